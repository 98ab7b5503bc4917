"""Routed requests' deadlines in the indexer service: a request the router booked on a worker (``POST /route``)
counts in that worker's load until it finishes, or until its time to live runs out, for a client that never says.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable

__all__ = ["Deadlines"]

log = logging.getLogger(__name__)


class Deadlines:
    """Each in-flight request id's deadline, and a heap of them for expiry.

    Invariant: every id in flight has exactly one heap entry with its deadline; the heap may also hold stale
    entries of ids finished (or booked again) since, skipped when they come up, at most about twice as many as are
    in flight (past that the heap is rebuilt from the ids in flight: routes finished at a high rate do not hold
    memory until their time to live). Not thread-safe: the service calls it under its lock.
    """

    __slots__ = ("_due", "_heap", "clock", "expired", "ttl_s")

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the time base of every ``now`` the service passes (bookings, expiry, observed TTFT and TPOT);
        tests move it by hand, so that no expiry depends on how fast the machine runs."""
        self.ttl_s = ttl_s  # how long a request stays in flight without a finish
        self.clock = clock
        self._due: dict[str, float] = {}  # request id -> its deadline
        self._heap: list[tuple[float, str]] = []  # (deadline, request id), stale entries included
        self.expired = 0  # requests dropped at their deadline

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, rid: str) -> bool:
        return rid in self._due

    def book(self, rid: str, now: float) -> None:
        """``rid`` is in flight from ``now`` until ``now + ttl_s``; ``ValueError`` if it is already. O(log n)
        amortised."""
        if rid in self._due:
            raise ValueError(f"request {rid!r} is already in flight")
        deadline = now + self.ttl_s
        self._due[rid] = deadline
        heapq.heappush(self._heap, (deadline, rid))
        if len(self._heap) > 2 * len(self._due) + 1024:  # mostly stale: O(n) once per n bookings or more
            self._heap = [(d, r) for r, d in self._due.items()]
            heapq.heapify(self._heap)

    def finish(self, rid: str) -> bool:
        """``rid`` is no longer in flight; whether it was. O(1) (its heap entry goes stale)."""
        return self._due.pop(rid, None) is not None

    def due(self, now: float) -> bool:
        """Whether some heap entry's deadline has passed (a stale one included). O(1)."""
        return bool(self._heap) and self._heap[0][0] <= now

    def expire(self, now: float, limit: int | None = None) -> list[str]:
        """The requests whose deadline has passed, no longer in flight: at most ``limit`` of them, the earliest
        first (the rest stay due). O(expired log n)."""
        gone: list[str] = []
        while self._heap and self._heap[0][0] <= now and (limit is None or len(gone) < limit):
            deadline, rid = heapq.heappop(self._heap)
            if self._due.get(rid) == deadline:
                del self._due[rid]
                gone.append(rid)
                log.info("request %s expired after %g s without finish", rid, self.ttl_s)
        self.expired += len(gone)
        return gone

    def _check(self) -> None:
        live = {(d, rid) for d, rid in self._heap if self._due.get(rid) == d}
        assert len(live) == len(self._due), f"{len(self._due)} requests in flight, {len(live)} live heap entries"
