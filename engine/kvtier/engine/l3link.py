"""One engine's side of its L3 store: the pages it writes behind its host tier, and those it has announced.

The store (:class:`kvtier.engine.l3.storage.PageStore`, per worker or shared by many) keys pages by the hex of
their SGLang page digest and keeps them prefix-closed. An engine announces a page (``BlockStored`` on DISK or
EXTERNAL) only once its write is committed or, in a shared pool, once it first finds the page there, and keeps
its own announcements prefix-closed too; it withdraws them (``BlockRemoved``) when the store evicts or deletes
the page. :class:`kvtier.engine.cache.TieredCache` decides when a node is written; this module decides which of
its pages go, and what each write and eviction announces.

Invariant (asserted by :meth:`L3Link._check`): every announced page is in the store.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from kvtier.engine.config import CacheConfig
from kvtier.engine.dump import l3_runs
from kvtier.engine.events import EventLog
from kvtier.engine.hashing import iter_chain
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore
from kvtier.engine.pool import PageId
from kvtier.engine.radix import Node, RadixTree
from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.codec import medium_spelling
from kvtier.wire.protocol import PackedTokens, StorageTier

log = logging.getLogger(__name__)

#: Starts the host -> store copy of ``keys`` (their metas, from these host pages); the cache submits it.
WriteOp = Callable[[list[str], list[PageMeta], list[PageId]], None]


class L3Link:
    """What one engine writes to and announces from its store. Single-threaded, as its cache."""

    __slots__ = ("_write_op", "announced", "config", "events", "name", "pending", "store", "write_failures")

    def __init__(self, store: PageStore, name: str, config: CacheConfig, events: EventLog, write_op: WriteOp) -> None:
        self.store = store  # the L3 store (shared with other engines or not)
        self.name = name  # this engine's tag in the store
        self.config = config  # the cache's sizes and policies
        self.events = events  # the cache's unflushed events
        self._write_op = write_op  # starts a host -> store copy
        self.announced: dict[str, int] = {}  # L3 key -> event hash, pages this engine announced
        self.pending: set[str] = set()  # keys this engine is writing
        self.write_failures = 0  # copy batches to the store that failed (a full disk fails each: logged sparsely)
        store.attach(name, self._evicted)
        # Pages a directory store adopted on start (a restart): announced with the first flush.
        adopted = store.unannounced()
        for key in adopted:
            store.announce(key, name)
        self.announce([(k, store.meta(k)) for k in adopted])

    @property
    def tier(self) -> StorageTier:
        """The store's tier: DISK for a store of its own, EXTERNAL for a shared pool, unless it was told another.
        O(1)."""
        return self.store.tier

    def run(self, parent_digest: bytes, tokens: PackedTokens) -> list[str]:
        """Keys of the full pages of ``tokens`` (continuing the page whose digest is ``parent_digest``) that the
        store holds, in a row from the first. O(pages in the row)."""
        keys: list[str] = []
        for d in iter_chain(parent_digest, tokens, self.config.page_size):
            key = d.hex()
            if not self.store.lookup(key):
                break
            keys.append(key)
        return keys

    def announced_run(self, parent_digest: bytes, tokens: PackedTokens) -> int:
        """How many leading full pages of ``tokens`` this engine has announced (in a shared pool: anybody has).
        Reads nothing but the bookkeeping: what an index that got every event counts. O(pages in the run)."""
        run = 0
        shared = self.store.shared
        for d in iter_chain(parent_digest, tokens, self.config.page_size):
            key = d.hex()
            if not (self.store.is_announced(key) if shared else key in self.announced):
                break
            run += 1
        return run

    def writing_any(self, digests: Iterable[bytes]) -> bool:
        """Whether a write of any of these pages is in flight (their host copy is its source). O(pages)."""
        pending = self.pending
        return bool(pending) and any(d.hex() in pending for d in digests)

    def write(self, node: Node, tree: RadixTree) -> None:
        """Write-behind of a host-resident node of ``tree``: its pages not yet in the store, parents first.
        O(pages of the node and its unwritten ancestors, + depth)."""
        config, store = self.config, self.store
        if not config.l3_write_behind or node.host is None:
            return
        if config.swa_window_pages and not node.host_swa:
            # Without its window KV (tombstoned when backed up, or prefetched without it): L3 pages always
            # carry it, which is what lets the index count an L3 page as usable without window events for L3.
            return
        p = node.parent
        if p is not None and p is not tree.root and p.digests[-1].hex() not in self.announced:
            self.write(p, tree)
        keys: list[str] = []
        metas: list[PageMeta] = []
        src: list[PageId] = []
        s = tree.stride
        depth0 = sum(n.pages for n in tree.path_to_root(node)) - node.pages
        page_keys = [d.hex() for d in node.digests]
        # Each page's parent_key is the key object of the page before it, not an equal copy: a store holds
        # one key string per page.
        parent_keys = [node.parent_digest().hex() or None, *page_keys[:-1]]
        parent_hashes = [node.parent_hash(), *node.hashes[:-1]]
        for i, (key, parent_key, parent_hash) in enumerate(zip(page_keys, parent_keys, parent_hashes, strict=True)):
            if key in self.announced or key in self.pending:
                continue
            meta = PageMeta(node.hashes[i], parent_key, parent_hash, node.tokens, depth0 + i, i, s)
            if key in store:
                if store.announce(key, self.name):
                    self.announce([(key, meta)])
                continue
            if store.is_pending(key):
                continue  # another engine is writing it into the shared pool
            if parent_key is not None and parent_key not in store and not store.is_pending(parent_key):
                break  # the parent page is gone and cannot be rewritten from here: stop the run
            if depth0 + i >= store.capacity:
                break  # it and its ancestors outnumber what the store holds: there is no room for it
            if not store.begin_write(key, meta):
                break  # no room: every other page is pinned or being written (its children need it first)
            self.pending.add(key)
            keys.append(key)
            metas.append(meta)
            src.append(node.host[i])
        if keys:
            self._write_op(keys, metas, src)

    def written(self, keys: list[str], metas: list[PageMeta], error: str | None) -> None:
        """A write of ``keys`` completed (``error``: it failed): commit what landed and announce it. O(keys)."""
        store = self.store
        landed: list[tuple[str, PageMeta]] = []
        for key, meta in zip(keys, metas, strict=True):
            self.pending.discard(key)
            if error:
                store.abort(key)
                continue
            if store.commit(key, self.name):
                landed.append((key, meta))
        self.announce(landed)
        if error:
            self.write_failures += 1
            if worth_logging(self.write_failures):
                log.error("%s: L3 write failed: %s%s", self.name, error, suffix(self.write_failures, "write_failures"))

    def announce(self, pages: list[tuple[str, PageMeta]]) -> None:
        """BlockStored(DISK or EXTERNAL) for pages, one event per run of consecutive pages.

        Keeps this engine's announcements prefix-closed: a page whose parent it has not announced
        (in a shared pool another engine wrote the parent while this one skipped it) is preceded by
        its committed ancestors, announced now. A store never holds a page without its parent, and
        evicts leaves first, so the ancestors are there. O(pages + ancestors announced).
        """
        store = self.store
        closed: list[tuple[str, PageMeta]] = []
        seen: set[str] = set()
        for key, meta in pages:
            missing: list[tuple[str, PageMeta]] = []
            pk = meta.parent_key
            while pk is not None and pk not in self.announced and pk not in seen and pk in store:
                store.announce(pk, self.name)
                parent = store.meta(pk)
                missing.append((pk, parent))
                pk = parent.parent_key
            for k, m in [*reversed(missing), (key, meta)]:
                seen.add(k)
                closed.append((k, m))
        for key, meta in closed:
            self.announced[key] = meta.event_hash
        self.events.extend(l3_runs([m for _, m in closed], medium_spelling(self.tier), self.config.page_size))

    def _evicted(self, keys: list[str]) -> None:
        """The store's listener: these pages are gone (BlockRemoved for those this engine announced)."""
        self.events.removed([self.announced.pop(k) for k in keys if k in self.announced], self.tier)

    def announced_pages(self) -> list[PageMeta]:
        """The pages this engine announced, parents first (for a state dump). O(pages in the store)."""
        return [self.store.meta(k) for k in self.store.announced_by(self.name) if k in self.announced]

    def reset(self) -> None:
        """The cache dropped everything (its writes in flight aborted): this engine's pages leave the store (a
        shared pool keeps them, no longer announced by it). O(pages of this engine)."""
        self.pending.clear()
        if self.store.shared:
            self.store.withdraw(self.name)
        else:
            self.store.clear()
        self.announced.clear()

    def _check(self) -> None:
        """Asserts the store's invariants and this module's. O(pages)."""
        self.store._check()
        for k in self.announced:
            assert k in self.store, f"announced L3 page {k} is not in the store"
