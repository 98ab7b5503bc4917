"""``kvtier indexer``: subscribe to engines, keep the tiered index, answer overlap queries over HTTP.

Endpoints:
  ``POST /query``  ``{"token_ids": [...], "lora_name"?: str, "cache_salt"?: str,
                   "mm_items"?: [{"identifier": str, "offset": int, "length": int}]}`` ->
                   per-worker tier overlaps with ``partial``/``recovering`` flags, shared-pool
                   blocks, costs and a recommended worker.
  ``GET /metrics`` Prometheus text (``?format=json`` for JSON): events applied / rejected,
                   gaps, resyncs, restarts, malformed frames, blocks per worker and tier, apply lag.
  ``GET /health``  liveness and per-worker staleness.

Threads: one event loop owns the ZMQ subscriber and applies deliveries; HTTP handler
threads query. One lock serialises index access between them.
"""

from __future__ import annotations

import json
import logging
import threading
import tomllib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvtier.indexer.consumer import IndexConsumer, Lag
from kvtier.indexer.exposition import Family, render
from kvtier.indexer.index import TieredIndex
from kvtier.indexer.latency import PRESETS, TransferModel
from kvtier.indexer.load import LoadTracker
from kvtier.indexer.router import Router
from kvtier.indexer.scoring import CostModel, CreditCost, TtftCost
from kvtier.wire.stream import StreamId
from kvtier.wire.subscriber import EndpointConfig, Subscriber

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A service configuration problem; the message names the offending entry."""


class ServiceUnavailable(RuntimeError):
    """The service cannot answer truthfully (its event loop died)."""


@dataclass(slots=True)
class ServiceConfig:
    """Everything ``kvtier indexer`` needs."""

    endpoints: list[EndpointConfig]  # engine streams to subscribe to
    block_size: int = 16  # tokens per block; events with another size are rejected
    listen: str = "127.0.0.1:8000"  # HTTP host:port (port 0 picks a free one)
    replay_timeout_s: float = 2.0  # wait for a replay or dump answer
    cost: str = "credit"  # "credit" or "ttft"
    model: str = "llama-3.1-8b"  # preset for the ttft cost's transfer times


def parse_endpoint(spec: str) -> EndpointConfig:
    """Parses ``WORKER=PUB_ENDPOINT[,replay=ENDPOINT][,dp=N][,dump]``."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise ConfigError(f"endpoint {spec!r}: expected WORKER=tcp://host:port[,replay=...][,dp=N][,dump]")
    parts = rest.split(",")
    opts: dict[str, Any] = {}
    for p in parts[1:]:
        key, _, value = p.partition("=")
        if key == "replay" and value:
            opts["replay_endpoint"] = value
        elif key == "dp" and value.isdigit():
            opts["dp_rank"] = int(value)
        elif key == "dump" and not value:
            opts["supports_dump"] = True
        else:
            raise ConfigError(f"endpoint {spec!r}: unknown option {p!r}")
    return EndpointConfig(worker=name, endpoint=parts[0], **opts)


