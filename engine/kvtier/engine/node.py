"""A cache behind a ZMQ publisher: what one serving process runs.

The node publishes the cache's events as they are produced and answers state-dump
requests (kvtier's resync extension) with the cache's whole current residency,
consistent with the last live batch: the snapshot is taken under the same lock as
publishing, and the dump's events are built from it outside the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from kvtier.engine.cache import TieredCache
from kvtier.engine.dump import dump_batches
from kvtier.wire.codec import WireFormat
from kvtier.wire.protocol import EventBatch
from kvtier.wire.transport.publisher import DUMP_INTERVAL_S, MAX_DUMPS, Publisher


class EngineNode:
    """Publishes a :class:`TieredCache`'s events; thread-safe through :attr:`lock`."""

    def __init__(self, cache: TieredCache, endpoint: str, replay_endpoint: str | None = None, *,
                 dp_rank: int | None = None, buffer_size: int = 10_000,
                 wire_format: WireFormat = WireFormat.SGLANG, clock: Callable[[], float] = time.time,
                 dump_interval_s: float = DUMP_INTERVAL_S, max_dumps: int = MAX_DUMPS) -> None:
        """``dump_interval_s`` and ``max_dumps`` ration the state dumps the replay socket answers
        (:class:`~kvtier.wire.transport.publisher.Publisher`: per peer, and at once)."""
        self.cache = cache
        self.dp_rank = dp_rank
        self.clock = clock
        self.lock = threading.RLock()  # guards the cache and the publisher's live socket
        self.publisher = Publisher(endpoint, replay_endpoint, buffer_size=buffer_size, wire_format=wire_format,
                                   dump_provider=self._dump, dump_interval_s=dump_interval_s, max_dumps=max_dumps)

    def flush(self) -> int | None:
        """Publishes pending events as one batch; returns its seq, or None if there were none."""
        with self.lock:
            batch = self.cache.flush_events(ts=self.clock(), dp_rank=self.dp_rank)
            return None if batch is None else self.publisher.publish(batch)

    def step(self) -> int | None:
        """Handles completed copies and publishes what they changed."""
        with self.lock:
            self.cache.poll()
            return self.flush()

    def _dump(self) -> tuple[int, Iterator[EventBatch]]:
        # Only the snapshot (references, O(nodes)) is taken under the lock; the publisher's dump
        # thread builds and encodes the batches while the engine goes on.
        with self.lock:
            self.flush()  # everything before the dump is live, so the dump's seq covers it
            snap = self.cache.dump_snapshot()
            last_seq = self.publisher.last_seq
        return last_seq, dump_batches(snap, dp_rank=self.dp_rank)

    def close(self) -> None:
        self.publisher.close()
