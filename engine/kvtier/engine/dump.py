"""State dumps (kvtier's resync extension): a snapshot taken under the engine lock, events built outside.

A dump must be consistent with the last live batch, so the snapshot is taken while the engine
lock is held; but building a whole engine's ``BlockStored`` events (copies of every token id) took
seconds on a large cache and held the lock, and everything else, that long. The snapshot
therefore only captures references, O(nodes): a radix node's ``hashes`` and ``tokens`` lists are
replaced, never mutated in place (a split slices them into new lists), and L3 page metadata is
immutable once written. The events are built from the snapshot later, on the publisher's dump
thread, a batch at a time as the subscriber reads them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.l3.pagetree import PageMeta
from kvtier.wire.protocol import BlockStored, EngineHash, Event, EventBatch, PackedTokens, window_group


@dataclass(slots=True, frozen=True)
class NodeRun:
    """One radix node's pages on one tier, by reference."""

    hashes: list[int]  # the node's event hashes (never mutated in place)
    parent: int | None  # event hash of the parent's last page
    tokens: PackedTokens  # the node's token ids (immutable bytes)
    medium: str  # wire spelling of the tier


@dataclass(slots=True, frozen=True)
class Snapshot:
    """Everything a dump sends, captured under the engine lock in O(nodes + L3 pages)."""

    page_size: int  # tokens per page
    runs: list[NodeRun]  # device and host residency, parents first
    l3_pages: list[PageMeta]  # announced L3 pages, parents first
    l3_medium: str  # wire spelling of the L3 tier
    windows: list[NodeRun] = field(default_factory=list)  # SWA: runs whose window KV is on that tier
    window_tokens: int = 0  # SWA: the window, tokens (the events' kv_cache_spec_sliding_window)


def l3_runs(pages: Iterable[PageMeta], medium: str, page_size: int) -> list[BlockStored]:
    """BlockStored events for L3 pages, one per run of consecutive pages (parent then child). O(pages)."""
    runs: list[tuple[int | None, list[EngineHash], list[bytes]]] = []  # parent hash, hashes, packed tokens
    for meta in pages:
        if runs and runs[-1][1][-1] == meta.parent_hash:
            runs[-1][1].append(meta.event_hash)
            runs[-1][2].append(meta.tokens)
        else:
            runs.append((meta.parent_hash, [meta.event_hash], [meta.tokens]))
    # A run's tokens are unpacked once, not page by page.
    return [BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=b"".join(parts),
                        block_size=page_size, medium=medium) for parent, hashes, parts in runs]


def _run_event(r: NodeRun, page_size: int, **group: Any) -> BlockStored:
    hashes: list[EngineHash] = list(r.hashes)
    return BlockStored(block_hashes=hashes, parent_block_hash=r.parent, token_ids=r.tokens,
                       block_size=page_size, medium=r.medium, **group)


def dump_batches(snap: Snapshot, *, max_events: int = 256, dp_rank: int | None = None) -> Iterator[EventBatch]:
    """The snapshot as event batches, built lazily (no lock needed). O(tokens) in all."""
    events: list[Event] = []
    for r in snap.runs:
        events.append(_run_event(r, snap.page_size))
        if len(events) == max_events:
            yield EventBatch(ts=0.0, events=list(events), dp_rank=dp_rank)
            events.clear()
    events.extend(l3_runs(snap.l3_pages, snap.l3_medium, snap.page_size))
    events.extend(_run_event(r, snap.page_size, **window_group(snap.window_tokens)) for r in snap.windows)
    for i in range(0, len(events), max_events):
        yield EventBatch(ts=0.0, events=events[i:i + max_events], dp_rank=dp_rank)
