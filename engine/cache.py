"""The tiered KV cache (HiCache-like): device and host page pools over a radix tree,
optional L3 store, asynchronous copies, and KV events emitted per SPEC section 1.

Events follow acknowledgements: a page is announced on a tier only once the copy
that put it there has completed, and withdrawn as soon as the cache stops
counting on it. :meth:`TieredCache.residency` is the ground truth the indexer's
view must equal once every event has been delivered.

Pieces kept apart: sizes and policies (:mod:`kvtier.engine.config`), the events not yet flushed
(:mod:`kvtier.engine.events`), this engine's side of the L3 store (:mod:`kvtier.engine.l3link`), and making room
in the pools (:mod:`kvtier.engine.eviction`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from kvtier.engine.config import CacheConfig, PrefetchPolicy, WritePolicy
from kvtier.engine.datapath import CopyKind, CopyOp, DataPath
from kvtier.engine.dump import NodeRun, Snapshot, dump_batches
from kvtier.engine.events import EventLog
from kvtier.engine.eviction import Evictor
from kvtier.engine.l3link import L3Link
from kvtier.engine.pool import PageId, PagePool
from kvtier.engine.radix import Node, RadixTree
from kvtier.engine.storage import PageMeta, PageStore
from kvtier.wire.codec import medium_spelling
from kvtier.wire.overlap import TierOverlap, window_cut
from kvtier.wire.protocol import (
    TOKEN_BYTES,
    EventBatch,
    PackedTokens,
    StorageTier,
    pack_tokens,
)

log = logging.getLogger(__name__)

__all__ = ["Admission", "CacheConfig", "PrefetchPolicy", "PrefillPlan", "TieredCache", "WritePolicy"]


@dataclass(slots=True, eq=False)
class Admission:
    """One request's hold on the cache, from admission to release."""

    request_id: str  # caller's id
    tokens: PackedTokens  # the prompt (4 bytes a token)
    last: Node  # deepest matched node; locked while admitted
    device_pages: int  # pages already on device at admission
    host_pages: int  # pages found on host (loaded back unless load_back=False)
    l3_pages: int  # pages found in the L3 store (prefetched)
    waits: set[int] = field(default_factory=set)  # op ids of loads the request needs
    prefetch_op: int | None = None  # the L3 prefetch, while in flight
    private: list[PageId] = field(default_factory=list)  # device pages for the tail and decode
    compute: list[PageId] = field(default_factory=list)  # device pages for pages to compute
    swa: list[PageId] = field(default_factory=list)  # window-KV pages for computed and tombstoned pages
    started: bool = False  # prefill began: late prefetches no longer load to device
    released: bool = False  # release() was called
    epoch: int = 0  # the cache's reset count at admission: a reset voids the admission


@dataclass(slots=True)
class PrefillPlan:
    """What a request computes: the rest of its prompt after the device-cached prefix."""

    cached_tokens: int  # tokens whose KV is on device
    compute_tokens: int  # tokens to prefill


@dataclass(slots=True)
class _OpInfo:
    op: CopyOp  # the copy
    nodes: list[Node] = field(default_factory=list)  # D2H / H2D: fragments, parents first
    metas: list[PageMeta] = field(default_factory=list)  # H2S: per page
    admission: Admission | None = None  # S2H: who asked
    parent: Node | None = None  # S2H: node the prefetched pages continue
    tokens: PackedTokens = b""  # S2H: the prefetched pages' tokens
    window: tuple[int, int] = (0, 0)  # S2H: pages (of the prefetched ones) whose window KV comes along


