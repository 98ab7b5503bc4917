"""L3 -> host prefetch: a prompt's pages found in the store come into host memory, and on to device.

The pages after a request's resident prefix that the store holds in a row (:meth:`Prefetcher.l3_run`) are read
into host pages under the prefix's last node, which stays locked until they land. On acknowledgement
(:meth:`Prefetcher.landed`) they become host-only nodes (``BlockStored`` CPU), pages the tree got meanwhile are
freed, and, unless the request already started its prefill, they are loaded back to device. Policies on waiting
for a prefetch (``wait_complete``, ``timeout``, ``best_effort``) are the scheduler's: see
:class:`kvtier.engine.config.PrefetchPolicy`.
"""

from __future__ import annotations

import logging
from itertools import pairwise

from kvtier.engine.admission import Admission
from kvtier.engine.config import CacheConfig
from kvtier.engine.copies import Copies, OpInfo
from kvtier.engine.datapath import CopyKind, DataPath
from kvtier.engine.events import EventLog
from kvtier.engine.eviction import Evictor
from kvtier.engine.l3.storage import PageStore
from kvtier.engine.l3link import L3Link
from kvtier.engine.pool import PageId, PagePool
from kvtier.engine.radix import Node, RadixTree
from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.protocol import PackedTokens, StorageTier

log = logging.getLogger(__name__)


class Prefetcher:
    """A cache's L3 -> host prefetches. One per tree, like :class:`kvtier.engine.copies.Copies`."""

    __slots__ = ("_config", "_copies", "_dp", "_events", "_evictor", "_host", "_l3", "_name", "_store", "_tree",
                 "read_failures")

    def __init__(self, config: CacheConfig, dp: DataPath, tree: RadixTree, host: PagePool, evictor: Evictor,
                 events: EventLog, copies: Copies, l3: L3Link, store: PageStore, name: str) -> None:
        self._config = config  # the cache's sizes and policies
        self._dp = dp  # where copies run
        self._tree = tree  # the cache's radix tree
        self._host = host  # the host pool (pages the tree already had are freed to it)
        self._evictor = evictor  # makes host room, and locks the prefix a prefetch hangs below
        self._events = events  # the cache's unflushed events
        self._copies = copies  # tracks the copies; hands their acknowledgements back to landed()
        self._l3 = l3  # the cache's L3 link: which pages the store holds
        self._store = store  # the L3 store
        self._name = name  # the engine's name, for the log
        self.read_failures = 0  # prefetches that failed (the store counts and logs each page; these sparsely)
        copies.on_prefetched = self.landed

    def l3_run(self, last: Node, tokens: PackedTokens, matched: int) -> list[str]:
        """Keys of the prompt's pages after the ``matched`` resident ones that the L3 store holds, in a row."""
        s = self._tree.stride
        return self._l3.run(last.digests[-1] if last.digests else b"", tokens[matched * s:(len(tokens) // s) * s])

    def prefetch(self, adm: Admission, last: Node, tokens: PackedTokens, matched: int, keys: list[str],
                 window: tuple[int, int]) -> None:
        """L3 -> host of the pages ``keys`` after the ``matched`` resident ones; window KV only for those in
        ``window`` (page range, SWA)."""
        s = self._tree.stride
        if len(keys) < max(1, self._config.prefetch_min_pages) or self._config.host_pages == 0:
            return
        pages = self._evictor.alloc_host(len(keys))
        if pages is None:
            return
        pinned = self._store.pin(keys)
        self._evictor.lock(last)  # the prefetched pages hang below `last`: keep it until they land
        lo, hi = (min(max(e - matched, 0), len(keys)) for e in window)
        op = self._dp.new_op(CopyKind.S2H, [], pages, keys, self._store, window_pages=hi - lo)
        self._copies.submit(op, OpInfo(op, admission=adm, parent=last,
                                       tokens=tokens[matched * s:(matched + len(keys)) * s], window=(lo, hi),
                                       pinned=pinned))
        adm.l3_pages = len(keys)
        adm.prefetch_op = op.op_id

    def landed(self, info: OpInfo) -> None:
        """A prefetch's acknowledgement: its pages join the tree on host, then load back for the request."""
        assert info.parent is not None and info.admission is not None
        self._store.unpin(info.pinned)
        adm, parent = info.admission, info.parent
        if adm.prefetch_op == info.op.op_id:
            adm.prefetch_op = None
        if info.op.error:
            self.read_failures += 1
            if worth_logging(self.read_failures):
                log.error("%s: L3 read failed: %s%s", self._name, info.op.error,
                          suffix(self.read_failures, "read_failures"))
            for key in info.op.bad_keys:  # never offered again: dropped, BlockRemoved by each announcer
                self._store.drop(key)
            self._host.release([PageId(p) for p in info.op.dst])
            self._evictor.unlock(parent)
            return
        new = self._insert_host_pages(parent, info.tokens, [PageId(p) for p in info.op.dst], info.window)
        self._evictor.unlock(parent)
        if new and not adm.started and not adm.released and self._config.load_back:
            # The new node may hang under host-only ancestors: load the whole chain, parents first,
            # so device residency stays prefix-closed.
            self._copies.load([n for n in self._tree.path_to_root(new[-1]) if n.device is None], adm)

    def _insert_host_pages(self, parent: Node, tokens: PackedTokens, pages: list[PageId],
                           window: tuple[int, int] = (0, 0)) -> list[Node]:
        """Prefetched pages below ``parent``: new host-only nodes (BlockStored CPU), those of the ``window``
        page range with their window KV (split at its edges); pages the tree already has are freed. Returns
        the new nodes, parents first."""
        tree = self._tree
        s = tree.stride
        node, pos, n_pages = parent, 0, len(tokens) // s
        for child in tree.descend(parent, tokens):  # pages the tree has already: their prefetched copies go
            self._host.release(pages[pos:pos + child.pages])
            pos += child.pages
            node = child
        if pos == n_pages:
            return []
        if node is not tree.root and node.host is None:
            self._host.release(pages[pos:])  # the parent has no host copy: keep host prefix-closed
            return []
        lo, hi = window
        edges = sorted({pos, n_pages, *(e for e in (lo, hi) if pos < e < n_pages)})
        new: list[Node] = []
        for a, b in pairwise(edges):
            node = tree.add_child(node, tokens[a * s:b * s])
            node.host = pages[a:b]
            self._events.stored(node, StorageTier.HOST)
            if self._config.swa_window_pages and lo <= a < hi:
                node.host_swa = node.load_swa = True
                self._events.window_stored(node, StorageTier.HOST)
            self._evictor.push_host(node)
            new.append(node)
        return new
