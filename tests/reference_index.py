"""A deliberately naive model of the tiered index, to check the fast one against."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.indexer.index.keys import BlockKey, block_keys, chain_keys, namespace
from kvtier.wire import AllBlocksCleared, BlockRemoved, BlockStored, Event, StorageTier, parse_medium
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import OverlapScores, TierOverlap

LEVELS = [
    {StorageTier.DEVICE},
    {StorageTier.DEVICE, StorageTier.HOST},
    {StorageTier.DEVICE, StorageTier.HOST, StorageTier.DISK},
]


@dataclass
class RefWorker:
    names: dict[object, BlockKey] = field(default_factory=dict)  # engine hash -> key
    tiers: dict[BlockKey, set[StorageTier]] = field(default_factory=dict)  # key -> tiers held
    # stores whose parent was unknown: (event, tier, per-block still-present flags)
    orphans: list[tuple[BlockStored, StorageTier, list[bool]]] = field(default_factory=list)
    # engine hash -> key of blocks dropped when events were lost for good: parents still, held no more
    ghosts: dict[object, BlockKey] = field(default_factory=dict)


@dataclass
class ReferenceIndex:
    block_size: int
    workers: dict[StreamId, RefWorker] = field(default_factory=dict)

    def apply(self, stream: StreamId, ev: Event) -> str:
        w = self.workers.setdefault(stream, RefWorker())
        if isinstance(ev, AllBlocksCleared):
            self.workers[stream] = RefWorker()
            return "applied"
        try:
            tier = parse_medium(ev.medium)
        except ValueError:
            return "rejected"
        if isinstance(ev, BlockRemoved):
            for eh in ev.block_hashes:
                key = w.names.get(eh)
                if key is not None and tier in w.tiers[key]:
                    w.tiers[key].discard(tier)
                    if not w.tiers[key]:
                        del w.tiers[key]
                        del w.names[eh]
                    continue
                for o_ev, o_tier, present in w.orphans:
                    if o_tier is tier:
                        for i, h in enumerate(o_ev.block_hashes):
                            if h == eh:
                                present[i] = False
            return "applied"
        assert isinstance(ev, BlockStored)
        n = len(ev.block_hashes)
        if ev.block_size != self.block_size or n == 0 or ev.num_tokens != n * ev.block_size:
            return "rejected"
        if ev.parent_block_hash is None:
            keys = chain_keys(ev.token_ids, ev.block_size, None, namespace(ev.lora_name, ev.cache_salt))
        elif ev.parent_block_hash in w.names:
            keys = chain_keys(ev.token_ids, ev.block_size, w.names[ev.parent_block_hash])
        elif ev.parent_block_hash in w.ghosts:
            keys = chain_keys(ev.token_ids, ev.block_size, w.ghosts[ev.parent_block_hash])
        else:
            w.orphans.append((ev, tier, [True] * n))
            return "orphaned"
        for eh, key in zip(ev.block_hashes, keys, strict=True):
            w.names[eh] = key
            w.tiers.setdefault(key, set()).add(tier)
        # Graft held orphans whose parent this store (or a graft) just named, until none is left.
        known = dict(zip(ev.block_hashes, keys, strict=True))
        progress = True
        while progress:
            progress = False
            for o in list(w.orphans):
                o_ev, o_tier, present = o
                if o_ev.parent_block_hash in known:
                    w.orphans.remove(o)
                    o_keys = chain_keys(o_ev.token_ids, o_ev.block_size, known[o_ev.parent_block_hash])
                    for eh, key, p in zip(o_ev.block_hashes, o_keys, present, strict=True):
                        known[eh] = key
                        if p:
                            w.names[eh] = key
                            w.tiers.setdefault(key, set()).add(o_tier)
                    progress = True
        return "applied"

    def clear_worker(self, stream: StreamId, partial: bool) -> None:
        """Drops the worker's blocks and orphans; ``partial``: events were lost for good, and the dropped
        blocks' names are remembered as parents of stores that extend them (ghosts)."""
        old = self.workers.get(stream, RefWorker())
        self.workers[stream] = RefWorker(ghosts={**old.ghosts, **old.names} if partial else {})

    def remove_worker(self, stream: StreamId) -> None:
        self.workers.pop(stream, None)

    def find_matches(self, token_ids: list[int]) -> OverlapScores:
        keys = block_keys(token_ids, self.block_size)
        pool = {k for w in self.workers.values() for k, ts in w.tiers.items() if StorageTier.EXTERNAL in ts}
        out = OverlapScores(total_blocks=len(keys))
        out.shared_pool = _run(keys, lambda k: k in pool)
        for stream, w in self.workers.items():
            out.workers[stream] = _worker_overlap(w, keys, pool)
        return out


def _worker_overlap(w: RefWorker, keys: list[BlockKey], pool: set[BlockKey]) -> TierOverlap:
    def on(levels: set[StorageTier], k: BlockKey) -> bool:
        return bool(w.tiers.get(k, set()) & levels)

    d = [_run(keys, lambda k, lv=lv: on(lv, k)) for lv in LEVELS]  # type: ignore[misc]
    ext = _run(keys, lambda k: on(LEVELS[2], k) or k in pool)
    return TierOverlap(d[0], d[1], d[2], ext)


def _run(keys: list[BlockKey], held: object) -> int:
    n = 0
    for k in keys:
        if not held(k):  # type: ignore[operator]
            break
        n += 1
    return n
