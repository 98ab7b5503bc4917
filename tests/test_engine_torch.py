"""The torch data path: real bytes survive device -> host -> file -> host -> device."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtier.engine.cache import Admission, CacheConfig, PrefetchPolicy, TieredCache
from kvtier.engine.datapath import CopyKind, TorchDataPath, _count_runs, _runs
from kvtier.engine.hashing import ROOT_DIGEST, event_hash, page_digest
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore
from kvtier.kernels import pagecopy
from kvtier.wire import StorageTier

PS = 4
SHAPE = (2, 2, PS, 2, 8)  # layers, K/V, page size, kv heads, head dim
# Every data-path test runs on the CPU and, where one is present, on a CUDA device: there the pools sit on
# the GPU and in pinned host memory and copies run on a side stream, acknowledged through CUDA events.
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def wait(cache: TieredCache, adm: Admission | None = None, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cache.poll()
        busy = cache.dp.ops or (adm is not None and (cache.waiting_for(adm) or adm.prefetch_op is not None))
        if not busy:
            return
        time.sleep(0.002)
    raise AssertionError("copies did not complete")


def run(cache: TieredCache, dp: TorchDataPath, rid: str, tokens: list[int], fill: int | None) -> torch.Tensor:
    adm = cache.admit(rid, tokens)
    wait(cache, adm)
    plan = cache.begin_prefill(adm)
    assert plan is not None
    if fill is not None and adm.compute:
        g = torch.Generator().manual_seed(fill)
        dp.set_pages(dp.device_kv, adm.compute, torch.randn((len(adm.compute), *SHAPE), generator=g))
    cache.finish_prefill(adm)
    node = adm.last
    cache.release(adm)
    assert node.device is not None
    return dp.pages(dp.device_kv, node.device).cpu()


@pytest.mark.parametrize("layout", ["page", "layer"])
@pytest.mark.parametrize("device", DEVICES)
def test_bytes_round_trip_through_every_tier(tmp_path: Path, device: str, layout: str) -> None:
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device=device, layout=layout)
    store = PageStore(64, tmp_path / "l3")
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    cache = TieredCache(cfg, dp, store)
    try:
        a = list(range(4 * PS))
        written = run(cache, dp, "a", a, fill=1)
        wait(cache)
        assert store.pages_path is not None
        assert len(list(store.pages_path.iterdir())) == 4  # one file per page
        for i in range(2):  # push `a` out of device and host
            run(cache, dp, f"x{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * PS)), fill=10 + i)
            wait(cache)
        assert not cache.tree.match(a), "a should be only in the file store now"
        assert all(h not in cache.residency()[StorageTier.HOST] for h in cache.tree.root.hashes)
        adm = cache.admit("a2", a)
        assert adm.l3_pages == 4
        wait(cache, adm)
        plan = cache.begin_prefill(adm)
        assert plan is not None and plan.cached_tokens == 4 * PS
        node = adm.last
        assert node.device is not None
        assert torch.equal(dp.pages(dp.device_kv, node.device).cpu(), written)
        cache.finish_prefill(adm)
        cache.release(adm)
        cache._check()
    finally:
        dp.close()


@pytest.mark.parametrize("device", DEVICES)
def test_short_page_payload_is_reported_not_swallowed(tmp_path: Path, device: str) -> None:
    dp = TorchDataPath(device_pages=2, host_pages=2, page_shape=SHAPE, device=device)
    store = PageStore(8, tmp_path)
    try:
        digest = page_digest(ROOT_DIGEST, bytes(4 * PS))
        key = digest.hex()
        store.begin_write(key, PageMeta(event_hash(digest), None, None, bytes(4 * PS), 0))
        store.write_pages([(key, b"short")])  # a sound file whose payload is not a page of this shape
        assert store.commit(key, "engine")
        op = dp.new_op(CopyKind.S2H, [], [0], [key], store)
        dp.submit(op)
        done = dp.drain()
        assert done[0].error is not None and "bytes" in done[0].error and done[0].bad_keys == [key]
        assert store.stats.damaged_reads == 1  # a page of another size is damage, counted as such
    finally:
        dp.close()


def test_copy_runs_group_contiguous_pages() -> None:
    assert _runs([0, 1, 2, 7, 8], [5, 6, 7, 0, 1]) == [(0, 5, 3), (7, 0, 2)]
    assert _runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]
    assert _count_runs([0, 1, 2, 7, 8], [5, 6, 7, 0, 1], 4) == 2
    assert _count_runs(list(range(10)), list(range(10, 0, -1)), 3) == 4  # stops past the limit
    assert _count_runs([], [], 4) == 0


@pytest.mark.parametrize("layout", ["page", "layer"])
@pytest.mark.parametrize("device", DEVICES)
def test_draft_pool_mirrors_backup_file_store_and_load_back(tmp_path: Path, device: str, layout: str) -> None:
    draft_shape = (1, 2, PS, 1, 8)
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device=device, draft_page_shape=draft_shape,
                       layout=layout)
    store = PageStore(64, tmp_path / "l3")
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    cache = TieredCache(cfg, dp, store)
    assert dp.device_draft is not None
    try:
        a = list(range(4 * PS))
        adm = cache.admit("a", a)
        assert cache.begin_prefill(adm) is not None
        g = torch.Generator().manual_seed(5)
        dp.set_pages(dp.device_kv, adm.compute, torch.randn((4, *SHAPE), generator=g))
        dp.set_pages(dp.device_draft, adm.compute, torch.randn((4, *draft_shape), generator=g))
        cache.finish_prefill(adm)
        node = adm.last
        assert node.device is not None
        target, draft = dp.pages(dp.device_kv, node.device), dp.pages(dp.device_draft, node.device)
        cache.release(adm)
        wait(cache)
        assert store.pages_path is not None
        files = sorted(p.name for p in store.pages_path.iterdir())
        assert len(files) == 8 and sum(f.startswith("d_") for f in files) == 4  # target + draft per page
        for i in range(2):
            run(cache, dp, f"x{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * PS)), fill=10 + i)
            wait(cache)
        adm = cache.admit("a2", a)
        assert adm.l3_pages == 4
        wait(cache, adm)
        assert cache.begin_prefill(adm) is not None
        node = adm.last
        assert node.device is not None
        assert torch.equal(dp.pages(dp.device_kv, node.device), target)
        assert torch.equal(dp.pages(dp.device_draft, node.device), draft)
        cache.release(adm)
        victim = store.announced_by("engine")[-1]
        store.delete(victim)  # eviction removes the draft companion too
        assert not (tmp_path / "l3" / ("d_" + victim)).exists()
    finally:
        dp.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_copies_run_on_a_side_stream_after_the_compute_that_wrote_the_pages() -> None:
    """A backup copy must see what compute wrote, even while compute is still running on its stream.

    The compute stream is held busy (``torch.cuda._sleep``) before it fills the pages, so a copy stream
    that did not wait for it would read the zeros that were there before.
    """
    dp = TorchDataPath(device_pages=4, host_pages=4, page_shape=(8, 2, PS, 8, 128), device="cuda")
    try:
        assert dp.device_kv.is_cuda and dp.host_kv.is_pinned()
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s of GPU cycles
        dp.device_kv[:2].fill_(3.0)
        d2h = dp.new_op(CopyKind.D2H, [0, 1], [2, 3])
        dp.submit(d2h)
        assert [op.op_id for op in dp.drain()] == [d2h.op_id] and d2h.error is None
        assert bool((dp.host_kv[2:4] == 3.0).all()), "the D2H copy ran before the compute that wrote the pages"
        dp.host_kv[0].fill_(7.0)
        h2d = dp.new_op(CopyKind.H2D, [0], [3])
        dp.submit(h2d)
        dp.drain()
        torch.cuda.synchronize()
        assert bool((dp.device_kv[3] == 7.0).all())
    finally:
        dp.close()


def test_layouts_and_copiers_are_checked() -> None:
    with pytest.raises(ValueError, match="layout must be one of page, layer"):
        TorchDataPath(2, 2, SHAPE, device="cpu", layout="rows")
    with pytest.raises(ValueError, match="copier must be one of"):
        TorchDataPath(2, 2, SHAPE, device="cpu", copier="fast")
    with pytest.raises(ValueError, match="at least 3 dimensions"):
        TorchDataPath(2, 2, (PS, 64), device="cpu", layout="layer")


def test_a_layer_major_pool_holds_each_page_as_one_chunk_per_layer_and_kv() -> None:
    dp = TorchDataPath(device_pages=3, host_pages=2, page_shape=SHAPE, device="cpu", layout="layer")
    try:
        assert dp.device_kv.shape == (2, 2, 3, PS, 2, 8) and dp.host_kv.shape == (2, 2, 2, PS, 2, 8)
        assert dp.page_bytes == 2 * 2 * PS * 2 * 8 * dp.device_kv.element_size()
        data = torch.arange(2 * 2 * 2 * PS * 2 * 8, dtype=torch.float32).view(2, *SHAPE)
        dp.set_pages(dp.device_kv, [2, 0], data)
        assert torch.equal(dp.device_kv[1, 0, 2], data[0, 1, 0].to(dp.device_kv.dtype))  # layer 1, K of page 2
        dp.submit(dp.new_op(CopyKind.D2H, [2, 0], [1, 0]))
        dp.drain()
        assert torch.equal(dp.pages(dp.host_kv, [1, 0]), data.to(dp.host_kv.dtype))
    finally:
        dp.close()


@pytest.mark.skipif(not pagecopy.available(), reason="needs Triton")
@pytest.mark.parametrize("words", [2 * pagecopy.TILE_WORDS + 7, 70])
@pytest.mark.parametrize("chunks", [1, 3, 40])
def test_the_page_copy_kernel_moves_each_chunk_of_each_page_to_its_destination(
        monkeypatch: pytest.MonkeyPatch, chunks: int, words: int) -> None:
    """The kernel's indexing, run by Triton's interpreter on CPU tensors (on a GPU the CUDA tests run it for real):
    chunks longer than one tile and ending mid-tile, or many to a tile (the last tile partly filled); strides that
    differ between the two pools."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(pagecopy, "_kernel", None)  # built afresh under the interpreter, dropped after
    src = torch.randint(-2**31, 2**31 - 1, (chunks, 9, words), dtype=torch.int32)
    dst = torch.zeros((chunks, 5, words), dtype=torch.int32)
    s, d = [7, 0, 4, 3], [1, 4, 0, 2]
    rows, width = pagecopy.tile(chunks, words)
    assert rows * width <= pagecopy.TILE_WORDS and (rows > 1) == (chunks > 1 and words < pagecopy.TILE_WORDS)
    pagecopy.copy_pages(src.view(-1), dst.view(-1), torch.tensor(s), torch.tensor(d), chunks, words,
                        9 * words, 5 * words)
    assert torch.equal(dst[:, d], src[:, s])
    assert not dst[:, 3].any()  # no page was copied there


