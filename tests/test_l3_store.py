"""The L3 file store: damaged pages are never served, restarts are warm, partial writes leave nothing,
engines of other layouts or other processes sharing the directory never touch each other's pages."""

from __future__ import annotations

import functools
import os
import random
import re
import time
from pathlib import Path

import msgspec
import pytest
import torch

from kvtier.engine.cache import CacheConfig, PrefetchPolicy, TieredCache
from kvtier.engine.datapath import TorchDataPath
from kvtier.engine.hashing import ROOT_DIGEST, chain, event_hash, page_digest
from kvtier.engine.l3 import pagedir
from kvtier.engine.l3.pagedir import OwnerBusy, SyncPolicy
from kvtier.engine.l3.pagefile import _FIXED, FIXED_SIZE, Layout, PageFileError, PageHeader, decode, encode, read_header
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore, StoreError
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import BlockRemoved, BlockStored, StorageTier, WorkerId, pack_tokens
from kvtier.wire.notices import StreamId
from tests.test_engine_torch import DEVICES, PS, SHAPE, run, wait

L = Layout("m", PS)



@functools.cache
def _digest(i: int, root: int = 0) -> bytes:
    """Page ``i`` of a chain from page ``root`` (each page's parent the one before it), its tokens all ``i``."""
    return page_digest(ROOT_DIGEST if i == root else _digest(i - 1, root), pack_tokens([i] * PS))


def k(i: int, root: int = 0) -> str:
    """The L3 key of page ``i`` of the chain from page ``root``: its digest (which its header is checked against)."""
    return _digest(i, root).hex()


def meta(i: int, parent: int | None) -> PageMeta:
    """Page ``i`` under page ``parent`` = ``i - 1`` of the chain from page 0, or a root of its own (None)."""
    assert parent in (None, i - 1)
    if parent is None:
        return PageMeta(event_hash(_digest(i, i)), None, None, pack_tokens([i] * PS), 0)
    return PageMeta(event_hash(_digest(i)), k(parent), event_hash(_digest(parent)), pack_tokens([i] * PS), i)


def chain_store(path: Path, n: int, *, owner: str = "a", capacity: int = 64, shared: bool = False,
                layout: Layout = L, sync: SyncPolicy = SyncPolicy.NONE) -> PageStore:
    """A store holding pages k0 <- k1 <- ... (a chain), each 64 bytes of its own."""
    store = PageStore(capacity, path, owner=owner, shared=shared, layout=layout, sync=sync)
    store.attach(owner, lambda keys: None)
    for i in range(n):
        store.begin_write(k(i), meta(i, i - 1 if i else None))
        store.write_pages([(k(i), bytes([i]) * 64)])
        assert store.commit(k(i), owner)
    return store


def files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != ".lock")


# --- the file format -----------------------------------------------------------------------


def test_every_damaged_byte_is_caught() -> None:
    header = PageHeader(k(0), L.tag(), event_hash(_digest(0)), None, None, 0, pack_tokens([0] * PS))
    good = b"".join(bytes(x) for x in encode(header, bytes(range(256)) * 4))
    assert bytes(decode(good, k(0), L.tag())[1]) == bytes(range(256)) * 4
    rng = random.Random(0)
    for pos in range(len(good)):  # every single-byte change is detected, header or payload
        bad = bytearray(good)
        bad[pos] ^= rng.randrange(1, 256)
        with pytest.raises(PageFileError):
            decode(bytes(bad), k(0), L.tag())
    for cut in (0, FIXED_SIZE - 1, FIXED_SIZE + 3, len(good) - 1):
        with pytest.raises(PageFileError):
            decode(good[:cut], k(0), L.tag())
    with pytest.raises(PageFileError, match="holds page"):
        decode(good, "other", L.tag())
    with pytest.raises(PageFileError, match="layout"):
        decode(good, k(0), Layout("other-model", PS).tag())


