"""One GPU kernel that moves a batch of scattered KV pages between a device pool and a pinned host pool.

A pool is viewed as ``[chunks, pages, chunk_words]`` 32-bit words: page-major pools (``[pages, ...]``, one chunk
per page) have ``chunks == 1``; layer-major pools (``[layers, 2, pages, ...]``, as engines lay KV out) have one
chunk per layer and K/V, ``chunk_stride`` words apart. Page ``src_idx[i]``'s chunk ``c`` of the source lands on
page ``dst_idx[i]``'s chunk ``c`` of the destination.

Why a kernel: a ``cudaMemcpyAsync`` per run of consecutive pages pays a fixed cost per call, so scattered pages of
16-512 KiB move at a fraction of what one copy of the same bytes does. Pinned host memory is mapped into the
GPU's address space (unified addressing), so thread blocks can read and write it directly; thousands of blocks
in flight keep the link busy however the pages are scattered. It runs on SMs, beside the engine's compute.

Needs Triton and a CUDA device; :func:`available` says whether it can run. ``TRITON_INTERPRET=1`` runs it on
CPU tensors (how its indexing is tested without a GPU).
"""

from __future__ import annotations

import importlib.util
from typing import Any

TILE_WORDS = 2048  # words one thread block moves: 8 KiB, a tile of whole chunks or a slice of one
MIN_ROW_WORDS = 16  # the narrowest tile row: 64 bytes, so a row is at least a few 16-byte vectors

_kernel: Any = None


def available() -> bool:
    """True where Triton is installed (the caller checks for a CUDA device)."""
    return importlib.util.find_spec("triton") is not None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def copy_chunks(src, dst, src_idx, dst_idx, chunks, chunk_words, src_stride, dst_stride,  # type: ignore[no-untyped-def]
                    ROWS: tl.constexpr, WIDTH: tl.constexpr) -> None:
        # A tile is ROWS chunks of one page by WIDTH words of each: small chunks (layer-major pools of small
        # pages) share a block, large ones are cut into WIDTH-word slices.
        groups = (chunks + ROWS - 1) // ROWS  # (no tl.cdiv: a nested jit call the interpreter refuses once a
        # real build of this kernel exists in the process)
        pg = tl.program_id(0)  # (page in batch) * groups + chunk group
        part = tl.program_id(1)  # which WIDTH-word slice of the chunks
        i = pg // groups
        c = ((pg % groups) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        s = tl.load(src_idx + i)
        d = tl.load(dst_idx + i)
        w = part.to(tl.int64) * WIDTH + tl.arange(0, WIDTH)
        mask = (c < chunks)[:, None] & (w < chunk_words)[None, :]
        v = tl.load(src + (c * src_stride + s * chunk_words)[:, None] + w[None, :], mask=mask)
        tl.store(dst + (c * dst_stride + d * chunk_words)[:, None] + w[None, :], v, mask=mask)

    return copy_chunks


def tile(chunks: int, chunk_words: int) -> tuple[int, int]:
    """(ROWS, WIDTH) of the tile for chunks of ``chunk_words`` words: powers of two, ROWS * WIDTH <= TILE_WORDS."""
    width = max(MIN_ROW_WORDS, min(TILE_WORDS, 1 << (chunk_words - 1).bit_length()))
    rows = max(1, min(TILE_WORDS // width, 1 << (chunks - 1).bit_length()))
    return rows, width


def copy_pages(src: Any, dst: Any, src_idx: Any, dst_idx: Any, chunks: int, chunk_words: int,
               src_stride: int, dst_stride: int) -> None:
    """Enqueues the copy on the current CUDA stream. ``src``/``dst``: int32 views of the pools (one of them may be
    pinned host memory); ``src_idx``/``dst_idx``: int64 page ids (on the device: every tile of a page reads them),
    alive until the stream has run the copy. Strides and ``chunk_words`` in words."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    n = len(src_idx)
    if n == 0:
        return
    rows, width = tile(chunks, chunk_words)
    grid = (n * -(-chunks // rows), -(-chunk_words // width))
    _kernel[grid](src, dst, src_idx, dst_idx, chunks, chunk_words, src_stride, dst_stride, ROWS=rows, WIDTH=width)
