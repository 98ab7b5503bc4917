"""One test per row of SPEC section 1's transition table, plus write and prefetch policies."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.engine.cache import CacheConfig, PrefetchPolicy, WritePolicy
from kvtier.engine.datapath import CopyKind
from kvtier.engine.dump import dump_batches, wire_bytes
from kvtier.engine.events import EventLog
from kvtier.engine.hashing import chain, event_hash
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    StorageTier,
    TierOverlap,
    WorkerId,
    is_window_event,
)
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import pack_tokens, unpack_tokens, window_group
from tests.engine_harness import Harness

PS = 4


def toks(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PS))


def hashes(tokens: list[int]) -> list[int]:
    return [event_hash(d) for d in chain(b"", tokens, PS)]


def kinds(events: list[Event]) -> list[tuple[str, str]]:
    """(type, medium) per event; window-KV events (SWA) have " window" after the medium."""
    return [(type(e).__name__, (getattr(e, "medium", "") or "")
             + (" window" if isinstance(e, BlockStored | BlockRemoved) and is_window_event(e) else ""))
            for e in events]


def test_sglang_hash_scheme_matches_wire_vectors() -> None:
    assert hashes(list(range(100, 116))) == [
        -7118152853857507680, -5037572900866013165, -8052603281837994718, 5043830065565855565]


def test_insert_emits_gpu_store_at_once_and_host_after_ack() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=16, host_ratio=2.0))
    t = toks(0, 3) + [7]  # trailing partial page is not cached
    h.run("r", t)
    assert kinds(h.log) == [("BlockStored", "GPU")]  # the backup is still in flight
    ev = h.log[0]
    assert isinstance(ev, BlockStored) and ev.block_hashes == hashes(t) and ev.parent_block_hash is None
    assert kinds(h.advance(1.0)) == []  # 3 pages take 3 s
    assert kinds(h.advance(2.5)) == [("BlockStored", "CPU_PINNED")]


def test_device_eviction_with_host_copy_removes_gpu_only() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0))
    a = toks(0, 4)
    h.run("a", a)
    h.settle()
    h.log.clear()
    h.run("b", toks(1000, 4))  # needs all 4 device pages: evicts a (backed up)
    assert ("BlockRemoved", "GPU") in kinds(h.log)
    removed = next(e for e in h.log if isinstance(e, BlockRemoved))
    assert removed.block_hashes == hashes(a)
    assert h.cache.residency()[StorageTier.HOST] >= set(hashes(a))


def test_device_eviction_without_host_copy_drops_node() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=4, host_ratio=0.0))
    h.run("a", toks(0, 4))
    h.run("b", toks(1000, 4))
    assert kinds(h.log) == [("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "GPU")]
    assert len(h.cache.tree.nodes()) == 1


def removed_hashes(events: list[Event], medium: str) -> list[list[int]]:
    return [e.block_hashes for e in events if isinstance(e, BlockRemoved) and e.medium == medium]


def test_device_eviction_takes_the_least_recently_used_leaf_not_the_first_one_cached() -> None:
    """A prefix used again is recent: SGLang evicts by last access, so the leaf not used since goes first."""
    h = Harness(CacheConfig(page_size=PS, device_pages=6, host_ratio=0.0))
    a, b = toks(0, 2), toks(1000, 2)
    h.run("a", a)
    h.run("b", b)
    h.run("a again", a)
    h.log.clear()
    h.run("c", toks(2000, 4))  # 2 pages free: one of a and b must go
    assert removed_hashes(h.log, "GPU") == [hashes(b)]
    assert h.cache.residency()[StorageTier.DEVICE] == set(hashes(a)) | set(hashes(toks(2000, 4)))


@pytest.mark.parametrize("host_ratio", [0.0, 2.0])
def test_page_eviction_takes_only_the_pages_needed_from_the_leafs_tail(host_ratio: float) -> None:
    """Eviction.PAGE, as vLLM's block pool: making room for 2 pages takes the last 2 of the 6-page leaf a (one
    BlockRemoved for them); its first 4 stay cached and match. Eviction.NODE (SGLang) takes all of a."""
    for eviction, left in (("page", 4), ("node", 0)):
        h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=host_ratio, eviction=eviction))
        a = toks(0, 6)
        h.run("a", a)
        h.settle()
        h.log.clear()
        h.run("b", toks(1000, 4))  # 2 pages free: 2 more must go
        assert removed_hashes(h.log, "GPU") == [hashes(a)[left:]], eviction
        assert h.cache.peek_overlap(pack_tokens(a)).device == left
        assert h.cache.residency()[StorageTier.DEVICE] == set(hashes(a)[:left]) | set(hashes(toks(1000, 4)))
        if host_ratio:  # the evicted tail keeps its host copy, as the whole node would
            assert h.cache.residency()[StorageTier.HOST] >= set(hashes(a))


def test_host_eviction_takes_the_least_recently_used_host_only_leaf() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=4, host_ratio=2.5))  # 10 host pages
    a, b = toks(0, 2), toks(1000, 2)
    for rid, t in (("a", a), ("b", b), ("a again", a)):
        h.run(rid, t)
        h.settle()
    h.run("c", toks(2000, 4))  # a and b leave the device for their host copies; c is backed up beside them
    h.settle()
    h.log.clear()
    h.run("d", toks(3000, 4))  # c leaves the device; d's backup needs 4 host pages of the 2 free
    h.settle()
    assert removed_hashes(h.log, "CPU_PINNED") == [hashes(b)]


def test_host_eviction_only_of_device_evicted_unlocked_leaves() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=4, host_ratio=1.0))
    h.run("a", toks(0, 4))
    h.settle()
    h.log.clear()
    h.run("b", toks(1000, 4))  # a leaves the device; b's backup then needs a's host pages
    h.settle()
    assert kinds(h.log) == [("BlockRemoved", "GPU"), ("BlockStored", "GPU"), ("BlockRemoved", "CPU_PINNED"),
                            ("BlockStored", "CPU_PINNED")]
    assert h.log[0].block_hashes == h.log[2].block_hashes == hashes(toks(0, 4))  # type: ignore[union-attr]


def test_host_pages_a_write_to_the_store_reads_are_not_evicted_under_it() -> None:
    """A host page an L3 write is still reading stays held: freed, the next allocation would hand it out and the
    store would be sent another page's bytes (loaded back later as this page's, with no error)."""
    h = Harness(CacheConfig(page_size=1, device_pages=4, host_ratio=1.0, write_policy=WritePolicy.WRITE_THROUGH),
                store=PageStore(100))
    h.run("a", [1, 2])
    h.advance(1.0)
    h.advance(1.0)
    h.advance(0.5)  # the host copies landed; the write to the store is in flight
    h.cache.evict_device(4)
    h.deliver()
    sources = {p for op in h.dp.ops.values() if op.kind is CopyKind.H2S for p in op.src}
    assert sources
    h.cache.evict_host(4)
    h.deliver()
    assert not sources & set(h.cache.host.alloc(h.cache.host.free))  # none of them was free to hand out


def test_load_back_emits_gpu_store_after_the_copy() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=2.0))
    a = toks(0, 4)
    h.run("a", a)
    h.settle()
    h.run("b", toks(1000, 4))
    h.run("c", toks(2000, 4))  # a is now host-only
    h.settle()
    h.log.clear()
    adm = h.cache.admit("a2", a)
    h.deliver()
    assert adm.host_pages == 4 and h.cache.waiting_for(adm)
    assert ("BlockStored", "GPU") not in kinds(h.log)  # submitted, not acknowledged
    h.advance(2.0)
    assert h.cache.waiting_for(adm)
    events = h.advance(2.5)
    assert ("BlockStored", "GPU") in kinds(events) and not h.cache.waiting_for(adm)
    plan = h.cache.begin_prefill(adm)
    assert plan is not None and plan.cached_tokens == 16 and plan.compute_tokens == 0


def test_recompute_into_host_only_node_emits_gpu_store() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, load_back=False))
    a = toks(0, 4)
    h.run("a", a)
    h.settle()
    h.run("b", toks(1000, 4))
    h.settle()
    h.log.clear()
    adm = h.run("a2", a)
    assert adm.host_pages == 4
    stored = [e for e in h.log if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert stored and stored[0].block_hashes == hashes(a)


def test_l3_write_and_eviction_emit_disk_events(tmp_path: Path) -> None:
    store = PageStore(6, tmp_path)
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=2.0), store)
    h.run("a", toks(0, 4))
    h.settle()
    disk = [e for e in h.log if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert len(disk) == 1  # consecutive pages written together are announced as one multi-block event
    assert disk[0].block_hashes == hashes(toks(0, 4)) and disk[0].parent_block_hash is None
    assert disk[0].token_ids == toks(0, 4)
    h.log.clear()
    h.run("b", toks(1000, 4))
    h.settle()  # 8 pages into a 6-page store: two leaf pages of `a` go, deepest first
    removed = [e for e in h.log if isinstance(e, BlockRemoved) and e.medium == "DISK"]
    assert [x for e in removed for x in e.block_hashes] == hashes(toks(0, 4))[:1:-1]
    assert len(store) == 6


def test_pages_deeper_than_the_store_holds_are_not_written(tmp_path: Path) -> None:
    """A prompt whose chain is longer than the store holds was written whole, then trimmed back once committed: its
    pages past the store's capacity (each with more ancestors than the store has room for) took disk space and I/O
    for nothing (on disk, `kvtier engine --disk-pages 500` held 1,006 page files). They are not written; what the
    store keeps is the same."""
    store = PageStore(6, tmp_path)
    reserved: list[int] = []
    begin = store.begin_write

    def counted(key: str, meta: PageMeta) -> bool:
        reserved.append(meta.depth)
        return begin(key, meta)

    store.begin_write = counted  # type: ignore[method-assign]
    h = Harness(CacheConfig(page_size=PS, device_pages=16, host_ratio=2.0), store)
    h.run("a", toks(0, 10))
    h.settle()
    assert sorted(reserved) == list(range(6))
    disk = [x for e in h.log if isinstance(e, BlockStored) and e.medium == "DISK" for x in e.block_hashes]
    assert disk == hashes(toks(0, 10))[:6] and len(store) == 6
    assert not [e for e in h.log if isinstance(e, BlockRemoved) and e.medium == "DISK"]


def test_l3_pages_share_their_nodes_tokens_and_read_back_their_own() -> None:
    """A page's metadata keeps its node's packed run and its place in it, not a copy per page (copies would be
    most of the disk tier's memory); a memory store's pages still give their own tokens, also after the node splits
    and after it leaves the tree."""
    store = PageStore(64)
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=2.0), store)
    t = toks(0, 4)
    h.run("a", t)
    h.settle()
    keys = store.announced_by(h.cache.l3.name if h.cache.l3 else "")
    assert len(keys) == 4
    metas = [store.meta(k) for k in keys]
    assert len({id(m.buf) for m in metas}) == 1 and len(metas[0].buf) == 4 * PS * 4
    for i, m in enumerate(metas):
        assert unpack_tokens(m.tokens) == t[i * PS:(i + 1) * PS]
    h.run("b", t[:2 * PS] + toks(500, 2))  # splits the node: the stored pages keep the run they were written from
    for i, r in enumerate("cdef"):  # a's node leaves the device and host tiers; its pages stay in the store
        h.run(r, toks(1000 * (i + 1), 4))
        h.settle()
    assert not h.cache.tree.match(pack_tokens(t[:PS]))
    assert [unpack_tokens(store.meta(k).tokens) for k in keys] == [t[i * PS:(i + 1) * PS] for i in range(4)]


def test_prefetch_from_l3_emits_host_store_then_loads(tmp_path: Path) -> None:
    store = PageStore(64, tmp_path)
    cfg = CacheConfig(page_size=PS, device_pages=8, host_ratio=1.5, prefetch_policy=PrefetchPolicy.WAIT_COMPLETE)
    h = Harness(cfg, store)
    a = toks(0, 4)
    h.run("a", a)
    h.settle()
    for i in range(3):  # push `a` out of device and host
        h.run(f"x{i}", toks(1000 * (i + 1), 4))
        h.settle()
    assert not h.cache.tree.match(a)
    h.log.clear()
    adm = h.cache.admit("a2", a)
    assert adm.l3_pages == 4 and adm.prefetch_op is not None
    h.settle()
    stores = [e.medium for e in h.log if isinstance(e, BlockStored) and e.block_hashes == hashes(a)]
    assert stores == ["CPU_PINNED", "GPU"]  # prefetched into host, then loaded for the request
    plan = h.cache.begin_prefill(adm)
    assert plan is not None and plan.cached_tokens == 16


def test_prefetch_threshold_skips_short_hits(tmp_path: Path) -> None:
    store = PageStore(64, tmp_path)
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=1.5, prefetch_min_pages=8), store)
    h.run("a", toks(0, 4))
    h.settle()
    for i in range(3):
        h.run(f"x{i}", toks(1000 * (i + 1), 4))
        h.settle()
    adm = h.cache.admit("a2", toks(0, 4))
    assert adm.l3_pages == 0 and adm.prefetch_op is None


def test_shared_pool_emits_external_per_announcer() -> None:
    pool = PageStore(64, shared=True)
    idx = TieredIndex(PS)
    h1 = Harness(CacheConfig(page_size=PS, device_pages=8), pool, name="w1", index=idx)
    h2 = Harness(CacheConfig(page_size=PS, device_pages=8), pool, name="w2", index=idx)
    h1.run("a", toks(0, 2))
    h1.settle()
    assert ("BlockStored", "EXTERNAL") in kinds(h1.log)
    h2.run("a", toks(0, 2))
    h2.settle()  # already in the pool: w2 announces without copying
    assert [e for e in h2.log if isinstance(e, BlockStored) and e.medium == "EXTERNAL"]
    assert idx.find_matches(toks(0, 2)).shared_pool == 2
    h1.cache.l3_delete(pool.announced_by("w1")[-1])
    h1.deliver()
    h2.deliver()
    assert idx.find_matches(toks(0, 2)).shared_pool == 1
    h1.check()
    h2.check()


def test_split_while_backup_pending_publishes_every_fragment() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=16, host_ratio=2.0))
    a = toks(0, 4)
    h.run("a", a)  # backup of 4 pages in flight
    adm = h.cache.admit("b", a[:2 * PS] + toks(500, 2))  # splits the node after 2 pages
    assert len(h.cache.tree.nodes()) == 2
    h.log.clear()
    events = h.advance(5.0)
    host = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU_PINNED"]
    ha = hashes(a)
    assert [(e.block_hashes, e.parent_block_hash) for e in host] == [(ha[:2], None), (ha[2:], ha[1])]
    h.cache.release(adm)


def test_write_through_selective_backs_up_after_threshold() -> None:
    cfg = CacheConfig(page_size=PS, device_pages=16, write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE,
                      selective_threshold=2)
    h = Harness(cfg)
    a = toks(0, 2)
    h.run("a", a)
    h.settle()
    assert h.cache.residency()[StorageTier.HOST] == set()
    h.run("a1", a)
    h.settle()
    assert h.cache.residency()[StorageTier.HOST] == set()
    h.run("a2", a)
    h.settle()
    assert h.cache.residency()[StorageTier.HOST] == set(hashes(a))


def test_write_back_backs_up_on_eviction_then_frees() -> None:
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=2.0, write_policy=WritePolicy.WRITE_BACK)
    h = Harness(cfg)
    a = toks(0, 4)
    h.run("a", a)
    h.settle()
    assert h.cache.residency()[StorageTier.HOST] == set()
    adm = h.cache.admit("b", toks(1000, 4))
    assert h.cache.begin_prefill(adm) is None  # the device frees only once a's backup lands
    h.settle()
    assert kinds(h.log)[-2:] == [("BlockStored", "CPU_PINNED"), ("BlockRemoved", "GPU")]
    assert h.cache.begin_prefill(adm) is not None
    h.cache.finish_prefill(adm)
    h.cache.release(adm)
    h.deliver()
    h.check()


def test_children_wait_for_parent_backup() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=16, host_ratio=2.0))
    a = toks(0, 2)
    h.run("a", a)
    h.run("ab", a + toks(900, 2))  # child computed while the parent's backup is in flight
    h.settle()
    host = [e for e in h.log if isinstance(e, BlockStored) and e.medium == "CPU_PINNED"]
    assert [e.parent_block_hash for e in host] == [None, hashes(a)[-1]]


def test_a_childs_backup_starts_only_once_its_parents_host_copy_has_landed() -> None:
    """A node's device -> host copy starts only after its parent's host copy has landed, not while the parent's is
    still in flight: a child computed during its parent's backup has no copy in flight until its parent's
    BlockStored CPU, and its own starts then (write-through, 1 page/s), so it is announced a whole copy later,
    under its parent's hash."""
    h = Harness(CacheConfig(page_size=PS, device_pages=16, host_ratio=2.0))
    a, ab = toks(0, 2), toks(0, 2) + toks(900, 2)
    h.run("a", a)  # a's backup: 2 pages, lands at 2 s
    h.run("ab", ab)  # the child's pages computed while a's backup is in flight
    parent, child = h.cache.tree.descend(h.cache.tree.root, pack_tokens(ab))

    def copying() -> list[list[int]]:
        return [op.src for op in h.dp.ops.values() if op.kind is CopyKind.D2H]

    def host(events: list[Event]) -> list[tuple[list[EngineHash], EngineHash | None]]:
        return [(e.block_hashes, e.parent_block_hash) for e in events
                if isinstance(e, BlockStored) and e.medium == "CPU_PINNED"]

    assert copying() == [parent.device], "the child's backup started before its parent's landed"
    assert child.host_pending is None and child.host is None
    assert host(h.advance(2.5)) == [(hashes(a), None)]  # t = 2.5: the parent's lands; the child's starts now
    assert copying() == [child.device]
    assert host(h.advance(1.75)) == []  # t = 4.25: 2 pages take 2 s from 2.5
    assert host(h.advance(0.5)) == [(hashes(ab)[2:], hashes(a)[-1])]
    assert not h.dp.ops


def test_reset_clears_everything() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=8), PageStore(16))
    h.run("a", toks(0, 2))
    h.cache.reset()
    h.deliver()
    assert isinstance(h.log[-1], AllBlocksCleared)
    assert all(not v for v in h.cache.residency().values())
    h.settle()
    h.run("b", toks(0, 2))
    h.settle()


