"""StreamTracker state machine, driven deterministically without sockets."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest

from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import (
    DUMP_REQUEST,
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    Delivery,
    EventBatch,
    GapDetected,
    GapFilled,
    MalformedFrame,
    PublisherRestarted,
    Received,
    ResyncDone,
    ResyncNeeded,
    ResyncStarted,
    StorageTier,
    StreamId,
    StreamTracker,
    WorkerId,
    encode_payload,
    pack_seq,
    unpack_seq,
)
from kvtier.wire.transport import recovery
from kvtier.wire.transport.backoff import Backoff
from kvtier.wire.transport.seqhistory import SeqHistory, digest
from kvtier.wire.transport.subscriber import EndpointConfig

S = StreamId(WorkerId("w"), 0)


def payload(tag: float) -> bytes:
    return encode_payload(EventBatch(ts=tag, events=[AllBlocksCleared()], dp_rank=0))


def seqs(out: list[Delivery]) -> list[int]:
    return [d.seq for d in out if isinstance(d, Received)]


def tracker(**kw: bool) -> StreamTracker:
    return StreamTracker(S, can_replay=kw.get("replay", True), can_dump=kw.get("dump", False),
                         timeout_s=1.0)


def test_in_order_delivery() -> None:
    t = tracker()
    out = [d for i in range(5) for d in t.on_live(i, payload(i), 0.0)]
    assert seqs(out) == [0, 1, 2, 3, 4] and t.expected == 5 and not t.outbox


def test_gap_is_filled_by_replay_and_held_messages_follow() -> None:
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    out = t.on_live(3, payload(3), 0.0)
    assert out == [GapDetected(S, 1, 3)]
    assert [unpack_seq(r) for r in t.outbox] == [1]
    t.outbox.clear()
    out = t.on_live(4, payload(4), 0.1)  # held while replaying
    assert out == []
    out = t.on_reply(pack_seq(1), payload(1), 0.2) + t.on_reply(pack_seq(2), payload(2), 0.2)
    out += t.on_reply(pack_seq(3), payload(3), 0.2) + t.on_reply(END_SEQ, b"", 0.3)
    assert seqs(out) == [1, 2, 3, 4]
    assert GapFilled(S, 1, 3) in out
    assert t.stats.gaps == 1 and t.stats.gaps_filled == 1


def test_late_joiner_replays_from_zero() -> None:
    t = tracker()
    assert t.on_live(7, payload(7), 0.0) == [GapDetected(S, 0, 7)]
    out = [d for s in range(8) for d in t.on_reply(pack_seq(s), payload(s), 0.1)]
    out += t.on_reply(END_SEQ, b"", 0.1)
    assert seqs(out) == list(range(8))


def test_short_replay_without_dump_marks_partial_and_continues_from_what_is_left() -> None:
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    t.on_live(5, payload(5), 0.0)
    # The buffer lost seqs 1..2: the answer starts at 3. What it holds is not thrown away.
    out = t.on_reply(pack_seq(3), payload(3), 0.1) + t.on_reply(pack_seq(4), payload(4), 0.1)
    out += t.on_reply(END_SEQ, b"", 0.1)
    assert isinstance(out[0], ResyncNeeded)
    assert seqs(out) == [3, 4, 5] and t.expected == 6 and not t.recovering
    assert t.expected == 6 and t.stats.resyncs == 1


def test_short_replay_with_dump_resynchronises() -> None:
    t = tracker(dump=True)
    t.on_live(0, payload(0), 0.0)
    t.on_live(5, payload(5), 0.0)
    t.outbox.clear()
    # The buffer no longer reaches back: the answer starts past the seq asked for.
    out = t.on_reply(pack_seq(4), payload(4), 0.1) + t.on_reply(END_SEQ, b"", 0.1)
    assert isinstance(out[0], ResyncStarted) and t.outbox == [DUMP_REQUEST]
    t.on_live(6, payload(6), 0.2)
    t.on_live(7, payload(7), 0.2)
    out = t.on_reply(pack_seq(6), payload(100), 0.3) + t.on_reply(END_SEQ, b"", 0.3)
    assert [(d.seq, d.source) for d in out if isinstance(d, Received)] == [(6, "dump"), (7, "live")]
    assert ResyncDone(S, 6) in out


def test_restart_and_duplicates() -> None:
    t = tracker()
    for i in range(3):
        t.on_live(i, payload(i), 0.0)
    assert t.on_live(1, payload(1), 0.0) == []  # exact duplicate
    assert t.stats.duplicates == 1
    # New content at seq 0 over the same connection: a new process, or a corrupt seq. The publisher is asked
    # whether it still holds batch 2: the new one holds nothing there, so it restarted; it is replayed from 0.
    out = t.on_live(0, payload(99), 0.0)
    assert out == [] and [unpack_seq(r) for r in t.outbox] == [2]
    out = _answer_honestly(t, {0: payload(99)}, 0.0)
    assert out[0] == PublisherRestarted(S, -1) and _contents(out) == [(0, 99.0)] and t.stats.restarts == 1
    # After a reconnect, a seq going back is a restart at once.
    t.on_disconnect()
    out = t.on_live(0, payload(42), 0.1)
    assert out[0] == PublisherRestarted(S, 0) and _contents(out) == [(0, 42.0)] and t.stats.restarts == 2


def test_replay_timeout_gives_up_and_resets_socket() -> None:
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    t.on_live(2, payload(2), 0.0)
    assert t.on_tick(0.5) == []
    t.outbox.clear()
    assert t.on_tick(1.5) == [] and t.on_tick(2.6) == []  # retried twice on fresh sockets
    assert [unpack_seq(r) for r in t.outbox] == [1] and t.reset_replay_socket  # (the first retry was never sent)
    out = t.on_tick(3.7)
    assert isinstance(out[0], ResyncNeeded) and seqs(out) == [2]
    assert t.reset_replay_socket
    assert t.on_reply(pack_seq(1), payload(1), 2.0) == []  # stale answer ignored


def test_no_replay_socket_marks_stale_at_once() -> None:
    t = tracker(replay=False)
    t.on_live(0, payload(0), 0.0)
    out = t.on_live(3, payload(3), 0.0)
    assert [type(d) for d in out] == [GapDetected, ResyncNeeded, Received]


def test_malformed_payload_is_counted_and_skipped() -> None:
    t = tracker()
    out = t.on_live(0, b"\x00\x01", 0.0) + t.on_live(1, payload(1), 0.0)
    assert isinstance(out[0], MalformedFrame) and seqs(out) == [1]
    assert t.stats.malformed == 1


def test_dump_with_no_answer_falls_back_to_partial() -> None:
    t = tracker(dump=True)
    t.on_live(0, payload(0), 0.0)
    t.on_live(3, payload(3), 0.0)
    for _ in range(t.attempts):  # empty answers: each is asked again, then seq 3 is set aside as doubtful
        assert not t.on_reply(END_SEQ, b"", 0.0)
    # The live batches go on past it, and a replay asked since still holds nothing: it was real, and the replay
    # keeps nothing: the stream needs a dump.
    assert isinstance(t.on_live(4, payload(4), 0.0)[0], GapDetected)
    for i in range(t.attempts):
        out = t.on_reply(END_SEQ, b"", 0.0)
        assert not out if i < t.attempts - 1 else isinstance(out[0], ResyncStarted)
    assert t.outbox[-1] == DUMP_REQUEST and t.stats.reasks == 2 * (t.attempts - 1)
    out = t.on_reply(END_SEQ, b"", 0.0)  # publisher answered the dump with nothing
    assert isinstance(out[0], ResyncNeeded) and seqs(out) == [3, 4]


def _answer_honestly(t: StreamTracker, buffer: dict[int, bytes], now: float, most: int = 100) -> list[Delivery]:
    """The publisher answers each replay request with every buffered batch from the seq asked, then the end marker,
    and a dump request with one batch at its last seq; past ``most`` requests the stream is taken to loop for ever."""
    out: list[Delivery] = []
    for _ in range(most):
        if not t.outbox:
            return out
        request = t.outbox.pop(0)
        t.reset_replay_socket = False
        if request == DUMP_REQUEST:
            out += t.on_reply(pack_seq(max(buffer)), payload(-2), now) + t.on_reply(END_SEQ, b"", now)
            continue
        start = unpack_seq(request)
        for q in sorted(q for q in buffer if q >= start):
            out += t.on_reply(pack_seq(q), buffer[q], now)
        out += t.on_reply(END_SEQ, b"", now)
    assert not t.outbox, f"still asking after {most} answers: {t.stats}"
    return out


def _answer_nothing(t: StreamTracker, now: float, step: float, *, until_given_up: bool = False
                    ) -> tuple[list[Delivery], float]:
    """Ticks every ``step`` s while nothing answers on the replay socket, until no recovery is under way (or, with
    ``until_given_up``, none and no seq expected): what was delivered meanwhile, and the time then."""
    out: list[Delivery] = []
    start = now
    while t.recovering or (until_given_up and t.expected is not None):
        now += step
        out += t.on_tick(now)
        t.outbox.clear()
        t.reset_replay_socket = False
        t._check()
        assert now < start + 100.0, "never given up"
    return out, now


@pytest.mark.parametrize("dump", [False, True])
def test_one_live_batch_with_a_corrupt_seq_does_not_wedge_the_stream(dump: bool) -> None:
    """One live frame of an honest publisher carries a corrupt seq far ahead (2**62). Its replay answers hold
    nothing past the last seq delivered, and its next live batches go on from there: the corrupt one is dropped and
    counted, and the batches after it are applied, with no loss reported (jumping to it would drop every later batch
    as a straggler of the seqs it skipped)."""
    t = tracker(dump=dump)
    buffer = {q: payload(q) for q in range(10)}
    out = [d for q in range(10) for d in t.on_live(q, buffer[q], 0.0)]
    out += t.on_live(2**62, payload(-1), 0.0) + _answer_honestly(t, buffer, 0.0)
    assert t.expected == 10 and not t.recovering
    for q in range(10, 40):
        buffer[q] = payload(q)
        out += t.on_live(q, buffer[q], 0.1 * q) + _answer_honestly(t, buffer, 0.1 * q)
        out += t.on_tick(0.1 * q) + _answer_honestly(t, buffer, 0.1 * q)
        t._check()
    assert seqs(out) == list(range(40)) and t.expected == 40
    assert not any(isinstance(d, ResyncNeeded | ResyncStarted) for d in out)
    assert [type(d) for d in out].count(MalformedFrame) == 1
    assert t.stats.bogus_seqs == 1 and t.stats.malformed == 1 and t.stats.late == 0 and t.stats.resyncs == 0


def _contents(out: list[Delivery]) -> list[tuple[int, float]]:
    """(seq, the tag of the payload delivered there) for each batch delivered."""
    return [(d.seq, d.batch.ts) for d in out if isinstance(d, Received)]


@pytest.mark.parametrize("dump", [False, True])
@pytest.mark.parametrize(("corrupt", "dropped"), [(11, []), (12, []), (12, [11, 12]), (2**62, [11])])
def test_a_corrupt_seq_on_a_published_batch_is_dropped_and_every_batch_delivered_once(
        dump: bool, corrupt: int, dropped: list[int]) -> None:
    """An honest publisher's batch 10 comes with a corrupt seq, near (11, 12) or far (2**62); then some live batches
    are lost on the wire. Its replay brings batch 10 back, so the corrupt frame repeats a batch delivered already: it
    is dropped as a corrupt seq, and the gap the lost batches leave is filled by a replay, with no loss reported and
    each batch delivered once, at its own seq. (Before, a near corrupt seq was delivered as the batch at that seq, and
    with the drops the gap was reported lost for good.)"""
    t = tracker(dump=dump)
    buffer = {q: payload(q) for q in range(10)}
    out = [d for q in range(10) for d in t.on_live(q, buffer[q], 0.0)]
    buffer[10] = payload(10)
    out += t.on_live(corrupt, buffer[10], 0.0) + _answer_honestly(t, buffer, 0.0)
    t._check()
    for q in range(11, 20):
        buffer[q] = payload(q)
        if q not in dropped:
            out += t.on_live(q, buffer[q], 0.1 * q) + _answer_honestly(t, buffer, 0.1 * q)
        t._check()
    assert _contents(out) == [(q, float(q)) for q in range(20)] and t.expected == 20
    assert not any(isinstance(d, ResyncNeeded | ResyncStarted | PublisherRestarted) for d in out)
    assert t.stats.bogus_seqs == 1 and t.stats.malformed == 1 and t.stats.resyncs == 0


def test_corrupt_seqs_twice_in_a_row_do_not_wedge_the_stream() -> None:
    """Two live frames in a row come with the same corrupt seq (2**62, a systematic bit pattern), each carrying a batch
    the publisher published. Neither is taken for the publisher's sequence (the second used to confirm the first,
    and the stream then dropped every later batch as a straggler of the seqs it skipped)."""
    t = tracker()
    buffer = {q: payload(q) for q in range(12)}
    out = [d for q in range(12) for d in t.on_live(q, buffer[q], 0.0)]
    for q in (12, 13):
        buffer[q] = payload(q)
        out += t.on_live(2**62, buffer[q], 0.0) + _answer_honestly(t, buffer, 0.0)
        t._check()
    for q in range(14, 20):
        buffer[q] = payload(q)
        out += t.on_live(q, buffer[q], 0.1 * q) + _answer_honestly(t, buffer, 0.1 * q)
    assert _contents(out) == [(q, float(q)) for q in range(20)] and t.expected == 20
    assert not any(isinstance(d, ResyncNeeded | ResyncStarted) for d in out) and t.stats.bogus_seqs == 2


def test_batches_set_aside_when_a_later_replay_delivers_are_settled_against_it() -> None:
    """Two frames the publisher's replay does not hold are set aside (fabricated: their payloads are no batch of
    its), the second at the same seq as the first: one of them is corrupt at once. Then the publisher publishes 10
    and 11, and a live batch past the set-aside seq comes: the replay asked then delivers 10 and 11, so the replay
    works and the batch kept aside is not the publisher's either; the next live batch, below it, drops it."""
    t = tracker()
    buffer = {q: payload(q) for q in range(10)}
    for q in range(10):
        t.on_live(q, buffer[q], 0.0)
    out = t.on_live(15, payload(-1), 0.0) + t.on_live(15, payload(-3), 0.0) + _answer_honestly(t, buffer, 0.0)
    assert t.stats.bogus_seqs == 1 and [q for q, _ in t._state.doubtful] == [15] and not t.recovering
    buffer |= {10: payload(10), 11: payload(11)}
    out += t.on_live(17, payload(-4), 0.1) + _answer_honestly(t, buffer, 0.1)
    t._check()
    assert seqs(out) == [10, 11] and [q for q, _ in t._state.doubtful] == [15, 17]
    buffer[12] = payload(12)
    out += t.on_live(12, buffer[12], 0.2)
    assert seqs(out) == [10, 11, 12] and not t._state.doubtful and t.stats.bogus_seqs == 3
    assert not any(isinstance(d, ResyncNeeded | ResyncStarted) for d in out)


