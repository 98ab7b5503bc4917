"""What each delivery of a subscriber does to the tiered index (the one place that decides it).

The indexer service, the tests' faulty-wire machines and anything else that feeds a
:class:`~kvtier.indexer.index.tiered.TieredIndex` from :class:`~kvtier.wire.transport.stream.StreamTracker`
deliveries go through :class:`IndexConsumer`, so they all recover the same way:

* ``Received``: every event of the batch is applied; a bad one is counted and skipped, and a store
  whose parent is unknown is held as an orphan, so one bad event costs one event and never asks
  for a resync (a replay would deliver the same event again).
* ``ResyncStarted`` / ``PublisherRestarted``: the worker is cleared; a full replay or a dump
  rebuilds it.
* ``ResyncNeeded``: events were lost for good. The worker is cleared once (removals may have been
  lost with the rest, and the index must never report a block the engine does not hold) and marked
  *partial*; live events keep being applied, so every prefix stored from then on is exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire.notices import Delivery, PublisherRestarted, Received, ResyncNeeded, ResyncStarted, StreamId
from kvtier.wire.protocol import Event

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Lag:
    """Delay between a live batch's publisher timestamp and its application."""

    last: float = 0.0  # seconds, latest live batch
    max: float = 0.0  # the largest seen


@dataclass(slots=True)
class ConsumerCounters:
    """What the consumer applied, across streams."""

    batches: int = 0  # batches applied
    outcomes: dict[str, int] = field(default_factory=dict)  # Outcome.value (other than applied) -> count
    lag: dict[StreamId, Lag] = field(default_factory=dict)  # per stream, live batches only


class IndexConsumer:
    """Applies deliveries to ``index``; see the module docstring for what each one does.

    Not thread-safe: the caller holds whatever lock guards the index.
    """

    def __init__(self, index: TieredIndex, *, wall_clock: Callable[[], float] = time.time,
                 keep: Callable[[Event], bool] | None = None) -> None:
        self.index = index
        self.counters = ConsumerCounters()
        self._wall = wall_clock
        self._keep = keep  # events it returns False for are skipped (a router listening to some tiers)
        self._ranks_told: set[StreamId] = set()  # streams whose batches named another dp rank (logged once each)

    def feed(self, deliveries: Iterable[Delivery]) -> None:
        """Applies each delivery in order. O(events delivered), plus O(blocks) per clear."""
        for d in deliveries:
            if isinstance(d, Received):
                self._apply(d)
            elif isinstance(d, ResyncStarted | PublisherRestarted):
                self.index.clear_worker(d.stream)
            elif isinstance(d, ResyncNeeded):
                self.index.clear_worker(d.stream, partial=True)
            else:
                log.debug("%s", d)

    def _apply(self, d: Received) -> None:
        outcomes, keep = self.counters.outcomes, self._keep
        rank = d.batch.dp_rank
        if rank is not None and rank != d.stream.dp_rank and d.stream not in self._ranks_told:
            self._ranks_told.add(d.stream)
            log.warning("stream %s (dp rank %d): its batches name dp rank %d; the endpoint's dp= (dp_rank in TOML) is "
                        "the rank the router sends its blocks' requests to: check it names the rank that publishes "
                        "there", d.stream.worker, d.stream.dp_rank, rank)
        events = d.batch.events if keep is None else [ev for ev in d.batch.events if keep(ev)]
        for outcome in self.index.apply_events(d.stream, events):
            if outcome is not Outcome.APPLIED:
                outcomes[outcome.value] = outcomes.get(outcome.value, 0) + 1
        self.counters.batches += 1
        if d.source == "live" and d.batch.ts > 0:
            lag = self.counters.lag.setdefault(d.stream, Lag())
            lag.last = max(0.0, self._wall() - d.batch.ts)
            lag.max = max(lag.max, lag.last)
