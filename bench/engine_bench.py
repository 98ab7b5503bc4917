"""Engine benchmark: cache operations per second, and the torch data path's copy bandwidth.

Modeled data path: insert (admit, prefill, release of a new 64-page sequence), match (admit and
release of a cached one) and device eviction, in operations per second; prompts packed
(:func:`kvtier.wire.pack_tokens`), and match once more from token-id lists.

Torch data path: device -> host and host -> device copies of whole pages through the engine's
copy machinery, as a fraction of one plain ``tensor.copy_`` of the same bytes (target >= 0.7).
With CUDA the pools are on the GPU and in pinned host memory, so the reference is a
cudaMemcpy-class pinned copy.

    python bench/engine_bench.py [--pages 256] [--model llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import CopyKind, ModeledDataPath, TorchDataPath
from kvtier.hardware.latency import PRESETS
from kvtier.wire import pack_tokens

PS = 16


def modeled_ops(n: int = 2000) -> None:
    now = [0.0]
    dp = ModeledDataPath(PS * 1024, lambda: now[0])
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=64 * 256, host_ratio=2.0), dp)
    # Prompts held packed, as the simulator holds them; a caller passing token-id lists pays one
    # pack per call (``match from lists`` below).
    lists = [list(range(i * 100_000, i * 100_000 + 64 * PS)) for i in range(n)]
    seqs = [pack_tokens(s) for s in lists]

    t0 = time.perf_counter()
    for i, s in enumerate(seqs[: n // 2]):
        adm = cache.admit(f"i{i}", s)
        cache.begin_prefill(adm)
        cache.finish_prefill(adm)
        cache.release(adm)
        now[0] += 1e-3
        cache.poll()
        cache.flush_events()
    insert = (n // 2) / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    for i in range(n):
        adm = cache.admit(f"m{i}", seqs[i % 200])
        cache.release(adm)
    match = n / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    for i in range(n):
        adm = cache.admit(f"l{i}", lists[i % 200])
        cache.release(adm)
    match_lists = n / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    evictions = 0
    for s in seqs[n // 2:]:  # each insert must evict one cached sequence
        adm = cache.admit("e", s)
        cache.begin_prefill(adm)
        cache.finish_prefill(adm)
        cache.release(adm)
        evictions += 1
        now[0] += 1e-3
        cache.poll()
        cache.flush_events()
    evict = evictions / (time.perf_counter() - t0)
    cache._check()
    print(f"modeled path ({PS}-token pages, 64-page sequences):")
    print(f"  insert {insert:9,.0f} seq/s   match {match:9,.0f} seq/s   insert+evict {evict:9,.0f} seq/s")
    print(f"  = {insert * 64:,.0f} / {match * 64:,.0f} / {evict * 64:,.0f} pages/s")
    print(f"  match from token-id lists {match_lists:9,.0f} seq/s (each call packs its {64 * PS} tokens)")


def copy_bandwidth(pages: int, model: str, repeats: int = 7) -> None:
    preset = PRESETS[model]
    shape = (preset.num_layers, 2, PS, preset.num_kv_heads, preset.head_dim)
    dp = TorchDataPath(pages, pages, shape)
    dp.device_kv.normal_()
    nbytes = dp.page_bytes * pages
    where = f"CUDA ({torch.cuda.get_device_name()}) with pinned host memory" if dp.cuda else "CPU, copy thread"
    print(f"torch path on {where}: {pages} pages of {dp.page_bytes / 2**20:.1f} MiB ({model}, {PS} tokens/page)")

    def sync() -> None:
        if dp.cuda:
            torch.cuda.synchronize()

    def engine_copy(kind: CopyKind, order: list[int]) -> float:
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            dp.submit(dp.new_op(kind, order, order))
            dp.drain()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def plain(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=dp.cuda)
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    ref_d2h = plain(dp.host_kv, dp.device_kv)
    ref_h2d = plain(dp.device_kv, dp.host_kv)
    contiguous = list(range(pages))
    scattered = contiguous[::2] + contiguous[1::2]  # every page its own run
    for name, order in (("contiguous", contiguous), ("scattered", scattered)):
        d2h = engine_copy(CopyKind.D2H, order)
        h2d = engine_copy(CopyKind.H2D, order)
        print(f"  {name:10} d2h {nbytes / d2h / 1e9:7.2f} GB/s = {ref_d2h / d2h:4.2f} x copy_   "
              f"h2d {nbytes / h2d / 1e9:7.2f} GB/s = {ref_h2d / h2d:4.2f} x copy_   (target >= 0.70)")
    print(f"  reference tensor.copy_: d2h {nbytes / ref_d2h / 1e9:.2f} GB/s, h2d {nbytes / ref_h2d / 1e9:.2f} GB/s")
    dp.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(PRESETS))
    ap.add_argument("--ops", type=int, default=2000)
    args = ap.parse_args()
    modeled_ops(args.ops)
    copy_bandwidth(args.pages, args.model)


if __name__ == "__main__":
    main()