def test_a_disconnect_while_set_aside_batches_are_settled_leaves_no_settle_behind() -> None:
    """A corrupt seq is set aside, and a live batch past it starts the replay that settles it; then the live socket
    drops (what was set aside goes with it) and another corrupt seq is held during the replay asked again. That replay
    is no longer settling anything: the new frame is set aside and dropped at the next live batch, and the stream goes
    on. (The settle purpose outlived the disconnect, so the empty answers were taken to confirm batches no longer set
    aside, and the stream jumped to the corrupt seq, dropping every later batch as a straggler of the seqs skipped.)"""
    t = tracker()
    buffer = {q: payload(q) for q in range(10)}
    out = [d for q in range(10) for d in t.on_live(q, buffer[q], 0.0)]
    out += t.on_live(15, payload(-1), 0.0) + _answer_honestly(t, buffer, 0.0)
    assert [q for q, _ in t._state.doubtful] == [15]
    out += t.on_live(17, payload(-4), 0.1)  # past it: the replay that settles it is asked
    t.on_disconnect()
    t._check()
    out += t.on_live(2**62, payload(-5), 0.2) + _answer_honestly(t, buffer, 0.2)
    t._check()
    assert t.expected == 10 and not t.recovering
    for q in range(10, 15):
        buffer[q] = payload(q)
        out += t.on_live(q, buffer[q], 0.3) + _answer_honestly(t, buffer, 0.3)
        t._check()
    assert _contents(out) == [(q, float(q)) for q in range(15)] and t.expected == 15
    assert not any(isinstance(d, ResyncNeeded | ResyncStarted | PublisherRestarted) for d in out)


@pytest.mark.parametrize("corrupt", [10, 11])
def test_a_held_corrupt_seq_the_replay_passed_does_not_restart_the_stream_for_ever(corrupt: int) -> None:
    """Batch 10 is lost on the wire, 11 opens the gap, and batch 12 comes with a corrupt seq below it (10 or 11) while
    the replay is pending. The replay delivers 10, 11 and 12: the held frame is below the seq expected with content
    other than what was delivered there, yet it repeats batch 12 byte for byte: a corrupt seq, dropped. (It was taken
    for a new process: a restart, a replay from 0 that held the frame again, and so on without end.)"""
    t = tracker()
    buffer = {q: payload(q) for q in range(10)}
    out = [d for q in range(10) for d in t.on_live(q, buffer[q], 0.0)]
    buffer |= {10: payload(10), 11: payload(11)}
    out += t.on_live(11, buffer[11], 0.1)
    buffer[12] = payload(12)
    out += t.on_live(corrupt, buffer[12], 0.1)
    for _ in range(5):
        out += _answer_honestly(t, buffer, 0.2)
        t._check()
    assert not t.recovering and t.expected == 13
    buffer[13] = payload(13)
    out += t.on_live(13, buffer[13], 0.3)
    assert _contents(out) == [(q, float(q)) for q in range(14)]
    assert not any(isinstance(d, PublisherRestarted | ResyncNeeded | ResyncStarted) for d in out)
    assert t.stats.bogus_seqs == 1 and t.stats.restarts == 0


def test_a_held_batch_never_replaces_the_replays_own_at_its_seq() -> None:
    """The publisher's buffer no longer holds 5 and 6 (a loss for good); its answer brings 7, 8 and 9, while a live
    frame with another payload was held at seq 9. What the stream goes on from at seq 9 is the publisher's batch
    from its replay, and the held frame is dropped as a corrupt seq: taking it, the real batch 9 would later look
    like a new process's."""
    t = tracker()
    buffer = {q: payload(q) for q in range(5)}
    out = [d for q in range(5) for d in t.on_live(q, buffer[q], 0.0)]
    buffer = {q: payload(q) for q in range(7, 10)}
    out += t.on_live(8, buffer[8], 0.1) + t.on_live(9, payload(-9), 0.1) + _answer_honestly(t, buffer, 0.1)
    t._check()
    assert sum(isinstance(d, ResyncNeeded) for d in out) == 1 and t.expected == 10
    out += t.on_live(9, buffer[9], 0.2) + t.on_live(10, payload(10), 0.2)
    assert _contents(out) == [(q, float(q)) for q in [*range(5), *range(7, 11)]]
    assert t.stats.bogus_seqs == 1 and t.stats.restarts == 0 and t.stats.duplicates == 1


def test_a_live_batch_below_the_seq_expected_is_checked_before_it_is_taken_for_a_restart() -> None:
    """Batch 20 comes with a corrupt seq below the seq expected (5), carrying content never delivered. No reconnect
    came, so the publisher is asked first whether it still holds the last batch delivered: it does (its replay from
    19 starts with batch 19 as delivered), so the frame is a corrupt seq, dropped, and batch 20 comes at its own
    seq. (It was taken for a new process at once: a restart, a replay from 0 that the publisher's buffer no longer
    reached, and the stream marked partial.)"""
    t = tracker()
    buffer = {q: payload(q) for q in range(20)}
    out = [d for q in range(20) for d in t.on_live(q, buffer[q], 0.0)]
    buffer = {q: payload(q) for q in range(16, 21)}  # the buffer holds the last five batches
    out += t.on_live(5, buffer[20], 0.1)
    assert [unpack_seq(r) for r in t.outbox] == [19]
    out += _answer_honestly(t, buffer, 0.1)
    t._check()
    assert not t.recovering and t.expected == 21
    assert _contents(out) == [(q, float(q)) for q in range(21)]
    assert not any(isinstance(d, PublisherRestarted | ResyncNeeded | ResyncStarted) for d in out)
    assert t.stats.bogus_seqs == 1 and t.stats.restarts == 0