def load_config(path: Path) -> ServiceConfig:
    """Reads a TOML file: top-level settings plus ``[[endpoints]]`` tables."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    eps = []
    for i, e in enumerate(raw.pop("endpoints", [])):
        try:
            eps.append(EndpointConfig(
                worker=str(e["worker"]), endpoint=str(e["endpoint"]),
                replay_endpoint=e.get("replay_endpoint"), dp_rank=int(e.get("dp_rank", 0)),
                supports_dump=bool(e.get("supports_dump", False))))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{path}: endpoints[{i}]: missing or bad field {exc}") from None
    known = {"block_size", "listen", "replay_timeout_s", "cost", "model"}
    if unknown := set(raw) - known:
        raise ConfigError(f"{path}: unknown settings {sorted(unknown)}")
    return ServiceConfig(endpoints=eps, **raw)


def make_cost_model(name: str, model: str) -> CostModel:
    if name == "credit":
        return CreditCost()
    if name == "ttft":
        if model not in PRESETS:
            raise ConfigError(f"unknown model preset {model!r}; known: {sorted(PRESETS)}")
        return TtftCost(TransferModel(PRESETS[model].bytes_per_token))
    raise ConfigError(f"unknown cost model {name!r}; expected 'credit' or 'ttft'")


#: Per-worker metrics of ``/metrics``: key in :meth:`IndexerService.metrics` -> (type, help).
_WORKER_METRICS: dict[str, tuple[str, str]] = {
    "events_applied": ("counter", "Events applied to the worker's index."),
    "events_rejected": ("counter", "Events rejected as bad input."),
    "unknown_parents": ("counter", "Stores whose parent the index did not know, held as orphans."),
    "orphans_grafted": ("counter", "Held orphan stores indexed once their parent became known."),
    "orphans_dropped": ("counter", "Held orphan stores aged out or cleared."),
    "orphan_blocks": ("gauge", "Blocks held as orphans, not yet indexed."),
    "unknown_removals": ("counter", "Removals of blocks the index did not hold."),
    "gaps": ("counter", "Sequence gaps detected on the worker's stream."),
    "gaps_filled": ("counter", "Gaps filled by replay."),
    "resyncs": ("counter", "Resynchronisations of the worker (replay from 0, dump or partial mark)."),
    "resyncs_deferred": ("counter", "Resyncs postponed by the rate limit."),
    "reasks": ("counter", "Replay requests repeated from the first missing seq (frames dropped)."),
    "probe_timeouts": ("counter", "Idle probes that got no answer (harmless)."),
    "restarts": ("counter", "Publisher restarts detected."),
    "malformed": ("counter", "Malformed frames received."),
    "duplicates": ("counter", "Duplicate batches dropped."),
    "partial": ("gauge", "1 once events were lost for good: prefixes stored before the loss are unknown."),
    "recovering": ("gauge", "1 while a catch-up, full replay or state dump is under way."),
    "apply_lag_seconds": ("gauge", "Delay from a batch's timestamp to its application, last batch."),
    "apply_lag_max_seconds": ("gauge", "Largest such delay seen."),
}


class IndexerService:
    """The indexer service; :meth:`start` runs it in background threads."""

    def __init__(self, config: ServiceConfig) -> None:
        if not config.endpoints:
            raise ConfigError("no endpoints configured")
        self.config = config
        self.index = TieredIndex(config.block_size)
        self.router = Router(self.index, make_cost_model(config.cost, config.model),
                             loads=LoadTracker(config.block_size))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = IndexConsumer(self.index)
        self._sub: Subscriber | None = None
        self._loop_error: str | None = None  # why the event loop died, if it did
        self._ready = threading.Event()
        #: Set when the event loop died: the index no longer follows the engines.
        self.failed = threading.Event()
        self._loop = threading.Thread(target=self._run_loop, name="kv-indexer", daemon=True)
        host, _, port = config.listen.rpartition(":")
        self._http = ThreadingHTTPServer((host or "127.0.0.1", int(port)), _handler(self))
        self._http.daemon_threads = True
        self._http_thread = threading.Thread(target=self._http.serve_forever, name="kv-http", daemon=True)
        for ep in config.endpoints:
            self.index.add_worker(ep.stream)

    @property
    def address(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        self._loop.start()
        self._http_thread.start()
        self._ready.wait(5.0)

    def stop(self) -> None:
        self._stop.set()
        self._http.shutdown()
        self._http.server_close()
        self._loop.join(timeout=5.0)

    # --- event loop ----------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            sub = Subscriber(self.config.endpoints, replay_timeout_s=self.config.replay_timeout_s)
        except Exception as exc:
            self._loop_failed(exc)
            return
        self._sub = sub
        self._ready.set()
        try:
            while not self._stop.is_set():
                deliveries = sub.poll(50)
                with self._lock:
                    self._consumer.feed(deliveries)
        except Exception as exc:
            self._loop_failed(exc)
        finally:
            sub.close()

    def _loop_failed(self, exc: Exception) -> None:
        self._loop_error = f"{type(exc).__name__}: {exc}"
        log.critical("event loop died: %s", self._loop_error, exc_info=exc)
        self._ready.set()
        self.failed.set()

    def worker_flags(self, stream: StreamId) -> dict[str, bool]:
        """``partial`` (events lost for good) and ``recovering`` (catch-up under way). Caller holds the lock."""
        sub = self._sub
        recovering = sub is not None and stream in sub.streams and sub.recovering(stream)
        return {"partial": self.index.is_partial(stream), "recovering": recovering}

    # --- queries -------------------------------------------------------------------------

    def query(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("token_ids"), list):
            raise ValueError('body must be a JSON object with "token_ids": [int, ...]')
        tokens = body["token_ids"]
        if not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
            raise ValueError("token_ids must be integers in [0, 2^32)")
        for opt in ("lora_name", "cache_salt"):
            if body.get(opt) is not None and not isinstance(body[opt], str):
                raise ValueError(f"{opt} must be a string")
        mm_items = _mm_items(body.get("mm_items"))
        if self.failed.is_set():
            raise ServiceUnavailable(f"event loop died ({self._loop_error}): the index no longer follows the engines")
        with self._lock:
            dec = self.router.route(tokens, lora_name=body.get("lora_name"),
                                    cache_salt=body.get("cache_salt"), mm_items=mm_items)
            flags = {str(s): self.worker_flags(s) for s in self.index.streams}
        out: dict[str, Any] = dec.overlaps.as_dict()
        out["workers"] = {str(s): {**o.as_dict(), **flags.get(str(s), {})} for s, o in dec.overlaps.workers.items()}
        out["recommended"] = str(dec.worker)
        out["costs"] = {str(w): c for w, c in dec.costs.items()}
        return out

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            workers: dict[str, Any] = {}
            for s in self.index.streams:
                st = self.index.stats(s)
                orphans = self.index.orphan_stats(s)
                entry: dict[str, Any] = {
                    "events_applied": st.events_applied, "events_rejected": st.events_rejected,
                    "unknown_parents": st.unknown_parents, "unknown_removals": st.unknown_removals,
                    "orphans_grafted": orphans.grafted, "orphans_dropped": orphans.dropped,
                    "orphan_blocks": self.index.orphan_blocks(s),
                    **self.worker_flags(s),
                    "blocks": {t.name.lower(): n for t, n in self.index.block_counts(s).items()},
                }
                if self._sub is not None and s in self._sub.streams:
                    ss = self._sub.stats(s)
                    entry.update(gaps=ss.gaps, gaps_filled=ss.gaps_filled, resyncs=ss.resyncs,
                                 resyncs_deferred=ss.resyncs_deferred, reasks=ss.reasks,
                                 probe_timeouts=ss.probe_timeouts,
                                 restarts=ss.restarts, malformed=ss.malformed, duplicates=ss.duplicates)
                lag = self._consumer.counters.lag.get(s, Lag())
                entry.update(apply_lag_seconds=lag.last, apply_lag_max_seconds=lag.max)
                workers[str(s)] = entry
            return {"batches_applied": self._consumer.counters.batches, "indexed_blocks": len(self.index),
                    "workers": workers}

    def metrics_text(self) -> str:
        """``/metrics`` in the Prometheus text format: one family per metric, every worker a series."""
        m = self.metrics()
        applied = Family("kvtier_batches_applied_total", "counter", "Event batches applied to the index.")
        applied.add(m["batches_applied"])
        indexed = Family("kvtier_indexed_blocks", "gauge", "Distinct block keys held by any worker.")
        indexed.add(m["indexed_blocks"])
        blocks = Family("kvtier_blocks", "gauge", "Blocks a worker holds, per tier.")
        per_worker = {key: Family(f"kvtier_{key}" + ("_total" if kind == "counter" else ""), kind, text)
                      for key, (kind, text) in _WORKER_METRICS.items()}
        for w, entry in m["workers"].items():
            for tier, n in entry["blocks"].items():
                blocks.add(n, worker=w, tier=tier)
            for key, fam in per_worker.items():
                if key in entry:
                    fam.add(float(entry[key]), worker=w)
        return render([applied, indexed, blocks, *per_worker.values()])

    def view(self, stream: StreamId) -> dict[Any, set[Any]]:
        """The worker's blocks per tier as the index holds them (engine hashes)."""
        with self._lock:
            return dict(self.index.worker_hashes(stream))

    def health(self) -> dict[str, Any]:
        """``status``: ``ok``, ``degraded`` (some worker partial or recovering) or ``down`` (the event
        loop died: ``/health`` then answers 503)."""
        with self._lock:
            flags = {str(s): self.worker_flags(s) for s in self.index.streams}
        partial = sorted(w for w, f in flags.items() if f["partial"])
        recovering = sorted(w for w, f in flags.items() if f["recovering"])
        alive = self._loop.is_alive() and not self.failed.is_set()
        out: dict[str, Any] = {
            "status": "down" if not alive else "degraded" if partial or recovering else "ok",
            "workers": len(flags), "partial_workers": partial, "recovering_workers": recovering}
        if self._loop_error is not None:
            out["error"] = self._loop_error
        return out


