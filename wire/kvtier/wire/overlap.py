"""Results of prefix-overlap queries."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.wire.notices import StreamId


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


def window_cut(ok: list[bool], limit: int, window: int) -> int:
    """The longest reusable prefix, in blocks, of a sliding-window model: the largest ``c <= limit`` whose
    ``window`` blocks before it (``[c - window, c)``, fewer near the start) all have window KV (``ok``), or 0.
    A prefix that ends elsewhere would need window KV that is gone, so the engine recomputes from the cut.
    O(limit)."""
    if window <= 0:
        return limit
    run = 0  # ok blocks in a row ending at the current position
    best = 0
    for i in range(limit):
        run = run + 1 if ok[i] else 0
        if run >= min(window, i + 1):
            best = i + 1
    return best


@dataclass(slots=True)
class OverlapScores:
    """Per-worker overlaps of one request."""

    total_blocks: int  # full blocks in the request
    workers: dict[StreamId, TierOverlap] = field(default_factory=dict)  # every known worker
    shared_pool: int = 0  # leading blocks all present in the shared external pool
    # Workers whose window KV the index knows (window-aware queries only): window length in blocks.
    # Their ``workers`` entry is then the usable overlap (kvtier.wire.overlap.window_cut per tier).
    windows: dict[StreamId, int] = field(default_factory=dict)
    raw: dict[StreamId, TierOverlap] = field(default_factory=dict)  # those workers' overlaps before the cut
    # Those of them that send no window events: their window KV is inferred from their stores (an estimate)
    inferred: set[StreamId] = field(default_factory=set)

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "total_blocks": self.total_blocks,
            "shared_pool": self.shared_pool,
            "workers": {str(s): o.as_dict() for s, o in self.workers.items()},
        }
        if self.windows:
            out["window_blocks"] = {str(s): b for s, b in self.windows.items()}
            out["raw"] = {str(s): o.as_dict() for s, o in self.raw.items()}
            if self.inferred:
                out["window_inferred"] = sorted(str(s) for s in self.inferred)
        return out
