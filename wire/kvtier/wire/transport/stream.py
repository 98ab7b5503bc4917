"""Per-stream ordering, gap detection, replay and resynchronisation (no sockets).

:class:`StreamTracker` is the state machine behind one publisher stream. It is
fed live messages, replay replies and clock ticks, and answers with
:data:`Delivery` items for the consumer plus requests for the replay socket.
Keeping it free of sockets makes every path (gap, replay shortfall, restart,
duplicate, timeout, dump) testable deterministically; :mod:`kvtier.wire.transport.subscriber`
wires it to ZMQ.

Guarantee: the ``Received`` batches of one stream reach the consumer in strictly
increasing seq order with no seq skipped, except across a ``ResyncStarted`` /
``ResyncNeeded`` / ``PublisherRestarted`` notice, which tells the consumer to
drop what it holds for that stream first.

What was delivered and is held back is :class:`~kvtier.wire.transport.streamstate.StreamState`; how a stream gets back
what it missed (replays, dumps, resyncs) is :class:`~kvtier.wire.transport.recovery.StreamRecovery`.
"""

from __future__ import annotations

from kvtier.wire.notices import Delivery, GapDetected, ResyncStarted, StreamId, StreamStats
from kvtier.wire.transport.backoff import Backoff
from kvtier.wire.transport.recovery import Mode, StreamRecovery
from kvtier.wire.transport.streamstate import Held, StreamState

__all__ = ["StreamTracker"]


