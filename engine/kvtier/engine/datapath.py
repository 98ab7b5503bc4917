"""Asynchronous KV copies with acknowledgements, behind one small interface.

The cache logic submits :class:`CopyOp` s and later collects the ids of completed
ones from :meth:`DataPath.poll`; it never knows which implementation runs:

* :class:`ModeledDataPath` completes copies when a clock says so (bandwidth +
  latency per channel, FIFO per channel): what the simulator uses;
* :class:`TorchDataPath` moves real bytes between torch tensors (device pool,
  host pool, files of an L3 store): CUDA streams and events when CUDA is present,
  a copy thread otherwise.

Ops complete in submission order within a channel (d2h, h2d, storage writes,
storage reads), which the cache relies on: a parent's copy is acknowledged no
later than its child's.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from kvtier.engine.l3.storage import DRAFT_PREFIX, StoreError

if TYPE_CHECKING:
    import torch

    from kvtier.engine.l3.storage import PageStore


class CopyKind(Enum):
    """Direction of a copy."""

    D2H = "d2h"  # device -> host (backup)
    H2D = "h2d"  # host -> device (load-back)
    H2S = "h2s"  # host -> L3 store (write-behind)
    S2H = "s2h"  # L3 store -> host (prefetch)


@dataclass(slots=True)
class CopyOp:
    """One asynchronous copy of whole pages."""

    op_id: int  # unique per data path
    kind: CopyKind  # direction
    src: list[int]  # source page ids (unused for S2H)
    dst: list[int]  # destination page ids (unused for H2S)
    keys: list[str] = field(default_factory=list)  # L3 keys for H2S / S2H, one per page
    store: PageStore | None = None  # the L3 store for H2S / S2H
    error: str | None = None  # set when the copy failed (e.g. a damaged page file)
    bad_keys: list[str] = field(default_factory=list)  # S2H: pages whose files were gone or damaged
    window_pages: int = 0  # SWA models: pages whose sliding-window KV moves with their full-attention KV

    @property
    def pages(self) -> int:
        return len(self.keys) if self.kind in (CopyKind.H2S, CopyKind.S2H) else len(self.src)


class DataPath(ABC):
    """Submits copies and reports their completion."""

    page_bytes: int  # bytes of KV in one page (full attention, plus the draft model's)
    window_page_bytes: int = 0  # bytes of one page's sliding-window KV (SWA models; 0: none)

    def __init__(self) -> None:
        self._next_id = 0
        self.ops: dict[int, CopyOp] = {}  # in flight, by id

    def new_op(self, kind: CopyKind, src: Sequence[int], dst: Sequence[int], keys: list[str] | None = None,
               store: PageStore | None = None, window_pages: int = 0) -> CopyOp:
        op = CopyOp(self._next_id, kind, list(src), list(dst), keys or [], store, window_pages=window_pages)
        self._next_id += 1
        return op

    def submit(self, op: CopyOp) -> None:
        """Starts ``op``; it completes later, reported by :meth:`poll`."""
        self.ops[op.op_id] = op
        self._start(op)

    @abstractmethod
    def _start(self, op: CopyOp) -> None: ...

    @abstractmethod
    def poll(self) -> list[CopyOp]:
        """Ops completed since the last call, per channel in submission order. Removes them."""

    @abstractmethod
    def drain(self) -> list[CopyOp]:
        """Waits for every op in flight and returns them (tests, shutdown)."""

    def reset(self) -> None:
        """Forgets ops in flight (their completions are dropped)."""
        self.drain()


# --- modeled -------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Bandwidths:
    """Link speeds of the modeled data path, bytes per second, and per-op latency."""

    d2h: float = 25e9  # device -> host (PCIe 5 x16 pinned)
    h2d: float = 25e9  # host -> device
    storage_write: float = 5e9  # host -> L3
    storage_read: float = 5e9  # L3 -> host
    latency_s: float = 20e-6  # fixed cost per op


class ModeledDataPath(DataPath):
    """Copies finish at ``max(now, channel free) + latency + bytes / bandwidth`` on ``clock``; an op's bytes
    are its pages' full-attention KV plus the window KV of its ``window_pages``."""

    def __init__(self, page_bytes: int, clock: Callable[[], float], bandwidths: Bandwidths | None = None,
                 window_page_bytes: int = 0) -> None:
        super().__init__()
        self.page_bytes = page_bytes
        self.window_page_bytes = window_page_bytes
        self.clock = clock
        self.bw = bandwidths or Bandwidths()
        self._free_at: dict[CopyKind, float] = {k: 0.0 for k in CopyKind}
        self._queues: dict[CopyKind, deque[tuple[float, CopyOp]]] = {k: deque() for k in CopyKind}

    def _rate(self, kind: CopyKind) -> float:
        return {CopyKind.D2H: self.bw.d2h, CopyKind.H2D: self.bw.h2d,
                CopyKind.H2S: self.bw.storage_write, CopyKind.S2H: self.bw.storage_read}[kind]

    def duration(self, kind: CopyKind, pages: int, window_pages: int = 0) -> float:
        """Seconds one op of ``pages`` pages (``window_pages`` of them with window KV) takes on an idle channel."""
        return self.bw.latency_s + (pages * self.page_bytes + window_pages * self.window_page_bytes) / self._rate(kind)

    def _start(self, op: CopyOp) -> None:
        start = max(self.clock(), self._free_at[op.kind])
        done = start + self.duration(op.kind, op.pages, op.window_pages)
        self._free_at[op.kind] = done
        self._queues[op.kind].append((done, op))

    def next_completion(self) -> float | None:
        """When the next op completes, or None if nothing is in flight. O(kinds)."""
        if not self.ops:  # (the simulator asks after every step, mostly with nothing in flight)
            return None
        heads = [q[0][0] for q in self._queues.values() if q]
        return min(heads) if heads else None

    def poll(self) -> list[CopyOp]:
        now = self.clock()
        done: list[tuple[float, int, CopyOp]] = []
        for q in self._queues.values():
            while q and q[0][0] <= now:
                t, op = q.popleft()
                done.append((t, op.op_id, op))
        done.sort(key=lambda x: (x[0], x[1]))
        for _, _, op in done:
            del self.ops[op.op_id]
        return [op for _, _, op in done]

    def drain(self) -> list[CopyOp]:
        done = [op for q in self._queues.values() for _, op in q]
        for q in self._queues.values():
            q.clear()
        for k in self._free_at:
            self._free_at[k] = 0.0
        self.ops.clear()
        return sorted(done, key=lambda op: op.op_id)


