"""State dumps (kvtier's resync extension): a snapshot taken under the engine lock, events built outside.

A dump must be consistent with the last live batch, so the snapshot is taken while the engine
lock is held; but building a whole engine's ``BlockStored`` events (copies of every token id) took
seconds on a large cache and held the lock, and everything else, that long. The snapshot
therefore only captures references, O(nodes): a radix node's ``hashes`` and ``tokens`` lists are
replaced, never mutated in place (a split slices them into new lists), and L3 page metadata is
immutable once written. The events are built from the snapshot later, on the publisher's dump
thread, a batch at a time as the subscriber reads them.

A dump batch carries at most ``max_events`` events and about ``max_bytes`` of token ids and hashes as msgpack
encodes them (:func:`wire_bytes`): a node run longer than that is cut into consecutive parts, each the next's
parent, so that no frame of a dump passes a subscriber's cap on frame size (``max_frame_bytes``, far above it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvtier.engine.l3.pagetree import PageMeta
from kvtier.wire.protocol import BlockStored, EngineHash, Event, EventBatch, PackedTokens, window_group

#: The most token and hash bytes (msgpack-encoded, :func:`wire_bytes`) a dump batch carries.
DUMP_BATCH_BYTES = 4 << 20


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


def wire_bytes(e: BlockStored) -> int:
    """An upper bound of the bytes msgpack spends on ``e``'s token ids and hashes (5 a token id, 9 a hash). O(1)."""
    return 5 * max(e.num_tokens, 0) + 9 * len(e.block_hashes)


def _parts(e: BlockStored, max_bytes: int) -> Iterator[BlockStored]:
    """``e``, cut into consecutive runs of pages of at most about ``max_bytes`` each (at least a page each), each
    part's parent the last page of the one before. O(its tokens)."""
    pages = len(e.block_hashes)
    per_page = max(1, wire_bytes(e) // max(pages, 1))
    step = max(1, max_bytes // per_page)
    if pages <= step:
        yield e
        return
    width = len(e.token_ids) // pages  # (token ids per page, packed or listed)
    parent = e.parent_block_hash
    for i in range(0, pages, step):
        hashes = e.block_hashes[i:i + step]
        yield msgspec.structs.replace(
            e, block_hashes=hashes, parent_block_hash=parent, token_ids=e.token_ids[i * width:(i + step) * width],
            extra_keys=None if e.extra_keys is None else e.extra_keys[i:i + step])
        parent = hashes[-1]


def _run_event(r: NodeRun, page_size: int, **group: Any) -> BlockStored:
    hashes: list[EngineHash] = list(r.hashes)
    return BlockStored(block_hashes=hashes, parent_block_hash=r.parent, token_ids=r.tokens,
                       block_size=page_size, medium=r.medium, **group)


def dump_batches(snap: Snapshot, *, max_events: int = 256, max_bytes: int = DUMP_BATCH_BYTES,
                 dp_rank: int | None = None) -> Iterator[EventBatch]:
    """The snapshot as event batches of at most ``max_events`` events and about ``max_bytes`` (:func:`wire_bytes`;
    a longer run is cut into parts), built lazily (no lock needed). O(tokens) in all."""
    events: list[Event] = []
    size = 0

    def stored() -> Iterator[BlockStored]:
        yield from (_run_event(r, snap.page_size) for r in snap.runs)
        yield from l3_runs(snap.l3_pages, snap.l3_medium, snap.page_size)
        yield from (_run_event(r, snap.page_size, **window_group(snap.window_tokens)) for r in snap.windows)

    for whole in stored():
        for e in _parts(whole, max_bytes):
            n = wire_bytes(e)
            if events and (len(events) == max_events or size + n > max_bytes):
                yield EventBatch(ts=0.0, events=events, dp_rank=dp_rank)
                events, size = [], 0
            events.append(e)
            size += n
    if events:
        yield EventBatch(ts=0.0, events=events, dp_rank=dp_rank)