def test_a_dump_is_cut_by_bytes_and_still_rebuilds_the_same_view(tmp_path: Path) -> None:
    """A dump batch carries about ``max_bytes`` at most: a run longer than that is cut into consecutive parts (each
    the next's parent), the batches stay under the budget, and the index they build is the whole dump's."""
    h = Harness(CacheConfig(page_size=PS, device_pages=64, host_ratio=1.0), PageStore(256, tmp_path))
    h.run("long", toks(0, 40))  # one node of 40 pages
    for i in range(1, 4):
        h.run(f"r{i}", toks(1000 * i, 3))
    h.settle()
    snap = h.cache.dump_snapshot()
    whole = list(dump_batches(snap))
    per_page = 5 * PS + 9
    budget = 3 * per_page + 1
    cut = list(dump_batches(snap, max_bytes=budget))
    assert len(cut) > 10 * len(whole)
    for batch in cut:
        assert sum(wire_bytes(e) for e in batch.events if isinstance(e, BlockStored)) <= budget
    parts = [e for b in cut for e in b.events if isinstance(e, BlockStored)]
    assert max(len(e.block_hashes) for e in parts) == 3
    longs = [e for b in whole for e in b.events if isinstance(e, BlockStored) and len(e.block_hashes) == 40]
    assert longs  # the long prompt's run, on each tier it is on
    for run in longs:  # its parts, in order: its pages, each part the next's parent, its tokens
        mine = [e for e in parts if e.medium == run.medium and e.block_hashes[0] in run.block_hashes]
        assert [h for e in mine for h in e.block_hashes] == run.block_hashes
        assert [e.parent_block_hash for e in mine] == [run.parent_block_hash, *(e.block_hashes[-1] for e in mine[:-1])]
        assert b"".join(bytes(e.token_ids) for e in mine) == bytes(run.token_ids)
    views = []
    for batches in (whole, cut):
        fresh = Harness(h.config, None, name="w0")
        fresh.apply_all(batches)
        assert fresh.index is not None
        views.append(fresh.index.worker_hashes(StreamId(WorkerId("w0"))))
    assert views[0] == views[1] == h.cache.residency()


