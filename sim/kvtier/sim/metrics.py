"""Per-request records and per-run summaries."""

from __future__ import annotations

import math
import statistics
from array import array
from collections.abc import Iterable, Sequence
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
    second_token: float = -1.0  # when its second token was produced (-1: it generated one token, or none yet)
    max_itl: float = -1.0  # its longest gap between two consecutive tokens, seconds (-1: fewer than two tokens)
    # Disaggregated serving (kvtier.sim.cluster): the decode worker (-1: aggregated), when the prompt's KV was
    # computed (-1: not yet), the prompt tokens the decode worker held already and those sent it over the KV link
    # (the two sum to the prompt once it was received; a prompt prefilled on its decode worker sends none), and
    # when the decode worker had room for its prompt and output and began receiving (-1: not yet, or nothing was
    # handed off: aggregated, or prefilled on its decode worker)
    decode_worker: int = -1
    prefill_end: float = -1.0
    decode_cached_tokens: int = 0
    transferred_tokens: int = 0
    receive_start: float = -1.0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def ttst(self) -> float:
        """Time to second token, seconds (nan: fewer than two tokens)."""
        return self.second_token - self.arrival if self.second_token >= 0 else math.nan

    @property
    def tpot(self) -> float:
        """Time per output token after the first, seconds: ``(e2e - TTFT) / (tokens - 1)``, which is also the mean
        inter-token latency of the request (nan: fewer than two tokens, or not finished)."""
        n = max(self.output_tokens, 1)
        return (self.finish - self.first_token) / (n - 1) if n > 1 and self.finish >= 0 else math.nan

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def queue(self) -> float:
        return self.prefill_start - self.arrival

    @property
    def decode_queue(self) -> float:
        """Disaggregated: from its prompt's KV computed on its prefill worker to its decode worker having room for
        it, seconds: the decode pool's queue, in TTFT (nan: nothing was handed off, or not yet)."""
        return self.receive_start - self.prefill_end if self.receive_start >= 0 else math.nan


