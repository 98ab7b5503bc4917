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
                   waits and holds, the HTTP loop's lag: :mod:`kvtier.indexer.service.histogram`).
  ``GET /health``  ``ok`` / ``degraded`` (partial, recovering or dead workers, or a snapshot that could not be
                   written) / ``down`` (503: the event loop died; the process then exits non-zero).

``/route``, first_token and finish change state: with ``auth_token_file`` they need a token, and a booking
is released only by the client that made it (:mod:`kvtier.indexer.service.clients`); README, "Security", lists the
limits on what a client may spend.

Threads: one owns the ZMQ subscriber and applies deliveries, a batch per lock hold (a large one in slices, the requests
waiting let in between: :mod:`kvtier.indexer.service.indexlock`); the HTTP front end
(:mod:`kvtier.indexer.service.http`, asyncio) answers on another. Requests hash their keys before taking
the lock, so the lock covers lookups and bookkeeping only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from kvtier.indexer.index.consumer import Lag
from kvtier.indexer.index.keys import BlockKey, key_backend
from kvtier.indexer.index.keytable import warm_tables
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.routing.disagg import KvLinkCost, PairRouter, pool_error, pool_routers
from kvtier.indexer.routing.load import LoadTracker, WorkerLoad
from kvtier.indexer.routing.plugins import BUILTIN, RoutingPolicy, load_policy, note_routed, unloadable
from kvtier.indexer.routing.policies import REGISTRY, RoutingSettings, make_cost, make_plugin
from kvtier.indexer.routing.router import RouteDecision, Router
from kvtier.indexer.routing.scoring import CostModel, SloCost, TtftCost, slo_met
from kvtier.indexer.service import fdlimit, persist
from kvtier.indexer.service.clients import Clients, ServiceUnavailable, load_tokens
from kvtier.indexer.service.config import ServiceConfig, closed_tiers, load_config, parse_endpoint
from kvtier.indexer.service.deadlines import Deadlines
from kvtier.indexer.service.disagg import pair_answer, route_pair
from kvtier.indexer.service.eventloop import EventLoop
from kvtier.indexer.service.histogram import Histogram
from kvtier.indexer.service.httplimits import check_json_shape
from kvtier.indexer.service.indexlock import IndexLock
from kvtier.indexer.service.metrics import render_metrics
from kvtier.indexer.service.predictions import Predictions
from kvtier.indexer.service.requestbody import RequestBody, parse_body, parse_finish
from kvtier.util.fields import ConfigError, did_you_mean
from kvtier.util.gcpause import GcPauses, freeze_startup_objects
from kvtier.util.signals import STOP_SIGNALS, handling
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import OverlapScores
from kvtier.wire.protocol import TOKEN_BYTES, PackedTokens
from kvtier.wire.tokenarray import token_backend

log = logging.getLogger(__name__)