def test_dump_rebuilds_the_same_view(tmp_path: Path) -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=1.0), PageStore(64, tmp_path))
    for i in range(5):
        h.run(f"r{i}", toks(100 * i, 3))
        h.settle()
    fresh = Harness(h.config, None, name="w0")
    fresh.apply_all(h.cache.dump_events())
    assert fresh.index is not None
    seen = fresh.index.worker_hashes(StreamId(WorkerId("w0")))
    assert seen == h.cache.residency()


def test_request_larger_than_the_device_evicts_nothing() -> None:
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=1.0))
    h.run("a", toks(0, 4))
    adm = h.cache.admit("huge", toks(1000, 9))
    assert h.cache.begin_prefill(adm) is None
    assert h.cache.residency()[StorageTier.DEVICE] == set(hashes(toks(0, 4)))
    h.cache.release(adm)


def test_host_eviction_removes_the_window_kv_before_the_full_kv() -> None:
    """A host page with window KV leaves with two removals, its window KV's first: a consumer that tracks the
    sliding-window group apart (vLLM's) keeps no window block of a page that is gone. (kvtier's index clears the
    window bits with the full removal, so it alone would not tell.)"""
    h = Harness(CacheConfig(page_size=1, device_pages=8, host_ratio=1.0, swa_window_pages=2))
    h.run("a", [1, 2])
    h.settle()
    h.cache.evict_device(8)
    h.deliver()
    h.log.clear()
    h.cache.evict_host(8)
    h.settle()
    assert kinds(h.log) == [("BlockRemoved", "CPU_PINNED window"), ("BlockRemoved", "CPU_PINNED")]
    assert h.log[0].block_hashes == h.log[1].block_hashes  # type: ignore[union-attr]


