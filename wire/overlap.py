"""Results of prefix-overlap queries."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.wire.stream import StreamId


@dataclass(slots=True, frozen=True)
class TierOverlap:
    """Cumulative prefix overlap of one request on one worker, in blocks.

    Invariant: ``device <= host <= disk <= external <= total``.
    """

    device: int  # blocks 0..device-1 are all on the worker's device
    host: int  # blocks 0..host-1 are each on device or host
    disk: int  # ... or on the worker's local disk
    external: int  # ... or in the shared external pool

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "disk": self.disk, "external": self.external}


@dataclass(slots=True)
class OverlapScores:
    """Per-worker overlaps of one request."""

    total_blocks: int  # full blocks in the request
    workers: dict[StreamId, TierOverlap] = field(default_factory=dict)  # every known worker
    shared_pool: int = 0  # leading blocks all present in the shared external pool

    def as_dict(self) -> dict[str, object]:
        return {
            "total_blocks": self.total_blocks,
            "shared_pool": self.shared_pool,
            "workers": {str(s): o.as_dict() for s, o in self.workers.items()},
        }