class IndexerService:
    """The indexer service; :meth:`start` runs it in background threads: the event loop
    (:class:`~kvtier.indexer.service.eventloop.EventLoop`) and the HTTP front end. The router, the loads and the routed
    requests' deadlines (:class:`~kvtier.indexer.service.deadlines.Deadlines`) are this class's, under its lock."""

    def __init__(self, config: ServiceConfig, *, clock: Callable[[], float] = time.monotonic,
                 request_clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the engine streams' (replay deadlines, idle probes, liveness); ``request_clock``: the routed
        requests' (time to live, observed TTFT and TPOT). Tests move them by hand."""
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
        if config.snapshot_path is not None:
            self._restore(Path(config.snapshot_path), streams)
        self.loads = LoadTracker(config.block_size)
        self.router_settings = config.routing_settings()
        # Window-aware: engines that announce window KV (SWA models) are scored on their usable prefix; the
        # others as before. Each answer says which it was per worker ("window_kv").
        # What /route predicts for each request on its worker (TTFT, TPOT), as the goodput policy estimates them
        # (kvtier.indexer.service.predictions), whatever the policy.
        rs = self.router_settings
        self._predictor = _predictor(rs)
        self.predictions = Predictions()
        # A disaggregated pool (endpoints with roles): a (prefill, decode) pair per request, each pool booked apart,
        # the decode side priced and predicted with its own workers' capacity (decode_capacity_tokens).
        self.decode_loads = LoadTracker(config.block_size)
        drs = config.routing_settings(decode=True)
        self._decode_predictor = _predictor(drs)
        self.kv_link = KvLinkCost.of(drs)  # what a pair's prediction adds between its prefill and its first token
        for ep in config.endpoints:
            self.index.set_role(ep.stream, ep.role)
        name = config.policy or "kv_all"
        try:
            #: A disaggregated pool's routers (None in an aggregated pool).
            self.pair = pool_routers(name, rs, self.index, {s: self.index.role(s) for s in streams}, self.loads,
                                     self.decode_loads, lambda: _policy(name, rs, config.block_size),
                                     self._rebuilding, self._dead, config.local_prefill_tokens,
                                     decode_settings=drs, make_decode=lambda: _policy(name, drs, config.block_size))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        #: An aggregated pool's router (None in a disaggregated pool: its policy and plugin are built per pool
        #: there, by :func:`~kvtier.indexer.routing.disagg.pool_routers`, and nowhere else).
        self.router: Router | None = None
        if self.pair is None:
            if (idle := _idle_settings(config)) is not None:
                raise ConfigError(idle)
            cost, plugin = _policy(name, rs, config.block_size)
            self.router = Router(self.index, cost, loads=self.loads, policy=plugin, rebuilding=self._rebuilding,
                                 window_aware=True, temperature=rs.temperature, seed=rs.seed, dead=self._dead)
        self._lock = IndexLock()  # guards index, loads and the deadlines
        # routed requests in flight, until finish or expiry
        self._deadlines = Deadlines(config.request_ttl_s, request_clock)
        tokens = load_tokens(config.auth_token_file) if config.auth_token_file is not None else None
        #: Who booked what, and the caps on bookings (kvtier.indexer.service.clients); under the lock.
        self.clients = Clients(tokens, config.max_in_flight, config.max_in_flight_per_client,
                               config.max_in_flight_blocks, config.max_in_flight_blocks_per_client)
        self._loop = EventLoop(config, self.index, self._lock, self._deadlines, self._expired, self._resume,
                               clock=clock)
        #: Set when the event loop died: the index no longer follows the engines.
        self.failed = self._loop.failed
        self.gc = GcPauses()  # the collector's passes and pauses, counted from start()
        # Where answers spend their time (kvtier.indexer.service.histogram); every observation is made under the lock.
        self.request_seconds = {"query": Histogram(), "route": Histogram()}  # inside the service, lock wait included
        self.lock_wait = Histogram()  # of /query and /route, for the index lock
        from kvtier.indexer.service.http import HttpFrontEnd  # aiohttp only where the service runs

        self._host, port = config.host_port
        try:
            self._http = HttpFrontEnd(self, self._host, port, max_body_bytes=config.max_body_bytes,
                                      read_timeout_s=config.read_timeout_s, keepalive_s=config.keepalive_s,
                                      loop=config.http_loop, max_connections=config.max_connections,
                                      max_connections_per_peer=config.max_connections_per_peer,
                                      header_timeout_s=config.header_timeout_s,
                                      max_body_bytes_in_flight=config.max_body_bytes_in_flight)
        except ImportError:
            raise ConfigError("http_loop: uvloop is not installed (pip install uvloop), use auto or asyncio") from None
        for ep in config.endpoints:
            self.index.add_worker(ep.stream)
            # After a loss for good, a store on a tier its engine keeps prefix-closed regains the chain it proves.
            self.index.set_prefix_closed(ep.stream, closed_tiers(ep))

    def _restore(self, path: Path, streams: list[StreamId]) -> None:
        """Checks that the snapshot can be written, and restores it where there is one."""
        try:
            persist.check_path(path)
            if not path.exists():
                return
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
        """:meth:`EventLoop.save_snapshot <kvtier.indexer.service.eventloop.EventLoop.save_snapshot>` (event loop
        thread, or once it stopped)."""
        return self._loop.save_snapshot(positions)

    @property
    def loop_restarts(self) -> int:
        """Times the event loop failed and was started again (``config.loop_restarts``)."""
        return self._loop.restarts

    @property
    def snapshots(self) -> int:
        """Snapshots written since start."""
        return self._loop.snapshots

    @property
    def snapshot_seconds(self) -> float:
        """How long the last snapshot took to write."""
        return self._loop.snapshot_seconds

    @property
    def requests_expired(self) -> int:
        """Routed requests dropped at their deadline, never finished."""
        return self._deadlines.expired

    @property
    def address(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host  # (an IPv6 address, bracketed in a URL)
        return f"http://{host}:{self._http.port}"

    def start(self) -> None:
        """Starts the event loop, then the HTTP front end; raises if the port cannot be bound."""
        load_kernels()  # now, not on a query or an event
        # Descriptors for every endpoint and connection, now rather than "Too many open files" mid-run.
        fdlimit.ensure(len(self.config.endpoints), self.config.max_connections)
        if self.config.snapshot_path is not None:
            try:  # (held by the event loop, the snapshots' writer, until it ends: a second service is refused)
                self._loop.claim = persist.claim(Path(self.config.snapshot_path))
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            except OSError as exc:  # (a file system without locks; one that went read-only since the preflight)
                raise ConfigError(f"snapshot {self.config.snapshot_path}: {exc.strerror or exc}: {exc.filename}"
                                  ) from None
        self._loop.start()
        try:
            self._http.start()
        except BaseException:  # (the port: said at once, not after the loop's last snapshot)
            self._loop.stop()
            self._loop.join(last_snapshot=False)
            raise
        # Everything startup made (modules, kernels, a restored index) lives as long as the service: out of
        # the collector's full passes, which otherwise stall every thread for tens of ms (kvtier.util.gcpause).
        freeze_startup_objects()
        self.gc.install()

    def stop(self) -> None:
        self.gc.uninstall()
        self._loop.stop()
        self._http.stop()
        self._loop.join()

    def _rebuilding(self) -> set[StreamId]:
        """:meth:`EventLoop.rebuilding <kvtier.indexer.service.eventloop.EventLoop.rebuilding>`. O(streams)."""
        return self._loop.rebuilding()

    def _dead(self) -> set[StreamId]:
        """:meth:`EventLoop.dead <kvtier.indexer.service.eventloop.EventLoop.dead>`. O(streams)."""
        return self._loop.dead()

    def worker_flags(self, stream: StreamId, rebuilding: set[StreamId],
                     dead: Collection[StreamId] = ()) -> dict[str, bool]:
        """``partial`` (events lost for good), ``recovering`` (catch-up under way) and ``dead`` (its publisher
        looks gone: not routed to); ``rebuilding`` and ``dead`` are ``self._rebuilding()`` and ``self._dead()``,
        taken once by callers answering for every worker. O(1). Caller holds the lock."""
        return {"partial": self.index.is_partial(stream), "recovering": stream in rebuilding, "dead": stream in dead}

    # --- queries and routing -------------------------------------------------------------

    def _request_keys(self, req: RequestBody, tokens: PackedTokens) -> list[BlockKey]:
        """Hashes a request's keys (no lock needed: pure). O(tokens)."""
        n = len(tokens) // TOKEN_BYTES
        if n > self.config.max_query_tokens:
            raise ValueError(f"{n} token ids; at most {self.config.max_query_tokens} per request")
        if req.mm_items and len(req.mm_items) > self.config.max_mm_items:
            raise ValueError(f"{len(req.mm_items)} mm_items; at most {self.config.max_mm_items} per request")
        mm = [(m.identifier, m.offset, m.length) for m in req.mm_items] if req.mm_items else None
        if mm:
            for _, offset, length in mm:  # (placeholders are prompt tokens: an item past the end is a client's error)
                if offset + length > n:
                    raise ValueError(f"mm_items: the item at offset {offset} (length {length}) ends past the prompt's "
                                     f"{n} tokens")
            # The placeholders of a prompt's items are disjoint, which bounds the (block, item) overlaps to hash.
            for a, b in itertools.pairwise(sorted(mm, key=lambda m: m[1])):
                if b[1] < a[1] + a[2]:
                    raise ValueError(f"mm_items overlap: the item at offset {b[1]} starts inside the one at offset "
                                     f"{a[1]} (length {a[2]})")
        return self.index.request_keys(tokens, lora_name=req.lora_name, cache_salt=req.cache_salt, mm_items=mm)

    def _check_alive(self) -> None:
        if self.failed.is_set():
            raise ServiceUnavailable(f"event loop died ({self._loop.error}): the index no longer follows the engines")

    def _answer(self, dec: RouteDecision) -> dict[str, Any]:
        """Overlaps, per-worker flags, costs and the choice. Caller holds the lock."""
        out: dict[str, Any] = dec.overlaps.as_dict()
        rebuilding, dead = self._rebuilding(), self._dead()
        out["workers"] = {str(s): {**o.as_dict(), **self.worker_flags(s, rebuilding, dead),
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
        """``POST /query`` (raw JSON or a decoded object): overlaps and a recommendation, in a disaggregated pool the
        pair :meth:`route` would book (:func:`~kvtier.indexer.service.disagg.pair_answer`); books nothing, and
        takes back its random draws."""
        t0 = time.perf_counter()
        req, tokens = self._parse(body)
        keys = self._request_keys(req, tokens)
        self._check_alive()
        n = len(tokens) // TOKEN_BYTES
        with self._timed_lock():
            if self.router is not None:
                out = self._answer(self.router.peek_keys(keys, n))
            else:
                out = pair_answer(self, self._pair().peek_keys(keys, n))
            self.request_seconds["query"].observe(time.perf_counter() - t0)
        return out

    @contextmanager
    def _timed_lock(self) -> Iterator[None]:
        """The index lock, for a request: how long it waited is counted (``lock_wait``)."""
        t0 = time.perf_counter()
        with self._lock:
            self.lock_wait.observe(time.perf_counter() - t0)
            yield

    def _parse(self, body: bytes | Any) -> tuple[RequestBody, PackedTokens]:
        """:func:`parse_body`, JSON nesting past ``max_json_depth`` and more than ``max_json_containers`` arrays and
        objects refused first. O(body)."""
        if isinstance(body, bytes | bytearray):
            check_json_shape(bytes(body), self.config.max_json_depth, self.config.max_json_containers)
        return parse_body(body)

    def _expired(self, rid: str) -> None:
        """A booking dropped at its deadline (event loop thread, under the lock)."""
        self.loads.finish(rid)
        self.decode_loads.finish(rid)
        self.clients.release(rid)
        self.predictions.forget(rid)

    def _pair(self) -> PairRouter:
        """:attr:`pair`, in a disaggregated pool (where :attr:`router` is None)."""
        if self.pair is None:
            raise RuntimeError("an aggregated pool has no pair of routers")
        return self.pair

    @staticmethod
    def _request_cost(router: Router, req: RequestBody) -> CostModel | None:
        """The cost model of this request: the goodput policy's told the request's own SLO, else the router's."""
        cm = router.cost_model
        if req.slo is None or not isinstance(cm, SloCost):
            return None
        return dataclasses.replace(cm, ttft_ms=req.slo.ttft_ms, tpot_ms=req.slo.tpot_ms)

    def _predict(self, dec: RouteDecision, keys: list[BlockKey], tokens: int) -> tuple[float, float]:
        """Predicted (TTFT, TPOT) in ms of a request on its chosen worker, before it is booked there. Caller holds
        the lock."""
        (load,), (shared,) = self.loads.loads_and_shared([dec.worker], keys)
        return self._predictor.estimates(tokens, self.index.block_size, dec.overlaps.workers[dec.worker], load,
                                         shared, self.loads.expected_output)

    def _route_one(self, router: Router, rid: str, keys: list[BlockKey], tokens: int, req: RequestBody, owner: str,
                   t0: float) -> tuple[dict[str, Any], float, float]:
        """:meth:`route` in an aggregated pool (``router``: :attr:`router`): the answer, with the predicted TTFT and
        TPOT in ms. Caller holds the lock."""
        dec = router.route_keys(keys, tokens, self._request_cost(router, req))
        ttft_ms, tpot_ms = self._predict(dec, keys, tokens)
        # A routing-history policy learns it; first, as its hook may fail (PluginError), and then nothing is booked.
        note_routed(router.policy, keys, tokens, dec.worker)
        self.predictions.routed(rid, self._deadlines.clock(), ttft_ms, tpot_ms)
        cached = dec.overlaps.workers[dec.worker].external * self.index.block_size
        self.loads.add(rid, dec.worker, keys, tokens, max(0, tokens - cached))
        self.index.note_routed(dec.worker, keys)  # inferred window KV (SWA engines without window events)
        self._deadlines.book(rid, self._deadlines.clock())
        self.clients.book(rid, owner, len(keys))
        out = self._answer(dec)
        self.request_seconds["route"].observe(time.perf_counter() - t0)
        out["request_id"] = rid
        out["worker"] = out["recommended"]
        return out, ttft_ms, tpot_ms

    def route(self, body: bytes | Any, owner: str = "local") -> dict[str, Any]:
        """``POST /route``: routes and books the request on its worker until it finishes or expires; ``owner``
        (:meth:`Clients.identify <kvtier.indexer.service.clients.Clients.identify>`) alone may release it.
        :class:`~kvtier.indexer.service.clients.TooManyInFlight` past the caps on bookings."""
        t0 = time.perf_counter()
        req, packed = self._parse(body)
        rid, tokens = req.request_id, len(packed) // TOKEN_BYTES
        if not rid or "/" in rid:
            raise ValueError('body must carry "request_id": a non-empty string without "/"')
        if len(rid.encode("utf-8", "surrogatepass")) > self.config.max_request_id_bytes:
            raise ValueError(f"request_id longer than {self.config.max_request_id_bytes} bytes")
        keys = self._request_keys(req, packed)
        self._check_alive()
        with self._timed_lock():
            if rid in self._deadlines:
                raise ValueError(f"request {rid!r} is already in flight")
            self.clients.check_room(owner, len(keys))
            if self.router is not None:
                out, ttft_ms, tpot_ms = self._route_one(self.router, rid, keys, tokens, req, owner, t0)
            else:
                out, ttft_ms, tpot_ms = route_pair(self, self._pair(), rid, keys, tokens, req.slo, owner, t0)
        predicted: dict[str, Any] = {"ttft_ms": ttft_ms, "tpot_ms": None if tpot_ms != tpot_ms else tpot_ms}
        if req.slo is not None:
            predicted["meets_slo"] = slo_met(ttft_ms, tpot_ms, req.slo.ttft_ms, req.slo.tpot_ms)
        out["predicted"] = predicted
        return out

    def first_token(self, rid: str, owner: str = "local") -> dict[str, Any]:
        """``POST /requests/{id}/first_token``: its prefill is done (idempotent); only its owner may say so
        (:class:`~kvtier.indexer.service.clients.Forbidden`). A request not in flight (never routed, finished,
        expired, or booked before a restart, which forgets bookings) is answered ``in_flight: false``, as a finish
        is: the client did nothing wrong."""
        with self._lock:
            self.clients.check_owner(rid, owner)
            known = rid in self._deadlines
            self.loads.prefill_done(rid)
            if self.pair is not None:  # its prefill worker is done with it; its decode worker decodes it
                self.loads.finish(rid)
                self.decode_loads.prefill_done(rid)
            observed = self.predictions.first_token(rid, self._deadlines.clock())
        answer: dict[str, Any] = {"request_id": rid, "in_flight": known}
        if observed is not None:
            answer["observed_ttft_ms"] = observed * 1000
        return answer

    def finish(self, rid: str, body: bytes | Any = b"", owner: str = "local") -> dict[str, Any]:
        """``POST /requests/{id}/finish``: it completed or failed; its load is released (idempotent).
        An optional body ``{"output_tokens": N}`` says how many tokens it generated: the router learns
        from it the output room engines reserve (``min_ttft``'s memory term), so it is bounded by the model's
        context (``max_context_tokens``). Only its owner may finish it
        (:class:`~kvtier.indexer.service.clients.Forbidden`)."""
        out = parse_finish(body).output_tokens
        if out is not None and out > self.config.max_context_tokens:
            raise ValueError(f"bad finish body: output_tokens {out} is more than max_context_tokens "
                             f"{self.config.max_context_tokens}")
        with self._lock:
            self.clients.check_owner(rid, owner)
            known = self._deadlines.finish(rid)
            # (in a pair the prefill pool decodes nothing: the output length is the decode pool's to learn)
            self.loads.finish(rid, None if self.pair is not None else out)
            self.decode_loads.finish(rid, out)
            self.clients.release(rid)
            observed = self.predictions.finish(rid, self._deadlines.clock(), out)
        answer: dict[str, Any] = {"request_id": rid, "was_in_flight": known}
        if observed is not None:
            answer["observed_tpot_ms"] = observed * 1000
        return answer

    # --- observability -------------------------------------------------------------------

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            workers: dict[str, Any] = {}
            rebuilding, dead = self._rebuilding(), self._dead()
            subscribed = self._loop.stream_stats()
            for s in self.index.streams:
                st = self.index.stats(s)
                orphans = self.index.orphan_stats(s)
                ld = self._worker_load(s)
                entry: dict[str, Any] = {
                    "events_applied": st.events_applied, "events_rejected": st.events_rejected,
                    "unknown_parents": st.unknown_parents, "unknown_removals": st.unknown_removals,
                    "orphans_grafted": orphans.grafted, "orphans_dropped": orphans.dropped,
                    "orphan_blocks": self.index.orphan_blocks(s),
                    **self.worker_flags(s, rebuilding, dead),
                    "blocks": {t.name.lower(): n for t, n in self.index.block_counts(s).items()},
                    "requests_running": ld.running, "requests_prefilling": ld.prefilling,
                    "active_blocks": ld.active_blocks, "pending_prefill_tokens": ld.pending_prefill_tokens,
                }
                if s in subscribed:
                    ss = subscribed[s]
                    entry.update(gaps=ss.gaps, gaps_filled=ss.gaps_filled, resyncs=ss.resyncs,
                                 resyncs_deferred=ss.resyncs_deferred, reasks=ss.reasks,
                                 probe_timeouts=ss.probe_timeouts,
                                 restarts=ss.restarts, malformed=ss.malformed, duplicates=ss.duplicates,
                                 disconnects=ss.disconnects)
                lag = self._loop.consumer.counters.lag.get(s, Lag())
                entry.update(apply_lag_seconds=lag.last, apply_lag_max_seconds=lag.max)
                workers[str(s)] = entry
            return {"batches_applied": self._loop.consumer.counters.batches, "indexed_blocks": len(self.index),
                    "requests_in_flight": len(self._deadlines), "blocks_in_flight": self.clients.blocks,
                    "requests_expired": self.requests_expired,
                    "snapshots": self.snapshots, "snapshot_seconds": self.snapshot_seconds,
                    "snapshot_pause_seconds": self._loop.snapshot_pause_seconds,
                    "snapshot_failures": self._loop.snapshot_failures, **self._http.counters(),
                    "auth_refused": self.clients.refused_auth, "owner_refused": self.clients.refused_owner,
                    "bookings_refused": self.clients.refused_full,
                    "loop_restarts": self.loop_restarts, **self.gc.figures(), "latency": self._latency(),
                    "dead_workers": len(dead), "predictions": self.predictions.as_dict(), "workers": workers}

    def _worker_load(self, s: StreamId) -> WorkerLoad:
        """What is booked on worker ``s``: a decode worker's bookings are in the decode pool's tracker (a local
        prefill's too), a prefill worker's in the prefill pool's; a worker of role "both" in a disaggregated pool
        serves either side, so it has its two trackers' figures added (a prefix a request of each side holds counted
        in each). Caller holds the lock. O(1)."""
        role = self.index.role(s)
        if role == "decode":
            return self.decode_loads.load(s)
        if role == "prefill" or self.pair is None:
            return self.loads.load(s)
        return self.loads.load(s).plus(self.decode_loads.load(s))

    def _latency(self) -> dict[str, dict[str, Any]]:
        """The latency histograms, JSON form. Caller holds the lock (the HTTP loop's lag has its own writer:
        a reader may see one observation half counted)."""
        return {**{f"{k}_seconds": h.as_dict() for k, h in self.request_seconds.items()},
                "lock_wait_seconds": self.lock_wait.as_dict(), "apply_wait_seconds": self._loop.apply_wait.as_dict(),
                "apply_hold_seconds": self._loop.apply_hold.as_dict(),
                "http_loop_lag_seconds": self._http.loop_lag.as_dict()}

    def metrics_text(self) -> str:
        """``/metrics`` in the Prometheus text format: one family per metric, every worker a series."""
        return render_metrics(self.metrics())

    def view(self, stream: StreamId) -> dict[Any, set[Any]]:
        """The worker's blocks per tier as the index holds them (engine hashes)."""
        with self._lock:
            return dict(self.index.worker_hashes(stream))

    def health(self) -> dict[str, Any]:
        """``status``: ``ok``, ``degraded`` (some worker partial, recovering or dead, or sending stores of another
        block size, every one while a failed event loop waits to restart) or ``down`` (the event loop died for
        good: ``/health`` then answers 503)."""
        with self._lock:
            rebuilding, dead = self._rebuilding(), self._dead()
            flags = {str(s): self.worker_flags(s, rebuilding, dead) for s in self.index.streams}
            # Stores of another block size are all rejected: that worker is not indexed (--block-size must be
            # the engines' page size) until its stores have the index's again.
            wrong = sorted(str(s) for s in self.index.streams if self.index.stats(s).block_size_wrong)
        partial = sorted(w for w, f in flags.items() if f["partial"])
        recovering = sorted(w for w, f in flags.items() if f["recovering"])
        gone = sorted(w for w, f in flags.items() if f["dead"])
        alive = self._loop.is_alive()
        snapshot_error = self._loop.snapshot_error  # the index is not saved: a restart would start cold
        out: dict[str, Any] = {
            "status": "down" if not alive else "degraded" if partial or recovering or gone or snapshot_error or wrong
            else "ok",
            "workers": len(flags), "partial_workers": partial, "recovering_workers": recovering, "dead_workers": gone,
            "http_loop": self._http.loop_kind, "keys": key_backend(load=False), "loop_restarts": self.loop_restarts,
            "restored_from": self.restored_from}
        if self._loop.error is not None:
            out["error"] = self._loop.error
        if snapshot_error is not None:
            out["snapshot_error"] = snapshot_error
        if wrong:
            out["wrong_block_size_workers"] = wrong
            out["block_size_error"] = (f"stores of another block size than the index's {self.index.block_size} were "
                                       f"rejected from {', '.join(wrong)}: set --block-size to the engines' page size")
        return out


def _predictor(settings: RoutingSettings) -> SloCost:
    """What /route predicts a request's TTFT and TPOT with on a worker priced by ``settings``, as the goodput policy
    estimates them, whatever the policy."""
    return SloCost(TtftCost(settings.transfer(), settings.latency, prefill_budget=settings.prefill_budget,
                            capacity_tokens=settings.capacity_tokens))


def _policy(name: str, settings: RoutingSettings, block_size: int) -> tuple[CostModel, RoutingPolicy | None]:
    """The cost model and plugin the service routes with for policy ``name``: a registry policy's cost is built by
    :func:`kvtier.indexer.routing.policies.make_cost` exactly as the simulator builds it; a plugin replaces the cost's
    choice (the cost stays for /query's costs)."""
    if name in REGISTRY:
        spec = REGISTRY[name]
        if not spec.served:
            raise ConfigError(f"policy {name!r} runs in the simulator only (it reads {spec.kind}, which a service "
                              f"does not have); served: {', '.join(n for n, p in REGISTRY.items() if p.served)}")
        if spec.plugin is not None:  # an incumbent's policy, built as the simulator builds it
            return make_cost(name if spec.cost is not None else "kv_all", settings), make_plugin(name, settings,
                                                                                                 block_size)
        if spec.kind == "index":
            return make_cost(name, settings), None
        return make_cost("kv_all", settings), BUILTIN[name]()
    try:
        return make_cost("kv_all", settings), load_policy(name)
    except ValueError as exc:
        raise _plugin_error(name, str(exc)) from None


def _plugin_error(name: str, problem: str) -> ConfigError:
    """The line refusing plugin ``name``: ``problem``, and the served built-ins where ``name`` is a bare name (a typo
    of a built-in more often than an entry point's). O(policies)."""
    served = ", ".join(n for n, p in REGISTRY.items() if p.served)
    return ConfigError(problem + ("" if ":" in name else f"{did_you_mean(name, REGISTRY)}; built-in policies: "
                                                         f"{served}"))


def load_kernels() -> None:
    """Loads the compiled kernels the service calls: from numba's cache in about a second; the first start after an
    install compiles them, which takes half a minute or more on 2 cores. O(1) once done."""
    key_backend()
    token_backend()
    warm_tables()


def _interrupt(signum: int, frame: object) -> None:
    """A stop signal as Ctrl-C: the service stops. Another while it stops (a supervisor signalling the process and
    then its group) is ignored, so that it cannot cut the stop short before the snapshot is written."""
    _ignore_stops()
    raise KeyboardInterrupt


def _ignore_stops() -> None:
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _idle_settings(config: ServiceConfig) -> str | None:
    """Why an aggregated pool (every endpoint of role ``both``) refuses the settings given: those of a disaggregated
    pool would change nothing there, so it says so rather than serve as if they did. None where there are none. O(1)."""
    idle = config.disaggregated_settings()
    if not idle or any(ep.role != "both" for ep in config.endpoints):
        return None
    return (f"{', '.join(idle)}: {'they apply' if len(idle) > 1 else 'it applies'} to a disaggregated pool only "
            "(endpoints with role=prefill and role=decode)")


def preflight(config: ServiceConfig, inputs: Collection[tuple[str, str]] = ()) -> None:
    """Refuses now what a start would refuse that needs no compiled kernel, before they load (half a minute on a
    first start after an install): the snapshot's path (not one of ``inputs``, (what, path) pairs such as the config
    file, nor the token file), the token file, a disaggregated pool without a prefill or a decode worker and settings
    of such a pool given to an aggregated one, a plugin policy's file or entry point (its code is not run), and an
    HTTP port taken already. Raises :class:`ConfigError`, or :class:`OSError` as binding the port would. The start
    checks each again: a port may be taken between the two. O(1), plus the snapshot directory's entries."""
    if config.snapshot_path is not None:
        snapshot = Path(config.snapshot_path)
        named = [*inputs, *([("auth_token_file", config.auth_token_file)] if config.auth_token_file else [])]
        for what, path in named:
            with suppress(OSError):  # (one missing: not the same file)
                if os.path.samefile(snapshot, path):
                    raise ConfigError(f"snapshot {snapshot}: is {what}, which the service reads; name another file")
        try:
            persist.check_path(snapshot)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        except OSError as exc:  # (a writer's left-over temporary file that cannot be removed: a directory, say)
            raise ConfigError(f"snapshot {snapshot}: {exc.strerror or exc}: {exc.filename}") from None
    if config.auth_token_file is not None:
        load_tokens(config.auth_token_file)
    if (wrong := pool_error(ep.role for ep in config.endpoints) or _idle_settings(config)) is not None:
        raise ConfigError(wrong)
    name = config.policy or "kv_all"
    if name not in REGISTRY and (problem := unloadable(name)) is not None:  # (its code runs once, at the start)
        raise _plugin_error(name, problem)
    host, port = config.host_port
    if port:
        _check_bindable(host, port)


def _check_bindable(host: str, port: int) -> None:
    """Binds, as the HTTP front end does (every address ``host`` names, address reuse on), and lets go at once: an
    :class:`OSError` where one is taken or not this host's. O(addresses)."""
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:  # a family this host cannot make (IPv6 off): skipped, as asyncio skips it
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # (as asyncio binds it: the IPv4 address is bound on its own)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)


def serve(config: ServiceConfig, load: Callable[[], object] = load_kernels,
          inputs: Collection[tuple[str, str]] = ()) -> None:
    """Runs the service until interrupted (Ctrl-C, or SIGTERM: how supervisors and Kubernetes stop a process),
    then stops it, the last snapshot written; exits non-zero if its event loop dies. ``load`` loads the compiled
    kernels first (the CLI's says so while a first start compiles them), a stop signal heeded meanwhile too; what
    :func:`preflight` (given ``inputs``) refuses is refused before."""
    preflight(config, inputs)
    svc: IndexerService | None = None
    with handling(STOP_SIGNALS, _interrupt) as main:  # (nohup's SIGHUP stays ignored; main: handlers were set)
        # A signal may land anywhere from here on, the kernels' loading, the start and the banner included (a
        # supervisor that saw the banner may stop the process before print has returned): every path stops what
        # was made, the service with its snapshot written.
        try:
            load()
            svc = IndexerService(config)
            svc.start()
            print(f"kvtier indexer: {len(config.endpoints)} endpoint(s), block size {config.block_size}, "
                  f"HTTP on {svc.address}", flush=True)
            svc.failed.wait()
        except KeyboardInterrupt:
            pass
        finally:
            if main:  # (stopped by Ctrl-C or a dead event loop: no stop signal may cut the stop short either)
                _ignore_stops()
            if svc is not None:
                svc.stop()
    if svc is None:
        return
    if svc.failed.is_set():
        # The index no longer follows the engines: exit non-zero so a supervisor restarts the service.
        raise SystemExit(f"kvtier indexer: event loop died: {svc.health().get('error')}")
    if (error := svc.health().get("snapshot_error")) is not None:
        # The last snapshot, written on the way out, failed: the next start is cold, which a clean exit would hide.
        raise SystemExit(f"kvtier indexer: stopped without its last snapshot: {error}")


__all__ = ["ConfigError", "IndexerService", "ServiceConfig", "ServiceUnavailable", "load_config", "load_kernels",
           "parse_body", "parse_endpoint", "preflight", "serve"]
