"""A tiny deterministic discrete-event core.

One clock, one heap of ``(time, priority, counter, callback)``: events at the same
time run by priority, then in scheduling order, so a run is reproducible for a
seed. An exception in a callback propagates out of :meth:`Environment.run`;
nothing is swallowed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True, order=True)
class _Entry:
    time: float  # when it fires
    priority: int  # lower fires first among equal times
    seq: int  # scheduling order: the final tie-break
    callback: Callable[[], None] = field(compare=False)  # what to run
    cancelled: bool = field(default=False, compare=False)  # skipped when popped


class Timer:
    """Handle of a scheduled callback; :meth:`cancel` makes it a no-op."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    @property
    def time(self) -> float:
        return self._entry.time

    def cancel(self) -> None:
        self._entry.cancelled = True


class Environment:
    """Owns simulated time (seconds). Every method is O(log n) in scheduled events."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[_Entry] = []
        self._seq = itertools.count()
        self.processed = 0

    def at(self, time: float, callback: Callable[[], None], priority: int = 0) -> Timer:
        """Runs ``callback`` at absolute ``time`` (never in the past)."""
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        entry = _Entry(time, priority, next(self._seq), callback)
        heapq.heappush(self._heap, entry)
        return Timer(entry)

    def after(self, delay: float, callback: Callable[[], None], priority: int = 0) -> Timer:
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        return self.at(self.now + delay, callback, priority)

    def run(self, until: float | None = None) -> None:
        """Processes events in order until none is left (or the next is past ``until``)."""
        heap = self._heap
        while heap:
            if until is not None and heap[0].time > until:
                self.now = until
                return
            entry = heapq.heappop(heap)
            if entry.cancelled:
                continue
            self.now = entry.time
            self.processed += 1
            entry.callback()

    @property
    def pending(self) -> int:
        return sum(1 for e in self._heap if not e.cancelled)
