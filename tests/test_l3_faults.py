"""The L3 store when the file system fails it or is shared in unusual ways: a page file that cannot be removed, a hold
that cannot be taken, readers of a page dropped and written again, several stores (or containers) writing temporary
files into one directory, and owner names that would collide with the directory's own files."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.cache import CacheConfig, TieredCache, WritePolicy
from kvtier.engine.datapath import ModeledDataPath
from kvtier.engine.l3 import pagedir
from kvtier.engine.l3.pagefile import PageHeader
from kvtier.engine.l3.storage import PageStore
from kvtier.wire import BlockRemoved, StorageTier
from tests.test_l3_store import PS, L, chain_store, files, k, meta


def _failing(real: Any, err: int, where: tuple[str, ...]) -> Any:
    """``real`` (an os function taking a path first), failing with ``err`` on paths that contain any of ``where``."""
    def call(path: Any, *args: Any, **kwargs: Any) -> Any:
        if any(w in str(path) for w in where):
            raise OSError(err, os.strerror(err), str(path))
        return real(path, *args, **kwargs)
    return call


# --- a page file that cannot be removed ----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["evict", "drop", "delete", "clear", "abort", "orphan commit"])
@pytest.mark.parametrize("err", [errno.EIO, errno.EROFS])
def test_a_page_whose_file_cannot_be_removed_still_leaves_the_store_and_its_announcers_are_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, how: str, err: int) -> None:
    lost: list[str] = []
    store = chain_store(tmp_path, 3, capacity=4)
    store.attach("a", lost.extend)
    if how != "clear":  # (a reset aborts the writes in flight first)
        store.begin_write(k(3), meta(3, 2))
        store.write_pages([(k(3), b"x" * 64)])
    monkeypatch.setattr(pagedir.os, "unlink", _failing(os.unlink, err, ("/refs/", "/pages/")))
    with caplog.at_level("WARNING"):
        if how == "evict":  # a page of another chain in a store of 4: the least recently used leaf goes
            assert store.commit(k(3), "a")
            store.begin_write(k(5, 5), meta(5, None))
            assert store.commit(k(5, 5), "a")
            gone = [k(3)]
        elif how == "drop":
            assert store.commit(k(3), "a")
            assert store.drop(k(1)) == [k(3), k(2), k(1)]
            gone = [k(3), k(2), k(1)]
        elif how == "delete":
            assert store.commit(k(3), "a")
            store.delete(k(3))
            gone = [k(3)]
        elif how == "clear":
            store.clear()
            gone = []  # (a reset: the engine forgets its announcements itself)
        elif how == "abort":
            store.abort(k(3))
            gone = []
        else:  # the parent went meanwhile: the page is committed nowhere and its file goes
            store.drop(k(2))
            assert not store.commit(k(3), "a")
            gone = [k(2)]
    assert sorted(lost) == sorted(gone)
    assert all(key not in store for key in gone) and not store.is_pending(k(3))
    assert len(store) == {"evict": 4, "drop": 1, "delete": 3, "clear": 0, "abort": 3, "orphan commit": 2}[how]
    store._check()
    warned = [r for r in caplog.records if "not removed" in r.getMessage()]
    assert warned and len(warned) <= 10 and os.strerror(err) in warned[0].getMessage()
    assert store.stats.release_failures >= len(warned)  # (in the stats line kvtier engine prints)


def test_a_failed_removal_is_retried_when_the_page_is_written_and_released_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a failed removal leaves is what a crash at that point leaves; the page's next release removes it."""
    base = tmp_path / L.tag()
    store = chain_store(tmp_path, 2)
    before = files(base)
    with monkeypatch.context() as m:
        m.setattr(pagedir.os, "unlink", _failing(os.unlink, errno.EIO, ("/refs/",)))
        store.delete(k(1))
    assert k(1) not in store and files(base) == before  # the hold and the file are left
    store.begin_write(k(1), meta(1, 0))
    store.write_pages([(k(1), b"y" * 64)])
    assert store.commit(k(1), "a") and bytes(store.read_page(k(1))) == bytes([1]) * 64  # the same page's file
    store.delete(k(1))
    assert files(base) == sorted(f for f in before if not f.endswith(k(1)))


