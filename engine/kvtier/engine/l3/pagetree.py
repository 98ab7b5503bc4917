"""An L3 store's pages as a tree: committed pages with their children, writes in flight, leaves in LRU order.

This is what makes a store prefix-closed (see :mod:`kvtier.engine.l3.storage`): a page is reserved only under a
committed or reserved parent, committed only under a committed one, and only a leaf (no committed or pending
child) is ever evicted, so no committed page outlives its parent. Which leaf goes, and who is told, is the
store's; the tree keeps the counts that say which pages are leaves.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvtier.wire.protocol import PackedTokens

__all__ = ["EngineTag", "PageEntry", "PageMeta", "PageTree"]

#: An engine's identity inside a shared store.
EngineTag = str


@dataclass(slots=True)
class PageMeta:
    """What an engine needs to announce a stored page."""

    event_hash: int  # the hash published in events
    parent_key: str | None  # L3 key of the parent page; None under the root
    parent_hash: int | None  # event hash of the parent page
    # Packed token ids (kvtier.wire.pack_tokens) holding the page's: the page's own, or its node's whole run,
    # which the node's pages share rather than each keeping a copy (most of an L3 page's memory otherwise).
    buf: PackedTokens
    depth: int  # pages from the root (for parent-first dumps)
    page: int = 0  # the page's index in buf, in pages of `stride` bytes
    stride: int = 0  # bytes per page in buf; 0: buf is the page itself

    @property
    def tokens(self) -> PackedTokens:
        """The page's token ids, packed. O(page)."""
        s = self.stride
        return self.buf[self.page * s:(self.page + 1) * s] if s else self.buf


@dataclass(slots=True)
class PageEntry(PageMeta):
    """A committed page: its metadata (the fields of the engine's :class:`PageMeta`, copied into one object per
    page, not one wrapping the other) and the store's bookkeeping."""

    children: int = 0  # committed or pending children
    pins: int = 0  # readers in flight
    # Engines that published it: one interned set per distinct value (the store's), not a set per page.
    announcers: frozenset[EngineTag] = frozenset()


class PageTree:
    """Committed pages (:attr:`entries`) and reservations (:attr:`pending`) of one store, with the children
    each has and the leaves in LRU order.

    Invariants (asserted by :meth:`_check`): a committed page's parent is committed; a committed page's
    ``children`` counts its committed and pending children; :attr:`leaves` holds exactly the committed pages
    without children; :attr:`pending_children` counts, per uncommitted key, the reservations under it.
    """

    __slots__ = ("entries", "leaves", "pending", "pending_children")

    def __init__(self) -> None:
        # Committed pages, in the order they were committed. Eviction order lives in ``leaves`` alone (only a
        # leaf is ever evicted), so this is a plain dict: an OrderedDict costs some 50 bytes more per page.
        self.entries: dict[str, PageEntry] = {}
        self.leaves: OrderedDict[str, None] = OrderedDict()  # committed pages without children, LRU first
        self.pending: dict[str, PageMeta] = {}  # key being written -> its meta
        # Uncommitted key -> children reserved under it and still pending. It outlives an aborted write of
        # the key (another engine of a shared pool may write it again, and those children still count).
        self.pending_children: dict[str, int] = {}

    def reserve(self, key: str, meta: PageMeta) -> None:
        """A write of ``key`` begins. Asserts it is new and its parent committed or reserved. O(1)."""
        assert key not in self.entries and key not in self.pending, f"page {key} written twice"
        parent_key = meta.parent_key
        if parent_key is not None:
            assert parent_key in self.entries or parent_key in self.pending, (
                f"page {key} written before its parent {parent_key}")
            self.add_child(parent_key)
        self.pending[key] = meta

    def unreserve(self, key: str) -> PageMeta:
        """Ends the reservation of ``key`` and returns its meta. Its parent still counts it: the caller
        commits it (:meth:`insert`) or drops it from its parent (:meth:`drop_child`). O(1)."""
        return self.pending.pop(key)

    def insert(self, key: str, entry: PageEntry) -> None:
        """Commits ``entry`` under ``key``, with the children already reserved under it. Its parent must be
        committed, and count it already. O(1)."""
        entry.children = self.pending_children.pop(key, 0)
        self.entries[key] = entry
        if entry.children == 0:
            self.leaves[key] = None

    def remove(self, key: str) -> PageEntry:
        """Uncommits ``key`` (a leaf, unless its subtree goes too: see :meth:`descendants`); the parent loses a
        child. O(1)."""
        e = self.entries.pop(key)
        self.leaves.pop(key, None)
        if e.children:  # children still being written: they count under the uncommitted key
            self.pending_children[key] = e.children
        if e.parent_key is not None:
            self.drop_child(e.parent_key)
        return e

    def add_child(self, parent_key: str) -> None:
        """``parent_key`` gets a child (committed there, or reserved). O(1)."""
        if parent_key in self.entries:
            e = self.entries[parent_key]
            e.children += 1
            self.leaves.pop(parent_key, None)
        else:
            self.pending_children[parent_key] = self.pending_children.get(parent_key, 0) + 1

    def drop_child(self, parent_key: str) -> None:
        """``parent_key`` loses a child; a committed parent left with none becomes the newest leaf. O(1)."""
        e = self.entries.get(parent_key)
        if e is not None:
            e.children -= 1
            if e.children == 0:
                self.leaves[parent_key] = None
        elif parent_key in self.pending_children:
            self.pending_children[parent_key] -= 1
            if self.pending_children[parent_key] == 0:
                del self.pending_children[parent_key]

    def touch(self, key: str) -> None:
        """Marks a page used now (evicted last among the leaves). O(1)."""
        if key in self.leaves:
            self.leaves.move_to_end(key)

    def clear_committed(self) -> None:
        """Drops every committed page (a private store's engine was reset); reservations stay. O(pages)."""
        self.entries.clear()
        self.leaves.clear()

    def subtree(self, key: str) -> list[str]:
        """``key`` and every committed page under it, parents before children. O(pages) (a scan)."""
        kids: dict[str, list[str]] = {}
        for k, e in self.entries.items():
            if e.parent_key is not None:
                kids.setdefault(e.parent_key, []).append(k)
        order: list[str] = []
        todo = [key]
        while todo:
            k = todo.pop()
            order.append(k)
            todo.extend(kids.get(k, []))
        return order

    def by_depth(self, keys: list[str]) -> list[str]:
        """``keys`` (committed) parents first. O(n log n)."""
        return sorted(keys, key=lambda k: self.entries[k].depth)

    def _check(self) -> None:
        """Asserts the invariants in the class docstring. O(pages^2)."""
        for k, e in self.entries.items():
            p = e.parent_key
            assert p is None or p in self.entries, f"page {k} present without its parent {p}"
            n = sum(1 for c in self.entries.values() if c.parent_key == k)
            n += sum(1 for m in self.pending.values() if m.parent_key == k)
            assert e.children == n, f"page {k}: children {e.children} but {n} found"
            assert (k in self.leaves) == (e.children == 0), f"page {k}: leaf list out of sync"
        assert all(k in self.entries for k in self.leaves), "a leaf that is not committed"
        pending_kids: dict[str, int] = {}
        for m in self.pending.values():
            if m.parent_key is not None and m.parent_key not in self.entries:
                pending_kids[m.parent_key] = pending_kids.get(m.parent_key, 0) + 1
        assert pending_kids == self.pending_children, (
            f"children pending under uncommitted pages out of sync: {pending_kids} != {self.pending_children}")
