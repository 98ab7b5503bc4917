"""Regaining, after a loss for good, the prefixes a partial worker's new stores prove it still holds.

When events were lost past what replay or a dump can restore, the worker is cleared once and marked partial
(:meth:`kvtier.indexer.index.tiered.TieredIndex.clear_worker`): its removals may be among the lost events, so nothing it
held before may be reported. A real SGLang engine never announces again the blocks it keeps cached, so without more
the prefixes it held before the loss, the hottest ones first, would stay unknown for good.

What a store proves. On a tier where the engine keeps its blocks *prefix-closed* (a block held there has its parent
held there), a ``BlockStored`` on that tier proves that, at that point of the stream, the parent it names and every
ancestor of the parent are held on that tier. Engines differ, so the index is told, per worker, which tiers are
closed (:meth:`kvtier.indexer.index.tiered.TieredIndex.set_prefix_closed`), and nothing is regained on any other:

* device: SGLang's radix tree and kvtier's engine evict only device leaves and insert, load back or recompute a
  page only under a parent on device, so a device store proves the parent chain is on device. vLLM evicts any free
  block, so a block of it can be held without its parent: never declared for vLLM.
* host: kvtier's engine backs a node up only once its parent is backed up, prefetches into host only under a node
  with a host copy, and evicts host copies leaves first (SPEC section 3), so its host stores prove the parent chain
  is on host. Not assumed of SGLang: where the engine does not promise host closure, a host store (the backup of a
  device page) proves its parent chain on device *or* host at the copy, and the index keeps no "one of the two"
  bit, so it records nothing of it.
* disk, external: L3 pages are written and evicted page by page, a page may outlive its parent's: never closed.

What is regained is exactly the chain a store proves: from the parent up to the root, or up to a block the index
already reports on that tier (a closed tier holds its ancestors already). A chain whose ancestry the index does not
know up to one of those ends is regained not at all (a block without its parent would be a guess about the parent's
tier). Removals after the store apply to regained blocks as to any other.

Finding the ancestors. Router keys are recomputed from token ids and a dropped block has none left, so its key and
its parent's engine hash are remembered when it is dropped (:attr:`WorkerState.ghosts` and :attr:`WorkerState.ups`):
the parent from the index's links (:mod:`kvtier.indexer.index.closure`: a child is linked under its parent while the
parent is held), and "under the root" for a block held on a tier where it is not loose with no parent among the
worker's blocks; stores made under a dropped block record that parent themselves (under one stored again since, as the
links forget it once the parent goes, only on a worker declared prefix-closed somewhere and while ``ups`` has under
:data:`UPS_OF_HELD_AGAIN` entries). Each map keeps at most :data:`MAX_REMEMBERED` entries, the oldest going first.

Cost: nothing on a worker that is not partial; for a partial one, O(1) per store on a closed tier whose parent is
held there, and O(chain) for a store that regains one; at a loss, O(blocks dropped) to read their parents.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from kvtier.indexer.index.blockmasks import BlockMasks
from kvtier.indexer.index.closure import PrefixClosure
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import CHILD, KEY, LINKS_NONE, LINKS_SET, USED
from kvtier.indexer.index.masklayout import SLOT_MASK, TIERS
from kvtier.indexer.index.workerstate import WorkerState
from kvtier.wire.protocol import EngineHash, StorageTier

__all__ = ["MAX_REMEMBERED", "UPS_OF_HELD_AGAIN", "ancestry", "relearn"]

#: Entries kept per worker in each of ``ghosts`` and ``ups`` (oldest forgotten first): some 200 bytes an entry.
MAX_REMEMBERED = 1 << 20
#: ``ups`` entries below which a store under a dropped block held again records its parent (about 13 MB a worker;
#: never pushing out what a loss recorded): see :meth:`kvtier.indexer.index.applier.EventApplier._remember_up`.
UPS_OF_HELD_AGAIN = 1 << 16


def ancestry(w: WorkerState, blocks: BlockMasks,
             items: list[tuple[EngineHash, BlockKey]]) -> dict[EngineHash, EngineHash | None]:
    """The parent engine hash of each block worker ``w`` holds (None: stored under the root), where the index can
    tell: read before the worker is cleared; ``items`` are the worker's ``hashes.items()``. A block whose parent the
    worker does not hold, or whose links are not known (a slot restored without them), is left out. O(blocks of the
    worker + their links), with no call per block but for the few blocks no link names (a loss may drop a million
    blocks, under the index's lock)."""
    closure, masks = blocks.closure, blocks.masks
    if w.slot in closure.unknown:
        return {}
    named = {key: eh for eh, key in items}
    up: dict[EngineHash, EngineHash | None] = {named[c]: named[p] for p, c in _links_among(closure, named)}
    shift = TIERS * w.slot
    loose = [closure.loose.get((w.slot, t), ()) for t in range(TIERS)]
    for eh, key in items:
        if eh in up:
            continue
        # Not loose on a tier it is held on: its parent is held there by this worker (and linked), or it is a root
        # block. No worker block links to it, so it is a root block.
        bits = masks.get(key, 0) >> shift & SLOT_MASK
        if any(bits >> t & 1 and key not in loose[t] for t in range(TIERS)):
            up[eh] = None
    return up


def _links_among(closure: PrefixClosure, keys: Mapping[BlockKey, object]) -> Iterable[tuple[BlockKey, BlockKey]]:
    """The links ``(parent, child)`` whose both ends are among ``keys``: O(links in the table), read from its rows
    all at once."""
    r = closure.table.r
    state = r[:, USED]
    rows = np.flatnonzero((state > LINKS_NONE) & (state != LINKS_SET))  # rows whose one child is in CHILD
    pairs = [(p, c) for p, c in zip(r[rows, KEY].tolist(), r[rows, CHILD].tolist(), strict=True)
             if c in keys and p in keys]
    pairs += [(p, c) for p, kids in closure.branches.items() if p in keys for c in kids if c in keys]
    return pairs


def relearn(w: WorkerState, blocks: BlockMasks, parent: EngineHash, tier: StorageTier) -> list[tuple[EngineHash,
                                                                                                      BlockKey]]:
    """Indexes on ``tier`` the chain that a store of partial worker ``w`` on ``tier`` (one of its closed tiers)
    under ``parent`` proves held: ``parent`` and its ancestors, up to the root or to a block the index holds there
    already. Nothing if the chain's ancestry is not known that far, or ``parent`` is held there already. Returns the
    blocks indexed there now (engine hash, key), root side first. O(chain)."""
    masks, hashes, ghosts, ups = blocks.masks, w.hashes, w.ghosts, w.ups
    bit = TIERS * w.slot + tier
    chain: list[tuple[EngineHash, BlockKey]] = []
    seen: set[EngineHash] = set()
    eh: EngineHash | None = parent
    top: BlockKey | None = None  # what the chain hangs under: None is the root
    while eh is not None:
        key = hashes.get(eh)
        if key is not None and masks.get(key, 0) >> bit & 1:
            top = key  # held there already, so are its ancestors (a closed tier)
            break
        if key is None:
            key = ghosts.get(eh)
        if key is None or eh in seen or eh not in ups:
            return []  # the ancestry stops short of a block known to be held: proves nothing the index can record
        seen.add(eh)
        chain.append((eh, key))
        eh = ups[eh]
    if not chain:
        return []
    chain.reverse()
    blocks.insert(w, [h for h, _ in chain], [k for _, k in chain], tier, top)
    w.stats.relearned += len(chain)
    return chain