def test_an_engine_whose_store_cannot_remove_files_keeps_running_and_publishes_every_removal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store's evictions run inside the engine's poll: a failed unlink there must not escape, and every page the
    store lets go is withdrawn (BlockRemoved), so the engine's announcements stay what the store holds."""
    now = [0.0]
    dp = ModeledDataPath(1000, lambda: now[0])
    store = PageStore(4, tmp_path, owner="w0", layout=L)
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=8, host_ratio=2.0,
                                    write_policy=WritePolicy.WRITE_THROUGH), dp, store, name="w0")

    def request(rid: str, tokens: list[int]) -> None:
        adm = cache.admit(rid, tokens)
        assert cache.begin_prefill(adm) is not None
        cache.finish_prefill(adm)
        cache.release(adm)
        for _ in range(6):
            now[0] += 100.0
            cache.poll()

    request("a", list(range(4 * PS)))
    disk = set(cache.residency()[StorageTier.DISK])
    assert len(disk) == 4 and cache.flush_events() is not None
    monkeypatch.setattr(pagedir.os, "unlink", _failing(os.unlink, errno.EIO, ("/refs/", "/pages/")))
    request("b", list(range(1000, 1000 + 4 * PS)))  # its pages evict a's from the store
    batch = cache.flush_events()
    assert batch is not None
    removed = {h for e in batch.events if isinstance(e, BlockRemoved) and e.medium == "DISK" for h in e.block_hashes}
    assert removed and removed <= disk and not removed & set(cache.residency()[StorageTier.DISK])
    assert not store._pending
    cache._check()


# --- a hold that cannot be taken -----------------------------------------------------------------------------------


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EDQUOT])
@pytest.mark.parametrize("what", ["link", "lock"])
def test_a_pool_page_that_cannot_be_held_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture, err: int, what: str) -> None:
    """Another process's page in a shared pool is taken by a hard link under ``refs/<owner>`` (and the directory
    lock): on a full or read-only disk neither can be made, and the page is a miss, as a damaged one is."""
    chain_store(tmp_path, 3, owner="a", shared=True)
    b = PageStore(64, tmp_path, owner="b", shared=True, layout=L)
    b.attach("b", lambda keys: None)
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=8, host_ratio=2.0),
                        ModeledDataPath(1000, lambda: 0.0), PageStore(64, tmp_path, owner="c", shared=True, layout=L),
                        name="c")
    if what == "link":
        monkeypatch.setattr(pagedir.os, "link", _failing(os.link, err, ("/pages/",)))
    else:
        monkeypatch.setattr(pagedir.os, "open", _failing(os.open, err, ("/.lock",)))
    with caplog.at_level("WARNING"):
        for _ in range(30):
            assert not b.lookup(k(0))
    assert len(b) == 0
    warned = [r for r in caplog.records if "not taken" in r.getMessage()]
    assert len(warned) == 10 and os.strerror(err) in warned[0].getMessage()
    assert b.stats.probe_failures == 30  # (in the stats line kvtier engine prints)
    adm = cache.admit("r", [0] * PS + [1] * PS)
    assert adm.l3_pages == 0
    monkeypatch.undo()
    assert b.lookup(k(0)) and b.lookup(k(1))  # the disk has room again


# --- readers of a page dropped and written again ---------------------------------------------------------------------


def test_a_reader_of_a_dropped_page_never_unpins_the_page_written_again() -> None:
    """A shared pool: two readers pin a page, one finds it damaged and drops it, another engine writes it again, and
    the other reader's unpin lands afterwards. Pins belong to the entry they were taken on: the new entry's stay
    its own readers', never negative, and it can be evicted once those are done."""
    pool = PageStore(1, shared=True)
    for w in ("w0", "w1"):
        pool.attach(w, lambda keys: None)
    p = k(0)
    pool.begin_write(p, meta(0, None))
    assert pool.commit(p, "w0")
    first, second = pool.pin([p]), pool.pin([p])
    assert pool.meta(p).pins == 2
    assert pool.drop(p) == [p]
    pool.unpin(first)
    pool.begin_write(p, meta(0, None))
    assert pool.commit(p, "w1")
    third = pool.pin([p])
    pool.unpin(second)  # lands after the page was written again
    assert pool.meta(p).pins == 1
    pool._check()
    q = k(5, 5)
    assert not pool.begin_write(q, meta(5, None))  # p is being read: no room for the new page
    assert p in pool and not pool.is_pending(q)
    pool.unpin(third)
    assert pool.meta(p).pins == 0
    pool._check()
    assert pool.begin_write(q, meta(5, None)) and p not in pool  # the write takes its room at once
    assert pool.commit(q, "w0") and q in pool


# --- temporary files of several stores -------------------------------------------------------------------------------


