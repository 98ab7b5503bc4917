"""Window KV of sliding-window models: which workers keep the window part of a block, per tier.

A sliding-window model reuses a prefix only where the window before its end still has window KV: counting the
full-attention blocks alone over-counts (SPEC section 3's tombstones publish nothing in SGLang). A kvtier SWA
engine announces window KV per tier as vLLM's hybrid cache groups do (``kv_cache_spec_kind``
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
:meth:`WindowKV.note_routed` marks it. An inferred overlap is still an estimate: the rule cannot see window KV
dropped under pool pressure (tombstones publish nothing). A worker's first window event switches it to tracked
for good and drops its inferred bits. Without ``window_tokens``, such workers keep their full-attention overlap
and are marked untracked.

Invariant (asserted by :meth:`WindowKV._check`): no key maps to a zero mask, and a worker's window bit on a
tier is set only where its full-attention bit there is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager

from kvtier.indexer.index.closure import MaskMap
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.masklayout import SLOT_MASK, TIERS, slot_shift, tier_bit
from kvtier.indexer.index.workerstate import WorkerState
from kvtier.wire.overlap import OverlapScores, TierOverlap, window_cut
from kvtier.wire.protocol import BlockRemoved, BlockStored, StorageTier


class WindowKV:
    """Window-KV bits per block key, in the layout of the index's masks (SWA workers only)."""

    __slots__ = ("_masks", "bits")

    def __init__(self, masks: MaskMap) -> None:
        self.bits: dict[BlockKey, int] = {}  # key -> window bits (a subset of its mask's bits)
        self._masks = masks  # the index's key -> mask table (the same object, kept current by the index)

    def __bool__(self) -> bool:
        """Whether any block has window KV indexed. O(1)."""
        return bool(self.bits)

    def mark(self, key: BlockKey, bit: int) -> None:
        """Sets the window bit ``bit`` of ``key`` if the block has that worker and tier's bit (window KV never
        outlives the block's full KV there; an aliased engine hash leaves a stored block without it). O(1)."""
        if self._masks.get(key, 0) & bit:
            self.bits[key] = self.bits.get(key, 0) | bit

    def drop(self, key: BlockKey, keep: int) -> None:
        """Keeps only the window bits of ``key`` in ``keep``. O(1)."""
        m = self.bits.get(key)
        if m is not None:
            m &= keep
            if m:
                self.bits[key] = m
            else:
                del self.bits[key]

    def by_slot(self, guard: AbstractContextManager[object]) -> dict[int, list[tuple[BlockKey, int]]]:
        """Per worker slot, its (key, window tier bits) pairs, in one pass (for a snapshot). O(window bits).

        Routing marks window KV from the service's HTTP threads (:meth:`note_routed`, under the service's lock) while
        the event loop copies the index for a snapshot without it: the dict is copied under ``guard`` (that lock),
        then read."""
        with guard:
            bits = dict(self.bits)
        out: dict[int, list[tuple[BlockKey, int]]] = {}
        for key, m in bits.items():
            slot = 0
            while m:
                if m & SLOT_MASK:
                    out.setdefault(slot, []).append((key, m & SLOT_MASK))
                m >>= TIERS
                slot += 1
        return out

    def drop_slot(self, slot: int, keys: Iterable[BlockKey]) -> None:
        """Drops the slot's window bits on ``keys``. O(keys)."""
        keep = ~(SLOT_MASK << slot_shift(slot))
        for key in keys:
            self.drop(key, keep)

    def infer_store(self, w: WorkerState, ev: BlockStored, keys: list[BlockKey], tier: StorageTier) -> None:
        """The inferred-window rule (module docstring) for a store the index just applied: the last
        ``w.window`` blocks of the chain this batch is storing on ``tier`` carry window KV, but a host copy of a
        device page (a backup) has window KV where the device page has it, and a device page loaded from a
        host copy without window KV has none. O(blocks in the event + window)."""
        bit = tier_bit(w.slot, tier)
        dev, host = tier_bit(w.slot, StorageTier.DEVICE), tier_bit(w.slot, StorageTier.HOST)
        masks, win = self._masks, self.bits
        if tier is StorageTier.HOST and masks.get(keys[0], 0) & dev:
            for key in keys:  # a backup (a prefetch stores only pages the device lacks)
                if win.get(key, 0) & dev:
                    self.mark(key, bit)
            w.chains.pop(tier, None)
            return
        chain = w.chains.get(tier)
        tail = chain[1] + keys if chain is not None and ev.parent_block_hash == chain[0] else keys
        cut = max(0, len(tail) - w.window)
        if chain is not None and tail is not keys:
            for key in tail[:min(cut, len(chain[1]))]:  # extended past: those blocks lost their window KV
                self.drop(key, ~bit)
        kept = tail[cut:]
        for key in kept:
            if tier is StorageTier.DEVICE and masks.get(key, 0) & host and not win.get(key, 0) & host:
                continue  # loaded back from a host copy that has no window KV: it lands tombstoned
            self.mark(key, bit)
        w.chains[tier] = (ev.block_hashes[-1], kept)

    def track(self, w: WorkerState) -> None:
        """The worker announces window KV itself: what the store rule guessed for it goes. O(worker blocks)."""
        if w.inferred:
            self.drop_slot(w.slot, w.hashes.values())
            w.inferred = False
            w.chains.clear()

    def announced(self, w: WorkerState, ev: BlockStored | BlockRemoved, tier: StorageTier) -> None:
        """Sets (store) or clears (removal) the worker's window bit on ``tier`` for the blocks of a window
        event it holds there; the others are counted in its stats. O(blocks in the event)."""
        bit = tier_bit(w.slot, tier)
        masks, win, hashes = self._masks, self.bits, w.hashes
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

    def note_routed(self, w: WorkerState, keys: Sequence[BlockKey]) -> None:
        """A request with these prompt block keys was sent to ``w``, whose window KV is inferred: it will hold
        window KV for the prompt's last window. Blocks of it the worker has on device are marked now, as the
        engine publishes no store for them; the rest comes with their stores. O(window)."""
        bit = tier_bit(w.slot, StorageTier.DEVICE)
        for key in keys[max(0, len(keys) - w.window):]:
            self.mark(key, bit)

    def cut(self, keys: list[BlockKey], result: OverlapScores, workers: Iterable[WorkerState]) -> None:
        """Replaces the overlaps of workers with a window (tracked or inferred) by their usable ones. O(m) per
        such worker with a prefix of m blocks."""
        wins: list[int] | None = None
        for w in workers:
            if not w.window:
                continue
            result.windows[w.stream] = w.window
            if w.inferred:
                result.inferred.add(w.stream)
            raw = result.workers[w.stream]
            if not raw.external:
                continue
            if wins is None:
                get = self.bits.get
                wins = [get(k, 0) for k in keys[:max(o.external for o in result.workers.values())]]
            shift = slot_shift(w.slot)
            ok = [bool(m >> (shift + StorageTier.DEVICE) & 1) for m in wins[:raw.device]]
            ok += [bool(m >> (shift + StorageTier.HOST) & 1) for m in wins[raw.device:raw.host]]
            ok += [True] * (raw.external - raw.host)  # L3 pages carry window KV
            result.raw[w.stream] = raw
            result.workers[w.stream] = TierOverlap(*(window_cut(ok, lvl, w.window)
                                                     for lvl in (raw.device, raw.host, raw.disk, raw.external)))

    def _check(self) -> None:
        """Asserts the module's invariant. O(keys with window KV)."""
        for key, m in self.bits.items():
            assert m, f"key {key:#x} maps to an empty window mask"
            assert m & ~self._masks.get(key, 0) == 0, f"key {key:#x}: window KV on a tier without the block"
