"""``/metrics`` in Prometheus text: the service's JSON metrics
(:meth:`kvtier.indexer.service.app.IndexerService.metrics`)
as one family per metric, every worker a series."""

from __future__ import annotations

from typing import Any

from kvtier.indexer.service.exposition import Family, render

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
    "disconnects": ("counter", "Live connections to the worker's publisher lost (it went away or restarted, or a "
                               "frame past max_frame_bytes was refused)."),
    "partial": ("gauge", "1 once events were lost for good: prefixes stored before the loss are unknown."),
    "recovering": ("gauge", "1 while a catch-up, full replay or state dump is under way."),
    "dead": ("gauge", "1 while the worker's publisher looks gone (nothing heard for liveness_timeout_s): "
                      "not routed to."),
    "apply_lag_seconds": ("gauge", "Delay from a batch's timestamp to its application, last batch."),
    "apply_lag_max_seconds": ("gauge", "Largest such delay seen."),
    "requests_running": ("gauge", "Routed requests in flight on the worker."),
    "requests_prefilling": ("gauge", "Routed requests on the worker that have not produced a first token."),
    "active_blocks": ("gauge", "KV blocks the worker's in-flight requests hold (shared prefixes once)."),
    "pending_prefill_tokens": ("gauge", "Prompt tokens the worker still has to prefill."),
}

#: Service-wide counts of what the limits refused (README, "Security"), and snapshots that failed.
_LIMIT_METRICS: dict[str, tuple[str, str]] = {
    "snapshot_failures": ("counter", "Snapshots that could not be written (/health says degraded until one is)."),
    "http_malformed_requests": ("counter", "HTTP requests that could not be parsed, answered 400."),
    "http_connections_open": ("gauge", "HTTP connections open."),
    "http_connections_refused": ("counter", "HTTP connections refused at max_connections (503)."),
    "http_connections_refused_per_peer": ("counter", "HTTP connections refused at max_connections_per_peer (429)."),
    "http_header_timeouts": ("counter", "HTTP connections closed for sending no headers within header_timeout_s."),
    "http_bodies_refused": ("counter", "Request bodies refused at max_body_bytes_in_flight (503)."),
    "plugin_errors": ("counter", "Requests a plugin policy failed by breaking its protocol (answered 500)."),
    "auth_refused": ("counter", "State-changing requests refused for a missing or invalid token (401)."),
    "owner_refused": ("counter", "Releases of a booking by a client that did not book it (403)."),
    "bookings_refused": ("counter", "Bookings refused at max_in_flight[_blocks] (503) or at a per-client cap (429)."),
}


def render_metrics(m: dict[str, Any]) -> str:
    """The JSON metrics as Prometheus text: one family per metric, every worker a series."""
    gc_passes = Family("kvtier_gc_passes_total", "counter", "Garbage-collector passes since start, by generation.")
    gc_passes.add(m["gc_passes"] - m["gc_full_passes"], generation="young")
    gc_passes.add(m["gc_full_passes"], generation="full")
    service = [
        _single("kvtier_batches_applied_total", "counter", "Event batches applied to the index.", m["batches_applied"]),
        _single("kvtier_indexed_blocks", "gauge", "Distinct block keys held by any worker.", m["indexed_blocks"]),
        _single("kvtier_requests_in_flight", "gauge", "Routed requests not finished yet.", m["requests_in_flight"]),
        _single("kvtier_blocks_in_flight", "gauge", "Prompt blocks the routed requests not finished yet hold.",
                m["blocks_in_flight"]),
        _single("kvtier_requests_expired_total", "counter", "Routed requests dropped after their TTL.",
                m["requests_expired"]),
        _single("kvtier_dead_workers", "gauge", "Workers whose publisher looks gone (not routed to).",
                m["dead_workers"]),
        _single("kvtier_loop_restarts_total", "counter", "Times the event loop failed and was started again.",
                m["loop_restarts"]),
        gc_passes,
        _single("kvtier_gc_pause_seconds_total", "counter", "Time every thread stood still for the collector.",
                m["gc_pause_seconds"]),
        _single("kvtier_gc_pause_max_seconds", "gauge", "The longest garbage-collector pause since start.",
                m["gc_pause_max_seconds"]),
        _single("kvtier_http_disconnects_total", "counter", "Requests whose client went away before its body arrived.",
                m["http_disconnects"]),
        *(_single(f"kvtier_{key}" + ("_total" if kind == "counter" else ""), kind, text, m[key])
          for key, (kind, text) in _LIMIT_METRICS.items()),
    ]
    blocks = Family("kvtier_blocks", "gauge", "Blocks the worker holds a copy of on each tier: a block on two "
                    "tiers counts in both (not cumulative, unlike /query's depths); external: those it put in the "
                    "shared pool.")
    per_worker = {key: Family(f"kvtier_{key}" + ("_total" if kind == "counter" else ""), kind, text)
                  for key, (kind, text) in _WORKER_METRICS.items()}
    for w, entry in m["workers"].items():
        for tier, n in entry["blocks"].items():
            blocks.add(n, worker=w, tier=tier)
        for key, fam in per_worker.items():
            if key in entry:
                fam.add(float(entry[key]), worker=w)
    return render([*service, *_latency_families(m["latency"]), *_prediction_families(m["predictions"]), blocks,
                   *per_worker.values()])


def _single(name: str, kind: str, text: str, value: float) -> Family:
    """A family of one unlabelled series."""
    fam = Family(name, kind, text)
    fam.add(value)
    return fam


def _latency_families(lat: dict[str, Any]) -> list[Family]:
    """The latency histograms of :meth:`IndexerService._latency` as Prometheus families."""
    request = Family("kvtier_request_seconds", "histogram",
                     "Time inside the service per answered request, index lock wait included "
                     "(HTTP parsing and socket queueing excluded).")
    for endpoint in ("query", "route"):
        request.add_histogram(lat[f"{endpoint}_seconds"], endpoint=endpoint)
    out = [request]
    for key, text in (("lock_wait", "Time /query and /route waited for the index lock (held by event application)."),
                      ("apply_wait", "Time each delivered event batch waited for the index lock (held by requests)."),
                      ("apply_hold", "Time each delivered event batch (or slice of a large one) held the index lock."),
                      ("http_loop_lag", "How late the HTTP event loop woke from a short sleep: a starved loop "
                                        "delays every connection at once.")):
        fam = Family(f"kvtier_{key}_seconds", "histogram", text)
        fam.add_histogram(lat[f"{key}_seconds"])
        out.append(fam)
    return out


def _prediction_families(p: dict[str, Any]) -> list[Family]:
    """How far /route's predictions (kvtier.indexer.service.predictions) were from what the reports showed."""
    out = []
    for what, text in (("ttft", "time to first token (route to the first-token report)"),
                       ("tpot", "time per output token (first token to finish, over the tokens after it)")):
        fam = Family(f"kvtier_{what}_prediction_error_seconds", "histogram",
                     f"Absolute error of /route's predicted {text}: whether the latency model fits this hardware.")
        fam.add_histogram(p[what]["abs_error_seconds"])
        out.append(fam)
        bias = p[what]["mean_signed_error_seconds"]
        out.append(_single(f"kvtier_{what}_prediction_bias_seconds", "gauge",
                           f"Mean of observed minus predicted {what.upper()}: positive, the model runs fast.",
                           0.0 if bias is None else bias))
    return out
