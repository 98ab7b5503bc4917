"""The copies in flight between an engine's tiers, from submission to acknowledgement.

Events for a copy's destination tier follow its acknowledgement, never its submission (SPEC section 1): a device
-> host backup is announced (``BlockStored`` CPU) when :meth:`Copies.poll` sees it complete, a load-back
(``BlockStored`` GPU) likewise, and an L3 write through :class:`kvtier.engine.l3link.L3Link`. Each copy names the
nodes it covers, parents first; a node split while a copy is in flight passes the copy to both fragments
(:meth:`Copies.on_split`), so the acknowledgement announces every fragment under its own parent hash.

Also here, since all they do is start copies: the write policies' backups (write-through, selective, write-back on
eviction) and host -> device load-back. L3 -> host prefetch is :mod:`kvtier.engine.prefetch`, whose
acknowledgements :meth:`Copies.poll` hands back to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.engine.admission import Admission
from kvtier.engine.config import CacheConfig, WritePolicy
from kvtier.engine.datapath import CopyKind, CopyOp, DataPath
from kvtier.engine.events import EventLog
from kvtier.engine.eviction import Evictor
from kvtier.engine.l3.pagetree import PageEntry, PageMeta
from kvtier.engine.l3.storage import PageStore
from kvtier.engine.l3link import L3Link
from kvtier.engine.pool import PageId
from kvtier.engine.radix import Node, RadixTree
from kvtier.wire.protocol import PackedTokens, StorageTier


@dataclass(slots=True)
class OpInfo:
    """What an in-flight copy carries, for its acknowledgement."""

    op: CopyOp  # the copy
    nodes: list[Node] = field(default_factory=list)  # D2H / H2D: fragments, parents first
    metas: list[PageMeta] = field(default_factory=list)  # H2S: per page
    admission: Admission | None = None  # S2H: who asked
    parent: Node | None = None  # S2H: node the prefetched pages continue
    tokens: PackedTokens = b""  # S2H: the prefetched pages' tokens
    window: tuple[int, int] = (0, 0)  # S2H: pages (of the prefetched ones) whose window KV comes along
    pinned: list[PageEntry] = field(default_factory=list)  # S2H: the store's entries pinned for the read


class Copies:
    """A cache's copies in flight. One per tree, like :class:`kvtier.engine.eviction.Evictor`: a reset abandons
    it (:meth:`abandon`) and starts a new one. Invariant: every op id in ``_node_ops`` is in flight (in ``_ops``)
    and lists that node among its nodes."""

    __slots__ = ("_config", "_dp", "_events", "_evictor", "_l3", "_node_ops", "_ops", "_store", "_tree",
                 "on_prefetched")

    def __init__(self, config: CacheConfig, dp: DataPath, tree: RadixTree, evictor: Evictor, events: EventLog,
                 l3: L3Link | None, store: PageStore | None) -> None:
        self._config = config  # the cache's sizes and policies
        self._dp = dp  # where copies run
        self._tree = tree  # the cache's radix tree
        self._evictor = evictor  # the cache's pools, through their evictor
        self._events = events  # the cache's unflushed events
        self._l3 = l3  # the cache's L3 link, if it has a store
        self._store = store  # the L3 store, if any
        self._ops: dict[int, OpInfo] = {}  # op id -> what it carries, while in flight
        self._node_ops: dict[int, list[int]] = {}  # node id -> the D2H/H2D ops covering it
        # Acknowledged L3 -> host prefetches go here (kvtier.engine.prefetch.Prefetcher.landed).
        self.on_prefetched: Callable[[OpInfo], None] | None = None

    # --- bookkeeping ---------------------------------------------------------------------

    def submit(self, op: CopyOp, info: OpInfo) -> None:
        """Starts ``op``, tracked until :meth:`poll` sees it complete. O(nodes)."""
        self._ops[op.op_id] = info
        for n in info.nodes:
            self._node_ops.setdefault(n.node_id, []).append(op.op_id)
        self._dp.submit(op)

    def poll(self) -> list[int]:
        """Handles completed copies (emitting their events); returns their op ids."""
        done = []
        handlers = {CopyKind.D2H: self._backed_up, CopyKind.H2D: self._loaded, CopyKind.H2S: self._l3_written,
                    CopyKind.S2H: self._prefetched}
        for op in self._dp.poll():
            info = self._ops.pop(op.op_id, None)
            if info is None:
                continue  # from before a reset
            for n in info.nodes:
                ids = self._node_ops.get(n.node_id, [])
                if op.op_id in ids:
                    ids.remove(op.op_id)
                if not ids:
                    self._node_ops.pop(n.node_id, None)
            handlers[op.kind](info)
            done.append(op.op_id)
        return done

    def on_split(self, front: Node, back: Node) -> None:
        """A node with copies in flight was split: the copies now cover both fragments. O(copies of the node)."""
        for op_id in self._node_ops.get(back.node_id, []):
            nodes = self._ops[op_id].nodes
            nodes.insert(nodes.index(back), front)
            self._node_ops.setdefault(front.node_id, []).append(op_id)

    def in_flight(self, op_ids: set[int]) -> set[int]:
        """Those of ``op_ids`` not acknowledged yet. O(ids)."""
        return {o for o in op_ids if o in self._ops} if op_ids else set()

    def prefetching_pages(self) -> int:
        """Host pages that L3 -> host copies in flight are filling. O(copies)."""
        return sum(len(i.op.dst) for i in self._ops.values() if i.op.kind is CopyKind.S2H)

    def abandon(self) -> None:
        """A reset: the data path has dropped every copy; store pages held for them are let go. O(copies)."""
        for info in self._ops.values():
            if info.op.kind is CopyKind.H2S and self._store is not None:
                for k in info.op.keys:
                    if self._store.is_pending(k):
                        self._store.abort(k)
            if info.op.kind is CopyKind.S2H and self._store is not None:
                self._store.unpin(info.pinned)
        self._ops.clear()
        self._node_ops.clear()

    # --- backups (device -> host) ----------------------------------------------------------

    def backup(self, node: Node) -> bool:
        """Device -> host copy of ``node`` if its parent is backed up. True if started."""
        if (self._config.host_pages == 0 or node.device is None or node.host is not None
                or node.host_pending is not None):
            return False
        p = node.parent
        if p is not None and p is not self._tree.root and p.host is None:
            return False  # parent first; retried when the parent's copy lands
        pages = self._evictor.alloc_host(node.pages, protect=node)
        if pages is None:
            return False
        node.host_pending = pages
        node.host_swa = node.swa is not None  # the window KV travels with the page if it is there
        op = self._dp.new_op(CopyKind.D2H, list(node.device), list(pages),
                             window_pages=node.pages if node.host_swa else 0)
        self.submit(op, OpInfo(op, nodes=[node]))
        return True

    def backup_path(self, path: list[Node]) -> None:
        """The write policy's backups of a matched path: all under write-through, the hot ones under selective."""
        policy = self._config.write_policy
        for n in path:
            if policy is WritePolicy.WRITE_THROUGH or (
                    policy is WritePolicy.WRITE_THROUGH_SELECTIVE and n.hits >= self._config.selective_threshold):
                self.backup(n)

    def write_back(self, node: Node) -> None:
        """write_back eviction: back up the unbacked chain down to ``node``, then free it.

        If no copy of the chain is in flight and the first one cannot start (no host room), the page
        is evicted without a backup, as SGLang's write-back does when host allocation fails: flagging
        it to wait for a copy that never starts would pin it on device forever.
        """
        chain = [n for n in self._tree.path_to_root(node) if n.host is None]
        if not any(n.host_pending is not None for n in chain) and not self.backup(chain[0]):
            self._evictor.drop_device(node)
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
            self._evictor.push_dev(n)
            todo.extend(n.children.values())

    def _backed_up(self, info: OpInfo) -> None:
        if info.op.error:
            raise RuntimeError(f"device->host copy failed: {info.op.error}")
        for n in info.nodes:
            assert n.host_pending is not None, f"node {n.node_id}: backup acknowledged twice"
            n.host, n.host_pending = n.host_pending, None
            n.want_backup = False
            self._events.stored(n, StorageTier.HOST)
            if n.host_swa:
                self._events.window_stored(n, StorageTier.HOST)
        for n in info.nodes:
            if self._l3 is not None:  # write-behind of the pages not yet in the store, parents first
                self._l3.write(n, self._tree)
            if n.evict_after_backup:
                n.evict_after_backup = False
                if n.lock_ref == 0 and n.device is not None and n.device_leaf():
                    self._evictor.drop_device(n)
            self._evictor.push_dev(n)
            self._evictor.push_host(n)
            policy = self._config.write_policy
            for c in list(n.children.values()):
                wanted = c.want_backup or policy is WritePolicy.WRITE_THROUGH or (
                    policy is WritePolicy.WRITE_THROUGH_SELECTIVE and c.hits >= self._config.selective_threshold)
                if wanted and not self.backup(c) and c.want_backup and c.host is None and c.host_pending is None:
                    self._abandon_write_back(c)

    # --- load-back (host -> device) --------------------------------------------------------

    def load(self, nodes: list[Node], adm: Admission | None) -> None:
        """Host -> device for host-only ``nodes``, a chain (parents first, each an ancestor of the last); joins loads
        already in flight. A node flagged ``load_swa`` brings its window KV too."""
        todo = []
        # Making room must evict neither the chain's ancestors already on device nor the chain's own host copies,
        # so the whole chain is held (its last node, with every ancestor) while its pages are allocated:
        # - an ancestor whose children have no device pages yet is a device leaf, and unless a request holds it
        #   (a chain a prefetch brought in hangs below what the request held), the allocation would evict the
        #   parent of the node it loads;
        # - under write_back a device eviction is a backup, whose host pages may evict a host-only leaf: the
        #   chain's own last node (a prefetched one), which would then be loaded without a host copy.
        anchor = nodes[-1] if nodes else None
        if anchor is not None:
            self._evictor.lock(anchor)
        try:
            for n in nodes:
                if n.loading is not None:
                    if adm is not None:
                        adm.waits.update(self._node_ops.get(n.node_id, []))
                    continue
                if n.device is not None:
                    continue
                pages = self._evictor.alloc_device(n.pages)
                if pages is None:
                    break  # the rest is recomputed
                n.loading = pages
                todo.append(n)
        finally:
            if anchor is not None:
                self._evictor.unlock(anchor)
        if not todo:
            return
        assert all(n.host is not None for n in todo), "loading a node without host copy"
        op = self._dp.new_op(CopyKind.H2D, [p for n in todo for p in n.host or []],
                             [p for n in todo for p in n.loading or []],
                             window_pages=sum(n.pages for n in todo if n.load_swa))
        self.submit(op, OpInfo(op, nodes=todo))
        if adm is not None:
            adm.waits.add(op.op_id)

    def _loaded(self, info: OpInfo) -> None:
        if info.op.error:
            raise RuntimeError(f"host->device copy failed: {info.op.error}")
        for n in info.nodes:
            assert n.loading is not None, f"node {n.node_id}: load acknowledged twice"
            n.device, n.loading = n.loading, None
            self._events.stored(n, StorageTier.DEVICE)
            if self._config.swa_window_pages and n.host_swa and n.load_swa:
                n.swa = self._evictor.alloc_swa(n.pages)  # None: lands tombstoned, the window is recomputed
                if n.swa is not None:
                    self._events.window_stored(n, StorageTier.DEVICE)
                    self._evictor.push_swa(n)
            n.load_swa = False
            self._evictor.push_dev(n)

    # --- L3 writes (host -> store) and prefetch acknowledgements ---------------------------

    def write_l3(self, keys: list[str], metas: list[PageMeta], src: list[PageId]) -> None:
        """Starts the host -> store copy of pages :class:`kvtier.engine.l3link.L3Link` reserved."""
        assert self._store is not None
        op = self._dp.new_op(CopyKind.H2S, src, [], keys, self._store,
                             window_pages=len(keys) if self._config.swa_window_pages else 0)
        self.submit(op, OpInfo(op, metas=metas))

    def _l3_written(self, info: OpInfo) -> None:
        assert self._l3 is not None
        self._l3.written(info.op.keys, info.metas, info.op.error)
        # Nodes whose L3 writes just landed may now be host-evictable: alloc_host rescans the tree when its heap
        # runs dry, so they need no push here.

    def _prefetched(self, info: OpInfo) -> None:
        assert self.on_prefetched is not None, "an L3 prefetch landed with no prefetcher to take it"
        self.on_prefetched(info)
