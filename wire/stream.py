"""Per-stream ordering, gap detection, replay and resynchronisation (no sockets).

:class:`StreamTracker` is the state machine behind one publisher stream. It is
fed live messages, replay replies and clock ticks, and answers with
:data:`Delivery` items for the consumer plus requests for the replay socket.
Keeping it free of sockets makes every path (gap, replay shortfall, restart,
duplicate, timeout, dump) testable deterministically; :mod:`indexer.subscriber`
wires it to ZMQ.

Guarantee: the ``Received`` batches of one stream reach the consumer in strictly
increasing seq order with no seq skipped, except across a ``ResyncStarted`` /
``ResyncNeeded`` / ``PublisherRestarted`` notice, which tells the consumer to
drop what it holds for that stream first.

Replay answers may come back incomplete for two different reasons, told apart by
where the answer starts. If its first batch is past the seq asked for, the
publisher's buffer no longer reaches back: those batches are lost for good. If
it starts where asked but skips or stops early, the publisher dropped frames on
the way (a ZMQ high-water mark: SGLang's replay socket keeps the default of
1,000 messages), so the tracker asks again from the first missing seq, as often
as each answer makes progress. Only a loss for good leads to a dump or to
``ResyncNeeded``; a quiet stream's probe that goes unanswered changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal, NamedTuple, TypeAlias

from kvtier.wire.backoff import Backoff
from kvtier.wire.codec import DecodeError, decode_payload
from kvtier.wire.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
from kvtier.wire.protocol import EventBatch, WorkerId
from kvtier.wire.ratelog import suffix, worth_logging
from kvtier.wire.replayrequest import ReplayRequest
from kvtier.wire.seqhistory import SeqHistory

log = logging.getLogger(__name__)


class StreamId(NamedTuple):
    """One publisher stream: a worker and its data-parallel rank."""

    worker: WorkerId
    dp_rank: int = 0

    def __str__(self) -> str:
        return self.worker if self.dp_rank == 0 else f"{self.worker}/dp{self.dp_rank}"


@dataclass(slots=True, frozen=True)
class Received:
    """A decoded batch to apply, in order."""

    stream: StreamId  # where it came from
    seq: int  # its sequence number (for a dump: the last live seq the dump includes)
    batch: EventBatch  # the events
    source: Literal["live", "replay", "dump"]  # which socket delivered it


@dataclass(slots=True, frozen=True)
class GapDetected:
    """Batches ``expected .. received-1`` were missed on the live socket; replay was asked."""

    stream: StreamId  # the stream with the hole
    expected: int  # first missing seq
    received: int  # seq that revealed the hole


@dataclass(slots=True, frozen=True)
class GapFilled:
    """The replay covered the hole; delivery continues in order."""

    stream: StreamId  # the stream that recovered
    first: int  # first seq recovered
    last: int  # last seq recovered


@dataclass(slots=True, frozen=True)
class PublisherRestarted:
    """The publisher's seq went backwards: a new engine process. Drop the stream's state."""

    stream: StreamId  # the restarted stream
    seq: int  # first seq seen from the new publisher


@dataclass(slots=True, frozen=True)
class ResyncStarted:
    """Events were lost; drop the stream's state now: a full replay or a state dump follows."""

    stream: StreamId  # the stream being resynchronised
    reason: str  # why replay could not recover


@dataclass(slots=True, frozen=True)
class ResyncDone:
    """The state dump was delivered; live delivery resumes after ``seq``."""

    stream: StreamId  # the resynchronised stream
    seq: int  # the last live seq the dump includes


@dataclass(slots=True, frozen=True)
class ResyncNeeded:
    """Events were lost for good and no dump is available: clear the stream, mark it stale."""

    stream: StreamId  # the stream whose state can no longer be trusted
    reason: str  # why


@dataclass(slots=True, frozen=True)
class MalformedFrame:
    """A message that could not be parsed or decoded; counted and skipped."""

    stream: StreamId  # where it came from
    reason: str  # what was wrong with it


Delivery: TypeAlias = (
    Received | GapDetected | GapFilled | PublisherRestarted | ResyncStarted | ResyncDone | ResyncNeeded
    | MalformedFrame
)


class _Mode(Enum):
    LIVE = 0  # delivering live messages as they come
    REPLAY = 1  # waiting for a replay answer; live messages are held back
    DUMP = 2  # waiting for a state dump; live messages are held back


