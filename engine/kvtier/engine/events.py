"""The events a cache has produced since its last flush, in the order its transitions happened (SPEC section 1).

The cache decides *when* an event is due (after the copy's acknowledgement, never at submission); this module
only says *what* each one carries: a node's pages with their parent and tokens for a store, the engine hashes
for a removal, and, for SWA engines that announce window KV (kvtier's extension), the same on the window-KV
cache group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtier.engine.radix import Node
from kvtier.wire.codec import medium_spelling
from kvtier.wire.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    StorageTier,
    window_group,
)


class EventLog:
    """Events not yet flushed. Single-threaded, as its cache."""

    __slots__ = ("_events", "_open", "page_size", "window_pages", "window_tokens")

    def __init__(self, page_size: int, window_pages: int, window_events: bool) -> None:
        self._events: list[Event] = []  # in emission order
        self._open: BlockRemoved | None = None  # the last removal this log made, which the next may join
        self.page_size = page_size  # tokens per page (the events' block size)
        self.window_pages = window_pages if window_events else 0  # SWA window announced in events (0: none)
        self.window_tokens = self.window_pages * page_size  # ``kv_cache_spec_sliding_window``: whole pages

    def __bool__(self) -> bool:
        """Whether any event waits for a flush. O(1)."""
        return bool(self._events)

    def flush(self, ts: float = 0.0, dp_rank: int | None = None) -> EventBatch | None:
        """The events since the last flush, as one batch (None if there are none). O(1)."""
        if not self._events:
            return None
        batch = EventBatch(ts=ts, events=self._events, dp_rank=dp_rank)
        self._events, self._open = [], None
        return batch

    def stored(self, node: Node, tier: StorageTier, **group: Any) -> None:
        """BlockStored of ``node``'s pages on ``tier``. O(pages)."""
        self._events.append(BlockStored(
            block_hashes=list(node.hashes), parent_block_hash=node.parent_hash(), token_ids=node.tokens,
            block_size=self.page_size, medium=medium_spelling(tier), **group))

    def removed(self, hashes: Iterable[EngineHash], tier: StorageTier, **group: Any) -> None:
        """BlockRemoved of the pages ``hashes`` name on ``tier``; nothing for none. Removals in a row on one tier and
        cache group are one event (an eviction that frees many nodes, or an L3 store trimmed page by page, is one
        ``BlockRemoved``): a removal's blocks are independent of each other, so the consumer's result is the same.
        O(pages)."""
        removed: list[EngineHash] = list(hashes)
        if not removed:
            return
        ev = BlockRemoved(block_hashes=removed, medium=medium_spelling(tier), **group)
        last = self._open
        if (last is not None and self._events and self._events[-1] is last and last.medium == ev.medium
                and last.group_idx == ev.group_idx and last.kv_cache_spec_kind == ev.kv_cache_spec_kind
                and last.kv_cache_spec_sliding_window == ev.kv_cache_spec_sliding_window):
            last.block_hashes.extend(removed)  # (this log made it, and nothing else holds it before the flush)
        else:
            self._events.append(ev)
            self._open = ev

    def window_stored(self, node: Node, tier: StorageTier) -> None:
        """``node``'s window KV is now on ``tier`` (after its full-attention BlockStored there). O(pages)."""
        if self.window_pages:
            self.stored(node, tier, **window_group(self.window_tokens))

    def window_removed(self, node: Node, tier: StorageTier) -> None:
        """``node``'s window KV left ``tier`` (before any full-attention BlockRemoved there). O(pages)."""
        if self.window_pages:
            self.removed(node.hashes, tier, **window_group(self.window_tokens))

    def extend(self, events: Iterable[Event]) -> None:
        """Events built elsewhere (L3 announcements), in order. O(events)."""
        self._events.extend(events)

    def cleared(self) -> None:
        """AllBlocksCleared. O(1)."""
        self._events.append(AllBlocksCleared())