def test_adoption_reads_a_damaged_header_as_damaged(tmp_path: Path) -> None:
    """Adoption reads a page's header, not its checksum: whatever byte of the header is changed, the header read is
    the one written or :class:`PageFileError`, never another exception (a key made no UTF-8 stopped every start) nor
    another page (a token flipped made the engine announce a block it never held). Only its depth is not checked
    here, but against its parent's by the store (below)."""
    header = PageHeader(k(1), L.tag(), event_hash(_digest(1)), k(0), event_hash(_digest(0)), 1,
                        pack_tokens([1] * PS))
    good = b"".join(bytes(x) for x in encode(header, bytes(64)))
    path = tmp_path / "page"
    for pos in range(len(good) - 64):
        for flip in (0x01, 0x20, 0x80, 0xFF):
            bad = bytearray(good)
            bad[pos] ^= flip
            path.write_bytes(bytes(bad))
            try:
                got = read_header(str(path), k(1), L.tag())
            except PageFileError:
                continue
            assert msgspec.structs.replace(got, depth=1) == header, f"byte {pos} ^ {flip:#x} read as another header"


def test_a_restart_adopts_no_page_whose_header_or_file_was_damaged(tmp_path: Path) -> None:
    """A token flipped in one page's header, or a page's file gone from ``pages/`` (its owner's link left in
    ``refs/``): that page is dropped at start, and its descendants with it; its ancestors stay."""
    chain_store(tmp_path / "flip", 6)
    page = tmp_path / "flip" / L.tag() / "pages" / k(2)
    data = bytearray(page.read_bytes())
    data[FIXED_SIZE + _FIXED.unpack_from(data)[3] - 1] ^= 1  # the header ends with the last token id's high byte
    page.write_bytes(bytes(data))  # in place: the owner's link sees it
    store = PageStore(64, tmp_path / "flip", owner="a", layout=L)
    assert store.unannounced() == [k(0), k(1)] and store.stats.dropped_at_start == 4
    chain_store(tmp_path / "gone", 6)
    (tmp_path / "gone" / L.tag() / "pages" / k(3)).unlink()
    store = PageStore(64, tmp_path / "gone", owner="a", layout=L)
    assert store.unannounced() == [k(0), k(1), k(2)]
    assert bytes(store.read_page(k(2))) == bytes([2]) * 64
    chain_store(tmp_path / "depth", 6)
    page = tmp_path / "depth" / L.tag() / "pages" / k(4)
    data = bytearray(page.read_bytes())
    at = FIXED_SIZE + _FIXED.unpack_from(data)[3] - 4 * PS - 3  # the depth: before the tokens' bin8 head
    assert data[at] == 4
    data[at] = 9
    page.write_bytes(bytes(data))
    store = PageStore(64, tmp_path / "depth", owner="a", layout=L)
    assert store.unannounced() == [k(0), k(1), k(2), k(3)]


def test_overwritten_pages_are_never_served(tmp_path: Path) -> None:
    """The issue's reproduction: 100 bytes overwritten in every page file."""
    store = chain_store(tmp_path, 40)
    assert store.pages_path is not None
    rng = random.Random(1)
    for f in store.pages_path.iterdir():
        data = bytearray(f.read_bytes())
        at = rng.randrange(0, len(data) - 100)
        data[at:at + 100] = bytes(rng.randrange(256) for _ in range(100))
        f.write_bytes(bytes(data))  # in place: the ref links see it too
    served = 0
    for i in range(40):
        try:
            store.read_page(k(i))
            served += 1
        except StoreError as exc:
            assert exc.key == k(i)
    assert served == 0 and store.stats.damaged_reads == 40


