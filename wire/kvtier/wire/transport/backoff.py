"""How often a stream may be resynchronised: resyncs that keep coming wait longer and longer.

A consumer that finds its state inconsistent asks for a resync; an engine that keeps losing events (or a bug that
keeps rejecting them) would otherwise have the index replay or dump the worker's whole state in a loop.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backoff"]


@dataclass(slots=True)
class Backoff:
    """Least time between two resyncs: ``base_s`` at first, doubling while they keep coming, up to ``max_s``; a
    quiet spell of four intervals starts it over at ``base_s``.

    Invariant: ``base_s <= interval <= max_s`` once a resync was allowed (``interval`` is 0 before).
    """

    base_s: float = 1.0  # the first interval
    max_s: float = 60.0  # the ceiling
    next_at: float = float("-inf")  # earliest time the next resync may start
    interval: float = 0.0  # current interval (0 until the first resync)
    _last: float = float("-inf")  # when the last allowed resync started

    def allow(self, now: float) -> bool:
        """True, and the interval advanced, if a resync may start at ``now``; False (nothing changes) while the
        interval since the last one runs. O(1)."""
        if now < self.next_at:
            return False
        quiet = now - self._last > 4 * max(self.interval, self.base_s)
        self.interval = self.base_s if quiet else min(2 * self.interval, self.max_s)
        self._last = now
        self.next_at = now + self.interval
        return True
