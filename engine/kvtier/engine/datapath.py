"""Asynchronous KV copies with acknowledgements, behind one small interface.

The cache logic submits :class:`CopyOp` s and later collects the ids of completed
ones from :meth:`DataPath.poll`; it never knows which implementation runs:

* :class:`ModeledDataPath` completes copies when a clock says so (bandwidth +
  latency per channel, FIFO per channel): what the simulator uses;
* :class:`TorchDataPath` moves real bytes between torch tensors (device pool,
  host pool, files of an L3 store): a CUDA stream per direction and events when
  CUDA is present, a copy thread otherwise.

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

from kvtier.engine.l3.pagefile import DRAFT_PREFIX
from kvtier.engine.l3.storage import StoreError

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

    def written(self, pages: Sequence[int], event: Any = None) -> None:  # noqa: B027 (optional hook)
        """Compute wrote device ``pages``; ``event`` marks the end of the write on its stream. Copies that read or
        overwrite those pages wait for it. A modeled path has no streams: nothing to do."""


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


def _count_runs(src: list[int], dst: list[int], limit: int) -> int:
    """How many runs :func:`_runs` would make, counted up to ``limit + 1`` (scattered pages stop it early)."""
    if not src:
        return 0
    runs = 1
    for i in range(1, len(src)):
        if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs += 1
            if runs > limit:
                break
    return runs


LAYOUTS = ("page", "layer")
COPIERS = ("auto", "kernel", "dma")
AUTO_DMA_COPIES = 4  # copier "auto": an op of at most this many copy_ calls runs them instead of the kernel


class TorchDataPath(DataPath):
    """Real KV pools as torch tensors, on a CUDA device and in pinned host memory, or both in CPU memory.

    ``page_shape`` is one page's KV, ``(layers, 2, page_size, kv_heads, head_dim)`` for a transformer. The
    ``layout`` of both pools:

    * ``"page"`` (page-major): ``[pages, *page_shape]``, a page's bytes contiguous;
    * ``"layer"`` (layer-major, as vLLM and SGLang lay out their device KV): ``[layers, 2, pages, *rest]``, a
      page one chunk per layer and K/V. Needs at least 3 dimensions in ``page_shape``.

    :meth:`pages` and :meth:`set_pages` read and write pages whatever the layout.

    With CUDA, device -> host backups and host -> device load-backs run on two streams of their own, so a
    load-back is never queued behind backups; each waits for the stream current at submission (compute that
    wrote or reads its pages) and for the events :meth:`written` recorded for its device pages (compute on
    other streams). Completion is read from CUDA events. The two streams never touch one page at once, because
    the cache frees no device page while its backup is in flight and no host page while it is being loaded
    (:mod:`kvtier.engine.eviction`). ``copier`` picks how pages move:

    * ``"dma"``: one ``copy_`` (a DMA transfer) per run of pages consecutive in both pools, per layout chunk;
    * ``"kernel"``: one launch of :mod:`kvtier.kernels.pagecopy` per op, which reads and writes the pinned host
      pool through its device mapping however the pages are scattered (needs Triton);
    * ``"auto"`` (default): ``dma`` where an op takes at most ``AUTO_DMA_COPIES`` copies, else the kernel where it
      runs, else ``dma``. Why the kernel could not run is kept in :attr:`kernel_error`.

    Without CUDA a copy thread runs them: a slice copy for one run, else one indexed gather and scatter per pool.
    L3 reads and writes always run on the copy thread (file I/O).
    """

    def __init__(self, device_pages: int, host_pages: int, page_shape: tuple[int, ...],
                 dtype: torch.dtype | None = None, device: str | None = None,
                 draft_page_shape: tuple[int, ...] | None = None, layout: str = "page",
                 copier: str = "auto") -> None:
        import torch

        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        if copier not in COPIERS:
            raise ValueError(f"copier must be one of {', '.join(COPIERS)}, got {copier!r}")
        if layout == "layer" and (len(page_shape) < 3 or (draft_page_shape is not None and len(draft_page_shape) < 3)):
            raise ValueError("layout 'layer' needs page shapes (layers, 2, ...) of at least 3 dimensions")
        super().__init__()
        self._torch = torch
        dtype = dtype or torch.bfloat16
        self.layout = layout
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.cuda = self.device.type == "cuda"
        self.device_kv = self._pool(device_pages, page_shape, dtype, self.device)
        self.host_kv = self._pool(host_pages, page_shape, dtype, torch.device("cpu"))
        # The draft model's KV (speculative decoding) uses the same page ids: every copy of a page
        # moves its draft page too, and L3 stores it beside the target page under "d:" + key.
        self.device_draft: torch.Tensor | None = None
        self.host_draft: torch.Tensor | None = None
        if draft_page_shape is not None:
            self.device_draft = self._pool(device_pages, draft_page_shape, dtype, self.device)
            self.host_draft = self._pool(host_pages, draft_page_shape, dtype, torch.device("cpu"))
        self.page_bytes = self._bytes(self.device_kv) + (self._bytes(self.device_draft) if self.device_draft is not None
                                                         else 0)
        self.copier = copier if self.cuda else "dma"
        self.kernel_error: str | None = None
        if self.cuda and copier != "dma":
            self.kernel_error = self._probe_kernel() if all(
                (self._bytes(d) // self._chunked(d).shape[0]) % 4 == 0 for d, _, _ in self._pools()) else (
                "a layout chunk is not a whole number of 4-byte words")
            if self.kernel_error is not None:
                if copier == "kernel":
                    raise RuntimeError(f"copier 'kernel' cannot run here: {self.kernel_error}")
                self.copier = "dma"
        self._streams: dict[CopyKind, Any] = {}
        if self.cuda:
            self._streams = {k: torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
                             for k in (CopyKind.D2H, CopyKind.H2D)}
        # (event, op, what the copy reads until it is done) per stream, in submission order
        self._cuda_inflight: dict[CopyKind, deque[tuple[Any, CopyOp, Any]]] = {k: deque() for k in self._streams}
        self._written: dict[int, Any] = {}  # device page -> event recorded after compute last wrote it
        self._done: queue.SimpleQueue[CopyOp] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[CopyOp | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name="kv-copy", daemon=True)
        self._thread.start()

    # --- pools and pages ---

    def _pool(self, pages: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        full = (pages, *shape) if self.layout == "page" else (*shape[:2], pages, *shape[2:])
        pin = self.cuda and device.type == "cpu"
        return self._torch.zeros(full, dtype=dtype, device=device, pin_memory=pin)

    def _chunked(self, pool: torch.Tensor) -> torch.Tensor:
        """``pool`` as ``[chunks, pages, ...]``: one chunk for page-major pools, layers x 2 for layer-major."""
        return pool.unsqueeze(0) if self.layout == "page" else pool.flatten(0, 1)

    def _page_dim(self) -> int:
        return 0 if self.layout == "page" else 2

    def _bytes(self, pool: torch.Tensor | None) -> int:
        """Bytes of one page of ``pool``."""
        if pool is None or pool.shape[self._page_dim()] == 0:
            return 0
        return pool.numel() // pool.shape[self._page_dim()] * pool.element_size()

    def _page(self, pool: torch.Tensor, page: int) -> torch.Tensor:
        """A view of one page (not contiguous in a layer-major pool)."""
        return pool[page] if self.layout == "page" else pool[:, :, page]

    def pages(self, pool: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
        """A copy of pages ``ids`` of ``pool`` (one of this path's four), as ``[len(ids), *page_shape]``."""
        if self.layout == "page":
            return pool[list(ids)]
        return pool[:, :, list(ids)].movedim(2, 0)

    def set_pages(self, pool: torch.Tensor, ids: Sequence[int], data: torch.Tensor) -> None:
        """Writes ``data`` (``[len(ids), *page_shape]``, any device) into pages ``ids`` of ``pool``."""
        data = data.to(pool.device, pool.dtype)
        if self.layout == "page":
            pool[list(ids)] = data
        else:
            pool[:, :, list(ids)] = data.movedim(0, 2)

    def _pools(self) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
        """(device pool, host pool, L3 key prefix) for the target and, if any, the draft KV."""
        pools = [(self.device_kv, self.host_kv, "")]
        if self.device_draft is not None and self.host_draft is not None:
            pools.append((self.device_draft, self.host_draft, DRAFT_PREFIX))
        return pools

    # --- ordering ---

    def written(self, pages: Sequence[int], event: Any = None) -> None:
        """Compute wrote device ``pages``: copies that read or overwrite them wait for ``event`` (a CUDA event
        recorded on the writer's stream after the write), or, without one, for the current stream as it is now.
        Without CUDA compute is done when it returns: nothing to wait for."""
        if not self.cuda:
            return
        if event is None:
            event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(self._torch.cuda.current_stream(self.device))
        for p in pages:
            self._written[p] = event

    def _wait_for_writers(self, stream: Any, pages: list[int]) -> None:
        """Orders ``stream`` after every recorded write of ``pages``. A write waited for once needs no second wait:
        the cache submits any later copy of those pages only after this one is acknowledged, so its record is
        dropped."""
        if not self._written:
            return
        events = {id(ev): ev for p in self._written.keys() & set(pages) if (ev := self._written.pop(p))}
        for ev in events.values():
            stream.wait_event(ev)

    def _start(self, op: CopyOp) -> None:
        if self.cuda and op.kind in (CopyKind.D2H, CopyKind.H2D):
            torch = self._torch
            stream = self._streams[op.kind]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            self._wait_for_writers(stream, op.src if op.kind is CopyKind.D2H else op.dst)
            with torch.cuda.stream(stream):
                keep = self._copy_pages(op)
                event = torch.cuda.Event()
                event.record(stream)
            self._cuda_inflight[op.kind].append((event, op, keep))
        else:
            self._jobs.put(op)

    # --- copies ---

    def _probe_kernel(self) -> str | None:
        """Why :mod:`kvtier.kernels.pagecopy` cannot move pages here, or None once a trial copy came back right."""
        from kvtier.kernels import pagecopy

        torch = self._torch
        if not pagecopy.available():
            return "Triton is not installed"
        try:
            words = pagecopy.TILE_WORDS + 5  # two tiles, the second partly masked
            dev = torch.arange(3 * words, dtype=torch.int32, device=self.device)
            host = torch.zeros(2 * words, dtype=torch.int32, pin_memory=True)
            idx = torch.tensor([[2, 0], [0, 1]], dtype=torch.int64, pin_memory=True)
            pagecopy.copy_pages(dev, host, idx[0], idx[1], 1, words, 0, 0)  # pages 2, 0 -> host 0, 1
            back = torch.zeros_like(dev)
            pagecopy.copy_pages(host, back, idx[1], idx[0], 1, words, 0, 0)  # host 0, 1 -> pages 2, 0
            torch.cuda.synchronize(self.device)
        except Exception as exc:  # no driver support, a Triton that refuses host pointers, ...
            return f"{type(exc).__name__}: {exc}"
        want = dev.clone()
        want[words:2 * words] = 0
        if not (torch.equal(host[:words].to(self.device), dev[2 * words:]) and torch.equal(back, want)):
            return "a trial copy through mapped host memory came back wrong"
        return None

    def _uses_kernel(self, op: CopyOp) -> bool:
        if self.copier != "auto":
            return self.copier == "kernel"
        # A few copy_ calls cost less than the kernel's launch and index copy, and one copy_ of a long run moves
        # at the DMA engines' full rate (bench/engine_bench.py); the runs are counted only as far as that limit.
        chunks = self._chunked(self.device_kv).shape[0]
        if chunks > AUTO_DMA_COPIES:
            return True
        return _count_runs(op.src, op.dst, AUTO_DMA_COPIES // chunks) * chunks > AUTO_DMA_COPIES

    def _copy_pages(self, op: CopyOp) -> Any:
        """Enqueues (CUDA) or runs (CPU) ``op``'s page copies; returns what must stay alive until they are done."""
        d2h = op.kind is CopyKind.D2H
        if self.cuda and self._uses_kernel(op):
            return self._kernel_copy(op, d2h)
        runs = _runs(op.src, op.dst)
        gather = not self.cuda and len(runs) > 1
        if gather:
            src_idx, dst_idx = self._torch.tensor(op.src), self._torch.tensor(op.dst)
        for device_pool, host_pool, _ in self._pools():
            src, dst = (device_pool, host_pool) if d2h else (host_pool, device_pool)
            src_c, dst_c = self._chunked(src), self._chunked(dst)
            if gather:  # on the CPU one indexed gather and scatter beat a copy per run
                dst_c.index_copy_(1, dst_idx, src_c.index_select(1, src_idx))
                continue
            for c in range(src_c.shape[0]):
                for s, d, n in runs:
                    dst_c[c, d:d + n].copy_(src_c[c, s:s + n], non_blocking=self.cuda)
        return None

    def _kernel_copy(self, op: CopyOp, d2h: bool) -> Any:
        from kvtier.kernels import pagecopy

        torch = self._torch
        host_idx = torch.empty((2, len(op.src)), dtype=torch.int64, pin_memory=True)
        arr = host_idx.numpy()
        arr[0], arr[1] = op.src, op.dst
        idx = host_idx.to(self.device, non_blocking=True)  # on this stream, before the kernel that reads it
        for device_pool, host_pool, _ in self._pools():
            src, dst = (device_pool, host_pool) if d2h else (host_pool, device_pool)
            chunks = self._chunked(src).shape[0]
            chunk_words = self._bytes(src) // chunks // 4
            src_pages, dst_pages = src.shape[self._page_dim()], dst.shape[self._page_dim()]
            pagecopy.copy_pages(src.view(-1).view(torch.int32), dst.view(-1).view(torch.int32), idx[0], idx[1],
                                chunks, chunk_words, src_pages * chunk_words, dst_pages * chunk_words)
        return host_idx, idx

    def _worker(self) -> None:
        torch = self._torch
        while (op := self._jobs.get()) is not None:
            try:
                if op.kind in (CopyKind.D2H, CopyKind.H2D):
                    self._copy_pages(op)
                elif op.kind is CopyKind.H2S:
                    assert op.store is not None
                    items: list[tuple[str, bytes | memoryview]] = []
                    for page, key in zip(op.src, op.keys, strict=True):
                        for _, host_pool, prefix in self._pools():
                            raw = self._page(host_pool, page).contiguous().view(-1).view(torch.uint8)
                            items.append((prefix + key, memoryview(raw.numpy().data)))
                    op.store.write_pages(items)
                else:
                    assert op.store is not None
                    for page, key in zip(op.dst, op.keys, strict=True):
                        for _, host_pool, prefix in self._pools():
                            try:
                                data = op.store.read_page(prefix + key, self._bytes(host_pool))
                            except StoreError as exc:
                                op.bad_keys.append(exc.key)
                                raise
                            view = self._page(host_pool, page)
                            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                            view.copy_(raw.view(host_pool.dtype).view(view.shape))
            except Exception as exc:  # reported with the op, never swallowed
                op.error = f"{type(exc).__name__}: {exc}"
            self._done.put(op)

    def poll(self) -> list[CopyOp]:
        out: list[CopyOp] = []
        for inflight in self._cuda_inflight.values():
            while inflight and inflight[0][0].query():
                out.append(inflight.popleft()[1])
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
            for inflight in self._cuda_inflight.values():
                if inflight:
                    inflight[-1][0].synchronize()  # the stream's last op: every earlier one is done too
            out.extend(self.poll())
            if self.ops and not any(self._cuda_inflight.values()):
                op = self._done.get(timeout=30)
                self.ops.pop(op.op_id, None)
                out.append(op)
        return out

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