def test_a_sound_write_replaces_another_owners_damaged_file_of_the_page(tmp_path: Path) -> None:
    """Two owners of one directory (engines on one pool): b's file of a page rotted, and a's write of that page
    shared b's file, throwing its own sound bytes away. a announced a page it could never read, and so on at every
    rewrite. A damaged file found there is now replaced by the sound one, b's hold moved to it (the file stays while
    b holds it, a gone); a sound one is still shared."""
    b = chain_store(tmp_path, 2, owner="b", shared=True)
    assert b.pages_path is not None
    rotted = b.pages_path / k(0)
    data = bytearray(rotted.read_bytes())
    data[-1] ^= 0xFF
    rotted.write_bytes(bytes(data))  # in place: b's hold sees it too
    a = PageStore(64, tmp_path, owner="a", shared=True, layout=L)
    a.attach("a", lambda keys: None)
    for i in (0, 1):
        a.begin_write(k(i), meta(i, i - 1 if i else None))
        a.write_pages([(k(i), bytes([100 + i]) * 64)])
        assert a.commit(k(i), "a")
    assert bytes(a.read_page(k(0))) == bytes([100]) * 64 and a.stats.damaged_reads == 0
    assert bytes(a.read_page(k(1))) == bytes([1]) * 64  # b's sound file, shared
    holds = tmp_path / L.tag() / "refs"
    for i in (0, 1):
        assert os.path.samefile(holds / "a" / k(i), holds / "b" / k(i))
        assert os.path.samefile(holds / "a" / k(i), b.pages_path / k(i))
        assert (b.pages_path / k(i)).stat().st_nlink == 3  # the page's name and its two owners
    assert a._dir is not None
    a._dir.release([k(1), k(0)])
    assert bytes(b.read_page(k(0))) == bytes([100]) * 64 and b.stats.damaged_reads == b.stats.missing_reads == 0
    assert sorted(p.name for p in (tmp_path / L.tag()).iterdir() if p.name.startswith(".tmp-")) == []


