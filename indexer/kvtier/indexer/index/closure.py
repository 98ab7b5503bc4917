"""Which workers hold each tier as a prefix-closed set of blocks, so that a query may binary-search.

A radix engine (SGLang, kvtier's) evicts only leaves: on every tier, a worker that holds a block holds its
parent there too. Along a query's chain of keys each worker's tier bit can then only drop, never come back,
so the index's masks form at most one run per distinct mask and :meth:`TieredIndex.find_matches_keys` finds
the runs' ends by binary search, with O(runs * log(blocks)) lookups instead of one per block. vLLM evicts any
free block, so a later block can outlive an earlier one: such a worker breaks the property, and queries go
back to a lookup per block until its loose blocks are gone.

The tracker keeps, per (worker slot, tier), the *loose* blocks: blocks held there whose parent is not held
there. All tiers are closed exactly when no slot has a loose block (and none was restored without links).

Invariant (the soundness ``find_matches`` relies on): every held block whose parent is not held on that tier
is in ``loose``. ``loose`` may hold more (a conservative answer: a slower query, never a wrong one); it is
exact except after a parent dies and is stored again while a worker still holds its child without it.

Finding a removed block's children needs links (parent -> children). A child is linked at every store, so while a
key is alive its links name every child any worker holds under it; links of a key die with it (no worker holds
it), at which point every child still held is loose already. The links live in the masks' compiled table
(:mod:`kvtier.indexer.index.tablekernel`): a parent's row holds its one child, or says that its children are a set,
kept in the Python dict ``branches`` (a branch is rare: a prompt that diverges where others went on). A block's
links live exactly as long as its row, so a store finds them where it finds the mask, with no probe of a table of
its own. Loose blocks stay Python sets. The store, removal and clearing kernels link and look at children
themselves; ``kids`` reads the links as a mapping for everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import CHILD, KEY, LINKS_NONE, LINKS_ONE, LINKS_SET, USED, VAL, KeyTable
from kvtier.indexer.index.masklayout import SLOTS_PER_WORD, TIERS

#: The index's key -> mask map (the compiled table :class:`kvtier.indexer.index.keytable.KeyTable`, read as a
#: mapping by the rare block-by-block paths).
MaskMap = MutableMapping[BlockKey, int]

#: A snapshot's copy of the links (:meth:`PrefixClosure.link_pairs`): the parents with one child, those children, and
#: each parent with a set of children with its children.
Links = tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], list[tuple[BlockKey, list[BlockKey]]]]

#: A key's children: one key (a chain), or a set (a branch). Entries may name dead keys; readers skip them. A set
#: drops its dead keys as it grows (at twice its live size), so it holds O(live children).
Kids = BlockKey | set[BlockKey]

_PRUNE_MIN = 16  # children in a set before its dead ones are first looked for


class KidMap(Mapping[BlockKey, Kids]):
    """The links of a :class:`PrefixClosure`, read as a mapping (one compiled lookup
    per read)."""

    __slots__ = ("_c",)

    def __init__(self, closure: PrefixClosure) -> None:
        self._c = closure

    def __getitem__(self, key: BlockKey) -> Kids:
        t = self._c.table
        i = t.slot(key)
        if i < 0 or t.r[i, USED] == LINKS_NONE:
            raise KeyError(key)
        if t.r[i, USED] == LINKS_SET:
            return self._c.branches[key]
        return BlockKey(int(t.r[i, CHILD]))

    def _rows(self) -> Any:
        t = self._c.table
        return np.flatnonzero(t.r[:, USED] > LINKS_NONE)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._c.table.r[self._rows(), KEY].tolist())

    def __len__(self) -> int:
        return len(self._rows())


class PrefixClosure:
    """Loose blocks per (slot, tier) and the parent-to-children links, in the masks' table, that find them. Every
    method is O(1) per block, except those that say otherwise."""

    __slots__ = ("_prune_at", "branches", "kids", "loose", "table", "unknown")

    def __init__(self, table: KeyTable) -> None:
        self.table = table  # the masks, with each block's links in its row
        self.branches: dict[BlockKey, set[BlockKey]] = {}  # parent -> its children, where it has several
        self._prune_at: dict[BlockKey, int] = {}  # parent -> its set's size at which dead children are dropped
        self.kids = KidMap(self)  # the links, read as a mapping (may name dead keys)
        self.loose: dict[tuple[int, int], set[BlockKey]] = {}  # (slot, tier) -> held blocks whose parent is not
        self.unknown: set[int] = set()  # slots restored from a snapshot without links: not known to be closed

    @property
    def closed(self) -> bool:
        """Whether every worker's every tier is prefix-closed (queries may binary-search). O(1)."""
        return not self.loose and not self.unknown

    def children(self, key: BlockKey) -> Iterator[BlockKey]:
        """The children linked under ``key`` (possibly dead: callers test their masks). O(children)."""
        cur = self.kids.get(key)
        if cur is None:
            return iter(())
        return iter(cur) if isinstance(cur, set) else iter((cur,))

    def stored(self, slot: int, tier: int, key: BlockKey, parent_held: bool) -> None:
        """``key`` newly held on (slot, tier), with or without its parent there. O(children of key) while the
        tier has loose blocks, else O(1)."""
        if not parent_held:
            self.loose.setdefault((slot, tier), set()).add(key)
        loose = self.loose.get((slot, tier))
        if loose:
            for c in self.children(key):
                loose.discard(c)  # its parent is held now
            if not loose:
                del self.loose[(slot, tier)]

    def removed(self, slot: int, tier: int, key: BlockKey, bit: int, masks: MaskMap) -> None:
        """``key`` no longer held on (slot, tier) (its bit ``bit`` already cleared): its children held there
        become loose. O(children of key)."""
        self.removed_all(slot, tier, [key], bit, masks)

    def removed_all(self, slot: int, tier: int, keys: list[BlockKey], bit: int, masks: MaskMap) -> None:
        """:meth:`removed` for every key of one removal event, once all their bits are cleared: a child
        removed in the same event, before or after its parent, is never loose at the end either way.
        O(keys + their children), one pass with no call per key (an engine evicts by the hundred)."""
        get = masks.get
        self.removed_all_by(slot, tier, keys, lambda kids: [get(c, 0) & bit for c in kids])

    def removed_all_by(self, slot: int, tier: int, keys: list[BlockKey],
                       held: Callable[[list[BlockKey]], Sequence[int]]) -> None:
        """:meth:`removed_all`, where ``held`` says for a list of keys which are held on (slot, tier) (truthy),
        all at once. O(keys + their children)."""
        loose = self.loose.get((slot, tier))
        if loose is not None:
            loose.difference_update(keys)  # none of them is held there now
        kids = self.kids.get
        linked: list[BlockKey] = []
        for key in keys:
            cur = kids(key)
            if cur is None:
                continue
            if isinstance(cur, set):
                linked.extend(cur)
            else:
                linked.append(cur)
        self.settle(slot, tier, [c for c, h in zip(linked, held(linked), strict=True) if h] if linked else [])

    def settle(self, slot: int, tier: int, now: list[BlockKey]) -> None:
        """Adds ``now`` (children held on (slot, tier) whose parent no longer is) to its loose blocks, and drops
        the set if it is empty. O(len(now))."""
        loose = self.loose.get((slot, tier))
        if now:
            if loose is None:
                loose = self.loose[(slot, tier)] = set()
            loose.update(now)
        if loose is not None and not loose:
            del self.loose[(slot, tier)]

    def clear_slot(self, slot: int, tiers: int) -> None:
        """The slot holds nothing now (a cleared or removed worker). O(tiers)."""
        for t in range(tiers):
            self.loose.pop((slot, t), None)
        self.unknown.discard(slot)

    def loose_of(self, slot: int, tiers: int) -> list[list[BlockKey]]:
        """Per tier, the slot's loose blocks, copied for a snapshot (unsorted: the encoder sorts them off the event
        loop). O(loose blocks)."""
        return [list(self.loose.get((slot, t), ())) for t in range(tiers)]

    def restore_slot(self, slot: int, loose: Sequence[Iterable[int]] | None) -> None:
        """Inverse of :meth:`loose_of` for a slot restored with blocks; ``None`` (a snapshot without loose
        blocks or links) leaves the slot not known to be closed until it is cleared. O(loose blocks)."""
        if loose is None:
            self.unknown.add(slot)
            return
        for t, blocks in enumerate(loose):
            if blocks:
                self.loose[(slot, t)] = {BlockKey(k) for k in blocks}

    def link(self, parent: BlockKey, child: BlockKey) -> None:
        """Records that ``child`` is stored under ``parent``. O(1)."""
        self._link([parent], [child], np.array([parent], np.uint64), np.array([child], np.uint64))

    def link_chain(self, keys: Sequence[BlockKey], karr: Any) -> None:
        """Links each key of a chain under the one before it (``karr``: the keys as an array). O(keys)."""
        if len(keys) > 1:
            self._link(keys[:-1], keys[1:], karr[:-1], karr[1:])

    def _link(self, parents: Sequence[BlockKey] | npt.NDArray[np.uint64],
              children: Sequence[BlockKey] | npt.NDArray[np.uint64], parr: Any, carr: Any) -> None:
        t = self.table
        cur = np.zeros(len(parents), np.uint64)
        how = t.k.link_chain(t.r, parr, carr, cur)
        if how.any():
            self.branched(parents, children, how, cur)

    def branched(self, parents: Sequence[BlockKey | None] | npt.NDArray[np.uint64],
                 children: Sequence[BlockKey] | npt.NDArray[np.uint64], how: Any, cur: Any) -> None:
        """What the link kernels leave to Python, the sets of a parent's children: where ``how[j]`` is 1,
        ``children[j]`` joins its parent's set; where 2, the parent's set is made of its child ``cur[j]`` and
        ``children[j]``. O(pairs)."""
        for j in np.flatnonzero(how).tolist():
            p = parents[j]  # (ints, or a restored snapshot's uint64s)
            self._branch(None if p is None else BlockKey(int(p)), BlockKey(int(children[j])), int(how[j]), cur[j])

    def branched_chain(self, first: BlockKey | None, keys: Sequence[BlockKey] | npt.NDArray[np.uint64], how: Any,
                       cur: Any) -> None:
        """:meth:`branched` for a stored chain: link ``j`` is ``keys[j]`` under ``keys[j - 1]``, the first under
        ``first`` (``keys``: a list, or the ``uint64`` array a store kernel wrote, read only where a link has work).
        O(links with work), where a list of the parents, or of the keys, would cost O(chain) per store."""
        for j in how.nonzero()[0].tolist():
            parent = first if j == 0 else BlockKey(int(keys[j - 1]))
            self._branch(parent, BlockKey(int(keys[j])), int(how[j]), cur[j])

    def _branch(self, parent: BlockKey | None, child: BlockKey, how: int, cur: Any) -> None:
        assert parent is not None, "a link under the root"
        if how == 1:
            kids = self.branches[parent]
            kids.add(child)
            if len(kids) >= self._prune_at.get(parent, _PRUNE_MIN):
                self._prune(parent, kids, child)
        else:
            self.branches[parent] = {BlockKey(int(cur)), child}

    def _prune(self, parent: BlockKey, kids: set[BlockKey], child: BlockKey) -> None:
        """Drops the dead keys (no row: no worker holds them) from ``parent``'s children, ``child`` (being linked:
        its row may come after its link) kept. A long-lived parent (a system prompt) has children stored and evicted
        by the thousand: its set would keep every one it ever had, and a removal of it walk them all. The next prune
        waits until the set has doubled, so each costs O(1) per link made meanwhile. O(children)."""
        slot = self.table.slot
        kids.intersection_update([c for c in kids if c == child or slot(c) >= 0])
        self._prune_at[parent] = max(_PRUNE_MIN, 2 * len(kids))

    def removed_found(self, slot: int, tier: int, gone: list[BlockKey], kids: list[BlockKey],
                      branched: list[BlockKey], holds: Callable[[list[BlockKey]], Sequence[int]]) -> None:
        """:meth:`removed_all` once the removal kernel found, for the blocks that lost the tier
        (``gone``: may be left empty while the slot has no loose blocks on the tier, as only those read it), their
        single children still holding it (``kids``) and those whose children are a set (``branched``; ``holds``
        says which of a list of keys hold it). O(keys + their children)."""
        loose = self.loose.get((slot, tier))
        if loose is not None:
            loose.difference_update(gone)
        if branched:
            linked = [c for p in branched for c in self.branches[p]]
            kids = kids + [c for c, h in zip(linked, holds(linked), strict=True) if h]
        self.settle(slot, tier, kids)

    def died(self, key: BlockKey) -> None:
        """No worker holds ``key`` any more (see :meth:`died_all`)."""
        self.died_all([key])

    def died_all(self, keys: list[BlockKey]) -> None:
        """No worker holds ``keys`` any more: their links went with their rows; their children's sets go here.
        O(keys) while any set is kept, else O(1)."""
        self.unbranch(keys)

    def unbranch(self, dead: list[BlockKey]) -> None:
        """Forgets the children's sets of ``dead`` blocks (their rows went with them). O(len(dead)) while any
        set is kept."""
        if self.branches:
            for _ in map(self.branches.pop, dead, repeat(None)):
                pass
            if self._prune_at:
                for _ in map(self._prune_at.pop, dead, repeat(None)):
                    pass

    def _check(self) -> None:
        """Asserts that the parents whose children are a set kept in Python are exactly those flagged so in the
        masks' table (a dead parent's set goes with its row). O(table)."""
        r = self.table.r
        flagged = set(r[r[:, USED] == LINKS_SET, KEY].tolist())
        kept = set(self.branches)
        assert flagged == kept, (f"{len(kept - flagged)} children's sets kept for parents not flagged, "
                                 f"{len(flagged - kept)} parents flagged without a set")
        assert set(self._prune_at) <= kept, "a prune threshold kept for a parent without a set"

    def link_pairs(self) -> Links:
        """Every link, copied for a snapshot: the parents with one child and those children (table order), and the
        parents with a set of children with theirs. O(table + links)."""
        r = self.table.r
        one = np.flatnonzero(r[:, USED] == LINKS_ONE)
        return r[one, KEY], r[one, CHILD], [(p, list(kids)) for p, kids in self.branches.items()]

    def link_all(self, parents: npt.NDArray[np.uint64], children: npt.NDArray[np.uint64]) -> None:
        """Records links ``children[j]`` under ``parents[j]`` (a restored snapshot's: their parents' masks restored
        first, as a parent nobody holds gets none), then makes loose every child held on a tier of a slot whose
        parent is not (a snapshot's loose blocks may be damaged: ``loose`` may hold more, never fewer).
        O(links * mask words), plus the children made loose."""
        self._link(parents, children, parents, children)
        t = self.table
        rows = t.k.find_all(t.r, np.concatenate([parents, children]))
        ids = np.where(rows >= 0, t.r[rows, VAL], 0).astype(np.int64)  # (id 0: the empty mask)
        pid, cid = ids[:len(parents)], ids[len(parents):]
        # Only a held child whose mask differs from its parent's can lack a parent anywhere; each such pair of masks
        # is compared once, a bounded number of rows at a time (masks are a word per 16 workers).
        some = np.flatnonzero((cid != 0) & (cid != pid))
        n_ids = t.pool.pm.shape[0]
        pairs, which = np.unique(cid[some] * n_ids + pid[some], return_inverse=True)
        lacks: dict[int, list[tuple[int, int]]] = {}  # pair -> the (slot, tier)s its child has and its parent lacks
        step = max(1, (1 << 16) // t.pool.pm.shape[1])
        for lo in range(0, len(pairs), step):
            u = pairs[lo:lo + step]
            lacking = t.pool.pm[u // n_ids] & ~t.pool.pm[u % n_ids]
            for k, word in zip(*(a.tolist() for a in np.nonzero(lacking)), strict=True):
                bits = int(lacking[k, word])
                while bits:
                    bit = (bits & -bits).bit_length() - 1
                    bits &= bits - 1
                    slot = word * SLOTS_PER_WORD + bit // TIERS
                    if slot not in self.unknown:
                        lacks.setdefault(lo + k, []).append((slot, bit % TIERS))
        if lacks:
            bad = np.fromiter(lacks, np.int64, len(lacks))
            for j in np.flatnonzero(np.isin(which, bad)).tolist():
                child = BlockKey(int(children[some[j]]))
                for slot_tier in lacks[int(which[j])]:
                    self.loose.setdefault(slot_tier, set()).add(child)