@pytest.mark.parametrize("at", ["below", "expected"])
def test_a_live_batch_repeating_one_delivered_is_a_corrupt_seq_wherever_it_lands(at: str) -> None:
    """Batch 12 (or 13) comes with a corrupt seq after the replay of the gap it left delivered it: below the seq
    expected (10) or exactly at it (15). It repeats a delivered batch byte for byte: a corrupt seq, dropped, and the
    real batch at that seq is delivered. (Below, it was taken for a new process; at the seq expected it was delivered
    as batch 15, and the real batch 15 then looked like a new process.)"""
    t = tracker()
    buffer = {q: payload(q) for q in range(15)}
    out = [d for q in range(12) for d in t.on_live(q, buffer[q], 0.0)]
    out += t.on_live(13, buffer[13], 0.1) + t.on_live(14, buffer[14], 0.1) + _answer_honestly(t, buffer, 0.1)
    assert t.expected == 15 and not t.recovering
    out += t.on_live(10 if at == "below" else 15, buffer[12 if at == "below" else 13], 0.2)
    buffer[15] = payload(15)
    out += t.on_live(15, buffer[15], 0.3) + _answer_honestly(t, buffer, 0.3)
    t._check()
    assert _contents(out) == [(q, float(q)) for q in range(16)] and t.expected == 16
    assert not any(isinstance(d, PublisherRestarted | ResyncNeeded | ResyncStarted) for d in out)
    assert t.stats.bogus_seqs == 1 and t.stats.restarts == 0


def test_a_stream_given_up_never_goes_back_to_a_held_batch_below_the_seq_expected() -> None:
    """Seqs 5 and 6 are lost on the wire, and batch 8 comes with a corrupt seq below them (2) while their replay is
    pending; the publisher's buffer no longer holds 5: a loss for good. The stream goes on from the publisher's own
    batches past the loss (6, 7, 8), never from the held frame below the seq expected (it was delivered as seq 2,
    rewinding the stream)."""
    t = tracker()
    buffer = {q: payload(q) for q in range(5)}
    out = [d for q in range(5) for d in t.on_live(q, buffer[q], 0.0)]
    buffer = {q: payload(q) for q in range(6, 9)}
    out += t.on_live(7, buffer[7], 0.0) + t.on_live(2, buffer[8], 0.1) + _answer_honestly(t, buffer, 0.1)
    t._check()
    assert sum(isinstance(d, ResyncNeeded) for d in out) == 1 and t.expected == 9
    assert _contents(out) == [(q, float(q)) for q in [*range(5), 6, 7, 8]]
    assert t.stats.bogus_seqs == 1 and t.stats.restarts == 0


def test_a_stream_given_up_drops_a_held_batch_the_replay_holds_at_another_seq() -> None:
    """Seq 9 is lost on the wire; while its replay is pending, the real batch 11 and batch 17 with a corrupt seq 11
    are held. The publisher's buffer no longer holds 9 to 13 (a loss for good); its answer holds batch 17 at its own
    seq, so the held frame at seq 11 is a corrupt seq and the real batch 11 is the one the stream goes on from. (The
    later frame at seq 11 won: batch 17 was delivered as seq 11, and the real batch 11 dropped.)"""
    t = tracker()
    buffer = {q: payload(q) for q in range(9)}
    out = [d for q in range(9) for d in t.on_live(q, buffer[q], 0.0)]
    out += t.on_live(10, payload(10), 0.0) + t.on_live(11, payload(11), 0.1) + t.on_live(11, payload(17), 0.2)
    buffer = {q: payload(q) for q in range(14, 18)}
    out += _answer_honestly(t, buffer, 0.3)
    t._check()
    assert sum(isinstance(d, ResyncNeeded) for d in out) == 2  # (9, then 12 and 13: never received)
    assert _contents(out) == [(q, float(q)) for q in [*range(9), 10, 11, *range(14, 18)]]
    assert t.stats.bogus_seqs == 1 and t.stats.restarts == 0


def test_a_late_copy_of_a_batch_delivered_before_a_dump_is_no_restart() -> None:
    """Batch 1 is reordered behind batch 2 on the wire: the gap's replay delivers 1 while the live copy is held; the
    rest of the answer stalls, and asked again the publisher's buffer no longer holds 2: a dump. The held copy of
    batch 1, delivered before the dump, is drained after it: a straggler, not a new process (it was taken for one:
    a restart, and the whole stream replayed from 0)."""
    t = tracker(dump=True)
    out = t.on_live(0, payload(0), 0.0) + t.on_live(2, payload(2), 0.0) + t.on_live(1, payload(1), 0.1)
    out += t.on_reply(pack_seq(1), payload(1), 0.1) + t.on_tick(0.7)
    out += t.on_reply(pack_seq(3), payload(3), 0.8) + t.on_reply(END_SEQ, b"", 0.8)
    assert t.outbox[-1] == DUMP_REQUEST
    out += t.on_reply(pack_seq(3), payload(-3), 0.9) + t.on_reply(END_SEQ, b"", 0.9)
    out += t.on_live(1, payload(1), 1.0)  # another late copy, after the dump
    t._check()
    assert ResyncDone(S, 3) in out and t.expected == 4 and not t.recovering
    assert not any(isinstance(d, PublisherRestarted) for d in out) and t.stats.restarts == 0
    assert seqs(t.on_live(4, payload(4), 1.1)) == [4]


def test_a_straggler_of_an_earlier_dump_is_no_restart_after_the_next_dump() -> None:
    """Two dumps in a row (each after a loss the publisher's buffer no longer reached); a late live copy of a batch
    the first dump stood for arrives after the second. The second dump stands for it too: a straggler, counted late
    (the second dump's range replaced the first's, so it was taken for a new process's batch)."""
    t = tracker(dump=True)
    t.on_live(0, payload(0), 0.0)
    out = t.on_live(3, payload(3), 0.0) + t.on_reply(pack_seq(3), payload(3), 0.0) + t.on_reply(END_SEQ, b"", 0.0)
    out += t.on_reply(pack_seq(5), payload(-5), 0.1) + t.on_reply(END_SEQ, b"", 0.1)
    assert ResyncDone(S, 5) in out and t.expected == 6
    out = t.on_live(8, payload(8), 10.0) + t.on_reply(pack_seq(7), payload(7), 10.0)
    out += t.on_reply(END_SEQ, b"", 10.0) + t.on_reply(pack_seq(9), payload(-9), 10.1) + t.on_reply(END_SEQ, b"", 10.1)
    assert ResyncDone(S, 9) in out and t.expected == 10 and not t.recovering
    t.outbox.clear()
    assert t.on_live(4, payload(4), 10.2) == [] and t.on_live(1, payload(1), 10.2) == [] and not t.outbox
    assert t.stats.late == 2 and t.stats.restarts == 0
    assert seqs(t.on_live(10, payload(10), 10.3)) == [10]


def test_a_stream_given_up_after_a_reconnect_never_continues_from_the_old_connections_answer() -> None:
    """A gap's replay answer starts past the seq asked (a loss for good) and brings 6 and 7, then the connection
    drops and the publisher restarts: the check asked again goes unanswered, while the new process's 0 and 1 are
    held. The stream given up goes on from the new process's batches only; the old answer's (6, 7) said nothing
    of it (they were continued from, mixing two processes' batches)."""
    t = tracker()
    out = [d for q in range(5) for d in t.on_live(q, payload(q), 0.0)]
    out += t.on_live(7, payload(7), 0.0) + t.on_reply(pack_seq(6), payload(6), 0.0)
    out += t.on_reply(pack_seq(7), payload(7), 0.0)
    t.on_disconnect()
    out += t.on_live(0, payload(100), 0.1) + t.on_live(1, payload(101), 0.1)
    out += _answer_nothing(t, 0.1, 0.5)[0]
    given_up = next(i for i, d in enumerate(out) if isinstance(d, ResyncNeeded))
    assert _contents(out[given_up:]) == [(0, 100.0), (1, 101.0)] and t.expected == 2


def test_a_batch_below_a_resumed_position_held_through_its_check_is_a_new_process() -> None:
    """A router resumed from a snapshot (position 3) is on a new connection, over which a PUB socket sends new
    batches only: a batch below the position, no duplicate or straggler, held through the resume's check, is a new
    process's even when the check passes (the new process's seq 2 repeats the old one's byte for byte, its clock
    stamping alike), as after a reconnect; it was checked again as a corrupt seq would be, and dropped."""
    t = tracker()
    t.resume((3, digest(payload(2))), 0.0)
    assert [unpack_seq(r) for r in t.outbox] == [2]
    out = t.on_live(0, payload(100), 0.1)
    out += _answer_honestly(t, {0: payload(100), 1: payload(101), 2: payload(2)}, 0.1)
    t._check()
    assert PublisherRestarted(S, 0) in out and t.stats.bogus_seqs == 0
    assert _contents(out) == [(0, 100.0)] and t.expected == 1


def test_a_restart_seen_by_its_seqs_alone_after_a_dump_is_not_taken_for_stragglers() -> None:
    """A dump stood for seqs 10 to 15; then the publisher restarts and no disconnect is seen (a proxy between, a
    monitor event lost): the new process's batches from seq 0 come with content the stream never delivered there. It
    is checked, not dropped as stragglers of the dump (the range a dump stood for once reached back to every seq
    delivered before it, so the new process's batches up to 15 were dropped unseen and 16 on continued the old
    process's stream)."""
    t = tracker(dump=True)
    out = [d for q in range(10) for d in t.on_live(q, payload(q), 0.0)]
    out += t.on_live(12, payload(12), 0.1) + t.on_reply(pack_seq(13), payload(13), 0.1) + t.on_reply(END_SEQ, b"", 0.1)
    out += t.on_reply(pack_seq(15), payload(-15), 0.2) + t.on_reply(END_SEQ, b"", 0.2)
    assert ResyncDone(S, 15) in out and t.expected == 16
    t.outbox.clear()
    out = t.on_live(0, payload(100), 1.0)
    assert out == [] and [unpack_seq(r) for r in t.outbox] == [15] and t.stats.late == 0
    out += _answer_honestly(t, {0: payload(100)}, 1.1)  # (the dump's seq has no batch to compare with)
    assert isinstance(out[0], ResyncStarted) and _contents(out) == [(0, 100.0)] and t.stats.restarts == 0


def test_a_check_for_a_seq_going_back_that_is_never_answered_is_a_restart() -> None:
    """A restart no disconnect told of: the new process's batches come below the seq expected and the check its first
    one starts is never answered (its replay socket not up yet). After the check's tries the publisher is taken for
    a new process, as when its answer comes back empty (it was given up as a loss, and the new process's batches
    dropped as corrupt seqs). Once even the replay from 0 goes unanswered, the batches at hand are delivered."""
    t = tracker()
    for q in range(17):
        t.on_live(q, payload(q), 0.0)
    out = [d for q in range(6) for d in t.on_live(q, payload(100 + q), 0.1 + q / 100)]
    out += _answer_nothing(t, 0.2, 1.1)[0]
    assert out[0] == PublisherRestarted(S, -1) and t.stats.bogus_seqs == 0
    assert _contents(out) == [(q, 100.0 + q) for q in range(6)] and t.expected == 6