def test_page_files_follow_the_umask_and_a_page_that_cannot_be_read_is_counted(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Page files were made by mkstemp, readable by their owner alone: another user's engine on a shared pool missed
    every page the first one wrote (the miss neither counted nor logged) and failed to hold any. They follow the
    umask now, and a page found that cannot be read counts as a failed probe."""
    old = os.umask(0o022)
    try:
        a = chain_store(tmp_path, 1, shared=True)
    finally:
        os.umask(old)
    assert a.pages_path is not None
    assert (a.pages_path / k(0)).stat().st_mode & 0o777 == 0o644
    b = PageStore(64, tmp_path, owner="b", shared=True, layout=L)
    b.attach("b", lambda keys: None)

    def refused(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pagedir, "read_header", refused)
    assert b._dir is not None and b._dir.probe(k(0)) is None
    assert b._dir.probe_failures == 1


@pytest.mark.parametrize("device", DEVICES)
def test_damaged_or_missing_page_is_dropped_with_its_descendants_and_removed_from_the_index(
        tmp_path: Path, device: str) -> None:
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device=device)
    store = PageStore(64, tmp_path, layout=L)
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    cache = TieredCache(cfg, dp, store, name="w0")
    index = TieredIndex(PS)
    sid = StreamId(WorkerId("w0"))
    index.add_worker(sid)

    def deliver() -> list[object]:
        batch = cache.flush_events()
        for ev in batch.events if batch else []:
            index.apply(sid, ev)
        return list(batch.events) if batch else []

    try:
        a = list(range(4 * PS))
        run(cache, dp, "a", a, fill=1)
        wait(cache)
        for i in range(2):  # push `a` out of device and host: it is only in the file store now
            run(cache, dp, f"x{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * PS)), fill=10 + i)
            wait(cache)
        deliver()
        assert index.find_matches(a).workers[sid].disk == 4
        second = chain(b"", a, PS)[1].hex()  # a's second page
        assert store.pages_path is not None
        target = store.pages_path / second
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.write_bytes(bytes(data))
        adm = cache.admit("a2", a)
        assert adm.l3_pages == 4
        wait(cache, adm)
        events = deliver()
        removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes]
        assert len(removed) == 3  # the damaged page and its two descendants, announced and now withdrawn
        assert index.find_matches(a).workers[sid].disk == 1
        assert store.stats.damaged_reads == 1
        cache.release(adm)
        adm = cache.admit("a3", a)
        assert adm.l3_pages == 1  # the damaged page is never offered again
        wait(cache, adm)
        cache.release(adm)
        first = chain(b"", a, PS)[0].hex()
        (store.pages_path / first).unlink()  # deleted under the engine
        with pytest.raises(StoreError, match="gone"):
            store.read_page(first)
        assert store.stats.missing_reads == 1
        cache._check()
    finally:
        dp.close()


# --- restarts ------------------------------------------------------------------------------


def test_restart_adopts_sound_pages_within_capacity_and_cleans_the_rest(tmp_path: Path) -> None:
    chain_store(tmp_path, 12, capacity=64)  # a process that is killed: nothing cleaned up
    base = tmp_path / L.tag()
    (base / (pagedir.tmp_prefix(999_999_999) + "x")).write_bytes(b"half a page")  # a dead writer's temporary file
    (base / (pagedir.tmp_prefix() + "y")).write_bytes(b"ours, from before")
    (base / "pages" / "stray").write_bytes(b"nobody holds this")
    (base / "pages" / k(5)).write_bytes(b"KVTP")  # truncated: not adopted, nor its descendants
    store = PageStore(8, tmp_path, owner="a", layout=L)
    assert store.stats.tmp_removed == 2 and store.stats.unheld_removed >= 1
    assert len(store) == 5 and store.stats.adopted == 5 and store.stats.dropped_at_start == 7
    assert store.unannounced() == [k(i) for i in range(5)]
    store._check()
    assert len(files(base / "pages")) == 5 and not [f for f in os.listdir(base) if f.startswith(".tmp")]
    chain_store(tmp_path / "big", 12)
    assert len(PageStore(8, tmp_path / "big", owner="a", layout=L)) == 8  # capacity holds on start
    assert len(files(tmp_path / "big" / L.tag() / "pages")) == 8
    assert bytes(store.read_page(k(3))) == bytes([3]) * 64


def test_a_page_dropped_at_restart_takes_its_draft_with_it(tmp_path: Path) -> None:
    """A page written with its draft model's companion (``d:`` + its key, as TorchDataPath writes them) and found
    damaged at restart: the draft goes too, not held for good where no store names it (its own clear() included)."""
    store = PageStore(8, tmp_path, owner="a", layout=L)
    store.attach("a", lambda keys: None)
    for i in range(2):
        store.begin_write(k(i), meta(i, i - 1 if i else None))
        store.write_pages([(k(i), bytes([i]) * 64), ("d:" + k(i), bytes([i]) * 32)])
        assert store.commit(k(i), "a")
    store.close()
    base = tmp_path / L.tag()
    (base / "pages" / k(1)).write_bytes(b"KVTP")  # page 1 damaged, its draft sound
    again = PageStore(8, tmp_path, owner="a", layout=L)
    assert again.stats.adopted == 1
    assert sorted(files(base / "pages")) == sorted([k(0), "d_" + k(0)]) == sorted(files(base / "refs" / "a"))
    again.attach("a", lambda keys: None)
    again.clear()
    assert files(base / "pages") == [] and files(base / "refs" / "a") == []


def test_temporary_files_are_judged_by_where_their_writer_ran(tmp_path: Path) -> None:
    """A pool may be shared by engines on other hosts or in other containers, whose process ids mean nothing here:
    their temporary files go only once older than any write takes (``STALE_TMP_S``). This host's go when their
    writer is gone, and so do files older than that bound wherever they were written."""
    base = tmp_path / L.tag()
    chain_store(tmp_path, 1).close()
    live, dead = os.getppid(), 999_999_999  # (the test's parent process outlives it)
    old = time.time() - pagedir.STALE_TMP_S - 60
    keep = [pagedir.tmp_prefix(dead, host="0123abcd") + "a", pagedir.tmp_prefix(live, host="0123abcd") + "b",
            pagedir.tmp_prefix(live) + "c"]
    drop = [pagedir.tmp_prefix(dead) + "d", pagedir.tmp_prefix() + "e", f".tmp-{dead}-f"]
    stale = [pagedir.tmp_prefix(dead, host="0123abcd") + "g", pagedir.tmp_prefix(live) + "h", f".tmp-{live}-i"]
    for name in keep + drop + stale:
        (base / name).write_bytes(b"half a page")
    for name in stale:
        os.utime(base / name, (old, old))
    store = PageStore(8, tmp_path, owner="a", layout=L)
    assert store.stats.tmp_removed == len(drop + stale)
    assert sorted(f for f in os.listdir(base) if f.startswith(".tmp")) == sorted(keep)
    assert len(store) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_restarted_engine_announces_its_pages_before_anything_else(tmp_path: Path, device: str) -> None:
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device=device)
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    try:
        cache = TieredCache(cfg, dp, PageStore(64, tmp_path, owner="w0", layout=L), name="w0")
        a = list(range(4 * PS))
        written = run(cache, dp, "a", a, fill=3)
        wait(cache)
        before = cache.residency()[StorageTier.DISK]
        assert len(before) == 4
    finally:
        dp.close()
        cache.store.close() if cache.store else None
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device=device)
    try:
        store = PageStore(64, tmp_path, owner="w0", layout=L)
        cache = TieredCache(cfg, dp, store, name="w0")
        batch = cache.flush_events()
        assert batch is not None
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        assert {h for e in stored for h in e.block_hashes} == before and stored[0].parent_block_hash is None
        assert all(e.medium == "DISK" for e in stored)
        adm = cache.admit("a-again", a)
        assert adm.l3_pages == 4
        wait(cache, adm)
        plan = cache.begin_prefill(adm)
        assert plan is not None and plan.cached_tokens == 4 * PS
        assert adm.last.device is not None and torch.equal(dp.device_kv[adm.last.device].cpu(), written)
        cache.finish_prefill(adm)
        cache.release(adm)
    finally:
        dp.close()


# --- writes ----------------------------------------------------------------------------------


def test_a_write_that_fails_part_way_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = chain_store(tmp_path, 1)
    calls = {"n": 0}
    real = pagedir.encode

    def failing(header: PageHeader, payload: bytes | memoryview) -> list[bytes | memoryview]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(28, "No space left on device")
        return real(header, payload)

    monkeypatch.setattr(pagedir, "encode", failing)
    for i in range(1, 5):
        store.begin_write(k(i), meta(i, i - 1))
    before = files(tmp_path)
    with pytest.raises(OSError, match="No space"):
        store.write_pages([(k(i), b"x" * 64) for i in range(1, 5)])
    assert files(tmp_path) == before  # no temporary file, no page, no ref of the batch


def test_link_failure_after_some_pages_were_linked_releases_them(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    store = chain_store(tmp_path, 1)
    for i in range(1, 4):
        store.begin_write(k(i), meta(i, i - 1))
    before = files(tmp_path)
    real, calls = os.link, {"n": 0}

    def link(src: str, dst: str) -> None:
        calls["n"] += 1
        if calls["n"] == 4:  # k1 page + ref linked, k2 page linked, k2 ref fails
            raise OSError(5, "I/O error")
        real(src, dst)

    monkeypatch.setattr(pagedir.os, "link", link)
    with pytest.raises(OSError, match="I/O"):
        store.write_pages([(k(i), b"x" * 64) for i in range(1, 4)])
    monkeypatch.setattr(pagedir.os, "link", real)
    assert files(tmp_path) == before


def test_a_store_that_cannot_write_is_counted_and_logged_sparsely(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A full disk fails every copy batch: each is counted, and the log has the first few and every thousandth, not a
    line per batch."""
    def full(header: PageHeader, payload: bytes | memoryview) -> list[bytes | memoryview]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pagedir, "encode", full)
    dp = TorchDataPath(device_pages=4, host_pages=8, page_shape=SHAPE, device="cpu")
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0), dp,
                        PageStore(64, tmp_path, owner="w0", layout=L), name="w0")
    try:
        with caplog.at_level("WARNING"):
            for i in range(40):
                run(cache, dp, f"r{i}", list(range(i * 1000, i * 1000 + 4 * PS)), fill=None)
                wait(cache)
    finally:
        dp.close()
    assert cache.l3 is not None and cache.l3.write_failures > 10
    logged = [r for r in caplog.records if "L3 write failed" in r.getMessage()]
    assert len(logged) == 10 and "every 1000th" in logged[-1].getMessage()


