"""The tiered KV cache (HiCache-like): device and host page pools over a radix tree,
optional L3 store, asynchronous copies, and KV events emitted per SPEC section 1.

Events follow acknowledgements: a page is announced on a tier only once the copy
that put it there has completed, and withdrawn as soon as the cache stops
counting on it. :meth:`TieredCache.residency` is the ground truth the indexer's
view must equal once every event has been delivered.

This module admits requests and runs their prefills. Pieces kept apart: sizes and policies
(:mod:`kvtier.engine.config`), a request's hold on the cache (:mod:`kvtier.engine.admission`), the events not yet
flushed (:mod:`kvtier.engine.events`), copies in flight with their acknowledgements, the write policies' backups and
load-back (:mod:`kvtier.engine.copies`), L3 -> host prefetch (:mod:`kvtier.engine.prefetch`), this engine's side of
the L3 store (:mod:`kvtier.engine.l3link`), making room in the pools and the locks that prevent it
(:mod:`kvtier.engine.eviction`), sliding-window attention's window KV (:mod:`kvtier.engine.window`), and read-only
views of the whole (:mod:`kvtier.engine.views`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.engine import views
from kvtier.engine.admission import Admission, PrefillPlan
from kvtier.engine.config import CacheConfig, PrefetchPolicy, WritePolicy
from kvtier.engine.copies import Copies
from kvtier.engine.datapath import DataPath
from kvtier.engine.dump import Snapshot, dump_batches
from kvtier.engine.events import EventLog
from kvtier.engine.eviction import Evictor
from kvtier.engine.hashing import DIGEST_BYTES
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore
from kvtier.engine.l3link import L3Link
from kvtier.engine.pool import PageId, PagePool
from kvtier.engine.prefetch import Prefetcher
from kvtier.engine.radix import Node, RadixTree
from kvtier.engine.window import alloc_from_path, mark_window_loads, plan_window, window_usable
from kvtier.wire.overlap import TierOverlap
from kvtier.wire.protocol import (
    TOKEN_BYTES,
    EventBatch,
    PackedTokens,
    StorageTier,
    pack_tokens,
)

__all__ = ["Admission", "CacheConfig", "PrefetchPolicy", "PrefillPlan", "TieredCache", "WritePolicy"]


class TieredCache:
    """See the module docstring. Single-threaded: callers serialise access."""

    def __init__(self, config: CacheConfig, datapath: DataPath, store: PageStore | None = None,
                 name: str = "engine") -> None:
        self.config = config
        self.name = name
        self.dp = datapath
        self.device = PagePool("device", config.device_pages)
        self.host = PagePool("host", config.host_pages)
        self.swa = PagePool("swa", config.window_pool_pages)
        self.store = store
        self.events = EventLog(config.page_size, config.swa_window_pages, config.swa_events)  # not yet flushed
        self._epoch = 0  # reset() count
        # This engine's side of the store (kvtier.engine.l3link); None without one. It outlives resets.
        self.l3 = L3Link(store, name, config, self.events, self._write_l3) if store is not None else None
        self._new_tree()

    def _new_tree(self) -> None:
        """An empty tree, with what lives as long as it does: its evictor (which makes room in the pools), its
        copies in flight and its prefetcher. At construction and on every reset."""
        self.tree = RadixTree(self.config.page_size)
        self.evictor = Evictor(self.config, self.tree, self.device, self.host, self.swa, self.events, self.l3,
                               self._write_back)
        self.copies = Copies(self.config, self.dp, self.tree, self.evictor, self.events, self.l3, self.store)
        self.tree.on_split = self.copies.on_split
        self.prefetcher = (Prefetcher(self.config, self.dp, self.tree, self.host, self.evictor, self.events,
                                      self.copies, self.l3, self.store, self.name)
                           if self.l3 is not None and self.store is not None else None)

    def _write_back(self, node: Node) -> None:
        """The evictor's write-back, by the copies of the tree now (a reset replaces them)."""
        self.copies.write_back(node)

    def _write_l3(self, keys: list[str], metas: list[PageMeta], src: list[PageId]) -> None:
        """The L3 link's host -> store copies, by the copies of the tree now."""
        self.copies.write_l3(keys, metas, src)

    # --- events --------------------------------------------------------------------------

    def flush_events(self, ts: float = 0.0, dp_rank: int | None = None) -> EventBatch | None:
        """The events produced since the last flush, as one batch (None if there are none)."""
        return self.events.flush(ts, dp_rank)

    @property
    def has_events(self) -> bool:
        return bool(self.events)

    # --- admission -----------------------------------------------------------------------

    def admit(self, request_id: str, tokens: Sequence[int] | PackedTokens, digests: bytes = b"") -> Admission:
        """Matches the prompt (token ids, or packed: :func:`~kvtier.wire.pack_tokens`), locks its prefix,
        starts load-back and L3 prefetch. ``digests``: the page digests of the prompt's full pages, joined, if the
        caller made them ahead (nodes made for the prompt take theirs from them). O(prompt)."""
        tokens = pack_tokens(tokens)
        path = self.tree.match(tokens)
        for n in path:
            n.hits += 1
        last = path[-1] if path else self.tree.root
        self.evictor.lock(last)
        dev = 0
        while dev < len(path) and path[dev].device is not None:
            dev += 1
        host_run = []
        for n in path[dev:]:
            if n.host is None:
                break
            host_run.append(n)
        adm = Admission(request_id, tokens, last, sum(n.pages for n in path[:dev]),
                        sum(n.pages for n in host_run), 0, epoch=self._epoch, digests=digests)
        self.copies.backup_path(path)
        resident = sum(n.pages for n in path)
        l3_keys = (self.prefetcher.l3_run(last, tokens, resident)
                   if self.prefetcher is not None and len(path) == len(host_run) + dev else [])
        window = (0, 0)
        if self.config.swa_window_pages:
            window = plan_window(path[:dev + len(host_run)], len(l3_keys), self.config.swa_window_pages)
            host_run = mark_window_loads(self.tree, host_run, sum(n.pages for n in path[:dev]), window)
        if host_run and self.config.load_back:
            self.copies.load(host_run, adm)
        if l3_keys:
            assert self.prefetcher is not None
            self.prefetcher.prefetch(adm, last, tokens, resident, l3_keys, window)
        return adm

    def waiting_for(self, adm: Admission) -> set[int]:
        """Op ids the request still waits for (load-backs; the prefetch per policy is the caller's)."""
        return self.copies.in_flight(adm.waits)

    def ready(self, adm: Admission, admitted_at: float, now: float) -> bool:
        """Whether ``adm``, admitted at ``admitted_at``, may begin its prefill at ``now`` (seconds of the caller's
        clock): its load-backs have landed, and its L3 prefetch per ``prefetch_policy``. A prefill begun before a
        load-back lands recomputes the loading prefix and leaves the pages past it uncached (:meth:`finish_prefill`),
        so every scheduler asks this first. O(1)."""
        if self.waiting_for(adm):
            return False
        if adm.prefetch_op is None:
            return True
        policy = self.config.prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True
        if policy is PrefetchPolicy.TIMEOUT:
            return now >= admitted_at + self.config.prefetch_timeout_s
        return False

    def begin_prefill(self, adm: Admission, output_tokens: int = 0, *, last_resort: bool = False) -> PrefillPlan | None:
        """Reserves device pages to compute the rest of the prompt and ``output_tokens``.

        Returns None (nothing reserved) if the device cannot make room now. ``last_resort``: the caller knows nothing
        else will free room (no request runs, no copy is in flight); with SWA, the window KV of the request's own
        path may then go too, the window it would read included (it is recomputed), where the window pool cannot
        hold that window and the new one beside it: else such a request would wait for ever. Once per admission
        (``ValueError`` for a second: the first's pages would be held by nothing, lost to the cache for good).
        """
        self._check_live(adm)
        if adm.started:
            raise ValueError(f"admission {adm.request_id!r} began its prefill already")
        ps = self.config.page_size
        path = self.tree.match(adm.tokens)
        last = path[-1] if path else self.tree.root
        if last is not adm.last:
            self.evictor.lock(last)
            self.evictor.unlock(adm.last)
            adm.last = last
        cached = 0
        for n in path:
            if n.device is None:
                break
            cached += n.pages
        n_tokens = len(adm.tokens) // TOKEN_BYTES
        full = n_tokens // ps
        tail = -(-(n_tokens - full * ps + output_tokens) // ps)
        need = (full - cached) + tail
        usable = window_usable(path, cached, self.config.swa_window_pages)
        # A running request keeps window KV for its last window only (what it attends to; SGLang frees the
        # rest as the prefill moves on), so that is all it takes from the pool, and all it leaves cached.
        swa_need = min(full - usable, self.config.swa_window_pages)
        pages = self.evictor.alloc_device(need)
        if pages is None:
            return None
        w = self.config.swa_window_pages
        swa = self.evictor.alloc_swa(swa_need)
        if swa is None:
            swa = alloc_from_path(self.evictor, self.swa, path, usable, swa_need, w)
        if swa is None and last_resort:
            # Its whole path's window KV may go (no window is kept), until a window's room is free; the pages
            # taken are given back, as the request's need is known only once its usable prefix is.
            self.swa.release(alloc_from_path(self.evictor, self.swa, path, 0, w, w) or [])
            usable = window_usable(path, cached, w)
            swa_need = min(full - usable, w)
            swa = self.evictor.alloc_swa(swa_need)
        if swa is None:
            self.device.release(pages)
            return None
        adm.compute, adm.private = pages[:full - cached], pages[full - cached:]
        adm.swa = swa
        adm.started = True
        return PrefillPlan(usable * ps, n_tokens - usable * ps)

    def finish_prefill(self, adm: Admission, ready: Any = None) -> None:
        """The prompt's KV is computed: its new full pages join the tree (BlockStored GPU).

        ``ready``: where compute ran on a stream other than the current one, a CUDA event recorded there after it
        wrote the pages; the pages' backups (and any later copy into them) wait for it
        (:meth:`~kvtier.engine.datapath.DataPath.written`).
        """
        self._check_live(adm)
        if ready is not None:
            self.dp.written(adm.compute, ready)
        s = self.tree.stride
        full = len(adm.tokens) // s
        path = self.tree.match(adm.tokens)
        compute = list(adm.compute)
        adm.compute = []
        window_from = full - len(adm.swa)  # pages from here on get the request's window KV
        done = 0
        for n in path:
            if n.device is None and n.loading is not None:
                # A load of this node is still landing: the node gets its device pages from it.
                # What this request computed past it stays uncached (the tree cannot hang it here).
                self.device.release(compute)
                return
            if n.device is None:  # host-only: recomputed into it
                if len(compute) < n.pages:  # it joined the path after begin_prefill reserved pages
                    self.device.release(compute)
                    return
                n.device, compute = compute[:n.pages], compute[n.pages:]
                self.events.stored(n, StorageTier.DEVICE)
                self.evictor.push_dev(n)
            if n.swa is None and done + n.pages > window_from:
                if done < window_from:
                    done += self.tree.split(n, window_from - done).pages  # the front stays tombstoned
                if len(adm.swa) >= n.pages:
                    n.swa, adm.swa = adm.swa[:n.pages], adm.swa[n.pages:]  # the window KV is recomputed
                    self.events.window_stored(n, StorageTier.DEVICE)
                    self.evictor.push_swa(n)
            done += n.pages
        parent = path[-1] if path else self.tree.root
        new_pages = full - done
        if new_pages > 0 and len(compute) >= new_pages:
            if done < window_from < full and self.config.swa_window_pages:
                # Computed pages before the request's last window are cached tombstoned.
                front = self.tree.add_child(parent, adm.tokens[done * s:window_from * s],
                                            adm.digests[done * DIGEST_BYTES:window_from * DIGEST_BYTES])
                front.device, compute = compute[:front.pages], compute[front.pages:]
                self.events.stored(front, StorageTier.DEVICE)
                self.evictor.push_dev(front)
                parent, done, new_pages = front, window_from, full - window_from
            node = self.tree.add_child(parent, adm.tokens[done * s:full * s],
                                       adm.digests[done * DIGEST_BYTES:full * DIGEST_BYTES])
            node.device, compute = compute[:new_pages], compute[new_pages:]
            self.events.stored(node, StorageTier.DEVICE)
            if self.config.swa_window_pages and len(adm.swa) >= new_pages:
                node.swa, adm.swa = adm.swa[:new_pages], adm.swa[new_pages:]
                self.events.window_stored(node, StorageTier.DEVICE)
                self.evictor.push_swa(node)
            self.evictor.lock(node)
            self.evictor.unlock(adm.last)
            adm.last = node
            self.evictor.push_dev(node)
            self.evictor.push_dev(parent)
            if self.config.write_policy is WritePolicy.WRITE_THROUGH:
                self.copies.backup(node)
        if compute:
            self.device.release(compute)  # computed twice concurrently: keep the tree's copy
        self.swa.release(adm.swa)
        adm.swa = []
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self.copies.backup_path(path)

    def _check_live(self, adm: Admission) -> None:
        if adm.released or adm.epoch != self._epoch:
            raise ValueError(f"admission {adm.request_id!r} was released or voided by reset()")

    def release(self, adm: Admission) -> None:
        """The request finished: unlock its prefix, free its private pages. Idempotent."""
        if adm.released:
            return
        adm.released = True
        if adm.epoch != self._epoch:
            return  # admitted before a reset, which already freed its pages and locks
        self.device.release(adm.private + adm.compute)
        self.swa.release(adm.swa)
        adm.private, adm.compute, adm.swa = [], [], []
        self.evictor.unlock(adm.last)

    def poll(self) -> list[int]:
        """Handles completed copies (emitting their events); returns their op ids."""
        return self.copies.poll()

    def l3_delete(self, key: str) -> None:
        """Deletes a page from the store (BlockRemoved for every engine that announced it)."""
        assert self.store is not None, "no L3 store configured"
        self.store.delete(key)

    # --- eviction ------------------------------------------------------------------------

    def evict_device(self, pages: int) -> int:
        """Frees at least ``pages`` device pages if possible; returns how many are free."""
        return self.evictor.evict_device(pages)

    def evict_host(self, pages: int) -> int:
        """Frees at least ``pages`` host pages if possible; returns how many are free."""
        return self.evictor.evict_host(pages)

    # --- whole-cache operations ------------------------------------------------------------

    def reset(self) -> None:
        """Drops everything on every tier and publishes ``AllBlocksCleared``. Voids admissions."""
        self._epoch += 1
        self.dp.reset()
        self.copies.abandon()
        self.device.reset()
        self.host.reset()
        self.swa.reset()
        self._new_tree()
        if self.l3 is not None:
            self.l3.reset()
        self.events.cleared()

    # --- views (kvtier.engine.views) -------------------------------------------------------

    def peek_overlap(self, tokens: Sequence[int] | PackedTokens) -> TierOverlap:
        """Cumulative tier overlap of ``tokens`` (ids, or packed) in pages, read from this cache without
        side effects (no split, no LRU touch), with the index's semantics: what an index that has
        received every event would answer for this worker. O(prompt)."""
        return views.peek(self.tree, self.l3, pack_tokens(tokens))

    def usable_overlap(self, tokens: Sequence[int] | PackedTokens) -> TierOverlap:
        """:meth:`peek_overlap` cut, per tier, to the prefix the engine can reuse: with SWA, one whose last
        ``swa_window_pages`` pages have window KV where each page is found (device pages on device, host
        pages on host; L3 pages always carry it). What a window-aware index answers. O(prompt)."""
        return views.usable(self.tree, self.l3, self.config.swa_window_pages, pack_tokens(tokens))

    def window_residency(self) -> dict[StorageTier, set[int]]:
        """Per tier (device, host), the event hashes of the pages whose window KV this engine holds there."""
        return views.window_residency(self.tree)

    def residency(self) -> dict[StorageTier, set[int]]:
        """Per tier, the event hashes of the pages this engine holds and has announced."""
        return views.residency(self.tree, self.l3)

    def dump_snapshot(self) -> Snapshot:
        """What a state dump sends, by reference (see :mod:`kvtier.engine.dump`). O(nodes + L3 pages)."""
        return views.snapshot(self.tree, self.events, self.l3)

    def dump_events(self, max_events: int = 256) -> list[EventBatch]:
        """The whole current state as BlockStored events, parents first (for resync)."""
        return list(dump_batches(self.dump_snapshot(), max_events=max_events))

    def _check(self) -> None:
        """Asserts the tree's, the pools' and the bookkeeping's invariants."""
        self.tree._check()
        self.device._check()
        self.host._check()
        self.swa._check()
        swa_pages = [p for n in self.tree.nodes() for p in n.swa or []]
        assert len(swa_pages) == len(set(swa_pages)), "a window-KV page is owned twice"
        assert len(swa_pages) <= self.swa.used, "tree holds unallocated window-KV pages"
        dev_pages = [p for n in self.tree.nodes() for p in (n.device or []) + (n.loading or [])]
        host_pages = [p for n in self.tree.nodes() for p in (n.host or []) + (n.host_pending or [])]
        assert len(dev_pages) == len(set(dev_pages)), "a device page is owned twice"
        assert len(host_pages) == len(set(host_pages)), "a host page is owned twice"
        prefetching = self.copies.prefetching_pages()
        assert len(host_pages) + prefetching == self.host.used, (
            f"host pool: {self.host.used} used, tree holds {len(host_pages)}, prefetch {prefetching}")
        assert len(dev_pages) <= self.device.used, "tree holds unallocated device pages"
        if self.l3 is not None:
            self.l3._check()