def test_held_batches_of_the_old_process_go_when_a_check_finds_a_new_one() -> None:
    """Batch 10 is lost and 11, 12 held through its replay; the old process dies and a new one (no disconnect seen)
    sends its 0 and 1, held too. The replay and the check that follow find the new process: it is replayed from 0,
    and the old process's held 11 and 12 go with the old process (they were held on through the new one's replay and
    delivered as its batches 11 and 12, and the real ones then looked like yet another process)."""
    t = tracker()
    for q in range(10):
        t.on_live(q, payload(q), 0.0)
    t.outbox.clear()
    out = t.on_live(11, payload(11), 0.1) + t.on_live(12, payload(12), 0.1)
    out += t.on_live(0, payload(100), 0.2) + t.on_live(1, payload(101), 0.2)
    out += t.on_reply(END_SEQ, b"", 0.3)  # the new process holds nothing at 10
    while t.outbox and unpack_seq(t.outbox[-1]) != 0:  # (the check: nothing at 9 either)
        t.outbox.clear()
        out += t.on_reply(END_SEQ, b"", 0.3)
    assert any(isinstance(d, PublisherRestarted) for d in out)
    t.outbox.clear()
    out += t.on_reply(pack_seq(0), payload(100), 0.4) + t.on_reply(pack_seq(1), payload(101), 0.4)
    out += t.on_reply(END_SEQ, b"", 0.4)
    for q in range(2, 11):  # live while whatever the stream asked is pending
        out += t.on_live(q, payload(100 + q), 0.5)
    for r in list(t.outbox):
        t.outbox.remove(r)
        out += [d for q in range(unpack_seq(r), 11) for d in t.on_reply(pack_seq(q), payload(100 + q), 0.6)]
        out += t.on_reply(END_SEQ, b"", 0.6)
    out += t.on_live(11, payload(111), 0.7) + t.on_live(12, payload(112), 0.7)
    t._check()
    after = max(i for i, d in enumerate(out) if isinstance(d, PublisherRestarted))
    assert _contents(out[after:]) == [(q, 100.0 + q) for q in range(13)] and t.expected == 13
    assert t.stats.restarts == 1


def test_a_seq_going_back_right_after_a_dump_is_never_continued_from() -> None:
    """Right after a dump, batch 13 comes with a corrupt seq below the seq expected (5). The dump's seq has no batch
    to check the publisher against, so the stream is resynchronised from 0; the publisher's buffer no longer reaches
    0 and the backoff defers a second dump, so the stream goes on from what the replay holds past the loss, never
    from the frame whose seq went back (batch 13 was delivered as seq 5, and the stream went on from there)."""
    t = tracker(dump=True)
    buffer = {q: payload(q) for q in range(10)}
    out = [d for q in range(10) for d in t.on_live(q, buffer[q], 0.0)]
    buffer = {q: payload(q) for q in range(11, 13)}
    out += t.on_live(12, buffer[12], 0.1) + _answer_honestly(t, buffer, 0.1)
    assert ResyncDone(S, 12) in out and t.expected == 13
    buffer[13] = payload(13)
    out = t.on_live(5, buffer[13], 0.2)
    assert [unpack_seq(r) for r in t.outbox] == [12]
    t.outbox.clear()
    out += t.on_reply(pack_seq(12), buffer[12], 0.2) + t.on_reply(END_SEQ, b"", 0.2)
    assert isinstance(out[0], ResyncStarted) and [unpack_seq(r) for r in t.outbox] == [0]
    t.outbox.clear()  # the replay from 0 answers from 11 on, its last frame dropped
    out += t.on_reply(pack_seq(11), buffer[11], 0.3) + t.on_reply(pack_seq(12), buffer[12], 0.3)
    out += t.on_reply(END_SEQ, b"", 0.3)
    t._check()
    after = max(i for i, d in enumerate(out) if isinstance(d, ResyncNeeded))
    assert _contents(out[after:]) == [(11, 11.0), (12, 12.0)] and t.expected == 13


def test_a_disconnect_before_anything_was_delivered_leaves_no_restart_mark_behind() -> None:
    """The live socket reconnects before the first batch: nothing was delivered, so nothing is checked. Batches then
    go on in order over that connection, and batch 10 comes with a corrupt seq below (3): it is checked like any
    seq going back over the same connection (the reconnect's mark stayed, with no check to end it, and the frame was
    taken for a restart)."""
    t = tracker()
    t.on_disconnect()
    for q in range(10):
        t.on_live(q, payload(q), 0.1)
    t.outbox.clear()
    out = t.on_live(3, payload(10), 0.2)
    assert out == [] and [unpack_seq(r) for r in t.outbox] == [9]
    out += _answer_honestly(t, {q: payload(q) for q in range(11)}, 0.2)
    assert _contents(out) == [(10, 10.0)] and t.stats.restarts == 0 and t.stats.bogus_seqs == 1


