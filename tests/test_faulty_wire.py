"""Consistency over a faulty wire: drops, duplicates, reordering, lost and cut-short replay answers, restarts.

Engines publish into a publisher model with a small replay buffer and a state-dump provider;
batches reach each worker's StreamTracker (the subscriber's ordering logic) through a wire that
loses, repeats and reorders them. The consumer applies deliveries to one TieredIndex exactly as
the indexer service does. Invariant: once the wire is quiet and recovery has run, every worker's
view equals its engine's residency, and recovering one worker never touched another.
"""

from __future__ import annotations

import tempfile
from collections import deque
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import Bandwidths, ModeledDataPath
from kvtier.engine.l3.storage import PageStore
from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.service import persist
from kvtier.wire import StorageTier, WorkerId, encode_payload
from kvtier.wire.notices import Delivery, StreamId
from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
from kvtier.wire.transport.stream import StreamTracker
from tests.conftest import SLOW

PS = 2
DOCS = [list(range(100, 120)), list(range(100, 108)) + list(range(300, 312)), list(range(500, 520))]
BW = Bandwidths(d2h=1e3, h2d=1e3, storage_write=1e3, storage_read=1e3, latency_s=1e-6)
CHECKS: list[int] = []  # quiet-and-recovered checks run, for the report


class Engine:
    """A cache plus a publisher model: seq numbers, a bounded replay buffer, state dumps.

    Each process stamps its batches with a clock of its own (:data:`RESTART_S` later per restart, as a real process's
    wall clock has moved on when it comes back): the tracker tells a restarted publisher by what it sends at a seq it
    has delivered, and a new process that repeated the last batch delivered byte for byte, timestamp included, would
    be the old one to any check (:mod:`kvtier.wire.transport.seqhistory`). ``distinct_processes = False`` stamps
    every process alike, for the tests that put such a repeat on purpose."""

    RESTART_S = 1e-3
    distinct_processes = True

    def __init__(self, name: str, clock: list[float], buffer: int) -> None:
        self.name, self.clock, self.buffer_size = name, clock, buffer
        self.restarts = -1
        self.start()

    def start(self) -> None:
        """A (re)started process: empty cache, seq from 0, empty replay buffer."""
        self.restarts += 1
        cfg = CacheConfig(page_size=PS, device_pages=8, host_ratio=1.5)
        self.cache = TieredCache(cfg, ModeledDataPath(1000, lambda: self.clock[0], BW), PageStore(12), name=self.name)
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_size)

    def flush(self) -> tuple[int, bytes] | None:
        late = self.restarts * self.RESTART_S if self.distinct_processes else 0.0
        batch = self.cache.flush_events(ts=self.clock[0] + late)
        if batch is None:
            return None
        msg = (self.next_seq, encode_payload(batch))
        self.next_seq += 1
        self.buffer.append(msg)
        return msg

    def answer(self, request: bytes) -> list[tuple[bytes, bytes]]:
        """Frames a ROUTER would send back for a replay or dump request, end marker included."""
        if request == DUMP_REQUEST:
            batches = self.cache.dump_events() or []
            frames = [(pack_seq(self.next_seq - 1), encode_payload(b)) for b in batches]
            if not frames:
                from kvtier.wire import EventBatch

                frames = [(pack_seq(self.next_seq - 1), encode_payload(EventBatch(ts=0.0, events=[])))]
            return [*frames, (END_SEQ, b"")]
        start = unpack_seq(request)
        return [(pack_seq(s), p) for s, p in self.buffer if s >= start] + [(END_SEQ, b"")]