@dataclass(slots=True, frozen=True)
class Slo:
    """Service-level objectives a request must meet, every given one, to count toward goodput (DistServe's
    measure): time to first token, time per output token and end-to-end latency, seconds; None: not bounded."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __bool__(self) -> bool:
        return not (self.ttft_s is None and self.tpot_s is None and self.e2e_s is None)

    def scaled(self, factor: float) -> Slo:
        """Every bound multiplied by ``factor`` (< 1 tightens)."""
        def f(x: float | None) -> float | None:
            return None if x is None else x * factor
        return Slo(f(self.ttft_s), f(self.tpot_s), f(self.e2e_s))

    def met(self, ttft: Any, tpot: Any, e2e: Any) -> Any:
        """Which requests meet every bound: works on floats or numpy arrays alike (a TPOT of nan, a one-token
        answer, meets any TPOT bound)."""
        ok: Any = True
        if self.ttft_s is not None:
            ok = ok & (ttft <= self.ttft_s)
        if self.tpot_s is not None:
            ok = ok & ~(tpot > self.tpot_s)
        if self.e2e_s is not None:
            ok = ok & (e2e <= self.e2e_s)
        return ok

    def describe(self) -> str:
        parts = [f"{name} <= {v * 1000:g} ms" for name, v in (("TTFT", self.ttft_s), ("TPOT", self.tpot_s),
                                                           ("e2e", self.e2e_s)) if v is not None]
        return ", ".join(parts) or "none"


def _pct(xs: Sequence[float], p: float) -> float:
    """Percentile ``p`` (to a tenth) of ``xs``, interpolated between the two values around it as
    ``statistics.quantiles(xs, n=1000, method="inclusive")`` does, but never outside them: the weighted sum can land
    an ulp past two equal values, so a percentile could exceed the largest value or a higher percentile.
    O(n log n)."""
    if not xs:
        return float("nan")
    data = sorted(xs)
    if len(data) == 1:
        return data[0]
    j, delta = divmod(min(999, max(1, round(p * 10))) * (len(data) - 1), 1000)
    lo, hi = data[j], data[j + 1]
    return min(hi, max(lo, (lo * (1000 - delta) + hi * delta) / 1000))


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
    load_imbalance: float  # max / mean requests per worker (disaggregated: of the worse pool)
    index_mae_blocks: float  # mean |predicted - actual| cached blocks at admission (policies that predict)
    index_exact: float  # share of requests predicted exactly
    unfinished: int = 0  # requests of the trace neither completed nor rejected (still running, queued or unreleased)
    events_rejected: int = 0  # events the router's index rejected
    # SWA models, policies that predict: the router's over-count against what the engine could reuse
    usable_mae_blocks: float = float("nan")  # mean |predicted - usable| blocks at admission
    overcount_blocks: float = float("nan")  # mean max(0, predicted - usable) blocks
    overcount_share: float = float("nan")  # predicted blocks that were not usable / predicted blocks
    # What a user feels, seconds, percentiles over completed requests (TTST, TPOT and max ITL over those that
    # generated two tokens or more; a request's TPOT is also its mean inter-token latency)
    ttft_p95: float = float("nan")
    ttst_p50: float = float("nan")  # time to second token
    ttst_p90: float = float("nan")
    ttst_p95: float = float("nan")
    ttst_p99: float = float("nan")
    tpot_p50: float = float("nan")  # time per output token after the first
    tpot_p90: float = float("nan")
    tpot_p95: float = float("nan")
    tpot_p99: float = float("nan")
    itl_max_p50: float = float("nan")  # a request's longest inter-token gap
    itl_max_p90: float = float("nan")
    itl_max_p95: float = float("nan")
    itl_max_p99: float = float("nan")
    e2e_p90: float = float("nan")
    e2e_p95: float = float("nan")
    e2e_p99: float = float("nan")
    queue_p90: float = float("nan")
    queue_p95: float = float("nan")
    queue_p99: float = float("nan")
    # Disaggregated: the wait of a prompt computed on its prefill worker for room on its decode worker, seconds, over
    # completed requests that were handed off (nan: none was)
    decode_queue_p50: float = float("nan")
    decode_queue_p90: float = float("nan")
    decode_queue_p95: float = float("nan")
    decode_queue_p99: float = float("nan")
    # Disaggregated: shares of the completed requests' prompt tokens moved over the KV link, and of the handed-off
    # ones' found on their decode worker (the transfer its radix cache saved); nan aggregated, or none handed off
    kv_transferred: float = float("nan")
    decode_cached: float = float("nan")
    # Under the run's SLO (nan without one): the share of the trace's requests that completed meeting every bound
    # (rejected and unfinished ones count as missing it), and their rate per second of the makespan
    goodput: float = float("nan")
    goodput_rps: float = float("nan")
    slo: str = ""  # the SLO, in words ("TTFT <= 500 ms, TPOT <= 50 ms"); empty without one
    extra: dict[str, Any] = field(default_factory=dict)  # policy-specific numbers

    @property
    def total(self) -> int:
        """The trace's requests: completed, rejected and unfinished."""
        return self.requests + self.rejected + self.unfinished

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class SummaryBuilder:
    """A :class:`RunSummary` built one record at a time, in any order, with the same figures as a batch
    over the records would give: sums are exact (integers, or floats summed once at the end), the
    percentiles sort every value.

    Memory: seven floats per completed request (TTFT, TTST, TPOT, max ITL, end-to-end, queue, decode queue), kept
    for exact percentiles and goodput, and nothing per record otherwise. :meth:`add` is O(1); :meth:`summary`
    O(n log n).
    """

    def __init__(self, workers: int, slo: Slo | None = None) -> None:
        self.workers = workers
        self.slo = slo if slo else None  # goodput's bounds, if any
        self.records = 0  # records added
        self.rejected = 0  # of them, rejected
        self.per_worker = [0] * workers  # completed requests per worker
        # Disaggregated: workers 0..split-1 prefill, the rest decode; a request counts on each of its two workers
        # and the imbalance is the worse pool's (0: aggregated)
        self.split = 0
        self.ttft = array("d")  # of completed requests, seconds, in the order added
        self.e2e = array("d")
        self.queue = array("d")
        self.ttst = array("d")  # nan where a request generated one token
        self.tpot = array("d")  # (ditto)
        self.itl_max = array("d")  # (ditto)
        self.decode_queue = array("d")  # nan where nothing was handed off (aggregated, or prefilled locally)
        # token sums of completed requests
        self.prompt = self.device = self.host = self.storage = self.recomputed = self.output = 0
        self.transferred = self.decode_cached = self.handed_off = 0  # (prompt tokens of the requests handed off)
        self.start = math.inf  # earliest arrival of a completed request
        self.end = -math.inf  # latest finish of a completed request
        self.predicted = 0  # completed requests with a prediction and an admission count
        self.abs_error = 0  # sum of |predicted - actual| blocks over them
        self.exact = 0  # of them, predicted exactly
        self.swa = 0  # of those, with a usable (SWA) count
        self.usable_error = 0  # sum of |predicted - usable| over them
        self.overcount = 0  # sum of max(0, predicted - usable) over them
        self.swa_predicted = 0  # sum of predicted blocks over them

    def add(self, r: RequestRecord) -> None:
        """Counts one record (completed, rejected, or neither: unfinished). O(1)."""
        self.records += 1
        if r.rejected:
            self.rejected += 1
            return
        if r.finish < 0:
            return
        self.per_worker[r.worker] += 1
        if r.decode_worker >= 0 and r.decode_worker != r.worker:
            self.per_worker[r.decode_worker] += 1
        self.ttft.append(r.ttft)
        self.e2e.append(r.e2e)
        self.queue.append(r.queue)
        self.ttst.append(r.ttst)
        self.tpot.append(r.tpot)
        self.itl_max.append(r.max_itl if r.max_itl >= 0 else math.nan)
        self.decode_queue.append(r.decode_queue)
        self.prompt += r.input_tokens
        self.device += r.device_tokens
        self.host += r.host_tokens
        self.storage += r.storage_tokens
        self.recomputed += r.recomputed_tokens
        self.output += max(r.output_tokens, 1)  # (a 0 generates one token)
        if r.receive_start >= 0:
            self.handed_off += r.input_tokens
            self.transferred += r.transferred_tokens
            self.decode_cached += r.decode_cached_tokens
        self.start = min(self.start, r.arrival)
        self.end = max(self.end, r.finish)
        if r.predicted_blocks >= 0 and r.actual_blocks >= 0:
            self.predicted += 1
            self.abs_error += abs(r.predicted_blocks - r.actual_blocks)
            self.exact += r.predicted_blocks == r.actual_blocks
            if r.usable_blocks >= 0:
                self.swa += 1
                self.usable_error += abs(r.predicted_blocks - r.usable_blocks)
                self.overcount += max(0, r.predicted_blocks - r.usable_blocks)
                self.swa_predicted += r.predicted_blocks

    def summary(self, policy: str, events_rejected: int = 0, total: int | None = None) -> RunSummary:
        """The aggregates; ``total`` (the trace's size, default the records added) minus the completed and
        rejected requests is reported as ``unfinished``, never silently dropped."""
        done = len(self.ttft)
        start, end = (self.start, self.end) if done else (0.0, 0.0)
        mean = sum(self.per_worker) / self.workers if self.workers else 0
        imbalance = max(self.per_worker) / mean if mean else 0.0
        if self.split:
            pools = [c for c in (self.per_worker[:self.split], self.per_worker[self.split:]) if sum(c)]
            imbalance = max((max(c) * len(c) / sum(c) for c in pools), default=0.0)
        nan = float("nan")
        if not done:  # no completed request: shares, throughput, spans and balance do not apply (null), not 0
            imbalance = nan

        def share(tokens: int) -> float:
            return tokens / self.prompt if self.prompt else nan
        # Means of integers divide the exact sum once, as statistics.fmean does.
        return RunSummary(
            policy=policy, requests=done, rejected=self.rejected,
            unfinished=(self.records if total is None else total) - done - self.rejected,
            hit_rate=share(self.device + self.host + self.storage), hit_device=share(self.device),
            hit_host=share(self.host), hit_storage=share(self.storage), recomputed=share(self.recomputed),
            ttft_p50=_pct(self.ttft, 50), ttft_p90=_pct(self.ttft, 90), ttft_p99=_pct(self.ttft, 99),
            ttft_mean=statistics.fmean(self.ttft) if done else nan,
            e2e_p50=_pct(self.e2e, 50), queue_p50=_pct(self.queue, 50),
            throughput_tok_s=self.output / max(end - start, 1e-9) if done else nan,
            makespan_s=end - start if done else nan, load_imbalance=imbalance,
            index_mae_blocks=self.abs_error / self.predicted if self.predicted else nan,
            index_exact=self.exact / self.predicted if self.predicted else nan,
            events_rejected=events_rejected,
            usable_mae_blocks=self.usable_error / self.swa if self.swa else nan,
            overcount_blocks=self.overcount / self.swa if self.swa else nan,
            overcount_share=self.overcount / max(1, self.swa_predicted) if self.swa else nan,
            kv_transferred=share(self.transferred) if self.split else nan,
            decode_cached=self.decode_cached / self.handed_off if self.split and self.handed_off else nan,
            **self._felt(done, (self.records if total is None else total), end - start),
        )

    def _felt(self, done: int, total: int, makespan: float) -> dict[str, Any]:
        """The percentiles of what a user feels, and goodput under the SLO. O(n log n)."""
        out: dict[str, Any] = {"ttft_p95": _pct(self.ttft, 95)}
        for name, xs in (("ttst", self.ttst), ("tpot", self.tpot), ("itl_max", self.itl_max),
                         ("decode_queue", self.decode_queue)):
            vals = [x for x in xs if not math.isnan(x)]
            out.update({f"{name}_p{p}": _pct(vals, p) for p in (50, 90, 95, 99)})
        out.update({f"{name}_p{p}": _pct(xs, p) for name, xs in (("e2e", self.e2e), ("queue", self.queue))
                    for p in (90, 95, 99)})
        if self.slo is not None:
            good = goodput_count(self.slo, self.ttft, self.tpot, self.e2e)
            out.update(goodput=good / total if total else math.nan, goodput_rps=good / max(makespan, 1e-9),
                       slo=self.slo.describe())
        return out


def goodput_count(slo: Slo, ttft: Sequence[float], tpot: Sequence[float], e2e: Sequence[float]) -> int:
    """How many of the completed requests whose latencies are given meet ``slo``. O(n)."""
    import numpy as np

    t = np.asarray(ttft)
    # (an SLO without a bound is met by every one: met() answers a scalar True then, counted once alone)
    return int(np.count_nonzero(np.broadcast_to(slo.met(t, np.asarray(tpot), np.asarray(e2e)), t.shape)))


def summarize(policy: str, records: Iterable[RequestRecord], workers: int, events_rejected: int = 0,
              total: int | None = None, slo: Slo | None = None, prefill_workers: int = 0) -> RunSummary:
    """Aggregates over completed requests (:class:`SummaryBuilder`); ``total`` (the trace's size, default
    the number of records) minus the completed and rejected ones is reported as ``unfinished``.
    ``prefill_workers``: a disaggregated run's (workers ``0..P-1`` prefill; the imbalance is the worse pool's, as
    the run's own summary has it); 0 for an aggregated one."""
    builder = SummaryBuilder(workers, slo)
    builder.split = prefill_workers
    for r in records:
        builder.add(r)
    return builder.summary(policy, events_rejected, total)