def test_batches_set_aside_cost_bounded_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Live batches held through a long replay whose answers hold nothing are set aside at most
    :data:`MAX_HELD_BYTES` of them (the highest seqs past it go as corrupt), and a replay under way counts them with
    what it holds, from its first batch."""
    entry = len(payload(0)) + recovery.HELD_ENTRY_BYTES
    monkeypatch.setattr(recovery, "MAX_HELD_BYTES", 60 * entry)
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    for q in range(5, 55):  # held while the gap's replay is pending
        t.on_live(q, payload(q), 0.0)
    monkeypatch.setattr(recovery, "MAX_HELD_BYTES", 20 * entry)  # (a bound the 50 held pass only once set aside)
    _answer_honestly(t, {0: payload(0)}, 0.0)
    t._check()
    aside = t._state.doubtful
    assert [q for q, _ in aside] == list(range(5, 25)) and t.stats.bogus_seqs == 30
    assert recovery._bytes(aside) <= recovery.MAX_HELD_BYTES
    # The next live batch starts a replay to settle them; the batches set aside fill the bound, so the live batch
    # held next passes it: given up.
    out = [d for q in range(60, 63) for d in t.on_live(q, payload(q), 0.1)]
    t._check()
    assert isinstance(out[-1], Received) and any(isinstance(d, ResyncNeeded) for d in out)
    assert not t._state.doubtful and not t.recovering and t.stats.resyncs == 1 and t.expected == 63


def test_batches_the_replay_does_not_hold_are_real_if_the_live_ones_go_on_past_them() -> None:
    """A publisher whose replay keeps nothing: the batches past the gap are set aside, not dropped; the next live
    batch follows them, and a replay asked then still holds nothing: they were real, the gap is a loss for good (the
    stream marked partial) and they are delivered, then the new one. A restart meanwhile drops them unseen."""
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    out = t.on_live(5, payload(5), 0.0) + _answer_honestly(t, {}, 0.0)
    assert seqs(out) == [] and t.expected == 1 and not t.recovering
    out = t.on_live(6, payload(6), 0.1)
    assert [type(d) for d in out] == [GapDetected] and t.recovering
    out = _answer_honestly(t, {}, 0.1)
    assert isinstance(out[0], ResyncNeeded) and seqs(out) == [5, 6] and t.expected == 7
    assert t.stats.bogus_seqs == 0 and t.stats.resyncs == 1
    assert t.on_live(3, payload(3), 0.2) == [] and t.stats.late == 1  # (a straggler of the loss)

    r = tracker()
    r.on_live(0, payload(0), 0.0)
    r.on_live(5, payload(5), 0.0)
    _answer_honestly(r, {}, 0.0)
    out = r.on_live(0, payload(100), 0.1)  # a new process: checked, it holds other content at seq 0
    out += _answer_honestly(r, {0: payload(100)}, 0.1)
    assert isinstance(out[0], PublisherRestarted) and seqs(out) == [0] and r.stats.bogus_seqs == 0
    assert seqs(r.on_live(1, payload(101), 0.2)) == [1]


def test_batches_set_aside_again_join_those_set_aside_before() -> None:
    """A publisher whose replay keeps nothing: batch 5 is set aside, an idle probe starts, live batch 6 is held during
    it and the probe comes back empty too: 6 joins 5 (5 was dropped unseen when the second set replaced the first),
    and the next live batch delivers both after the loss."""
    t = tracker()
    out = t.on_live(0, payload(0), 0.0)
    out += t.on_live(5, payload(5), 0.0) + _answer_honestly(t, {}, 0.0)
    out += t.on_tick(1.5)  # quiet past probe_s: a probe from seq 1
    out += t.on_live(6, payload(6), 1.6) + _answer_honestly(t, {}, 1.6)
    t._check()
    out += t.on_live(7, payload(7), 1.7) + _answer_honestly(t, {}, 1.7)
    assert seqs(out) == [0, 5, 6, 7] and sum(isinstance(d, ResyncNeeded) for d in out) == 1
    t._check()


def test_a_stream_given_up_drops_the_batches_it_had_set_aside() -> None:
    """A corrupt seq set aside, then a resync while the replay socket is unresponsive: the replay and the dump time
    out and the stream is given up with nothing held (no seq expected). What was set aside goes with it; the next
    live batch starts the stream again rather than failing an assertion (which ended the service's event loop)."""
    t = tracker(dump=True)
    buffer = {q: payload(q) for q in range(10)}
    for q in range(10):
        t.on_live(q, buffer[q], 0.0)
    t.on_live(2**62, payload(-1), 0.0)
    _answer_honestly(t, buffer, 0.0)
    t.request_resync("consumer inconsistent", 100.0)
    now = _answer_nothing(t, 100.0, 0.5, until_given_up=True)[1]
    out = t.on_live(10, payload(10), now) + _answer_honestly(t, {**buffer, 10: payload(10)}, now)
    t._check()
    assert seqs(out)[-1] == 10 and t.expected == 11 and t.stats.bogus_seqs == 0


def test_a_dump_asked_again_after_it_stalled_starts_over() -> None:
    """A dump answer that stalls part-way is asked again; the new answer reflects a later state, so the consumer
    drops the part it applied (a block the engine has evicted since would otherwise stay indexed) and live
    delivery resumes after the new dump's seq, not the first's."""
    t = tracker(dump=True)
    t.on_live(0, payload(0), 0.0)
    assert isinstance(t.request_resync("unknown parent", 0.0)[0], ResyncStarted)  # a replay from 0
    t.outbox.clear()
    assert t.on_reply(pack_seq(5), payload(5), 0.0) == []  # the answer starts past 0: lost for good
    assert isinstance(t.on_reply(END_SEQ, b"", 0.0)[0], ResyncStarted)  # so a dump
    assert t.outbox == [DUMP_REQUEST]
    t.outbox.clear()
    assert seqs(t.on_reply(pack_seq(5), payload(50), 0.1)) == [5]  # the dump's first batch, then silence
    for seq in (6, 7, 8):
        assert t.on_live(seq, payload(seq), 0.2) == []  # held while the dump is pending
    assert t.on_tick(1.2) == [] and t.outbox == [DUMP_REQUEST]  # stalled past the timeout: asked again
    out = t.on_reply(pack_seq(7), payload(70), 1.3)  # the new answer covers seqs up to 7
    assert [type(d) for d in out] == [ResyncStarted, Received] and seqs(out) == [7]
    out = t.on_reply(END_SEQ, b"", 1.3)
    assert isinstance(out[0], ResyncDone) and out[0].seq == 7 and seqs(out) == [8] and t.expected == 9
    assert t.stats.resyncs == 2  # the consumer's resync and the dump: asking the dump again is not another


def test_a_dump_asked_again_after_a_reconnect_starts_over() -> None:
    """The live socket drops mid-dump of a stream resynchronised from seq 0 (so no check of the publisher
    follows the reconnect): the new answer must still replace the part of the first one applied."""
    t = tracker(dump=True)
    t.on_live(0, payload(0), 0.0)
    t.request_resync("unknown parent", 0.0)
    t.on_reply(pack_seq(5), payload(5), 0.0)
    assert isinstance(t.on_reply(END_SEQ, b"", 0.0)[0], ResyncStarted)  # the replay from 0 fell short: a dump
    assert seqs(t.on_reply(pack_seq(5), payload(50), 0.1)) == [5]
    t.outbox.clear()
    t.on_disconnect()
    assert t.outbox == [DUMP_REQUEST]
    out = t.on_reply(pack_seq(7), payload(70), 0.2)
    assert [type(d) for d in out] == [ResyncStarted, Received]
    assert isinstance(t.on_reply(END_SEQ, b"", 0.2)[0], ResyncDone) and seqs(t.on_live(8, payload(8), 0.3)) == [8]


def test_reconnect_to_same_publisher_is_verified_and_continues() -> None:
    t = tracker()
    for i in range(3):
        t.on_live(i, payload(i), 0.0)
    t.on_disconnect()
    assert t.on_live(3, payload(3), 0.1) == []  # held until the check answers
    assert [unpack_seq(r) for r in t.outbox] == [2]
    out = t.on_reply(pack_seq(2), payload(2), 0.2) + t.on_reply(pack_seq(3), payload(3), 0.2)
    out += t.on_reply(END_SEQ, b"", 0.2)
    assert seqs(out) == [3] and t.stats.restarts == 0


def test_restart_hidden_behind_reconnect_is_detected() -> None:
    """A new publisher whose seqs 0..2 were lost while reconnecting looks seamless by seq alone."""
    t = tracker()
    for i in range(3):
        t.on_live(i, payload(i), 0.0)
    t.on_disconnect()
    t.on_live(3, payload(103), 0.1)
    t.outbox.clear()
    out = t.on_reply(pack_seq(2), payload(102), 0.2)  # different content at seq 2
    out += t.on_reply(pack_seq(3), payload(103), 0.2) + t.on_reply(END_SEQ, b"", 0.2)
    assert isinstance(out[0], PublisherRestarted)
    assert [unpack_seq(r) for r in t.outbox] == [0]  # replays the new publisher from its start
    out = [d for s in range(4) for d in t.on_reply(pack_seq(s), payload(100 + s), 0.3)]
    out += t.on_reply(END_SEQ, b"", 0.3)
    assert [int(d.batch.ts) for d in out if isinstance(d, Received)] == [100, 101, 102, 103]


def test_consumer_requested_resync_replays_from_zero() -> None:
    t = tracker()
    for i in range(4):
        t.on_live(i, payload(i), 0.0)
    out = t.request_resync("unknown parent", 0.1)
    assert isinstance(out[0], ResyncStarted) and [unpack_seq(r) for r in t.outbox] == [0]
    out = [d for s in range(4) for d in t.on_reply(pack_seq(s), payload(s), 0.2)]
    out += t.on_reply(END_SEQ, b"", 0.2)
    assert seqs(out) == [0, 1, 2, 3] and t.expected == 4


def test_consumer_requested_resync_falls_back_to_dump() -> None:
    t = tracker(dump=True)
    for i in range(4):
        t.on_live(i, payload(i), 0.0)
    t.request_resync("unknown parent", 0.1)
    t.outbox.clear()
    out = t.on_reply(pack_seq(2), payload(2), 0.2) + t.on_reply(END_SEQ, b"", 0.2)  # 0..1 gone
    assert isinstance(out[-1], ResyncStarted) and t.outbox == [DUMP_REQUEST]


def test_join_catches_up_from_zero_before_any_live_message() -> None:
    t = tracker()
    t.start(0.0)
    assert [unpack_seq(r) for r in t.outbox] == [0]
    t.outbox.clear()
    assert t.on_live(3, payload(3), 0.1) == []  # held during the catch-up
    out = [d for s in range(3) for d in t.on_reply(pack_seq(s), payload(s), 0.2)]
    out += t.on_reply(END_SEQ, b"", 0.2)
    assert seqs(out) == [0, 1, 2, 3]


def test_join_on_a_quiet_publisher() -> None:
    t = tracker()
    t.start(0.0)
    assert t.on_reply(END_SEQ, b"", 0.1) == [] and t.expected == 0
    assert seqs(t.on_live(0, payload(0), 0.2)) == [0]


def test_quiet_stream_probe_recovers_a_lost_last_batch() -> None:
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    # seq 1 was lost on the wire and nothing follows it.
    assert t.on_tick(0.5) == [] and not t.outbox
    assert t.on_tick(1.2) == [] and [unpack_seq(r) for r in t.outbox] == [1]
    out = t.on_reply(pack_seq(1), payload(1), 1.3) + t.on_reply(END_SEQ, b"", 1.3)
    assert seqs(out) == [1] and t.expected == 2
    t.outbox.clear()
    t.on_tick(2.4)
    assert t.on_reply(END_SEQ, b"", 2.5) == [] and t.expected == 2  # nothing new: stays quiet


def test_restart_during_catch_up_drops_what_the_old_publisher_sent() -> None:
    t = tracker()
    t.start(0.0)
    t.outbox.clear()  # the catch-up request's answer is lost
    t.on_live(0, payload(0), 0.1)  # held: the catch-up is still pending
    t.on_live(1, payload(1), 0.1)
    t.on_disconnect()  # the publisher process died and a new one took its port
    assert [unpack_seq(r) for r in t.outbox] == [0] and t.reset_replay_socket  # asked again at once
    out = t.on_reply(END_SEQ, b"", 0.2)  # the new publisher has published nothing
    assert seqs(out) == [] and t.expected == 0
    assert seqs(t.on_live(0, payload(100), 0.3)) == [0]


def test_restart_during_a_replay_that_delivered_is_checked_before_its_answer_is_trusted() -> None:
    """The catch-up delivered seq 0 of the old publisher, then its answer stalled; the publisher restarted. The
    new one's seqs 0 and 1 must not be taken for the continuation: its seq 0 would be skipped as delivered, and
    the index would lack a block the engine holds."""
    t = tracker()
    t.start(0.0)
    t.outbox.clear()
    assert seqs(t.on_reply(pack_seq(0), payload(0), 0.1)) == [0]  # the old publisher's seq 0; no end marker
    t.on_disconnect()  # it died and a new one took its port
    assert [unpack_seq(r) for r in t.outbox] == [0]  # asked again from the last seq delivered: a check
    t.outbox.clear()
    # That answer is lost too; the retry after the timeout is a check as well.
    assert t.on_tick(1.2) == [] and [unpack_seq(r) for r in t.outbox] == [0]
    out = t.on_reply(pack_seq(0), payload(100), 1.3) + t.on_reply(pack_seq(1), payload(101), 1.3)
    out += t.on_reply(END_SEQ, b"", 1.3)
    assert isinstance(out[0], PublisherRestarted) and seqs(out) == []
    assert [unpack_seq(r) for r in t.outbox] == [0, 0]  # then the new publisher from its start
    out = t.on_reply(pack_seq(0), payload(100), 1.4) + t.on_reply(pack_seq(1), payload(101), 1.4)
    out += t.on_reply(END_SEQ, b"", 1.4)
    assert [int(d.batch.ts) for d in out if isinstance(d, Received)] == [100, 101] and t.expected == 2


def test_reconnect_during_a_replay_to_the_same_publisher_continues_it() -> None:
    """The check a reconnect puts on a pending replay passes for the same publisher: no restart, no replay from 0."""
    t = tracker()
    t.start(0.0)
    t.outbox.clear()
    t.on_reply(pack_seq(0), payload(0), 0.1)
    t.on_disconnect()
    out = t.on_reply(pack_seq(0), payload(0), 0.2) + t.on_reply(pack_seq(1), payload(1), 0.2)
    out += t.on_reply(END_SEQ, b"", 0.2)
    assert seqs(out) == [1] and t.expected == 2 and t.stats.restarts == 0
    assert [unpack_seq(r) for r in t.outbox] == [0]  # the check was the only request


def test_stragglers_of_any_earlier_loss_are_not_taken_for_a_restart() -> None:
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    for answer_from, late in ((3, 5), (8, 10)):  # two losses for good: seqs 1-2, then 6-7
        t.on_live(late, payload(late), 0.0)  # reveals the gap; replay from `lost_from` asked
        out = [d for s in range(answer_from, late) for d in t.on_reply(pack_seq(s), payload(s), 0.1)]
        out += t.on_reply(END_SEQ, b"", 0.1)
        assert isinstance(out[0], ResyncNeeded) and seqs(out) == list(range(answer_from, late + 1))
    # The lost batches turn up late (they were only delayed): dropped, not a "new publisher".
    for s in (1, 2, 6, 7):
        assert t.on_live(s, payload(s), 0.2) == []
    assert t.stats.late == 4 and t.stats.restarts == 0 and t.expected == 11


def test_a_flood_of_malformed_batches_is_counted_but_logged_sparingly(caplog: pytest.LogCaptureFixture) -> None:
    t = tracker()
    with caplog.at_level(logging.WARNING, logger="kvtier.wire.transport.stream"):
        for i in range(3000):  # (each batch other bytes: one repeating another would be a corrupt seq)
            t.on_live(i, b"\xc1 not msgpack %d" % i, 0.0)
    assert t.stats.malformed == 3000 and t.expected == 3000
    assert len(caplog.records) == 10 + 3  # the first ten, then the 1000th, 2000th and 3000th
    assert "every 1000th" in caplog.records[9].getMessage()


@pytest.mark.parametrize("path", ["live", "replay"])
def test_a_batch_that_does_not_decode_is_a_loss_for_good(path: str) -> None:
    """A batch in order that fails to decode (one ill-typed field throws the whole batch) used up its seq: its events,
    a removal perhaps, are lost for good (the publisher sends the same bytes again). The stream is marked partial
    (resynchronised by a dump where it has one), never left claiming what the lost batch removed; the seqs after it
    follow on."""
    bad = b"\xc1 not msgpack"
    t = tracker()
    out = t.on_live(0, payload(0), 0.0)
    if path == "live":
        out += t.on_live(1, bad, 0.0)
    else:  # seq 1 is missed live; the replay of the gap delivers it
        out += t.on_live(2, payload(2), 0.0)
        assert t.outbox == [pack_seq(1)] and not any(isinstance(d, ResyncNeeded) for d in out)
        out += t.on_reply(pack_seq(1), bad, 0.1) + t.on_reply(pack_seq(2), payload(2), 0.1)
        out += t.on_reply(END_SEQ, b"", 0.1)
    out += t.on_live(3 if path == "replay" else 2, payload(3), 0.2)
    kinds = [type(d).__name__ for d in out]
    assert kinds.count("MalformedFrame") == 1 and kinds.count("ResyncNeeded") == 1, kinds
    assert kinds.index("ResyncNeeded") > kinds.index("MalformedFrame")
    assert seqs(out) == ([0, 2, 3] if path == "replay" else [0, 2]) and not t.recovering
    d = tracker(dump=True)
    out = d.on_live(0, payload(0), 0.0) + d.on_live(1, bad, 0.0)
    assert isinstance(out[-1], ResyncStarted) and d.outbox == [DUMP_REQUEST]


def test_a_check_that_timed_out_does_not_make_the_next_probe_a_check() -> None:
    """The replay that checks a reconnected publisher went unanswered and was given up; the idle probe that
    follows asks from ``expected``, and its first batch is not the last one delivered: no restart."""
    t = tracker()
    for i in range(3):
        t.on_live(i, payload(i), 0.0)
    t.on_disconnect()
    t.on_live(3, payload(3), 0.1)  # the check is asked (from seq 2); 3 is held
    now = 0.1
    while not any(isinstance(d, ResyncNeeded) for d in t.on_tick(now)):  # no answer, ever
        now += 1.1
        assert now < 10, "the check never timed out"
    assert t.expected == 4 and not t.recovering  # gave up: continued from the held batch
    t.outbox.clear()
    t.on_tick(now + 1.5)  # quiet: the probe asks for seq 4 on
    assert [unpack_seq(r) for r in t.outbox] == [4]
    out = t.on_reply(pack_seq(4), payload(4), now + 1.6) + t.on_reply(END_SEQ, b"", now + 1.6)
    assert seqs(out) == [4] and t.stats.restarts == 0


def test_resyncs_that_keep_coming_wait_longer_and_a_quiet_spell_starts_over() -> None:
    b = Backoff(base_s=1.0, max_s=4.0)
    allowed = [now for now in (0.0, 0.5, 1.0, 2.0, 3.0, 5.0, 9.0, 12.0, 13.0) if b.allow(now)]
    assert allowed == [0.0, 1.0, 3.0, 9.0, 13.0]  # intervals 1, 2, 4, then capped at 4
    assert b.interval == 4.0 and b.next_at == 17.0
    assert b.allow(40.0) and b.interval == 1.0  # quiet for more than four intervals


def test_a_resync_asked_inside_the_backoff_is_deferred_then_dumped() -> None:
    t = StreamTracker(S, can_replay=True, can_dump=True, timeout_s=1.0, probe_s=None, resync_backoff_s=2.0)
    t.on_live(0, payload(0), 0.0)
    assert isinstance(t.request_resync("unknown parent", 0.0)[0], ResyncStarted)  # a replay from 0 at once
    out = t.on_reply(pack_seq(0), payload(0), 0.1) + t.on_reply(END_SEQ, b"", 0.1)
    assert seqs(out) == [0] and not t.recovering
    t.outbox.clear()
    assert t.request_resync("unknown parent again", 0.5) == [] and not t.outbox  # within 2 s: deferred
    assert t.stats.resyncs_deferred == 1 and t.next_tick() == 2.0 and t.needs_tick
    assert t.on_tick(1.9) == [] and not t.outbox
    out = t.on_tick(2.0)
    assert isinstance(out[0], ResyncStarted) and t.outbox == [DUMP_REQUEST] and t.recovering


def test_a_resync_of_a_stream_without_replay_counts_once() -> None:
    """The consumer's resync of a stream with no replay socket marks it partial: one resync, one notice (the
    request and the partial mark it leads to are not counted apart)."""
    t = tracker(replay=False)
    t.on_live(0, payload(0), 0.0)
    out = t.request_resync("unknown parent", 0.0)
    assert [type(d) for d in out] == [ResyncNeeded] and t.stats.resyncs == 1


def test_a_dump_needs_the_replay_socket_it_is_asked_on() -> None:
    with pytest.raises(ValueError, match="replay"):
        StreamTracker(S, can_replay=False, can_dump=True)
    with pytest.raises(ValueError, match="replay"):
        EndpointConfig("w", "tcp://127.0.0.1:5557", supports_dump=True)


def test_seq_history_keeps_a_window_of_digests_and_a_bounded_list_of_losses() -> None:
    h = SeqHistory(window=3, ranges=2)
    for s in range(5):
        h.delivered(s, payload(s))
    assert h.holds(4, payload(4)) and not h.holds(4, payload(5)) and h.digest_at(1) is None  # 0, 1 forgotten
    for first in (10, 20, 30):
        h.give_up(first, first + 2)
    assert not h.gave_up(10) and h.gave_up(21) and h.gave_up(31) and not h.gave_up(32)
    h._check()
    h.forget()
    assert h.digest_at(4) is None and not h.gave_up(31)


def test_a_dump_after_a_probe_found_a_loss_counts_as_recovering() -> None:
    """The idle probe's answer starts past ``expected``: batches are lost for good, the worker's state is dropped and
    a dump asked; until it lands the router must skip the worker (a probe alone is not a recovery)."""
    t = tracker(dump=True)
    t.on_live(0, payload(0), 0.0)
    t.on_tick(1.5)  # quiet: the probe asks from seq 1
    assert [unpack_seq(r) for r in t.outbox] == [1] and not t.recovering
    t.outbox.clear()
    out = t.on_reply(pack_seq(3), payload(3), 1.6) + t.on_reply(END_SEQ, b"", 1.6)  # 1 and 2 are gone
    assert isinstance(out[-1], ResyncStarted) and t.outbox == [DUMP_REQUEST]
    assert t.recovering


def test_a_stream_resumed_right_after_a_dump_is_resynchronised_not_trusted() -> None:
    """A position saved right after a state dump has no digest (the dump carries no batch of its own), so
    nothing can tell the publisher that answers the resume from a new process that restarted meanwhile. A resume
    that replays from the saved seq and finds nothing past it must not trust the stream, or the index keeps the
    old process's blocks: the stream is resynchronised (the consumer drops it, then a replay from 0), with no
    restart counted."""
    t = tracker(dump=True)
    t.on_live(0, payload(0), 0.0)
    t.request_resync("unknown parent", 0.0)
    t.outbox.clear()
    t.on_reply(pack_seq(4), payload(4), 0.0)  # the replay from 0 starts past it: a dump
    t.on_reply(END_SEQ, b"", 0.0)
    t.on_reply(pack_seq(4), payload(40), 0.1)
    assert isinstance(t.on_reply(END_SEQ, b"", 0.1)[0], ResyncDone)
    assert t.position() == (5, None)

    r = tracker(dump=True)
    r.resume((5, None), 1.0)  # the publisher restarted meanwhile and published only seq 0
    assert [unpack_seq(q) for q in r.outbox] == [4]  # the check, from the last seq the dump covered
    r.outbox.clear()
    out = r.on_reply(END_SEQ, b"", 1.1)
    assert [type(d) for d in out] == [ResyncStarted] and "state dump" in out[0].reason
    assert [unpack_seq(q) for q in r.outbox] == [0] and r.stats.restarts == 0 and r.stats.resyncs == 1
    out = r.on_reply(pack_seq(0), payload(100), 1.2) + r.on_reply(END_SEQ, b"", 1.2)
    pos = r.position()
    assert seqs(out) == [0] and pos is not None and pos[0] == 1 and pos[1] is not None

    # A publisher that did not restart answers the check with the batch the dump covered: it cannot be
    # compared with anything either, so the stream is resynchronised all the same (a dump, as its buffer no
    # longer reaches seq 0).
    same = tracker(dump=True)
    same.resume((5, None), 1.0)
    same.outbox.clear()
    out = same.on_reply(pack_seq(4), payload(4), 1.1)
    assert [type(d) for d in out] == [ResyncStarted]
    out = same.on_reply(END_SEQ, b"", 1.1)
    assert [unpack_seq(q) for q in same.outbox] == [0]


def test_live_batches_a_dump_covered_that_arrive_after_it_are_not_taken_for_a_restart() -> None:
    """A router that lags behind its SUB socket gets the dump's end marker (on the replay socket) before the
    live batches the dump covered, which were still queued on the live one. By seq and digest alone each looks
    like a new publisher (its seq below the next expected, its digest unknown since the dump has none), and
    taking it for one would clear the worker, replay from 0 and dump again, over and over under steady lag. Over
    the same connection they can only be stragglers of the same process: counted late, no restart. After a
    reconnect the check is kept."""
    def dump_started(t: StreamTracker) -> None:
        t.on_live(0, payload(0), 0.0)
        t.on_live(3, payload(3), 0.0)  # seqs 1-2 lost; the buffer no longer reaches them: a dump
        t.on_reply(pack_seq(3), payload(3), 0.0)
        assert isinstance(t.on_reply(END_SEQ, b"", 0.0)[0], ResyncStarted)
        t.on_reply(pack_seq(5), payload(50), 0.1)  # the dump's first batch: it stands for seqs up to 5

    def dumped(t: StreamTracker) -> None:
        dump_started(t)
        assert isinstance(t.on_reply(END_SEQ, b"", 0.1)[0], ResyncDone) and t.expected == 6

    t = tracker(dump=True)
    dumped(t)
    for s in (1, 2, 4, 5):  # the dump stood for them; they arrive after it
        assert t.on_live(s, payload(s), 0.2) == []
    assert seqs(t.on_live(6, payload(6), 0.3)) == [6]
    assert t.stats.late == 4 and t.stats.restarts == 0 and t.stats.resyncs == 1

    t = tracker(dump=True)
    dumped(t)
    t.on_disconnect()  # a reconnect: the next batch below the dump's seq may come from a new process
    assert isinstance(t.on_live(0, payload(100), 0.2)[0], PublisherRestarted)

    # A late copy of a batch delivered before the dump is a duplicate. New content there is a new process's or a
    # corrupt seq: the publisher is checked, and as the dump's own seq has no batch to compare with (a new process
    # could not be told from the same one), the stream is resynchronised from 0.
    t = tracker(dump=True)
    dumped(t)
    t.outbox.clear()
    assert t.on_live(0, payload(0), 0.2) == [] and t.stats.duplicates == 1 and not t.outbox
    assert t.on_live(0, payload(100), 0.2) == [] and [unpack_seq(r) for r in t.outbox] == [5]
    out = t.on_reply(pack_seq(5), payload(5), 0.3)
    assert isinstance(out[0], ResyncStarted) and t.stats.restarts == 0 and t.expected == 0

    # A reconnect during the dump: the dump is asked again, and a batch of the dropped connection that the new
    # answer covers is a straggler too; one past it is checked against the publisher, not applied blindly.
    t = tracker(dump=True)
    dump_started(t)
    t.outbox.clear()
    t.on_disconnect()
    assert t.outbox == [DUMP_REQUEST]
    t.outbox.clear()
    t.on_reply(pack_seq(6), payload(60), 0.2)
    assert isinstance(t.on_reply(END_SEQ, b"", 0.2)[0], ResyncDone) and t.expected == 7
    assert t.on_live(4, payload(4), 0.3) == [] and t.stats.late == 1
    assert t.on_live(7, payload(7), 0.3) == [] and [unpack_seq(q) for q in t.outbox] == [6]


def test_a_request_asked_again_on_a_fresh_socket_goes_alone() -> None:
    """Requests not yet sent when the replay socket is recreated give way to the request asked again, which goes
    alone: sent as well, each would come back with an answer of its own, and once the first answer moved the
    stream on to a dump, the second (a replay answer) would be taken for the dump's and applied as the engine's
    whole state."""
    t = tracker(dump=True)
    t.start(0.0)  # a catch-up from seq 0, not yet sent
    assert t.on_tick(1.5) == [] and t.reset_replay_socket  # timed out: asked again on a fresh socket
    assert [unpack_seq(r) for r in t.outbox] == [0]
    t.outbox.clear()
    t.on_reply(pack_seq(1), payload(1), 1.6)  # the buffer no longer reaches seq 0: a dump
    assert isinstance(t.on_reply(END_SEQ, b"", 1.6)[0], ResyncStarted) and t.outbox == [DUMP_REQUEST]
    out = t.on_reply(pack_seq(4), payload(40), 1.7) + t.on_reply(END_SEQ, b"", 1.7)
    assert isinstance(out[-1], ResyncDone) and out[-1].seq == 4 and t.expected == 5


def test_batches_of_no_payload_held_in_a_recovery_are_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each held batch costs its tuple, seq and bytes object beside its payload: a flood of empty payloads held
    while a replay goes on counted as nothing, and was held without bound."""
    from kvtier.wire.transport import recovery

    monkeypatch.setattr(recovery, "MAX_HELD_BYTES", 64 << 10)
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    t.on_live(2, payload(2), 0.0)  # seq 1 missing: a replay from 1 is asked
    out: list[Delivery] = []
    for seq in range(3, 20_000):
        out += t.on_live(seq, b"", 0.1)
        if any(isinstance(d, ResyncNeeded) for d in out):
            break
    assert any(isinstance(d, ResyncNeeded) for d in out), "held without bound"
    assert seq * recovery.HELD_ENTRY_BYTES < 2 * (64 << 10) + 2 * 1024 * recovery.HELD_ENTRY_BYTES


def _stored(seq: int, n: int, first: int = 0) -> bytes:
    """Batch ``seq``: one block of ``n`` token ids from ``first``."""
    return encode_payload(EventBatch(ts=float(seq), dp_rank=0, events=[BlockStored(
        block_hashes=[seq], parent_block_hash=None, token_ids=list(range(first, first + n)), block_size=n)]))


def _bulky(seq: int) -> bytes:
    """Batch ``seq``: about 80 KiB (16,384 token ids of 5 bytes each)."""
    return _stored(seq, 1 << 14, first=1 << 17)


@pytest.mark.parametrize("cap, batch", [(64 << 10, payload), (1 << 20, _bulky)], ids=["small", "large"])
@pytest.mark.parametrize("where", ["live", "answer"])
def test_a_recovery_holds_bounded_bytes(where: str, cap: int, batch: Callable[[int], bytes],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches held while a replay goes on (live ones held back, or an answer's batches past a loss) stop at
    ``MAX_HELD_BYTES``: a replay answer that never ends, or that trickles while live traffic piles up, ends as a
    loss for good: the answer is abandoned (a fresh replay socket), the stream is marked partial, and what was held
    is delivered in order. Large batches too: their bytes were first counted when 1,024 were held, so up to 1,023
    frames of ``max_frame_bytes`` (64 GiB at the defaults) were held whatever their size."""
    monkeypatch.setattr(recovery, "MAX_HELD_BYTES", cap)
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    t.on_live(2, payload(2), 0.0)  # seq 1 missing: a replay from 1 is asked
    assert t.outbox == [pack_seq(1)]
    t.outbox.clear()
    out: list[Delivery] = []
    for seq in range(3, 3000):
        if where == "live":
            out += t.on_live(seq, batch(seq), 0.1)
        else:  # the answer starts past seq 1 (lost for good) and goes on without an end marker
            out += t.on_reply(pack_seq(seq), batch(seq), 0.1)
        if any(isinstance(d, ResyncNeeded) for d in out):
            break
    size = len(batch(3)) + recovery.HELD_ENTRY_BYTES
    assert any(isinstance(d, ResyncNeeded) for d in out), "held without bound"
    # within 1.125 times the cap, and the batch that passed it
    assert (seq - 2) * size <= cap + cap // 8 + size, f"{seq - 2} batches of {size} bytes held, past the cap"
    assert t.reset_replay_socket and not t.recovering
    assert seqs(out) == list(range(2, seq + 1))  # (seq 1 given up for lost)


def _held_bytes(t: StreamTracker) -> int:
    r = t._recovery
    return recovery._bytes(r.state.held) + recovery._bytes(r.replay.beyond) + recovery._bytes(r.state.doubtful)


def test_a_recovery_given_up_for_its_bytes_hands_on_every_batch_it_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """Held batches with gaps among them (a publisher losing every other batch while a replay was slow): the give-up
    handed them on only up to the next gap, whose replay held the rest again, past the bound; each batch taken then
    gave up again and released one, so what was held grew by a batch a batch (376 times the bound in review). A gap
    among batches handed on by such a give-up is lost for good too: every one of them goes on."""
    cap = 64 << 10
    monkeypatch.setattr(recovery, "MAX_HELD_BYTES", cap)
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    out: list[Delivery] = []
    seq = 2
    while not any(isinstance(d, ResyncNeeded) for d in out):  # small batches, every other one lost
        out += t.on_live(seq, payload(seq), 0.1)
        seq += 2
    assert seqs(out) == list(range(2, seq, 2)) and _held_bytes(t) == 0  # all of them handed on
    worst = 0
    for _ in range(100):  # then large ones, every other one lost still
        t.on_live(seq, _bulky(seq), 0.2)
        seq += 2
        worst = max(worst, _held_bytes(t))
    assert worst <= cap + cap // 8 + len(_bulky(seq)) + recovery.HELD_ENTRY_BYTES


@pytest.mark.parametrize("seed", range(24))  # (seeds 15 and 20 went past the bound before)
def test_held_bytes_stay_bounded_whatever_comes(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Live batches of mixed sizes with gaps, replay answers at old seqs, end markers and deadlines, at random (a
    fixed seed): after every input what a recovery holds is within 1.125 times the bound and the largest batch."""
    rng = random.Random(seed)
    cap = 256 << 10
    monkeypatch.setattr(recovery, "MAX_HELD_BYTES", cap)
    t = tracker(dump=seed % 2 == 1)
    t.on_live(0, payload(0), 0.0)
    seq, now, largest, b = 1, 0.0, 0, b""

    for _ in range(1500):
        now += 0.001
        n = rng.choice([1, 100, 2000, 8000, 30000])
        op = rng.random()
        if op < 0.75:
            if rng.random() < 0.05:
                seq += rng.randint(1, 5)  # a gap
            b = _stored(seq, n)
            t.on_live(seq, b, now)
            seq += 1
        elif op < 0.95:
            q = max(0, seq - rng.randint(1, 50))
            b = _stored(q, n)
            t.on_reply(pack_seq(q), b, now)
        elif op < 0.98:
            t.on_reply(END_SEQ, b"", now)
        else:
            t.on_tick(now + 5)
        t.outbox.clear()
        t.reset_replay_socket = False
        largest = max(largest, len(b) + recovery.HELD_ENTRY_BYTES)
        assert _held_bytes(t) <= cap + cap // 8 + largest


def _store(q: int, proc: int = 1) -> bytes:
    """Batch ``q`` of publisher process ``proc``: a block stored (not the AllBlocksCleared of :func:`payload`, which
    would end a partial state itself)."""
    return encode_payload(EventBatch(ts=100.0 * proc + q, dp_rank=0, events=[BlockStored(
        block_hashes=[1000 * proc + q], parent_block_hash=None, token_ids=list(range(16 * q, 16 * q + 16)),
        block_size=16)]))


def _given_up(before: int, **kw: bool) -> tuple[StreamTracker, list[Delivery]]:
    """A stream given up for lost with nothing at hand: followed from its first batch for ``before`` batches, then
    its engine went down (the reconnect's check goes unanswered); or, with none, the router's replay from 0 at start
    went unanswered."""
    t = tracker(**kw)
    out: list[Delivery] = []
    if before:
        out = [d for q in range(before) for d in t.on_live(q, _store(q, proc=0), 0.0)]
        t.on_disconnect()
    else:
        t.start(0.0)
    out += t.on_tick(5.0)
    out += _answer_nothing(t, 5.0, 1.1, until_given_up=True)[0]
    assert any(isinstance(d, ResyncNeeded) for d in out) and t.expected is None
    return t, out


@pytest.mark.parametrize("first", [0, 3])
@pytest.mark.parametrize("before", [0, 7])
def test_a_publishers_first_batches_after_a_loss_for_good_make_the_state_complete(before: int, first: int) -> None:
    """An engine that can replay but not dump (SGLang, vLLM) is down while the stream's replay goes unanswered (the
    router started first, or the engine is restarting), so its state is given up for lost and the worker marked
    partial. When the engine comes up, everything it holds is announced from its seq 0: that batch live, or, where
    the reconnecting socket missed its first ones (``first``), a replay from 0. The worker's state is complete again
    once they are delivered, cleared of anything from before (a restart where batches were delivered before and seq
    0 came live). It stayed partial for good."""
    t, out = _given_up(before)
    index = TieredIndex(block_size=16)
    consumer = IndexConsumer(index)
    consumer.feed(out)
    assert index.is_partial(S)
    buffer = {q: _store(q) for q in range(first + 3)}
    later = [d for q in range(first, first + 3) for d in t.on_live(q, buffer[q], 100.0)]
    later += _answer_honestly(t, buffer, 100.0)
    assert _contents(later) == [(q, 100.0 + q) for q in range(first + 3)]
    notice = PublisherRestarted if before and not first else ResyncStarted
    assert isinstance(later[0], notice) and not any(isinstance(d, ResyncNeeded) for d in later), later
    assert t.stats.restarts == (1 if notice is PublisherRestarted else 0)
    consumer.feed(later)
    assert not index.is_partial(S) and t.expected == first + 3 and not t.recovering and not t.outbox
    assert t.on_tick(101.0) == [] and [unpack_seq(r) for r in t.outbox] == [first + 3]  # (an idle probe, no check)


def test_a_check_the_old_connection_owed_is_not_asked_of_the_new_process() -> None:
    """The engine went down while a gap's replay was under way (the reconnect's check deferred behind it) and the
    stream was given up for lost. The new process's seq 0 ends the partial mark; the check the old connection owed
    is not asked of it afterwards (unanswered by an engine still starting, it marked the worker partial again)."""
    t = tracker()
    for q in range(7):
        t.on_live(q, _store(q, proc=0), 0.0)
    t.on_live(9, _store(9, proc=0), 1.0)  # (8 lost: its replay under way)
    t.on_disconnect()
    _answer_nothing(t, 1.0, 1.1, until_given_up=True)
    out = t.on_live(0, _store(0), 100.0) + t.on_live(1, _store(1), 100.1)
    assert isinstance(out[0], PublisherRestarted) and _contents(out) == [(0, 100.0), (1, 101.0)]
    assert not t.recovering and not t.outbox


def test_a_garbled_seq_0_after_a_loss_for_good_is_no_new_process() -> None:
    """The stream was given up for lost, its publisher still running; a live frame of a batch delivered before comes
    with its seq garbled to 0. It repeats a delivered batch: a corrupt seq, not a new process's first batch (which
    would have ended the partial mark and counted a restart that never was)."""
    t, _ = _given_up(7)
    out = t.on_live(0, _store(5, proc=0), 100.0)
    assert not any(isinstance(d, PublisherRestarted | ResyncStarted | Received) for d in out)
    assert t.stats.bogus_seqs == 1 and t.stats.restarts == 0


def test_a_dump_capable_publishers_seq_0_after_a_loss_for_good_asks_no_dump() -> None:
    """A dump-capable engine given up for lost (its dumps unanswered: down) is asked for a dump again as the backoff
    allows; when it comes back with its seq 0, its state is complete from there, and no dump is asked for (one would
    clear the worker and rebuild what it holds already)."""
    t, _ = _given_up(7, dump=True)
    out = t.on_live(0, _store(0), 100.0)
    assert isinstance(out[0], PublisherRestarted) and _contents(out) == [(0, 100.0)]
    assert not t.outbox
    out = t.on_tick(1000.0)
    assert not out and t.outbox == [pack_seq(1)] and t.stats.resyncs == 1  # (an idle probe, no dump)


def test_losses_for_good_of_an_engine_without_dumps_are_logged_sparingly(caplog: pytest.LogCaptureFixture) -> None:
    """A publisher whose replay buffer no longer holds what the wire dropped (an engine without dumps past its
    high-water mark) loses batches for good again and again: each is counted (``resyncs``) and marks the worker
    partial, but only the first ten and every thousandth reach the log, as malformed frames do (the count that
    thinned them grew only for dump-capable engines, so every loss was logged)."""
    t = tracker()
    t.on_live(0, payload(0), 0.0)
    with caplog.at_level(logging.WARNING, logger="kvtier.wire.transport.stream"):
        for k in range(1, 1201):
            out = t.on_live(2 * k, payload(2 * k), float(k))  # (2k - 1 dropped on the wire)
            out += t.on_reply(pack_seq(2 * k), payload(2 * k), float(k))  # (the buffer starts past it)
            out += t.on_reply(END_SEQ, b"", float(k))
            assert any(isinstance(d, ResyncNeeded) for d in out) and t.expected == 2 * k + 1
    assert t.stats.resyncs == 1200
    partial = [r for r in caplog.records if "state marked partial" in r.getMessage()]
    assert len(partial) == 10 + 1, [r.getMessage() for r in partial[:12]]
    assert "further ones logged every 1000th" in partial[9].getMessage()


def test_the_position_is_kept_while_a_replay_is_pending_and_not_while_a_dump_is() -> None:
    """What a pending replay has not delivered is held back, so the consumer's state is whole up to the seq before
    the one expected, and a snapshot taken meanwhile resumes from there (a stream left out of one is started
    afresh). An idle probe and a gap's replay keep the position; a resync starts from seq 0 (nothing delivered
    yet), and a dump under way has none: the consumer's state is then being rebuilt."""
    t = StreamTracker(S, can_replay=True, can_dump=True, timeout_s=1.0, probe_s=1.0)
    for i in range(3):
        t.on_live(i, payload(i), 0.0)
    at = t.position()
    assert at is not None and at[0] == 3
    t.on_tick(2.0)  # quiet: an idle probe goes out
    assert [unpack_seq(q) for q in t.outbox] == [3] and t.position() == at
    t.outbox.clear()
    t.on_reply(END_SEQ, b"", 2.1)  # nothing new
    t.on_live(5, payload(5), 2.2)  # seqs 3 and 4 went missing: a gap's replay, seq 5 held back
    assert [unpack_seq(q) for q in t.outbox] == [3] and t.position() == at
    t.outbox.clear()
    t.on_reply(pack_seq(3), payload(3), 2.3)
    pos = t.position()
    assert pos is not None and pos[0] == 4  # seq 3 delivered, 4 still missing
    t.on_reply(pack_seq(4), payload(4), 2.3)
    t.on_reply(pack_seq(5), payload(5), 2.3)
    t.on_reply(END_SEQ, b"", 2.3)
    pos = t.position()
    assert pos is not None and pos[0] == 6
    t.request_resync("the consumer found its state inconsistent", 2.4)
    assert [unpack_seq(q) for q in t.outbox] == [0] and t.position() is None  # (from seq 0: nothing delivered)
    t.outbox.clear()
    t.on_reply(pack_seq(4), payload(4), 2.5)  # the buffer no longer reaches seq 0: a dump
    t.on_reply(END_SEQ, b"", 2.5)
    assert t.outbox == [DUMP_REQUEST] and t.position() is None