@pytest.mark.parametrize("window_events", [False, True])
def test_swa_window_eviction_is_a_tombstone(window_events: bool) -> None:
    cfg = CacheConfig(page_size=PS, device_pages=16, host_ratio=0.0, swa_window_pages=2, swa_pages=2,
                      swa_events=window_events)
    h = Harness(cfg)
    a = toks(0, 4)
    h.run("a", a)  # cached as pages 0-1 tombstoned (out of its window when it finished), 2-3 with window KV
    h.log.clear()
    h.run("b", toks(1000, 4))  # needs the pool's 2 window-KV pages: a's window KV goes, a stays on device
    if window_events:  # kvtier's extension: the window KV's removal, a's full KV untouched
        assert kinds(h.log) == [("BlockRemoved", "GPU window"), ("BlockStored", "GPU"), ("BlockStored", "GPU"),
                                ("BlockStored", "GPU window")]
    else:  # as SGLang: silent
        assert kinds(h.log) == [("BlockStored", "GPU"), ("BlockStored", "GPU")]
    assert set(hashes(a)) <= h.cache.residency()[StorageTier.DEVICE]
    node = h.cache.tree.match(a)[-1]
    assert node.device is not None and node.swa is None  # tombstone
    assert h.cache.usable_overlap(a) == TierOverlap(0, 0, 0, 0)
    assert h.cache.peek_overlap(a) == TierOverlap(4, 4, 4, 4)


