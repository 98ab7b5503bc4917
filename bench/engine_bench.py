"""Engine benchmark: cache operations per second, and how fast the torch data path moves scattered pages.

Modeled data path: insert (admit, prefill, release of a new 64-page sequence), match (admit and
release of one the device holds, checked to be found there) and device eviction, in operations per
second; prompts packed (:func:`kvtier.wire.pack_tokens`), and match once more from token-id lists.

Torch data path: device -> host (backup) and host -> device (load-back) ops of scattered pages (random
page ids on both sides, so no two pages are consecutive in both pools), 16 KiB to 512 KiB pages, 1 to
4,096 pages per op, timed from submission to acknowledgement. Beside each, one plain ``copy_`` of the
same number of bytes between contiguous buffers (pinned host memory with CUDA): the ratio is the
op's bandwidth over that one copy's (target >= 0.8 on a GPU). Each copier (``dma``: one copy per run
of consecutive pages; ``kernel``: kvtier.kernels.pagecopy; ``auto``: what the engine uses) and each
pool layout (``page``-major, ``layer``-major as engines lay KV out: 32 layers x K/V chunks per page).

    python bench/engine_bench.py [--layouts page,layer] [--copiers dma,kernel,auto] [--csv FILE]
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import statistics
import time
from collections.abc import Callable

import torch
from benchargs import count, counts, names

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import CopyKind, ModeledDataPath, TorchDataPath
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
    # One sequence in and out, untimed: the compiled kernels (page digests) load on first use.
    warm = cache.admit("warm", pack_tokens(range(n * 100_000, n * 100_000 + 64 * PS)))
    cache.begin_prefill(warm)
    cache.finish_prefill(warm)
    cache.release(warm)
    cache.flush_events()

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

    # Matches of the sequences inserted last, which the device still holds (256 of them fit): each finds its whole
    # prompt there but the last page, which a prefill always computes.
    recent = range(max(0, n // 2 - 200), n // 2)
    missed = 0
    t0 = time.perf_counter()
    for i in range(n):
        adm = cache.admit(f"m{i}", seqs[recent[i % len(recent)]])
        missed += adm.device_pages < 63
        cache.release(adm)
    match = n / (time.perf_counter() - t0)

    t0 = time.perf_counter()
    for i in range(n):
        adm = cache.admit(f"l{i}", lists[recent[i % len(recent)]])
        missed += adm.device_pages < 63
        cache.release(adm)
    match_lists = n / (time.perf_counter() - t0)
    assert not missed, f"{missed} of {2 * n} matches did not find their sequence on device"

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


LAYERS = 32  # layer-major pages: one chunk per layer and K/V


def _op(dp: TorchDataPath, kind: CopyKind, src: list[int], dst: list[int]) -> None:
    dp.submit(dp.new_op(kind, src, dst))
    dp.drain()


def _timed(fn: Callable[[], object], sync: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps + 1):  # the first run warms up (Triton compile, allocator)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def copy_table(layouts: list[str], copiers: list[str], sizes_kib: list[int], batches: list[int],
               reps: int, rows: list[dict[str, object]], max_dma_copies: int) -> None:
    cuda = torch.cuda.is_available()
    where = f"CUDA ({torch.cuda.get_device_name()}), pinned host memory" if cuda else "CPU (copy thread)"
    target = "target >= 0.80" if cuda else "the target, >= 0.80 on a GPU, is not judged on the CPU"
    print(f"\ntorch data path on {where}: scattered pages, GB/s and x one copy_ of the same bytes "
          f"(median of {reps}; {target})")
    n = max(batches)
    g = torch.Generator().manual_seed(0)
    for layout in layouts:
        for kib in sizes_kib:
            words = kib * 1024 // 2  # bf16 elements per page
            shape = (LAYERS, 2, words // (2 * LAYERS)) if layout == "layer" else (words,)
            # One data path per page size (pinned memory is slow to get); each copier is set on it in turn.
            dp = TorchDataPath(n, n, shape, layout=layout)
            if "kernel" in copiers and dp.kernel_error is not None:
                raise SystemExit(f"engine_bench: copier kernel cannot run here: {dp.kernel_error}")
            dp.device_kv.view(-1)[:] = 1.0
            flat_dev = dp.device_kv.view(-1).view(torch.uint8)
            flat_host = dp.host_kv.view(-1).view(torch.uint8)

            def sync() -> None:
                if cuda:
                    torch.cuda.synchronize()

            for pages in batches:
                nbytes = pages * dp.page_bytes
                src = torch.randperm(n, generator=g)[:pages].tolist()
                dst = torch.randperm(n, generator=g)[:pages].tolist()
                for kind in (CopyKind.D2H, CopyKind.H2D):
                    a, b = (flat_host, flat_dev) if kind is CopyKind.D2H else (flat_dev, flat_host)
                    one = functools.partial(a[:nbytes].copy_, b[:nbytes], non_blocking=cuda)
                    ref = _timed(one, sync, reps)
                    row: dict[str, object] = {"layout": layout, "page_kib": kib, "pages": pages,
                                              "kind": kind.value, "one_copy_gbps": round(nbytes / ref / 1e9, 3)}
                    for c in copiers:
                        copies = pages * (2 * LAYERS if layout == "layer" else 1)
                        if c == "dma" and copies > max_dma_copies:  # a copy_ each: seconds per op, nothing to learn
                            row[f"{c}_gbps"] = row[f"{c}_x"] = float("nan")
                            continue

                        dp.copier = "dma" if dp.kernel_error is not None else c  # as auto falls back
                        pair = (src, dst) if kind is CopyKind.D2H else (dst, src)
                        t = _timed(functools.partial(_op, dp, kind, *pair), sync, reps)
                        row[f"{c}_gbps"] = round(nbytes / t / 1e9, 3)
                        row[f"{c}_x"] = round(ref / t, 3)
                    rows.append(row)
            dp.close()
            del dp, flat_dev, flat_host
    for layout in layouts:
        for direction in ("d2h", "h2d"):
            print(f"\n{layout}-major pools, {direction}: GB/s of one copy_, then per copier GB/s (x one copy_)")
            print(f"{'page KiB':>8} {'pages':>5} {'one copy':>9}" + "".join(f" {c:>16}" for c in copiers))
            for r in rows:
                if r["layout"] == layout and r["kind"] == direction:
                    print(f"{r['page_kib']:>8} {r['pages']:>5} {r['one_copy_gbps']:>9.2f}"
                          + "".join(f" {r[f'{c}_gbps']:>8.2f} ({r[f'{c}_x']:4.2f})" for c in copiers))
    for c in copiers:
        for layout in layouts:
            mine = [r for r in rows if r["layout"] == layout]
            mine = [r for r in mine if not math.isnan(float(str(r[f"{c}_x"])))]
            met = sum(float(str(r[f"{c}_x"])) >= 0.8 for r in mine)
            big = [float(str(r[f"{c}_x"])) for r in mine if int(str(r["pages"])) >= 64]
            print(f"{c:>6} {layout}-major: {met}/{len(mine)} cells measured >= 0.80 x one copy_; "
                  f"ops of >= 64 pages: min {min(big, default=float('nan')):.2f}, "
                  f"median {statistics.median(big) if big else float('nan'):.2f}"
                  f"{'' if torch.cuda.is_available() else ' (CPU: not judged)'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=count(512), default=2000,
                    help="cache operations per modeled measurement, at least 512: the first half fills the device "
                         "(256 sequences), so that each insert of the last phase evicts one")
    ap.add_argument("--layouts", type=names(["page", "layer"]), default="page,layer", help="pool layouts: page, layer")
    ap.add_argument("--copiers", type=names(["dma", "kernel", "auto"]), default="dma,kernel,auto",
                    help="copiers: dma, kernel, auto (kernel: CUDA only)")
    ap.add_argument("--sizes-kib", type=counts(), default="16,32,64,128,256,512", help="page sizes, KiB")
    ap.add_argument("--batches", type=counts(), default="1,4,16,64,256,1024,4096", help="pages per op")
    ap.add_argument("--reps", type=count(), default=5, help="timed runs per cell (the median is shown)")
    ap.add_argument("--csv", help="also write every cell to this CSV")
    ap.add_argument("--max-dma-copies", type=count(), default=20_000,
                    help="skip dma cells needing more copy_ calls per op than this (nan in the table)")
    ap.add_argument("--skip-modeled", action="store_true", help="only the torch data path")
    args = ap.parse_args()
    if not args.skip_modeled:
        modeled_ops(args.ops)
    copiers: list[str] = args.copiers
    if not torch.cuda.is_available() and "kernel" in copiers:
        copiers = [c for c in copiers if c != "kernel"] or ["dma"]
        print(f"copier kernel needs CUDA: left out here (measuring {', '.join(copiers)})")
    rows: list[dict[str, object]] = []
    copy_table(args.layouts, copiers, args.sizes_kib, args.batches, args.reps, rows, args.max_dma_copies)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