class TieredCache:
    """See the module docstring. Single-threaded: callers serialise access."""

    def __init__(self, config: CacheConfig, datapath: DataPath, store: PageStore | None = None,
                 name: str = "engine") -> None:
        self.config = config
        self.name = name
        self.dp = datapath
        self.tree = RadixTree(config.page_size)
        self.device = PagePool("device", config.device_pages)
        self.host = PagePool("host", config.host_pages)
        self.swa = PagePool("swa", (config.swa_pages or config.device_pages) if config.swa_window_pages else 0)
        self.store = store
        self.events = EventLog(config.page_size, config.swa_window_pages, config.swa_events)  # not yet flushed
        self._ops: dict[int, _OpInfo] = {}
        self._node_ops: dict[int, list[int]] = {}  # node_id -> D2H/H2D ops holding it
        self._epoch = 0  # reset() count
        self.tree.on_split = self._on_split
        # This engine's side of the store (kvtier.engine.l3link); None without one.
        self.l3 = L3Link(store, name, config, self.events, self._write_l3) if store is not None else None
        self.evictor = self._evictor()  # makes room in the pools (kvtier.engine.eviction)

    def _evictor(self) -> Evictor:
        return Evictor(self.config, self.tree, self.device, self.host, self.swa, self.events, self.l3, self._write_back)

    # --- events --------------------------------------------------------------------------

    def flush_events(self, ts: float = 0.0, dp_rank: int | None = None) -> EventBatch | None:
        """The events produced since the last flush, as one batch (None if there are none)."""
        return self.events.flush(ts, dp_rank)

    @property
    def has_events(self) -> bool:
        return bool(self.events)

    # --- admission -----------------------------------------------------------------------

    def admit(self, request_id: str, tokens: Sequence[int] | PackedTokens) -> Admission:
        """Matches the prompt (token ids, or packed: :func:`~kvtier.wire.pack_tokens`), locks its prefix,
        starts load-back and L3 prefetch. O(prompt)."""
        tokens = pack_tokens(tokens)
        path = self.tree.match(tokens)
        for n in path:
            n.hits += 1
        last = path[-1] if path else self.tree.root
        self._lock(last)
        dev = 0
        while dev < len(path) and path[dev].device is not None:
            dev += 1
        host_run = []
        for n in path[dev:]:
            if n.host is None:
                break
            host_run.append(n)
        adm = Admission(request_id, tokens, last, sum(n.pages for n in path[:dev]),
                        sum(n.pages for n in host_run), 0, epoch=self._epoch)
        self._backup_path(path)
        resident = sum(n.pages for n in path)
        l3_keys = (self._l3_run(last, tokens, resident)
                   if self.store is not None and len(path) == len(host_run) + dev else [])
        window = (0, 0)
        if self.config.swa_window_pages:
            window = self._plan_window(path[:dev + len(host_run)], len(l3_keys))
            host_run = self._mark_window_loads(host_run, sum(n.pages for n in path[:dev]), window)
        if host_run and self.config.load_back:
            self._load(host_run, adm)
        if l3_keys:
            self._prefetch(adm, last, tokens, resident, l3_keys, window)
        return adm

    def _plan_window(self, path: list[Node], l3_pages: int) -> tuple[int, int]:
        """SWA: the pages ``[c - w, c)`` whose window KV the request needs, ``c`` the end of its usable prefix
        over the device and host runs of ``path`` and ``l3_pages`` more from L3 (whose pages always carry
        window KV). Only these pages' window KV is loaded and prefetched (SGLang's TRAILING_PAGES)."""
        ok: list[bool] = []
        for n in path:
            ok.extend([n.window_read] * n.pages)
        ok.extend([True] * l3_pages)
        cut = window_cut(ok, len(ok), self.config.swa_window_pages)
        return max(0, cut - self.config.swa_window_pages), cut

    def _mark_window_loads(self, host_run: list[Node], start: int, window: tuple[int, int]) -> list[Node]:
        """Splits the host run (pages from ``start``) at the window's edges and flags the nodes inside it whose
        host copy has window KV to bring it along. Returns the run's nodes after the splits."""
        lo, hi = window
        out: list[Node] = []
        pos = start
        for n in host_run:
            for edge in (lo, hi):
                if pos < edge < pos + n.pages:
                    front = self.tree.split(n, edge - pos)
                    front.load_swa = lo <= pos < hi and front.host_swa
                    out.append(front)
                    pos += front.pages
            n.load_swa = lo <= pos < hi and n.host_swa
            out.append(n)
            pos += n.pages
        return out

    def _backup_path(self, path: list[Node]) -> None:
        policy = self.config.write_policy
        for n in path:
            if policy is WritePolicy.WRITE_THROUGH or (
                    policy is WritePolicy.WRITE_THROUGH_SELECTIVE and n.hits >= self.config.selective_threshold):
                self._backup(n)

    def _load(self, nodes: list[Node], adm: Admission | None) -> None:
        """Host -> device for host-only nodes (parents first); joins loads already in flight. A node flagged
        ``load_swa`` brings its window KV too."""
        todo = []
        for n in nodes:
            if n.loading is not None:
                if adm is not None:
                    adm.waits.update(self._node_ops.get(n.node_id, []))
                continue
            if n.device is not None:
                continue
            pages = self.evictor.alloc_device(n.pages)
            if pages is None:
                break  # the rest is recomputed
            n.loading = pages
            todo.append(n)
        if not todo:
            return
        assert all(n.host is not None for n in todo), "loading a node without host copy"
        op = self.dp.new_op(CopyKind.H2D, [p for n in todo for p in n.host or []],
                            [p for n in todo for p in n.loading or []],
                            window_pages=sum(n.pages for n in todo if n.load_swa))
        self._submit(op, _OpInfo(op, nodes=todo))
        if adm is not None:
            adm.waits.add(op.op_id)

    def _l3_run(self, last: Node, tokens: PackedTokens, matched: int) -> list[str]:
        """Keys of the prompt's pages after the ``matched`` resident ones that the L3 store holds, in a row."""
        assert self.l3 is not None
        s = self.tree.stride
        return self.l3.run(last.digests[-1] if last.digests else b"", tokens[matched * s:(len(tokens) // s) * s])

    def _prefetch(self, adm: Admission, last: Node, tokens: PackedTokens, matched: int, keys: list[str],
                  window: tuple[int, int]) -> None:
        """L3 -> host of the pages ``keys`` after the ``matched`` resident ones; window KV only for those in
        ``window`` (page range, SWA)."""
        assert self.store is not None
        s = self.tree.stride
        if len(keys) < max(1, self.config.prefetch_min_pages) or self.config.host_pages == 0:
            return
        pages = self.evictor.alloc_host(len(keys))
        if pages is None:
            return
        self.store.pin(keys)
        self._lock(last)  # the prefetched pages hang below `last`: keep it until they land
        lo, hi = (min(max(e - matched, 0), len(keys)) for e in window)
        op = self.dp.new_op(CopyKind.S2H, [], pages, keys, self.store, window_pages=hi - lo)
        self._submit(op, _OpInfo(op, admission=adm, parent=last, tokens=tokens[matched * s:(matched + len(keys)) * s],
                                 window=(lo, hi)))
        adm.l3_pages = len(keys)
        adm.prefetch_op = op.op_id

    def waiting_for(self, adm: Admission) -> set[int]:
        """Op ids the request still waits for (load-backs; the prefetch per policy is the caller's)."""
        return {o for o in adm.waits if o in self._ops}

    def begin_prefill(self, adm: Admission, output_tokens: int = 0) -> PrefillPlan | None:
        """Reserves device pages to compute the rest of the prompt and ``output_tokens``.

        Returns None (nothing reserved) if the device cannot make room now.
        """
        self._check_live(adm)
        ps = self.config.page_size
        path = self.tree.match(adm.tokens)
        last = path[-1] if path else self.tree.root
        if last is not adm.last:
            self._lock(last)
            self._unlock(adm.last)
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
        usable = self._window_usable(path, cached)
        # A running request keeps window KV for its last window only (what it attends to; SGLang frees the
        # rest as the prefill moves on), so that is all it takes from the pool, and all it leaves cached.
        swa_need = min(full - usable, self.config.swa_window_pages)
        pages = self.evictor.alloc_device(need)
        if pages is None:
            return None
        swa = self.evictor.alloc_swa(swa_need)
        if swa is None:
            swa = self._alloc_swa_from_path(path, usable, swa_need)
        if swa is None:
            self.device.release(pages)
            return None
        adm.compute, adm.private = pages[:full - cached], pages[full - cached:]
        adm.swa = swa
        adm.started = True
        return PrefillPlan(usable * ps, n_tokens - usable * ps)

    def _alloc_swa_from_path(self, path: list[Node], usable: int, n: int) -> list[PageId] | None:
        """``n`` window-KV pages when the LRU has none to give: the request's own locked path may hold the
        pool (a long session caches a window at each turn's end). Like SGLang's SWA lock, which covers only
        the window before a request's cut, window KV elsewhere on the path that no other request holds is
        tombstoned, shallowest first. O(path)."""
        w = self.config.swa_window_pages
        end = 0
        for node in path:
            if self.swa.free >= n:
                break
            start, end = end, end + node.pages
            if node.swa is None or node.lock_ref != 1 or node.host_pending is not None:
                continue  # tombstoned already, read by another request too, or being backed up
            if start < usable and end > usable - w:
                continue  # the window this request reads
            self.evictor.tombstone(node)
        return self.evictor.alloc_swa(n)

    def _window_usable(self, path: list[Node], cached: int) -> int:
        """Longest reusable device prefix (pages): with SWA, the window before the cut needs its
        window KV; tombstoned pages inside it are recomputed."""
        w = self.config.swa_window_pages
        if not w:
            return cached
        present: list[bool] = []
        for n in path:
            if len(present) >= cached:
                break
            present.extend([n.swa is not None] * n.pages)
        return window_cut(present, cached, w)

    def finish_prefill(self, adm: Admission) -> None:
        """The prompt's KV is computed: its new full pages join the tree (BlockStored GPU)."""
        self._check_live(adm)
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
                front = self.tree.add_child(parent, adm.tokens[done * s:window_from * s])
                front.device, compute = compute[:front.pages], compute[front.pages:]
                self.events.stored(front, StorageTier.DEVICE)
                self.evictor.push_dev(front)
                parent, done, new_pages = front, window_from, full - window_from
            node = self.tree.add_child(parent, adm.tokens[done * s:full * s])
            node.device, compute = compute[:new_pages], compute[new_pages:]
            self.events.stored(node, StorageTier.DEVICE)
            if self.config.swa_window_pages and len(adm.swa) >= new_pages:
                node.swa, adm.swa = adm.swa[:new_pages], adm.swa[new_pages:]
                self.events.window_stored(node, StorageTier.DEVICE)
                self.evictor.push_swa(node)
            self._lock(node)
            self._unlock(adm.last)
            adm.last = node
            self.evictor.push_dev(node)
            self.evictor.push_dev(parent)
            if self.config.write_policy is WritePolicy.WRITE_THROUGH:
                self._backup(node)
        if compute:
            self.device.release(compute)  # computed twice concurrently: keep the tree's copy
        self.swa.release(adm.swa)
        adm.swa = []
        if self.config.write_policy is WritePolicy.WRITE_THROUGH:
            self._backup_path(path)

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
        self._unlock(adm.last)

    def _on_split(self, front: Node, back: Node) -> None:
        """A node with copies in flight was split: the copies now cover both fragments."""
        for op_id in self._node_ops.get(back.node_id, []):
            nodes = self._ops[op_id].nodes
            nodes.insert(nodes.index(back), front)
            self._node_ops.setdefault(front.node_id, []).append(op_id)

    # --- locks ---------------------------------------------------------------------------

    def _lock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.tree.root:
            n.lock_ref += 1
            n = n.parent

    def _unlock(self, node: Node) -> None:
        n: Node | None = node
        while n is not None and n is not self.tree.root:
            assert n.lock_ref > 0, f"unlocking node {n.node_id} that is not locked"
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictor.push_dev(n)
                self.evictor.push_host(n)
                self.evictor.push_swa(n)
            n = n.parent

    # --- backups -------------------------------------------------------------------------

    def _backup(self, node: Node) -> bool:
        """Device -> host copy of ``node`` if its parent is backed up. True if started."""
        if (self.config.host_pages == 0 or node.device is None or node.host is not None
                or node.host_pending is not None):
            return False
        p = node.parent
        if p is not None and p is not self.tree.root and p.host is None:
            return False  # parent first; retried when the parent's copy lands
        pages = self.evictor.alloc_host(node.pages, protect=node)
        if pages is None:
            return False
        node.host_pending = pages
        node.host_swa = node.swa is not None  # the window KV travels with the page if it is there
        op = self.dp.new_op(CopyKind.D2H, list(node.device), list(pages),
                            window_pages=node.pages if node.host_swa else 0)
        self._submit(op, _OpInfo(op, nodes=[node]))
        return True

    def _write_back(self, node: Node) -> None:
        """write_back eviction: back up the unbacked chain down to ``node``, then free it.

        If no copy of the chain is in flight and the first one cannot start (no host room), the page
        is evicted without a backup, as SGLang's write-back does when host allocation fails: flagging
        it to wait for a copy that never starts would pin it on device forever.
        """
        chain = [n for n in self.tree.path_to_root(node) if n.host is None]
        if not any(n.host_pending is not None for n in chain) and not self._backup(chain[0]):
            self.evictor.drop_device(node)
            return
        node.evict_after_backup = True
        for n in chain:
            n.want_backup = True

    def _abandon_write_back(self, node: Node) -> None:
        """The chain below ``node`` cannot be backed up now: its nodes become ordinary device leaves
        again (evictable, and written back afresh when next chosen)."""
        todo = [node]
        while todo:
            n = todo.pop()
            if not (n.want_backup or n.evict_after_backup):
                continue
            n.want_backup = n.evict_after_backup = False
            self.evictor.push_dev(n)
            todo.extend(n.children.values())

    # --- L3 ------------------------------------------------------------------------------

    def _l3_write(self, node: Node) -> None:
        """Write-behind of a host-resident node's pages not yet in the store, parents first."""
        if self.l3 is not None:
            self.l3.write(node, self.tree)

    def _write_l3(self, keys: list[str], metas: list[PageMeta], src: list[PageId]) -> None:
        """Starts the host -> store copy of pages :class:`kvtier.engine.l3link.L3Link` reserved."""
        assert self.store is not None
        op = self.dp.new_op(CopyKind.H2S, src, [], keys, self.store,
                            window_pages=len(keys) if self.config.swa_window_pages else 0)
        self._submit(op, _OpInfo(op, metas=metas))

    def l3_delete(self, key: str) -> None:
        """Deletes a page from the store (BlockRemoved for every engine that announced it)."""
        assert self.store is not None, "no L3 store configured"
        self.store.delete(key)

    # --- data path completions -----------------------------------------------------------

    def _submit(self, op: CopyOp, info: _OpInfo) -> None:
        self._ops[op.op_id] = info
        for n in info.nodes:
            self._node_ops.setdefault(n.node_id, []).append(op.op_id)
        self.dp.submit(op)

    def poll(self) -> list[int]:
        """Handles completed copies (emitting their events); returns their op ids."""
        done = []
        for op in self.dp.poll():
            info = self._ops.pop(op.op_id, None)
            if info is None:
                continue  # from before a reset
            for n in info.nodes:
                ids = self._node_ops.get(n.node_id, [])
                if op.op_id in ids:
                    ids.remove(op.op_id)
                if not ids:
                    self._node_ops.pop(n.node_id, None)
            {CopyKind.D2H: self._backed_up, CopyKind.H2D: self._loaded,
             CopyKind.H2S: self._l3_written, CopyKind.S2H: self._prefetched}[op.kind](info)
            done.append(op.op_id)
        return done

    def _backed_up(self, info: _OpInfo) -> None:
        if info.op.error:
            raise RuntimeError(f"device->host copy failed: {info.op.error}")
        for n in info.nodes:
            assert n.host_pending is not None, f"node {n.node_id}: backup acknowledged twice"
            n.host, n.host_pending = n.host_pending, None
            n.want_backup = False
            self.events.stored(n, StorageTier.HOST)
            if n.host_swa:
                self.events.window_stored(n, StorageTier.HOST)
        for n in info.nodes:
            self._l3_write(n)
            if n.evict_after_backup:
                n.evict_after_backup = False
                if n.lock_ref == 0 and n.device is not None and n.device_leaf():
                    self.evictor.drop_device(n)
            self.evictor.push_dev(n)
            self.evictor.push_host(n)
            policy = self.config.write_policy
            for c in list(n.children.values()):
                wanted = c.want_backup or policy is WritePolicy.WRITE_THROUGH or (
                    policy is WritePolicy.WRITE_THROUGH_SELECTIVE and c.hits >= self.config.selective_threshold)
                if wanted and not self._backup(c) and c.want_backup and c.host is None and c.host_pending is None:
                    self._abandon_write_back(c)

    def _loaded(self, info: _OpInfo) -> None:
        if info.op.error:
            raise RuntimeError(f"host->device copy failed: {info.op.error}")
        for n in info.nodes:
            assert n.loading is not None, f"node {n.node_id}: load acknowledged twice"
            n.device, n.loading = n.loading, None
            self.events.stored(n, StorageTier.DEVICE)
            if self.config.swa_window_pages and n.host_swa and n.load_swa:
                n.swa = self.evictor.alloc_swa(n.pages)  # None: lands tombstoned, the window is recomputed
                if n.swa is not None:
                    self.events.window_stored(n, StorageTier.DEVICE)
                    self.evictor.push_swa(n)
            n.load_swa = False
            self.evictor.push_dev(n)

    def _l3_written(self, info: _OpInfo) -> None:
        assert self.l3 is not None
        self.l3.written(info.op.keys, info.metas, info.op.error)
        # Nodes whose L3 writes just landed may now be host-evictable: _alloc_host rescans
        # the tree when its heap runs dry, so they need no push here.

    def _prefetched(self, info: _OpInfo) -> None:
        assert self.store is not None and info.parent is not None and info.admission is not None
        self.store.unpin(info.op.keys)
        adm, parent = info.admission, info.parent
        if adm.prefetch_op == info.op.op_id:
            adm.prefetch_op = None
        if info.op.error:
            log.error("%s: L3 read failed: %s", self.name, info.op.error)
            for key in info.op.bad_keys:  # never offered again: dropped, BlockRemoved by each announcer
                self.store.drop(key)
            self.host.release([PageId(p) for p in info.op.dst])
            self._unlock(parent)
            return
        new = self._insert_host_pages(parent, info.tokens, [PageId(p) for p in info.op.dst], info.window)
        self._unlock(parent)
        if new and not adm.started and not adm.released and self.config.load_back:
            # The new node may hang under host-only ancestors: load the whole chain, parents first,
            # so device residency stays prefix-closed.
            self._load([n for n in self.tree.path_to_root(new[-1]) if n.device is None], adm)

    def _insert_host_pages(self, parent: Node, tokens: PackedTokens, pages: list[PageId],
                           window: tuple[int, int] = (0, 0)) -> list[Node]:
        """Prefetched pages below ``parent``: new host-only nodes (BlockStored CPU), those of the ``window``
        page range with their window KV (split at its edges); pages the tree already has are freed. Returns
        the new nodes, parents first."""
        s = self.tree.stride
        node, pos, n_pages = parent, 0, len(tokens) // s
        while pos < n_pages:
            child = node.children.get(self.tree.page_key(tokens, pos))
            if child is None:
                break
            k = self.tree.common_pages(child, tokens, pos, n_pages)
            if k < child.pages:
                child = self.tree.split(child, k)
            self.host.release(pages[pos:pos + k])
            pos += k
            node = child
        if pos == n_pages:
            return []
        if node is not self.tree.root and node.host is None:
            self.host.release(pages[pos:])  # the parent has no host copy: keep host prefix-closed
            return []
        lo, hi = window
        edges = sorted({pos, n_pages, *(e for e in (lo, hi) if pos < e < n_pages)})
        new: list[Node] = []
        for a, b in pairwise(edges):
            node = self.tree.add_child(node, tokens[a * s:b * s])
            node.host = pages[a:b]
            self.events.stored(node, StorageTier.HOST)
            if self.config.swa_window_pages and lo <= a < hi:
                node.host_swa = node.load_swa = True
                self.events.window_stored(node, StorageTier.HOST)
            self.evictor.push_host(node)
            new.append(node)
        return new

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
        for info in self._ops.values():
            if info.op.kind is CopyKind.H2S and self.store is not None:
                for k in info.op.keys:
                    if self.store.is_pending(k):
                        self.store.abort(k)
            if info.op.kind is CopyKind.S2H and self.store is not None:
                self.store.unpin(info.op.keys)
        self._ops.clear()
        self._node_ops.clear()
        self.tree = RadixTree(self.config.page_size)
        self.tree.on_split = self._on_split
        self.device.reset()
        self.host.reset()
        self.swa.reset()
        self.evictor = self._evictor()
        if self.l3 is not None:
            self.l3.reset()
        self.events.cleared()

    def peek_overlap(self, tokens: Sequence[int] | PackedTokens) -> TierOverlap:
        """Cumulative tier overlap of ``tokens`` (ids, or packed) in pages, read from this cache without
        side effects (no split, no LRU touch), with the index's semantics: what an index that has
        received every event would answer for this worker. O(prompt)."""
        return self._peek(pack_tokens(tokens), None)

    def usable_overlap(self, tokens: Sequence[int] | PackedTokens) -> TierOverlap:
        """:meth:`peek_overlap` cut, per tier, to the prefix the engine can reuse: with SWA, one whose last
        ``swa_window_pages`` pages have window KV where each page is found (device pages on device, host
        pages on host; L3 pages always carry it). What a window-aware index answers. O(prompt)."""
        ok: list[bool] = []
        raw = self._peek(pack_tokens(tokens), ok)
        w = self.config.swa_window_pages
        if not w:
            return raw
        ok.extend([True] * (raw.external - len(ok)))
        return TierOverlap(*(window_cut(ok, level, w) for level in (raw.device, raw.host, raw.disk, raw.external)))

    def _peek(self, tokens: PackedTokens, ok: list[bool] | None) -> TierOverlap:
        """The raw overlap; fills ``ok`` (if given) with, per page on device or host, whether its window KV
        is there too."""
        s = self.tree.stride
        pages = len(tokens) // s
        node, pos = self.tree.root, 0
        last_digest = b""  # digest of the last matched page: the L3 chain continues from it
        device = -1
        while pos < pages:
            child = node.children.get(self.tree.page_key(tokens, pos))
            if child is None:
                break
            k = self.tree.common_pages(child, tokens, pos, pages)
            if child.device is None and device < 0:
                device = pos
            if child.device is None and child.host is None:
                break  # only in flight towards host: not announced on any tier yet
            if ok is not None:
                ok.extend([child.window_read] * k)
            pos += k
            node = child
            last_digest = child.digests[k - 1]
            if k < child.pages:
                break
        host = pos
        device = host if device < 0 else device
        disk = ext = host
        if self.l3 is not None and host < pages:
            run = self.l3.announced_run(last_digest, tokens[host * s:pages * s])
            if self.l3.store.shared:
                ext = host + run
            else:
                disk = ext = host + run
        return TierOverlap(device, host, disk, ext)

    def window_residency(self) -> dict[StorageTier, set[int]]:
        """Per tier (device, host), the event hashes of the pages whose window KV this engine holds there."""
        out: dict[StorageTier, set[int]] = {StorageTier.DEVICE: set(), StorageTier.HOST: set()}
        for n in self.tree.nodes():
            if n.swa is not None:
                out[StorageTier.DEVICE].update(n.hashes)
            if n.host is not None and n.host_swa:
                out[StorageTier.HOST].update(n.hashes)
        return out

    def residency(self) -> dict[StorageTier, set[int]]:
        """Per tier, the event hashes of the pages this engine holds and has announced."""
        out: dict[StorageTier, set[int]] = {t: set() for t in StorageTier}
        for n in self.tree.nodes():
            if n.device is not None:
                out[StorageTier.DEVICE].update(n.hashes)
            if n.host is not None:
                out[StorageTier.HOST].update(n.hashes)
        if self.l3 is not None:
            out[self.l3.tier].update(self.l3.announced.values())
        return out

    def dump_snapshot(self) -> Snapshot:
        """What a state dump sends, by reference (see :mod:`kvtier.engine.dump`). O(nodes + L3 pages)."""
        runs: list[NodeRun] = []
        windows: list[NodeRun] = []  # window KV: after every full-attention run, which they refer to
        dev, host = medium_spelling(StorageTier.DEVICE), medium_spelling(StorageTier.HOST)
        for n in self.tree.nodes():
            if n.device is not None:
                runs.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, dev))
                if n.swa is not None and self.events.window_pages:
                    windows.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, dev))
            if n.host is not None:
                runs.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, host))
                if n.host_swa and self.events.window_pages:
                    windows.append(NodeRun(n.hashes, n.parent_hash(), n.tokens, host))
        window_tokens = self.events.window_tokens if windows else 0
        if self.l3 is None:
            return Snapshot(self.tree.page_size, runs, [], "", windows, window_tokens)
        return Snapshot(self.tree.page_size, runs, self.l3.announced_pages(), medium_spelling(self.l3.tier), windows,
                        window_tokens)

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
        prefetching = sum(len(i.op.dst) for i in self._ops.values() if i.op.kind is CopyKind.S2H)
        assert len(host_pages) + prefetching == self.host.used, (
            f"host pool: {self.host.used} used, tree holds {len(host_pages)}, prefetch {prefetching}")
        assert len(dev_pages) <= self.device.used, "tree holds unallocated device pages"
        if self.l3 is not None:
            self.l3._check()
