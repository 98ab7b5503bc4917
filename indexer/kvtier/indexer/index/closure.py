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

Finding a removed block's children needs links: ``kids`` maps a key to the children stored under it (one
key, or a set at a branch). A child is linked at every store, so while a key is alive its links name every
child any worker holds under it; links of a key die with it (no worker holds it), at which point every
child still held is loose already.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from itertools import repeat

from kvtier.indexer.index.keys import BlockKey

#: The index's key -> mask map: a dict, or the compiled table (:class:`kvtier.indexer.index.keytable.KeyTable`).
MaskMap = MutableMapping[BlockKey, int]

#: A key's children: one key (a chain), or a set (a branch). Entries may name dead keys; readers skip them.
Kids = BlockKey | set[BlockKey]


class PrefixClosure:
    """Loose blocks per (slot, tier) and the parent-to-children links that find them. Every method is O(1)
    per block, except those that say otherwise."""

    __slots__ = ("kids", "loose", "unknown")

    def __init__(self) -> None:
        self.kids: dict[BlockKey, Kids] = {}  # parent key -> its children (links; may name dead keys)
        self.loose: dict[tuple[int, int], set[BlockKey]] = {}  # (slot, tier) -> held blocks whose parent is not
        self.unknown: set[int] = set()  # slots restored from a snapshot without links: not known to be closed

    @property
    def closed(self) -> bool:
        """Whether every worker's every tier is prefix-closed (queries may binary-search). O(1)."""
        return not self.loose and not self.unknown

    def link(self, parent: BlockKey, child: BlockKey, alive: MaskMap) -> None:
        """Records that ``child`` is stored under ``parent``; ``alive`` is the index's masks."""
        cur = self.kids.get(parent)
        if cur is None:
            self.kids[parent] = child
        elif isinstance(cur, set):
            cur.add(child)
        elif cur != child:
            self.kids[parent] = {cur, child} if cur in alive else child

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

    def died(self, key: BlockKey) -> None:
        """No worker holds ``key`` any more: its links go (every child still held is loose already)."""
        self.kids.pop(key, None)

    def died_all(self, keys: list[BlockKey]) -> None:
        """:meth:`died` for each of ``keys``, in C. O(keys)."""
        deque(map(self.kids.pop, keys, repeat(None)), maxlen=0)

    def clear_slot(self, slot: int, tiers: int) -> None:
        """The slot holds nothing now (a cleared or removed worker). O(tiers)."""
        for t in range(tiers):
            self.loose.pop((slot, t), None)
        self.unknown.discard(slot)

    def loose_of(self, slot: int, tiers: int) -> list[list[BlockKey]]:
        """Per tier, the slot's loose blocks (for a snapshot). O(loose blocks)."""
        return [sorted(self.loose.get((slot, t), ())) for t in range(tiers)]

    def restore_slot(self, slot: int, loose: list[list[int]] | None) -> None:
        """Inverse of :meth:`loose_of` for a slot restored with blocks; ``None`` (a snapshot without loose
        blocks or links) leaves the slot not known to be closed until it is cleared. O(loose blocks)."""
        if loose is None:
            self.unknown.add(slot)
            return
        for t, blocks in enumerate(loose):
            if blocks:
                self.loose[(slot, t)] = {BlockKey(k) for k in blocks}

    def links(self) -> list[tuple[BlockKey, list[BlockKey]]]:
        """Every link, as ``(parent, children)`` (for a snapshot). O(links)."""
        return [(p, sorted(c) if isinstance(c, set) else [c]) for p, c in self.kids.items()]
