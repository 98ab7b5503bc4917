"""The router's global tiered index: which worker holds which block on which tier.

Layout. Every block key maps to one bitmask with four bits per worker slot (bit ``4 * slot + tier``; equal masks
share one pool entry). A worker's engine hashes resolve to keys through a per-worker table, used only to find a
stored block's parent and to resolve ``BlockRemoved``; router keys are always recomputed from token ids. Links
from each key to the children stored under it tell whether every worker's tiers are prefix-closed, as radix engines keep
them; while they are, a query binary-searches for the ends of its runs of equal masks instead of
looking every block up (:mod:`kvtier.indexer.index.closure`).

Storage. The masks, each worker's engine hashes and the links live in compiled open-addressing tables
(:mod:`kvtier.indexer.index.keytable`), and a store, a removal or a query is one compiled call over its blocks
(:class:`kvtier.indexer.index.blockmasks.BlockMasks`, :class:`kvtier.indexer.index.levels.DepthFinder`); the tables
read as mappings for everything but the hot paths. There is no other implementation: where numba cannot load,
constructing an index raises :class:`kvtier.kernels.jit.KernelsUnavailable` naming the platform.

Invariants (asserted by :meth:`TieredIndex._check`):

* no key maps to a zero mask;
* for every worker, the keys carrying any of its bits are exactly the values of
  its engine-hash dict, and the dict is injective (one engine hash per block);
* ``counts[tier]`` of a worker equals the number of keys carrying its tier bit;
* links name only keys somebody holds as parents, and a held block whose linked parent is not held
  on that tier by that worker is among its loose blocks (:class:`kvtier.indexer.index.closure.PrefixClosure`);
* slots are unique and no freed slot has bits left anywhere;
* window KV (SWA models, events of kind ``kvtier.wire.WINDOW_KIND``) has a second mask per key with the same
  layout: a worker's window bit on a tier is set only where its full-attention bit there is
  (:class:`kvtier.indexer.index.windowkv.WindowKV`).

Pieces kept apart: the mask layout (:mod:`kvtier.indexer.index.masklayout`), the per-worker state
(:mod:`kvtier.indexer.index.workerstate`), the masks and what events change in them
(:mod:`kvtier.indexer.index.blockmasks`),
window KV of sliding-window models (:mod:`kvtier.indexer.index.windowkv`), and reading a query's depths off the masks
(:mod:`kvtier.indexer.index.levels`), applying events: validation, parents, orphans
(:mod:`kvtier.indexer.index.applier`), and
the workers' slots (:mod:`kvtier.indexer.index.slots`). This module ties them together, and answers queries.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

import msgspec
import numpy as np

from kvtier.indexer.index import snapshot as snapfmt
from kvtier.indexer.index.applier import EventApplier
from kvtier.indexer.index.blockmasks import BlockMasks
from kvtier.indexer.index.closure import MaskMap
from kvtier.indexer.index.keys import BlockKey, block_keys
from kvtier.indexer.index.keytable import KERNELS, KeyTable
from kvtier.indexer.index.levels import DepthFinder
from kvtier.indexer.index.masklayout import SLOT_MASK, TIERS
from kvtier.indexer.index.orphans import OrphanStats
from kvtier.indexer.index.relearn import MAX_REMEMBERED, ancestry
from kvtier.indexer.index.slots import WorkerSlots
from kvtier.indexer.index.windowkv import WindowKV
from kvtier.indexer.index.workerstate import Outcome, WorkerState, WorkerStats
from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import OverlapScores
from kvtier.wire.protocol import (
    AllBlocksCleared,
    EngineHash,
    Event,
    EventBatch,
    PackedTokens,
    StorageTier,
    WorkerId,
)

__all__ = ["Outcome", "TieredIndex", "WorkerStats"]

log = logging.getLogger(__name__)



class TieredIndex:
    """Global per-worker tiered block index for one block size.

    Not thread-safe: callers serialise access (the service holds one lock).
    """

    def __init__(self, block_size: int, *, window_tokens: int = 0) -> None:
        """``window_tokens``: the served model's sliding window, used to infer window KV of workers that
        send no window events (see :mod:`kvtier.indexer.index.windowkv`); 0 leaves them untracked."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window_tokens < 0:
            raise ValueError(f"window_tokens must be >= 0, got {window_tokens}")
        self.block_size = block_size
        self.window_tokens = window_tokens
        # What each worker serves in a disaggregated pool (kvtier.indexer.routing.disagg): "prefill", "decode";
        # absent: both
        self._roles: dict[StreamId, str] = {}
        self._default_window = -(-window_tokens // block_size)  # in blocks
        KERNELS.require()  # the compiled tables are the index (a clear error where numba cannot load)
        self._masks = KeyTable()
        self._workers = WorkerSlots(self._new_worker)  # worker streams and the mask slots they own
        self._win = WindowKV(self._masks)  # window-KV bits (SWA workers only: kvtier.indexer.index.windowkv)
        # Reads queries' depths off the masks (kvtier.indexer.index.levels); what events change in them
        # (kvtier.indexer.index.blockmasks).
        self._depths = DepthFinder(self._masks, self._workers.owners)
        self._blocks = BlockMasks(self._masks, self._win)
        self._closure = self._blocks.closure  # whether queries may binary-search (kvtier.indexer.index.closure)
        self._events = EventApplier(block_size, self._blocks, self._win)  # validates and applies events

    # --- workers -------------------------------------------------------------------------

    @property
    def streams(self) -> list[StreamId]:
        return list(self._workers)

    def _new_worker(self, stream: StreamId, slot: int) -> WorkerState:
        """The state of a worker added at ``slot`` (called by :class:`WorkerSlots`), with the index's window. O(1)."""
        return WorkerState(stream, slot, window=self._default_window, inferred=bool(self._default_window))

    def add_worker(self, stream: StreamId) -> None:
        """Registers a worker with no blocks (it then appears in every query). O(1)."""
        self._workers.add(stream)

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
        """Blocks the worker holds per tier (zeros for an unknown worker, as :meth:`worker_hashes`). O(1)."""
        w = self._workers.get(stream)
        return {t: w.counts[t] if w is not None else 0 for t in StorageTier}

    def worker_hashes(self, stream: StreamId) -> dict[StorageTier, set[EngineHash]]:
        """The engine hashes the worker holds per tier, as the index sees them (empty for an unknown
        worker). O(worker blocks)."""
        return _hashes_by_tier(self._workers.get(stream), self._masks, list(StorageTier))

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
        instead of waiting as orphans; on a worker declared prefix-closed on some tiers
        (:meth:`set_prefix_closed`), with their parents, so that a later store there regains the
        chain it proves held (:mod:`kvtier.indexer.index.relearn`).
        """
        w = self._workers.add(stream)
        if partial:
            items = list(w.hashes.items())  # (all at once from a compiled table)
            if w.closed_tiers:  # where a later store may prove them held: their parents (kvtier.indexer.index.relearn)
                w.ups.update(ancestry(w, self._blocks, items))
                while len(w.ups) > MAX_REMEMBERED:
                    del w.ups[next(iter(w.ups))]
            w.ghosts.update(items)
            while len(w.ghosts) > MAX_REMEMBERED:
                del w.ghosts[next(iter(w.ghosts))]
        else:
            w.ghosts.clear()
            w.ups.clear()
        self._blocks.clear_slot(w)
        w.orphans.clear()
        w.chains.clear()
        w.stats.clears += 1
        w.partial = partial

    def set_prefix_closed(self, stream: StreamId, tiers: Iterable[StorageTier]) -> None:
        """Declares the tiers on which the worker's engine keeps its blocks prefix-closed (a block held there has its
        parent held there): the device for SGLang, device and host for kvtier's engine, none for vLLM (the
        default). After a loss for good, a store on one of them regains the chain it proves held
        (:mod:`kvtier.indexer.index.relearn`); a wrong declaration would report blocks the engine may not hold. O(1)."""
        closed = 0
        for t in tiers:
            closed |= 1 << StorageTier(t)
        self._workers.add(stream).closed_tiers = closed

    def prefix_closed(self, stream: StreamId) -> set[StorageTier]:
        """The tiers :meth:`set_prefix_closed` declared for the worker. O(1)."""
        w = self._workers.get(stream)
        return {t for t in StorageTier if w is not None and w.closed_tiers >> t & 1}

    def set_role(self, stream: StreamId, role: str) -> None:
        """Declares what the worker serves: ``"prefill"`` (its overlaps are prompt KV it need not compute, on every
        tier), ``"decode"`` (its device overlap is KV it need not receive) or ``"both"``. O(1)."""
        if role not in ("prefill", "decode", "both"):
            raise ValueError(f"role {role!r}: expected prefill, decode or both")
        if role == "both":
            self._roles.pop(stream, None)
        else:
            self._roles[stream] = role

    def role(self, stream: StreamId) -> str:
        """What :meth:`set_role` declared for the worker (``"both"`` unless told). O(1)."""
        return self._roles.get(stream, "both")

    def remove_worker(self, stream: StreamId) -> None:
        """Forgets the worker and frees its slot. O(blocks of the worker)."""
        if stream in self._workers:
            self.clear_worker(stream)
            self._workers.remove(stream)

    # --- events --------------------------------------------------------------------------

    def apply_batch(self, stream: StreamId, batch: EventBatch) -> list[Outcome]:
        """Applies a batch's events in order; one outcome per event."""
        return self.apply_events(stream, batch.events)

    def apply_events(self, stream: StreamId, events: Sequence[Event]) -> list[Outcome]:
        """Applies the events of one batch (all of it, or those a router listens to) in order; one outcome
        per event. A batch is the unit of the inferred-window rule: events applied one by one with
        :meth:`apply` continue the last batch. O(blocks in the events)."""
        w = self._workers.add(stream) if events else self._workers.get(stream)  # (no events add no worker)
        if w is None:
            return []
        w.chains.clear()
        return [self._apply(w, ev) for ev in events]

    def window_hashes(self, stream: StreamId) -> dict[StorageTier, set[EngineHash]]:
        """The engine hashes whose window KV the worker holds, per tier (device, host). O(worker blocks)."""
        return _hashes_by_tier(self._workers.get(stream), self._win.bits, [StorageTier.DEVICE, StorageTier.HOST])

    def apply(self, stream: StreamId, event: Event) -> Outcome:
        """Applies one event of ``stream``. O(blocks in the event).

        Never raises for bad input: it is counted, logged with the worker id and
        reported as ``REJECTED``; a store whose parent is unknown is held as an orphan
        (``ORPHANED``, see :mod:`kvtier.indexer.index.orphans`). Either way the next event of the
        batch applies as usual, and other workers' state is never touched (:mod:`kvtier.indexer.index.applier`).
        """
        return self._apply(self._workers.add(stream), event)

    def _apply(self, w: WorkerState, event: Event) -> Outcome:
        """:meth:`apply`, for the worker's state. O(blocks in the event)."""
        if isinstance(event, AllBlocksCleared):
            self.clear_worker(w.stream)
            outcome = Outcome.APPLIED
        else:
            try:
                outcome = self._events.apply(w, event)
            except Exception as exc:  # (an input the applier's checks let through broke it midway)
                outcome = self._contain(w, event, exc)
        if outcome is Outcome.APPLIED:
            w.stats.events_applied += 1
        return outcome

    def _contain(self, w: WorkerState, event: Event, exc: Exception) -> Outcome:
        """An event the applier raised on, having changed part of the worker's state: that state can no longer be
        trusted, so the worker is dropped (every block and orphan, no remembered keys: its hashes may map wrongly)
        and marked partial until its state is complete again; the event counts as rejected and the index serves on.
        Other workers' bits are untouched: their slots are theirs. O(blocks of the worker)."""
        self.clear_worker(w.stream)
        w.partial = True
        w.stats.internal_errors += 1
        w.stats.events_rejected += 1
        w.stats.last_error = f"{type(event).__name__} broke the index ({type(exc).__name__}: {exc}); worker dropped"
        if worth_logging(w.stats.internal_errors):
            log.error("worker %s: %s%s", w.stream, w.stats.last_error, suffix(w.stats.internal_errors),
                      exc_info=exc)
        return Outcome.REJECTED

    def note_routed(self, stream: StreamId, keys: Sequence[BlockKey]) -> None:
        """A request with these prompt block keys was sent to ``stream``. A worker whose window KV is inferred
        will hold window KV for the prompt's last window: blocks of it the worker has on device are marked
        now, as the engine publishes no store for them; the rest comes with their stores. Nothing for other
        workers. O(window)."""
        w = self._workers.get(stream)
        if w is None or not w.inferred:
            return
        self._win.note_routed(w, keys)

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
        (see :mod:`kvtier.indexer.index.keys`). O(len(token_ids) + items)."""
        return block_keys(token_ids, self.block_size, lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items)

    def find_matches_keys(self, keys: list[BlockKey], *, window_aware: bool = False) -> OverlapScores:
        """Per-worker tier overlaps of a request given as block keys.

        While every worker's tiers are prefix-closed (radix engines: :mod:`kvtier.indexer.index.closure`),
        O(r log m) dict lookups for the r runs of equal masks over the m leading blocks anybody holds;
        otherwise one lookup per leading block (in C) and vectorised work past
        ``kvtier.indexer.index.levels.MAX_RUNS`` runs (:class:`kvtier.indexer.index.levels.DepthFinder`). Either way
        independent of the number of indexed blocks. ``window_aware``: workers that announce window KV get their
        usable overlap (:mod:`kvtier.indexer.index.windowkv`), their raw one in ``raw``; O(m) more per such worker
        holding a prefix.
        """
        overlaps, pool = self._depths.overlaps(keys, self._closure.closed, self._workers.end)
        workers = self._workers.zeros()
        workers.update(overlaps)
        result = OverlapScores(len(keys), workers, pool)
        if window_aware:
            self._win.cut(keys, result, self._workers.values())
        return result

    # --- snapshot ------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole index as bytes (:mod:`kvtier.indexer.index.snapshot`; the same index, the same bytes).
        :meth:`capture`, then :func:`kvtier.indexer.index.snapshot.encode`."""
        return snapfmt.encode(self.capture())

    def capture(self, guard: AbstractContextManager[object] | None = None) -> snapfmt.Capture:
        """A copy of the index for a snapshot, which :func:`kvtier.indexer.index.snapshot.encode` turns into bytes,
        on another thread if need be (the index may change meanwhile). ``guard``: held while the window KV is copied,
        which :meth:`note_routed` changes from other threads (the service's lock; the index's writer may copy the
        rest without it). O(total entries), a few compiled passes."""
        records, blocks = [], []
        windows = self._win.by_slot(guard or nullcontext())
        for w in self._workers.values():
            hashes, keys, signed = w.hashes.export()
            blocks.append((keys, self._masks.slot_bits(keys, w.slot), hashes))
            records.append(snapfmt.WorkerRecord(
                worker=w.stream.worker, dp_rank=w.stream.dp_rank, partial=w.partial, keys=b"", bits=b"", hashes=b"",
                signed=signed, window=w.window, inferred=w.inferred, window_bits=windows.get(w.slot, []),
                loose=None if w.slot in self._closure.unknown else self._closure.loose_of(w.slot, TIERS),
                # Then what is held outside the blocks: the keys of blocks dropped at a loss and their parents, oldest
                # first (the order they are forgotten in), and the stores awaiting a parent.
                ghosts=list(w.ghosts.items()), orphans=w.orphans.dump(), closed_tiers=w.closed_tiers,
                ups=list(w.ups.items())))
        head = snapfmt.Snapshot(version=snapfmt.VERSION, block_size=self.block_size,
                                 window_tokens=self.window_tokens, workers=records, links=b"")
        return snapfmt.Capture(head, blocks, self._closure.link_pairs())

    @classmethod
    def restore(cls, data: bytes) -> TieredIndex:
        """Inverse of :meth:`snapshot`, which also reads version-1 snapshots. Raises ``ValueError`` naming what is
        wrong with ``data``. O(total entries), a few compiled passes."""
        try:
            snap = snapfmt.decode(data)
            index = cls(snap.block_size, window_tokens=snap.window_tokens)
            for rec in snap.workers:
                b = snapfmt.blocks(rec)
                stream = StreamId(WorkerId(rec.worker), rec.dp_rank)
                if stream in index._workers:
                    raise ValueError(f"worker {rec.worker!r} rank {rec.dp_rank} twice")
                w = index._workers.add(stream)
                w.partial, w.window, w.inferred = rec.partial, rec.window, rec.inferred
                if len(b.keys):  # (a worker holding nothing widens no mask)
                    index._masks.add_slot_bits(b.keys, b.bits, w.slot)
                w.hashes.load(b.hashes, b.keys, rec.signed)
                w.counts[:] = [int(np.count_nonzero(b.bits & (1 << t))) for t in range(TIERS)]
                shift = TIERS * w.slot
                for key, bits in b.window:
                    index._win.bits[key] = index._win.bits.get(key, 0) | bits << shift
                if len(b.keys):  # (without loose blocks the worker is not known to be prefix-closed: queries scan)
                    index._closure.restore_slot(w.slot, b.loose)
                w.ghosts.update((eh, BlockKey(key)) for eh, key in rec.ghosts)
                w.orphans.load(rec.orphans, snap.block_size)
                w.closed_tiers = rec.closed_tiers & ((1 << TIERS) - 1)
                w.ups.update(rec.ups)
            index._closure.link_all(*snapfmt.links(snap))
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError, ValueError, OverflowError, IndexError,
                RecursionError) as exc:  # (RecursionError: msgpack nested deeper than a decoder goes)
            raise ValueError(f"not an index snapshot: {exc}") from None
        return index

    # --- invariants ----------------------------------------------------------------------

    def _check(self) -> None:
        """Asserts every structural invariant. O(total entries)."""
        self._workers._check()
        for w in self._workers.values():
            assert not w.inferred or w.window, f"{w.stream}: window KV inferred with no window"
            assert w.inferred or not w.chains, f"{w.stream}: store chains kept for a worker that is not inferred"
            assert all(len(c[1]) <= w.window for c in w.chains.values()), f"{w.stream}: a chain tail over the window"
        held: dict[int, set[BlockKey]] = {w.slot: set() for w in self._workers.values()}
        for key, m in self._masks.items():
            assert m, f"key {key:#x} maps to an empty mask"
            s = 0
            while m:
                if m & SLOT_MASK:
                    assert s in held, f"key {key:#x} has bits of slot {s}, which no worker owns"
                    held[s].add(key)
                m >>= TIERS
                s += 1
        for w in self._workers.values():
            values = set(w.hashes.values())
            assert len(values) == len(w.hashes), f"worker {w.stream}: two engine hashes name one block"
            assert values == held[w.slot], (
                f"worker {w.stream}: {len(values - held[w.slot])} mapped keys without bits, "
                f"{len(held[w.slot] - values)} keys with bits but no engine hash")
            shift = TIERS * w.slot
            for t in range(TIERS):
                n = sum(1 for k in values if self._masks[k] >> (shift + t) & 1)
                assert w.counts[t] == n, f"worker {w.stream}: counts[{t}]={w.counts[t]} but {n} blocks"
            w.orphans._check()
            assert len(w.ghosts) <= MAX_REMEMBERED and len(w.ups) <= MAX_REMEMBERED, f"worker {w.stream}: unbounded"
        cl = self._closure
        for (slot, t), loose in cl.loose.items():
            assert loose, f"slot {slot} tier {t}: an empty loose set is kept"
            assert slot in held, f"slot {slot}: loose blocks of a slot no worker owns"
            for key in loose:
                assert self._masks.get(key, 0) >> (TIERS * slot + t) & 1, f"slot {slot}: loose {key:#x} not held"
        for parent in cl.kids:
            pm = self._masks.get(parent, 0)
            assert pm, f"links kept for {parent:#x}, which nobody holds"
            for kid in cl.children(parent):
                km = self._masks.get(kid, 0)
                for slot in held:
                    for t in range(TIERS):
                        bit = TIERS * slot + t
                        if km >> bit & 1 and not pm >> bit & 1 and slot not in cl.unknown:
                            assert kid in cl.loose.get((slot, t), ()), (
                                f"slot {slot} tier {t}: {kid:#x} held without its parent {parent:#x} but not loose")
        cl._check()
        self._win._check()
        self._masks._check()


def _hashes_by_tier(w: WorkerState | None, masks: MaskMap,
                    tiers: list[StorageTier]) -> dict[StorageTier, set[EngineHash]]:
    """Per tier of ``tiers``, the engine hashes of worker ``w`` (none if None) whose bit ``masks`` has.
    O(worker blocks)."""
    out: dict[StorageTier, set[EngineHash]] = {t: set() for t in tiers}
    if w is None:
        return out
    shift = TIERS * w.slot
    for eh, key in w.hashes.items():
        bits = masks.get(key, 0) >> shift
        for t in tiers:
            if bits >> t & 1:
                out[t].add(eh)
    return out