def test_swa_prefix_reuse_needs_the_window_and_recompute_restores_it() -> None:
    cfg = CacheConfig(page_size=PS, device_pages=32, host_ratio=0.0, swa_window_pages=2, swa_pages=8)
    h = Harness(cfg)
    a = toks(0, 4)
    h.run("a1", a[:2 * PS])
    h.run("a2", a)  # two nodes: pages 0-1 and pages 2-3
    second = h.cache.tree.match(a)[-1]
    assert second.swa is not None
    h.cache.swa.release(second.swa)  # tombstone only the second node's window KV
    second.swa = None
    h.log.clear()
    adm = h.cache.admit("again", a + [7])
    plan = h.cache.begin_prefill(adm)
    assert plan is not None and plan.cached_tokens == 2 * PS  # the window before page 4 is gone: back off
    h.cache.finish_prefill(adm)
    h.cache.release(adm)
    h.deliver()
    assert kinds(h.log) == [("BlockStored", "GPU window")]  # the recomputed window KV is announced
    assert h.cache.tree.match(a)[-1].swa is not None
    adm = h.cache.admit("third", a + [7])
    plan = h.cache.begin_prefill(adm)
    assert plan is not None and plan.cached_tokens == 4 * PS
    h.cache.release(adm)


def test_swa_session_whose_own_path_holds_the_window_pool_still_starts() -> None:
    """A session caches a window at each turn's end, all on the next turn's (locked) path. That turn reads
    only the window before its cut: the older windows on its path are tombstoned to make room, as SGLang's
    SWA lock covers only that window. So the turn starts, and does not wait for window KV forever."""
    cfg = CacheConfig(page_size=PS, device_pages=32, host_ratio=0.0, swa_window_pages=2, swa_pages=4)
    h = Harness(cfg)
    h.run("t1", toks(0, 4))  # window KV on pages 2-3
    h.run("t2", toks(0, 6))  # and on pages 4-5: the pool is full
    first, second = h.cache.tree.match(toks(0, 6))[1:]
    assert first.swa is not None and second.swa is not None and h.cache.swa.free == 0
    h.log.clear()
    adm = h.cache.admit("t3", toks(0, 8))
    plan = h.cache.begin_prefill(adm)
    assert plan is not None and plan.cached_tokens == 6 * PS  # its cut keeps the window it reads
    assert first.swa is None and second.swa is not None
    h.cache.finish_prefill(adm)
    h.cache.release(adm)
    h.deliver()
    assert kinds(h.log)[0] == ("BlockRemoved", "GPU window")  # announced like any tombstone
    h.cache._check()


