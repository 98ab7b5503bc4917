"""A process's helper threads: one worker thread per purpose, started on first use.

A forked child (a sweep's process pool) has none of its parent's threads, and a task handed to the parent's
executor there would never run: the child starts its own thread on its first submission.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["HelperThread"]

T = TypeVar("T")


class HelperThread:
    """One worker thread named ``name``, started by the first :meth:`submit` of each process."""

    __slots__ = ("_pid", "_pool", "name")

    def __init__(self, name: str) -> None:
        self.name = name  # the thread's name prefix
        self._pool: ThreadPoolExecutor | None = None  # the thread, once started
        self._pid = 0  # the process that started it

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Runs ``fn(*args)`` on the thread, after what was submitted before. O(1)."""
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name)
            self._pid = os.getpid()
        return self._pool.submit(fn, *args)