def test_a_reset_with_a_write_in_flight_leaves_no_page_file_behind(tmp_path: Path) -> None:
    """A reset waits for the copies in flight and drops their pages: a write to the store that finished meanwhile
    left its files held by the owner, counted by no store, adopted again at the next start."""
    dp = TorchDataPath(device_pages=8, host_pages=16, page_shape=SHAPE, device="cpu")
    store = PageStore(64, tmp_path, owner="w0", layout=L)
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=8, host_ratio=2.0), dp, store, name="w0")
    try:
        adm = cache.admit("a", list(range(4 * PS)))
        assert cache.begin_prefill(adm) is not None
        cache.finish_prefill(adm)
        cache.release(adm)
        deadline = time.monotonic() + 10
        while cache.l3 is not None and not cache.l3.pending and time.monotonic() < deadline:
            cache.poll()  # until the backups landed and the write to the store was started, never after
            time.sleep(0.001)
        assert cache.l3 is not None and cache.l3.pending
        cache.reset()
        base = tmp_path / L.tag()
        assert len(store) == 0 and files(base / "pages") == [] and files(base / "refs" / "w0") == []
    finally:
        dp.close()
        store.close()
    assert len(PageStore(64, tmp_path, owner="w0", layout=L)) == 0


@pytest.mark.parametrize("sync", list(SyncPolicy))
def test_every_sync_policy_writes_sound_pages(tmp_path: Path, sync: SyncPolicy) -> None:
    store = chain_store(tmp_path, 5, sync=sync)
    assert [bytes(store.read_page(k(i)))[:1] for i in range(5)] == [bytes([i]) for i in range(5)]


