"""The index's block masks: which worker slots hold each block key on which tier, with the prefix-closure links.

Every block key anybody holds maps to one int in the layout of :mod:`kvtier.indexer.index.masklayout`. Most keys share
a handful of mask values (one worker, one tier), so equal masks share one object: an int object per key would be a
quarter of the index's memory. The changes events make (a chain stored under a parent, blocks removed, a worker
dropped) keep three things in step: the masks, each worker's engine-hash dict
(:class:`kvtier.indexer.index.workerstate.WorkerState`), and the links and loose blocks of
:class:`kvtier.indexer.index.closure.PrefixClosure`; window KV never outlives a block's bit
(:class:`kvtier.indexer.index.windowkv.WindowKV`).

Stores and evictions come by the hundred blocks: the common cases (a chain of new blocks, blocks this worker alone
holds going away) run as bulk dict operations, in C; anything else goes block by block.
"""

from __future__ import annotations

from collections import deque
from itertools import islice, repeat
from typing import cast

import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.closure import MaskMap, PrefixClosure
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.masklayout import SLOT_MASK, TIERS
from kvtier.indexer.index.windowkv import WindowKV
from kvtier.indexer.index.workerstate import WorkerState
from kvtier.wire.protocol import BlockStored, EngineHash, StorageTier

_MAX_SHARED_MASKS = 1 << 16  # distinct mask values kept as shared objects (see BlockMasks.share)


