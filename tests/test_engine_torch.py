"""The torch data path: real bytes survive device -> host -> file -> host -> device."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvtier.engine.cache import Admission, CacheConfig, PrefetchPolicy, TieredCache
from kvtier.engine.datapath import CopyKind, TorchDataPath, _runs
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore
from kvtier.wire import StorageTier

PS = 4
SHAPE = (2, 2, PS, 2, 8)  # layers, K/V, page size, kv heads, head dim
# Every data-path test runs on the CPU and, where one is present, on a CUDA device: there the pools sit on
# the GPU and in pinned host memory and copies run on a side stream, acknowledged through CUDA events.
DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


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
        data = torch.randn((len(adm.compute), *SHAPE), generator=g).to(dp.device_kv.dtype)
        dp.device_kv[adm.compute] = data.to(dp.device)
    cache.finish_prefill(adm)
    node = adm.last
    cache.release(adm)
    assert node.device is not None
    return dp.device_kv[node.device].clone().cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_bytes_round_trip_through_every_tier(tmp_path: Path, device: str) -> None:
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device=device)
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
        assert torch.equal(dp.device_kv[node.device].cpu(), written)
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
        store.begin_write("k", PageMeta(1, None, None, b"", 0))
        store.write_pages([("k", b"short")])  # a sound file whose payload is not a page of this shape
        assert store.commit("k", "engine")
        op = dp.new_op(CopyKind.S2H, [], [0], ["k"], store)
        dp.submit(op)
        done = dp.drain()
        assert done[0].error is not None and "bytes" in done[0].error and done[0].bad_keys == ["k"]
    finally:
        dp.close()


def test_copy_runs_group_contiguous_pages() -> None:
    assert _runs([0, 1, 2, 7, 8], [5, 6, 7, 0, 1]) == [(0, 5, 3), (7, 0, 2)]
    assert _runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]


@pytest.mark.parametrize("device", DEVICES)
def test_draft_pool_mirrors_backup_file_store_and_load_back(tmp_path: Path, device: str) -> None:
    draft_shape = (1, 2, PS, 1, 8)
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device=device, draft_page_shape=draft_shape)
    store = PageStore(64, tmp_path / "l3")
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    cache = TieredCache(cfg, dp, store)
    assert dp.device_draft is not None
    try:
        a = list(range(4 * PS))
        adm = cache.admit("a", a)
        assert cache.begin_prefill(adm) is not None
        g = torch.Generator().manual_seed(5)
        dp.device_kv[adm.compute] = torch.randn((4, *SHAPE), generator=g).to(dp.device, dp.device_kv.dtype)
        dp.device_draft[adm.compute] = torch.randn((4, *draft_shape), generator=g).to(dp.device, dp.device_draft.dtype)
        cache.finish_prefill(adm)
        node = adm.last
        assert node.device is not None
        target, draft = dp.device_kv[node.device].clone(), dp.device_draft[node.device].clone()
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
        assert torch.equal(dp.device_kv[node.device], target)
        assert torch.equal(dp.device_draft[node.device], draft)
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
