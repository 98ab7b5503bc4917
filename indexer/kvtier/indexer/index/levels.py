"""A query's per-worker tier depths: how many leading blocks of its chain of keys each worker holds per tier.

The depths are cumulative levels (as :class:`kvtier.wire.overlap.TierOverlap`): ``device`` counts the leading
blocks all on device, ``host`` those all on device or host, ``disk`` adds the worker's disk, ``external`` adds
the shared pool as well. They are read off the index's masks (:mod:`kvtier.indexer.index.masklayout`), in one of two
ways:

* while every worker's tiers are prefix-closed (:mod:`kvtier.indexer.index.closure`), each tier bit can only drop
  along the chain, so the masks form runs of equal values whose ends a binary search finds with
  O(runs * log(blocks)) lookups;
* otherwise one lookup per leading block, in C, then the same walk over the runs it finds, or numpy past
  ``MAX_RUNS`` runs.

Only slots with a non-zero depth get an entry, so a query's cost grows with the workers that hold its prefix,
not with the cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import compress, count, islice, takewhile
from operator import ne
from typing import Any, cast

import numpy as np

from kvtier.indexer.index.closure import MaskMap
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import KeyTable
from kvtier.indexer.index.masklayout import DEV, EXT, M64, SLOTS_PER_WORD, TIERS, dev_all
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import TierOverlap
from kvtier.wire.protocol import StorageTier

MAX_RUNS = 64  # runs of equal masks walked in Python up to this many, else numpy

#: Slot -> its depth per level (device, host, disk, external); slots at depth 0 everywhere are left out.
Depths = dict[int, list[int]]
#: The same per worker (the stream owning the slot), as overlaps: one object per distinct depths, shared by the
#: workers that have them (workers holding the same prefix, as a system prompt: building an overlap costs more than
#: the lookups that found it).
Overlaps = dict[StreamId, TierOverlap]


def _shared(depths: Depths, owned: dict[int, StreamId]) -> Overlaps:
    """``depths`` (of owned slots) as :data:`Overlaps`. O(slots)."""
    made: dict[tuple[int, ...], TierOverlap] = {}
    out: Overlaps = {}
    for slot, d in depths.items():
        levels = tuple(d)
        ov = made.get(levels)
        if ov is None:
            ov = made[levels] = TierOverlap(*levels)
        out[owned[slot]] = ov
    return out


class DepthFinder:
    """Reads per-slot depths off the masks of one index. Never changes them."""

    __slots__ = ("_dev_all", "_dev_all_slots", "_masks", "_owned")

    def __init__(self, masks: MaskMap, owned: dict[int, StreamId]) -> None:
        self._masks = masks  # the index's key -> mask dict (the same object, kept current by the index)
        self._owned = owned  # the index's slot -> stream dict: bits of slots not in it are ignored
        self._dev_all = 0  # the device bit of every slot below _dev_all_slots (see _device_bits)
        self._dev_all_slots = 0

    def overlaps(self, keys: list[BlockKey], closed: bool, slots: int) -> tuple[Overlaps, int]:
        """The overlaps of ``keys`` per worker holding some, and how many leading blocks the shared pool holds;
        ``closed``: every worker's
        tiers are prefix-closed (a binary search is sound); ``slots``: slots ever handed out. O(r log m) lookups
        for the r runs of equal masks over the m leading blocks anybody holds when ``closed``, else O(m)."""
        depths: Depths = {}
        pool = 0
        searched = self.runs_by_search(keys) if closed else None
        if searched is not None:
            runs, n = searched
            if n:
                pool = self._levels_by_runs(runs, n, depths, slots)
            return _shared(depths, self._owned), pool
        ms = self.leading_masks(keys)
        n = len(ms)
        if n:
            # Where each run of equal masks starts (a block whose mask differs from the one before it).
            starts = [0, *compress(count(1), map(ne, ms, islice(ms, 1, None)))]
            if len(starts) <= MAX_RUNS:
                pool = self._levels_by_runs([(ms[a], a) for a in starts], n, depths, slots)
            else:
                pool = self._levels(ms, n, depths, slots)
        return _shared(depths, self._owned), pool

    def leading_masks(self, keys: list[BlockKey]) -> list[int]:
        """The masks of the leading blocks anybody holds: a lookup per block, in C (a mask is never 0, a
        missing key gives None). O(leading blocks)."""
        get: Callable[[BlockKey], int | None] = self._masks.get
        return cast(list[int], list(takewhile(bool, map(get, keys))))

    def runs_by_search(self, keys: list[BlockKey]) -> tuple[list[tuple[int, int]], int] | None:
        """The runs of equal masks over the leading blocks anybody holds, as ``(mask, first position)``, and
        their length, found by binary search; ``None`` past ``MAX_RUNS`` runs (a scan is cheaper then).

        Sound only while every worker's tiers are prefix-closed: a block with its run's mask then proves every
        block between them has it too. O(runs * log(blocks)) lookups.
        """
        get: Callable[[BlockKey], int | None] = self._masks.get
        total = len(keys)
        runs: list[tuple[int, int]] = []
        pos = 0
        m = get(keys[0]) if total else None
        while m:
            if len(runs) == MAX_RUNS:
                return None
            lo, hi = pos + 1, total  # keys[pos:lo] have mask m; keys[hi:] do not
            while lo < hi:
                mid = (lo + hi) >> 1
                if get(keys[mid]) == m:
                    lo = mid + 1
                else:
                    hi = mid
            runs.append((m, pos))
            pos = lo
            m = get(keys[pos]) if pos < total else None
        return runs, pos

    def _device_bits(self, slots: int) -> int:
        """The device bit of every slot below ``slots`` (cached until more slots are handed out). O(1) amortised."""
        if self._dev_all_slots != slots:
            self._dev_all = dev_all(slots)
            self._dev_all_slots = slots
        return self._dev_all

    def _levels_by_runs(self, runs: list[tuple[int, int]], n: int, depths: Depths, slots: int) -> int:
        """Cumulative tier levels over runs of equal masks, given as ``(mask, first position)``, on Python ints
        (any number of workers). Within a run the mask is constant, so a slot's bit can only drop at a run's
        start. Returns the shared pool's leading blocks. O(runs + set bits)."""
        every = self._device_bits(slots)
        alive = [every] * TIERS
        pool_run = -1
        for m, pos in runs:
            a1 = m | (m >> 1)
            disk = (a1 | (m >> 2)) & every
            pooled = bool(m & (every << StorageTier.EXTERNAL))
            if not pooled and pool_run < 0:
                pool_run = pos
            drops: dict[int, list[int]] = {}  # slots' device bits dropped here -> the levels they drop at
            for lvl, held in enumerate((m & every, a1 & every, disk, every if pooled else disk)):
                dropped = alive[lvl] & ~held
                if dropped:
                    alive[lvl] &= held
                    drops.setdefault(dropped, []).append(lvl)
            for dropped, lvls in drops.items():  # one decode of the bits for levels that drop together
                self._record(dropped, pos, lvls, depths)
        ends: dict[int, list[int]] = {}
        for lvl in range(TIERS):
            ends.setdefault(alive[lvl], []).append(lvl)
        for bits, lvls in ends.items():
            self._record(bits, n, lvls, depths)
        return n if pool_run < 0 else pool_run

    def _record(self, bits: int, depth: int, lvls: Sequence[int], depths: Depths, base: int = 0) -> None:
        """Sets ``depth`` at each level of ``lvls`` for every owned slot whose device bit is in ``bits`` (slots
        numbered from ``base``, the first slot of the mask word). Depth 0 is every slot's default: nothing to
        record. O(set bits * levels): the bits are decoded once for all the levels (where many workers share
        a prefix, as a system prompt, this loop is most of a query)."""
        if not depth:
            return
        owned = self._owned
        # The set bits, found in the binary digits (str.find runs in C): peeling the lowest bit off a mask of
        # hundreds of workers would allocate a new big int twice per bit.
        digits = bin(bits)
        last = len(digits) - 1  # the position of bit 0
        i = digits.find("1", 2)
        while i >= 0:
            slot = base + (last - i) // TIERS
            if slot in owned:
                d = depths.get(slot)
                if d is None:
                    d = depths[slot] = [0] * TIERS
                for lvl in lvls:
                    d[lvl] = depth
            i = digits.find("1", i + 1)

    def _levels(self, ms: list[int], n: int, depths: Depths, slots: int) -> int:
        """:meth:`_levels_by_runs` for many runs, vectorised over 64-bit words of the masks. O(n * words)."""
        words = max(1, -(-slots // SLOTS_PER_WORD))
        if words == 1:
            arrs = [np.array(ms, dtype=np.uint64)]
        else:
            arrs = [np.fromiter(((m >> (64 * g)) & M64 for m in ms), dtype=np.uint64, count=n)
                    for g in range(words)]
        return self._levels_words(arrs, n, depths)

    def _levels_words(self, arrs: list[np.ndarray[Any, Any]], n: int, depths: Depths) -> int:
        """:meth:`_levels` on the masks split into 64-bit words (``arrs[g]``: word ``g`` of every mask).
        O(n * words)."""
        ext_bits = np.uint64(EXT)
        pool = np.zeros(n, dtype=bool)
        for a in arrs:
            pool |= (a & ext_bits) != 0
        pool_run = n if pool.all() else int(np.argmin(pool))
        dev = np.uint64(DEV)
        for g, a in enumerate(arrs):
            a1 = a | (a >> np.uint64(1))
            levels = np.empty((TIERS, n), dtype=np.uint64)
            np.bitwise_and(a, dev, out=levels[0])
            np.bitwise_and(a1, dev, out=levels[1])
            np.bitwise_and(a1 | (a >> np.uint64(2)), dev, out=levels[2])
            np.bitwise_or(levels[2], np.where(pool, dev, np.uint64(0)), out=levels[3])
            acc = np.bitwise_and.accumulate(levels, axis=1)
            for lvl in range(TIERS):
                self._depths_from_run(acc[lvl], n, g, lvl, depths)
        return pool_run

    def _depths_from_run(self, row: np.ndarray[Any, Any], n: int, word: int, lvl: int, depths: Depths) -> None:
        # `row` is a running AND, so each slot's bit is set on a prefix: find where each drops.
        base = word * SLOTS_PER_WORD
        change = np.flatnonzero(row[1:] != row[:-1])
        before = row[change].tolist()
        after = row[change + 1].tolist()
        for pos, b, a in zip(change.tolist(), before, after, strict=True):
            self._record(b & ~a, pos + 1, (lvl,), depths, base)
        self._record(int(row[-1]), n, (lvl,), depths, base)


class TableDepthFinder(DepthFinder):
    """:class:`DepthFinder` over the compiled table (:class:`kvtier.indexer.index.keytable.KeyTable`): the search or the
    scan is one kernel call over the query's keys as an array, and the levels another over the runs of mask ids
    (:func:`kvtier.indexer.index.tablekernel.run_levels`), where Python decoded the bits of every slot holding a
    prefix."""

    __slots__ = ("_rows", "_runs")

    def __init__(self, masks: MaskMap, owned: dict[int, StreamId]) -> None:
        super().__init__(masks, owned)
        # The kernels' outputs, kept from query to query (allocating them cost a query more than using them).
        self._runs = np.empty(MAX_RUNS + 1, np.int64), np.empty(MAX_RUNS + 1, np.int64)  # starts, mask ids
        self._rows = self._outputs(SLOTS_PER_WORD)  # run_levels' depths, holders, groups, distinct depths

    @staticmethod
    def _outputs(rows: int) -> tuple[Any, Any, Any, Any]:
        return (np.zeros((rows, TIERS), np.int64), np.empty(rows, np.int64), np.empty(rows, np.int64),
                np.empty((rows, TIERS), np.int64))

    def overlaps(self, keys: list[BlockKey], closed: bool, slots: int) -> tuple[Overlaps, int]:
        """:meth:`DepthFinder.overlaps`; the same complexity, in compiled lookups."""
        t = cast(KeyTable, self._masks)
        k = t.k
        karr = t.array(keys)
        if closed:
            starts, ids = self._runs
            runs = k.runs_by_search(t.r, karr, MAX_RUNS, starts, ids)
            if runs >= 0:
                return self._levels_of_runs(ids, starts, runs, int(starts[runs]), slots)
        ids = k.leading_ids(t.r, karr)  # one id per distinct mask (kvtier.indexer.index.keytable.MaskPool)
        n = len(ids)
        if not n:
            return {}, 0
        starts = np.concatenate((np.zeros(1, np.int64), np.flatnonzero(ids[1:] != ids[:-1]) + 1))
        return self._levels_of_runs(ids[starts], starts, len(starts), n, slots)

    def _levels_of_runs(self, ids: Any, starts: Any, runs: int, n: int, slots: int) -> tuple[Overlaps, int]:
        """The overlaps and the pool's leading blocks of ``runs`` runs of mask ids over ``n`` blocks. O(runs * words +
        slots * distinct overlaps)."""
        if not n:
            return {}, 0
        t = cast(KeyTable, self._masks)
        rows = -(-slots // SLOTS_PER_WORD) * SLOTS_PER_WORD
        if len(self._rows[0]) < rows:
            self._rows = self._outputs(rows)
        out, held, groups, uniq = self._rows
        pool_run, count, distinct = t.k.run_levels(t.pool.pm, ids, starts, runs, n, slots, out, held, groups, uniq)
        made = [TierOverlap(*levels) for levels in uniq[:distinct].tolist()]
        owned = self._owned
        return {s: made[g] for slot, g in zip(held[:count].tolist(), groups[:count].tolist(), strict=True)
                if (s := owned.get(slot)) is not None}, pool_run
