"""Sliding-window attention (SWA) in the engine's cache: which pages' window KV a request needs, and where it
comes from.

A page's full-attention KV and its window KV are kept apart: the window KV of a page may be gone (tombstoned)
while its full-attention KV stays. A cached prefix is usable only up to a cut whose last ``w`` pages
(``swa_window_pages``) still have their window KV, so only those pages' window KV is loaded, prefetched or
recomputed (SGLang's TRAILING_PAGES). Functions of the path a request matched; the cache calls them.
"""

from __future__ import annotations

from kvtier.engine.eviction import Evictor
from kvtier.engine.pool import PageId, PagePool
from kvtier.engine.radix import Node, RadixTree
from kvtier.wire.overlap import window_cut


def plan_window(path: list[Node], l3_pages: int, w: int) -> tuple[int, int]:
    """The pages ``[c - w, c)`` whose window KV the request needs, ``c`` the end of its usable prefix over the
    device and host runs of ``path`` and ``l3_pages`` more from L3 (whose pages always carry window KV).
    O(pages)."""
    ok: list[bool] = []
    for n in path:
        ok.extend([n.window_read] * n.pages)
    ok.extend([True] * l3_pages)
    cut = window_cut(ok, len(ok), w)
    return max(0, cut - w), cut


def mark_window_loads(tree: RadixTree, host_run: list[Node], start: int, window: tuple[int, int]) -> list[Node]:
    """Splits the host run (pages from ``start``) at the window's edges and flags the nodes inside it whose host
    copy has window KV to bring it along. Returns the run's nodes after the splits. O(nodes)."""
    lo, hi = window
    out: list[Node] = []
    pos = start
    for n in host_run:
        for edge in (lo, hi):
            if pos < edge < pos + n.pages:
                front = tree.split(n, edge - pos)
                front.load_swa = lo <= pos < hi and front.host_swa
                out.append(front)
                pos += front.pages
        n.load_swa = lo <= pos < hi and n.host_swa
        out.append(n)
        pos += n.pages
    return out


def window_usable(path: list[Node], cached: int, w: int) -> int:
    """Longest reusable device prefix (pages) of the ``cached`` ones: with SWA (``w`` > 0), the window before the
    cut needs its window KV; tombstoned pages inside it are recomputed. O(pages)."""
    if not w:
        return cached
    present: list[bool] = []
    for n in path:
        if len(present) >= cached:
            break
        present.extend([n.swa is not None] * n.pages)
    return window_cut(present, cached, w)


def alloc_from_path(evictor: Evictor, pool: PagePool, path: list[Node], usable: int, n: int,
                    w: int) -> list[PageId] | None:
    """``n`` window-KV pages when the LRU has none to give: the request's own locked path may hold the pool (a
    long session caches a window at each turn's end). Like SGLang's SWA lock, which covers only the window before
    a request's cut, window KV elsewhere on the path that no other request holds is tombstoned, shallowest first.
    O(path)."""
    end = 0
    for node in path:
        if pool.free >= n:
            break
        start, end = end, end + node.pages
        if node.swa is None or node.lock_ref != 1 or node.host_pending is not None:
            continue  # tombstoned already, read by another request too, or being backed up
        if start < usable and end > usable - w:
            continue  # the window this request reads
        evictor.tombstone(node)
    return evictor.alloc_swa(n)