# --- sharing one directory -------------------------------------------------------------------


def test_other_layouts_in_one_directory_are_isolated(tmp_path: Path) -> None:
    chain_store(tmp_path, 3, layout=Layout("llama", PS))
    other = chain_store(tmp_path, 3, layout=Layout("qwen", PS), owner="a")
    assert bytes(other.read_page(k(1))) == bytes([1]) * 64
    other.close()
    tp1 = PageStore(8, tmp_path, owner="a", layout=Layout("llama", PS, tp_size=2, tp_rank=1))
    assert len(tp1) == 0  # another shard's pages are not this shard's
    llama = PageStore(8, tmp_path, owner="a", layout=Layout("llama", PS))
    assert len(llama) == 3
    assert {p.name for p in tmp_path.iterdir()} == {Layout("llama", PS).tag(), Layout("qwen", PS).tag(),
                                                    Layout("llama", PS, tp_size=2, tp_rank=1).tag()}


def test_layout_tags_name_each_layout_once() -> None:
    """A tag is a filesystem-safe directory name, one per layout: models whose names differ only in characters a
    path cannot hold, and pages of another byte size, never share a directory. A name that needs no escaping keeps
    the tag it always had, so existing stores are still found."""
    layouts = [Layout("org/m"), Layout("org_m"), Layout("org:m"), Layout("org%2Fm"), Layout("m", dtype="fp8-e4m3"),
               Layout("m", dtype="fp8_e4m3"), Layout("m", kv_bytes_per_token=1024), Layout("m", kv_bytes_per_token=512),
               Layout("m"), Layout("m-ps16-bfloat16-tp0of1-pp0of1"), Layout("m", 16 * 11), Layout("m", 16, dtype="1")]
    tags = [x.tag() for x in layouts]
    assert len(set(tags)) == len(tags), tags
    assert all(re.fullmatch(r"[A-Za-z0-9._%-]+", t) and not t.startswith(".") for t in tags), tags
    assert Layout("gpt-oss-20b", 64).tag() == "gpt-oss-20b-ps64-bfloat16-tp0of1-pp0of1"
    with pytest.raises(ValueError, match="model"):
        Layout("")
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        Layout("m", kv_bytes_per_token=-2)


