"""The indexer service's event loop: the thread that follows the engines.

It subscribes to every endpoint, applies each delivered batch to the index under the service's lock (one batch per
hold: a query waits for a batch, never for a backlog), drops routed requests past their time to live, and copies
the index for a snapshot every ``snapshot_interval_s``, which a helper thread encodes and writes while events go on
being applied. A failure ends it (``failed``) unless the configuration allows restarts: it then starts again after a
back-off, each stream resuming after its last applied batch as from a snapshot, while the service answers, degraded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.service import persist
from kvtier.indexer.service.config import ServiceConfig
from kvtier.indexer.service.deadlines import Deadlines
from kvtier.indexer.service.histogram import Histogram
from kvtier.indexer.service.indexlock import IndexLock
from kvtier.util.helperthread import HelperThread
from kvtier.wire.notices import Delivery, StreamId, StreamStats
from kvtier.wire.transport.subscriber import Subscriber

__all__ = ["EventLoop"]

log = logging.getLogger(__name__)

_EXPIRE_BATCH = 64  # requests expired per hold of the service's lock
_RESTART_BACKOFF_S = 0.5  # the first wait before a failed event loop starts again
_RESTART_BACKOFF_MAX_S = 30.0  # the longest, as failures repeat
_STOP_WAIT_S = 60.0  # how much longer than join's timeout a stop waits for the last snapshot (EventLoop.join)
_WRITER = HelperThread("kvtier-snapshot")  # writes the periodic snapshots' copies (EventLoop._save_behind)


class EventLoop:
    """Follows the engines on its own thread (:meth:`start`); the index's only writer."""

    def __init__(self, config: ServiceConfig, index: TieredIndex, lock: IndexLock, deadlines: Deadlines,
                 on_expired: Callable[[str], None], resume: persist.Positions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the streams' (replay deadlines, idle probes, liveness); tests move it by hand."""
        self.config = config
        self._clock = clock
        self.index = index  # what it keeps up to date
        self._lock = lock  # the service's: guards the index, the loads and the deadlines
        self._deadlines = deadlines  # routed requests' deadlines
        self._on_expired = on_expired  # told each request dropped at its deadline (under the lock)
        self._resume = resume  # where each stream resumes at start (restored from a snapshot)
        self.consumer = IndexConsumer(index)  # applies deliveries; its counters are the service's metrics
        self._sub: Subscriber | None = None  # the subscriber of the current life of the loop
        self._carried: dict[StreamId, StreamStats] = {}  # each stream's counters over the loop's ended lives
        self._stop = threading.Event()
        self.ready = threading.Event()  # set once it subscribed (or failed, or waits to restart)
        self.failed = threading.Event()  # set when it died for good: the index no longer follows the engines
        self.error: str | None = None  # why it died, if it did
        self.restarts = 0  # times it failed and was started again (config.loop_restarts)
        self.restarting = False  # between a failure and the restart
        self._torn: set[StreamId] = set()  # streams of deliveries polled, not applied, when the loop last ended
        self._positions: persist.Positions = {}  # each in-sync stream's position when the loop last ended
        self.snapshots = 0  # snapshots written
        self.snapshot_seconds = 0.0  # how long the last one took, copy and write
        self.snapshot_pause_seconds = 0.0  # how long the copy of the last one stopped the loop
        self._writing: Future[None] | None = None  # the periodic snapshot being written on the writer thread
        self.snapshot_failures = 0  # snapshots that could not be written
        self.snapshot_error: str | None = None  # why the last one failed, until one succeeds again
        self.apply_wait = Histogram()  # a delivered batch's wait for the lock: how long requests held it up
        self.apply_hold = Histogram()  # the lock held by one delivered batch's application (a slice of a large one)
        self.claim: persist.Claim | None = None  # the snapshot path, held until the thread ends (persist.claim)
        self._thread = threading.Thread(target=self._run, name="kv-indexer", daemon=True)

    def start(self, ready_within_s: float = 5.0) -> None:
        """Starts the thread and waits (at most ``ready_within_s``) until it subscribed."""
        try:
            self._thread.start()
        except BaseException:
            self._let_go()
            raise
        self.ready.wait(ready_within_s)

    def _let_go(self) -> None:
        """Lets go of the snapshot path: no snapshot is written from here on."""
        if self.claim is not None:
            self.claim.release()
            self.claim = None

    def stop(self) -> None:
        """Asks the thread to stop; it writes a last snapshot on its way out (:meth:`join`)."""
        self._stop.set()

    def join(self, timeout_s: float = 5.0, *, last_snapshot: bool = True) -> None:
        """Waits for the thread to end after :meth:`stop`: at most ``timeout_s`` without snapshots. With snapshots the
        thread ends only once it applied what it last polled (a catch-up's poll takes seconds) and wrote the last
        snapshot (after the one in flight), and a process that exits before would lose it (the thread is a daemon):
        it is waited for up to :data:`_STOP_WAIT_S` or three times the last snapshot's length more, and if it is
        still at work then, the last snapshot counts as failed (``snapshot_error``), so that the service exits
        saying so. Nothing to wait for if it never started (a service stopped during its start). Without
        ``last_snapshot`` (a start that failed: there was nothing to serve) at most ``timeout_s``."""
        if self._thread.ident is None:
            return
        self._thread.join(timeout=timeout_s)
        if not last_snapshot or self.config.snapshot_path is None or not self._thread.is_alive():
            return
        more = max(_STOP_WAIT_S, 3 * self.snapshot_seconds)
        self._thread.join(timeout=more)
        if self._thread.is_alive():
            self.snapshot_failures += 1
            self.snapshot_error = (f"snapshot to {self.config.snapshot_path} not written: the event loop was still "
                                   f"applying events {timeout_s + more:g} s after the stop")
            log.error("%s", self.snapshot_error)

    def is_alive(self) -> bool:
        """Whether the thread runs and has not died for good (it may be waiting to restart). O(1)."""
        return self._thread.is_alive() and not self.failed.is_set()

    # --- what the service reads (under its lock) ------------------------------------------

    def rebuilding(self) -> set[StreamId]:
        """Streams whose catch-up, full replay or dump is under way (the router skips them); every stream
        while a failed loop waits to start again. O(streams)."""
        if self.restarting:
            return set(self.index.streams)
        sub = self._sub
        return set() if sub is None else {s for s in sub.streams if sub.recovering(s)}

    def dead(self) -> set[StreamId]:
        """Streams whose publisher looks gone (silent for ``liveness_timeout_s``: :meth:`Subscriber.silent
        <kvtier.wire.transport.subscriber.Subscriber.silent>`); none while a failed loop waits to start again (every
        stream is rebuilding then). O(streams)."""
        sub = self._sub
        if sub is None or self.restarting:
            return set()
        return sub.silent(self.config.liveness_timeout_s)

    def stream_stats(self) -> dict[StreamId, StreamStats]:
        """Each subscribed stream's counters since the service started, over every life of the loop (a counter that
        went down at a restart would read as a reset to Prometheus, its increase lost). O(streams)."""
        sub = self._sub
        now = {} if sub is None else {s: sub.stats(s) for s in sub.streams}
        return {s: self._carried.get(s, StreamStats()) + now.get(s, StreamStats())
                for s in now.keys() | self._carried.keys()}

    # --- snapshots ------------------------------------------------------------------------

    def save_snapshot(self, positions: persist.Positions | None = None) -> int | None:
        """Writes the snapshot now, after the one being written if any (loop thread: the index's only writer, so no
        lock is needed for a consistent read, and queries go on meanwhile; or once it stopped), with each stream's
        ``positions`` (default: the subscriber's). Returns its size, None if not configured."""
        if self.config.snapshot_path is None or (self._sub is None and positions is None):
            return None
        if positions is None:
            assert self._sub is not None
            positions = self._sub.positions()
        self._settle()
        t0 = time.monotonic()
        return self._write(self._capture(positions), t0)

    def _capture(self, positions: persist.Positions) -> persist.Pending:
        """The copy of a snapshot (this thread; the window KV under the service's lock), its pause recorded."""
        t0 = time.monotonic()
        pending = persist.capture(self.index, positions, self._lock)
        self.snapshot_pause_seconds = time.monotonic() - t0
        return pending

    def _write(self, pending: persist.Pending, t0: float) -> int:
        """Writes a copy taken at ``t0`` and counts it (either thread; one write at a time). Returns its size."""
        assert self.config.snapshot_path is not None
        n = persist.write(Path(self.config.snapshot_path), pending)
        self.snapshots += 1
        self.snapshot_seconds = time.monotonic() - t0
        return n

    def _settle(self) -> None:
        """Waits for the snapshot being written on the writer thread, if any (its failure is accounted there)."""
        if self._writing is not None:
            self._writing.result()
            self._writing = None

    def _save_logged(self, positions: persist.Positions | None = None) -> None:
        self._logged(lambda: self.save_snapshot(positions))

    def _save_behind(self) -> bool:
        """The periodic snapshot: copies the index on this thread and writes the copy on the writer thread, so that
        events stop being applied only for the copy, not for encoding and writing it. False, doing nothing, while
        the last one is still being written (the next try is the caller's)."""
        if self.config.snapshot_path is None:
            return True  # (no snapshots configured)
        if self._writing is not None and not self._writing.done():
            return False
        self._writing = None
        assert self._sub is not None
        positions = self._sub.positions()
        t0 = time.monotonic()
        try:
            pending = self._capture(positions)
        except Exception as exc:  # a bug in the copy: a failed snapshot (the error stays until one is written)
            self._failed(exc)
            return True
        try:
            self._writing = _WRITER.submit(self._logged, lambda: self._write(pending, t0))
        except RuntimeError:  # the interpreter is shutting down and starts no thread: written here
            self._logged(lambda: self._write(pending, t0))
        return True

    def _logged(self, save: Callable[[], object]) -> None:
        """Runs ``save``, which writes a snapshot; a failure is counted, logged and shown until one is written."""
        try:
            save()
        except Exception as exc:
            self._failed(exc)
        else:
            self.snapshot_error = None

    def _failed(self, exc: Exception) -> None:
        """A full disk, or a bug in writing a snapshot: the index goes on following the engines, and the failure
        shows in /metrics and /health (a traceback for a bug, one line for the disk)."""
        self.snapshot_failures += 1
        why = (exc.strerror or exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        self.snapshot_error = f"snapshot to {self.config.snapshot_path} failed: {why}"
        log.error("%s", self.snapshot_error, exc_info=not isinstance(exc, OSError))

    # --- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        """The thread: follows the engines (:meth:`_follow_until_stopped`), then lets go of the snapshot path, as it
        writes no snapshot any more."""
        try:
            self._follow_until_stopped()
        finally:
            self._let_go()

    def _follow_until_stopped(self) -> None:
        """Follows the engines until stop. A failure ends it (``failed``), unless ``loop_restarts`` allows
        another try: it then starts again after a back-off, each stream resuming after its last applied batch,
        as from a snapshot (a stream that was not in sync starts afresh)."""
        resume, left, backoff = self._resume, self.config.loop_restarts, _RESTART_BACKOFF_S
        while True:
            try:
                self._follow(resume)
                return
            except Exception as exc:
                if left <= 0 or self._stop.is_set():
                    self._died(exc)
                    return
                left -= 1
                self.restarts += 1
                self.restarting = True
                log.error("event loop failed (%s: %s); restarting it in %g s (%d more allowed)",
                          type(exc).__name__, exc, backoff, left, exc_info=exc)
                resume = self._resume_points(resume)
                self.ready.set()  # the service goes on: it answers, degraded, meanwhile
                if self._stop.wait(backoff):
                    self._save_logged(resume)  # stopped while waiting: the index, and where each stream resumes
                    return
                backoff = min(2 * backoff, _RESTART_BACKOFF_MAX_S)

    def _resume_points(self, fallback: persist.Positions) -> persist.Positions:
        """Where each stream resumes after a failure: its subscriber's position. A stream with none (it was
        catching up), or with a delivery of the failed poll not applied (torn: its position counts the batch being
        applied, which the index may hold in part, and every batch polled after it, which the index lacks), is
        cleared, to be rebuilt from scratch. ``fallback`` if no subscriber was made."""
        if self._sub is None:
            return fallback
        positions = dict(self._positions)
        for s in self._torn:
            positions.pop(s, None)
        self._torn = set()
        with self._lock:
            for s in self.index.streams:
                if s not in positions:
                    self.index.clear_worker(s)
        return positions

    def _follow(self, resume: persist.Positions) -> None:
        """One life of the loop: subscribes (resuming ``resume``) and applies deliveries until stop; raises
        what stopped it otherwise."""
        # Quiet streams are probed often enough for a live publisher to answer several times within the
        # liveness timeout.
        probe_s = min(1.0, self.config.liveness_timeout_s / 4)
        sub = Subscriber(self.config.endpoints, replay_timeout_s=self.config.replay_timeout_s, resume=resume,
                         clock=self._clock, probe_s=probe_s, max_frame_bytes=self.config.max_frame_bytes)
        self._sub = sub
        self.restarting = False
        self.ready.set()
        next_snapshot = time.monotonic() + self.config.snapshot_interval_s
        polled: list[Delivery] = []
        applied = 0  # of polled
        try:
            while not self._stop.is_set():
                polled, applied = sub.poll(50), 0
                # Away from polling (applying, expiring, a snapshot, which takes seconds for a large index): no idle
                # probe goes out, so the part of a long absence past the probes' interval counts toward no silence and
                # no replay's timeout (Subscriber.away).
                with sub.away():
                    for d in polled:
                        t0 = time.perf_counter()
                        # One batch per hold, a large one in slices with the requests waiting let in between: a query
                        # waits for a slice, never a backlog (kvtier.indexer.service.indexlock)
                        with self._lock:
                            t1 = time.perf_counter()
                            self.apply_wait.observe(t1 - t0)
                            for _ in self.consumer.slices(d):
                                self.apply_hold.observe(time.perf_counter() - t1)
                                self._lock.let_waiters_in()
                                t1 = time.perf_counter()
                            applied += 1
                            self.apply_hold.observe(time.perf_counter() - t1)
                    now = self._deadlines.clock()
                    while self._deadlines.due(now):
                        with self._lock:  # a batch per hold: a wave of expiries (their blocks) never stalls queries
                            for rid in self._deadlines.expire(now, _EXPIRE_BATCH):
                                self._on_expired(rid)
                    if time.monotonic() >= next_snapshot and self._save_behind():
                        next_snapshot = time.monotonic() + self.config.snapshot_interval_s
            self._save_logged()  # on stop
        finally:
            self._positions = sub.positions()  # where a restart resumes (closing forgets the streams)
            # The subscriber counts every delivery it handed over: the stream of one not applied (the one that
            # failed, or one polled after it) is past what the index holds, so it is not resumed.
            self._torn = {d.stream for d in polled[applied:]}
            with self._lock:  # (a reader of the counts sees each once: the subscriber's, or carried)
                for s in sub.streams:
                    self._carried[s] = self._carried.get(s, StreamStats()) + sub.stats(s)
                sub.close()

    def _died(self, exc: Exception) -> None:
        self.error = f"{type(exc).__name__}: {exc}"
        log.critical("event loop died: %s", self.error, exc_info=exc)
        self.ready.set()
        self.failed.set()
