"""Per-request records and per-run summaries."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request."""

    request_id: str  # from the trace
    worker: int  # where the router sent it
    arrival: float  # seconds
    input_tokens: int  # prompt length
    output_tokens: int  # generated length
    prefill_start: float = -1.0  # when its prefill began (queue time ends)
    first_token: float = -1.0  # when its first token was produced
    finish: float = -1.0  # when its last token was produced
    device_tokens: int = 0  # prompt tokens served from device cache
    host_tokens: int = 0  # ... loaded from host
    storage_tokens: int = 0  # ... prefetched from L3
    recomputed_tokens: int = 0  # prompt tokens prefilled
    predicted_blocks: int = -1  # cached blocks the router expected on the chosen worker (-1: no prediction)
    actual_blocks: int = -1  # cached blocks really there when the engine admitted it (tiers the policy sees)
    rejected: bool = False  # could never fit on the worker
    # SWA models: of actual_blocks, the prefix the engine can reuse (window KV before its end; -1: not SWA)
    usable_blocks: int = -1

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def queue(self) -> float:
        return self.prefill_start - self.arrival


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=1000, method="inclusive")[min(998, max(0, round(p * 10) - 1))]


@dataclass(slots=True)
class RunSummary:
    """Aggregates of one simulated run."""

    policy: str  # policy name
    requests: int  # completed requests
    rejected: int  # requests that could never fit on their worker
    hit_rate: float  # cached prompt tokens / prompt tokens
    hit_device: float  # share of prompt tokens from device
    hit_host: float  # ... from host
    hit_storage: float  # ... from L3
    recomputed: float  # share prefilled
    ttft_p50: float  # seconds
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    e2e_p50: float
    queue_p50: float
    throughput_tok_s: float  # output tokens per second of simulated time
    makespan_s: float  # first arrival to last finish
    load_imbalance: float  # max / mean requests per worker
    index_mae_blocks: float  # mean |predicted - actual| cached blocks at admission (policies that predict)
    index_exact: float  # share of requests predicted exactly
    unfinished: int = 0  # requests of the trace neither completed nor rejected (still running, queued or unreleased)
    events_rejected: int = 0  # events the router's index rejected
    # SWA models, policies that predict: the router's over-count against what the engine could reuse
    usable_mae_blocks: float = float("nan")  # mean |predicted - usable| blocks at admission
    overcount_blocks: float = float("nan")  # mean max(0, predicted - usable) blocks
    overcount_share: float = float("nan")  # predicted blocks that were not usable / predicted blocks
    extra: dict[str, Any] = field(default_factory=dict)  # policy-specific numbers

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(policy: str, records: list[RequestRecord], workers: int, events_rejected: int = 0,
              total: int | None = None) -> RunSummary:
    """Aggregates over completed requests; ``total`` (the trace's size, default ``len(records)``) minus the
    completed and rejected ones is reported as ``unfinished``, never silently dropped."""
    done = [r for r in records if not r.rejected and r.finish >= 0]
    rejected = sum(r.rejected for r in records)
    prompt = sum(r.input_tokens for r in done) or 1
    dev = sum(r.device_tokens for r in done)
    host = sum(r.host_tokens for r in done)
    sto = sum(r.storage_tokens for r in done)
    ttft = [r.ttft for r in done]
    per_worker = [0] * workers
    for r in done:
        per_worker[r.worker] += 1
    mean = sum(per_worker) / workers if workers else 0
    predicted = [r for r in done if r.predicted_blocks >= 0 and r.actual_blocks >= 0]
    start = min((r.arrival for r in done), default=0.0)
    end = max((r.finish for r in done), default=0.0)
    swa = [r for r in predicted if r.usable_blocks >= 0]
    over = [max(0, r.predicted_blocks - r.usable_blocks) for r in swa]
    nan = float("nan")
    return RunSummary(
        policy=policy, requests=len(done), rejected=rejected,
        unfinished=(len(records) if total is None else total) - len(done) - rejected,
        hit_rate=(dev + host + sto) / prompt, hit_device=dev / prompt, hit_host=host / prompt,
        hit_storage=sto / prompt, recomputed=sum(r.recomputed_tokens for r in done) / prompt,
        ttft_p50=_pct(ttft, 50), ttft_p90=_pct(ttft, 90), ttft_p99=_pct(ttft, 99),
        ttft_mean=statistics.fmean(ttft) if ttft else float("nan"),
        e2e_p50=_pct([r.e2e for r in done], 50), queue_p50=_pct([r.queue for r in done], 50),
        throughput_tok_s=sum(r.output_tokens for r in done) / max(end - start, 1e-9),
        makespan_s=end - start, load_imbalance=max(per_worker) / mean if mean else 0.0,
        index_mae_blocks=(statistics.fmean(abs(r.predicted_blocks - r.actual_blocks) for r in predicted)
                          if predicted else float("nan")),
        index_exact=(sum(r.predicted_blocks == r.actual_blocks for r in predicted) / len(predicted)
                     if predicted else float("nan")),
        events_rejected=events_rejected,
        usable_mae_blocks=statistics.fmean(abs(r.predicted_blocks - r.usable_blocks) for r in swa) if swa else nan,
        overcount_blocks=statistics.fmean(over) if swa else nan,
        overcount_share=sum(over) / max(1, sum(r.predicted_blocks for r in swa)) if swa else nan,
    )
