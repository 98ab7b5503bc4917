"""Applying a worker's events to the index: validation, parents, orphans, window KV.

Each event is checked before anything changes (block size, token count, extra keys, medium), its parent is resolved
through the worker's engine hashes (or the ghosts of blocks dropped at a loss), and its router keys are computed from
its token ids (SPEC section 2). A store whose parent is unknown is held as an orphan
(:mod:`kvtier.indexer.index.orphans`)
and grafted when the parent arrives. Bad input is counted and logged with the worker id, never raised: the next
event applies as usual, and other workers' state is never touched. What a store or removal changes in the masks is
:mod:`kvtier.indexer.index.blockmasks`'s; which worker owns which slot is
:class:`kvtier.indexer.index.tiered.TieredIndex`'s.
"""

from __future__ import annotations

import logging
from itertools import groupby
from operator import itemgetter

from kvtier.indexer.index.blockmasks import BlockMasks
from kvtier.indexer.index.keys import BlockKey, chain_keys, namespace, split_extra_keys
from kvtier.indexer.index.relearn import MAX_REMEMBERED, UPS_OF_HELD_AGAIN, relearn
from kvtier.indexer.index.windowkv import WindowKV
from kvtier.indexer.index.workerstate import Outcome, WorkerState
from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.protocol import (
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    StorageTier,
    UnknownMediumError,
    is_window_event,
    parse_medium,
)

log = logging.getLogger(__name__)

__all__ = ["EventApplier"]


#: The longest rejection reason kept and logged: one line, whatever the event quoted in it held.
MAX_REASON = 300


