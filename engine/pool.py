"""Fixed-size page pools with a free list (device and host KV memory)."""

from __future__ import annotations

from typing import NewType

PageId = NewType("PageId", int)


class PoolExhausted(RuntimeError):
    """Asked for more pages than are free; the caller evicts and retries."""


class PagePool:
    """Hands out page ids ``0..capacity-1``.

    Invariant: every id is either free or allocated, never both. Allocation
    takes the lowest-numbered free pages last freed first (a stack), O(n).
    """

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{name} pool capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._free: list[PageId] = [PageId(i) for i in range(capacity - 1, -1, -1)]
        self._used: set[PageId] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[PageId]:
        """``n`` pages, or :class:`PoolExhausted` (nothing is taken then). O(n)."""
        if n > len(self._free):
            raise PoolExhausted(f"{self.name} pool: {n} pages wanted, {len(self._free)} free")
        if n <= 0:
            return []
        free = self._free
        pages = free[-n:]
        pages.reverse()  # the order n pops from the end would give
        del free[-n:]
        self._used.update(pages)
        return pages

    def release(self, pages: list[PageId]) -> None:
        """Returns pages to the pool. O(n), in C. Asserts that each was allocated, once."""
        used = self._used
        if not used.issuperset(pages):
            stray = [p for p in pages if p not in used]
            raise AssertionError(f"{self.name} pool: pages {stray} released but not allocated")
        before = len(used)
        used.difference_update(pages)
        if len(used) != before - len(pages):
            used.update(pages)  # every one was allocated: the pool is as it was
            twice = sorted({p for p in pages if pages.count(p) > 1})
            raise AssertionError(f"{self.name} pool: pages {twice} released twice at once")
        self._free.extend(pages)

    def reset(self) -> None:
        self._free = [PageId(i) for i in range(self.capacity - 1, -1, -1)]
        self._used.clear()

    def _check(self) -> None:
        assert len(self._free) + len(self._used) == self.capacity, f"{self.name} pool: pages lost"
        assert not self._used & set(self._free), f"{self.name} pool: page both free and used"