# --- torch ---------------------------------------------------------------------------------


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Groups page pairs into (src start, dst start, length) runs contiguous in both pools."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


class TorchDataPath(DataPath):
    """Real KV pools as torch tensors of shape ``[pages, layers, 2, page_size, kv_heads, head_dim]``.

    With CUDA: device pool on the GPU, pinned host pool, device<->host copies on a
    dedicated stream, completion by CUDA events. Without: both pools in CPU memory
    and a copy thread. L3 reads and writes always run on the copy thread (file I/O).
    """

    def __init__(self, device_pages: int, host_pages: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype | None = None, device: str | None = None,
                 draft_page_shape: tuple[int, ...] | None = None) -> None:
        import torch

        super().__init__()
        self._torch = torch
        dtype = dtype or torch.bfloat16
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.device_kv = torch.zeros((device_pages, *page_shape), dtype=dtype, device=self.device)
        self.host_kv = torch.zeros((host_pages, *page_shape), dtype=dtype, pin_memory=self.cuda)
        # The draft model's KV (speculative decoding) uses the same page ids: every copy of a page
        # moves its draft page too, and L3 stores it beside the target page under "d:" + key.
        self.device_draft: torch.Tensor | None = None
        self.host_draft: torch.Tensor | None = None
        if draft_page_shape is not None:
            self.device_draft = torch.zeros((device_pages, *draft_page_shape), dtype=dtype, device=self.device)
            self.host_draft = torch.zeros((host_pages, *draft_page_shape), dtype=dtype, pin_memory=self.cuda)
        self.page_bytes = self._bytes(self.device_kv) + (self._bytes(self.device_draft) if self.device_draft is not None
                                                         else 0)
        self._stream = torch.cuda.Stream(device=self.device) if self.cuda else None  # type: ignore[no-untyped-call]
        self._cuda_inflight: deque[tuple[Any, CopyOp]] = deque()  # (event, op) in submission order
        self._done: queue.SimpleQueue[CopyOp] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[CopyOp | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name="kv-copy", daemon=True)
        self._thread.start()

    def _start(self, op: CopyOp) -> None:
        if self.cuda and op.kind in (CopyKind.D2H, CopyKind.H2D):
            assert self._stream is not None
            # The copy reads what compute wrote on the default stream: order after it.
            self._stream.wait_stream(self._torch.cuda.current_stream(self.device))
            with self._torch.cuda.stream(self._stream):
                self._copy_pages(op)
                event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            self._cuda_inflight.append((event, op))
        else:
            self._jobs.put(op)

    @staticmethod
    def _bytes(pool: torch.Tensor | None) -> int:
        return 0 if pool is None or len(pool) == 0 else pool[0].numel() * pool.element_size()

    def _pools(self) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
        """(device pool, host pool, L3 key prefix) for the target and, if any, the draft KV."""
        pools = [(self.device_kv, self.host_kv, "")]
        if self.device_draft is not None and self.host_draft is not None:
            pools.append((self.device_draft, self.host_draft, DRAFT_PREFIX))
        return pools

    def _copy_pages(self, op: CopyOp) -> None:
        d2h = op.kind is CopyKind.D2H
        runs = _runs(op.src, op.dst)
        for device_pool, host_pool, _ in self._pools():
            src, dst = (device_pool, host_pool) if d2h else (host_pool, device_pool)
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=self.cuda)

    def _worker(self) -> None:
        while (op := self._jobs.get()) is not None:
            try:
                if op.kind in (CopyKind.D2H, CopyKind.H2D):
                    self._copy_pages(op)
                elif op.kind is CopyKind.H2S:
                    assert op.store is not None
                    items: list[tuple[str, bytes | memoryview]] = []
                    for page, key in zip(op.src, op.keys, strict=True):
                        for _, host_pool, prefix in self._pools():
                            raw = host_pool[page].contiguous().view(-1).view(self._torch.uint8)
                            items.append((prefix + key, memoryview(raw.numpy().data)))
                    op.store.write_pages(items)
                else:
                    assert op.store is not None
                    for page, key in zip(op.dst, op.keys, strict=True):
                        for _, host_pool, prefix in self._pools():
                            try:
                                data = op.store.read_page(prefix + key)
                            except StoreError as exc:
                                op.bad_keys.append(exc.key)
                                raise
                            want = self._bytes(host_pool)
                            if len(data) != want:
                                op.bad_keys.append(key)
                                raise ValueError(f"page file {prefix + key}: {len(data)} bytes, not {want}")
                            raw = self._torch.frombuffer(bytearray(data), dtype=self._torch.uint8)
                            host_pool[page].view(-1).view(self._torch.uint8).copy_(raw)
            except Exception as exc:  # reported with the op, never swallowed
                op.error = f"{type(exc).__name__}: {exc}"
            self._done.put(op)

    def poll(self) -> list[CopyOp]:
        out: list[CopyOp] = []
        while self._cuda_inflight and self._cuda_inflight[0][0].query():
            out.append(self._cuda_inflight.popleft()[1])
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        for op in out:
            self.ops.pop(op.op_id, None)
        return out

    def drain(self) -> list[CopyOp]:
        out: list[CopyOp] = []
        while self.ops:
            if self._cuda_inflight:
                self._cuda_inflight[0][0].synchronize()
            out.extend(self.poll())
            if self.ops and not self._cuda_inflight:
                op = self._done.get(timeout=30)
                self.ops.pop(op.op_id, None)
                out.append(op)
        return out

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
