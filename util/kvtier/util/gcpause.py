"""Garbage-collector pauses of a long-running process: measured, and kept short for the service.

CPython's cyclic collector stops every thread while it runs, and a full (generation 2) pass visits every
object the collector tracks. A started service holds some 100,000 such objects that live as long as it does
(modules, numba's compiled kernels, aiohttp's machinery); a full pass over them stalls the event loop and every
query in flight, and set the p99 of ``bench/service_bench.py``. :func:`freeze_startup_objects` moves them out of
the collector's view once startup is done (``gc.freeze``), so later passes visit only what was allocated since
(figures: ``bench/MEASUREMENTS.md``).

Objects frozen are still freed by reference counting; only a reference cycle among them would outlive its
use, and startup objects are meant to live as long as the process anyway.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


def freeze_startup_objects() -> int:
    """Collects what startup left as garbage, then freezes every object still alive so that later
    collections skip it. Returns how many objects are frozen. O(objects)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


#: Net new container objects between young-generation passes inside :func:`rare_collections` (CPython's
#: default is 700).
RARE_YOUNG_THRESHOLD = 50_000


@contextmanager
def rare_collections(young: int = RARE_YOUNG_THRESHOLD) -> Iterator[None]:
    """Runs the block with the collector's young-generation threshold raised to at least ``young``, then
    restores the thresholds it found (process-wide, like every ``gc`` setting); a threshold of 0
    (automatic collection off) stays 0.

    For batch work over a heap of millions of long-lived objects that die by reference count, such as a
    simulation's radix trees, index and page stores: the default threshold starts a young pass every 700
    net allocations and, as they pile up, full passes that walk the whole heap and find next to no cycles.
    On a long replay this takes most of the collector's time out of the run (``bench/MEASUREMENTS.md``).
    Cyclic garbage is still collected, only later. O(1).
    """
    if young < 1:
        raise ValueError(f"young-generation threshold must be >= 1, got {young}")
    old = gc.get_threshold()
    # A threshold of 0 means automatic collection is off; a higher one set by the caller is kept.
    gc.set_threshold(old[0] and max(young, old[0]), *old[1:])
    try:
        yield
    finally:
        gc.set_threshold(*old)


@dataclass(slots=True)
class GcPauses:
    """Counts the collector's passes and how long they stopped the process, through ``gc.callbacks``.

    Install with :meth:`install`, remove with :meth:`uninstall`. The callbacks run on whichever thread
    triggered the collection and take no lock: a lock held by a reader that allocates could be wanted by
    the collection that allocation starts (a deadlock), and passes never overlap (the collector runs one
    at a time), so each figure is updated by one writer at a time; a reader may see one pass half
    counted. O(1) per pass.
    """

    passes: int = 0  # collector passes seen, every generation
    full_passes: int = 0  # of which generation 2
    total_seconds: float = 0.0  # time spent in all of them
    max_seconds: float = 0.0  # the longest pass
    _started: float = 0.0  # perf_counter at the start of the pass under way

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        spent = time.perf_counter() - self._started
        self.passes += 1
        self.full_passes += info.get("generation") == 2
        self.total_seconds += spent
        self.max_seconds = max(self.max_seconds, spent)

    def install(self) -> None:
        """Starts counting (idempotent)."""
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        """Stops counting (idempotent)."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def figures(self) -> dict[str, float]:
        """``gc_passes``, ``gc_full_passes``, ``gc_pause_seconds`` (total) and ``gc_pause_max_seconds``."""
        return {"gc_passes": self.passes, "gc_full_passes": self.full_passes,
                "gc_pause_seconds": self.total_seconds, "gc_pause_max_seconds": self.max_seconds}