class TwoEngines(RuleBasedStateMachine):
    """Two engines behind a wire and a tracker each: the rules that drive them, shared by the
    machines in this file and in test_partial_recovery.py (each defines setup, _publish, _consume), and the
    router's restart from its snapshot file."""

    clock: list[float]
    engines: list[Engine]
    trackers: list[StreamTracker]
    wire: list[deque[tuple[int, bytes]]]
    cut_next_answer: list[int | None]  # frames the next answer keeps (its end marker lost with the rest)
    streams: list[StreamId]
    index: TieredIndex
    consumer: IndexConsumer
    snapshots: tempfile.TemporaryDirectory[str]  # where the router's snapshot file goes (_restart_router)

    def _publish(self, w: int) -> None:
        raise NotImplementedError

    def _consume(self, w: int, out: list[Delivery]) -> None:
        raise NotImplementedError

    @rule(w=st.integers(0, 1), doc=st.integers(0, 2), pages=st.integers(1, 10))
    def request(self, w: int, doc: int, pages: int) -> None:
        cache = self.engines[w].cache
        adm = cache.admit("r", DOCS[doc][: pages * PS])
        if cache.begin_prefill(adm) is not None:
            cache.finish_prefill(adm)
        cache.release(adm)
        self._publish(w)

    @rule(dt=st.sampled_from([0.3, 1.0, 3.0]))
    def advance(self, dt: float) -> None:
        self.clock[0] += dt
        for w, e in enumerate(self.engines):
            e.cache.poll()
            self._publish(w)
            self._consume(w, self.trackers[w].on_tick(self.clock[0]))

    @rule(w=st.integers(0, 1), keep=st.integers(1, 3))
    def cut_an_answer_short(self, w: int, keep: int) -> None:
        """The next replay or dump answer stops after ``keep`` frames (the publisher dropped the rest, or its
        connection went): the tracker has used part of it when it asks again, and the engine may have changed
        by then."""
        self.cut_next_answer[w] = keep

    def _answer(self, w: int, request: bytes) -> list[tuple[bytes, bytes]]:
        """Engine ``w``'s answer to ``request`` as it arrives: whole, or cut short (:meth:`cut_an_answer_short`)."""
        frames = self.engines[w].answer(request)
        keep, self.cut_next_answer[w] = self.cut_next_answer[w], None
        return frames if keep is None else frames[:min(keep, len(frames) - 1)]

    @precondition(lambda self: any(self.wire))
    @rule(w=st.integers(0, 1), n=st.integers(1, 4))
    def deliver(self, w: int, n: int) -> None:
        for _ in range(min(n, len(self.wire[w]))):
            seq, payload = self.wire[w].popleft()
            self._consume(w, self.trackers[w].on_live(seq, payload, self.clock[0]))

    def _restart_router(self, can_dump: bool) -> None:
        """The router restarts from its snapshot file (``self.snapshots``): index and positions saved and loaded,
        the wire cleared, each stream resumed, or cleared and started afresh (:meth:`_started_afresh`)."""
        path = Path(self.snapshots.name) / "index.snap"
        persist.save(path, self.index, {s: p for s, t in zip(self.streams, self.trackers, strict=True)
                                        if (p := t.position()) is not None})
        self.index, positions = persist.load(path, PS)
        self.consumer = IndexConsumer(self.index)
        for w, s in enumerate(self.streams):
            self.wire[w].clear()
            self.trackers[w] = t = StreamTracker(s, can_replay=True, can_dump=can_dump, timeout_s=1.0, probe_s=1.0)
            if s in positions:
                t.resume(positions[s], self.clock[0])
            else:
                self.index.clear_worker(s)
                self._started_afresh(w)
                t.start(self.clock[0])
            self._consume(w, [])

    def _started_afresh(self, w: int) -> None:
        """Worker ``w``'s stream had no position to resume from: its state was cleared (a hook for models)."""

    def teardown(self) -> None:
        if hasattr(self, "snapshots"):
            self.snapshots.cleanup()

    def settle(self, ticks: int) -> None:
        """Every copy lands, everything on the wire is delivered, then ``ticks`` rounds of 2 s let
        probes, retries and dumps run."""
        for _ in range(3):
            self.advance(10.0)
            for w in range(2):
                self.deliver(w, 1000) if self.wire[w] else None
        for _ in range(ticks):
            self.clock[0] += 2.0
            for w in range(2):
                self._consume(w, self.trackers[w].on_tick(self.clock[0]))


