"""The KV link of a disaggregated cluster: each computed prompt's KV moving from its prefill worker to its decode
worker (:mod:`kvtier.sim.cluster`).

Two models, ``kv_link_sharing``:

* ``none``: every transfer moves at the link's whole bandwidth, however many run at once, as Dynamo's mocker moves
  them (so the cross-check compares like with like).
* ``nic``: each worker's NIC is shared by the transfers it sends or receives at once. A transfer moves at the
  bandwidth over the larger of its two ends' counts (its bottleneck's fair share), recomputed whenever a transfer
  starts or ends, so fifteen prefill workers sending to one decode worker share that worker's link. The share is a
  transfer's bottleneck alone, not the max-min fair allocation of the whole network: a transfer held back at one end
  leaves bandwidth at its other end unused by the rest.

Invariant (``nic``): between two starts or ends no rate changes, so each transfer's bytes left fall linearly; the
one timer pending fires at the earliest end among them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.sim.core import Environment, Timer

#: ``kv_link_sharing`` values.
SHARING = ("none", "nic")


@dataclass(slots=True, eq=False)
class _Transfer:
    src: int  # sending (prefill) worker
    dst: int  # receiving (decode) worker
    left: float  # bytes not yet moved, as of KvLink._at
    rate: float  # bytes per second since KvLink._at
    done: Callable[[], None]  # called once every byte has moved


class KvLink:
    """Transfers over the cluster's KV link of ``gbps`` (GB/s per NIC), shared as ``sharing`` says."""

    def __init__(self, env: Environment, gbps: float, sharing: str = "none") -> None:
        if sharing not in SHARING:
            raise ValueError(f"kv_link_sharing {sharing!r}: expected one of {', '.join(SHARING)}")
        self.env = env
        self.bandwidth = gbps * 1e9  # bytes per second
        self.shared = sharing == "nic"
        self._active: list[_Transfer] = []
        self._out: Counter[int] = Counter()  # transfers each worker sends now
        self._in: Counter[int] = Counter()  # and receives
        self._at = 0.0  # when the bytes left were last brought up to date
        self._timer: Timer | None = None

    def start(self, src: int, dst: int, nbytes: float, done: Callable[[], None]) -> None:
        """Moves ``nbytes`` from worker ``src`` to worker ``dst``, then calls ``done`` (at priority 1, as every
        transfer's end). O(1) unshared, O(transfers in flight) shared."""
        if not self.shared:
            self.env.after(nbytes / self.bandwidth, done, priority=1)
            return
        self._advance()
        self._active.append(_Transfer(src, dst, float(nbytes), 0.0, done))
        self._out[src] += 1
        self._in[dst] += 1
        self._reschedule()

    @property
    def in_flight(self) -> int:
        """Transfers started and not yet ended (shared only; 0 unshared, where none is tracked)."""
        return len(self._active)

    def _advance(self) -> None:
        """Brings every transfer's bytes left up to now."""
        elapsed = self.env.now - self._at
        if elapsed > 0:
            for t in self._active:
                t.left -= t.rate * elapsed
        self._at = self.env.now

    def _reschedule(self) -> None:
        """Every transfer's rate from its ends' counts, and the one timer at the earliest end."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._active:
            return
        first = None
        for t in self._active:
            t.rate = self.bandwidth / max(self._out[t.src], self._in[t.dst])
            end = max(t.left, 0.0) / t.rate
            if first is None or end < first:
                first = end
        assert first is not None
        self._timer = self.env.after(first, self._end, priority=1)

    def _end(self) -> None:
        """The earliest transfer has moved its last byte, and so has any due within the clock's rounding of it: they
        end now, whatever rounding left of their bytes (at a large ``now`` a nanosecond is below the clock's
        resolution, and waiting for the rest would fire again at the same instant)."""
        self._timer = None
        self._advance()
        due = [max(t.left, 0.0) / t.rate for t in self._active]
        tolerance = max(1e-9, 4 * math.ulp(self.env.now))
        first = min(due)
        ended = [t for t, d in zip(self._active, due, strict=True) if d <= first + tolerance]
        for t in ended:
            self._active.remove(t)
            self._out[t.src] -= 1
            self._in[t.dst] -= 1
        self._reschedule()
        for t in ended:
            t.done()