def test_pages_of_another_byte_size_are_kept_apart(tmp_path: Path) -> None:
    """An engine restarted with another KV size per token over the same directory adopts none of the old pages
    (they would all be damage at their first read) and leaves them to the engines of their own size."""
    chain_store(tmp_path, 3, layout=Layout("m", PS, kv_bytes_per_token=4)).close()
    other = PageStore(8, tmp_path, owner="a", layout=Layout("m", PS, kv_bytes_per_token=8))
    assert len(other) == 0 and other.stats.dropped_at_start == 0
    other.close()
    assert len(PageStore(8, tmp_path, owner="a", layout=Layout("m", PS, kv_bytes_per_token=4))) == 3


def test_processes_sharing_a_pool_never_delete_each_others_pages(tmp_path: Path) -> None:
    a = chain_store(tmp_path, 4, owner="a", shared=True)
    b = PageStore(64, tmp_path, owner="b", shared=True, layout=L)
    b.attach("b", lambda keys: None)
    assert all(b.lookup(k(i)) for i in range(4))  # found on disk, written by a: now held by b too
    assert not b.lookup(k(9))
    b.begin_write(k(4), meta(4, 3))
    b.write_pages([(k(4), bytes([4]) * 64)])
    assert b.commit(k(4), "b")
    a.clear()  # a resets (or evicts everything): b's pages stay
    assert [bytes(b.read_page(k(i)))[:1] for i in range(5)] == [bytes([i]) for i in range(5)]
    with pytest.raises(OwnerBusy, match="in use"):
        PageStore(64, tmp_path, owner="a", shared=True, layout=L)  # one process per owner
    a.close()
    a2 = PageStore(64, tmp_path, owner="a", shared=True, layout=L)
    assert len(a2) == 0  # a held nothing any more
    b.delete(k(4))
    b.clear()
    assert files(tmp_path / L.tag() / "pages") == []  # the last holder gone: the files go


def test_a_page_another_process_wrote_without_its_parent_here_is_not_taken(tmp_path: Path) -> None:
    chain_store(tmp_path, 3, owner="a", shared=True)
    b = PageStore(64, tmp_path, owner="b", shared=True, layout=L)
    assert not b.lookup(k(2))  # its parent k1 is not held by b: a page never lives without its parent
    assert b.lookup(k(0)) and b.lookup(k(1)) and b.lookup(k(2))
    b._check()


def test_children_begun_under_a_page_whose_write_was_aborted_still_count_when_it_is_written_again() -> None:
    """The shared-pool case the slow consistency profile found: w1 writes P, w0 writes C under P, w1 is
    reset (P aborted) and writes P again; P's children must count C, or a later eviction goes wrong."""
    pool = PageStore(8, shared=True)
    for w in ("w0", "w1"):
        pool.attach(w, lambda keys: None)
    pool.begin_write("P", meta(0, None))
    pool.begin_write("C", PageMeta(2, "P", 1000, bytes(4 * PS), 1))
    pool.abort("P")  # w1's reset
    pool._check()
    pool.begin_write("P", meta(0, None))  # w1 writes it again
    assert pool.commit("P", "w1")
    pool._check()
    assert pool.commit("C", "w0")
    pool._check()
    pool.begin_write("Q", meta(3, None))
    pool.abort("Q")
    pool.begin_write("D", PageMeta(4, "P", 1000, bytes(4 * PS), 1))
    pool.drop("P")  # damaged: its committed child goes with it, the one still being written is counted
    pool._check()
    assert not pool.commit("D", "w0")  # its parent is gone: dropped, and nothing is left counting it
    pool._check()