class FaultyWire(TwoEngines):
    @initialize(buffer=st.sampled_from([2, 4, 64]))
    def setup(self, buffer: int) -> None:
        self.clock = [0.0]
        self.engines = [Engine("w0", self.clock, buffer), Engine("w1", self.clock, buffer)]
        self.streams = [StreamId(WorkerId(e.name)) for e in self.engines]
        self.index = TieredIndex(PS)
        self.consumer = IndexConsumer(self.index)
        self.trackers = [self._tracker(s) for s in self.streams]
        self.wire: list[deque[tuple[int, bytes]]] = [deque(), deque()]
        self.lose_next_answer = [False, False]
        self.cut_next_answer = [None, None]
        self.untouched: dict[StreamId, int] = {}
        self.snapshots = tempfile.TemporaryDirectory(prefix="kvtier-faulty-wire-")

    def _tracker(self, stream: StreamId) -> StreamTracker:
        t = StreamTracker(stream, can_replay=True, can_dump=True, timeout_s=1.0, probe_s=1.0)
        t.start(self.clock[0])
        return t

    # --- the consumer, as in indexer.service -----------------------------------------------

    def _consume(self, w: int, out: list[Delivery]) -> None:
        other = self.streams[1 - w]
        before = self.index.worker_hashes(other)
        self._consume_one(w, out)
        assert self.index.worker_hashes(other) == before, f"handling {self.streams[w]} changed {other}"

    def _consume_one(self, w: int, out: list[Delivery]) -> None:
        self._serve(w, out)
        while out:
            self.consumer.feed([out.pop(0)])
            self._serve(w, out)

    def _serve(self, w: int, out: list[Delivery]) -> None:
        t = self.trackers[w]
        while t.outbox:
            request = t.outbox.pop(0)
            if self.lose_next_answer[w]:
                self.lose_next_answer[w] = False
                continue  # the answer never arrives: the tracker must time out and retry
            for seq_frame, payload in self._answer(w, request):
                out.extend(t.on_reply(seq_frame, payload, self.clock[0]))

    # --- engines ---------------------------------------------------------------------------

    @rule(w=st.integers(0, 1))
    def reset(self, w: int) -> None:
        self.engines[w].cache.reset()
        self._publish(w)

    @rule(w=st.integers(0, 1))
    def restart_process(self, w: int) -> None:
        """The engine process dies and comes back: seq restarts at 0; the socket reconnects."""
        self.engines[w].start()
        self.wire[w].clear()
        self.trackers[w].on_disconnect()

    @rule(w=st.integers(0, 1))
    def remove_and_rejoin(self, w: int) -> None:
        """The router forgets the worker, then subscribes again from scratch."""
        self.index.remove_worker(self.streams[w])
        self.trackers[w] = self._tracker(self.streams[w])
        self._consume(w, [])

    def _publish(self, w: int) -> None:
        msg = self.engines[w].flush()
        if msg is not None:
            self.wire[w].append(msg)

    # --- the wire --------------------------------------------------------------------------

    @precondition(lambda self: any(self.wire))
    @rule(w=st.integers(0, 1), action=st.sampled_from(["drop", "duplicate", "swap"]))
    def misbehave(self, w: int, action: str) -> None:
        q = self.wire[w]
        if not q:
            return
        if action == "drop":
            q.popleft()
        elif action == "duplicate":
            q.appendleft(q[0])
        elif len(q) >= 2:
            q[0], q[1] = q[1], q[0]

    @rule(w=st.integers(0, 1))
    def lose_an_answer(self, w: int) -> None:
        self.lose_next_answer[w] = True

    @rule()
    def router_restarts_from_its_snapshot(self) -> None:
        """The router process stops and starts again, as the indexer service does with a snapshot file: the
        index and each stream's position are saved, live batches sent meanwhile are lost, and each stream
        resumes after its last applied batch (one saved mid-recovery, or before any batch, starts afresh)."""
        self._restart_router(can_dump=True)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def other_workers_untouched(self) -> None:
        self.index._check()
        for t in self.trackers:
            t._check()

    @rule()
    def quiet_then_check(self) -> None:
        """Let every copy land, deliver everything, let probes and retries run: views must agree."""
        self.settle(ticks=6)
        for e, s in zip(self.engines, self.streams, strict=True):
            e.cache._check()
            seen, truth = self.index.worker_hashes(s), e.cache.residency()
            for tier in StorageTier:
                assert seen[tier] == truth[tier], (s, tier, seen[tier] ^ truth[tier])
        CHECKS.append(1)


