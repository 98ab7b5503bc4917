"""The engine -> router event path of a simulated cluster: delay, loss, and the recovery a router runs.

Each engine's batches get sequence numbers and go into a bounded replay buffer, as a real
publisher's do; each lost batch simply never arrives live. With recovery, the router side is the
real :class:`~kvtier.wire.transport.stream.StreamTracker` (the one the ``kvtier indexer`` service runs): it
sees the gap on the next batch (or on an idle probe), asks for a replay, and, when the buffer no
longer reaches back, for a state dump (kvtier engines) or gives the worker up as partial (SGLang and
vLLM engines cannot dump). Replay and dump answers come back after a modeled round trip, read from
the buffer and the engine as they are at that moment. Without recovery, batches are applied as they
arrive and lost ones are just missing, which is what the index sees if nobody tracks seqs.

Ticks (timeouts, probes) are scheduled only when the tracker has something pending, and idle probes
only after live traffic, so a run still ends when its work does.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from kvtier.sim.core import Environment, Timer
from kvtier.wire.codec import decode_payload, encode_payload
from kvtier.wire.notices import Delivery, Received, ResyncNeeded, StreamId
from kvtier.wire.protocol import BlockRemoved, BlockStored, EventBatch, WorkerId
from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
from kvtier.wire.transport.stream import StreamTracker


class Recovery(StrEnum):
    """What the router does about lost event batches."""

    NONE = "none"  # nothing: lost batches stay missing (no seq tracking)
    REPLAY = "replay"  # seq tracking and replay from the publisher's buffer; no dumps (SGLang, vLLM)
    DUMP = "dump"  # replay, and a state dump when the buffer no longer reaches back (kvtier engines)


@dataclass(slots=True, frozen=True)
class WireConfig:
    """The modeled event path."""

    delay_s: float = 0.0  # engine -> router latency of live batches
    loss: float = 0.0  # probability a live batch starts a loss
    burst: int = 1  # batches of that worker lost in a row when one is (an outage, not a drop)
    recovery: Recovery = Recovery.DUMP  # see Recovery
    buffer: int = 10_000  # batches the publisher keeps for replay
    rtt_s: float = 0.001  # round trip of a replay or dump request
    timeout_s: float = 2.0  # the tracker's wait for an answer
    probe_s: float = 1.0  # the tracker's idle probe interval

    def __post_init__(self) -> None:
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"event loss must be in [0, 1], got {self.loss}")
        if self.delay_s < 0 or self.rtt_s < 0:
            raise ValueError(f"event delay and replay round trip must be >= 0, got {self.delay_s}, {self.rtt_s}")
        if self.buffer < 1:
            raise ValueError(f"replay buffer must hold >= 1 batch, got {self.buffer}")
        if self.burst < 1:
            raise ValueError(f"loss burst must be >= 1 batch, got {self.burst}")


@dataclass(slots=True)
class WireCounters:
    """What the event path did in one run."""

    published: int = 0  # batches the engines published
    blocks: int = 0  # blocks their stored and removed events name (the index's work is about proportional)
    lost: int = 0  # live batches dropped
    replay_requests: int = 0  # replay requests answered (catch-up, gap fill, probe)
    dumps: int = 0  # state dumps answered
    partial_marks: int = 0  # times a worker was given up as partial (loss beyond the buffer, no dump)
    # Wall seconds spent on the event path: encoding batches, and decoding and applying them at the router (live,
    # replayed, dumped, or released when a gap's deadline passes). Measured, so not deterministic: what it costs,
    # never part of a result.
    seconds: float = 0.0


def event_blocks(batch: EventBatch) -> int:
    """Blocks the stored and removed events of ``batch`` name. O(events)."""
    return sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored | BlockRemoved))


class SimWire:
    """Carries every worker's batches to ``sink`` (the router's delivery handler)."""

    def __init__(self, env: Environment, cfg: WireConfig, workers: int, rng: random.Random,
                 sink: Callable[[list[Delivery]], None], dump: Callable[[int], list[EventBatch]]) -> None:
        self.env, self.cfg, self.rng = env, cfg, rng
        self.counters = WireCounters()
        self._sink = sink
        self._dump = dump  # flushes worker i's pending events, then returns its state as batches
        self._streams = [StreamId(WorkerId(f"w{i}")) for i in range(workers)]
        self._next_seq = [0] * workers
        self._buffers: list[deque[tuple[int, bytes]]] = [deque(maxlen=cfg.buffer) for _ in range(workers)]
        self._trackers: list[StreamTracker | None] = [None] * workers
        self._epoch = [0] * workers  # bumped when the tracker abandons an answer (a fresh socket)
        self._timers: list[Timer | None] = [None] * workers
        self._active = [False] * workers  # live traffic since the last tick: idle probes are worth it
        self._dropping = [0] * workers  # batches still to lose in the current burst
        self._timing = 0  # event-path spans open: only the outermost one is counted (a dump publishes inside one)
        self._t0 = 0.0
        if cfg.recovery is not Recovery.NONE:
            for i, s in enumerate(self._streams):
                t = StreamTracker(s, can_replay=True, can_dump=cfg.recovery is Recovery.DUMP,
                                  timeout_s=cfg.timeout_s, probe_s=cfg.probe_s)
                t.expected = 0  # joined before the engines' first batch: nothing to catch up on
                self._trackers[i] = t

    def publish(self, worker: int, batch: EventBatch) -> None:
        """An engine published ``batch``: buffer it, then lose or deliver it. O(batch)."""
        c = self.counters
        c.published += 1
        self._time_in()
        try:
            payload = encode_payload(batch)
        finally:
            self._time_out()
        seq = self._next_seq[worker]
        self._next_seq[worker] = seq + 1
        if self._trackers[worker] is not None:
            # The engine's replay buffer; only a router that recovers ever reads it (without a
            # tracker nothing asks for replay), so without one it would only hold every payload.
            self._buffers[worker].append((seq, payload))
        if self._dropping[worker] or (self.cfg.loss and self.rng.random() < self.cfg.loss):
            self._dropping[worker] = (self._dropping[worker] or self.cfg.burst) - 1
            c.lost += 1
            return
        if self.cfg.delay_s <= 0:
            self._live(worker, seq, payload)
        else:
            self.env.after(self.cfg.delay_s, lambda: self._live(worker, seq, payload), priority=-1)

    def _time_in(self) -> None:
        """Opens an event-path span for :attr:`WireCounters.seconds`; spans nest, and the outermost is counted."""
        if not self._timing:
            self._t0 = time.perf_counter()
        self._timing += 1

    def _time_out(self) -> None:
        self._timing -= 1
        if not self._timing:
            self.counters.seconds += time.perf_counter() - self._t0

    def _live(self, w: int, seq: int, payload: bytes) -> None:
        self._time_in()
        try:
            tracker = self._trackers[w]
            if tracker is None:
                self._sink([Received(self._streams[w], seq, decode_payload(payload, packed_tokens=True), "live")])
            else:
                self._active[w] = True
                self._handle(w, tracker, tracker.on_live(seq, payload, self.env.now))
        finally:
            self._time_out()

    def _handle(self, w: int, tracker: StreamTracker, out: list[Delivery]) -> None:
        """Hands deliveries on, sends the tracker's requests, re-arms its tick."""
        self.counters.partial_marks += sum(isinstance(d, ResyncNeeded) for d in out)
        if out:
            self._sink(out)
        if tracker.reset_replay_socket:
            tracker.reset_replay_socket = False
            self._epoch[w] += 1  # answers in flight on the old socket are dropped
        for request in tracker.outbox:
            epoch = self._epoch[w]
            self.env.after(self.cfg.rtt_s, lambda r=request, e=epoch: self._answer(w, r, e),  # type: ignore[misc]
                           priority=-1)
        tracker.outbox.clear()
        self._arm(w, tracker)

    def _answer(self, w: int, request: bytes, epoch: int) -> None:
        tracker = self._trackers[w]
        assert tracker is not None, "an answer for a worker without recovery"
        if epoch != self._epoch[w]:
            return
        self._time_in()
        try:
            self._answer_request(w, tracker, request)
        finally:
            self._time_out()

    def _answer_request(self, w: int, tracker: StreamTracker, request: bytes) -> None:
        if request == DUMP_REQUEST:
            self.counters.dumps += 1
            batches = self._dump(w)  # flushes first, so the dump covers every published seq
            seq = pack_seq(self._next_seq[w] - 1)
            frames = [(seq, encode_payload(b)) for b in batches or [EventBatch(ts=self.env.now, events=[])]]
        else:
            self.counters.replay_requests += 1
            start = unpack_seq(request)
            frames = [(pack_seq(s), p) for s, p in self._buffers[w] if s >= start]
        out: list[Delivery] = []
        for seq_frame, payload in [*frames, (END_SEQ, b"")]:
            out.extend(tracker.on_reply(seq_frame, payload, self.env.now))
        self._handle(w, tracker, out)

    def _arm(self, w: int, tracker: StreamTracker) -> None:
        t = tracker.next_tick()
        if t is None or not (tracker.needs_tick or self._active[w]):
            return  # only an idle probe is left, and nothing arrived since the last one
        t = max(t, self.env.now)
        timer = self._timers[w]
        if timer is not None and self.env.now <= timer.time <= t:
            return  # an earlier tick is already due; it re-arms
        if timer is not None:
            timer.cancel()
        self._timers[w] = self.env.at(t, lambda: self._tick(w), priority=-1)

    def _tick(self, w: int) -> None:
        tracker = self._trackers[w]
        assert tracker is not None
        self._timers[w] = None
        due = tracker.next_tick()
        if due is None or not (tracker.needs_tick or self._active[w]):
            return  # armed for a deadline that was met meanwhile, and no traffic since
        if due > self.env.now:  # armed for an earlier deadline that moved on
            self._arm(w, tracker)
            return
        self._active[w] = False
        self._time_in()  # (a deadline passed can release held batches, decoded and applied here)
        try:
            self._handle(w, tracker, tracker.on_tick(self.env.now))
        finally:
            self._time_out()