@dataclass(slots=True)
class StreamStats:
    """Counters of one stream, for metrics."""

    received: int = 0  # live messages seen
    delivered: int = 0  # batches handed to the consumer (live, replay and dump)
    duplicates: int = 0  # messages dropped as already delivered
    gaps: int = 0  # holes detected
    gaps_filled: int = 0  # holes recovered by replay
    restarts: int = 0  # publisher restarts seen
    resyncs: int = 0  # dumps requested or partial marks (unrecoverable holes)
    resyncs_deferred: int = 0  # resyncs postponed by the rate limit
    reasks: int = 0  # replay requests repeated from the first missing seq (frames dropped)
    probe_timeouts: int = 0  # idle probes that got no answer (harmless)
    late: int = 0  # live batches that arrived after their seq had been given up for lost
    malformed: int = 0  # frames or payloads that failed to parse


@dataclass(slots=True)
class StreamTracker:
    """Orders one stream's messages; see the module docstring for the guarantee.

    The caller sends :attr:`outbox` requests on the replay socket (and clears it),
    and recreates that socket when :attr:`reset_replay_socket` is set, so a late
    answer to an abandoned request can never be mistaken for a new one. What was
    delivered lately is :class:`~kvtier.wire.seqhistory.SeqHistory`'s, the pending
    replay's answer :class:`~kvtier.wire.replayrequest.ReplayRequest`'s, the pace of
    resyncs :class:`~kvtier.wire.backoff.Backoff`'s.
    """

    stream: StreamId  # identity of the stream
    can_replay: bool  # the publisher has a replay socket
    can_dump: bool  # the publisher answers DUMP_REQUEST (kvtier engines)
    timeout_s: float = 2.0  # how long to wait for a replay or dump answer to start, or a dump to go on
    stall_s: float = 0.5  # a replay answer that made progress and then went quiet this long is re-asked
    attempts: int = 3  # requests sent (on fresh sockets) without progress before giving up
    probe_s: float | None = 1.0  # after this long without traffic, ask for anything past `expected`
    resync_backoff_s: float = 1.0  # least time between two resyncs; doubles while they repeat
    resync_backoff_max_s: float = 60.0  # the backoff's ceiling
    expected: int | None = None  # next seq to deliver; None before the first message
    stats: StreamStats = field(default_factory=StreamStats)  # counters
    outbox: list[bytes] = field(default_factory=list)  # requests for the replay socket
    reset_replay_socket: bool = False  # set when an answer is abandoned
    _mode: _Mode = _Mode.LIVE  # see _Mode
    _held: list[tuple[int, bytes]] = field(default_factory=list)  # live messages held back
    _deadline: float = 0.0  # when the pending request times out
    _tries: int = 0  # requests sent for the pending replay or dump
    _replay: ReplayRequest = field(default_factory=ReplayRequest)  # the pending (or last) replay
    _history: SeqHistory = field(default_factory=SeqHistory)  # digests of recent seqs, ranges given up
    _pace: Backoff = field(init=False)  # when the next resync may start (from the resync_backoff fields)
    _dump_due: bool = False  # a dump was wanted while rate-limited: start it once allowed
    _dump_seq: int | None = None  # last live seq the incoming dump includes
    _suspect: bool = False  # the live socket reconnected: the publisher may be a new process
    _last_seen: float = 0.0  # when the stream last showed activity (for tail probes)

    def __post_init__(self) -> None:
        if self.can_dump and not self.can_replay:
            raise ValueError(f"stream {self.stream}: a state dump is asked on the replay socket: no dump without one")
        self._pace = Backoff(self.resync_backoff_s, self.resync_backoff_max_s)

    # --- inputs --------------------------------------------------------------------------

    def on_live(self, seq: int, payload: bytes, now: float) -> list[Delivery]:
        """A live message arrived. Amortised O(1) plus decoding."""
        self.stats.received += 1
        self._last_seen = now
        out: list[Delivery] = []
        self._live(seq, payload, now, out)
        return out

    def on_reply(self, seq_frame: bytes, payload: bytes, now: float) -> list[Delivery]:
        """A frame pair arrived on the replay socket (a batch or the end marker)."""
        out: list[Delivery] = []
        if self._mode is _Mode.LIVE:
            return out  # an answer nobody waits for any more
        self._last_seen = now
        # Every frame shows the answer is flowing: a big replay or dump is not timed as a whole.
        self._deadline = now + (self.stall_s if self._mode is _Mode.REPLAY else self.timeout_s)
        if seq_frame == END_SEQ:
            if self._mode is _Mode.REPLAY:
                self._finish_replay(now, out)
            else:
                self._finish_dump(now, out)
            return out
        try:
            seq = unpack_seq(seq_frame)
        except ValueError as exc:
            self._malformed(f"replay answer: {exc}", out)
            return out
        if self._mode is _Mode.REPLAY:
            self._replayed(seq, payload, out)
        else:
            self._dumped(seq, payload, out)
        return out

    def start(self, now: float) -> None:
        """Catches up on join: asks for everything from seq 0 before the first live message.

        Without this, a stream whose first messages were lost while the socket
        connected would stay unknown until the publisher sent again.
        """
        if self.can_replay and self.expected is None and self._mode is _Mode.LIVE:
            self.expected = 0
            self._start_replay(0, now, [])

    def position(self) -> tuple[int, int | None] | None:
        """``(next seq, digest of the last delivered batch)`` for a snapshot of the consumer's state
        (digest None right after a state dump, which carries no batch of its own); None while nothing
        was delivered or a recovery is under way. O(1)."""
        if self._mode is not _Mode.LIVE or not self.expected:
            return None
        return self.expected, self._history.digest_at(self.expected - 1)

    def resume(self, position: tuple[int, int | None], now: float) -> None:
        """Continues from a snapshot's :meth:`position` instead of :meth:`start`. With a digest it first
        checks, by replay, that the publisher still holds the same batch at the last applied seq (else
        it is a new process: ``PublisherRestarted`` and a replay from 0), then replays what came after.
        Without one it replays from the next seq; a publisher that restarted meanwhile is then caught
        only if it has not yet published past the saved seq (its next batch goes backwards)."""
        expected, known = position
        assert expected >= 1 and self.expected is None, "resume() replaces start() on a fresh tracker"
        self.expected = expected
        if known is None:
            if self.can_replay:
                self._start_replay(expected, now, [])
            return
        self._history.vouch(expected - 1, known)
        if self.can_replay:
            self._start_replay(expected - 1, now, [], verify=True)

    def next_tick(self) -> float | None:
        """When :meth:`on_tick` next has something to do (a deadline, a deferred dump, an idle probe),
        or None. For owners that schedule ticks instead of polling (the simulator). O(1)."""
        if self._mode is not _Mode.LIVE:
            return self._deadline
        if self._dump_due:
            return self._pace.next_at
        if self._suspect and self.expected and self.can_replay:
            return self._last_seen
        if self.probe_s is not None and self.can_replay and self.expected is not None:
            return self._last_seen + self.probe_s
        return None

    @property
    def needs_tick(self) -> bool:
        """:meth:`on_tick` has work due at :meth:`next_tick` beyond an optional idle probe. O(1)."""
        return self._mode is not _Mode.LIVE or self._dump_due or bool(self._suspect and self.expected)

    @property
    def recovering(self) -> bool:
        """A catch-up, full replay or dump is under way: the consumer's view is incomplete. O(1)."""
        return self._mode is not _Mode.LIVE and not self._replay.probe

    def request_resync(self, reason: str, now: float) -> list[Delivery]:
        """The consumer found its state inconsistent and wants it again from scratch.

        Tries, in order: a full replay from seq 0, a state dump, marking the stream
        partial. Ignored while a replay or dump is already under way; rate-limited
        (see :attr:`resync_backoff_s`): a request inside the backoff is deferred, and
        a dump-capable stream gets its dump once the backoff has passed.
        """
        out: list[Delivery] = []
        if self._mode is not _Mode.LIVE:
            return out
        if not self._resync_allowed(now):
            self._dump_due = self.can_dump
            return out
        self.stats.resyncs += 1
        if not self.can_replay:
            self._unrecoverable(reason, now, out)
            return out
        out.append(ResyncStarted(self.stream, reason))
        self.expected = 0
        self._history.forget_digests()
        self._start_replay(0, now, out, resyncing=True)
        return out

    def on_disconnect(self) -> None:
        """The live socket lost its connection. O(1).

        A publisher that restarts and whose first ``expected`` messages are lost
        while the socket reconnects looks seamless by seq alone; so the next live
        message after a reconnect first checks, by replay, that the publisher
        still holds the same content for the last seq delivered.
        """
        if self.expected:
            self._suspect = True
        # Messages held back came over the connection that dropped: if the publisher restarted
        # they are stale. Dropping them is always safe, a replay fetches whatever is current.
        self._held.clear()
        # The replay socket most likely lost the same peer: a request on it could vanish, so ask
        # again on a fresh socket.
        self.reset_replay_socket = True
        if self._mode is _Mode.REPLAY and self.expected is not None:
            self._replay.fresh_answer()
            self.outbox.append(pack_seq(self.expected))
        elif self._mode is _Mode.DUMP:
            self._dump_seq = None
            self.outbox.append(DUMP_REQUEST)

    def on_tick(self, now: float) -> list[Delivery]:
        """Checks the pending request's deadline, and probes a quiet stream. O(1).

        A batch lost on the wire is noticed when a later one arrives; if it was the
        last one for a while, the probe (a replay from ``expected``) finds it.
        """
        out: list[Delivery] = []
        if self._mode is _Mode.LIVE:
            self._tick_live(now, out)
        elif now >= self._deadline:
            self._timed_out(now, out)
        return out

    def _tick_live(self, now: float, out: list[Delivery]) -> None:
        """A deferred dump once the backoff allows it, a check after a reconnect, a probe of a quiet stream."""
        if self._dump_due and now >= self._pace.next_at:
            self._dump_due = False
            self._unrecoverable("deferred resync", now, out)
        elif self._suspect and self.expected and self.can_replay:
            # Reconnected and quiet since: a restarted engine may publish nothing for a long time,
            # so check now whether the publisher still holds what we delivered last.
            self._suspect = False
            self._start_replay(self.expected - 1, now, out, verify=True)
        elif (self.probe_s is not None and self.can_replay and self.expected is not None
                and now - self._last_seen >= self.probe_s):
            self._last_seen = now
            self._start_replay(self.expected, now, out, probe=True)

    def _timed_out(self, now: float, out: list[Delivery]) -> None:
        """The pending replay or dump went quiet past its deadline: asked again, or given up."""
        self.reset_replay_socket = True
        r = self._replay
        if self._mode is _Mode.REPLAY and r.progress:
            self._reask(now)  # the answer made progress, then stalled: frames were dropped
        elif self._mode is _Mode.REPLAY and r.probe:
            # An idle probe went unanswered (the publisher may be busy with a dump for another
            # client): nothing is known to be missing, so nothing changes.
            self.stats.probe_timeouts += 1
            self._mode = _Mode.LIVE
            r.done()
            self._drain_held(now, out)
        elif self._tries < self.attempts:
            self._tries += 1
            self._deadline = now + self.timeout_s
            if self._mode is _Mode.REPLAY:
                assert self.expected is not None, "replaying while no seq is expected"
                r.fresh_answer()
                self.outbox.append(pack_seq(self.expected))
            else:
                self.outbox.append(DUMP_REQUEST)
        elif self._mode is _Mode.REPLAY:
            self._unrecoverable("replay timed out", now, out)
        else:
            self._give_up("state dump timed out", now, out)

    # --- live path -----------------------------------------------------------------------

    def _live(self, seq: int, payload: bytes, now: float, out: list[Delivery]) -> None:
        if self._mode is not _Mode.LIVE:
            self._held.append((seq, payload))
            return
        if self.expected is not None and seq < self.expected:
            if self._history.holds(seq, payload):
                self.stats.duplicates += 1
                return
            if self._history.gave_up(seq):
                # A straggler of batches already given up for lost (a replay answer overtook it):
                # applying it now, after later batches, could resurrect removed blocks.
                self.stats.late += 1
                return
            # A PUB socket never repeats a seq with new content: the publisher restarted.
            self.stats.restarts += 1
            out.append(PublisherRestarted(self.stream, seq))
            self.expected = None
            self._history.forget()
        if self.expected is None and seq == 0:
            self.expected = 0
        if self._suspect and self.expected and self.can_replay:
            self._suspect = False
            self._held.append((seq, payload))
            self._start_replay(self.expected - 1, now, out, verify=True)
            return
        if seq == self.expected:
            self._deliver(seq, payload, "live", out)
            return
        first_missing = 0 if self.expected is None else self.expected
        self.stats.gaps += 1
        out.append(GapDetected(self.stream, first_missing, seq))
        self._held.append((seq, payload))
        self.expected = first_missing
        self._start_replay(first_missing, now, out, for_gap=True)

    def _deliver(self, seq: int, payload: bytes, source: Literal["live", "replay"],
                 out: list[Delivery]) -> None:
        self.expected = seq + 1
        self._history.delivered(seq, payload)
        try:
            batch = decode_payload(payload, packed_tokens=True)
        except DecodeError as exc:
            self._malformed(f"seq {seq}: {exc}", out)
            return
        self.stats.delivered += 1
        out.append(Received(self.stream, seq, batch, source))

    def on_malformed(self, reason: str) -> list[Delivery]:
        """A frame the caller could not even parse (wrong frame count, bad seq frame): counted,
        logged sparingly, reported. O(1)."""
        out: list[Delivery] = []
        self._malformed(reason, out)
        return out

    def _malformed(self, reason: str, out: list[Delivery]) -> None:
        self.stats.malformed += 1
        if worth_logging(self.stats.malformed):
            log.warning("stream %s: malformed message: %s%s", self.stream, reason, suffix(self.stats.malformed))
        out.append(MalformedFrame(self.stream, reason))

    # --- replay path ---------------------------------------------------------------------

    def _start_replay(self, start: int, now: float, out: list[Delivery], *, for_gap: bool = False,
                      probe: bool = False, resyncing: bool = False, verify: bool = False) -> None:
        """Asks for every batch from ``start``, for what the flags say (:class:`ReplayRequest`)."""
        if not self.can_replay:
            self._unrecoverable("no replay socket", now, out)
            return
        self._mode = _Mode.REPLAY
        self._replay.ask(start, for_gap=for_gap, probe=probe, resyncing=resyncing, verify=verify)
        self._tries = 1
        self._deadline = now + self.timeout_s
        self.outbox.append(pack_seq(start))

    def _reask(self, now: float) -> None:
        """Asks again from the first missing seq on a fresh socket (frames were dropped). O(1).

        An answer that delivered something starts the count of attempts afresh.
        """
        assert self.expected is not None, "re-asking while no seq is expected"
        self.stats.reasks += 1
        self.reset_replay_socket = True
        if self._replay.progress:
            self._tries = 1
        self._replay.fresh_answer()
        self._deadline = now + self.timeout_s
        self.outbox.append(pack_seq(self.expected))

    def _replayed(self, seq: int, payload: bytes, out: list[Delivery]) -> None:
        assert self.expected is not None, "replay answer while no seq is expected"
        r = self._replay
        if r.verify:
            r.verify = False
            if seq == self.expected - 1 and self._history.holds(seq, payload):
                return  # same publisher: the replay goes on as usual
            self._on_new_publisher(seq, out)
        if r.take(seq, payload, self.expected):
            self._deliver(seq, payload, "replay", out)

    def _on_new_publisher(self, seq: int, out: list[Delivery]) -> None:
        self.stats.restarts += 1
        out.append(PublisherRestarted(self.stream, seq))
        self._history.forget()
        self.expected = 0
        self._replay.restarted = True

    def _finish_replay(self, now: float, out: list[Delivery]) -> None:
        assert self.expected is not None, "replay finished while no seq is expected"
        r = self._replay
        if r.verify:  # nothing came back to compare with: assume the worst
            r.verify = False
            self._on_new_publisher(-1, out)
        if r.restarted:
            self._start_replay(0, now, out)
            return
        if r.lost:
            self._unrecoverable(f"replay from seq {self.expected} started at seq {r.beyond[0][0]}: "
                                "the publisher's buffer no longer holds the batches between", now, out)
            return
        held = sorted(self._held)
        self._held = []
        pending = [(s, p) for s, p in held if s >= self.expected]
        if r.hole or (pending and pending[0][0] > self.expected):
            # Frames were dropped, or the answer ended before the held messages: ask again from the
            # first missing seq. An answer that delivered something never counts against `attempts`.
            self._held = pending
            if r.progress:
                self._reask(now)
            elif self._tries < self.attempts:
                self._tries += 1
                self._reask(now)
            else:
                self._unrecoverable(f"replay from seq {self.expected} came back short {self._tries} times",
                                    now, out)
            return
        self._mode = _Mode.LIVE
        if r.for_gap:
            self.stats.gaps_filled += 1
            out.append(GapFilled(self.stream, r.start, self.expected - 1))
        r.done()
        self._drain(pending, now, out)

    def _drain(self, pending: list[tuple[int, bytes]], now: float, out: list[Delivery]) -> None:
        for i, (seq, payload) in enumerate(pending):
            if self.expected is not None and seq < self.expected:
                continue  # already delivered by the replay or included in the dump
            self._live(seq, payload, now, out)
            if self._mode is not _Mode.LIVE:  # a new hole inside the held messages
                self._held.extend(pending[i + 1:])
                return

    # --- resynchronisation ---------------------------------------------------------------

    def _resync_allowed(self, now: float) -> bool:
        """Rate limit: True (and the backoff advanced) if a resync may start now."""
        if self._pace.allow(now):
            return True
        self.stats.resyncs_deferred += 1
        return False

    def _unrecoverable(self, reason: str, now: float, out: list[Delivery]) -> None:
        """Events are lost for good: a state dump (rate-limited, unless the replay that failed was a resync,
        counted already) or, without one, the stream marked partial."""
        self.stats.resyncs += 1
        resync = self._replay.resyncing
        self._replay.done()  # whatever replay failed is over
        if self.can_dump and not resync and not self._resync_allowed(now):
            self._dump_due = True  # mark partial now, dump when the rate limit allows
        elif self.can_dump:
            log.warning("stream %s: %s; requesting a state dump", self.stream, reason)
            self._mode = _Mode.DUMP
            self._dump_seq = None
            self._tries = 1
            self._deadline = now + self.timeout_s
            self.outbox.append(DUMP_REQUEST)
            out.append(ResyncStarted(self.stream, reason))
            return
        self._give_up(reason, now, out)

    def _give_up(self, reason: str, now: float, out: list[Delivery]) -> None:
        log.warning("stream %s: %s; state marked partial", self.stream, reason)
        out.append(ResyncNeeded(self.stream, reason))
        self._mode = _Mode.LIVE
        r = self._replay  # (done already: _unrecoverable ended it, or a dump, which only _unrecoverable starts)
        # Continue from the oldest batch still at hand (what the replay returned past the loss,
        # then the held live messages): the consumer rebuilds from there.
        by_seq = dict(r.beyond)
        r.beyond = []
        r.fresh_answer()  # (the answer is used up: its loss now lies in the history)
        by_seq.update(self._held)
        held = sorted(by_seq.items())
        self._held = []
        if held and self.expected is not None and held[0][0] > self.expected:
            self._history.give_up(self.expected, held[0][0])
        self.expected = held[0][0] if held else None
        self._drain(held, now, out)

    def _drain_held(self, now: float, out: list[Delivery]) -> None:
        held = sorted(self._held)
        self._held = []
        self._drain(held, now, out)

    def _dumped(self, seq: int, payload: bytes, out: list[Delivery]) -> None:
        if self._dump_seq is None:
            self._dump_seq = seq
        try:
            batch = decode_payload(payload, packed_tokens=True)
        except DecodeError as exc:
            self._malformed(f"dump: {exc}", out)
            return
        self.stats.delivered += 1
        out.append(Received(self.stream, seq, batch, "dump"))

    def _finish_dump(self, now: float, out: list[Delivery]) -> None:
        if self._dump_seq is None:
            self._give_up("publisher sent no state dump", now, out)
            return
        self._mode = _Mode.LIVE
        self.expected = self._dump_seq + 1
        self._history.forget_digests()
        out.append(ResyncDone(self.stream, self._dump_seq))
        held = sorted(self._held)
        self._held = []
        self._drain(held, now, out)

    def _check(self) -> None:
        """Asserts the tracker's invariants (tests call it between steps)."""
        if self._mode is _Mode.LIVE:
            assert not self._held, f"stream {self.stream}: {len(self._held)} batches held back while live"
            assert not self._replay.purposes, f"stream {self.stream}: a replay's purpose outlived it: {self._replay}"
        elif self._mode is _Mode.REPLAY:
            assert self.expected is not None, f"stream {self.stream}: replaying with no seq expected"
        else:
            assert not self._replay.purposes, f"stream {self.stream}: a replay's purpose carried into a dump"
        self._replay._check()
        self._history._check()