@NEEDS_CUDA
@pytest.mark.parametrize("layout", ["page", "layer"])
@pytest.mark.parametrize("copier", ["kernel", "dma"])
def test_cuda_copiers_move_scattered_pages_of_both_pools(layout: str, copier: str) -> None:
    draft = (1, 2, PS, 1, 8)
    dp = TorchDataPath(device_pages=64, host_pages=48, page_shape=SHAPE, device="cuda", draft_page_shape=draft,
                       layout=layout, copier=copier)
    assert dp.device_draft is not None and dp.host_draft is not None
    try:
        assert dp.copier == copier and dp.kernel_error is None
        g = torch.Generator().manual_seed(3)
        dp.set_pages(dp.device_kv, range(64), torch.randn((64, *SHAPE), generator=g))
        dp.set_pages(dp.device_draft, range(64), torch.randn((64, *draft), generator=g))
        src = torch.randperm(64, generator=g)[:40].tolist()
        dst = torch.randperm(48, generator=g)[:40].tolist()
        dp.submit(dp.new_op(CopyKind.D2H, src, dst))
        assert all(op.error is None for op in dp.drain())
        for dev_pool, host_pool, _ in dp._pools():
            assert torch.equal(dp.pages(host_pool, dst), dp.pages(dev_pool, src).cpu())
        back = torch.randperm(64, generator=g)[:40].tolist()
        dp.submit(dp.new_op(CopyKind.H2D, dst, back))
        dp.drain()
        for dev_pool, host_pool, _ in dp._pools():
            assert torch.equal(dp.pages(dev_pool, back).cpu(), dp.pages(host_pool, dst))
    finally:
        dp.close()