class BlockMasks:
    """Key -> mask, with the closure links. Not thread-safe (the index's caller serialises access)."""

    __slots__ = ("_shared", "_win", "closure", "masks")

    def __init__(self, masks: MaskMap, win: WindowKV) -> None:
        self.masks = masks  # key -> mask (never 0: a key nobody holds is absent)
        self.closure = PrefixClosure()  # whether queries may binary-search (kvtier.indexer.index.closure)
        self._win = win  # window-KV bits over the same masks
        # One object per distinct mask value; cleared when it grows past _MAX_SHARED_MASKS (sharing is an
        # economy, never a meaning).
        self._shared: dict[int, int] = {}

    def _pool(self) -> dict[int, int]:
        """The shared mask objects, emptied first once they reach ``_MAX_SHARED_MASKS``. O(1) amortised."""
        if len(self._shared) >= _MAX_SHARED_MASKS:
            self._shared.clear()
        return self._shared

    def share(self, m: int) -> int:
        """``m``, as the one object the index keeps for that value. O(1)."""
        return self._pool().setdefault(m, m)

    def insert(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey], tier: StorageTier,
               parent: BlockKey | None) -> None:
        """Puts the worker's ``tier`` bit on each key of a chain stored under ``parent`` (None: the root),
        keeping its engine-hash dict injective and the prefix-closure links (kvtier.indexer.index.closure).
        O(blocks)."""
        hashes, masks, closure = w.hashes, self.masks, self.closure
        bit = 1 << (TIERS * w.slot + tier)
        share = self._pool().setdefault  # BlockMasks.share, without a call per block
        parent_mask = 0 if parent is None else masks.get(parent, 0)
        parent_held = parent is None or bool(parent_mask & bit)
        kids = closure.kids
        if parent_mask:  # a link under a block nobody holds would outlive it (the child is loose anyway)
            closure.link(cast(BlockKey, parent), keys[0], masks)
        if not (any(map(masks.__contains__, keys)) or any(map(hashes.__contains__, block_hashes))
                or len(set(block_hashes)) < len(block_hashes)):
            # New content under new engine hashes (most stores): every block gets the same mask, in C.
            masks.update(zip(keys, repeat(share(bit, bit))))
            hashes.update(zip(block_hashes, keys, strict=True))
            kids.update(zip(keys, islice(keys, 1, None), strict=False))
            if not parent_held:
                closure.stored(w.slot, tier, keys[0], False)  # new blocks have no children to settle
            w.counts[tier] += len(keys)
            return
        slot_bits = SLOT_MASK << (TIERS * w.slot)
        if parent_held and not closure.loose and self._insert_held_elsewhere(w, block_hashes, keys, tier, slot_bits):
            return
        self._insert_each(w, block_hashes, keys, tier, parent, parent_held)

    def insert_tokens(self, w: WorkerState, ev: BlockStored, tier: StorageTier,
                      ns: int | None) -> npt.NDArray[np.uint64] | None:
        """The store ``ev`` of worker ``w``, validated by the caller (block size, token count) and without per-block
        extra keys (``ns``: its key space, under the root), from its token ids, with its keys computed and its
        parent looked up in the same pass, where an implementation has one: returns the chain's keys (valid until
        the next store), or None with nothing done, and the caller takes the general path (:meth:`insert`). Here
        always None: dicts gain nothing from it. O(1)."""
        return None

    def _insert_each(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey], tier: StorageTier,
                     parent: BlockKey | None, parent_held: bool) -> None:
        """:meth:`insert` block by block, for what its bulk cases leave: aliases, engine hashes reused for other
        content, repeats, loose tiers. Reads ``masks`` and the worker's hashes only through the mapping
        interface, so that the compiled tables (:mod:`kvtier.indexer.index.tablemasks`) share it. O(blocks)."""
        hashes, masks, closure = w.hashes, self.masks, self.closure
        bit = 1 << (TIERS * w.slot + tier)
        slot_bits = SLOT_MASK << (TIERS * w.slot)
        share = self.share
        link, linked = closure.link, closure.kids.get
        prev = None  # the block before this one in the chain (its parent was linked by insert)
        added = 0
        for eh, key in zip(block_hashes, keys, strict=True):
            old = hashes.get(eh)
            m = masks.get(key, 0)
            if old is None:
                if m & slot_bits:
                    # A second engine hash for a block this worker already names: keep the first
                    # name, so the dict stays injective (a later use of this alias is "unknown").
                    w.stats.aliases += 1
                else:
                    hashes[eh] = key
            elif old != key:  # the engine reused a hash for other content: forget the old block
                self._drop_slot_bits(w, old, slot_bits)
                hashes[eh] = key
                m = masks.get(key, 0)
                below = prev if prev is not None else parent
                parent_held = below is None or bool(masks.get(below, 0) & bit)  # the dropped block may be it
            if prev is not None and linked(prev) != key:  # (most stores here repeat a link already made)
                link(prev, key, masks)
            if not m & bit:
                m |= bit
                masks[key] = share(m)
                added += 1
                if not parent_held or closure.loose:
                    closure.stored(w.slot, tier, key, parent_held)
            prev, parent_held = key, True
        w.counts[tier] += added

    def _insert_held_elsewhere(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey],
                               tier: StorageTier, slot_bits: int) -> bool:
        """:meth:`insert`'s second bulk case, for a chain under a parent the worker holds there while every tier
        is prefix-closed: blocks new to this worker under engine hashes new to it, some of which other workers
        hold (a conversation served twice), or blocks this worker holds on other tiers under the same engine
        hashes (a backup, load-back or prefetch). Each key's mask gains the bit, in C. False, with nothing
        done, for anything else (an engine hash naming another block, a block this worker holds under another
        name, repeats): the caller then goes block by block. O(blocks)."""
        if len(set(block_hashes)) < len(block_hashes) or len(set(keys)) < len(keys):
            return False
        hashes, masks, closure = w.hashes, self.masks, self.closure
        known = list(map(hashes.get, block_hashes))
        olds = list(map(masks.get, keys, repeat(0)))
        if known != keys:  # then only blocks new to this worker, under engine hashes new to it
            if known.count(None) != len(known) or any(map(slot_bits.__and__, olds)):
                return False
            hashes.update(zip(block_hashes, keys, strict=True))
        linked = closure.kids.get
        if list(map(linked, islice(keys, len(keys) - 1))) != keys[1:]:  # (a re-store finds its links made)
            link = closure.link
            for prev, key in zip(keys, islice(keys, 1, None), strict=False):
                if linked(prev) != key:
                    link(prev, key, masks)
        bit = 1 << (TIERS * w.slot + tier)
        news = list(map(bit.__or__, olds))
        share = self._pool().setdefault
        masks.update(zip(keys, map(share, news, news), strict=True))
        w.counts[tier] += list(map(bit.__and__, olds)).count(0)
        return True

    def _drop_slot_bits(self, w: WorkerState, key: BlockKey, slot_bits: int) -> None:
        """Takes the worker's bits (``slot_bits``) off ``key``, which it holds, with their window KV and closure
        links; the caller drops the engine hash naming it. O(children of key)."""
        if self._win:
            self._win.drop(key, ~slot_bits)
        m = self.masks[key]
        shift = TIERS * w.slot
        held = [t for t in range(TIERS) if m >> (shift + t) & 1]
        for t in held:
            w.counts[t] -= 1
        m &= ~slot_bits
        if m:
            self.masks[key] = self.share(m)
        for t in held:
            self.closure.removed(w.slot, t, key, 1 << (shift + t), self.masks)
        if not m:  # after its children were looked at (compiled tables keep its links in its row)
            del self.masks[key]
            self.closure.died(key)

    def remove(self, w: WorkerState, block_hashes: list[EngineHash], tier: StorageTier) -> int:
        """Takes the worker's ``tier`` bit off the blocks its engine hashes name (a ``BlockRemoved``), or drops them
        from its held orphans; returns how many it holds in neither place. O(blocks + their children)."""
        shift = TIERS * w.slot
        bit = 1 << (shift + tier)
        masks, hashes = self.masks, w.hashes
        if not self._win and self._remove_sole_holder(w, block_hashes, tier, bit):
            return 0
        share = self._pool().setdefault  # BlockMasks.share, without a call per block
        unknown = 0
        gone: list[BlockKey] = []  # keys whose bit this event clears, in order
        dead: list[BlockKey] = []  # of which those nobody holds any more
        for eh in block_hashes:
            key = hashes.get(eh)
            m = 0 if key is None else masks[key]
            if not m & bit:
                if not (w.orphans and w.orphans.remove(eh, tier)):
                    unknown += 1
                continue
            assert key is not None
            m &= ~bit
            if self._win:
                self._win.drop(key, ~bit)  # window KV never outlives the block's full KV on a tier
            if m:
                masks[key] = share(m, m)
            else:
                dead.append(key)  # (its engine hash goes below: a repeat of it in the event is unknown)
            gone.append(key)
            if not (m >> shift) & SLOT_MASK:
                del hashes[eh]
        w.counts[tier] -= len(gone)
        if gone:
            self._removed_then_dead(w.slot, tier, gone, bit, dead)
        return unknown

    def _removed_then_dead(self, slot: int, tier: int, gone: list[BlockKey], bit: int, dead: list[BlockKey]) -> None:
        """The closure's side of a removal whose ``gone`` blocks lost ``bit``, of which ``dead`` (still in ``masks``,
        with their old masks) nobody holds now: their children are looked at first, with the dead ones read as not
        holding the bit, then the dead ones go with their links (compiled tables keep the links in the rows).
        O(gone + their children)."""
        get, closure = self.masks.get, self.closure
        if dead:
            gone_now = set(dead)
            closure.removed_all_by(slot, tier, gone,
                                   lambda kids: [0 if c in gone_now else get(c, 0) & bit for c in kids])
            deque(map(self.masks.__delitem__, dead), maxlen=0)
            closure.died_all(dead)
        else:
            closure.removed_all(slot, tier, gone, bit, self.masks)

    def _remove_sole_holder(self, w: WorkerState, block_hashes: list[EngineHash], tier: StorageTier, bit: int) -> bool:
        """The common eviction, in bulk: every block named is known, once, and held by this worker on this tier
        alone (its mask is exactly ``bit``), so every block goes. False (nothing done) otherwise: the caller
        then takes the blocks one by one. No window KV may be indexed (the caller checks). O(blocks), in C
        but for the closure's pass over their children."""
        keys = list(map(w.hashes.get, block_hashes))
        if None in keys or len(set(keys)) != len(keys):
            return False
        gone = cast(list[BlockKey], keys)
        masks = self.masks
        if list(map(masks.get, gone)).count(bit) != len(gone):
            return False
        deque(map(w.hashes.__delitem__, block_hashes), maxlen=0)
        w.counts[tier] -= len(gone)
        self._removed_then_dead(w.slot, tier, gone, bit, gone)
        return True

    def clear_slot(self, w: WorkerState) -> None:
        """Drops every block of the worker: its bits, window KV, loose blocks and engine hashes (the caller
        keeps what else it needs of them first). O(blocks of the worker)."""
        keep = ~(SLOT_MASK << (TIERS * w.slot))
        masks = self.masks
        for key in w.hashes.values():
            m = masks[key] & keep
            if m:
                masks[key] = self.share(m)
            else:
                del masks[key]
                self.closure.died(key)
        if self._win:
            self._win.drop_slot(w.slot, w.hashes.values())
        self.closure.clear_slot(w.slot, TIERS)
        w.hashes.clear()
        w.counts = [0] * TIERS
