"""What a stream tracker hands its consumer: batches in order and notices of what happened to the stream
(:class:`kvtier.wire.transport.stream.StreamTracker`), and the stream's counters.

A consumer applies each ``Received`` batch; a ``ResyncStarted``, ``ResyncNeeded`` or ``PublisherRestarted``
tells it to drop what it holds for the stream first. The other notices are for metrics and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, NamedTuple, TypeAlias

from kvtier.wire.protocol import EventBatch, WorkerId

__all__ = [
    "Delivery",
    "GapDetected",
    "GapFilled",
    "MalformedFrame",
    "PublisherRestarted",
    "Received",
    "ResyncDone",
    "ResyncNeeded",
    "ResyncStarted",
    "StreamId",
    "StreamStats",
]


class StreamId(NamedTuple):
    """One publisher stream: a worker and its data-parallel rank."""

    worker: WorkerId
    dp_rank: int = 0

    def __str__(self) -> str:
        return self.worker if self.dp_rank == 0 else f"{self.worker}/dp{self.dp_rank}"


@dataclass(slots=True, frozen=True)
class Received:
    """A decoded batch to apply, in order."""

    stream: StreamId  # where it came from
    seq: int  # its sequence number (for a dump: the last live seq the dump includes)
    batch: EventBatch  # the events
    source: Literal["live", "replay", "dump"]  # which socket delivered it


@dataclass(slots=True, frozen=True)
class GapDetected:
    """Batches ``expected .. received-1`` were missed on the live socket; replay was asked."""

    stream: StreamId  # the stream with the hole
    expected: int  # first missing seq
    received: int  # seq that revealed the hole


@dataclass(slots=True, frozen=True)
class GapFilled:
    """The replay covered the hole; delivery continues in order."""

    stream: StreamId  # the stream that recovered
    first: int  # first seq recovered
    last: int  # last seq recovered


@dataclass(slots=True, frozen=True)
class PublisherRestarted:
    """The publisher's seq went backwards: a new engine process. Drop the stream's state."""

    stream: StreamId  # the restarted stream
    seq: int  # first seq seen from the new publisher


@dataclass(slots=True, frozen=True)
class ResyncStarted:
    """Events were lost; drop the stream's state now: a full replay or a state dump follows."""

    stream: StreamId  # the stream being resynchronised
    reason: str  # why replay could not recover


@dataclass(slots=True, frozen=True)
class ResyncDone:
    """The state dump was delivered; live delivery resumes after ``seq``."""

    stream: StreamId  # the resynchronised stream
    seq: int  # the last live seq the dump includes


@dataclass(slots=True, frozen=True)
class ResyncNeeded:
    """Events were lost for good and no dump is available: clear the stream, mark it stale."""

    stream: StreamId  # the stream whose state can no longer be trusted
    reason: str  # why


@dataclass(slots=True, frozen=True)
class MalformedFrame:
    """A message that could not be parsed or decoded; counted and skipped. One that used up a seq is followed by
    the loss it is (``ResyncStarted`` for a dump, else ``ResyncNeeded``)."""

    stream: StreamId  # where it came from
    reason: str  # what was wrong with it


Delivery: TypeAlias = (
    Received | GapDetected | GapFilled | PublisherRestarted | ResyncStarted | ResyncDone | ResyncNeeded
    | MalformedFrame
)


@dataclass(slots=True)
class StreamStats:
    """Counters of one stream, for metrics."""

    received: int = 0  # live messages seen
    delivered: int = 0  # batches handed to the consumer (live, replay and dump)
    duplicates: int = 0  # messages dropped as already delivered
    gaps: int = 0  # holes detected
    gaps_filled: int = 0  # holes recovered by replay
    restarts: int = 0  # publisher restarts seen
    resyncs: int = 0  # full replays the consumer asked for, dumps requested, and partial marks
    resyncs_deferred: int = 0  # resyncs postponed by the rate limit
    reasks: int = 0  # replay requests repeated from the first missing seq (frames dropped)
    probe_timeouts: int = 0  # idle probes that got no answer (harmless)
    late: int = 0  # live batches that arrived after their seq had been given up for lost or covered by a dump
    malformed: int = 0  # frames or payloads that failed to parse
    # live batches found to carry a corrupt seq frame: one that repeats a batch delivered already (the replay of the gap
    # it opened brought that batch back at its own seq), one the publisher's replay answers and the live batches
    # after them contradict, one below the seq expected while the publisher still holds the last batch delivered, or
    # one a loss's replay answer holds at another seq; dropped, each counted in ``malformed`` too
    bogus_seqs: int = 0
    disconnects: int = 0  # live connections lost (a publisher gone or restarting, a frame past max_frame_bytes)

    def __add__(self, other: StreamStats) -> StreamStats:
        """Both counts added, field by field: one stream's counters over two subscribers' lives."""
        return StreamStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(StreamStats)))
