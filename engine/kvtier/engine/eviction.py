"""Making room in an engine's page pools: least recently used nodes go first, leaves before their parents.

Device pages go from unlocked device leaves (a node with a host copy keeps it; under ``write_back`` one without
is backed up first, see :meth:`kvtier.engine.copies.Copies.write_back`); host pages from host-only leaves
whose L3 write is not in flight; window-KV pages (SWA) are tombstoned: the node keeps its full-attention KV, so
only a window-KV removal is published (nothing, as in SGLang, without window events). Each eviction queues its
removal events at once, ahead of any event about the pages' next use. A device eviction takes a whole leaf node, as
SGLang's radix cache does; under ``Eviction.PAGE`` only the pages the allocation still lacks, the leaf's last ones
(the node is split first), as vLLM's block pool frees a request's blocks last first and evicts them one by one.

The candidates sit in one lazy heap per pool, ordered by last access: an entry may be stale, checked when it is
popped (a node used since the entry was made goes back in at its last use: the order is the tree's true LRU order,
as SGLang's, which sorts its leaves by last access at each eviction), and when a heap runs dry the tree is rescanned
once, so a node that became evictable without being pushed is still found. Locks live here too: a node is never a
candidate while a request holds it, and becomes one again when its last lock goes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from kvtier.engine.config import CacheConfig, Eviction, WritePolicy
from kvtier.engine.events import EventLog
from kvtier.engine.l3link import L3Link
from kvtier.engine.pool import PageId, PagePool, PoolExhausted
from kvtier.engine.radix import Node, RadixTree
from kvtier.wire.protocol import StorageTier


class Evictor:
    """Allocates pages of a cache's pools, evicting what it must. One per tree: a reset starts a new one."""

    __slots__ = ("_config", "_dev_heap", "_device", "_events", "_host", "_host_heap", "_l3", "_swa", "_swa_heap",
                 "_tree", "_write_back")

    def __init__(self, config: CacheConfig, tree: RadixTree, device: PagePool, host: PagePool, swa: PagePool,
                 events: EventLog, l3: L3Link | None, write_back: Callable[[Node], None]) -> None:
        self._config = config  # the cache's sizes and policies
        self._tree = tree  # the cache's radix tree
        self._device, self._host, self._swa = device, host, swa  # the pools
        self._events = events  # the cache's unflushed events
        self._l3 = l3  # the cache's L3 link (a page being written to L3 keeps its host copy)
        self._write_back = write_back  # backs up a device leaf that has no host copy, then drops it
        self._dev_heap: list[tuple[int, int, Node]] = []  # (last access, node id, node), lazily
        self._host_heap: list[tuple[int, int, Node]] = []
        self._swa_heap: list[tuple[int, int, Node]] = []

    def push_dev(self, n: Node) -> None:
        """``n`` may be a device candidate now (unlocked, or a leaf at last). O(log heap)."""
        if n is not self._tree.root and n.device is not None:
            heapq.heappush(self._dev_heap, (n.last_access, n.node_id, n))

    def push_host(self, n: Node) -> None:
        """``n`` may be a host candidate now. O(log heap)."""
        if n is not self._tree.root and n.host is not None:
            heapq.heappush(self._host_heap, (n.last_access, n.node_id, n))

    def lock(self, node: Node) -> None:
        """A request holds ``node`` and its ancestors: none of them is evicted until :meth:`unlock`. O(depth)."""
        n: Node | None = node
        while n is not None and n is not self._tree.root:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: Node) -> None:
        """Undoes one :meth:`lock` of ``node``; a node whose last lock goes is a candidate again. O(depth)."""
        n: Node | None = node
        while n is not None and n is not self._tree.root:
            assert n.lock_ref > 0, f"unlocking node {n.node_id} that is not locked"
            n.lock_ref -= 1
            if n.lock_ref == 0:
                if n.device_leaf():  # (a node with a child on device is pushed when its last such child goes)
                    self.push_dev(n)
                self.push_host(n)
                self.push_swa(n)
            n = n.parent

    def _device_evictable(self, n: Node) -> bool:
        return (n.device is not None and n.lock_ref == 0 and n.host_pending is None and not n.evict_after_backup
                and n.device_leaf() and n.parent is not None)

    def _host_evictable(self, n: Node) -> bool:
        return (n.host is not None and n.device is None and n.loading is None and n.host_pending is None
                and n.lock_ref == 0 and not n.children and n.parent is not None
                and not (self._l3 is not None and self._l3.writing_any(n.digests)))

    def alloc_device(self, n: int) -> list[PageId] | None:
        """``n`` device pages, evicting LRU device leaves (under ``Eviction.PAGE`` only the last pages of the leaf
        that it takes to make the room: :meth:`_tail`); None if that cannot free enough now."""
        evict: Callable[[Node], None] = self._evict_device
        if self._config.eviction == Eviction.PAGE:
            pool = self._device

            def evict_tail(node: Node) -> None:
                self._evict_device(self._tail(node, n - pool.free))
            evict = evict_tail
        return self._alloc(self._device, self._dev_heap, self.push_dev, self._device_evictable, evict, n)

    def _tail(self, node: Node, need: int) -> Node:
        """The leaf ``node`` cut so that its last ``need`` pages are a leaf of their own, which it returns (``node``
        itself where it has no more pages than that, or its pages are being copied or carry window KV). The front
        keeps the rest, on every tier it had them, and stays cached: vLLM's block pool frees a request's blocks last
        first, so its eviction takes a prefix's tail and keeps its head. O(pages)."""
        if need >= node.pages or node.host_pending is not None or node.loading is not None or node.swa is not None:
            return node
        self._tree.split(node, node.pages - need)
        return node

    def _alloc(self, pool: PagePool, heap: list[tuple[int, int, Node]], push: Callable[[Node], None],
               evictable: Callable[[Node], bool], evict: Callable[[Node], None], n: int) -> list[PageId] | None:
        """``n`` pages of ``pool``, evicting the least recently used ``evictable`` nodes from ``heap``.

        The heap is lazy: entries may be stale (checked when popped); when it runs dry the tree is
        rescanned once, so a node that became evictable without being pushed is still found.
        Returns None, having evicted nothing needlessly, if ``n`` exceeds the pool.
        """
        if n > pool.capacity:
            return None  # can never fit: evicting would only destroy the cache
        rescanned = False
        while pool.free < n:
            if not heap:
                if rescanned:
                    return None
                rescanned = True
                for node in self._tree.nodes():
                    push(node)
                continue
            key, _, node = heapq.heappop(heap)
            if node.parent is None or not evictable(node):
                continue  # it left the tree, or is no candidate now (it is pushed again when it becomes one)
            if key != node.last_access:
                push(node)  # used since this entry was made: it goes back in at its last use, not evicted early
                continue
            evict(node)
        try:
            return pool.alloc(n)
        except PoolExhausted:
            return None

    def _evict_device(self, n: Node) -> None:
        """A device candidate goes: at once if it has a host copy or the policy backs up nothing on eviction,
        else written back first."""
        if n.host is not None:
            self.drop_device(n)
        elif self._config.write_policy is WritePolicy.WRITE_BACK and self._config.host_pages:
            self._write_back(n)
        else:
            self.drop_device(n)

    def drop_device(self, n: Node) -> None:
        """Frees ``n``'s device pages (and window KV) with their BlockRemoved; a node left with no copy leaves
        the tree. Its parent may be a candidate now. O(pages)."""
        assert n.device is not None
        self._device.release(n.device)
        n.device = None
        if n.swa is not None:
            self._events.window_removed(n, StorageTier.DEVICE)
            self._swa.release(n.swa)
            n.swa = None
        self._events.removed(n.hashes, StorageTier.DEVICE)
        parent = n.parent
        if n.host is None and n.host_pending is None:
            assert not n.children, f"node {n.node_id} dropped with children"
            self._tree.remove(n)
            n.parent = None
        if parent is not None:
            self.push_dev(parent)
            self.push_host(parent)

    def push_swa(self, n: Node) -> None:
        """``n``'s window KV may be a candidate now. O(log heap)."""
        if n.swa is not None and n is not self._tree.root:
            heapq.heappush(self._swa_heap, (n.last_access, n.node_id, n))

    def alloc_swa(self, n: int) -> list[PageId] | None:
        """``n`` window-KV pages, tombstoning LRU unlocked nodes (which publishes nothing: their
        full-attention KV stays on device). [] when SWA is off; None if no room now."""
        if not self._config.swa_window_pages or n == 0:
            return []
        # A node being backed up keeps its window KV: the copy is reading it.
        return self._alloc(self._swa, self._swa_heap, self.push_swa,
                           lambda node: node.swa is not None and node.lock_ref == 0 and node.host_pending is None,
                           self.tombstone, n)

    def tombstone(self, node: Node) -> None:
        """Frees ``node``'s window KV; its full-attention KV stays (a window-KV removal if announced). O(pages)."""
        assert node.swa is not None
        self._events.window_removed(node, StorageTier.DEVICE)
        self._swa.release(node.swa)
        node.swa = None

    def alloc_host(self, n: int, protect: Node | None = None) -> list[PageId] | None:
        """``n`` host pages, evicting LRU host-only leaves other than ``protect``; None if that cannot free
        enough now (or there is no host tier)."""
        if self._config.host_pages == 0:
            return None
        return self._alloc(self._host, self._host_heap, self.push_host,
                           lambda node: node is not protect and self._host_evictable(node), self._evict_host, n)

    def _evict_host(self, n: Node) -> None:
        """A host-only leaf goes: its pages are freed with their BlockRemoved and it leaves the tree."""
        assert n.host is not None
        if n.host_swa:
            self._events.window_removed(n, StorageTier.HOST)
            n.host_swa = False
        self._host.release(n.host)
        n.host = None
        self._events.removed(n.hashes, StorageTier.HOST)
        parent = n.parent
        self._tree.remove(n)
        n.parent = None
        if parent is not None:
            self.push_host(parent)
            self.push_dev(parent)

    def evict_device(self, pages: int) -> int:
        """Frees at least ``pages`` device pages if possible; returns how many are free."""
        got = self.alloc_device(pages)
        if got is not None:
            self._device.release(got)
        return self._device.free

    def evict_host(self, pages: int) -> int:
        """Frees at least ``pages`` host pages if possible; returns how many are free."""
        got = self.alloc_host(pages)
        if got is not None:
            self._host.release(got)
        return self._host.free
