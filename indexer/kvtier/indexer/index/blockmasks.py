"""The index's block masks: which worker slots hold each block key on which tier, with the prefix-closure links.

Every block key anybody holds maps to one mask in the layout of :mod:`kvtier.indexer.index.masklayout`, in a
compiled :class:`kvtier.indexer.index.keytable.KeyTable` (equal masks share one pool entry); each worker's engine
hashes live in an :class:`kvtier.indexer.index.keytable.EngineHashes`. The changes events make (a chain stored
under a parent, blocks removed, a worker dropped) keep three things in step: the masks, each worker's engine hashes
(:class:`kvtier.indexer.index.workerstate.WorkerState`), and the links and loose blocks of
:class:`kvtier.indexer.index.closure.PrefixClosure`; window KV never outlives a block's bit
(:class:`kvtier.indexer.index.windowkv.WindowKV`). The cases every event of a radix engine takes run as one kernel
call of :mod:`kvtier.indexer.index.tablekernel`:

* a store, whatever blocks it names, unless an engine hash repeats in it or names another block already: new
  blocks, blocks the worker names already (backups, load-backs, prefetches), blocks others hold (a conversation
  served twice), chains that extend what the worker holds, aliases, loose tiers;
* a removal that does not touch window KV, whoever else holds the blocks, with what it does to the closure;
* clearing a worker.

What is left (repeated engine hashes, engine hashes reused for other content, window KV) goes block by block
through the table's mapping interface (:meth:`BlockMasks._insert_each`, :meth:`BlockMasks._remove_each`); so do
workers whose engine hashes are ``bytes`` (kept in a dict) for what the bulk kernels leave. Either way the result
is the one ``tests/reference_index.py`` gives.

Invariants: a key in the table has a non-zero mask (a key nobody holds is absent); each worker's engine hashes
name distinct keys; ``w.counts[t]`` is the number of keys with worker ``w``'s tier-``t`` bit.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.closure import PrefixClosure
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import _M64, ROOT, ROOT_NS, UNDER, VAL, KeyTable
from kvtier.indexer.index.masklayout import SLOT_MASK, SLOTS_PER_WORD, TIERS
from kvtier.indexer.index.windowkv import WindowKV
from kvtier.indexer.index.workerstate import WorkerState
from kvtier.wire.protocol import TOKEN_BYTES, BlockStored, EngineHash, StorageTier, pack_tokens

_NONE = np.zeros(1, np.uint64)  # the engine-hash arguments of a kernel call for a worker whose hashes are a dict
_NONE_E = np.zeros((1, VAL + 1), np.uint64)
_NONE_M = np.zeros(1, np.int64)


def _as_list(keys: Any) -> list[BlockKey]:
    """Keys as a list of ints (a kernel's ``uint64`` array converted; a list as it is). O(keys)."""
    return keys.tolist() if isinstance(keys, np.ndarray) else keys  # type: ignore[no-any-return]


def _bits(slot: int, tier: int) -> tuple[int, np.uint64, np.uint64]:
    """The word of a mask holding ``slot``'s bits, its ``tier`` bit there, and all its bits there. O(1)."""
    word, pos = divmod(slot, SLOTS_PER_WORD)
    shift = TIERS * pos
    return word, np.uint64(1 << (shift + tier)), np.uint64(SLOT_MASK << shift)


class BlockMasks:
    """Key -> mask in a compiled table, with the closure links. Not thread-safe (the index's caller serialises
    access)."""

    __slots__ = ("_c", "_k", "_removal", "_scratch", "_t", "_wheres", "_win", "closure", "masks")

    def __init__(self, table: KeyTable, win: WindowKV) -> None:
        self.masks = self._t = table  # key -> mask (never 0: a key nobody holds is absent)
        self._win = win  # window-KV bits over the same masks
        self._k: Any = table.k  # the kernel module
        self._c = self.closure = PrefixClosure(table)  # whether queries may binary-search, and the links
        self._wheres: dict[tuple[int, int], tuple[int, np.uint64, np.uint64]] = {}  # (slot, tier) -> _bits(...)
        # The store kernel's outputs, reused (a store allocating four arrays pays more for that than for a block).
        self._scratch = self._outputs(64)
        self._removal = self._removal_outputs(64)  # the same for the removal kernel

    @staticmethod
    def _outputs(n: int) -> tuple[Any, Any, Any, Any, Any]:
        # newly, how, cur, res, keys (the keys store_tokens computes)
        return np.empty(n, np.uint8), np.empty(n, np.uint8), np.empty(n, np.uint64), np.empty(7, np.int64), \
            np.empty(n, np.uint64)

    @staticmethod
    def _removal_outputs(n: int) -> tuple[Any, Any, Any, Any, Any]:
        return np.empty(n, np.uint8), np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n, np.uint64), \
            np.empty(5, np.int64)

    def _where(self, slot: int, tier: int) -> tuple[int, np.uint64, np.uint64]:
        """:func:`_bits`, remembered. O(1)."""
        got = self._wheres.get((slot, tier))
        if got is None:
            got = self._wheres[(slot, tier)] = _bits(slot, tier)
        return got

    def insert(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey], tier: StorageTier,
               parent: BlockKey | None) -> None:
        """Puts the worker's ``tier`` bit on each key of a chain stored under ``parent`` (None: the root), keeping
        its engine hashes injective and the prefix-closure links: one kernel call for every case but the rare ones
        (repeated engine hashes, an engine hash reused for other content), which go block by block. O(blocks)."""
        e = w.hashes
        ehs = e.int64s(block_hashes)
        if ehs is None:
            self._insert_named_in_dict(w, e.demote(), block_hashes, keys, tier, parent)
            return
        n = len(keys)
        word, bit, slot_bits = self._where(w.slot, tier)
        newly, how, cur, res, _ = self._room_for(n)
        t = self._t
        p, karr, store, closed = t.pool, t.array(keys), self._k.store, not self._c.loose
        while (path := store(t.r, t.m, p.pm, p.ph, p.pa, e.r, e.m, karr, ehs, np.uint64(parent or 0),
                             parent is not None, word, bit, slot_bits, closed, newly, how, cur, res)) < 0:
            self._grow(w, n)  # then again, with the grown arrays
        self._stored(w, path, block_hashes, keys, tier, parent)

    def insert_tokens(self, w: WorkerState, ev: BlockStored, tier: StorageTier,
                      ns: int | None) -> npt.NDArray[np.uint64] | None:
        """The store ``ev`` of worker ``w``, validated by the caller (block size, token count) and without per-block
        extra keys (``ns``: its key space, under the root), in one kernel call (``tablekernel.store_tokens``): the
        parent's lookup, the keys and the store. Returns the chain's keys as a ``uint64`` array, valid until the
        next store; or None with nothing done, and the caller takes the general path (:meth:`insert`). O(blocks)."""
        e = w.hashes
        peh = ev.parent_block_hash
        if peh is None:
            mode, base = (ROOT, 0) if ns is None else (ROOT_NS, ns)
        elif e.py is None and e.fits(peh):
            mode, base = UNDER, peh & _M64  # type: ignore[operator]
        else:
            return None  # a parent only a dict, a ghost or an orphan can name: the general path looks
        buf = np.frombuffer(pack_tokens(ev.token_ids), np.uint8)  # (bad token ids raise before anything changes)
        ehs = e.int64s(ev.block_hashes)
        if ehs is None:
            return None
        n = len(ehs)
        word, bit, slot_bits = self._where(w.slot, tier)
        newly, how, cur, res, karr = self._room_for(n)
        t = self._t
        p, store, closed = t.pool, self._k.store_tokens, not self._c.loose
        while (path := store(t.r, t.m, p.pm, p.ph, p.pa, e.r, e.m, buf, ev.block_size * TOKEN_BYTES, ehs,
                             np.uint64(base), mode, word, bit, slot_bits, closed, newly, how, cur, res, karr)) == -1:
            self._grow(w, n)  # then again, with the grown arrays
        if path < 0:
            return None  # the table does not name the parent
        keys: npt.NDArray[np.uint64] = karr[:n]
        parent = BlockKey(int(res[5]) & _M64) if mode == UNDER else None  # (res is int64: the key's 64 bits)
        self._stored(w, path, ev.block_hashes, keys, tier, parent)
        return keys

    def _room_for(self, n: int) -> tuple[Any, Any, Any, Any, Any]:
        """The store kernels' outputs, for ``n`` blocks. O(1), O(n) when they grow."""
        if len(self._scratch[0]) < n:
            self._scratch = self._outputs(n)
        return self._scratch

    def _stored(self, w: WorkerState, path: int, block_hashes: list[EngineHash], keys: Any, tier: StorageTier,
                parent: BlockKey | None) -> None:
        """What follows a store kernel's call (``path``, and its outputs in the scratch arrays) in Python: the
        closure's loose blocks and sets of children, the counts; block by block if the kernel took none of its
        cases. ``keys``: the chain's keys, a list or a ``uint64`` array. O(blocks) then, else O(changes)."""
        e, closure = w.hashes, self._c
        newly, how, cur, res, _ = self._scratch
        held, added, aliases, linking, high, _, filling = res.tolist()
        parent_held = bool(held)
        if filling:  # past 5/8 full: their next sizes get ready before they must grow
            if filling & 1:
                self._t.prepare()
            if filling & 2:
                e.prepare()
        n = len(keys)
        if not path:  # nothing changed yet: the parent's link, then block by block
            ks = _as_list(keys)
            self._grow(w, n)
            if parent is not None and parent in self._t:
                closure.link(parent, ks[0])
            self._insert_each(w, block_hashes, ks, tier, parent, parent_held)
            return
        if high and e.signed is None:  # converted as int64 (EngineHashes.int64s): the top bit is a sign
            e.signed = True
        if linking:
            closure.branched_chain(parent, keys, how[:n], cur)
        if path == 1:
            if not parent_held:
                closure.stored(w.slot, tier, BlockKey(int(keys[0])), False)  # new blocks have no children to settle
        elif path == 4 and (not parent_held or closure.loose):
            ks = _as_list(keys)
            for j in np.flatnonzero(newly[:n]).tolist():  # in chain order, as the bits were set
                if (j == 0 and not parent_held) or closure.loose:
                    closure.stored(w.slot, tier, ks[j], parent_held or j > 0)
        w.counts[tier] += added
        w.stats.aliases += aliases

    def _pool_room(self, w: WorkerState, n: int) -> None:
        """Room in the pool for ``n`` new masks with worker ``w``'s bits. O(masks) when it grows, else O(1)."""
        self._t.widen(w.slot + 1)
        self._t.pool.reserve(n)

    def _grow(self, w: WorkerState, n: int) -> None:
        """Room for ``n`` more blocks of worker ``w`` in every table and the pool, for the kernels that check for
        it themselves (they change nothing while it lacks). O(entries) when a table grows, else O(1)."""
        t, e = self._t, w.hashes
        t.widen(w.slot + 1)
        t.reserve(n)
        e.reserve(n)
        t.pool.reserve(n)

    def _insert_named_in_dict(self, w: WorkerState, py: dict[EngineHash, BlockKey], block_hashes: list[EngineHash],
                              keys: list[BlockKey], tier: StorageTier, parent: BlockKey | None) -> None:
        """:meth:`insert` for a worker whose engine hashes live in a dict (vLLM's ``bytes``): the bulk cases with
        the engine hashes in Python and the masks in the table. O(blocks)."""
        t, k, closure = self._t, self._k, self._c
        t.widen(w.slot + 1)
        word, bit, slot_bits = _bits(w.slot, tier)
        p = t.pool
        parent_held = True
        if parent is not None:
            state = k.bit_state(t.r, p.pm, np.uint64(parent), word, bit)
            parent_held = state == 1
            if state >= 0:  # a link under a block nobody holds would outlive it (the child is loose anyway)
                closure.link(parent, keys[0])
        n = len(keys)
        t.reserve(n)
        p.reserve(n)
        karr = t.array(keys)
        if (len(set(block_hashes)) == n and not any(map(py.__contains__, block_hashes))
                and k.store_new(t.r, t.m, p.pm, p.ph, p.pa, karr, word, bit)):
            py.update(zip(block_hashes, keys, strict=True))
            closure.link_chain(keys, karr)
            if not parent_held:
                closure.stored(w.slot, tier, keys[0], False)  # new blocks have no children to settle
            w.counts[tier] += n
            return
        if parent_held and not closure.loose and len(set(block_hashes)) == n:
            known = list(map(py.get, block_hashes))
            fresh = known != keys
            if not fresh or known.count(None) == n:
                added = k.store_held_elsewhere(t.r, t.m, p.pm, p.ph, p.pa, karr, word, bit, slot_bits, fresh)
                if added >= 0:
                    if fresh:
                        py.update(zip(block_hashes, keys, strict=True))
                    closure.link_chain(keys, karr)
                    w.counts[tier] += added
                    return
        self._insert_each(w, block_hashes, keys, tier, parent, parent_held)

    def remove(self, w: WorkerState, block_hashes: list[EngineHash], tier: StorageTier) -> int:
        """Takes the worker's ``tier`` bit off the blocks its engine hashes name (a ``BlockRemoved``), or drops them
        from its held orphans; returns how many it holds in neither place. One kernel call unless window KV is
        indexed. O(blocks + their children)."""
        if self._win:
            return self._remove_each(w, block_hashes, tier)
        t, k, closure = self._t, self._k, self._c
        word, bit, slot_bits = self._where(w.slot, tier)
        n = len(block_hashes)
        p = t.pool
        e = w.hashes
        ehs = e.int64s(block_hashes)
        if len(self._removal[0]) < n:
            self._removal = self._removal_outputs(n)
        out, kids, branched, karr, res = self._removal
        if ehs is not None:
            while not k.remove(t.r, t.m, p.pm, p.ph, p.pa, karr, word, bit, slot_bits, e.r, e.m, ehs, True, n, out,
                               kids, branched, res):
                self._pool_room(w, n)  # then again, with the grown arrays
        else:
            py = e.demote()
            named = list(map(py.get, block_hashes))
            out[:n] = [x is not None for x in named]
            karr[:n] = [x or 0 for x in named]
            while not k.remove(t.r, t.m, p.pm, p.ph, p.pa, karr, word, bit, slot_bits, _NONE_E, _NONE_M, _NONE, False,
                               n, out, kids, branched, res):
                self._pool_room(w, n)
            for eh, s in zip(block_hashes, out[:n].tolist(), strict=True):
                if s >= 2:
                    del py[eh]
        nk, nb, nheld, _, nsets = res.tolist()
        unknown = 0
        out, karr = out[:n], karr[:n]
        if nheld < n:
            orphans = w.orphans
            for j in np.flatnonzero(out == 0).tolist():
                if not (orphans and orphans.remove(block_hashes[j], tier)):
                    unknown += 1
        if nheld:
            # The blocks that lost the tier matter only to the worker's loose blocks on it, where there are any.
            gone: list[BlockKey] = ((karr if nheld == n else karr[out != 0]).tolist()
                                    if closure.loose.get((w.slot, tier)) else [])
            w.counts[tier] -= nheld

            def holds(children: list[BlockKey]) -> Any:
                return k.has_bit(t.r, p.pm, np.array(children, np.uint64), word, bit)
            closure.removed_found(w.slot, tier, gone, kids[:nk].tolist(), branched[:nb].tolist(), holds)
            if nsets:
                closure.unbranch(karr[out == 3].tolist())  # after their children were looked at
        return unknown

    def clear_slot(self, w: WorkerState) -> None:
        """Drops every block of the worker: its bits, window KV, loose blocks and engine hashes (the caller keeps
        what else it needs of them first), in one kernel call. O(blocks of the worker)."""
        t, closure = self._t, self._c
        t.widen(w.slot + 1)
        e = w.hashes
        karr = e.key_array()
        word, _, slot_bits = _bits(w.slot, 0)
        p = t.pool
        p.reserve(len(karr))
        dead = self._k.clear_slot(t.r, t.m, p.pm, p.ph, p.pa, karr, word, slot_bits)
        closure.unbranch(karr[dead == 1].tolist())
        if self._win:
            self._win.drop_slot(w.slot, karr.tolist())
        closure.clear_slot(w.slot, TIERS)
        e.clear()
        w.counts = [0] * TIERS

    def _insert_each(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey], tier: StorageTier,
                     parent: BlockKey | None, parent_held: bool) -> None:
        """:meth:`insert` block by block, for what its bulk cases leave: aliases, engine hashes reused for other
        content, repeats, loose tiers. Reads ``masks`` and the worker's hashes only through the mapping
        interface, one lookup at a time. O(blocks)."""
        hashes, masks, closure = w.hashes, self.masks, self.closure
        bit = 1 << (TIERS * w.slot + tier)
        slot_bits = SLOT_MASK << (TIERS * w.slot)
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
                m = masks.get(key, 0)
                if m & slot_bits:  # the new content has a name here already: keep it (the dict stays injective)
                    del hashes[eh]
                    w.stats.aliases += 1
                else:
                    hashes[eh] = key
                below = prev if prev is not None else parent
                parent_held = below is None or bool(masks.get(below, 0) & bit)  # the dropped block may be it
            if prev is not None and linked(prev) != key:  # (most stores here repeat a link already made)
                link(prev, key)
            if not m & bit:
                m |= bit
                masks[key] = m
                added += 1
                if not parent_held or closure.loose:
                    closure.stored(w.slot, tier, key, parent_held)
            prev, parent_held = key, True
        w.counts[tier] += added

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
            self.masks[key] = m
        for t in held:
            self.closure.removed(w.slot, t, key, 1 << (shift + t), self.masks)
        if not m:  # after its children were looked at (the table keeps its links in its row)
            del self.masks[key]
            self.closure.died(key)

    def _remove_each(self, w: WorkerState, block_hashes: list[EngineHash], tier: StorageTier) -> int:
        """:meth:`remove` block by block, through the table's mapping interface: for removals while window KV is
        indexed (the removal kernel does not drop window bits). O(blocks + their children)."""
        shift = TIERS * w.slot
        bit = 1 << (shift + tier)
        masks, hashes = self.masks, w.hashes
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
                masks[key] = m
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
        holding the bit, then the dead ones go with their links (the table keeps the links in the rows).
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
