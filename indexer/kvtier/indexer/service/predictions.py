"""What the service predicted for each routed request, against what its reports show: how well the latency model
fits the operator's hardware.

At ``/route`` the service predicts the request's time to first token and time per output token on the chosen
worker (:meth:`kvtier.indexer.routing.scoring.SloCost.estimates`: the router's own model of queued prefill, tier
loads and
the decode step, with the configured links, latency fit and device capacity). Its first-token report gives the
observed TTFT (time since ``/route``, on the service's clock), its finish with ``output_tokens`` the observed TPOT
(time since the first token over the tokens after it). The absolute errors go into histograms and their signed
mean tells whether the model runs fast or slow; ``/metrics`` exports both.

Invariant: a request is held here from its ``/route`` until its finish or expiry, as in the load bookkeeping, so
memory is bounded by the bookings in flight. Every method is O(1); the caller holds the service's lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.indexer.service.histogram import Histogram


@dataclass(slots=True)
class _Pending:
    routed: float  # when it was routed (the service's monotonic clock)
    ttft_s: float  # predicted
    tpot_s: float  # predicted (nan: no capacity configured)
    first: float = -1.0  # when its first token was reported


@dataclass(slots=True)
class ErrorStats:
    """Absolute errors of one prediction (a histogram, seconds) and their signed sum (observed - predicted)."""

    abs_error: Histogram = field(default_factory=Histogram)
    signed_sum: float = 0.0

    def observe(self, observed: float, predicted: float) -> None:
        self.abs_error.observe(abs(observed - predicted))
        self.signed_sum += observed - predicted

    def as_dict(self) -> dict[str, object]:
        n = self.abs_error.count
        return {"abs_error_seconds": self.abs_error.as_dict(),
                "mean_signed_error_seconds": self.signed_sum / n if n else None}


class Predictions:
    """Predicted TTFT / TPOT per routed request and the errors their reports show."""

    __slots__ = ("_pending", "tpot", "ttft")

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self.ttft = ErrorStats()
        self.tpot = ErrorStats()

    def routed(self, rid: str, now: float, ttft_ms: float, tpot_ms: float) -> None:
        self._pending[rid] = _Pending(now, ttft_ms / 1000.0, tpot_ms / 1000.0)

    def first_token(self, rid: str, now: float) -> float | None:
        """Records the observed TTFT (the first report only); returns it, seconds."""
        p = self._pending.get(rid)
        if p is None or p.first >= 0:
            return None
        p.first = now
        observed = now - p.routed
        self.ttft.observe(observed, p.ttft_s)
        return observed

    def finish(self, rid: str, now: float, output_tokens: int | None) -> float | None:
        """Forgets the request; with its first token seen and two tokens or more, records the observed TPOT and
        returns it, seconds."""
        p = self._pending.pop(rid, None)
        if p is None or p.first < 0 or output_tokens is None or output_tokens < 2 or math.isnan(p.tpot_s):
            return None
        observed = (now - p.first) / (output_tokens - 1)
        self.tpot.observe(observed, p.tpot_s)
        return observed

    def forget(self, rid: str) -> None:
        self._pending.pop(rid, None)

    def __len__(self) -> int:
        return len(self._pending)

    def as_dict(self) -> dict[str, object]:
        return {"ttft": self.ttft.as_dict(), "tpot": self.tpot.as_dict()}
