"""``kvtier indexer``: subscribe to engines, keep the tiered index, answer overlap queries over HTTP.

Endpoints:
  ``POST /query``  ``{"token_ids": [...], "lora_name"?: str, "cache_salt"?: str,
                   "mm_items"?: [{"identifier": str, "offset": int, "length": int}]}`` ->
                   per-worker tier overlaps with ``partial``/``recovering`` flags, shared-pool
                   blocks, costs and a recommended worker.
  ``POST /route``  the same plus ``"request_id": str``: picks a worker and books the request as in
                   flight on it (its load counts in later decisions) until
  ``POST /requests/{id}/first_token`` and ``POST /requests/{id}/finish`` (or ``request_ttl_s``).
  ``GET /metrics`` Prometheus text (``?format=json`` for JSON): events applied / rejected,
                   gaps, resyncs, restarts, malformed frames, blocks per worker and tier, apply
                   lag, in-flight load per worker; latency histograms (time per request, index lock
                   waits and holds, the HTTP loop's lag: :mod:`kvtier.indexer.histogram`).
  ``GET /health``  ``ok`` / ``degraded`` (partial or recovering workers) / ``down`` (503: the event
                   loop died; the process then exits non-zero).

Threads: one owns the ZMQ subscriber and applies deliveries, a batch per lock hold; the HTTP front
end (:mod:`kvtier.indexer.http`, asyncio) answers on another. Requests hash their keys before taking
the lock, so the lock covers lookups and bookkeeping only.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvtier.fields import ConfigError
from kvtier.indexer import persist
from kvtier.indexer.consumer import IndexConsumer, Lag
from kvtier.indexer.gcpause import GcPauses, freeze_startup_objects
from kvtier.indexer.histogram import Histogram
from kvtier.indexer.index import TieredIndex
from kvtier.indexer.keys import BlockKey, key_backend
from kvtier.indexer.load import LoadTracker
from kvtier.indexer.plugins import BUILTIN, RoutingPolicy, load_policy
from kvtier.indexer.requestbody import RequestBody, parse_body, parse_finish
from kvtier.indexer.router import RouteDecision, Router
from kvtier.indexer.serviceconfig import (
    NAMED_POLICIES,
    ServiceConfig,
    load_config,
    make_cost_model,
    named_policy_cost,
    parse_endpoint,
)
from kvtier.indexer.servicemetrics import render_metrics
from kvtier.wire.overlap import OverlapScores
from kvtier.wire.protocol import TOKEN_BYTES, PackedTokens
from kvtier.wire.stream import StreamId
from kvtier.wire.subscriber import Subscriber
from kvtier.wire.tokenarray import token_backend

log = logging.getLogger(__name__)


_RESTART_BACKOFF_S = 0.5  # the first wait before a failed event loop starts again
_RESTART_BACKOFF_MAX_S = 30.0  # the longest, as failures repeat


class ServiceUnavailable(RuntimeError):
    """The service cannot answer truthfully (its event loop died)."""


class IndexerService:
    """The indexer service; :meth:`start` runs it in background threads."""

    def __init__(self, config: ServiceConfig) -> None:
        if not config.endpoints:
            raise ConfigError("no endpoints configured")
        streams = [ep.stream for ep in config.endpoints]
        if len(set(streams)) != len(streams):
            dup = sorted({str(s) for s in streams if streams.count(s) > 1})
            raise ConfigError(f"endpoints name the same worker stream twice: {dup}")
        self.config = config
        self.index = TieredIndex(config.block_size, window_tokens=config.inferred_window_tokens)
        self._resume: persist.Positions = {}  # streams restored from the snapshot, and where they were
        self.restored_from: str | None = None  # the snapshot file the index was restored from
        if config.snapshot_path is not None and Path(config.snapshot_path).exists():
            self._restore(Path(config.snapshot_path), streams)
        self.loads = LoadTracker(config.block_size)
        plugin: RoutingPolicy | None = None
        cost = make_cost_model(config.cost, config.model)
        if config.policy in NAMED_POLICIES:
            cost = named_policy_cost(config)
        elif config.policy in BUILTIN:
            plugin = BUILTIN[config.policy]()
        elif config.policy is not None:
            try:
                plugin = load_policy(config.policy)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        # Window-aware: engines that announce window KV (SWA models) are scored on their usable prefix; the
        # others as before. Each answer says which it was per worker ("window_kv").
        self.router = Router(self.index, cost, loads=self.loads, policy=plugin, rebuilding=self._rebuilding,
                             window_aware=True)
        self._lock = threading.Lock()  # guards index, loads and the request registry
        self._stop = threading.Event()
        self._consumer = IndexConsumer(self.index)
        self._sub: Subscriber | None = None
        self._loop_error: str | None = None  # why the event loop died, if it did
        self._ready = threading.Event()
        #: Set when the event loop died: the index no longer follows the engines.
        self.failed = threading.Event()
        self._deadlines: dict[str, float] = {}  # routed request id -> when it expires
        self._expiry: list[tuple[float, str]] = []  # heap of (deadline, request id)
        self.requests_expired = 0
        self.loop_restarts = 0  # times the event loop failed and was started again (config.loop_restarts)
        self._restarting = False  # between a failed event loop and its restart
        self._torn: StreamId | None = None  # the stream whose delivery is being applied (event loop thread)
        self._positions: persist.Positions = {}  # each in-sync stream's position when the event loop last ended
        self.snapshots = 0  # snapshots written
        self.snapshot_seconds = 0.0  # how long the last one took
        self.gc = GcPauses()  # the collector's passes and pauses, counted from start()
        # Where answers spend their time (kvtier.indexer.histogram); every observation is made under the lock.
        self.request_seconds = {"query": Histogram(), "route": Histogram()}  # inside the service, lock wait included
        self.lock_wait = Histogram()  # of /query and /route, for the index lock
        self.apply_wait = Histogram()  # a delivered batch's wait for the lock: how long requests held it up
        self.apply_hold = Histogram()  # the lock held by one delivered batch's application
        self._loop = threading.Thread(target=self._run_loop, name="kv-indexer", daemon=True)
        from kvtier.indexer.http import HttpFrontEnd  # aiohttp only where the service runs

        self._host, port = config.host_port
        try:
            self._http = HttpFrontEnd(self, self._host, port, max_body_bytes=config.max_body_bytes,
                                      read_timeout_s=config.read_timeout_s, keepalive_s=config.keepalive_s,
                                      loop=config.http_loop)
        except ImportError:
            raise ConfigError("http_loop: uvloop is not installed (pip install uvloop), use auto or asyncio") from None
        for s in streams:
            self.index.add_worker(s)

    def _restore(self, path: Path, streams: list[StreamId]) -> None:
        try:
            index, positions = persist.load(path, self.config.block_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if index.window_tokens != self.config.inferred_window_tokens:
            # Its inferred window KV was cut to another window: it would be wrong for as long as it lasts.
            raise ConfigError(f"snapshot {path}: window_tokens {index.window_tokens}, the service's is "
                              f"{self.config.inferred_window_tokens}; remove the snapshot or set window_tokens")
        for s in index.streams:
            if s not in streams:
                index.remove_worker(s)  # no longer configured
            elif s not in positions:
                index.clear_worker(s)  # saved mid-recovery or before any batch: start it afresh
        self.index = index
        self._resume = {s: p for s, p in positions.items() if s in streams}
        self.restored_from = str(path)
        log.info("restored %d blocks from %s; resuming %d of %d streams", len(index), path,
                 len(self._resume), len(streams))

    def save_snapshot(self, positions: persist.Positions | None = None) -> int | None:
        """Writes the snapshot now (event loop thread: the index's only writer, so no lock is needed
        for a consistent read, and queries go on meanwhile), with each stream's ``positions`` (default: the
        subscriber's). Returns its size, None if not configured."""
        if self.config.snapshot_path is None or (self._sub is None and positions is None):
            return None
        if positions is None:
            assert self._sub is not None
            positions = self._sub.positions()
        t0 = time.monotonic()
        n = persist.save(Path(self.config.snapshot_path), self.index, positions)
        self.snapshots += 1
        self.snapshot_seconds = time.monotonic() - t0
        return n

    @property
    def address(self) -> str:
        return f"http://{self._host}:{self._http.port}"

    def start(self) -> None:
        """Starts the event loop, then the HTTP front end; raises if the port cannot be bound."""
        # The compiled kernels load now (seconds when numba's cache is cold), not on a query or an event.
        key_backend()
        token_backend()
        self._loop.start()
        self._ready.wait(5.0)
        try:
            self._http.start()
        except BaseException:
            self._stop.set()
            raise
        # Everything startup made (modules, kernels, a restored index) lives as long as the service: out of
        # the collector's full passes, which otherwise stall every thread for tens of ms (kvtier.indexer.gcpause).
        freeze_startup_objects()
        self.gc.install()

    def stop(self) -> None:
        self.gc.uninstall()
        self._stop.set()
        self._http.stop()
        self._loop.join(timeout=5.0)

    # --- event loop ----------------------------------------------------------------------

    def _run_loop(self) -> None:
        """Follows the engines until stop. A failure ends the service (``failed``), unless ``loop_restarts``
        allows another try: the event loop then starts again after a back-off, each stream resuming after its
        last applied batch, as from a snapshot (a stream that was not in sync starts afresh)."""
        resume, left, backoff = self._resume, self.config.loop_restarts, _RESTART_BACKOFF_S
        while True:
            try:
                self._follow(resume)
                return
            except Exception as exc:
                if left <= 0 or self._stop.is_set():
                    self._loop_failed(exc)
                    return
                left -= 1
                self.loop_restarts += 1
                self._restarting = True
                log.error("event loop failed (%s: %s); restarting it in %g s (%d more allowed)",
                          type(exc).__name__, exc, backoff, left, exc_info=exc)
                resume = self._resume_points(resume)
                self._ready.set()  # start() goes on: the service answers, degraded, meanwhile
                if self._stop.wait(backoff):
                    self._save_logged(resume)  # stopped while waiting: the index, and where each stream resumes
                    return
                backoff = min(2 * backoff, _RESTART_BACKOFF_MAX_S)

    def _resume_points(self, fallback: persist.Positions) -> persist.Positions:
        """Where each stream resumes after a failed loop: its subscriber's position. A stream with none (it was
        catching up), or whose delivery was being applied when the loop failed (torn: its position counts a
        batch the index may hold in part), is cleared, to be rebuilt from scratch. ``fallback`` if no
        subscriber was made."""
        if self._sub is None:
            return fallback
        positions = dict(self._positions)
        if self._torn is not None:
            positions.pop(self._torn, None)
            self._torn = None
        with self._lock:
            for s in self.index.streams:
                if s not in positions:
                    self.index.clear_worker(s)
        return positions

    def _follow(self, resume: persist.Positions) -> None:
        """One life of the event loop: subscribes (resuming ``resume``) and applies deliveries until stop;
        raises what stopped it otherwise."""
        sub = Subscriber(self.config.endpoints, replay_timeout_s=self.config.replay_timeout_s, resume=resume)
        self._sub = sub
        self._restarting = False
        self._ready.set()
        next_snapshot = time.monotonic() + self.config.snapshot_interval_s
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_snapshot:
                    self._save_logged()
                    next_snapshot = time.monotonic() + self.config.snapshot_interval_s
                for d in sub.poll(50):
                    t0 = time.perf_counter()
                    with self._lock:  # one batch per hold: queries wait for a batch, never a backlog
                        t1 = time.perf_counter()
                        self._torn = d.stream  # if applying it fails, its state is half there: never resumed
                        self._consumer.feed((d,))
                        self._torn = None
                        self.apply_wait.observe(t1 - t0)
                        self.apply_hold.observe(time.perf_counter() - t1)
                if self._expiry and self._expiry[0][0] <= time.monotonic():
                    with self._lock:
                        self._expire(time.monotonic())
            self._save_logged()  # on stop
        finally:
            self._positions = sub.positions()  # where a restart resumes (closing forgets the streams)
            sub.close()

    def _save_logged(self, positions: persist.Positions | None = None) -> None:
        try:
            self.save_snapshot(positions)
        except OSError as exc:  # a full disk must not stop the index from following the engines
            log.error("snapshot to %s failed: %s", self.config.snapshot_path, exc)

    def _loop_failed(self, exc: Exception) -> None:
        self._loop_error = f"{type(exc).__name__}: {exc}"
        log.critical("event loop died: %s", self._loop_error, exc_info=exc)
        self._ready.set()
        self.failed.set()

    def _rebuilding(self) -> set[StreamId]:
        """Streams whose catch-up, full replay or dump is under way (the router skips them); every stream
        while a failed event loop waits to start again. O(streams)."""
        if self._restarting:
            return set(self.index.streams)
        sub = self._sub
        return set() if sub is None else {s for s in sub.streams if sub.recovering(s)}

    def worker_flags(self, stream: StreamId, rebuilding: set[StreamId]) -> dict[str, bool]:
        """``partial`` (events lost for good) and ``recovering`` (catch-up under way); ``rebuilding`` is
        ``self._rebuilding()``, taken once by callers answering for every worker. O(1). Caller holds the
        lock."""
        return {"partial": self.index.is_partial(stream), "recovering": stream in rebuilding}

    # --- queries and routing -------------------------------------------------------------

    def _request_keys(self, req: RequestBody, tokens: PackedTokens) -> list[BlockKey]:
        """Hashes a request's keys (no lock needed: pure). O(tokens)."""
        n = len(tokens) // TOKEN_BYTES
        if n > self.config.max_query_tokens:
            raise ValueError(f"{n} token ids; at most {self.config.max_query_tokens} per request")
        mm = [(m.identifier, m.offset, m.length) for m in req.mm_items] if req.mm_items else None
        return self.index.request_keys(tokens, lora_name=req.lora_name, cache_salt=req.cache_salt, mm_items=mm)

    def _check_alive(self) -> None:
        if self.failed.is_set():
            raise ServiceUnavailable(f"event loop died ({self._loop_error}): the index no longer follows the engines")

    def _answer(self, dec: RouteDecision) -> dict[str, Any]:
        """Overlaps, per-worker flags, costs and the choice. Caller holds the lock."""
        out: dict[str, Any] = dec.overlaps.as_dict()
        rebuilding = self._rebuilding()
        out["workers"] = {str(s): {**o.as_dict(), **self.worker_flags(s, rebuilding),
                                   **self._window_answer(dec.overlaps, s)}
                          for s, o in dec.overlaps.workers.items()}
        out["recommended"] = str(dec.worker)
        out["costs"] = {str(w): c for w, c in dec.costs.items()}
        return out

    @staticmethod
    def _window_answer(overlaps: OverlapScores, s: StreamId) -> dict[str, Any]:
        """``window_kv``: ``tracked`` (an SWA engine announcing window KV: the overlap is its usable prefix,
        ``raw`` the full-attention one), ``inferred`` (an engine that sends no window events, with the
        configured ``window_tokens``: the usable prefix as the store rule estimates it) or ``untracked``
        (the overlap as announced; for an SWA engine that sends no window events, an upper bound)."""
        if s not in overlaps.windows:
            return {"window_kv": "untracked"}
        raw = overlaps.raw.get(s)
        return {"window_kv": "inferred" if s in overlaps.inferred else "tracked", "window_blocks": overlaps.windows[s],
                "raw": (raw or overlaps.workers[s]).as_dict()}

    def query(self, body: bytes | Any) -> dict[str, Any]:
        """``POST /query`` (raw JSON or a decoded object): overlaps and a recommendation; books nothing."""
        t0 = time.perf_counter()
        req, tokens = parse_body(body)
        keys = self._request_keys(req, tokens)
        self._check_alive()
        with self._timed_lock():
            out = self._answer(self.router.route_keys(keys, len(tokens) // TOKEN_BYTES))
            self.request_seconds["query"].observe(time.perf_counter() - t0)
        return out

    @contextmanager
    def _timed_lock(self) -> Iterator[None]:
        """The index lock, for a request: how long it waited is counted (``lock_wait``)."""
        t0 = time.perf_counter()
        with self._lock:
            self.lock_wait.observe(time.perf_counter() - t0)
            yield

    def route(self, body: bytes | Any) -> dict[str, Any]:
        """``POST /route``: routes and books the request on its worker until it finishes or expires."""
        t0 = time.perf_counter()
        req, packed = parse_body(body)
        rid, tokens = req.request_id, len(packed) // TOKEN_BYTES
        if not rid or "/" in rid:
            raise ValueError('body must carry "request_id": a non-empty string without "/"')
        keys = self._request_keys(req, packed)
        self._check_alive()
        with self._timed_lock():
            if rid in self._deadlines:
                raise ValueError(f"request {rid!r} is already in flight")
            dec = self.router.route_keys(keys, tokens)
            cached = dec.overlaps.workers[dec.worker].external * self.index.block_size
            self.loads.add(rid, dec.worker, keys, tokens, max(0, tokens - cached))
            self.index.note_routed(dec.worker, keys)  # inferred window KV (SWA engines without window events)
            deadline = time.monotonic() + self.config.request_ttl_s
            self._deadlines[rid] = deadline
            heapq.heappush(self._expiry, (deadline, rid))
            out = self._answer(dec)
            self.request_seconds["route"].observe(time.perf_counter() - t0)
        out["request_id"] = rid
        out["worker"] = out["recommended"]
        return out

    def first_token(self, rid: str) -> dict[str, Any]:
        """``POST /requests/{id}/first_token``: its prefill is done (idempotent)."""
        with self._lock:
            known = rid in self._deadlines
            self.loads.prefill_done(rid)
        if not known:
            raise LookupError(f"request {rid!r} is not in flight (never routed, finished or expired)")
        return {"request_id": rid, "in_flight": True}

    def finish(self, rid: str, body: bytes | Any = b"") -> dict[str, Any]:
        """``POST /requests/{id}/finish``: it completed or failed; its load is released (idempotent).
        An optional body ``{"output_tokens": N}`` says how many tokens it generated: the router learns
        from it the output room engines reserve (``min_ttft``'s memory term)."""
        out = parse_finish(body).output_tokens
        with self._lock:
            known = self._deadlines.pop(rid, None) is not None
            self.loads.finish(rid, out)
        return {"request_id": rid, "was_in_flight": known}

    def _expire(self, now: float) -> None:
        """Drops requests past their TTL from the load. Caller holds the lock. O(expired log n)."""
        while self._expiry and self._expiry[0][0] <= now:
            deadline, rid = heapq.heappop(self._expiry)
            if self._deadlines.get(rid) == deadline:
                del self._deadlines[rid]
                self.loads.finish(rid)
                self.requests_expired += 1
                log.info("request %s expired after %g s without finish", rid, self.config.request_ttl_s)

    # --- observability -------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            workers: dict[str, Any] = {}
            rebuilding = self._rebuilding()
            subscribed = set(self._sub.streams) if self._sub is not None else set()
            for s in self.index.streams:
                st = self.index.stats(s)
                orphans = self.index.orphan_stats(s)
                ld = self.loads.load(s)
                entry: dict[str, Any] = {
                    "events_applied": st.events_applied, "events_rejected": st.events_rejected,
                    "unknown_parents": st.unknown_parents, "unknown_removals": st.unknown_removals,
                    "orphans_grafted": orphans.grafted, "orphans_dropped": orphans.dropped,
                    "orphan_blocks": self.index.orphan_blocks(s),
                    **self.worker_flags(s, rebuilding),
                    "blocks": {t.name.lower(): n for t, n in self.index.block_counts(s).items()},
                    "requests_running": ld.running, "requests_prefilling": ld.prefilling,
                    "active_blocks": ld.active_blocks, "pending_prefill_tokens": ld.pending_prefill_tokens,
                }
                if self._sub is not None and s in subscribed:
                    ss = self._sub.stats(s)
                    entry.update(gaps=ss.gaps, gaps_filled=ss.gaps_filled, resyncs=ss.resyncs,
                                 resyncs_deferred=ss.resyncs_deferred, reasks=ss.reasks,
                                 probe_timeouts=ss.probe_timeouts,
                                 restarts=ss.restarts, malformed=ss.malformed, duplicates=ss.duplicates)
                lag = self._consumer.counters.lag.get(s, Lag())
                entry.update(apply_lag_seconds=lag.last, apply_lag_max_seconds=lag.max)
                workers[str(s)] = entry
            return {"batches_applied": self._consumer.counters.batches, "indexed_blocks": len(self.index),
                    "requests_in_flight": len(self._deadlines), "requests_expired": self.requests_expired,
                    "snapshots": self.snapshots, "snapshot_seconds": self.snapshot_seconds,
                    "loop_restarts": self.loop_restarts, **self.gc.figures(), "latency": self._latency(),
                    "http_disconnects": self._http.disconnects, "workers": workers}

    def _latency(self) -> dict[str, dict[str, Any]]:
        """The latency histograms, JSON form. Caller holds the lock (the HTTP loop's lag has its own writer:
        a reader may see one observation half counted)."""
        return {**{f"{k}_seconds": h.as_dict() for k, h in self.request_seconds.items()},
                "lock_wait_seconds": self.lock_wait.as_dict(), "apply_wait_seconds": self.apply_wait.as_dict(),
                "apply_hold_seconds": self.apply_hold.as_dict(),
                "http_loop_lag_seconds": self._http.loop_lag.as_dict()}

    def metrics_text(self) -> str:
        """``/metrics`` in the Prometheus text format: one family per metric, every worker a series."""
        return render_metrics(self.metrics())

    def view(self, stream: StreamId) -> dict[Any, set[Any]]:
        """The worker's blocks per tier as the index holds them (engine hashes)."""
        with self._lock:
            return dict(self.index.worker_hashes(stream))

    def health(self) -> dict[str, Any]:
        """``status``: ``ok``, ``degraded`` (some worker partial or recovering, every one while a failed event
        loop waits to restart) or ``down`` (the event loop died for good: ``/health`` then answers 503)."""
        with self._lock:
            rebuilding = self._rebuilding()
            flags = {str(s): self.worker_flags(s, rebuilding) for s in self.index.streams}
        partial = sorted(w for w, f in flags.items() if f["partial"])
        recovering = sorted(w for w, f in flags.items() if f["recovering"])
        alive = self._loop.is_alive() and not self.failed.is_set()
        out: dict[str, Any] = {
            "status": "down" if not alive else "degraded" if partial or recovering else "ok",
            "workers": len(flags), "partial_workers": partial, "recovering_workers": recovering,
            "http_loop": self._http.loop_kind, "keys": key_backend(load=False), "loop_restarts": self.loop_restarts}
        if self._loop_error is not None:
            out["error"] = self._loop_error
        return out


def serve(config: ServiceConfig) -> None:
    """Runs the service until interrupted; exits non-zero if its event loop dies."""
    svc = IndexerService(config)
    svc.start()
    print(f"kvtier indexer: {len(config.endpoints)} endpoint(s), block size {config.block_size}, "
          f"HTTP on {svc.address}", flush=True)
    try:
        svc.failed.wait()
    except KeyboardInterrupt:
        return
    finally:
        svc.stop()
    # The index no longer follows the engines: exit non-zero so a supervisor restarts the service.
    raise SystemExit(f"kvtier indexer: event loop died: {svc.health().get('error')}")


__all__ = ["ConfigError", "IndexerService", "ServiceConfig", "ServiceUnavailable", "load_config", "parse_body",
           "parse_endpoint", "serve"]
