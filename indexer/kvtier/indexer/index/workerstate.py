"""What the index keeps per worker stream, and what applying one event to it did."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import EngineHashes
from kvtier.indexer.index.masklayout import TIERS
from kvtier.indexer.index.orphans import OrphanPool
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import EngineHash, StorageTier


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
    relearned: int = 0  # blocks dropped at a loss indexed again on a tier a later store proved they are held on
    wrong_block_size: int = 0  # of events_rejected, stores of another block size (a misconfigured --block-size)
    block_size_wrong: bool = False  # its last store had another block size (none of the index's size since)
    internal_errors: int = 0  # of events_rejected, events the index raised on midway: the worker was dropped
    last_error: str | None = None  # the most recent rejection reason


@dataclass(slots=True)
class WorkerState:
    """One worker stream's part of the index. Its blocks' bits live in the index's masks, at ``slot``
    (:mod:`kvtier.indexer.index.masklayout`); the keys carrying them are exactly the values of ``hashes``."""

    stream: StreamId  # identity
    slot: int  # bit position / TIERS in every mask
    # Engine hash -> key, injective: a compiled table, which keeps ``bytes`` hashes in a dict of its own
    # (kvtier.indexer.index.keytable.EngineHashes).
    hashes: EngineHashes = field(default_factory=EngineHashes)
    counts: list[int] = field(default_factory=lambda: [0] * TIERS)  # blocks per tier
    stats: WorkerStats = field(default_factory=WorkerStats)  # counters
    orphans: OrphanPool = field(default_factory=OrphanPool)  # stores waiting for their parent
    # Engine hash -> key of blocks dropped at a loss for good: no longer reported as held, but
    # still the parent of a store that extends them (engine hashes name content, so the key stays right).
    ghosts: dict[EngineHash, BlockKey] = field(default_factory=dict)
    # Engine hash -> its parent's engine hash (None: stored under the root), where the index knows it, for blocks
    # dropped at a loss and the first blocks of stores made under one: how a store that proves a dropped block
    # held finds that block's ancestors (kvtier.indexer.index.relearn). At most as many entries as ``ghosts`` allows.
    ups: dict[EngineHash, EngineHash | None] = field(default_factory=dict)
    # Tiers (bit ``tier``) on which the engine keeps its blocks prefix-closed, as declared for it
    # (TieredIndex.set_prefix_closed): a store there proves its parent chain is held there too.
    closed_tiers: int = 0
    partial: bool = False  # events were lost for good: prefixes stored before the loss are unknown
    window: int = 0  # window length in blocks: announced by window events, or the index's (0: untracked)
    inferred: bool = False  # window bits come from the store rule (no window events seen), not from events
    # Inferred window KV: per tier, the last block's engine hash and the last ``window`` keys of the chain
    # that the current batch is storing (a store extending it continues it). Reset at each batch.
    chains: dict[StorageTier, tuple[EngineHash, list[BlockKey]]] = field(default_factory=dict)
