"""A tiny deterministic discrete-event core.

One clock, one heap of ``(time, priority, seq, callback)``: events at the same
time run by priority, then in scheduling order, so a run is reproducible for a
seed. An exception in a callback propagates out of :meth:`Environment.run`;
nothing is swallowed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    time: float  # when it fires
    callback: Callable[[], None]  # what to run
    cancelled: bool = False  # skipped when popped


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
    """Owns simulated time (seconds). Every method is O(log n) in scheduled events.

    The heap holds ``(time, priority, seq, entry)`` tuples: ``seq`` is unique, so the order is total
    and compared in C, never reaching the entry. ``reserved`` sequence numbers ``0 .. reserved - 1``
    are the caller's to hand out (:meth:`at`'s ``seq``): an event scheduled late with a reserved
    number runs exactly where it would have run had it been scheduled before everything else, which
    lets a caller feed a long list of arrivals one at a time instead of all up front.
    """

    def __init__(self, reserved: int = 0) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, _Entry]] = []
        self._seq = itertools.count(reserved)
        self._reserved = reserved
        self.processed = 0

    def at(self, time: float, callback: Callable[[], None], priority: int = 0, *, seq: int | None = None) -> Timer:
        """Runs ``callback`` at absolute ``time`` (never in the past). ``seq``: a reserved sequence
        number (see the class docstring), each used once."""
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        if seq is None:
            seq = next(self._seq)
        elif not 0 <= seq < self._reserved:
            raise ValueError(f"seq {seq} is not a reserved sequence number (0 .. {self._reserved - 1})")
        entry = _Entry(time, callback)
        heapq.heappush(self._heap, (time, priority, seq, entry))
        return Timer(entry)

    def after(self, delay: float, callback: Callable[[], None], priority: int = 0) -> Timer:
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        return self.at(self.now + delay, callback, priority)

    def run(self, until: float | None = None) -> None:
        """Processes events in order until none is left (or the next is past ``until``)."""
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            time, _, _, entry = pop(heap)
            if entry.cancelled:
                continue
            self.now = time
            self.processed += 1
            entry.callback()

    @property
    def pending(self) -> int:
        return sum(1 for e in self._heap if not e[3].cancelled)
