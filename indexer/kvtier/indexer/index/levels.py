"""A query's per-worker tier depths: how many leading blocks of its chain of keys each worker holds per tier.

The depths are cumulative levels (as :class:`kvtier.wire.overlap.TierOverlap`): ``device`` counts the leading
blocks all on device, ``host`` those all on device or host, ``disk`` adds the worker's disk, ``external`` adds
the shared pool as well. They are read off the index's compiled masks (:mod:`kvtier.indexer.index.masklayout`,
:class:`kvtier.indexer.index.keytable.KeyTable`), in one of two ways:

* while every worker's tiers are prefix-closed (:mod:`kvtier.indexer.index.closure`), each tier bit can only drop
  along the chain, so the masks form runs of equal values whose ends a binary search finds with
  O(runs * log(blocks)) lookups (``tablekernel.runs_by_search``; past ``MAX_RUNS`` runs a scan is cheaper);
* otherwise one lookup per leading block (``tablekernel.leading_ids``).

Either way one more kernel call turns the runs into levels (``tablekernel.run_levels``). Only slots with a
non-zero depth get an entry, so a query's cost grows with the workers that hold its prefix, not with the cluster.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import KeyTable
from kvtier.indexer.index.masklayout import SLOTS_PER_WORD, TIERS
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import TierOverlap

MAX_RUNS = 64  # runs of equal masks searched for, up to this many; past it a scan

#: Per worker (the stream owning a slot), its overlap: one object per distinct depths, shared by the workers that
#: have them (workers holding the same prefix, as a system prompt: building an overlap costs more than the lookups
#: that found it).
Overlaps = dict[StreamId, TierOverlap]


class DepthFinder:
    """Reads per-slot depths off the masks of one index. Never changes them: the search or the scan is one kernel
    call over the query's keys as an array, and the levels another over the runs of mask ids, where Python decodes
    the bits of every slot holding a prefix."""

    __slots__ = ("_owned", "_rows", "_runs", "_table")

    def __init__(self, table: KeyTable, owned: dict[int, StreamId]) -> None:
        self._table = table  # the index's masks (the same object, kept current by the index)
        self._owned = owned  # the index's slot -> stream dict: bits of slots not in it are ignored
        # The kernels' outputs, kept from query to query (allocating them cost a query more than using them).
        self._runs = np.empty(MAX_RUNS + 1, np.int64), np.empty(MAX_RUNS + 1, np.int64)  # starts, mask ids
        self._rows = self._outputs(SLOTS_PER_WORD)  # run_levels' depths, holders, groups, distinct depths

    @staticmethod
    def _outputs(rows: int) -> tuple[Any, Any, Any, Any]:
        return (np.zeros((rows, TIERS), np.int64), np.empty(rows, np.int64), np.empty(rows, np.int64),
                np.empty((rows, TIERS), np.int64))

    def overlaps(self, keys: list[BlockKey], closed: bool, slots: int) -> tuple[Overlaps, int]:
        """The overlaps of ``keys`` per worker holding some, and how many leading blocks the shared pool holds;
        ``closed``: every worker's tiers are prefix-closed (a binary search is sound); ``slots``: slots ever
        handed out. O(r log m) lookups for the r runs of equal masks over the m leading blocks anybody holds when
        ``closed``, else O(m); then O(r * words + slots * distinct overlaps)."""
        t = self._table
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

    def runs_by_search(self, keys: list[BlockKey]) -> tuple[list[tuple[int, int]], int] | None:
        """The runs of equal masks over the leading blocks anybody holds, as ``(mask, first position)``, and their
        length, as the binary search finds them; ``None`` past ``MAX_RUNS`` runs. Sound only while every worker's
        tiers are prefix-closed (then a block with its run's mask proves every block between them has it too).
        For checks and tools: :meth:`overlaps` reads the same runs without leaving the kernels. O(runs * log
        blocks) lookups."""
        t = self._table
        starts, ids = self._runs
        runs = t.k.runs_by_search(t.r, t.array(keys), MAX_RUNS, starts, ids)
        if runs < 0:
            return None
        firsts = starts[:runs].tolist()
        return [(t[keys[a]], a) for a in firsts], int(starts[runs])

    def _levels_of_runs(self, ids: Any, starts: Any, runs: int, n: int, slots: int) -> tuple[Overlaps, int]:
        """The overlaps and the pool's leading blocks of ``runs`` runs of mask ids over ``n`` blocks. O(runs * words +
        slots * distinct overlaps)."""
        if not n:
            return {}, 0
        t = self._table
        rows = -(-slots // SLOTS_PER_WORD) * SLOTS_PER_WORD
        if len(self._rows[0]) < rows:
            self._rows = self._outputs(rows)
        out, held, groups, uniq = self._rows
        pool_run, count, distinct = t.k.run_levels(t.pool.pm, ids, starts, runs, n, slots, out, held, groups, uniq)
        made = [TierOverlap(*levels) for levels in uniq[:distinct].tolist()]
        owned = self._owned
        return {s: made[g] for slot, g in zip(held[:count].tolist(), groups[:count].tolist(), strict=True)
                if (s := owned.get(slot)) is not None}, pool_run