def test_swa_full_eviction_emits_gpu_removal() -> None:
    cfg = CacheConfig(page_size=PS, device_pages=4, host_ratio=0.0, swa_window_pages=2)
    h = Harness(cfg)
    h.run("a", toks(0, 4))
    h.run("b", toks(1000, 4))
    # Each prompt is cached as its tombstoned front and its last window (2 pages) with window KV; b evicts
    # a's leaf (window KV first), then its front: one removal of both on the device.
    assert kinds(h.log) == [("BlockStored", "GPU"), ("BlockStored", "GPU"), ("BlockStored", "GPU window"),
                            ("BlockRemoved", "GPU window"), ("BlockRemoved", "GPU"),
                            ("BlockStored", "GPU"), ("BlockStored", "GPU"), ("BlockStored", "GPU window")]
    assert [len(e.block_hashes) for e in h.log if isinstance(e, BlockRemoved)] == [2, 4]
    assert h.cache.swa.used == 2


def test_shared_pool_announcements_stay_prefix_closed_when_another_engine_wrote_the_parent() -> None:
    """w1 writes page P into the shared pool; w2, meanwhile, skips P (in flight) and writes P's
    child C. When C lands, w2 announces P (now committed by w1) before C, so w2's live events and
    its dumps never name a parent w2 has not announced."""
    pool = PageStore(64, shared=True)
    idx = TieredIndex(PS)
    h1 = Harness(CacheConfig(page_size=PS, device_pages=8), pool, name="w1", index=idx)
    h2 = Harness(CacheConfig(page_size=PS, device_pages=8), pool, name="w2", index=idx)
    p_and_c = toks(0, 2)
    assert h1.cache.l3 is not None and h2.cache.l3 is not None
    h1.run("a", p_and_c[:PS])
    while not h1.cache.l3.pending:  # w1's host backup of P lands, then its L3 write of P starts
        h1.advance(0.5)
    (p_key,) = h1.cache.l3.pending
    h2.run("b", p_and_c)
    while not h2.cache.l3.pending:  # w2's backup of [P, C] lands: P is in flight (w1's), w2 writes C
        h2.advance(0.5)
    assert p_key not in h2.cache.l3.pending and pool.is_pending(p_key)
    while pool.is_pending(p_key):  # P commits, announced by w1
        h1.advance(0.5)
    h2.settle()  # C commits: w2 announces P, then C (Harness.deliver asserts every event applied)
    ext = [e for e in h2.log if isinstance(e, BlockStored) and e.medium == "EXTERNAL"]
    assert [h for e in ext for h in e.block_hashes] == hashes(p_and_c)
    assert idx.worker_hashes(h2.stream)[StorageTier.EXTERNAL] == set(hashes(p_and_c))
    h2.cache.evict_host(2)
    h2.cache.evict_device(2)
    h2.deliver()
    fresh = TieredIndex(PS)
    for batch in h2.cache.dump_events():
        for ev in batch.events:
            assert fresh.apply(h2.stream, ev).value == "applied", ev
    assert fresh.worker_hashes(h2.stream) == h2.cache.residency()