def _mm_items(raw: Any) -> list[tuple[str, int, int]] | None:
    """``mm_items``: ``[{"identifier": str, "offset": int, "length": int}, ...]`` (token positions)."""
    if raw is None:
        return None
    err = 'mm_items must be a list of {"identifier": str, "offset": int >= 0, "length": int > 0}'
    if not isinstance(raw, list):
        raise ValueError(err)
    out = []
    for item in raw:
        if not isinstance(item, dict):
            raise ValueError(err)
        ident, off, length = item.get("identifier"), item.get("offset"), item.get("length")
        if not (isinstance(ident, str) and type(off) is int and type(length) is int and off >= 0 and length > 0):
            raise ValueError(err)
        out.append((ident, off, length))
    return out


def _handler(service: IndexerService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http: " + format, *args)

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path, _, qs = self.path.partition("?")
            if path == "/metrics":
                if "format=json" in qs:
                    self._send(200, json.dumps(service.metrics()))
                else:
                    self._send(200, service.metrics_text(), "text/plain; version=0.0.4")
            elif path == "/health":
                h = service.health()
                self._send(503 if h["status"] == "down" else 200, json.dumps(h))
            else:
                self._send(404, json.dumps({"error": f"no such path {path}"}))

        def do_POST(self) -> None:
            if self.path != "/query":
                self._send(404, json.dumps({"error": f"no such path {self.path}"}))
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(length) or b"null")
                self._send(200, json.dumps(service.query(body)))
            except ServiceUnavailable as exc:
                self._send(503, json.dumps({"error": str(exc)}))
            except (ValueError, LookupError) as exc:
                self._send(400, json.dumps({"error": str(exc)}))

    return Handler


def serve(config: ServiceConfig) -> None:
    """Runs the service until interrupted."""
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


__all__ = ["ConfigError", "IndexerService", "ServiceConfig", "load_config", "parse_endpoint", "serve"]