def test_a_restart_while_a_catch_up_answer_is_cut_short_and_its_retry_lost_converges() -> None:
    """The catch-up answer delivers seq 0 and loses its end marker, the retry's answer is lost, the engine
    restarts and stores a block. The retry after the reconnect must not take the new process's seq 1 for the
    continuation of the old one's seq 0: once the wire is quiet, the index holds what the new process holds,
    its seq 0's device block included."""
    m = FaultyWire()
    m.setup(buffer=2)
    m.reset(w=0)
    m.cut_an_answer_short(keep=1, w=0)
    m.advance(dt=0.3)
    m.lose_an_answer(w=0)
    m.restart_process(w=0)
    m.cut_an_answer_short(keep=1, w=0)
    m.request(doc=0, pages=1, w=0)
    m.quiet_then_check()
    m.teardown()


def test_a_check_that_finds_the_buffer_past_its_seq_is_not_forgotten_by_its_re_ask() -> None:
    """After a reconnect the tracker checks the publisher by replaying from the last seq delivered (0). The engine
    restarted, published its seq 0, and its buffer of 2 now starts at seq 1: the check's answer starts past the
    seq it checks, so what came before is lost for good. That answer is cut short, and the re-ask (from seq 1)
    answered in full must not be taken for a seamless continuation (it was, and the new process's seq 0 store
    never reached the index): the worker is dumped, and the index converges. (Found by the slow profile.)"""
    m = FaultyWire()
    m.setup(buffer=2)
    m.reset(w=0)
    m.quiet_then_check()
    m.lose_an_answer(w=0)
    m.restart_process(w=0)
    m.cut_an_answer_short(keep=1, w=0)
    m.request(doc=0, pages=1, w=0)
    m.quiet_then_check()
    assert m.trackers[0].stats.resyncs == 1
    m.teardown()


def test_live_batches_that_arrive_after_the_dump_covering_them_are_no_restart() -> None:
    """w0's catch-up answer is lost across a router restart, so its batches are on the wire when the check at
    the next quiet point finds the buffer past seq 0 and asks for dumps, whose end markers come first. The
    engine never restarted, so a live batch a dump covered is counted late, not taken for a new process (which
    would clear the worker, replay from 0, and mark the stream partial and dump it again): no restart is
    counted, and the index converges."""
    m = FaultyWire()
    m.setup(buffer=2)
    m.request(doc=0, pages=1, w=0)
    m.lose_an_answer(w=0)
    m.router_restarts_from_its_snapshot()
    m.request(doc=0, pages=2, w=0)
    m.quiet_then_check()
    assert m.trackers[0].stats.restarts == 0 and m.trackers[0].stats.late > 0
    m.teardown()


def test_a_router_resumed_right_after_a_dump_finds_the_engine_restarted_meanwhile() -> None:
    """w0's last batch before the router's restart is a state dump, so its saved position has no digest; the
    engine then restarts and publishes nothing. A resume that replays from the saved seq and finds nothing past
    it must not trust the stream: once the wire is quiet, the index holds none of the blocks the new process
    never had."""
    m = FaultyWire()
    m.setup(buffer=2)
    m.request(doc=0, pages=1, w=0)
    m.request(doc=1, pages=3, w=0)
    m.request(doc=2, pages=2, w=0)
    m.router_restarts_from_its_snapshot()  # w0 had no position: from seq 0, past its buffer, so a dump
    assert m.trackers[0].position() == (3, None)
    m.restart_process(w=0)
    m.router_restarts_from_its_snapshot()
    m.quiet_then_check()
    m.teardown()


