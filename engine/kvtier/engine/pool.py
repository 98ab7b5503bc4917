"""Fixed-size page pools with a free list (device and host KV memory)."""

from __future__ import annotations

from typing import NewType, NoReturn, cast

PageId = NewType("PageId", int)


class PoolExhausted(RuntimeError):
    """Asked for more pages than are free; the caller evicts and retries."""


class PagePool:
    """Hands out page ids ``0..capacity-1``.

    Invariant: every id is either free or allocated, never both. Allocation
    takes the lowest-numbered free pages last freed first (a stack), O(n).
    Which pages are allocated is a byte per page, not a set of them: a host pool holds hundreds of
    thousands of pages, and a set of their ids cost some 30 bytes each.
    """

    __slots__ = ("_free", "_n_used", "_used", "capacity", "name")

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{name} pool capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._free: list[PageId] = self._all_free()  # a stack: the top goes first
        self._used = bytearray(capacity)  # 1 where the page is allocated
        self._n_used = 0  # pages allocated

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self._n_used

    def alloc(self, n: int) -> list[PageId]:
        """``n`` pages, or :class:`PoolExhausted` (nothing is taken then). O(n), in C."""
        if n > len(self._free):
            raise PoolExhausted(f"{self.name} pool: {n} pages wanted, {len(self._free)} free")
        if n <= 0:
            return []
        free = self._free
        pages = free[-n:]
        pages.reverse()  # the order n pops from the end would give
        del free[-n:]
        used = self._used
        for p in pages:  # (a plain loop: the interpreter's bytearray store beats a mapped __setitem__ 3x)
            used[p] = 1
        self._n_used += n
        return pages

    def release(self, pages: list[PageId]) -> None:
        """Returns pages to the pool. O(n). Asserts that each was allocated, once (the pool is then as it was)."""
        if not pages:
            return
        used = self._used
        freed = 0  # one pass checks and frees: a page given twice is unallocated the second time
        try:
            for p in pages:  # (a plain loop: the interpreter's bytearray stores beat a mapped __setitem__ 3x)
                if not used[p]:
                    break
                used[p] = 0
                freed += 1
        except (IndexError, TypeError):  # past the end, or not an id: nothing after it was freed
            pass
        if freed < len(pages) or min(pages) < 0:  # (a negative id indexes from the end)
            self._refuse(pages, freed)
        self._n_used -= freed
        self._free.extend(pages)

    def _refuse(self, pages: list[PageId], freed: int) -> NoReturn:
        """Undoes the first ``freed`` pages of a bad :meth:`release` of ``pages`` and raises what was wrong."""
        for p in pages[:freed]:
            self._used[p] = 1
        if len(set(pages)) != len(pages):
            twice = sorted({p for p in pages if pages.count(p) > 1})
            raise AssertionError(f"{self.name} pool: pages {twice} released twice at once")
        stray = [p for p in pages if not self._allocated(p)]
        raise AssertionError(f"{self.name} pool: pages {stray} released but not allocated")

    def _allocated(self, page: object) -> bool:
        try:
            return 0 <= page < self.capacity and bool(self._used[page])  # type: ignore[operator,call-overload]
        except TypeError:  # not an id at all
            return False

    def reset(self) -> None:
        self._free = self._all_free()
        self._used = bytearray(self.capacity)
        self._n_used = 0

    def _all_free(self) -> list[PageId]:
        """Every id, the lowest on top. O(capacity), in C: a ``PageId`` call per id cost a million calls for the
        host pools of a 16-worker simulation (``NewType`` is the identity at run time)."""
        return cast(list[PageId], list(range(self.capacity - 1, -1, -1)))

    def _check(self) -> None:
        assert len(self._free) + self._n_used == self.capacity, f"{self.name} pool: pages lost"
        assert self._used.count(1) == self._n_used, f"{self.name} pool: allocated pages miscounted"
        assert not any(map(self._used.__getitem__, self._free)), f"{self.name} pool: page both free and used"