class EventApplier:
    """Applies events to one index's masks, for the worker the index resolved. Holds no state of its own."""

    __slots__ = ("_block_size", "_blocks", "_win")

    def __init__(self, block_size: int, blocks: BlockMasks, win: WindowKV) -> None:
        self._block_size = block_size  # the index's block size: events of another are rejected
        self._blocks = blocks  # the masks, and what stores and removals change in them
        self._win = win  # window-KV bits (SWA workers)

    def apply(self, w: WorkerState, event: Event) -> Outcome:
        """Applies one event of worker ``w`` other than ``AllBlocksCleared`` (the index clears the worker).
        O(blocks in the event).

        Never raises for bad input: it is counted, logged with the worker id and reported as ``REJECTED``; a
        store whose parent is unknown is held as an orphan (``ORPHANED``). Counting applied events is the
        caller's.
        """
        try:
            if isinstance(event, BlockStored | BlockRemoved) and event.kv_cache_spec_kind is not None:
                return self._window_event(w, event)
            if isinstance(event, BlockStored):
                return self._store(w, event)
            if isinstance(event, BlockRemoved):
                return self._remove(w, event)
            return self._reject(w, f"unknown event type {type(event).__name__}")
        except (ValueError, TypeError, UnknownMediumError) as exc:
            return self._reject(w, str(exc))

    def _reject(self, w: WorkerState, reason: str, outcome: Outcome = Outcome.REJECTED) -> Outcome:
        if len(reason) > MAX_REASON:  # (a reason may quote the event's bad value, of any size)
            reason = f"{reason[:MAX_REASON]}... ({len(reason):,} characters)"
        w.stats.events_rejected += 1
        w.stats.last_error = reason
        n = w.stats.events_rejected
        # Every rejection is counted; the log gets the first few and then one in a thousand, so a
        # flood of bad input cannot drown the log.
        if worth_logging(n):
            log.warning("worker %s: event rejected: %s%s", w.stream, reason, suffix(n))
        return outcome

    def _store(self, w: WorkerState, ev: BlockStored) -> Outcome:
        tier = parse_medium(ev.medium)
        n = len(ev.block_hashes)
        bs = ev.block_size
        if bs != self._block_size:
            w.stats.wrong_block_size += 1
            w.stats.block_size_wrong = True
            return self._reject(w, f"block_size {bs} differs from the index's {self._block_size}")
        w.stats.block_size_wrong = False
        if n == 0:
            return self._reject(w, "BlockStored with no block hashes")
        if ev.parent_block_hash is not None and ev.parent_block_hash in ev.block_hashes:
            # (a chain cannot hang under one of its own blocks: grafted, it would re-key the parent it hangs from)
            return self._reject(w, f"BlockStored under parent {ev.parent_block_hash!r}, one of its own block hashes")
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
        ns = namespace(ev.lora_name, salt) if ev.parent_block_hash is None else None
        if extras is None:  # the parent, the keys and the store in one pass, where the masks have one
            done = self._blocks.insert_tokens(w, ev, tier, ns)
            if done is not None:
                if w.ghosts:
                    self._remember_up(w, ev, held=True)  # (the fast path: its parent is held)
                if (w.inferred and tier <= StorageTier.HOST) or w.orphans:
                    self._after_store(w, ev, done.tolist(), tier)
                if w.partial and w.closed_tiers >> tier & 1 and ev.parent_block_hash is not None:
                    self._relearn(w, ev.parent_block_hash, tier)  # (its parent may be held on another tier only)
                return Outcome.APPLIED
        held = False  # its parent is held by the worker
        if ev.parent_block_hash is None:
            parent = None
        else:
            parent = w.hashes.get(ev.parent_block_hash)
            held = parent is not None
            if parent is None and w.ghosts:
                parent = w.ghosts.get(ev.parent_block_hash)
            if parent is None:
                w.stats.unknown_parents += 1
                w.orphans.hold(ev, tier, extras)
                return Outcome.ORPHANED
        keys = chain_keys(ev.token_ids, bs, parent, ns, extras)  # (bad token ids raise here: nothing changed)
        if w.ghosts:
            self._remember_up(w, ev, held=held)
        if w.partial and w.closed_tiers >> tier & 1 and ev.parent_block_hash is not None:
            self._relearn(w, ev.parent_block_hash, tier)  # first, so that the store hangs under a held parent
        self._blocks.insert(w, ev.block_hashes, keys, tier, parent)
        self._after_store(w, ev, keys, tier)
        return Outcome.APPLIED

    @staticmethod
    def _remember_up(w: WorkerState, ev: BlockStored, *, held: bool) -> None:
        """A store whose parent (``held`` by the worker or not) may be a block dropped at a loss: if so, its first
        block's parent, for a later store that proves the chain (:mod:`kvtier.indexer.index.relearn`). Under a dropped
        block not held: the oldest entry makes room. Under one held again (on a worker declared prefix-closed
        somewhere): the index's links name the parent while the worker holds it, but a later loss reads them, and a
        block that outlives its parent would be dropped then with its parent forgotten; every new conversation under a
        hot prefix held again makes such a store, so these are kept while ``ups`` has under
        :data:`UPS_OF_HELD_AGAIN` entries, never pushing out what a loss recorded. O(1)."""
        if ev.parent_block_hash not in w.ghosts:
            return
        if held:
            if w.closed_tiers and len(w.ups) < UPS_OF_HELD_AGAIN:
                w.ups.setdefault(ev.block_hashes[0], ev.parent_block_hash)
            return
        w.ups.setdefault(ev.block_hashes[0], ev.parent_block_hash)
        if len(w.ups) > MAX_REMEMBERED:
            del w.ups[next(iter(w.ups))]  # the oldest goes

    def _relearn(self, w: WorkerState, parent: EngineHash, tier: StorageTier) -> None:
        """A store of partial worker ``w`` under ``parent`` on ``tier``, one the engine keeps prefix-closed: the
        parent's chain is indexed there as far as the store proves it (:mod:`kvtier.indexer.index.relearn`), and held
        orphans waiting on those blocks graft. O(1) when the parent is held there already, else O(chain)."""
        chain = relearn(w, self._blocks, parent, tier)
        if chain and w.orphans:
            self._graft(w, [h for h, _ in chain], [k for _, k in chain])

    def _after_store(self, w: WorkerState, ev: BlockStored, keys: list[BlockKey], tier: StorageTier) -> None:
        """What a store's keys mean beyond its masks: window KV the rule infers, orphans waiting on its blocks.
        O(blocks)."""
        if w.inferred and tier <= StorageTier.HOST:
            self._win.infer_store(w, ev, keys, tier)
        if w.orphans:
            self._graft(w, ev.block_hashes, keys)

    def _graft(self, w: WorkerState, block_hashes: list[EngineHash], keys: list[BlockKey]) -> None:
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
                        self._blocks.insert(w, [h for h, _, _ in part], [k for _, k, _ in part], run.tier, below)
                    below = part[-1][1]
                # Children may wait on any block of the run, also one removed since: its key is known.
                work.extend(zip(ev.block_hashes, run_keys, strict=True))

    def _window_event(self, w: WorkerState, ev: BlockStored | BlockRemoved) -> Outcome:
        """A window-KV event: sets or clears the worker's window bit on blocks it holds on that tier. Events
        of other non-full-attention cache groups (vLLM's mamba, chunked-local ...) are counted and ignored."""
        if not is_window_event(ev):
            if ev.kv_cache_spec_kind.lower() in ("full_attention", "mla_attention", "mla"):  # type: ignore[union-attr]
                return self._store(w, ev) if isinstance(ev, BlockStored) else self._remove(w, ev)
            return self._reject(w, f"kv_cache_spec_kind {ev.kv_cache_spec_kind!r} is not indexed")
        tier = parse_medium(ev.medium)
        if tier > StorageTier.HOST:
            return self._reject(w, f"window KV on {tier.name}: only device and host window KV is tracked")
        self._win.track(w)  # the engine announces window KV: what the store rule guessed goes
        size = ev.kv_cache_spec_sliding_window
        if size is not None:
            if size <= 0:
                return self._reject(w, f"kv_cache_spec_sliding_window {size} is not positive")
            w.window = -(-size // self._block_size)
        elif not w.window:
            return self._reject(w, "window-KV event without kv_cache_spec_sliding_window")
        if isinstance(ev, BlockStored) and ev.block_size != self._block_size:
            w.stats.wrong_block_size += 1
            w.stats.block_size_wrong = True
            return self._reject(w, f"block_size {ev.block_size} differs from the index's {self._block_size}")
        self._win.announced(w, ev, tier)
        return Outcome.APPLIED

    def _remove(self, w: WorkerState, ev: BlockRemoved) -> Outcome:
        tier = parse_medium(ev.medium)
        unknown = self._blocks.remove(w, ev.block_hashes, tier)
        if unknown:
            w.stats.unknown_removals += unknown
            w.stats.last_error = f"removal of {unknown} block(s) not on {tier.name}"
            log.info("worker %s: %s", w.stream, w.stats.last_error)
        return Outcome.APPLIED
