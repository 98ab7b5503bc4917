"""The router's global tiered index: which worker holds which block on which tier.

Layout. Every block key maps to one int, a bitmask with four bits per worker slot
(bit ``4 * slot + tier``; equal masks share one object). A worker's engine hashes resolve to keys
through a per-worker dict, used only to find a stored block's parent and to resolve
``BlockRemoved``; router keys are always recomputed from token ids. Links from each key to the
children stored under it tell whether every worker's tiers are prefix-closed, as radix engines keep
them; while they are, a query binary-searches for the ends of its runs of equal masks instead of
looking every block up (:mod:`kvtier.indexer.closure`).

Invariants (asserted by :meth:`TieredIndex._check`):

* no key maps to a zero mask;
* for every worker, the keys carrying any of its bits are exactly the values of
  its engine-hash dict, and the dict is injective (one engine hash per block);
* ``counts[tier]`` of a worker equals the number of keys carrying its tier bit;
* links name only keys somebody holds as parents, and a held block whose linked parent is not held
  on that tier by that worker is among its loose blocks (:class:`kvtier.indexer.closure.PrefixClosure`);
* slots are unique and no freed slot has bits left anywhere;
* window KV (SWA models, events of kind ``kvtier.wire.WINDOW_KIND``) has a second mask per key with the same
  layout: a worker's window bit on a tier is set only where its full-attention bit there is.

Window KV. A sliding-window model reuses a prefix only where the window before its end still has window KV:
counting the full-attention blocks alone over-counts (SPEC section 3's tombstones publish nothing in SGLang).
A kvtier SWA engine announces window KV per tier as vLLM's hybrid cache groups do (``kv_cache_spec_kind``
``sliding_window``); the index keeps it beside the full-attention bits, and a window-aware query cuts each such
worker's overlap per tier to its usable prefix (:func:`kvtier.wire.overlap.window_cut`: device blocks need
window KV on device, host blocks on host; L3 pages always carry it).

Engines that send no window events (real SGLang) are scored by a rule that needs none, when the index is told
the served model's window (``window_tokens``): their window KV is *inferred*. An SWA engine keeps window KV
for the last window of each prefix it caches (it frees the rest while the prefill moves on), so of each chain
of blocks a batch stores on a tier, the last ``window`` blocks get the window bit; blocks that a later event
of the same batch extends past lose it again. Load-back and L3 prefetch store the trailing window the same
way (SGLang's TRAILING_PAGES). A prompt whose last window the worker already holds as full-attention blocks gets
that window recomputed with no store published: the router knows it from its own decision, and
:meth:`TieredIndex.note_routed` marks it. An inferred overlap is still an estimate: the rule cannot see window KV
dropped under pool pressure (tombstones publish nothing). A worker's first window event
switches it to tracked for good and drops its inferred bits. Without ``window_tokens``, such workers keep
their full-attention overlap and are marked untracked.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import compress, count, groupby, islice, repeat, takewhile
from operator import itemgetter, ne
from typing import Any, cast

import msgspec
import numpy as np

from kvtier.indexer.closure import PrefixClosure
from kvtier.indexer.keys import BlockKey, block_keys, chain_keys, namespace, split_extra_keys
from kvtier.indexer.orphans import OrphanPool, OrphanStats
from kvtier.wire.overlap import OverlapScores, TierOverlap, window_cut
from kvtier.wire.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    PackedTokens,
    StorageTier,
    UnknownMediumError,
    WorkerId,
    is_window_event,
    parse_medium,
)
from kvtier.wire.ratelog import suffix, worth_logging
from kvtier.wire.stream import StreamId

log = logging.getLogger(__name__)

_TIERS = len(StorageTier)
_SLOT_MASK = (1 << _TIERS) - 1
_M64 = (1 << 64) - 1
_SLOTS_PER_WORD = 64 // _TIERS
_DEV = sum(1 << (_TIERS * s) for s in range(_SLOTS_PER_WORD))  # the device bit of every slot
_EXT = _DEV << StorageTier.EXTERNAL
_MAX_RUNS = 64  # find_matches walks runs of equal masks in Python up to this many, else numpy
_ZERO = TierOverlap(0, 0, 0, 0)  # the overlap of every worker that holds none of a query (shared: frozen)
_MAX_SHARED_MASKS = 1 << 16  # distinct mask values kept as shared objects (see TieredIndex._share)
_MAX_GHOSTS = 1 << 20  # remembered keys of blocks dropped at losses, per worker (oldest forgotten first)


class Outcome(Enum):
    """What applying one event did."""

    APPLIED = "applied"
    REJECTED = "rejected"  # bad input, counted; the worker's state is unchanged
    ORPHANED = "orphaned"  # a store whose parent is unknown: held until the parent is known


@dataclass(slots=True)
class WorkerStats:
    """Counters for one worker stream."""

    events_applied: int = 0  # events that changed or confirmed state
    events_rejected: int = 0  # bad events (not counting orphans, which are held)
    unknown_parents: int = 0  # stores whose parent was unknown on arrival (held as orphans)
    unknown_removals: int = 0  # removals of blocks not on that tier
    clears: int = 0  # AllBlocksCleared, restarts and resyncs
    aliases: int = 0  # engine hashes ignored because another one already names the block
    window_events: int = 0  # window-KV events applied (SWA engines)
    window_unknown: int = 0  # window-KV blocks announced or removed that the full-attention view lacks
    last_error: str | None = None  # the most recent rejection reason


@dataclass(slots=True)
class _Worker:
    stream: StreamId  # identity
    slot: int  # bit position / 4 in every mask
    hashes: dict[EngineHash, BlockKey] = field(default_factory=dict)  # engine hash -> key
    counts: list[int] = field(default_factory=lambda: [0] * _TIERS)  # blocks per tier
    stats: WorkerStats = field(default_factory=WorkerStats)  # counters
    orphans: OrphanPool = field(default_factory=OrphanPool)  # stores waiting for their parent
    # Engine hash -> key of blocks dropped at a loss for good: no longer reported as held, but
    # still the parent of a store that extends them (engine hashes name content, so the key stays right).
    ghosts: dict[EngineHash, BlockKey] = field(default_factory=dict)
    partial: bool = False  # events were lost for good: prefixes stored before the loss are unknown
    window: int = 0  # window length in blocks: announced by window events, or the index's (0: untracked)
    inferred: bool = False  # window bits come from the store rule (no window events seen), not from events
    # Inferred window KV: per tier, the last block's engine hash and the last ``window`` keys of the chain
    # that the current batch is storing (a store extending it continues it). Reset at each batch.
    chains: dict[StorageTier, tuple[EngineHash, list[BlockKey]]] = field(default_factory=dict)


class TieredIndex:
    """Global per-worker tiered block index for one block size.

    Not thread-safe: callers serialise access (the service holds one lock).
    """

    def __init__(self, block_size: int, *, window_tokens: int = 0) -> None:
        """``window_tokens``: the served model's sliding window, used to infer window KV of workers that
        send no window events (see "Window KV" in the module docstring); 0 leaves them untracked."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window_tokens < 0:
            raise ValueError(f"window_tokens must be >= 0, got {window_tokens}")
        self.block_size = block_size
        self.window_tokens = window_tokens
        self._default_window = -(-window_tokens // block_size)  # in blocks
        self._masks: dict[BlockKey, int] = {}
        self._workers: dict[StreamId, _Worker] = {}
        self._slot_stream: dict[int, StreamId] = {}  # slot -> the worker that owns it
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._dev_all_cache = 0  # see _dev_all
        self._dev_all_slots = 0
        self._win: dict[BlockKey, int] = {}  # window-KV bits, the layout of _masks (SWA workers only)
        self._closure = PrefixClosure()  # whether queries may binary-search (kvtier.indexer.closure)
        # One object per distinct mask value: most keys share a handful of masks (one worker, one tier), and
        # an int object per key would be a quarter of the index's memory. Cleared when it grows past
        # _MAX_SHARED_MASKS (sharing is an economy, never a meaning).
        self._shared_masks: dict[int, int] = {}

    # --- workers -------------------------------------------------------------------------

    @property
    def streams(self) -> list[StreamId]:
        return list(self._workers)

    def _worker(self, stream: StreamId) -> _Worker:
        w = self._workers.get(stream)
        if w is None:
            if self._free_slots:
                slot = min(self._free_slots)
                self._free_slots.remove(slot)
            else:
                slot = self._next_slot
                self._next_slot += 1
            w = self._workers[stream] = _Worker(stream, slot, window=self._default_window,
                                                inferred=bool(self._default_window))
            self._slot_stream[slot] = stream
        return w

    def add_worker(self, stream: StreamId) -> None:
        """Registers a worker with no blocks (it then appears in every query). O(1)."""
        self._worker(stream)

    def stats(self, stream: StreamId) -> WorkerStats:
        return self._workers[stream].stats

    def is_partial(self, stream: StreamId) -> bool:
        """True once events of the worker were lost for good (see :meth:`clear_worker`). O(1)."""
        return self._workers[stream].partial

    def orphan_stats(self, stream: StreamId) -> OrphanStats:
        """Counters of the worker's held orphan stores. O(1)."""
        return self._workers[stream].orphans.stats

    def orphan_blocks(self, stream: StreamId) -> int:
        """Blocks currently held as orphans (not in the index). O(1)."""
        return self._workers[stream].orphans.blocks

    def block_counts(self, stream: StreamId) -> dict[StorageTier, int]:
        """Blocks the worker holds per tier. O(1)."""
        w = self._workers[stream]
        return {t: w.counts[t] for t in StorageTier}

    def worker_hashes(self, stream: StreamId) -> dict[StorageTier, set[EngineHash]]:
        """The engine hashes the worker holds per tier, as the index sees them (empty for an unknown
        worker). O(worker blocks)."""
        return self._hashes_by_tier(stream, self._masks, list(StorageTier))

    def _hashes_by_tier(self, stream: StreamId, masks: dict[BlockKey, int],
                        tiers: list[StorageTier]) -> dict[StorageTier, set[EngineHash]]:
        """Per tier of ``tiers``, the worker's engine hashes whose bit ``masks`` has. O(worker blocks)."""
        out: dict[StorageTier, set[EngineHash]] = {t: set() for t in tiers}
        w = self._workers.get(stream)
        if w is None:
            return out
        shift = _TIERS * w.slot
        for eh, key in w.hashes.items():
            bits = masks.get(key, 0) >> shift
            for t in tiers:
                if bits >> t & 1:
                    out[t].add(eh)
        return out

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._masks)

    def clear_worker(self, stream: StreamId, *, partial: bool = False) -> None:
        """Drops every block and held orphan of the worker, keeping its slot. O(blocks of the worker).

        ``partial=True`` records that events were lost for good: what the worker stored before
        is unknown (and its removals may be lost too, which is why it is dropped rather than
        kept). Live events are applied from then on, so every prefix stored after the loss is
        indexed exactly; the flag stays until the worker's state is complete again (a state dump,
        a replay from seq 0, an ``AllBlocksCleared``). The dropped blocks' keys are remembered
        (not reported as held) so that stores extending those prefixes are indexed at once
        instead of waiting as orphans.
        """
        w = self._worker(stream)
        if partial:
            w.ghosts.update(w.hashes)
            while len(w.ghosts) > _MAX_GHOSTS:
                del w.ghosts[next(iter(w.ghosts))]
        else:
            w.ghosts.clear()
        keep = ~(_SLOT_MASK << (_TIERS * w.slot))
        masks = self._masks
        for key in w.hashes.values():
            m = masks[key] & keep
            if m:
                masks[key] = self._share(m)
            else:
                del masks[key]
                self._closure.died(key)
            if self._win:
                self._drop_window(key, keep)
        self._closure.clear_slot(w.slot, _TIERS)
        w.hashes.clear()
        w.counts = [0] * _TIERS
        w.orphans.clear()
        w.chains.clear()
        w.stats.clears += 1
        w.partial = partial

    def remove_worker(self, stream: StreamId) -> None:
        """Forgets the worker and frees its slot. O(blocks of the worker)."""
        if stream not in self._workers:
            return
        self.clear_worker(stream)
        w = self._workers.pop(stream)
        del self._slot_stream[w.slot]
        self._free_slots.append(w.slot)

    # --- events --------------------------------------------------------------------------

    def apply_batch(self, stream: StreamId, batch: EventBatch) -> list[Outcome]:
        """Applies a batch's events in order; one outcome per event."""
        return self.apply_events(stream, batch.events)

    def apply_events(self, stream: StreamId, events: Sequence[Event]) -> list[Outcome]:
        """Applies the events of one batch (all of it, or those a router listens to) in order; one outcome
        per event. A batch is the unit of the inferred-window rule: events applied one by one with
        :meth:`apply` continue the last batch. O(blocks in the events)."""
        w = self._workers.get(stream)
        if w is not None:
            w.chains.clear()
        return [self.apply(stream, ev) for ev in events]

    def window_hashes(self, stream: StreamId) -> dict[StorageTier, set[EngineHash]]:
        """The engine hashes whose window KV the worker holds, per tier (device, host). O(worker blocks)."""
        return self._hashes_by_tier(stream, self._win, [StorageTier.DEVICE, StorageTier.HOST])

    def apply(self, stream: StreamId, event: Event) -> Outcome:
        """Applies one event of ``stream``. O(blocks in the event).

        Never raises for bad input: it is counted, logged with the worker id and
        reported as ``REJECTED``; a store whose parent is unknown is held as an orphan
        (``ORPHANED``, see :mod:`kvtier.indexer.orphans`). Either way the next event of the
        batch applies as usual, and other workers' state is never touched.
        """
        w = self._worker(stream)
        try:
            if isinstance(event, BlockStored | BlockRemoved) and event.kv_cache_spec_kind is not None:
                outcome = self._window_event(w, event)
            elif isinstance(event, BlockStored):
                outcome = self._store(w, event)
            elif isinstance(event, BlockRemoved):
                outcome = self._remove(w, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear_worker(stream)
                outcome = Outcome.APPLIED
            else:
                outcome = self._reject(w, f"unknown event type {type(event).__name__}")
        except (ValueError, TypeError, UnknownMediumError) as exc:
            outcome = self._reject(w, str(exc))
        if outcome is Outcome.APPLIED:
            w.stats.events_applied += 1
        return outcome

    def _reject(self, w: _Worker, reason: str, outcome: Outcome = Outcome.REJECTED) -> Outcome:
        w.stats.events_rejected += 1
        w.stats.last_error = reason
        n = w.stats.events_rejected
        # Every rejection is counted; the log gets the first few and then one in a thousand, so a
        # flood of bad input cannot drown the log.
        if worth_logging(n):
            log.warning("worker %s: event rejected: %s%s", w.stream, reason, suffix(n))
        return outcome

    def _store(self, w: _Worker, ev: BlockStored) -> Outcome:
        tier = parse_medium(ev.medium)
        n = len(ev.block_hashes)
        bs = ev.block_size
        if bs != self.block_size:
            return self._reject(w, f"block_size {bs} differs from the index's {self.block_size}")
        if n == 0:
            return self._reject(w, "BlockStored with no block hashes")
        tokens = ev.num_tokens
        if tokens != n * bs:
            got = f"{tokens} token ids" if tokens >= 0 else f"{len(ev.token_ids)} bytes of packed tokens"
            return self._reject(w, f"{got} for {n} blocks of {bs}")
        salt, extras = ev.cache_salt, None
        if ev.extra_keys is not None:
            if len(ev.extra_keys) != n:
                return self._reject(w, f"{len(ev.extra_keys)} extra_keys entries for {n} blocks")
            vllm_salt, extras = split_extra_keys(ev.extra_keys, ev.lora_name)
            salt = salt or vllm_salt
        if ev.parent_block_hash is None:
            parent = None
            ns = namespace(ev.lora_name, salt)
        else:
            parent = w.hashes.get(ev.parent_block_hash)
            if parent is None and w.ghosts:
                parent = w.ghosts.get(ev.parent_block_hash)
            ns = None
            if parent is None:
                w.stats.unknown_parents += 1
                w.orphans.hold(ev, tier, extras)
                return Outcome.ORPHANED
        keys = chain_keys(ev.token_ids, bs, parent, ns, extras)
        self._insert(w, ev.block_hashes, keys, tier, parent)
        if w.inferred and tier <= StorageTier.HOST:
            self._infer_window(w, ev, keys, tier)
        if w.orphans:
            self._graft(w, ev.block_hashes, keys)
        return Outcome.APPLIED

    def _infer_window(self, w: _Worker, ev: BlockStored, keys: list[BlockKey], tier: StorageTier) -> None:
        """The inferred-window rule (module docstring): the last ``w.window`` blocks of the chain this batch
        is storing on ``tier`` carry window KV, but a host copy of a device page (a backup) has window KV where
        the device page has it, and a device page loaded from a host copy without window KV has none.
        O(blocks in the event + window)."""
        shift = _TIERS * w.slot
        bit, dev, host = 1 << (shift + tier), 1 << shift, 1 << (shift + StorageTier.HOST)
        masks, win = self._masks, self._win
        if tier is StorageTier.HOST and masks.get(keys[0], 0) & dev:
            for key in keys:  # a backup (a prefetch stores only pages the device lacks)
                if win.get(key, 0) & dev:
                    self._mark_window(key, bit)
            w.chains.pop(tier, None)
            return
        chain = w.chains.get(tier)
        tail = chain[1] + keys if chain is not None and ev.parent_block_hash == chain[0] else keys
        cut = max(0, len(tail) - w.window)
        if chain is not None and tail is not keys:
            for key in tail[:min(cut, len(chain[1]))]:  # extended past: those blocks lost their window KV
                self._drop_window(key, ~bit)
        kept = tail[cut:]
        for key in kept:
            if tier is StorageTier.DEVICE and masks.get(key, 0) & host and not win.get(key, 0) & host:
                continue  # loaded back from a host copy that has no window KV: it lands tombstoned
            self._mark_window(key, bit)
        w.chains[tier] = (ev.block_hashes[-1], kept)

    def _mask_pool(self) -> dict[int, int]:
        """The shared mask objects, emptied first once they reach ``_MAX_SHARED_MASKS``. O(1) amortised."""
        if len(self._shared_masks) >= _MAX_SHARED_MASKS:
            self._shared_masks.clear()
        return self._shared_masks

    def _share(self, m: int) -> int:
        """``m``, as the one object the index keeps for that value. O(1)."""
        return self._mask_pool().setdefault(m, m)

    def _insert(self, w: _Worker, block_hashes: list[EngineHash], keys: list[BlockKey], tier: StorageTier,
                parent: BlockKey | None) -> None:
        """Puts the worker's ``tier`` bit on each key of a chain stored under ``parent`` (None: the root),
        keeping its engine-hash dict injective and the prefix-closure links (kvtier.indexer.closure).
        O(blocks)."""
        hashes, masks, closure = w.hashes, self._masks, self._closure
        bit = 1 << (_TIERS * w.slot + tier)
        share = self._mask_pool().setdefault  # TieredIndex._share, without a call per block
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
        slot_bits = _SLOT_MASK << (_TIERS * w.slot)
        if parent_held and not closure.loose and self._insert_held_elsewhere(w, block_hashes, keys, tier, slot_bits):
            return
        link, linked = closure.link, kids.get
        prev = None  # the block before this one in the chain (its parent was linked above)
        added = 0
        for eh, key in zip(block_hashes, keys, strict=True):
            old = hashes.setdefault(eh, key)
            m = masks.get(key, 0)
            if old is key and m & slot_bits:
                # A second engine hash for a block this worker already names: keep the first
                # name, so the dict stays injective (a later use of this alias is "unknown").
                del hashes[eh]
                w.stats.aliases += 1
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
                masks[key] = share(m, m)
                added += 1
                if not parent_held or closure.loose:
                    closure.stored(w.slot, tier, key, parent_held)
            prev, parent_held = key, True
        w.counts[tier] += added

    def _insert_held_elsewhere(self, w: _Worker, block_hashes: list[EngineHash], keys: list[BlockKey],
                               tier: StorageTier, slot_bits: int) -> bool:
        """:meth:`_insert`'s second bulk case, for a chain under a parent the worker holds there while every tier
        is prefix-closed: blocks new to this worker under engine hashes new to it, some of which other workers
        hold (a conversation served twice), or blocks this worker holds on other tiers under the same engine
        hashes (a backup, load-back or prefetch). Each key's mask gains the bit, in C. False, with nothing
        done, for anything else (an engine hash naming another block, a block this worker holds under another
        name, repeats): the caller then goes block by block. O(blocks)."""
        if len(set(block_hashes)) < len(block_hashes) or len(set(keys)) < len(keys):
            return False
        hashes, masks, closure = w.hashes, self._masks, self._closure
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
        bit = 1 << (_TIERS * w.slot + tier)
        news = list(map(bit.__or__, olds))
        share = self._mask_pool().setdefault
        masks.update(zip(keys, map(share, news, news), strict=True))
        w.counts[tier] += list(map(bit.__and__, olds)).count(0)
        return True

    def _graft(self, w: _Worker, block_hashes: list[EngineHash], keys: list[BlockKey]) -> None:
        """Indexes the held orphans whose parent is among ``block_hashes`` (keys known now), and
        theirs in turn. O(blocks grafted)."""
        work = list(zip(block_hashes, keys, strict=True))
        while work:
            eh, key = work.pop()
            for run in w.orphans.take(eh):
                ev = run.event
                try:
                    run_keys = chain_keys(ev.token_ids, ev.block_size, key, None, run.extras)
                except ValueError as exc:  # bad token ids: this run is lost, the others graft
                    self._reject(w, f"held orphan store: {exc}")
                    continue
                # Blocks removed while the run waited are skipped: each stretch of present ones is a chain under
                # the block before it (held or not: the closure tracker marks it loose if not).
                below = key
                for present, stretch in groupby(zip(ev.block_hashes, run_keys, run.present, strict=True),
                                                key=itemgetter(2)):
                    part = list(stretch)
                    if present:
                        self._insert(w, [h for h, _, _ in part], [k for _, k, _ in part], run.tier, below)
                    below = part[-1][1]
                # Children may wait on any block of the run, also one removed since: its key is known.
                work.extend(zip(ev.block_hashes, run_keys, strict=True))

    def _window_event(self, w: _Worker, ev: BlockStored | BlockRemoved) -> Outcome:
        """A window-KV event: sets or clears the worker's window bit on blocks it holds on that tier. Events
        of other non-full-attention cache groups (vLLM's mamba, chunked-local ...) are counted and ignored."""
        if not is_window_event(ev):
            if ev.kv_cache_spec_kind.lower() in ("full_attention", "mla_attention", "mla"):  # type: ignore[union-attr]
                return self._store(w, ev) if isinstance(ev, BlockStored) else self._remove(w, ev)
            return self._reject(w, f"kv_cache_spec_kind {ev.kv_cache_spec_kind!r} is not indexed")
        tier = parse_medium(ev.medium)
        if tier > StorageTier.HOST:
            return self._reject(w, f"window KV on {tier.name}: only device and host window KV is tracked")
        if w.inferred:  # the engine announces window KV: what the store rule guessed goes
            keep = ~(_SLOT_MASK << (_TIERS * w.slot))
            for held in w.hashes.values():
                self._drop_window(held, keep)
            w.inferred = False
            w.chains.clear()
        size = ev.kv_cache_spec_sliding_window
        if size is not None:
            if size <= 0:
                return self._reject(w, f"kv_cache_spec_sliding_window {size} is not positive")
            w.window = -(-size // self.block_size)
        elif not w.window:
            return self._reject(w, "window-KV event without kv_cache_spec_sliding_window")
        if isinstance(ev, BlockStored) and ev.block_size != self.block_size:
            return self._reject(w, f"block_size {ev.block_size} differs from the index's {self.block_size}")
        shift = _TIERS * w.slot
        bit = 1 << (shift + tier)
        masks, win, hashes = self._masks, self._win, w.hashes
        unknown = 0
        for eh in ev.block_hashes:
            key = hashes.get(eh)
            if key is None or not masks[key] & bit:
                unknown += 1  # window KV is announced after, and withdrawn before, the block's full KV
                continue
            m = win.get(key, 0)
            m = m | bit if isinstance(ev, BlockStored) else m & ~bit
            if m:
                win[key] = m
            else:
                win.pop(key, None)
        if unknown:
            w.stats.window_unknown += unknown
            w.stats.last_error = f"window KV of {unknown} block(s) not on {tier.name}"
        w.stats.window_events += 1
        return Outcome.APPLIED

    def note_routed(self, stream: StreamId, keys: Sequence[BlockKey]) -> None:
        """A request with these prompt block keys was sent to ``stream``. A worker whose window KV is inferred
        will hold window KV for the prompt's last window: blocks of it the worker has on device are marked
        now, as the engine publishes no store for them; the rest comes with their stores. Nothing for other
        workers. O(window)."""
        w = self._workers.get(stream)
        if w is None or not w.inferred:
            return
        bit = 1 << (_TIERS * w.slot + StorageTier.DEVICE)
        for key in keys[max(0, len(keys) - w.window):]:
            self._mark_window(key, bit)

    def _mark_window(self, key: BlockKey, bit: int) -> None:
        """Sets the window bit ``bit`` of ``key`` if the block has that worker and tier's bit (window KV never
        outlives the block's full KV there; an aliased engine hash leaves a stored block without it)."""
        if self._masks.get(key, 0) & bit:
            self._win[key] = self._win.get(key, 0) | bit

    def _drop_window(self, key: BlockKey, keep: int) -> None:
        m = self._win.get(key)
        if m is not None:
            m &= keep
            if m:
                self._win[key] = m
            else:
                del self._win[key]

    def _drop_slot_bits(self, w: _Worker, key: BlockKey, slot_bits: int) -> None:
        if self._win:
            self._drop_window(key, ~slot_bits)
        m = self._masks[key]
        shift = _TIERS * w.slot
        held = [t for t in range(_TIERS) if m >> (shift + t) & 1]
        for t in held:
            w.counts[t] -= 1
        m &= ~slot_bits
        if m:
            self._masks[key] = self._share(m)
        else:
            del self._masks[key]
        for t in held:
            self._closure.removed(w.slot, t, key, 1 << (shift + t), self._masks)
        if not m:
            self._closure.died(key)  # after its children were looked at

    def _remove(self, w: _Worker, ev: BlockRemoved) -> Outcome:
        tier = parse_medium(ev.medium)
        shift = _TIERS * w.slot
        bit = 1 << (shift + tier)
        masks, hashes, closure = self._masks, w.hashes, self._closure
        if not self._win and self._remove_sole_holder(w, ev.block_hashes, tier, bit):
            return Outcome.APPLIED
        share = self._mask_pool().setdefault  # TieredIndex._share, without a call per block
        unknown = 0
        gone: list[BlockKey] = []  # keys whose bit this event clears, in order
        dead: list[BlockKey] = []  # of which those nobody holds any more
        for eh in ev.block_hashes:
            key = hashes.get(eh)
            m = 0 if key is None else masks[key]
            if not m & bit:
                if not (w.orphans and w.orphans.remove(eh, tier)):
                    unknown += 1
                continue
            assert key is not None
            m &= ~bit
            if self._win:
                self._drop_window(key, ~bit)  # window KV never outlives the block's full KV on a tier
            if m:
                masks[key] = share(m, m)
            else:
                del masks[key]
                dead.append(key)
            gone.append(key)
            if not (m >> shift) & _SLOT_MASK:
                del hashes[eh]
        w.counts[tier] -= len(gone)
        if gone:
            closure.removed_all(w.slot, tier, gone, bit, masks)
            closure.died_all(dead)  # after their children were looked at
        if unknown:
            w.stats.unknown_removals += unknown
            w.stats.last_error = f"removal of {unknown} block(s) not on {tier.name}"
            log.info("worker %s: %s", w.stream, w.stats.last_error)
        return Outcome.APPLIED

    def _remove_sole_holder(self, w: _Worker, block_hashes: list[EngineHash], tier: StorageTier, bit: int) -> bool:
        """The common eviction, in bulk: every block named is known, once, and held by this worker on this tier
        alone (its mask is exactly ``bit``), so every block goes. False (nothing done) otherwise: the caller
        then takes the blocks one by one. No window KV may be indexed (the caller checks). O(blocks), in C
        but for the closure's pass over their children."""
        keys = list(map(w.hashes.get, block_hashes))
        if None in keys or len(set(keys)) != len(keys):
            return False
        gone = cast(list[BlockKey], keys)
        masks = self._masks
        if list(map(masks.get, gone)).count(bit) != len(gone):
            return False
        deque(map(masks.__delitem__, gone), maxlen=0)
        deque(map(w.hashes.__delitem__, block_hashes), maxlen=0)
        w.counts[tier] -= len(gone)
        self._closure.removed_all(w.slot, tier, gone, bit, masks)
        self._closure.died_all(gone)
        return True

    # --- queries -------------------------------------------------------------------------

    def find_matches(
        self, token_ids: list[int], *, lora_name: str | None = None, cache_salt: str | None = None,
        mm_items: Sequence[tuple[str, int, int]] | None = None,
    ) -> OverlapScores:
        """Per-worker tier overlaps of a request given as token ids. O(len(token_ids))."""
        return self.find_matches_keys(self.request_keys(token_ids, lora_name=lora_name, cache_salt=cache_salt,
                                                        mm_items=mm_items))

    def request_keys(
        self, token_ids: Sequence[int] | PackedTokens, *, lora_name: str | None = None,
        cache_salt: str | None = None, mm_items: Sequence[tuple[str, int, int]] | None = None,
    ) -> list[BlockKey]:
        """The router block keys of a request's full blocks (token ids, or packed), in its LoRA / salt key
        space, with its multimodal items ``(identifier, offset, length)`` scoping the blocks they overlap
        (see :mod:`kvtier.indexer.keys`). O(len(token_ids) + items)."""
        return block_keys(token_ids, self.block_size, lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items)

    def find_matches_keys(self, keys: list[BlockKey], *, window_aware: bool = False) -> OverlapScores:
        """Per-worker tier overlaps of a request given as block keys.

        While every worker's tiers are prefix-closed (radix engines: :mod:`kvtier.indexer.closure`),
        O(r log m) dict lookups for the r runs of equal masks over the m leading blocks anybody holds;
        otherwise one lookup per leading block (in C) and vectorised work past ``_MAX_RUNS`` runs. Either
        way independent of the number of indexed blocks. ``window_aware``: workers that announce window KV
        get their usable overlap (see the module docstring), their raw one in ``raw``; O(m) more per such
        worker holding a prefix.
        """
        result = OverlapScores(total_blocks=len(keys))
        # Only slots with a non-zero depth get an entry: the rest share one zero overlap, so a query's cost
        # grows with the workers that hold its prefix, not with the cluster.
        depths: dict[int, list[int]] = {}
        searched = self._runs_by_search(keys) if self._closure.closed else None
        if searched is not None:
            runs, n = searched
            if n:
                result.shared_pool = self._levels_by_runs(runs, n, depths)
        else:
            ms = self._leading_masks(keys)
            n = len(ms)
            if n:
                # Where each run of equal masks starts (a block whose mask differs from the one before it).
                starts = [0, *compress(count(1), map(ne, ms, islice(ms, 1, None)))]
                if len(starts) <= _MAX_RUNS:
                    result.shared_pool = self._levels_by_runs([(ms[a], a) for a in starts], n, depths)
                else:
                    result.shared_pool = self._levels(ms, n, depths)
        result.workers = workers = dict.fromkeys(self._workers, _ZERO)
        owner = self._slot_stream
        # Workers that hold the same prefix (a system prompt) share one frozen overlap: building one costs more
        # than the lookups that found it.
        made: dict[tuple[int, ...], TierOverlap] = {}
        for slot, d in depths.items():
            levels = tuple(d)
            ov = made.get(levels)
            if ov is None:
                ov = made[levels] = TierOverlap(*levels)
            workers[owner[slot]] = ov
        if window_aware:
            self._cut_to_windows(keys, result)
        return result

    def _leading_masks(self, keys: list[BlockKey]) -> list[int]:
        """The masks of the leading blocks anybody holds: a lookup per block, in C (a mask is never 0, a
        missing key gives None). O(leading blocks)."""
        get: Callable[[BlockKey], int | None] = self._masks.get
        return cast(list[int], list(takewhile(bool, map(get, keys))))

    def _runs_by_search(self, keys: list[BlockKey]) -> tuple[list[tuple[int, int]], int] | None:
        """The runs of equal masks over the leading blocks anybody holds, as ``(mask, first position)``, and
        their length, found by binary search; ``None`` past ``_MAX_RUNS`` runs (a scan is cheaper then).

        Only while every worker's tiers are prefix-closed (:mod:`kvtier.indexer.closure`): each tier bit
        can then only drop along the chain, so a block with its run's mask proves every block between
        them has it too. O(runs * log(blocks)) lookups.
        """
        get: Callable[[BlockKey], int | None] = self._masks.get
        total = len(keys)
        runs: list[tuple[int, int]] = []
        pos = 0
        m = get(keys[0]) if total else None
        while m:
            if len(runs) == _MAX_RUNS:
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

    def _cut_to_windows(self, keys: list[BlockKey], result: OverlapScores) -> None:
        """Replaces the overlaps of workers with a window (tracked or inferred) by their usable ones. O(m) per
        such worker with a prefix."""
        wins: list[int] | None = None
        for w in self._workers.values():
            if not w.window:
                continue
            result.windows[w.stream] = w.window
            if w.inferred:
                result.inferred.add(w.stream)
            raw = result.workers[w.stream]
            if not raw.external:
                continue
            if wins is None:
                get = self._win.get
                wins = [get(k, 0) for k in keys[:max(o.external for o in result.workers.values())]]
            shift = _TIERS * w.slot
            ok = [bool(m >> (shift + StorageTier.DEVICE) & 1) for m in wins[:raw.device]]
            ok += [bool(m >> (shift + StorageTier.HOST) & 1) for m in wins[raw.device:raw.host]]
            ok += [True] * (raw.external - raw.host)  # L3 pages carry window KV
            result.raw[w.stream] = raw
            result.workers[w.stream] = TierOverlap(*(window_cut(ok, lvl, w.window)
                                                     for lvl in (raw.device, raw.host, raw.disk, raw.external)))

    def _levels_by_runs(self, runs: list[tuple[int, int]], n: int, depths: dict[int, list[int]]) -> int:
        """Cumulative tier levels over runs of equal masks, given as ``(mask, first position)``, on Python ints
        (any number of workers).

        Within a run the mask is constant, so a slot's bit can only drop at a run's start.
        """
        dev_all = self._dev_all()
        alive = [dev_all] * _TIERS
        pool_run = -1
        for m, pos in runs:
            a1 = m | (m >> 1)
            disk = (a1 | (m >> 2)) & dev_all
            pooled = bool(m & (dev_all << StorageTier.EXTERNAL))
            if not pooled and pool_run < 0:
                pool_run = pos
            drops: dict[int, list[int]] = {}  # slots' device bits dropped here -> the levels they drop at
            for lvl, held in enumerate((m & dev_all, a1 & dev_all, disk, dev_all if pooled else disk)):
                dropped = alive[lvl] & ~held
                if dropped:
                    alive[lvl] &= held
                    drops.setdefault(dropped, []).append(lvl)
            for dropped, lvls in drops.items():  # one decode of the bits for levels that drop together
                self._record(dropped, pos, lvls, depths)
        ends: dict[int, list[int]] = {}
        for lvl in range(_TIERS):
            ends.setdefault(alive[lvl], []).append(lvl)
        for bits, lvls in ends.items():
            self._record(bits, n, lvls, depths)
        return n if pool_run < 0 else pool_run

    def _record(self, bits: int, depth: int, lvls: Sequence[int], depths: dict[int, list[int]],
                base: int = 0) -> None:
        """Sets ``depth`` at each level of ``lvls`` for every owned slot whose device bit is in ``bits`` (slots
        numbered from ``base``, the first slot of the mask word). Depth 0 is every slot's default: nothing to
        record. O(set bits * levels): the bits are decoded once for all the levels (where many workers share
        a prefix, as a system prompt, this loop is most of a query)."""
        if not depth:
            return
        owned = self._slot_stream
        # The set bits, found in the binary digits (str.find runs in C): peeling the lowest bit off a mask of
        # hundreds of workers would allocate a new big int twice per bit.
        digits = bin(bits)
        last = len(digits) - 1  # the position of bit 0
        i = digits.find("1", 2)
        while i >= 0:
            slot = base + (last - i) // _TIERS
            if slot in owned:
                d = depths.get(slot)
                if d is None:
                    d = depths[slot] = [0] * _TIERS
                for lvl in lvls:
                    d[lvl] = depth
            i = digits.find("1", i + 1)

    def _dev_all(self) -> int:
        """The device bit of every slot in use (cached until a new slot appears)."""
        if self._dev_all_slots != self._next_slot:
            self._dev_all_cache = sum(1 << (_TIERS * s) for s in range(self._next_slot))
            self._dev_all_slots = self._next_slot
        return self._dev_all_cache

    def _levels(self, ms: list[int], n: int, depths: dict[int, list[int]]) -> int:
        words = max(1, -(-self._next_slot // _SLOTS_PER_WORD))
        if words == 1:
            arrs = [np.array(ms, dtype=np.uint64)]
        else:
            arrs = [np.fromiter(((m >> (64 * g)) & _M64 for m in ms), dtype=np.uint64, count=n)
                    for g in range(words)]
        ext_bits = np.uint64(_EXT)
        pool = np.zeros(n, dtype=bool)
        for a in arrs:
            pool |= (a & ext_bits) != 0
        pool_run = n if pool.all() else int(np.argmin(pool))
        dev = np.uint64(_DEV)
        for g, a in enumerate(arrs):
            a1 = a | (a >> np.uint64(1))
            levels = np.empty((_TIERS, n), dtype=np.uint64)
            np.bitwise_and(a, dev, out=levels[0])
            np.bitwise_and(a1, dev, out=levels[1])
            np.bitwise_and(a1 | (a >> np.uint64(2)), dev, out=levels[2])
            np.bitwise_or(levels[2], np.where(pool, dev, np.uint64(0)), out=levels[3])
            acc = np.bitwise_and.accumulate(levels, axis=1)
            for lvl in range(_TIERS):
                self._depths_from_run(acc[lvl], n, g, lvl, depths)
        return pool_run

    def _depths_from_run(self, row: np.ndarray[Any, Any], n: int, word: int, lvl: int,
                         depths: dict[int, list[int]]) -> None:
        # `row` is a running AND, so each slot's bit is set on a prefix: find where each drops.
        base = word * _SLOTS_PER_WORD
        change = np.flatnonzero(row[1:] != row[:-1])
        before = row[change].tolist()
        after = row[change + 1].tolist()
        for pos, b, a in zip(change.tolist(), before, after, strict=True):
            self._record(b & ~a, pos + 1, (lvl,), depths, base)
        self._record(int(row[-1]), n, (lvl,), depths, base)

    # --- snapshot ------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole index as bytes (msgpack). O(total entries)."""
        workers = []
        for w in self._workers.values():
            shift = _TIERS * w.slot
            entries = [(eh, key, (self._masks[key] >> shift) & _SLOT_MASK) for eh, key in w.hashes.items()]
            window = [(key, bits) for key in w.hashes.values()
                      if (bits := (self._win.get(key, 0) >> shift) & _SLOT_MASK)] if w.window else []
            workers.append((w.stream.worker, w.stream.dp_rank, w.partial, entries, w.window, window, w.inferred,
                            None if w.slot in self._closure.unknown else self._closure.loose_of(w.slot, _TIERS)))
        return msgspec.msgpack.encode({"version": 1, "block_size": self.block_size,
                                       "window_tokens": self.window_tokens, "workers": workers,
                                       "links": self._closure.links()})

    @classmethod
    def restore(cls, data: bytes) -> TieredIndex:
        """Inverse of :meth:`snapshot`. Raises ``ValueError`` naming what is wrong with ``data``."""
        try:
            obj = msgspec.msgpack.decode(data)
            if obj.get("version") != 1:
                raise ValueError(f"unsupported snapshot version {obj.get('version')!r}")
            index = cls(int(obj["block_size"]), window_tokens=int(obj.get("window_tokens", 0)))
            for worker, dp_rank, partial, entries, *swa in obj["workers"]:
                w = index._worker(StreamId(WorkerId(worker), int(dp_rank)))
                w.partial = bool(partial)
                if swa:  # written since window KV is tracked; older snapshots have none
                    w.window = int(swa[0])
                    w.inferred = bool(swa[2]) if len(swa) > 2 else False
                    for key, bits in swa[1]:
                        index._win[BlockKey(key)] = index._win.get(key, 0) | (bits << (_TIERS * w.slot))
                shift = _TIERS * w.slot
                for eh, key, bits in entries:
                    w.hashes[eh] = BlockKey(key)
                    index._masks[BlockKey(key)] = index._share(index._masks.get(key, 0) | (bits << shift))
                    for t in range(_TIERS):
                        w.counts[t] += bits >> t & 1
                # Loose blocks per tier (kvtier.indexer.closure), written since queries binary-search; without
                # them (or the links) the worker is not known to be prefix-closed and queries scan.
                if entries:
                    index._closure.restore_slot(w.slot, swa[3] if len(swa) > 3 and "links" in obj else None)
            for parent, kids in obj.get("links", ()):
                for kid in kids:
                    index._closure.link(BlockKey(parent), BlockKey(kid), index._masks)
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not an index snapshot: {exc}") from None
        return index

    # --- invariants ----------------------------------------------------------------------

    def _check(self) -> None:
        """Asserts every structural invariant. O(total entries)."""
        slots = [w.slot for w in self._workers.values()]
        assert len(set(slots)) == len(slots), f"duplicate slots {slots}"
        assert self._slot_stream == {w.slot: s for s, w in self._workers.items()}, "slot owners out of sync"
        assert not set(slots) & set(self._free_slots), "a live slot is also free"
        assert all(s < self._next_slot for s in slots + self._free_slots), "slot beyond next_slot"
        for w in self._workers.values():
            assert not w.inferred or w.window, f"{w.stream}: window KV inferred with no window"
            assert w.inferred or not w.chains, f"{w.stream}: store chains kept for a worker that is not inferred"
            assert all(len(c[1]) <= w.window for c in w.chains.values()), f"{w.stream}: a chain tail over the window"
        held: dict[int, set[BlockKey]] = {w.slot: set() for w in self._workers.values()}
        for key, m in self._masks.items():
            assert m, f"key {key:#x} maps to an empty mask"
            s = 0
            while m:
                if m & _SLOT_MASK:
                    assert s in held, f"key {key:#x} has bits of slot {s}, which no worker owns"
                    held[s].add(key)
                m >>= _TIERS
                s += 1
        for w in self._workers.values():
            values = set(w.hashes.values())
            assert len(values) == len(w.hashes), f"worker {w.stream}: two engine hashes name one block"
            assert values == held[w.slot], (
                f"worker {w.stream}: {len(values - held[w.slot])} mapped keys without bits, "
                f"{len(held[w.slot] - values)} keys with bits but no engine hash")
            shift = _TIERS * w.slot
            for t in range(_TIERS):
                n = sum(1 for k in values if self._masks[k] >> (shift + t) & 1)
                assert w.counts[t] == n, f"worker {w.stream}: counts[{t}]={w.counts[t]} but {n} blocks"
            w.orphans._check()
        cl = self._closure
        for (slot, t), loose in cl.loose.items():
            assert loose, f"slot {slot} tier {t}: an empty loose set is kept"
            assert slot in held, f"slot {slot}: loose blocks of a slot no worker owns"
            for key in loose:
                assert self._masks.get(key, 0) >> (_TIERS * slot + t) & 1, f"slot {slot}: loose {key:#x} not held"
        for parent in cl.kids:
            pm = self._masks.get(parent, 0)
            assert pm, f"links kept for {parent:#x}, which nobody holds"
            for kid in cl.children(parent):
                km = self._masks.get(kid, 0)
                for slot in held:
                    for t in range(_TIERS):
                        bit = _TIERS * slot + t
                        if km >> bit & 1 and not pm >> bit & 1 and slot not in cl.unknown:
                            assert kid in cl.loose.get((slot, t), ()), (
                                f"slot {slot} tier {t}: {kid:#x} held without its parent {parent:#x} but not loose")
        for key, m in self._win.items():
            assert m, f"key {key:#x} maps to an empty window mask"
            assert m & ~self._masks.get(key, 0) == 0, f"key {key:#x}: window KV on a tier without the block"
