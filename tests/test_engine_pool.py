"""The page pool: a stack of free ids, and releases checked in bulk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.pool import PageId, PagePool, PoolExhausted


class StackModel:
    """The pool as first written, one page at a time: the order the engine's results depend on."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, -1, -1))

    def alloc(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.randoms(use_true_random=False)), max_size=40))
def test_alloc_and_release_hand_out_the_ids_one_page_at_a_time_would(ops: list[tuple[bool, int, object]]) -> None:
    pool, model, held = PagePool("device", 24), StackModel(24), []
    for take, n, rnd in ops:
        if take:
            if n > pool.free:
                with pytest.raises(PoolExhausted):
                    pool.alloc(n)
                continue
            got = pool.alloc(n)
            assert got == model.alloc(n)
            held.append(got)
        elif held:
            pages = held.pop(n % len(held))
            rnd.shuffle(pages)  # type: ignore[attr-defined]
            pool.release(pages)
            model.release(pages)
        pool._check()
        assert pool.free == len(model.free)


def test_a_bad_release_says_which_pages_and_changes_nothing() -> None:
    pool = PagePool("host", 8)
    a = pool.alloc(3)
    with pytest.raises(AssertionError, match=r"host pool: pages \[7\] released but not allocated"):
        pool.release([a[0], PageId(7)])
    with pytest.raises(AssertionError, match=rf"pages \[{a[1]}\] released twice"):
        pool.release([a[1], a[2], a[1]])
    pool._check()
    assert (pool.free, pool.used) == (5, 3)
    pool.release(a)
    assert pool.free == 8 and pool.alloc(0) == []


def test_ids_outside_the_pool_are_never_taken_as_allocated() -> None:
    """Which pages are allocated is a byte per page: a negative id must not read another page's byte from the end,
    nor an id past the end fail with anything but the pool's own message."""
    pool = PagePool("device", 4)
    pages = pool.alloc(4)
    for bad in (PageId(-1), PageId(4)):
        with pytest.raises(AssertionError, match=rf"device pool: pages \[{bad}\] released but not allocated"):
            pool.release([pages[0], bad])
    pool._check()
    with pytest.raises(AssertionError, match=r"device pool: pages \['x'\] released but not allocated"):
        pool.release([pages[0], "x"])  # type: ignore[list-item]
    pool._check()
    pool.release(pages)
    assert (pool.free, pool.used) == (4, 0)