def test_batches_naming_another_dp_rank_than_their_endpoints_are_reported_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """An endpoint's ``dp=`` names the data-parallel rank the router sends its blocks' requests to; SGLang and vLLM
    name the publishing rank in every batch. A mismatch (the endpoint configured for another rank's port) routed
    each prefix to a rank that does not hold it, unnoticed: it is logged once per stream, the blocks still indexed
    under the endpoint's stream (the configuration is the operator's to fix)."""
    consumer = IndexConsumer(TieredIndex(4))
    rank1 = StreamId(WorkerId("w"), 1)
    store = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4)
    with caplog.at_level(logging.WARNING):
        for seq in range(2):
            consumer.feed([Received(rank1, seq, EventBatch(ts=0.0, events=[store], dp_rank=0), "live")])
        consumer.feed([Received(S, 0, EventBatch(ts=0.0, events=[store], dp_rank=0), "live"),
                       Received(StreamId(WorkerId("v"), 1), 0, EventBatch(ts=0.0, events=[store]), "live")])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["stream w (dp rank 1): its batches name dp rank 0; the endpoint's dp= (dp_rank in TOML) is the "
                      "rank the router sends its blocks' requests to: check it names the rank that publishes there"]
    assert consumer.index.worker_hashes(rank1)[StorageTier.DEVICE] == {1}