def test_a_catch_up_asked_again_before_it_was_sent_is_answered_once() -> None:
    """w0's catch-up from seq 0 times out before it is sent and is asked again on a fresh socket; both go out,
    and the first answer starts past seq 0, so a dump is asked. The second replay answer must not be taken for
    the dump's (that would apply two batches as the engine's whole state and drop the live ones the dump
    covers): once the wire is quiet, the index matches every engine."""
    m = FaultyWire()
    m.setup(buffer=2)
    m.request(doc=2, pages=1, w=0)
    m.request(doc=0, pages=1, w=0)
    m.quiet_then_check()
    m.teardown()


@pytest.mark.parametrize("router_restarts", [1, 2])
def test_a_restarted_engines_batches_held_through_a_check_are_not_dropped_as_seen(router_restarts: int) -> None:
    """After a reconnect, the check replays the last seq delivered (1). The engine restarted, and its new seq 1 is
    byte for byte the old one (the same store at the same time), so the check passes, cut short, and while it is
    asked again the new process's live seqs 0 and 1 are held. They came back below the next seq expected and were
    dropped unseen as delivered already; seq 0 is a store the old process never sent (its seq 0 cleared the cache),
    so it must be taken for the new process it is: the worker is caught up again, and the index converges. After a
    second router restart the router, resumed from its snapshot, knows the digest of the last seq applied only, so
    seq 0 contradicts nothing it knows: a batch below the seq expected that is no duplicate and no straggler comes
    from a new process all the same (a PUB socket sends a reconnected peer new batches only), as on the live path.
    (Found by the slow profile, before processes stamped their batches apart; a real process's clock would have told
    the two seq 1 apart.)"""
    m = FaultyWire()
    m.setup(buffer=2)
    for e in m.engines:
        e.distinct_processes = False  # (the repeat, on purpose)
    m.reset(w=0)
    m.request(doc=2, pages=1, w=0)
    for _ in range(router_restarts):
        m.router_restarts_from_its_snapshot()
    m.restart_process(w=0)
    m.cut_an_answer_short(keep=1, w=0)
    m.request(doc=0, pages=1, w=0)
    m.request(doc=2, pages=1, w=0)
    m.quiet_then_check()
    assert m.trackers[0].stats.restarts == 1
    m.teardown()


def test_a_restart_whose_first_batch_was_lost_with_a_router_restart_is_told_by_the_next_ones_stamp() -> None:
    """The restarted engine's seq 0 is lost on the wire while the router restarts; its seq 1 is the old process's
    seq 1 but for its timestamp. The router's check of seq 1 finds other content there: the worker is caught up
    again, and the index holds seq 0's block. (Stamped alike, the two processes' seq 1 are one batch to any check:
    the slow profile found that, and the model now stamps each process apart, as real clocks do.)"""
    m = FaultyWire()
    m.setup(buffer=2)
    m.reset(w=0)
    m.request(doc=2, pages=1, w=0)
    m.router_restarts_from_its_snapshot()
    m.restart_process(w=0)
    m.cut_an_answer_short(keep=1, w=0)
    m.request(doc=0, pages=1, w=0)
    m.router_restarts_from_its_snapshot()
    m.request(doc=2, pages=1, w=0)
    m.quiet_then_check()
    m.teardown()


FaultyWire.TestCase.settings = settings(max_examples=2000 if SLOW else 500, stateful_step_count=80 if SLOW else 50,
                                        deadline=None)
TestFaultyWire = FaultyWire.TestCase
