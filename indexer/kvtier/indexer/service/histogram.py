"""Latency histograms for the service's metrics: where a slow answer spent its time.

A router's operator sees the client's latency; these say which part of the service it came from: time inside
a request's handler, time waiting for the index lock (held by event application), time each event batch held
that lock, and how late the HTTP event loop woke up (a starved loop delays every connection at once, whatever
the handlers cost). Exposed as Prometheus histograms (``_bucket``/``_sum``/``_count``) and in the JSON metrics.

Each histogram has one writer thread; a reader on another thread may see one observation half counted (a
bucket ahead of ``count``), never a torn number.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

#: Upper bounds in seconds: fine below 10 ms, where a router's hot path lives, coarse up to the seconds a
#: stall takes.
LATENCY_BOUNDS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class Histogram:
    """Counts of observations per bucket (``counts[i]``: those in ``(bounds[i-1], bounds[i]]``, the last one
    past every bound), their sum and the largest.

    Invariant (:meth:`_check`): ``count == sum(counts)``, ``len(counts) == len(bounds) + 1``, bounds ascend.
    """

    bounds: tuple[float, ...] = LATENCY_BOUNDS  # bucket upper bounds, ascending (seconds)
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; one more than bounds (+Inf)
    count: int = 0  # observations
    total: float = 0.0  # their sum
    max: float = 0.0  # the largest

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Counts one observation. O(log buckets)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the ``q`` quantile (an upper estimate; ``max`` past the last
        bound; 0 with no observations). O(buckets)."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for i, n in enumerate(self.counts):
            seen += n
            if seen >= rank:
                return self.bounds[i] if i < len(self.bounds) else self.max
        return self.max

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations at or below it)`` per bucket, ``inf`` last: Prometheus's ``le``
        buckets. O(buckets)."""
        out: list[tuple[float, int]] = []
        seen = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            seen += n
            out.append((bound, seen))
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON form: ``buckets`` as ``[le, cumulative count]`` (``le`` null for +Inf), ``count``, ``sum``,
        ``max``, and the p50 / p99 upper estimates. O(buckets)."""
        return {"buckets": [[None if math.isinf(b) else b, n] for b, n in self.cumulative()],
                "count": self.count, "sum": self.total, "max": self.max,
                "p50": self.quantile(0.5), "p99": self.quantile(0.99)}

    def _check(self) -> None:
        assert len(self.counts) == len(self.bounds) + 1, "one bucket per bound plus +Inf"
        assert all(a < b for a, b in zip(self.bounds, self.bounds[1:], strict=False)), "bounds must ascend"
        assert self.count == sum(self.counts), f"count {self.count} != bucket total {sum(self.counts)}"
        assert self.max <= self.total + 1e-12 or self.count == 0, "max exceeds the sum of observations"