def test_a_second_store_in_this_process_leaves_the_first_ones_write_in_flight(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each store names its temporary files with a token of its own: a store starting on the same directory (another
    engine of this process) tells them from those of an earlier process with this one's id, and keeps them."""
    a = chain_store(tmp_path, 1, owner="a")
    a.begin_write(k(1), meta(1, 0))
    real = pagedir.encode
    seen: dict[str, Any] = {}

    def encode_and_start_another(header: PageHeader, payload: bytes | memoryview) -> list[bytes | memoryview]:
        seen["tmp"] = [f for f in os.listdir(tmp_path / L.tag()) if f.startswith(".tmp-")]  # a's, being written
        seen["b"] = PageStore(64, tmp_path, owner="b", layout=L)
        return real(header, payload)

    monkeypatch.setattr(pagedir, "encode", encode_and_start_another)
    a.write_pages([(k(1), b"x" * 64)])
    monkeypatch.undo()
    assert len(seen["tmp"]) == 1 and seen["b"].stats.tmp_removed == 0
    assert a.commit(k(1), "a") and bytes(a.read_page(k(1))) == b"x" * 64


def test_temporary_files_of_this_process_id_go_only_when_no_store_here_wrote_them(tmp_path: Path) -> None:
    """A file named for this process's id but no store of this process (an earlier process with this id, here) is a
    dead writer's; one of another pid namespace (a container sharing this host's name and boot) is judged by its age
    alone: its ids mean nothing here."""
    base = tmp_path / L.tag()
    a = chain_store(tmp_path, 1)
    live = os.getppid()
    other_ns = "0123abcd"  # what another pid namespace's files are named with (see pagedir._where)
    assert other_ns != pagedir._WHERE
    assert a._dir is not None
    ours = pagedir.tmp_prefix(token=a._dir.token) + "a"
    keep = [ours, pagedir.tmp_prefix(os.getpid(), host=other_ns) + "b",
            pagedir.tmp_prefix(os.getpid(), host=other_ns, token="0" * 16) + "c",
            pagedir.tmp_prefix(999_999_999, host=other_ns) + "d", pagedir.tmp_prefix(live) + "e"]
    drop = [pagedir.tmp_prefix() + "f", pagedir.tmp_prefix(token="0" * 16) + "g", pagedir.tmp_prefix(999_999_999) + "h"]
    old = time.time() - pagedir.STALE_TMP_S - 60
    stale = pagedir.tmp_prefix(os.getpid(), host=other_ns, token="1" * 16) + "i"
    for name in [*keep, *drop, stale]:
        (base / name).write_bytes(b"half a page")
    os.utime(base / stale, (old, old))
    b = PageStore(8, tmp_path, owner="b", layout=L)
    assert b.stats.tmp_removed == len(drop) + 1
    assert sorted(f for f in os.listdir(base) if f.startswith(".tmp")) == sorted(keep)


def test_a_temporary_file_that_goes_while_a_store_starts_is_skipped(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer in another process removes its temporary files outside the lock when its batch fails: one listed by a
    starting store may be gone by the time it is looked at."""
    chain_store(tmp_path, 1, owner="a").close()
    base = tmp_path / L.tag()
    tmp = base / (pagedir.tmp_prefix(os.getppid()) + "inflight")
    tmp.write_bytes(b"half a page")
    real = os.scandir

    def racy_scandir(path: Any) -> Iterator[os.DirEntry[str]]:
        entries = list(real(path))
        if Path(path) == base and tmp.exists():
            tmp.unlink()  # the other process's failed write cleans up right now
        return iter(entries)

    monkeypatch.setattr(pagedir.os, "scandir", racy_scandir)
    store = PageStore(64, tmp_path, owner="b", layout=L)
    assert store.stats.tmp_removed == 0 and not tmp.exists()


# --- owner names ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("owner", [".w0.lock", ".hidden", ".", "..", "", "a/b"])
def test_owner_names_that_could_collide_with_the_directorys_own_files_are_refused(tmp_path: Path,
                                                                                  owner: str) -> None:
    """An owner's holds live in ``refs/<owner>/`` beside every owner's lock file ``refs/.<owner>.lock``."""
    with pytest.raises(ValueError, match="store owner") as info:
        PageStore(8, tmp_path, owner=owner, layout=L)
    assert repr(owner) in str(info.value) and "\n" not in str(info.value)
    PageStore(8, tmp_path, owner="w0", layout=L)
    PageStore(8, tmp_path, owner="w0.lock", layout=L)  # (a name that merely contains a dot is fine)
