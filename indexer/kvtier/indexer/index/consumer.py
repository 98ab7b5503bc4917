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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire.notices import Delivery, PublisherRestarted, Received, ResyncNeeded, ResyncStarted, StreamId
from kvtier.wire.protocol import Event

log = logging.getLogger(__name__)

#: Work (an event, and a block per block hash it names) applied per slice of a batch (:meth:`IndexConsumer.slices`),
#: so that a reader waits for a slice, never a whole batch (a slice of clears, the events costliest to apply for their
#: size, holds the lock longest).
SLICE_WORK = 4096


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

    def slices(self, d: Delivery, work: int = SLICE_WORK) -> Iterator[None]:
        """Applies ``d`` as :meth:`feed` does, a slice of a batch at a time: a batch of more than ``work`` units (an
        event, and a block per block hash it names) yields after each slice of about that many but the last, where
        the caller may let readers of the index in (the index is whole after every event; the batch's later events
        are not applied yet); anything else is fed whole. Run it to its end. O(events delivered)."""
        if isinstance(d, Received) and _slice_end(d.batch.events, 0, work) < len(d.batch.events):
            yield from self._sliced(d, work)
            return
        self.feed((d,))

    def _sliced(self, d: Received, work: int) -> Iterator[None]:
        """:meth:`slices` of a batch of more than one slice (counted before ``keep`` filters it)."""
        events = self._events(d)
        end = _slice_end(events, 0, work)
        self._count(self.index.apply_events(d.stream, events[:end]))  # (it begins the batch: the inferred-window rule)
        while end < len(events):
            yield
            start, end = end, _slice_end(events, end, work)
            self._count([self.index.apply(d.stream, ev) for ev in events[start:end]])  # (apply continues the batch)
        self._applied(d)

    def _apply(self, d: Received) -> None:
        self._count(self.index.apply_events(d.stream, self._events(d)))
        self._applied(d)

    def _events(self, d: Received) -> Sequence[Event]:
        """The batch's events the index takes (those ``keep`` keeps); a batch naming another dp rank than its stream's
        is logged, once per stream."""
        rank = d.batch.dp_rank
        if rank is not None and rank != d.stream.dp_rank and d.stream not in self._ranks_told:
            self._ranks_told.add(d.stream)
            log.warning("stream %s (dp rank %d): its batches name dp rank %d; the endpoint's dp= (dp_rank in TOML) is "
                        "the rank the router sends its blocks' requests to: check it names the rank that publishes "
                        "there", d.stream.worker, d.stream.dp_rank, rank)
        keep = self._keep
        return d.batch.events if keep is None else [ev for ev in d.batch.events if keep(ev)]

    def _count(self, applied: list[Outcome]) -> None:
        outcomes = self.counters.outcomes
        for outcome in applied:
            if outcome is not Outcome.APPLIED:
                outcomes[outcome.value] = outcomes.get(outcome.value, 0) + 1

    def _applied(self, d: Received) -> None:
        """A batch applied whole: counted, and its lag measured."""
        self.counters.batches += 1
        if d.source == "live" and d.batch.ts > 0:
            lag = self.counters.lag.setdefault(d.stream, Lag())
            lag.last = max(0.0, self._wall() - d.batch.ts)
            lag.max = max(lag.max, lag.last)


def _slice_end(events: Sequence[Event], start: int, work: int) -> int:
    """Where the slice of ``events`` from ``start`` ends: after about ``work`` units, at least one event. O(slice)."""
    end, units = start, 0
    while end < len(events) and units < work:
        units += 1 + len(getattr(events[end], "block_hashes", ()))
        end += 1
    return end