class StreamTracker:
    """Orders one stream's messages; see the module docstring for the guarantee.

    The caller sends :attr:`outbox` requests on the replay socket (and clears it),
    and recreates that socket when :attr:`reset_replay_socket` is set, so a late
    answer to an abandoned request can never be mistaken for a new one. Live
    messages go through :meth:`_live`, the one place that delivers, drops or holds
    them; a recovery that ends hands its held batches back to it (:meth:`_drain`).
    """

    __slots__ = ("_connected", "_heard", "_last_seen", "_recovery", "_state", "_suspect", "probe_s")

    def __init__(self, stream: StreamId, can_replay: bool, can_dump: bool, *, timeout_s: float = 2.0,
                 stall_s: float = 0.5, attempts: int = 3, probe_s: float | None = 1.0,
                 resync_backoff_s: float = 1.0, resync_backoff_max_s: float = 60.0) -> None:
        """``can_replay``: the publisher has a replay socket; ``can_dump``: it answers DUMP_REQUEST (kvtier
        engines). ``timeout_s``: how long to wait for a replay or dump answer to start, or a dump to go on;
        ``stall_s``: a replay answer that made progress and then went quiet this long is re-asked;
        ``attempts``: requests sent (on fresh sockets) without progress before giving up; ``probe_s``: after
        this long without traffic, ask for anything past :attr:`expected` (None: never); the resync backoff:
        least time between two resyncs, doubling while they repeat, up to its ceiling."""
        if can_dump and not can_replay:
            raise ValueError(f"stream {stream}: a state dump is asked on the replay socket: no dump without one")
        self._state = StreamState(stream)  # what was delivered, what is held back
        self._recovery = StreamRecovery(self._state, can_replay, can_dump, timeout_s, stall_s, attempts,
                                        Backoff(resync_backoff_s, resync_backoff_max_s))  # replays, dumps, resyncs
        self.probe_s = probe_s  # after this long without traffic, ask for anything past `expected`
        self._suspect = False  # the live socket reconnected: the publisher may be a new process
        self._last_seen = 0.0  # when the stream last showed activity (for tail probes)
        self._heard: float | None = None  # when the publisher last sent anything (a batch or an answer)
        self._connected = False  # the live socket holds a connection to the publisher (the subscriber's monitor)

    @property
    def stream(self) -> StreamId:
        """Identity of the stream."""
        return self._state.stream

    @property
    def stats(self) -> StreamStats:
        """The stream's counters."""
        return self._state.stats

    @property
    def expected(self) -> int | None:
        """Next seq to deliver; None before the first message."""
        return self._state.expected

    @expected.setter
    def expected(self, seq: int | None) -> None:
        # (for an owner that joined before the publisher's first batch: nothing to catch up on)
        self._state.expected = seq

    @property
    def attempts(self) -> int:
        """Requests sent without progress before a replay or dump is given up."""
        return self._recovery.attempts

    @property
    def outbox(self) -> list[bytes]:
        """Requests for the replay socket, oldest first; the caller sends and clears them."""
        return self._recovery.outbox

    @property
    def reset_replay_socket(self) -> bool:
        """Set when an answer is abandoned: the caller recreates the replay socket and clears the flag."""
        return self._recovery.reset_socket

    @reset_replay_socket.setter
    def reset_replay_socket(self, value: bool) -> None:
        self._recovery.reset_socket = value

    # --- inputs --------------------------------------------------------------------------

    def on_live(self, seq: int, payload: bytes, now: float) -> list[Delivery]:
        """A live message arrived. Amortised O(1) plus decoding."""
        self._state.stats.received += 1
        self._last_seen = self._heard = now
        out: list[Delivery] = []
        self._live(seq, payload, now, out)
        self._bound_held(now, out, len(payload))
        return out

    def on_reply(self, seq_frame: bytes, payload: bytes, now: float) -> list[Delivery]:
        """A frame pair arrived on the replay socket (a batch or the end marker)."""
        out: list[Delivery] = []
        self._heard = now  # (even a late answer shows the publisher is there)
        if not self._recovery.active:
            return out  # an answer nobody waits for any more
        self._last_seen = now
        self._drain(self._recovery.on_reply(seq_frame, payload, now, out), now, out)
        self._bound_held(now, out, len(payload))
        return out

    def _bound_held(self, now: float, out: list[Delivery], taken: int) -> None:
        """Ends a recovery that holds more than :data:`~kvtier.wire.transport.recovery.MAX_HELD_BYTES`; ``taken``: the
        payload bytes of the batch just taken. O(1) amortised."""
        if self._recovery.active:
            held = self._recovery.overheld(now, out, taken)
            if held is not None:
                self._drain(held, now, out, lossy=True)

    def start(self, now: float) -> None:
        """Catches up on join: asks for everything from seq 0 before the first live message.

        Without this, a stream whose first messages were lost while the socket
        connected would stay unknown until the publisher sent again.
        """
        self._heard = now  # (silence is counted from the start)
        if self._recovery.can_replay and self._state.expected is None and not self._recovery.active:
            self._state.expected = 0
            self._recovery.replay_from(0, now, [])

    def position(self) -> tuple[int, int | None] | None:
        """``(next seq, digest of the last delivered batch)`` for a snapshot of the consumer's state
        (digest None right after a state dump, which carries no batch of its own); None while nothing
        was delivered, a state dump is under way, or a replayed batch that did not decode awaits its replay's end
        (the seq expected is past it, and its loss is reported then). A pending replay (an idle probe, a gap's, a
        check's, a resync's from seq 0) holds back what it has not delivered, so the consumer's state is whole up to
        the seq before the one expected: a snapshot taken meanwhile resumes from there (a quiet stream is probed every
        second, and a stream left out of a snapshot is started afresh, partial where the publisher's buffer no longer
        reaches seq 0). A restart found, or a resync begun, expects seq 0 again: nothing delivered. O(1)."""
        s, rec = self._state, self._recovery
        if rec.mode is Mode.DUMP or (rec.mode is Mode.REPLAY and rec.undecodable is not None) or not s.expected:
            return None
        return s.expected, s.history.digest_at(s.expected - 1)

    def resume(self, position: tuple[int, int | None], now: float) -> None:
        """Continues from a snapshot's :meth:`position` instead of :meth:`start`: it first checks, by replay,
        that the publisher still holds the same batch at the last applied seq (other content there, or nothing at
        or past it: a new process, ``PublisherRestarted`` and a replay from 0; an answer that starts past it: a
        buffer that no longer reaches back to the snapshot, which tells no restart, so what came before the answer
        is lost for good), then replays what came after. A position with no digest
        (saved right after a state dump) cannot be checked, and a publisher that restarted meanwhile would look
        the same as one that did not: the check's answer then starts a resync (``ResyncStarted``, a replay
        from 0, else a dump)."""
        expected, known = position
        s, rec = self._state, self._recovery
        self._heard = now  # (silence is counted from the start)
        assert expected >= 1 and s.expected is None, "resume() replaces start() on a fresh tracker"
        s.expected = expected
        s.reconnected = True  # (a new connection: a batch below the position, no straggler, is a new process's)
        if known is not None:
            s.history.vouch(expected - 1, known)
        if rec.can_replay:
            rec.replay_from(expected - 1, now, [], verify=True)

    def next_tick(self) -> float | None:
        """When :meth:`on_tick` next has something to do (a deadline, a deferred dump, an idle probe),
        or None. For owners that schedule ticks instead of polling (the simulator). O(1)."""
        at = self._recovery.next_at()
        if at is not None:
            return at
        if self._checks_publisher:
            return self._last_seen
        if self.probe_s is not None and self._recovery.can_replay and self._state.expected is not None:
            return self._last_seen + self.probe_s
        return None

    @property
    def needs_tick(self) -> bool:
        """:meth:`on_tick` has work due at :meth:`next_tick` beyond an optional idle probe. O(1)."""
        return self._recovery.next_at() is not None or bool(self._suspect and self._state.expected)

    def silent(self, now: float, timeout_s: float) -> bool:
        """The publisher looks gone: nothing came from it, no batch and no answer to a request (an idle
        stream is probed every :attr:`probe_s`), for ``timeout_s`` since it was last heard or since
        :meth:`start`. Never for a stream without a replay socket: nothing can be asked of it, and an idle
        publisher is as silent as a dead one. A stream given up with no batch at hand has nothing to probe
        from: it is heard again at its next batch (or, dump-capable, at the next answer to the dumps it keeps
        asking for), and while its live socket holds a connection to the publisher (:meth:`on_connect`, until
        :meth:`on_disconnect`) it is taken to be up: an engine started after the indexer, idle, would otherwise stay
        gone until it published, and a router sends nothing to a worker it takes for gone. O(1)."""
        if self._connected and self._state.lost_all and self._state.expected is None:
            return False
        return (self._recovery.can_replay and self._heard is not None
                and now - self._heard >= timeout_s)

    @property
    def recovering(self) -> bool:
        """A catch-up, full replay or dump is under way: the consumer's view is incomplete. O(1)."""
        return self._recovery.recovering

    def request_resync(self, reason: str, now: float) -> list[Delivery]:
        """The consumer found its state inconsistent and wants it again from scratch.

        Tries, in order: a full replay from seq 0, a state dump, marking the stream
        partial. Ignored while a replay or dump is already under way; rate-limited
        (``resync_backoff_s``): a request inside the backoff is deferred, and a
        dump-capable stream gets its dump once the backoff has passed.
        """
        out: list[Delivery] = []
        if not self._recovery.active:
            self._drain(self._recovery.resync(reason, now, out), now, out)
        return out

    def on_connect(self, now: float) -> None:
        """The live socket completed a handshake with the publisher: it is up now. O(1)."""
        self._heard = now
        self._connected = True

    def on_disconnect(self) -> None:
        """The live socket lost its connection. O(1).

        A publisher that restarts and whose first ``expected`` messages are lost
        while the socket reconnects looks seamless by seq alone; so the next live
        message after a reconnect first checks, by replay, that the publisher
        still holds the same content for the last seq delivered.
        """
        self._connected = False
        self._state.stats.disconnects += 1
        if self._state.expected:
            self._suspect = True
        # (a check or the recovery under way ends it; with nothing delivered no seq can go back)
        self._state.reconnected = bool(self._state.expected) or self._recovery.active
        self._state.history.uncover()  # (a batch in the last dump's range may now come from a new process)
        # Messages held back came over the connection that dropped: if the publisher restarted
        # they are stale. Dropping them is always safe, a replay fetches whatever is current.
        self._state.held.clear()
        self._state.doubtful.clear()
        self._recovery.disconnect()

    def on_tick(self, now: float) -> list[Delivery]:
        """Checks the pending request's deadline, and probes a quiet stream. O(1).

        A batch lost on the wire is noticed when a later one arrives; if it was the
        last one for a while, the probe (a replay from ``expected``) finds it.
        """
        out: list[Delivery] = []
        s, rec = self._state, self._recovery
        drain = rec.tick(now, out)
        if drain is not None:
            self._drain(drain, now, out)
        elif self._checks_publisher:
            # Reconnected and quiet since: a restarted engine may publish nothing for a long time,
            # so check now whether the publisher still holds what we delivered last.
            assert s.expected is not None, "a check with no seq delivered"
            self._suspect = False
            self._drain(rec.replay_from(s.expected - 1, now, out, verify=True), now, out)
        elif (self.probe_s is not None and rec.can_replay and s.expected is not None
                and now - self._last_seen >= self.probe_s):
            self._last_seen = now
            self._drain(rec.replay_from(s.expected, now, out, probe=True), now, out)
        return out

    def on_malformed(self, reason: str) -> list[Delivery]:
        """A frame the caller could not even parse (wrong frame count, bad seq frame): counted,
        logged sparingly, reported. O(1)."""
        out: list[Delivery] = []
        self._state.malformed(reason, out)
        return out

    # --- live path -----------------------------------------------------------------------

    @property
    def _checks_publisher(self) -> bool:
        """The live socket reconnected after something was delivered: the publisher is to be checked."""
        return bool(self._suspect and self._state.expected and self._recovery.can_replay)

    def _live(self, seq: int, payload: bytes, now: float, out: list[Delivery]) -> None:
        """Live batch ``seq``: held during a recovery; dropped if it is accounted for below the seq expected
        (:meth:`StreamState.passed`) or repeats a batch delivered already (a corrupt seq); below the seq expected
        otherwise, a new process's if it came over a new connection before its check was over, else held for a
        check of the publisher; delivered at the seq expected (after a reconnect's check); past it, a gap and its
        replay. O(1) and hashing it (twice when delivered)."""
        s, rec = self._state, self._recovery
        if rec.active:
            s.held.append((seq, payload))
            return
        # (a straggler is one of batches given up for lost, which a replay answer overtook, or of those the last
        # dump stood for, which its end marker overtook)
        if s.expected is not None and seq < s.expected and s.passed(seq, payload):
            return
        if s.history.repeats(payload):  # (also right after a loss for good: no new process's first batch then)
            # An honest publisher's batch whose seq frame was garbled, which the replay of the gap it left brought
            # back at its own seq: delivered as this seq, the real batch here would later look like a new process's
            s.bogus(seq, "the payload of a batch delivered already", out)
            return
        if s.expected is not None and seq < s.expected:
            if s.reconnected or not rec.can_replay:
                # Reconnected (or nothing can be asked): a PUB socket never repeats a seq with new content, so the
                # publisher restarted.
                s.new_publisher(seq, None, out)
            else:
                # Over the same connection, a seq going back is a corrupt seq frame or a restart whose disconnect
                # has not been seen yet: the publisher is asked whether it still holds the last batch delivered
                # (held batches below the seq expected are corrupt seqs once it does: ``_finish_replay``).
                s.held.append((seq, payload))
                self._drain(rec.replay_from(s.expected - 1, now, out, verify=True, below=True), now, out)
                return
        if s.doubtful:
            self._settle_doubtful(seq, out)
        if s.expected is None and s.lost_all:
            self._fresh_start(seq, out)
        if s.expected is None and seq == 0:
            s.expected = 0
        if self._suspect and self._checks_publisher:  # (the flag first: this runs for every batch)
            assert s.expected is not None, "a check with no seq delivered"
            self._suspect = False
            s.held.append((seq, payload))
            self._drain(rec.replay_from(s.expected - 1, now, out, verify=True), now, out)
            return
        if seq == s.expected:
            if not s.deliver(seq, payload, "live", out):
                rec.lost_batch(f"seq {seq} did not decode", now, out)
            return
        first_missing = 0 if s.expected is None else s.expected
        s.stats.gaps += 1
        out.append(GapDetected(s.stream, first_missing, seq))
        s.held.append((seq, payload))
        s.expected = first_missing
        # (with batches set aside, the replay settles them: :meth:`_settle_doubtful`)
        self._drain(rec.replay_from(first_missing, now, out, for_gap=True, settle=bool(s.doubtful)), now, out)

    def _fresh_start(self, seq: int, out: list[Delivery]) -> None:
        """The stream was given up for lost with nothing to go on from (its publisher down or restarting: nothing
        answered), and live batch ``seq`` came: everything a publisher process holds is announced from its seq 0, this
        batch or the replay from 0 its gap asks for, so the worker's state will be complete again. Reported as a new
        process where this is its seq 0 and batches were delivered before, else as a resync (a replay from 0 that
        fails marks it partial again); what the old connection owed (a check, a dump) is not asked of it. O(1), and
        O(history) forgetting the old process."""
        s = self._state
        s.lost_all = False
        self._suspect = False
        s.reconnected = False
        self._recovery.owe_nothing()
        if seq == 0 and s.stats.delivered:
            s.new_publisher(seq, None, out)
            return
        if seq == 0:
            s.history.forget()  # (a resumed stream's vouched digest: the old process's)
        out.append(ResyncStarted(s.stream, "a publisher's batches after its state was lost: rebuilt from its seq 0"))

    def _settle_doubtful(self, seq: int, out: list[Delivery]) -> None:
        """Live batch ``seq`` came while batches are set aside as doubtful (the publisher's replay answers held
        nothing at or past the seq expected: :meth:`~kvtier.wire.transport.recovery.StreamRecovery._doubt`); it
        tells what they were. O(d).

        Below the first of them, the publisher's sequence goes on where the answers said it ends: they were never
        part of it (corrupt seq frames), and are dropped as malformed (``bogus_seqs``) while ``seq`` goes on as usual.
        At or past it, the live path finds the gap before ``seq`` as usual, and its replay, asked now that the
        publisher has published ``seq``, settles them: one that delivers anything shows the replay works (those set
        aside at seqs it delivers are settled against what it delivered, the rest stay aside); one that still holds
        nothing shows the publisher's replay keeps nothing, and they are its batches
        (:meth:`~kvtier.wire.transport.recovery.StreamRecovery._confirm_doubtful`). Those a replay or dump since
        moved ``expected`` past are settled first (``StreamState.settle_passed_doubtful``)."""
        s = self._state
        s.settle_passed_doubtful(out)
        if s.doubtful and seq < s.doubtful[0][0]:
            for q, _ in s.doubtful:
                s.bogus(q, f"not in the publisher's replay answers, and its next batch is seq {seq}", out)
            s.doubtful = []

    def _drain(self, pending: Held, now: float, out: list[Delivery], *, lossy: bool = False) -> None:
        """Batches a recovery handed back, through the live path in seq order; those after one that starts a
        new recovery are held for it. Once the stream is live, batches set aside as doubtful that a replay or dump
        moved ``expected`` past are settled. ``lossy``: a recovery given up for holding too much handed them back
        (the stream marked partial): a gap among them is lost for good too, not replayed, or the rest would be held
        again past the bound, one run released per batch taken."""
        if self._state.doubtful and not self._recovery.active:
            self._state.settle_passed_doubtful(out)
        for i, (seq, payload) in enumerate(pending):
            s = self._state
            if s.expected is not None and seq < s.expected and not s.history.foreign(seq, payload):
                continue  # already delivered by the replay, or a straggler of a loss or a dump
            if lossy and s.expected is not None and seq > s.expected and not self._recovery.active:
                s.history.give_up(s.expected, seq)
                s.stats.gaps += 1
                s.expected = seq
            self._live(seq, payload, now, out)
            if self._recovery.active:  # a new hole inside the held messages
                self._state.held.extend(pending[i + 1:])
                return
        if not self._recovery.active and not self._suspect:
            self._state.reconnected = False  # (the reconnect's check is over, the batches held through it drained)

    def _check(self) -> None:
        """Asserts the tracker's invariants (tests call it between steps)."""
        doubtful = [q for q, _ in self._state.doubtful]
        assert doubtful == sorted(set(doubtful)), f"doubtful batches out of order or repeated: {doubtful}"
        assert not doubtful or self._state.expected is not None, "doubtful batches with no seq expected"
        self._recovery._check()
        self._state.history._check()