@NEEDS_CUDA
def test_auto_copier_runs_the_kernel_on_a_gpu_where_chunks_are_whole_words() -> None:
    dp = TorchDataPath(device_pages=4, host_pages=4, page_shape=SHAPE, device="cuda")
    try:
        assert dp.kernel_error is None and dp.copier == "auto"
    finally:
        dp.close()
    odd = TorchDataPath(device_pages=4, host_pages=4, page_shape=(2, 2, 1, 1, 3), device="cuda", layout="layer")
    try:  # 6-byte chunks: the kernel moves 4-byte words, so every copy is a copy_
        assert odd.copier == "dma" and odd.kernel_error is not None and "4-byte words" in odd.kernel_error
    finally:
        odd.close()
    with pytest.raises(RuntimeError, match="4-byte words"):
        TorchDataPath(device_pages=4, host_pages=4, page_shape=(2, 2, 1, 1, 3), device="cuda", layout="layer",
                      copier="kernel")


@NEEDS_CUDA
@pytest.mark.parametrize("layout", ["page", "layer"])
def test_a_backup_waits_for_pages_written_on_a_side_stream(tmp_path: Path, layout: str) -> None:
    """Compute that fills the pages on a stream of its own, held busy first: a backup ordered after the current
    stream only copies the zeros that were there before. The engine is given the writer's event."""
    dp = TorchDataPath(device_pages=8, host_pages=8, page_shape=SHAPE, device="cuda", layout=layout)
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=8, host_ratio=1.0), dp)
    try:
        adm = cache.admit("a", list(range(4 * PS)))
        assert cache.begin_prefill(adm) is not None and len(adm.compute) == 4
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            torch.cuda._sleep(400_000_000)  # type: ignore[no-untyped-call]  # ~0.2 s of GPU cycles
            dp.set_pages(dp.device_kv, adm.compute, torch.full((4, *SHAPE), 3.0, device="cuda"))
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
        cache.finish_prefill(adm, ready=done)  # write-through: the new pages are backed up now
        node = adm.last
        cache.release(adm)
        wait(cache)
        assert node.host is not None, "the backup did not land"
        assert bool((dp.pages(dp.host_kv, node.host) == 3.0).all()), "the backup copied the pages before the write"
    finally:
        dp.close()


@NEEDS_CUDA
def test_a_load_back_is_not_queued_behind_backups() -> None:
    """The backup stream is held by a long kernel; a load-back submitted after the backup still lands first."""
    dp = TorchDataPath(device_pages=8, host_pages=8, page_shape=SHAPE, device="cuda")
    try:
        with torch.cuda.stream(dp._streams[CopyKind.D2H]):
            torch.cuda._sleep(4_000_000_000)  # type: ignore[no-untyped-call]  # ~2 s of GPU cycles
        backup = dp.new_op(CopyKind.D2H, [0, 1], [0, 1])
        dp.submit(backup)
        dp.host_kv[5].fill_(9.0)
        load = dp.new_op(CopyKind.H2D, [5], [6])
        dp.submit(load)
        done: list[int] = []
        deadline = time.monotonic() + 10
        while load.op_id not in done and time.monotonic() < deadline:
            done += [op.op_id for op in dp.poll()]
        assert load.op_id in done, "the load-back never landed"
        assert backup.op_id not in done and backup.op_id in dp.ops, "the load-back waited for the backup"
        assert bool((dp.device_kv[6] == 9.0).all())
        dp.drain()
    finally:
        dp.close()
