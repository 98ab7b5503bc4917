"""The router's own bookkeeping of in-flight work per worker (no engine feedback needed)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.wire.stream import StreamId


@dataclass(slots=True)
class WorkerLoad:
    """Work the router has sent a worker and not yet seen finish."""

    running: int = 0  # requests routed and not finished
    active_blocks: int = 0  # KV blocks those requests occupy (prompt + expected output)
    pending_prefill_tokens: int = 0  # prompt tokens still to compute (cleared at first token)
    prefilling: int = 0  # of ``running``, requests that have not produced their first token


@dataclass(slots=True, frozen=True)
class _InFlight:
    worker: StreamId  # where it went
    blocks: int  # KV blocks it holds
    prefill_tokens: int  # uncached prompt tokens it brought


class LoadTracker:
    """Tracks in-flight requests per worker. Every method is O(1)."""

    def __init__(self) -> None:
        self._loads: dict[StreamId, WorkerLoad] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._prefilling: set[str] = set()

    def load(self, worker: StreamId) -> WorkerLoad:
        return self._loads.get(worker) or WorkerLoad()

    def add(self, request_id: str, worker: StreamId, blocks: int, prefill_tokens: int) -> None:
        """A request was routed. Raises ``ValueError`` if ``request_id`` is already in flight."""
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} is already in flight")
        self._inflight[request_id] = _InFlight(worker, blocks, prefill_tokens)
        self._prefilling.add(request_id)
        ld = self._loads.setdefault(worker, WorkerLoad())
        ld.running += 1
        ld.active_blocks += blocks
        ld.pending_prefill_tokens += prefill_tokens
        ld.prefilling += 1

    def prefill_done(self, request_id: str) -> None:
        """The request produced its first token; idempotent."""
        if request_id in self._prefilling:
            self._prefilling.discard(request_id)
            f = self._inflight[request_id]
            ld = self._loads[f.worker]
            ld.pending_prefill_tokens -= f.prefill_tokens
            ld.prefilling -= 1

    def finish(self, request_id: str) -> None:
        """The request completed (or failed); unknown ids are ignored."""
        self.prefill_done(request_id)
        f = self._inflight.pop(request_id, None)
        if f is not None:
            ld = self._loads[f.worker]
            ld.running -= 1
            ld.active_blocks -= f.blocks

    def _check(self) -> None:
        totals: dict[StreamId, WorkerLoad] = {}
        for rid, f in self._inflight.items():
            t = totals.setdefault(f.worker, WorkerLoad())
            t.running += 1
            t.active_blocks += f.blocks
            if rid in self._prefilling:
                t.pending_prefill_tokens += f.prefill_tokens
                t.prefilling += 1
        for w, ld in self._loads.items():
            assert ld == totals.get(w, WorkerLoad()), f"load of {w} out of sync: {ld} != {totals.get(w)}"
