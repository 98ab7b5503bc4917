"""How a stream gets back what it missed: replays, re-asks, state dumps and, as a last resort, a stream marked
partial (:class:`kvtier.wire.transport.stream.StreamTracker` drives it).

Replay answers may come back incomplete for two different reasons, told apart by where the answer starts. If its
first batch is past the seq asked for, the publisher's buffer no longer reaches back: those batches are lost for
good. If it starts where asked but skips or stops early, the publisher dropped frames on the way (a ZMQ high-water
mark: SGLang's replay socket keeps the default of 1,000 messages), so the recovery asks again from the first
missing seq, as often as each answer makes progress. Only a loss for good leads to a dump or to ``ResyncNeeded``;
a quiet stream's probe that goes unanswered changes nothing.

Every method that can end the recovery returns the batches to drain through the tracker's live path (empty while
the recovery goes on, or when nothing is held): the live path may start the next recovery, and this way the two
never call each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.notices import Delivery, GapFilled, ResyncDone, ResyncNeeded, ResyncStarted
from kvtier.wire.transport.backoff import Backoff
from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
from kvtier.wire.transport.replayrequest import ReplayRequest
from kvtier.wire.transport.streamstate import Held, StreamState, log

__all__ = ["MAX_HELD_BYTES", "Mode", "StreamRecovery"]

#: The most batch bytes a stream holds while a recovery goes on (live batches held back, an answer's batches past a
#: loss, batches set aside as doubtful), about: past it the recovery is given up as a loss for good, and what is held
#: is delivered. An answer that keeps coming (a publisher replaying without end, or trickling while live traffic
#: piles up) costs no more; nor do batches set aside again and again (past it, the highest seqs go as corrupt).
MAX_HELD_BYTES = 256 << 20
#: What holding one batch costs beside its payload (its tuple, seq and bytes object): counted, so that batches of no
#: payload, which a publisher may send by the million, are bounded too.
HELD_ENTRY_BYTES = 128
_FIRST_SIZE_CHECK = 1024  # batches held when their bytes are first counted; then at each doubling (amortised O(1))


def _bytes(held: Held) -> int:
    """What holding ``held`` costs, about: its payloads and an entry each. O(h)."""
    return sum(len(p) for _, p in held) + len(held) * HELD_ENTRY_BYTES


class Mode(Enum):
    LIVE = 0  # delivering live messages as they come
    REPLAY = 1  # waiting for a replay answer; live messages are held back
    DUMP = 2  # waiting for a state dump; live messages are held back


@dataclass(slots=True)
class StreamRecovery:
    """The request a stream has on its replay socket (a replay or a dump), its deadline and tries, and the pace
    of resyncs.

    The owner sends :attr:`outbox` requests on the replay socket (and clears it), and recreates that socket when
    :attr:`reset_socket` is set, so a late answer to an abandoned request can never be mistaken for a new one.
    Invariants (:meth:`_check`): nothing is held and no replay carries a purpose while live; a replay has a seq
    expected; a dump's batches are marked applied only while a dump is pending.
    """

    state: StreamState  # the stream's delivered side (shared with the tracker)
    can_replay: bool  # the publisher has a replay socket
    can_dump: bool  # the publisher answers DUMP_REQUEST (kvtier engines)
    timeout_s: float  # how long to wait for a replay or dump answer to start, or a dump to go on
    stall_s: float  # a replay answer that made progress and then went quiet this long is re-asked
    attempts: int  # requests sent (on fresh sockets) without progress before giving up
    pace: Backoff  # when the next resync may start
    outbox: list[bytes] = field(default_factory=list)  # requests for the replay socket
    reset_socket: bool = False  # set when an answer is abandoned
    mode: Mode = Mode.LIVE  # see Mode
    deadline: float = 0.0  # when the pending request times out
    tries: int = 0  # requests sent for the pending replay or dump
    replay: ReplayRequest = field(default_factory=ReplayRequest)  # the pending (or last) replay
    dump_due: bool = False  # a dump was wanted while rate-limited, or the last one failed: start it once allowed
    failed_dumps: int = 0  # give-ups of a dump-capable stream in a row since a dump came through (thins the log)
    dump_seq: int | None = None  # last live seq the incoming dump includes
    dump_applied: bool = False  # a batch of the pending dump was handed on: an answer asked again replaces it
    size_check_at: int = _FIRST_SIZE_CHECK  # batches held when :meth:`overheld` next counts their bytes
    bytes_check_at: int = MAX_HELD_BYTES  # or bytes taken since the last count, whichever comes first
    taken: int = 0  # bytes taken (a batch, an entry each) since the last count
    undecodable: str | None = None  # a batch the pending replay delivered did not decode: why (see lost_batch)

    @property
    def active(self) -> bool:
        """A replay or dump is pending: live messages are held back. O(1)."""
        return self.mode is not Mode.LIVE

    @property
    def recovering(self) -> bool:
        """A catch-up, full replay or dump is pending (not an idle probe). O(1)."""
        return self.mode is not Mode.LIVE and not self.replay.probe

    def next_at(self) -> float | None:
        """When :meth:`tick` has work: the pending request's deadline, or when a deferred dump may start. O(1)."""
        if self.mode is not Mode.LIVE:
            return self.deadline
        return self.pace.next_at if self.dump_due else None

    def replay_from(self, start: int, now: float, out: list[Delivery], *, for_gap: bool = False,
                    probe: bool = False, resyncing: bool = False, verify: bool = False, settle: bool = False,
                    below: bool = False) -> Held:
        """Asks for every batch from ``start``, for what the flags say (:class:`ReplayRequest`); without a replay
        socket the stream is unrecoverable at once. O(1)."""
        if not self.can_replay:
            return self.unrecoverable("no replay socket", now, out)
        self.mode = Mode.REPLAY
        self._count_afresh()
        self.undecodable = None
        self.replay.ask(start, for_gap=for_gap, probe=probe, resyncing=resyncing, verify=verify, settle=settle,
                        below=below)
        self.tries = 1
        self.deadline = now + self.timeout_s
        self.outbox.append(pack_seq(start))
        return []

    def on_reply(self, seq_frame: bytes, payload: bytes, now: float, out: list[Delivery]) -> Held:
        """A frame pair of the pending answer (a batch or the end marker); the owner checked one is pending."""
        assert self.mode is not Mode.LIVE, "an answer handled while none is pending"
        # Every frame shows the answer is flowing: a big replay or dump is not timed as a whole.
        self.deadline = now + (self.stall_s if self.mode is Mode.REPLAY else self.timeout_s)
        if seq_frame == END_SEQ and (self.mode is Mode.REPLAY or not payload):
            return self._finish_replay(now, out) if self.mode is Mode.REPLAY else self._finish_dump(now, out)
        if seq_frame == END_SEQ:
            # A dump batch numbered -1: the publisher has published nothing yet (a restarted engine, idle), so its
            # dump stands for "before seq 0"; the end marker has an empty payload, a dump batch never does.
            self._dumped(-1, payload, out)
            return []
        try:
            seq = unpack_seq(seq_frame)
        except ValueError as exc:
            self.state.malformed(f"replay answer: {exc}", out)
            return []
        if self.mode is Mode.REPLAY:
            self._replayed(seq, payload, out)
        else:
            self._dumped(seq, payload, out)
        return []

    def overheld(self, now: float, out: list[Delivery], taken: int = 0) -> Held | None:
        """None while what the recovery holds is within :data:`MAX_HELD_BYTES`; past it, the answer is abandoned
        and the recovery ends as a loss for good (a dump for a stream that has one, else the stream marked
        partial, what is held delivered). ``taken``: the payload bytes of the batch just taken.

        Its bytes are counted when the held batches reach 1,024, 2,048, ... or when the bytes taken since the last
        count reach the cap's room left, or an eighth of what was counted if more: so what is held never passes
        1.125 times the cap by more than the batch just taken, and each count's O(held) is paid for by the batches
        or bytes taken before it. Amortised O(1) a batch."""
        self.taken += taken + HELD_ENTRY_BYTES
        s = self.state
        held = len(s.held) + len(self.replay.beyond) + len(s.doubtful)
        if self.mode is Mode.LIVE or (held < self.size_check_at and self.taken < self.bytes_check_at):
            return None
        size = _bytes(s.held) + _bytes(self.replay.beyond) + _bytes(s.doubtful)
        if size <= MAX_HELD_BYTES:
            self.size_check_at = max(2 * held, _FIRST_SIZE_CHECK)
            self.bytes_check_at, self.taken = max(MAX_HELD_BYTES - size, size // 8), 0
            return None
        self._count_afresh()
        self._fresh_socket()  # (the rest of this answer is not taken)
        reason = f"{held} batches ({size >> 20} MiB) held while a {self.mode.name.lower()} went on"
        return self.unrecoverable(reason, now, out) if self.mode is Mode.REPLAY else self._give_up(reason, now, out)

    def _count_afresh(self) -> None:
        """A new request: :meth:`overheld` counts from nothing, or, where batches set aside are still held, at the
        next batch taken. O(1)."""
        s = self.state
        carried = len(s.held) + len(self.replay.beyond) + len(s.doubtful)
        self.size_check_at, self.bytes_check_at, self.taken = _FIRST_SIZE_CHECK, 0 if carried else MAX_HELD_BYTES, 0

    def resync(self, reason: str, now: float, out: list[Delivery]) -> Held:
        """The consumer wants the stream from scratch (the owner checked nothing is pending): a full replay from
        seq 0, else a dump, else the stream marked partial; deferred inside the backoff (a dump-capable stream
        gets its dump once it has passed). O(1)."""
        if not self._resync_allowed(now):
            self.dump_due = self.can_dump
            return []
        if not self.can_replay:
            return self.unrecoverable(reason, now, out)  # (which counts it)
        self.state.stats.resyncs += 1
        out.append(ResyncStarted(self.state.stream, reason))
        self.state.expected = 0
        self.state.history.forget_digests()
        return self.replay_from(0, now, out, resyncing=True)

    def tick(self, now: float, out: list[Delivery]) -> Held | None:
        """A deferred dump once the backoff allows it, and the pending request's deadline; None if the stream is
        live with no dump due (the owner's idle checks may run). O(1)."""
        if self.mode is Mode.LIVE:
            if self.dump_due and now >= self.pace.next_at:
                self.dump_due = False
                return self.unrecoverable("deferred resync", now, out)
            return None
        return self._timed_out(now, out) if now >= self.deadline else []

    def owe_nothing(self) -> None:
        """The publisher's state is being announced whole from its seq 0 (``StreamTracker._fresh_start``): no dump
        is owed it, and none failed for it. O(1)."""
        self.dump_due = False
        self.failed_dumps = 0

    def disconnect(self) -> None:
        """The live socket lost its peer, and the replay socket most likely the same one: the pending request
        could vanish, so it goes again on a fresh socket. The peer may be a restarted publisher, whose seqs would
        follow the old one's seamlessly: once anything was delivered, the replay asks again as a check, from the
        last seq delivered (:meth:`_ask_again`). O(1)."""
        self._fresh_socket()
        # (the batches it was to settle, or to check below the seq expected, went with the connection, and what an
        # answer over it held past a loss says nothing of a publisher that may have restarted since)
        r = self.replay
        r.settle = r.below = False
        r.forget_answer()
        if self.mode is Mode.REPLAY and self.state.expected is not None:
            if self.state.expected:
                r.verify, r.checked = True, False
            self._ask_again()
        elif self.mode is Mode.DUMP:
            self._dump_again()

    def _fresh_socket(self) -> None:
        """The owner recreates the replay socket before it sends the outbox: requests not sent yet are for the
        request about to be asked again, and would each bring an answer of their own on the new socket (one the
        stream could take for the answer to a later request), so they go. O(1)."""
        self.reset_socket = True
        self.outbox.clear()

    def _ask_again(self) -> None:
        """Sends the pending replay request again: from the first seq missing, or, while its check is pending
        (``verify``: the answer's first batch is compared with the last one delivered), from the one before.
        O(1)."""
        expected = self.state.expected
        assert expected is not None, "replaying while no seq is expected"
        self.outbox.append(pack_seq(expected - 1 if self.replay.verify else expected))

    def _timed_out(self, now: float, out: list[Delivery]) -> Held:
        """The pending replay or dump went quiet past its deadline: asked again, or given up (a check for a seq
        going back that was never answered: a restart)."""
        self._fresh_socket()
        r = self.replay
        if self.mode is Mode.REPLAY and r.progress:
            self._reask(now)  # the answer made progress, then stalled: frames were dropped
        elif self.mode is Mode.REPLAY and r.probe:
            # An idle probe went unanswered (the publisher may be busy with a dump for another
            # client): nothing is known to be missing, so nothing changes.
            self.state.stats.probe_timeouts += 1
            self.mode = Mode.LIVE
            r.done()
            return self.state.take_held()
        elif self.tries < self.attempts:
            self.tries += 1
            self.deadline = now + self.timeout_s
            if self.mode is Mode.REPLAY:
                r.fresh_answer()
                self._ask_again()
            else:
                self._dump_again()
        elif self.mode is Mode.REPLAY and r.below and r.verify:
            # A seq went back and the publisher never answered whether it still holds the last batch delivered:
            # a new process is assumed (its replay socket not up yet, or the request went down the old connection),
            # as when an answer comes back empty.
            self._check_failed(-1, out)
            return self.replay_from(0, now, out)
        elif self.mode is Mode.REPLAY:
            return self.unrecoverable("replay timed out", now, out)
        else:
            return self._give_up("state dump timed out", now, out)
        return []

    # --- replay ------------------------------------------------------------------------------

    def _reask(self, now: float) -> None:
        """Asks again from the first missing seq on a fresh socket (frames were dropped). O(1).

        An answer that delivered something starts the count of attempts afresh.
        """
        assert self.state.expected is not None, "re-asking while no seq is expected"
        self.state.stats.reasks += 1
        self._fresh_socket()
        if self.replay.progress:
            self.tries = 1
        self.replay.fresh_answer()
        self.deadline = now + self.timeout_s
        self._ask_again()

    def _replayed(self, seq: int, payload: bytes, out: list[Delivery]) -> None:
        s, r = self.state, self.replay
        assert s.expected is not None, "replay answer while no seq is expected"
        if r.verify:
            r.verify = False
            if seq == s.expected - 1 and s.history.holds(seq, payload):
                r.checked = True
                return  # same publisher: the replay goes on as usual
            if seq < s.expected:
                self._check_failed(seq, out)
            else:
                # The answer starts past the batch asked for: the buffer no longer reaches back that far (a router
                # resumed from a snapshot older than it, or away longer than it lasts). A restarted publisher's seq
                # goes back, so its answer would hold other content there or end before it: no restart is known.
                # Nor is the same process: one restarted since may have published past it already. Either way
                # what came before this batch is lost for good (the worker is dumped, or cleared once and marked
                # partial, keeping what it remembers of its blocks), never taken as a seamless continuation.
                r.frames += 1
                r.lost = r.lost_at_check = True
                r.beyond.append((seq, payload))
                return
        if r.take(seq, payload, s.expected) and not s.deliver(seq, payload, "replay", out):
            self.undecodable = f"seq {seq} did not decode"  # (a loss once the replay is over: lost_batch)

    def _check_failed(self, seq: int, out: list[Delivery]) -> None:
        """The check's answer (first batch ``seq``, -1 if none) did not hold the last batch delivered: a new
        publisher, or, where no digest of that batch is known, one that cannot be told from the same."""
        s = self.state
        assert s.expected, "a check with no seq delivered"
        if s.history.digest_at(s.expected - 1) is None:
            self._unverifiable(out)
        else:
            self._on_new_publisher(seq, out)

    def _on_new_publisher(self, seq: int, out: list[Delivery]) -> None:
        """The check found a new process: it is replayed from 0. Batches held at or past the seq expected may be
        the old process's (its last, overtaken by the restart when no disconnect was seen), and what an answer held
        past a loss was the old one's: they go (the replay fetches the new one's), as do duplicates and stragglers.
        Those held below it that are neither are the new process's: kept. O(h)."""
        s = self.state
        old = s.expected
        s.held = [(q, p) for q, p in s.held if old is not None and q < old and s.history.foreign(q, p)]
        self.replay.forget_answer()
        s.new_publisher(seq, 0, out)
        self.replay.restarted = True

    def _unverifiable(self, out: list[Delivery]) -> None:
        """The check has nothing to compare with: the last seq delivered came with a state dump, which carries no
        batch of its own (or a resumed position saved then). A publisher that restarted since cannot be told from
        the same one, so the stream is resynchronised from seq 0 as after a restart, and counted as a resync. What
        is held goes (the replay from 0 fetches whatever is current): a batch whose seq went back, which started the
        check, may be a corrupt seq as well as a new process's, and continued from after a loss it would stand at a
        seq not its own."""
        s = self.state
        assert s.expected, "a check with no seq delivered"
        s.held = []
        self.replay.forget_answer()
        s.stats.resyncs += 1
        out.append(ResyncStarted(s.stream, f"the publisher cannot be checked: seq {s.expected - 1} came with a "
                                           "state dump, whose content no replay can be compared with"))
        s.history.forget_digests()
        s.expected = 0
        self.replay.restarted = True

    def _finish_replay(self, now: float, out: list[Delivery]) -> Held:
        s, r = self.state, self.replay
        assert s.expected is not None, "replay finished while no seq is expected"
        if r.verify:  # nothing came back to compare with: assume the worst
            r.verify = False
            self._check_failed(-1, out)
        if r.restarted:
            return self.replay_from(0, now, out)
        if r.lost:
            first = r.beyond[0][0]
            return self.unrecoverable(
                f"replay from seq {s.expected} started at seq {first}: the publisher's buffer no longer holds the "
                "batches between" if first > s.expected else f"the publisher's buffer no longer holds seq "
                f"{s.expected - 1}, the last one applied: a restart since cannot be ruled out", now, out)
        # Held batches the replay delivered (or stragglers) are dropped. One below the seq expected that is neither
        # is a corrupt seq once a check asked for such a batch passed (the publisher still holds what was delivered),
        # else kept for the live path (a new process's after a reconnect, else checked).
        pending: Held = []
        for q, p in s.take_held():
            if q >= s.expected:
                pending.append((q, p))
            elif not s.history.foreign(q, p):
                continue
            elif r.below and r.checked:
                s.bogus(q, "below the seq expected, yet the publisher still holds the last batch delivered", out)
            else:
                pending.append((q, p))
        if r.hole or (pending and pending[0][0] > s.expected):
            # Frames were dropped, or the answer ended before the held messages: ask again from the
            # first missing seq. An answer that delivered something never counts against `attempts`.
            s.held = pending
            if r.progress:
                self._reask(now)
            elif self.tries < self.attempts:
                self.tries += 1
                self._reask(now)
            elif not r.hole and not r.beyond and r.settle and s.doubtful and s.expected == r.start:
                return self._confirm_doubtful(now, out)
            elif not r.hole and not r.beyond:
                self._doubt(now, out)
            else:
                return self.unrecoverable(f"replay from seq {s.expected} came back short {self.tries} times",
                                          now, out)
            return []
        self.mode = Mode.LIVE
        if r.for_gap:
            s.stats.gaps_filled += 1
            out.append(GapFilled(s.stream, r.start, s.expected - 1))
        r.done()
        self._lost_undecodable(now, out)  # (a dump it starts holds what is pending, as the live path would)
        return pending

    def _doubt(self, now: float, out: list[Delivery]) -> None:
        """The answers, asked ``attempts`` times, held no batch at or past the seq expected, yet live batches past it
        are held. A publisher buffers each batch as it publishes it and answers with every buffered batch from the
        seq asked, so one that published them would have sent at least the last: its own sequence ends below them.
        They are corrupt seq frames (the batches between are not missing, so jumping to them would drop every batch
        the publisher sends next as a straggler), or real ones of a publisher whose replay keeps nothing. One whose
        payload is a batch delivered already is a corrupt seq, dropped at once (as an honest publisher's corrupt
        frame is: its batch came back in the replay). The rest are set aside, neither delivered nor given up, and
        the stream goes live again at the seq expected: the live batches that follow tell which they were
        (``StreamTracker._settle_doubtful``). What was set aside before is kept (at one seq, the later batch); past
        :data:`MAX_HELD_BYTES`, the highest seqs go as corrupt. O((h + d) log(h + d)) and hashing their payloads."""
        s = self.state
        aside = s.merged(s.doubtful + s.held, "another batch came with the same seq, neither held by the publisher's "
                                              "replay", out)
        s.held = []
        s.doubtful, size = [], 0
        for seq, payload in sorted(aside.items()):
            if s.history.repeats(payload):
                s.bogus(seq, "the payload of a batch delivered already, which the publisher's replay ends before", out)
            elif size + len(payload) + HELD_ENTRY_BYTES > MAX_HELD_BYTES:
                s.bogus(seq, f"set aside past {MAX_HELD_BYTES >> 20} MiB of doubtful batches", out)
            else:
                size += len(payload) + HELD_ENTRY_BYTES
                s.doubtful.append((seq, payload))
        self.mode = Mode.LIVE
        self.replay.done()
        self._lost_undecodable(now, out)  # (a batch an earlier answer delivered: lost all the same)

    def _confirm_doubtful(self, now: float, out: list[Delivery]) -> Held:
        """A replay asked after a live batch went past the batches set aside as doubtful still holds nothing from
        the seq expected on: the publisher's replay keeps nothing, and they are its batches (a corrupt seq's payload
        is one the publisher published, which its replay would hold). The batches between are lost for good: a
        dump, else the stream marked partial, delivering from the first set aside on. O(h + d)."""
        s = self.state
        s.held = sorted(s.merged(s.doubtful + s.held, "another batch came with the same seq", out).items())
        s.doubtful = []
        return self.unrecoverable(
            f"the publisher's replay holds nothing from seq {s.expected} on, yet its batches go on from seq "
            f"{s.held[0][0]}: the batches between are lost for good", now, out)

    def _lost_undecodable(self, now: float, out: list[Delivery]) -> None:
        """The replay just ended: a batch it delivered that did not decode is the loss :meth:`lost_batch` reports.
        O(1)."""
        if self.undecodable is not None:
            reason, self.undecodable = self.undecodable, None
            self.lost_batch(reason, now, out)

    # --- losses for good ---------------------------------------------------------------------

    def _resync_allowed(self, now: float) -> bool:
        """Rate limit: True (and the backoff advanced) if a resync may start now."""
        if self.pace.allow(now):
            return True
        self.state.stats.resyncs_deferred += 1
        return False

    def unrecoverable(self, reason: str, now: float, out: list[Delivery]) -> Held:
        """Events are lost for good: a state dump (rate-limited, unless the replay that failed was a resync,
        counted already) or, without one, the stream marked partial."""
        self.state.stats.resyncs += 1
        resync = self.replay.resyncing
        self.replay.done()  # whatever replay failed is over
        if self.can_dump and not resync and not self._resync_allowed(now):
            self.dump_due = True  # mark partial now, dump when the rate limit allows
        elif self.can_dump:
            self._start_dump(reason, now, out)
            return []
        return self._give_up(reason, now, out)

    def _start_dump(self, reason: str, now: float, out: list[Delivery]) -> None:
        if worth_logging(self.failed_dumps + 1):
            log.warning("stream %s: %s; requesting a state dump%s", self.state.stream, reason,
                        suffix(self.failed_dumps + 1, "the resyncs metric") if self.failed_dumps else "")
        self.mode = Mode.DUMP
        self.dump_seq = None
        self.dump_applied = False
        self.tries = 1
        self.deadline = now + self.timeout_s
        self.outbox.append(DUMP_REQUEST)
        out.append(ResyncStarted(self.state.stream, reason))

    def lost_batch(self, reason: str, now: float, out: list[Delivery]) -> None:
        """A batch delivered in order used up its seq but did not decode: its events are lost for good (asked
        again, the publisher sends the same bytes), a removal among them perhaps. A state dump where the stream
        has one (once the backoff allows: the stream marked partial meanwhile), else the stream marked partial;
        the seqs after it follow on as they come. Live mode only. O(1)."""
        assert self.mode is Mode.LIVE, "a lost batch handled while a recovery is pending"
        self.state.stats.resyncs += 1
        if self.can_dump and self._resync_allowed(now):
            self._start_dump(reason, now, out)
            return
        self.dump_due = self.can_dump  # (the batch was logged as malformed, sparingly: a flood logs no more here)
        out.append(ResyncNeeded(self.state.stream, reason))

    def _give_up(self, reason: str, now: float, out: list[Delivery]) -> Held:
        """The stream marked partial. A dump-capable one keeps asking for a dump, paced by the resync backoff,
        until one comes through (unless its publisher answered without one: :meth:`_finish_dump`): its publisher
        may be gone for now (killed, restarting), and a restarted one would otherwise stay partial for good,
        since nothing else asks it for its state."""
        s, r = self.state, self.replay
        # (thinned by the dumps failed in a row where dumps are asked, else by the losses for good: each counted)
        count = self.failed_dumps + 1 if self.can_dump else s.stats.resyncs
        if worth_logging(count):
            log.warning("stream %s: %s; state marked partial%s%s", s.stream, reason,
                        "; a state dump is asked again as the resync backoff allows" if self.can_dump else "",
                        suffix(count, "the resyncs metric"))
        out.append(ResyncNeeded(s.stream, reason))
        self.mode = Mode.LIVE
        self.dump_applied = False
        if self.can_dump:
            self.failed_dumps += 1
            self.dump_due = True
        # (the replay is done already: unrecoverable ended it, or a dump, which only unrecoverable starts)
        # Continue from the oldest batch still at hand (what the replay returned past the loss,
        # then the held live messages): the consumer rebuilds from there, never from before the seq expected but
        # after a reconnect (a new process's batches then, its first seen).
        # At a seq both hold, the publisher's replay wins: a live frame there with other content has a corrupt seq,
        # as has one whose batch the replay holds at another seq.
        at = {p: q for q, p in r.beyond}
        live: Held = []
        for q, p in s.held:
            if s.expected is not None and q < s.expected and not s.reconnected:
                if s.history.foreign(q, p):
                    s.bogus(q, "below the seq expected at a loss for good", out)
            elif at.get(p, q) != q:
                s.bogus(q, f"the publisher's replay answer holds this batch at seq {at[p]}", out)
            else:
                live.append((q, p))
        by_seq = s.merged(live + r.beyond, "the publisher's replay answer holds another batch at that seq", out)
        r.forget_answer()  # (the answer is used up: its loss now lies in the history)
        held = sorted(by_seq.items())
        s.held = []
        # Batches set aside as doubtful are never continued from (a corrupt seq would wedge the stream): the loss
        # reported here covers them if they were the publisher's.
        s.doubtful = []
        if held and s.expected is not None and held[0][0] > s.expected:
            s.history.give_up(s.expected, held[0][0])
        s.expected = held[0][0] if held else None
        s.lost_all = not held
        return held

    def _dump_again(self) -> None:
        """The pending dump asked again; its answer will stand for whatever state the engine is in then."""
        self.dump_seq = None
        self.outbox.append(DUMP_REQUEST)

    def _dumped(self, seq: int, payload: bytes, out: list[Delivery]) -> None:
        if self.dump_seq is None:
            if self.dump_applied:
                # An answer to the dump asked again: it stands for a later state than the part of the first
                # applied already, which may hold blocks evicted since. The consumer drops that part.
                out.append(ResyncStarted(self.state.stream, "state dump asked again"))
            self.dump_seq = seq
        self.dump_applied = True
        self.state.hand_on(seq, payload, "dump", out, "dump")

    def _finish_dump(self, now: float, out: list[Delivery]) -> Held:
        s = self.state
        if self.dump_seq is None:
            # It answered, with no batch: it cannot dump (an engine marked dump-capable by mistake), so asking
            # again would only clear what its live events rebuild, again and again.
            held = self._give_up("publisher sent no state dump", now, out)
            self.dump_due = False
            return held
        self.mode = Mode.LIVE
        self.dump_applied = False
        self.failed_dumps = 0
        first = s.expected if s.expected is not None else 0  # (the first seq not delivered before the dump)
        s.expected = self.dump_seq + 1
        s.history.dumped(first, s.expected)
        out.append(ResyncDone(s.stream, self.dump_seq))
        return s.take_held()

    def _check(self) -> None:
        """Asserts the recovery's invariants (the tracker's :meth:`_check` calls it)."""
        s = self.state
        if self.mode is Mode.LIVE:
            assert not s.held, f"stream {s.stream}: {len(s.held)} batches held back while live"
            assert not self.replay.purposes, f"stream {s.stream}: a replay's purpose outlived it: {self.replay}"
        elif self.mode is Mode.REPLAY:
            assert s.expected is not None, f"stream {s.stream}: replaying with no seq expected"
        else:
            assert not self.replay.purposes, f"stream {s.stream}: a replay's purpose carried into a dump"
        assert self.mode is Mode.DUMP or not self.dump_applied, f"stream {s.stream}: a dump applied with none pending"
        self.replay._check()
