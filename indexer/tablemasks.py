"""The index's block masks in compiled tables: :class:`BlockMasks`' bulk cases as one kernel call per event.

:class:`TableMasks` keeps the masks in a :class:`kvtier.indexer.keytable.KeyTable` and each worker's engine hashes
in an :class:`kvtier.indexer.keytable.EngineHashes`; the cases every event of a radix engine takes run in
:mod:`kvtier.indexer.tablekernel`:

* a chain of new blocks under new engine hashes (most stores);
* a chain the worker names already, or new to it but held by others (backups, load-backs, prefetches, a
  conversation served twice), while every tier is prefix-closed;
* a removal that does not touch window KV, whoever else holds the blocks.

What is left (aliases, engine hashes reused for other content, repeats, stores into loose tiers, window KV)
goes block by block through :class:`BlockMasks`' own code, which reads both tables as mappings. Either way the
results are those of :class:`BlockMasks` on dicts, which stays the implementation where numba does not run.
The closure links are compiled too (:class:`kvtier.indexer.tableclosure.TableClosure`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.indexer.blockmasks import BlockMasks
from kvtier.indexer.keys import BlockKey
from kvtier.indexer.keytable import EngineHashes, KeyTable
from kvtier.indexer.masklayout import SLOT_MASK, SLOTS_PER_WORD, TIERS
from kvtier.indexer.tableclosure import TableClosure
from kvtier.indexer.windowkv import WindowKV
from kvtier.indexer.workerstate import WorkerState
from kvtier.wire.protocol import EngineHash, StorageTier

_NONE = np.zeros(1, np.uint64)  # the engine-hash arguments of a kernel call for a worker whose hashes are a dict
_NONE_U = np.zeros(1, np.uint8)
_NONE_V = np.zeros((1, 1), np.uint64)
_NONE_M = np.zeros(1, np.int64)


def _bits(slot: int, tier: int) -> tuple[int, np.uint64, np.uint64]:
    """The mask word of ``slot``, its ``tier`` bit there, and all its bits there. O(1)."""
    word, pos = divmod(slot, SLOTS_PER_WORD)
    shift = TIERS * pos
    return word, np.uint64(1 << (shift + tier)), np.uint64(SLOT_MASK << shift)


class TableMasks(BlockMasks):
    """:class:`BlockMasks` over compiled tables. Workers' ``hashes`` must be :class:`EngineHashes`."""

    __slots__ = ("_c", "_k", "_t")

    def __init__(self, table: KeyTable, win: WindowKV) -> None:
        super().__init__(table, win)
        self._t = table  # the masks (the same object as self.masks)
        self._k: Any = table.k  # the kernel module
        self._c = self.closure = TableClosure(table)  # the links in a compiled table too

    def share(self, m: int) -> int:
        """Rows hold their mask's words: nothing to share. O(1)."""
        return m

    def _e(self, w: WorkerState, n: int) -> tuple[EngineHashes, Any, Any, Any, Any]:
        """The worker's engine-hash table and its arrays, with room for ``n`` more. O(1) amortised."""
        e = w.hashes
        assert isinstance(e, EngineHashes), f"worker {w.stream}: engine hashes in a {type(e).__name__}"
        if e.py is not None:
            return e, _NONE, _NONE_U, _NONE_V, _NONE_M
        e.reserve(n)
        return e, e.tk, e.tu, e.tv, e.meta

    def insert(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey], tier: StorageTier,
               parent: BlockKey | None) -> None:
        """:meth:`BlockMasks.insert`, its bulk cases compiled. O(blocks)."""
        t, k, closure = self._t, self._k, self._c
        t.widen(w.slot + 1)
        word, bit, _ = _bits(w.slot, tier)
        if parent is None:
            parent_held = True
        else:
            state = k.bit_state(t.tk, t.tu, t.tv, np.uint64(parent), word, bit)
            parent_held = state == 1
            if state >= 0:  # a link under a block nobody holds would outlive it (the child is loose anyway)
                closure.link(parent, keys[0], t)
        n = len(keys)
        t.reserve(n)
        karr = t.array(keys)
        ehs = w.hashes.int64s(block_hashes) if isinstance(w.hashes, EngineHashes) else None
        e, ek, eu, ev, em = self._e(w, n)
        py = e.py
        fresh = ehs is not None or (py is not None and len(set(block_hashes)) == n
                                    and not any(map(py.__contains__, block_hashes)))
        if fresh and k.store_new(t.tk, t.tu, t.tv, t.meta, karr, word, bit, ek, eu, ev, em,
                                 _NONE if ehs is None else ehs, ehs is not None):
            if py is not None:
                py.update(zip(block_hashes, keys, strict=True))
            closure.link_chain(keys, karr)
            if not parent_held:
                closure.stored(w.slot, tier, keys[0], False)  # new blocks have no children to settle
            w.counts[tier] += n
            return
        if parent_held and not closure.loose:
            added = self._held_elsewhere(w, block_hashes, keys, karr, ehs, tier)
            if added >= 0:
                w.counts[tier] += added
                return
        if ehs is None or not self._store_each(w, keys, karr, ehs, tier, parent_held):
            self._insert_each(w, block_hashes, keys, tier, parent, parent_held)

    def _store_each(self, w: WorkerState, keys: list[BlockKey], karr: Any, ehs: Any, tier: StorageTier,
                    parent_held: bool) -> bool:
        """:meth:`BlockMasks._insert_each` in one kernel call, for stores whose engine hashes are distinct and
        name no other block (a chain that extends what the worker holds, aliases); False, with nothing done,
        for the rest. O(blocks)."""
        t, k, closure = self._t, self._k, self.closure
        word, bit, _ = _bits(w.slot, tier)
        slot_word, _, slot_bits = _bits(w.slot, 0)
        _, ek, eu, ev, em = self._e(w, len(keys))
        newly = np.empty(len(keys), np.uint8)
        counts = np.zeros(2, np.int64)
        if not k.store_each(t.tk, t.tu, t.tv, t.meta, karr, word, bit, slot_word, slot_bits, ek, eu, ev, em, ehs,
                            newly, counts):
            return False
        self._c.link_chain(keys, karr)
        if not parent_held or closure.loose:
            for j in np.flatnonzero(newly).tolist():  # in chain order, as the bits were set
                if (j == 0 and not parent_held) or closure.loose:
                    closure.stored(w.slot, tier, keys[j], parent_held or j > 0)
        added, aliases = counts.tolist()
        w.counts[tier] += added
        w.stats.aliases += aliases
        return True

    def _held_elsewhere(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey], karr: Any,
                        ehs: Any, tier: StorageTier) -> int:
        """:meth:`BlockMasks._insert_held_elsewhere` in one kernel call: how many blocks gained the bit, or -1
        with nothing done. O(blocks)."""
        t, k = self._t, self._k
        word, bit, _ = _bits(w.slot, tier)
        slot_word, _, slot_bits = _bits(w.slot, 0)
        e, ek, eu, ev, em = self._e(w, len(keys))
        py = e.py
        slot_free = False
        if py is not None:
            if len(set(block_hashes)) < len(block_hashes):
                return -1
            known = list(map(py.get, block_hashes))
            if known != keys:
                if known.count(None) != len(known):
                    return -1
                slot_free = True
        added: int = k.store_held_elsewhere(t.tk, t.tu, t.tv, t.meta, karr, word, bit, slot_word, slot_bits,
                                            ek, eu, ev, em, _NONE if ehs is None else ehs, ehs is not None,
                                            slot_free)
        if added < 0:
            return -1
        if slot_free and py is not None:
            py.update(zip(block_hashes, keys, strict=True))
        self._c.link_chain(keys, karr)
        return added

    def remove(self, w: WorkerState, block_hashes: list[EngineHash], tier: StorageTier) -> int:
        """:meth:`BlockMasks.remove`, in one kernel call unless window KV is indexed. O(blocks + their
        children)."""
        if self._win:
            return super().remove(w, block_hashes, tier)
        t, k, closure = self._t, self._k, self.closure
        t.widen(w.slot + 1)
        word, bit, slot_bits = _bits(w.slot, tier)
        n = len(block_hashes)
        e = w.hashes
        assert isinstance(e, EngineHashes), f"worker {w.stream}: engine hashes in a {type(e).__name__}"
        ehs = e.int64s(block_hashes)
        out = np.empty(n, np.uint8)
        if ehs is not None:
            karr = k.remove(t.tk, t.tu, t.tv, t.meta, np.empty(n, np.uint64), word, bit, word, slot_bits,
                            e.tk, e.tu, e.tv, e.meta, ehs, True, out)
        else:
            py = e.demote()
            named = list(map(py.get, block_hashes))
            out[:] = [x is not None for x in named]
            karr = k.remove(t.tk, t.tu, t.tv, t.meta, np.array([x or 0 for x in named], np.uint64), word, bit,
                            word, slot_bits, _NONE, _NONE_U, _NONE_V, _NONE_M, _NONE, False, out)
            for eh, s in zip(block_hashes, out.tolist(), strict=True):
                if s >= 2:
                    del py[eh]
        unknown = 0
        held = out.astype(bool)
        if not held.all():
            orphans = w.orphans
            for j in np.flatnonzero(~held).tolist():
                if not (orphans and orphans.remove(block_hashes[j], tier)):
                    unknown += 1
        gone: list[BlockKey] = karr[held].tolist()
        w.counts[tier] -= len(gone)
        if gone:
            def holds(kids: list[BlockKey]) -> Any:
                return k.has_bit(t.tk, t.tu, t.tv, np.array(kids, np.uint64), word, bit)
            self._c.removed_bulk(w.slot, tier, gone, karr[held], word, bit, holds)
            closure.died_all(karr[out == 3].tolist())  # after their children were looked at
        return unknown

    def clear_slot(self, w: WorkerState) -> None:
        """:meth:`BlockMasks.clear_slot`, in one kernel call. O(blocks of the worker)."""
        t = self._t
        t.widen(w.slot + 1)
        e = w.hashes
        assert isinstance(e, EngineHashes), f"worker {w.stream}: engine hashes in a {type(e).__name__}"
        karr = e.key_array()
        word, _, slot_bits = _bits(w.slot, 0)
        dead = self._k.clear_slot(t.tk, t.tu, t.tv, t.meta, karr, word, slot_bits)
        self.closure.died_all(karr[dead == 1].tolist())
        if self._win:
            self._win.drop_slot(w.slot, karr.tolist())
        self.closure.clear_slot(w.slot, TIERS)
        e.clear()
        w.counts = [0] * TIERS