def test_removals_in_a_row_on_one_tier_and_group_are_one_event() -> None:
    """An eviction freeing several nodes publishes one ``BlockRemoved`` per run of removals on one tier and cache
    group, their hashes in the order they went; another event, tier or group, or a flush starts a new one."""
    log = EventLog(page_size=PS, window_pages=2, window_events=True)
    log.removed([1, 2], StorageTier.DEVICE)
    log.removed([3], StorageTier.DEVICE)
    log.removed([4], StorageTier.HOST)
    log.removed([5], StorageTier.HOST, **window_group(2 * PS))
    log.removed([6], StorageTier.HOST)
    log.removed([], StorageTier.HOST)
    log.cleared()
    log.removed([7], StorageTier.HOST)
    batch = log.flush()
    log.removed([8], StorageTier.HOST)
    assert batch is not None and kinds(batch.events) == [
        ("BlockRemoved", "GPU"), ("BlockRemoved", "CPU_PINNED"), ("BlockRemoved", "CPU_PINNED window"),
        ("BlockRemoved", "CPU_PINNED"), ("AllBlocksCleared", ""), ("BlockRemoved", "CPU_PINNED")]
    assert [e.block_hashes for e in batch.events if isinstance(e, BlockRemoved)] == [[1, 2, 3], [4], [5], [6], [7]]
    after = log.flush()
    assert after is not None and [e.block_hashes for e in after.events if isinstance(e, BlockRemoved)] == [[8]]