def test_a_batch_applied_in_slices_gives_the_index_feed_gives() -> None:
    """IndexConsumer.slices (the service's way with a large batch) applies what feed applies, counts the batch once
    and yields between its slices only, the inferred-window rule reading the batch's stores whole."""
    from kvtier.wire import BlockRemoved

    toks = list(range(100, 132))
    events = [BlockStored(block_hashes=[i], parent_block_hash=i - 1 if i else None, token_ids=toks[4 * i:4 * i + 4],
                          block_size=4) for i in range(8)]
    events += [BlockRemoved(block_hashes=[7, 6]), AllBlocksCleared(), *events[:5],
               BlockStored(block_hashes=[40], parent_block_hash=99, token_ids=toks[:4], block_size=4)]
    d = Received(S, 0, EventBatch(ts=0.0, events=events), "live")
    whole, sliced = IndexConsumer(TieredIndex(4, window_tokens=8)), IndexConsumer(TieredIndex(4, window_tokens=8))
    whole.feed([d])
    yields = 0
    for _ in sliced.slices(d, work=3):
        yields += 1
        assert sliced.counters.batches == 0  # (counted once whole)
    assert yields >= 7  # 16 events, two or so a slice
    for consumer in (whole, sliced):
        consumer.index._check()
        assert consumer.counters.batches == 1 and consumer.counters.outcomes == {"orphaned": 1}
    assert whole.index.worker_hashes(S) == sliced.index.worker_hashes(S)
    assert whole.index.window_hashes(S) == sliced.index.window_hashes(S)
    assert sum(map(len, whole.index.worker_hashes(S).values())) == 5


def test_no_position_while_a_replayed_batch_that_did_not_decode_is_pending() -> None:
    """A replay answer's batch that does not decode is a loss, reported when the replay ends; the seq expected moves
    past it meanwhile. A snapshot taken in between resumed the stream after the lost batch, the loss never reported
    (the resume check passes: the publisher holds the same bytes). Until that replay ends there is no position."""
    t = StreamTracker(S, can_replay=True, can_dump=False, timeout_s=1.0, probe_s=None)
    t.on_live(0, payload(0), 0.0)
    t.on_live(3, payload(3), 0.1)  # a gap: replay from 1
    t.outbox.clear()
    t.on_reply(pack_seq(1), b"\xff\xfe not msgpack", 0.2)
    assert t.position() is None
    out = t.on_reply(pack_seq(2), payload(2), 0.3) + t.on_reply(pack_seq(3), payload(3), 0.3)
    out += t.on_reply(END_SEQ, b"", 0.3)
    assert any(isinstance(d, ResyncNeeded) for d in out)
    pos = t.position()
    assert pos is not None and pos[0] == 4  # (partial from here on: the position is the live one's)
