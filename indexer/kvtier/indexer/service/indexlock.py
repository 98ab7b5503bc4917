"""The service's lock over the index, the loads and the deadlines, with a hand-off to waiting requests.

The event loop applies a large batch in slices (:meth:`kvtier.indexer.index.consumer.IndexConsumer.slices`), so that
a query waits for a slice, never a whole batch: a batch's size is bounded only by the largest frame taken (64 MiB), and
one of a million cheap events held every request, ``/health`` included, for seconds. Between two slices the loop calls
:meth:`IndexLock.let_waiters_in`. A plain lock would not do: the thread that releases it may take it back before a
waiter wakes, so a request could wait through every slice all the same.

Invariant: ``_waiting`` counts the threads inside :meth:`acquire` (waiting, or just through), ``_entered`` every
acquisition made through it; both change under ``_cond`` only.
"""

from __future__ import annotations

import threading
from types import TracebackType

__all__ = ["IndexLock"]


class IndexLock:
    """A lock (``with lock:``) whose holder can let the threads waiting for it in first. Not reentrant."""

    __slots__ = ("_cond", "_entered", "_lock", "_waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0  # threads in acquire()
        self._entered = 0  # acquisitions through acquire(), ever

    def acquire(self) -> None:
        with self._cond:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cond:
                self._waiting -= 1
                self._entered += 1
                self._cond.notify_all()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> IndexLock:
        self.acquire()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()

    def let_waiters_in(self, timeout_s: float = 1.0) -> int:
        """Called by the holder: if threads are waiting for the lock, releases it until each of them has taken it
        (or ``timeout_s`` passed: one that gave up waiting), then takes it back. Returns how many were waiting.
        O(waiters)."""
        with self._cond:
            waiting = self._waiting
            if not waiting:
                return 0
            until = self._entered + waiting
        self._lock.release()
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._entered >= until, timeout_s)
        finally:
            self._lock.acquire()
        return waiting