def test_a_second_begin_prefill_on_one_admission_is_refused_and_leaks_nothing() -> None:
    """A second begin_prefill on one admission (a scheduler re-planning it) overwrote the first's reservation: those
    device pages were held by nothing, lost to the cache for good, and a prompt the device holds could no longer be
    admitted."""
    h = Harness(CacheConfig(page_size=PS, device_pages=16, host_ratio=0.0))
    adm = h.cache.admit("a", toks(0, 4))
    assert h.cache.begin_prefill(adm, 4) is not None
    with pytest.raises(ValueError, match="admission 'a' began its prefill already"):
        h.cache.begin_prefill(adm, 4)
    h.cache.release(adm)
    assert h.cache.device.used == 0  # (nothing cached: no finish)
    h.run("whole", toks(1000, 16))  # the whole device


def test_request_larger_than_the_device_evicts_nothing_evictable() -> None:
    """As ``test_request_larger_than_the_device_evicts_nothing``, with the cached prefix evictable (its backup
    landed, no request holds it): a request that could never fit must still not empty the device for nothing."""
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=1.0))
    h.run("a", toks(0, 4))
    h.settle()
    h.log.clear()
    adm = h.cache.admit("huge", toks(1000, 9))
    assert h.cache.begin_prefill(adm) is None
    assert h.cache.residency()[StorageTier.DEVICE] == set(hashes(toks(0, 4)))
    h.cache.release(adm)
    assert kinds(h.deliver()) == []


def test_a_prefill_reserves_room_for_its_output_beside_its_prompt() -> None:
    """``begin_prefill`` reserves the prompt's uncomputed pages and, with them, the pages its output will fill (the
    partial last page of the prompt counted with the output), as an engine reserves a request's whole context: a
    request whose output would not fit beside it waits (None, nothing reserved), and the pages come back when it
    ends. (Only the simulator's pinned results noticed a prefill that reserved the prompt alone.)"""
    h = Harness(CacheConfig(page_size=PS, device_pages=8, host_ratio=0.0))
    prompt = [*toks(0, 3), 90, 91]  # 3 full pages and 2 tokens of a fourth
    adm = h.cache.admit("a", prompt)
    plan = h.cache.begin_prefill(adm, output_tokens=7)  # 2 + 7 tokens past the full pages: 3 pages
    assert plan is not None and (len(adm.compute), len(adm.private)) == (3, 3)
    assert h.cache.device.free == 2
    h.cache.finish_prefill(adm)
    h.cache.release(adm)
    big = h.cache.admit("b", toks(100, 3))
    assert h.cache.begin_prefill(big, output_tokens=6 * PS + 1) is None  # 3 + 7 pages: more than the device
    assert h.cache.device.free == 8 - 3  # a's three full pages stay cached; the rest came back
    assert h.cache.begin_prefill(big, output_tokens=PS) is not None
    h.deliver()
    h.check()