def test_children_begun_under_an_aborted_page_count_when_it_is_found_on_disk_instead(tmp_path: Path) -> None:
    """As above, but the page comes back through :meth:`PageStore.lookup`: another process of the pool wrote
    it. Adopting it must count the child still being written under it, or it stays a leaf with a child and an
    eviction takes it first: a page without its parent."""
    a = PageStore(2, tmp_path, owner="a", shared=True, layout=L)
    a.attach("a", lambda keys: None)
    a.begin_write(k(0), meta(0, None))
    a.begin_write(k(1), meta(1, 0))
    a.abort(k(0))  # (its write failed; k1's goes on)
    chain_store(tmp_path, 1, owner="b", shared=True)  # another process writes k0
    assert a.lookup(k(0))
    a._check()
    a.write_pages([(k(1), bytes([1]) * 64)])
    assert a.commit(k(1), "a")
    a._check()
    assert a.begin_write(k(9, 9), meta(9, None))  # the store is full: a leaf goes, and k0 is not one
    a.write_pages([(k(9, 9), bytes([9]) * 64)])
    assert a.commit(k(9, 9), "a")
    a._check()
    assert k(0) in a and k(1) not in a


def test_writes_in_flight_take_their_room(tmp_path: Path) -> None:
    """A full store that took writes was over its capacity by every write in flight until they landed: the files
    counted nothing in flight (`kvtier engine --disk-pages 500` peaked at 947-966 page files), so a disk sized to
    the capacity could fill. A write takes its room when it is reserved, evicting then, and the files never
    outnumber the capacity. With no room to make (every page pinned), the write is refused, nothing reserved."""
    store = chain_store(tmp_path, 4, capacity=4)
    pages = store.pages_path
    assert pages is not None
    gone: list[str] = []
    store.attach("a", gone.extend)
    for i in range(10, 14):  # four new chains' first pages, all in flight at once
        assert store.begin_write(k(i, i), meta(i, None))
        assert len(store) + len(store._pending) <= 4
    assert gone == [k(3), k(2), k(1), k(0)]  # leaves first, each as it made room
    store.write_pages([(k(i, i), bytes([i]) * 64) for i in range(10, 14)])
    assert len([p for p in pages.iterdir() if p.is_file()]) == 4
    for i in range(10, 14):
        assert store.commit(k(i, i), "a")
    held = store.pin([k(i, i) for i in range(10, 14)])
    assert not store.begin_write(k(20, 20), meta(20, None))  # every page is being read
    assert not store.is_pending(k(20, 20)) and len(store) == 4 and store.stats.refused_writes == 1
    store.unpin(held)
    store._check()


def test_a_page_found_in_the_pool_takes_its_room_or_is_not_adopted(tmp_path: Path) -> None:
    """A page another process wrote into the pool is adopted only if the store can make room for it, as a write
    makes it: where the room is taken by writes in flight (and the page found has a child still being written under
    it, so it cannot go itself), it was adopted all the same and the store went over its capacity. Now it is not
    adopted; the child is dropped when it lands, never a page without its parent. (From review BB.)"""
    a = PageStore(2, tmp_path, owner="a", shared=True, layout=L)
    a.attach("a", lambda keys: None)
    assert a.begin_write(k(0), meta(0, None))
    assert a.begin_write(k(1), meta(1, 0))
    a.abort(k(0))  # its write failed; k1's goes on
    assert a.begin_write(k(9, 9), meta(9, None))  # no room left: two writes in flight
    chain_store(tmp_path, 1, owner="b", shared=True)  # another process of the pool writes k0
    assert not a.lookup(k(0))
    a._check()
    a.write_pages([(k(1), bytes([1]) * 64)])
    assert not a.commit(k(1), "a")  # its parent is not here: dropped
    a.write_pages([(k(9, 9), bytes([9]) * 64)])
    assert a.commit(k(9, 9), "a")
    assert a.lookup(k(0)) and len(a) == 2  # room now
    a._check()
