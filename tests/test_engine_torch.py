"""The torch data path: real bytes survive device -> host -> file -> host -> device."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvtier.engine.cache import Admission, CacheConfig, PrefetchPolicy, TieredCache
from kvtier.engine.datapath import CopyKind, TorchDataPath, _runs
from kvtier.engine.storage import PageMeta, PageStore
from kvtier.wire import StorageTier

PS = 4
SHAPE = (2, 2, PS, 2, 8)  # layers, K/V, page size, kv heads, head dim


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


def test_bytes_round_trip_through_every_tier(tmp_path: Path) -> None:
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device="cpu")
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


def test_short_page_payload_is_reported_not_swallowed(tmp_path: Path) -> None:
    dp = TorchDataPath(device_pages=2, host_pages=2, page_shape=SHAPE, device="cpu")
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


def test_draft_pool_mirrors_backup_file_store_and_load_back(tmp_path: Path) -> None:
    draft_shape = (1, 2, PS, 1, 8)
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device="cpu", draft_page_shape=draft_shape)
    store = PageStore(64, tmp_path / "l3")
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    cache = TieredCache(cfg, dp, store)
    assert dp.device_draft is not None
    try:
        a = list(range(4 * PS))
        adm = cache.admit("a", a)
        assert cache.begin_prefill(adm) is not None
        g = torch.Generator().manual_seed(5)
        dp.device_kv[adm.compute] = torch.randn((4, *SHAPE), generator=g).to(dp.device_kv.dtype)
        dp.device_draft[adm.compute] = torch.randn((4, *draft_shape), generator=g).to(dp.device_draft.dtype)
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
