"""The tiered index: keys, events, queries, snapshots, and agreement with a naive model."""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvtier.indexer.index import levels as levels_module
from kvtier.indexer.index.blockmasks import BlockMasks
from kvtier.indexer.index.keys import block_keys
from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event, StorageTier, WorkerId
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import TierOverlap
from tests.reference_index import ReferenceIndex

A, B, C = (StreamId(WorkerId(n)) for n in "abc")
A1 = StreamId(WorkerId("a"), 1)


def test_keys_pinned_to_independent_xxhash() -> None:
    def h(data: bytes) -> int:
        return xxhash.xxh3_64_intdigest(data, seed=1337)

    l0 = h(struct.pack("<4I", 1, 2, 3, 4))
    l1 = h(struct.pack("<4I", 5, 6, 7, 8))
    assert l0 == 0xCB38E4D7FB2DCA5C
    k1 = h(struct.pack("<QQ", l0, l1))
    assert k1 == 0x44A2B2379D6D3C3D
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [l0, k1]  # partial tail block: no key


def test_lora_and_salt_open_separate_key_spaces() -> None:
    toks = list(range(32))
    base = block_keys(toks, 16)
    lora = block_keys(toks, 16, lora_name="sql-adapter")
    salt = block_keys(toks, 16, cache_salt="tenant-7")
    both = block_keys(toks, 16, lora_name="sql-adapter", cache_salt="tenant-7")
    assert len({base[0], lora[0], salt[0], both[0]}) == 4
    assert len({base[1], lora[1], salt[1], both[1]}) == 4
    assert block_keys(toks, 16, lora_name="x") == block_keys(toks, 16, lora_name="x")


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU",
           bs: int = 4) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs,
                       medium=medium)


TOKS = list(range(100, 116))


def test_multi_block_store_and_tiers() -> None:
    idx = TieredIndex(4)
    assert idx.apply(A, stored([1, 2, 3, 4], None, TOKS)) is Outcome.APPLIED
    assert idx.apply(A, stored([1, 2], None, TOKS[:8], "CPU_PINNED")) is Outcome.APPLIED
    assert idx.apply(A, stored([1], None, TOKS[:4], "disk")) is Outcome.APPLIED
    idx._check()
    assert idx.block_counts(A) == {StorageTier.DEVICE: 4, StorageTier.HOST: 2, StorageTier.DISK: 1,
                                   StorageTier.EXTERNAL: 0}
    idx.apply(A, BlockRemoved(block_hashes=[1, 2], medium="GPU"))
    idx._check()
    o = idx.find_matches(TOKS).workers[A]
    assert (o.device, o.host, o.disk, o.external) == (0, 4, 4, 4)
    idx.apply(A, BlockRemoved(block_hashes=[2], medium="CPU"))
    o = idx.find_matches(TOKS).workers[A]
    assert (o.device, o.host, o.disk) == (0, 1, 1)


def test_a_worker_the_index_never_heard_holds_nothing_on_any_tier() -> None:
    """``block_counts`` of an unknown worker: zeros, as ``worker_hashes`` answers empty sets (it raised KeyError)."""
    idx = TieredIndex(4)
    assert idx.block_counts(B) == dict.fromkeys(StorageTier, 0)
    assert idx.worker_hashes(B) == {t: set() for t in StorageTier}


def test_unknown_parent_is_held_as_an_orphan_and_grafted_when_the_parent_arrives() -> None:
    idx = TieredIndex(4)
    # Children first (a shared pool's writers, or a prefix stored before a loss), then the parent.
    assert idx.apply(A, stored([3], 2, TOKS[8:12])) is Outcome.ORPHANED
    assert idx.apply(A, stored([2], 1, TOKS[4:8], "CPU")) is Outcome.ORPHANED
    assert idx.stats(A).unknown_parents == 2 and idx.stats(A).events_rejected == 0
    assert len(idx) == 0 and idx.orphan_blocks(A) == 2
    idx.apply(A, BlockRemoved(block_hashes=[3], medium="CPU"))  # wrong tier: block 3 stays
    assert idx.stats(A).unknown_removals == 1
    idx._check()
    assert idx.apply(A, stored([1], None, TOKS[:4])) is Outcome.APPLIED
    idx._check()
    o = idx.find_matches(TOKS).workers[A]
    assert (o.device, o.host) == (1, 3)  # block 2 is on the host only, block 3 on device only
    assert idx.worker_hashes(A)[StorageTier.DEVICE] == {1, 3}
    assert idx.orphan_blocks(A) == 0 and idx.orphan_stats(A).grafted == 2


def test_orphan_removed_before_its_graft_is_never_indexed() -> None:
    idx = TieredIndex(4)
    idx.apply(A, stored([2, 3], 1, TOKS[4:12]))
    idx.apply(A, BlockRemoved(block_hashes=[3], medium="GPU"))
    assert idx.stats(A).unknown_removals == 0
    idx.apply(A, stored([1], None, TOKS[:4]))
    idx._check()
    assert idx.worker_hashes(A)[StorageTier.DEVICE] == {1, 2}


def test_removals_of_held_orphans_go_by_hash_and_tier_each_block_once() -> None:
    """A removal marks every held block of that hash on that tier gone (in every run naming it), leaves the same
    hash on another tier, and a second removal of it is unknown: the graft then indexes exactly what is still
    held."""
    idx = TieredIndex(4)
    idx.apply(A, stored([2, 3, 4], 1, TOKS[4:16]))
    idx.apply(A, stored([3], 9, TOKS[:4]))  # another run naming hash 3, under a parent that never comes
    idx.apply(A, stored([3], 1, TOKS[12:16], medium="CPU_PINNED"))
    idx.apply(A, BlockRemoved(block_hashes=[3, 4], medium="GPU"))
    idx._check()
    assert idx.stats(A).unknown_removals == 0 and idx.orphan_blocks(A) == 5
    idx.apply(A, BlockRemoved(block_hashes=[3], medium="GPU"))
    assert idx.stats(A).unknown_removals == 1
    idx.apply(A, stored([1], None, TOKS[:4]))
    idx._check()
    held = idx.worker_hashes(A)
    assert held[StorageTier.DEVICE] == {1, 2} and held[StorageTier.HOST] == {3}


def test_one_bad_event_costs_one_event() -> None:
    idx = TieredIndex(4)
    batch = [stored([7], 99, TOKS[:4]), stored([1, 2], None, TOKS[:8]),
             stored([5], None, TOKS[:3]), stored([3], 2, TOKS[8:12])]
    assert [idx.apply(A, ev) for ev in batch] == [Outcome.ORPHANED, Outcome.APPLIED, Outcome.REJECTED,
                                                  Outcome.APPLIED]
    assert idx.find_matches(TOKS).workers[A].device == 3


def test_orphan_pool_is_bounded_oldest_first() -> None:
    idx = TieredIndex(4)
    idx._workers.add(A).orphans.capacity = 3
    for i in range(5):
        idx.apply(A, stored([100 + i], 50 + i, TOKS[:4]))
    idx._check()
    assert idx.orphan_blocks(A) == 3 and idx.orphan_stats(A).dropped == 2
    idx.apply(A, stored([50], None, TOKS[:4]))  # the oldest orphan's parent: it was aged out
    assert idx.orphan_stats(A).grafted == 0
    idx.apply(A, stored([54], None, TOKS[:4]))
    assert idx.orphan_stats(A).grafted == 1
    idx._check()


def test_orphan_pool_is_bounded_in_bytes_too() -> None:
    """A held store of one block may carry a salt of megabytes: a pool bounded in blocks alone held 65,536 such
    (64 GiB a worker). Past its bytes the oldest go, as past its blocks."""
    idx = TieredIndex(4)
    pool = idx._workers.add(A).orphans
    pool.byte_capacity = 10_000
    for i in range(20):
        ev = BlockStored(block_hashes=[100 + i], parent_block_hash=50 + i, token_ids=TOKS[:4], block_size=4,
                         medium="GPU", cache_salt=f"{i:02d}" * 1000)
        assert idx.apply(A, ev) is Outcome.ORPHANED
    idx._check()
    assert 0 < pool.held_bytes <= 10_000 and idx.orphan_blocks(A) == 4 and idx.orphan_stats(A).dropped == 16
    assert idx.apply(A, BlockStored(block_hashes=[69], parent_block_hash=None, token_ids=TOKS[:4], block_size=4,
                                    medium="GPU", cache_salt="9" * 2000)) is Outcome.APPLIED
    assert idx.orphan_stats(A).grafted == 1  # the newest (under 69) was kept


@pytest.mark.parametrize("ev,reason", [
    (stored([1], None, TOKS[:4], bs=8), "block_size"),
    (stored([1, 2], None, TOKS[:5]), "token ids"),
    (stored([], None, []), "no block hashes"),
    (stored([1], None, TOKS[:4], medium="TAPE"), "TAPE"),
    (stored([1], None, TOKS[:4], bs=-4), "block_size"),
])
def test_bad_events_are_rejected_without_touching_others(ev: BlockStored, reason: str) -> None:
    idx = TieredIndex(4)
    idx.apply(B, stored([1, 2], None, TOKS[:8]))
    before = idx.snapshot()
    assert idx.apply(A, ev) is Outcome.REJECTED
    assert reason in (idx.stats(A).last_error or "")
    idx.remove_worker(A)
    assert idx.snapshot() == before
    idx._check()


def test_removing_unknown_blocks_is_counted() -> None:
    idx = TieredIndex(4)
    idx.apply(A, stored([1], None, TOKS[:4]))
    idx.apply(A, BlockRemoved(block_hashes=[1, 77], medium="CPU"))
    assert idx.stats(A).unknown_removals == 2
    assert idx.block_counts(A)[StorageTier.DEVICE] == 1
    idx._check()


def test_clear_remove_worker_and_dp_ranks() -> None:
    idx = TieredIndex(4)
    idx.apply(A, stored([1, 2], None, TOKS[:8]))
    idx.apply(A1, stored([1, 2, 3], None, TOKS[:12]))
    idx.apply(B, stored([5], None, TOKS[:4], "EXTERNAL"))
    m = idx.find_matches(TOKS)
    assert m.workers[A].device == 2 and m.workers[A1].device == 3
    assert m.shared_pool == 1 and m.workers[A].external == 2 and m.workers[B].external == 1
    idx.apply(A, AllBlocksCleared())
    idx._check()
    assert idx.find_matches(TOKS).workers[A].device == 0
    assert idx.find_matches(TOKS).workers[A1].device == 3
    idx.remove_worker(A1)
    idx._check()
    assert A1 not in idx.find_matches(TOKS).workers
    idx.apply(C, stored([1], None, TOKS[:4]))  # reuses the freed slot
    idx._check()
    assert idx.find_matches(TOKS).workers[C].device == 1
    # Every known worker is listed, those holding none of the query too, as workers come and go between queries.
    idx.remove_worker(B)
    assert list(idx.find_matches(TOKS).workers) == [A, C]
    idx.apply(A1, stored([7], None, [9, 9, 9, 9]))
    assert list(idx.find_matches(TOKS).workers) == [A, C, A1]
    assert idx.find_matches(TOKS).workers[A1] == TierOverlap(0, 0, 0, 0)


def test_snapshot_round_trip_and_bad_snapshot() -> None:
    idx = TieredIndex(4)
    idx.apply(A, stored([1, 2], None, TOKS[:8]))
    idx.apply(B, stored([b"\x01" * 32], None, TOKS[:4], "CPU"))
    idx.clear_worker(C, partial=True)
    again = TieredIndex.restore(idx.snapshot())
    again._check()
    assert again.find_matches(TOKS) == idx.find_matches(TOKS)
    assert again.is_partial(C) and again.snapshot() == idx.snapshot()
    with pytest.raises(ValueError, match="snapshot"):
        TieredIndex.restore(b"\x01\x02")
    # A block outside the key space, or tier bits past the worker's own slot (another worker's), is refused whole.
    for entry in [(1, -5, 1), (1, 5, 1 << 40), (1, 5, 0)]:
        bad = msgspec.msgpack.encode({"version": 1, "block_size": 4, "window_tokens": 0, "links": [],
                                      "workers": [("a", 0, False, [entry])]})
        with pytest.raises(ValueError, match="not an index snapshot"):
            TieredIndex.restore(bad)
    # A worker's record cut after its window (damage, or a writer of another version): refused, not an IndexError.
    bad = msgspec.msgpack.encode({"version": 1, "block_size": 4, "window_tokens": 0, "links": [],
                                  "workers": [("a", 0, False, [(1, 5, 1)], 8)]})
    with pytest.raises(ValueError, match="not an index snapshot"):
        TieredIndex.restore(bad)


def test_a_parents_children_set_keeps_its_live_children_not_every_child_it_had() -> None:
    """A long-lived parent (a system prompt) has children stored and evicted by the thousand: its set of children
    kept every one it ever had (memory, and a walk of them all at each removal of it). The dead go as it grows; the
    live stay, so a removal of the parent still finds every child that becomes loose."""
    idx = TieredIndex(4)
    parent = stored([7], None, TOKS[:4])
    idx.apply(B, parent)
    idx.apply(A, parent)
    live = []
    for i in range(3000):
        idx.apply(A, stored([1000 + i], 7, [i, i, i, 9]))
        if i % 500 == 0:
            live.append(idx.request_keys(TOKS[:4] + [i, i, i, 9])[1])
        else:
            idx.apply(A, BlockRemoved(block_hashes=[1000 + i], medium="GPU"))
    idx._check()
    pkey = idx.request_keys(TOKS[:4])[0]
    kids = idx._closure.branches[pkey]
    assert set(live) <= kids and len(kids) < 64
    idx.apply(A, BlockRemoved(block_hashes=[7], medium="GPU"))  # A's live children are loose now
    idx._check()
    assert set(live) <= idx._closure.loose[(idx._workers[A].slot, StorageTier.DEVICE)]
    assert idx.block_counts(A)[StorageTier.DEVICE] == len(live) == 6


def test_a_hash_reused_for_content_another_hash_names_keeps_one_name() -> None:
    """An engine reuses hash 1 for the content its hash 2 names: hash 1's old block goes, and hash 1 becomes an alias
    (unknown later), as a new hash for held content does. Naming the key twice, a removal of hash 2 left hash 1
    naming a key with no bits: the next snapshot raised KeyError (the service's event loop died) or wrote a file
    no restart could read."""
    idx = TieredIndex(4)
    idx.apply(B, stored([50], None, TOKS[4:8]))
    for e in (stored([1], None, TOKS[:4]), stored([2], None, TOKS[4:8]), stored([1], None, TOKS[4:8])):
        assert idx.apply(A, e) is Outcome.APPLIED
    idx._check()
    assert idx.stats(A).aliases == 1 and idx.block_counts(A)[StorageTier.DEVICE] == 1
    assert idx.apply(A, BlockRemoved(block_hashes=[2], medium="GPU")) is Outcome.APPLIED
    idx._check()
    assert idx.block_counts(A)[StorageTier.DEVICE] == 0 and idx.find_matches(TOKS[4:8]).workers[B].device == 1
    again = TieredIndex.restore(idx.snapshot())
    again._check()
    assert again.snapshot() == idx.snapshot()
    # Reuses in an order that broke the worker's state midway (the event then rejected, the worker dropped): sound.
    idx = TieredIndex(4)
    for ev in (stored([4, 1, 3], None, _blocks(0, 2, 2)), stored([4, 4, 3], 1, _blocks(2, 2, 0), medium="CPU_PINNED")):
        assert idx.apply(A, ev) is Outcome.APPLIED
        idx._check()
    assert idx.stats(A).internal_errors == 0 and not idx.is_partial(A)


@pytest.mark.parametrize("signed", [True, False])
def test_a_snapshot_of_thousands_of_blocks_per_worker_restores(signed: bool) -> None:
    """A restart from a snapshot writes every worker's engine hashes back one by one, growing its table many
    times over (a worker's table starts at 64 rows): every block must come back where a query finds it, with
    SGLang's signed and vLLM's unsigned hashes alike. Each hash goes into the table as grown so far, never into
    the rows from before a growth (an ``IndexError``, or a hash silently lost)."""
    n, bs = 3000, 4
    toks = list(range(n * bs))
    base = -(1 << 62) if signed else 1 << 63  # the sign the engine's hashes come with
    hashes = [base + 7919 * i for i in range(1, n + 1)]
    idx = TieredIndex(bs)
    for lo in range(0, n, 500):  # a chain of 3,000 blocks stored in batches, as an engine sends it
        parent = hashes[lo - 1] if lo else None
        assert idx.apply(A, stored(hashes[lo:lo + 500], parent, toks[lo * bs:(lo + 500) * bs], bs=bs)) \
            is Outcome.APPLIED
    idx.apply(B, stored(hashes[:100], None, toks[:100 * bs], "CPU", bs=bs))
    again = TieredIndex.restore(idx.snapshot())
    again._check()
    assert again.worker_hashes(A) == idx.worker_hashes(A) and again.worker_hashes(B) == idx.worker_hashes(B)
    assert again.find_matches(toks) == idx.find_matches(toks)
    assert again.find_matches(toks).workers[A].device == n
    # (the bytes of a second snapshot may differ: a table restored row by row has its own row order)
    twice = TieredIndex.restore(again.snapshot())
    assert twice.worker_hashes(A) == idx.worker_hashes(A) and twice.find_matches(toks) == idx.find_matches(toks)


def test_a_restored_index_still_grafts_held_orphans_and_extends_blocks_dropped_at_a_loss() -> None:
    """A restarted service resumes each stream after its last applied batch, so what the index held outside its
    blocks must come back too: a store waiting for its parent (the parent arrives after the restart) and the keys
    of blocks dropped at a loss (a store extending them arrives after the restart)."""
    idx = TieredIndex(4)
    assert idx.apply(A, stored([3], 2, TOKS[8:12], "CPU")) is Outcome.ORPHANED
    assert idx.apply(A, stored([4], 3, TOKS[12:16])) is Outcome.ORPHANED
    idx.apply(A, BlockRemoved(block_hashes=[4], medium="GPU"))  # gone before its graft: never indexed
    idx.apply(B, stored([11, 12], None, TOKS[:8]))
    idx.clear_worker(B, partial=True)
    again = TieredIndex.restore(idx.snapshot())
    again._check()
    assert again.orphan_blocks(A) == 2 and again.snapshot() == idx.snapshot()
    for index in (idx, again):
        assert index.apply(A, stored([1, 2], None, TOKS[:8])) is Outcome.APPLIED
        assert index.apply(B, stored([13], 12, TOKS[8:12])) is Outcome.APPLIED  # not an orphan: 12 is a ghost
        index._check()
    assert again.find_matches(TOKS) == idx.find_matches(TOKS)
    o = again.find_matches(TOKS).workers
    assert (o[A].device, o[A].host, o[B].device) == (2, 3, 0)  # B's block 13 hangs under prefixes it lost
    assert again.worker_hashes(A)[StorageTier.HOST] == {3} and again.worker_hashes(B)[StorageTier.DEVICE] == {13}


def test_a_parent_whose_children_branch_takes_their_set_with_it_when_nobody_holds_it() -> None:
    """Two chains branch under one block: its children are a set kept beside the table. Removing every
    block drops that set with the parent's row; a set kept for a dead parent would be a leak _check reports."""
    idx = TieredIndex(4)
    idx.apply(A, stored([1, 2], None, TOKS[:8]))
    idx.apply(A, stored([3], 1, list(range(900, 904))))
    idx._check()
    assert len(list(idx._closure.children(block_keys(TOKS[:4], 4)[0]))) == 2
    idx.apply(A, BlockRemoved(block_hashes=[3, 2, 1], medium="GPU"))
    idx._check()
    assert len(idx) == 0


def test_a_block_dropped_by_an_engine_hash_reused_for_other_content_leaves_its_child_loose() -> None:
    """The engine names other content with the hash of A's first block: that block goes (nobody holds it), so its
    child, still held, is held without its parent. The compiled table keeps a block's links in its row, so the
    block-by-block path must look at the children before the row goes, or the child is never marked loose and
    queries would binary-search past the hole."""
    idx = TieredIndex(4)
    idx.apply(A, stored([1, 2], None, TOKS[:8]))
    idx.apply(A, stored([1], None, list(range(900, 904))))  # hash 1, other content, under the root
    child = block_keys(TOKS[:8], 4)[1]
    assert not idx._closure.closed and child in idx._closure.loose[(0, int(StorageTier.DEVICE))]
    idx._check()


def test_a_chain_stored_across_another_workers_branch_is_linked_so_a_hole_in_it_is_seen() -> None:
    """B stores a chain whose first blocks A holds, branching where A's went elsewhere: B's blocks gain its
    bit in bulk, and the link under the branch point must still be made, or B losing the middle block would
    leave its last one held without a parent while queries trust binary search."""
    idx = TieredIndex(4)
    base = list(range(100, 108))  # two blocks both chains share
    idx.apply(A, stored([1, 2, 3], None, base + list(range(200, 204))))
    idx.apply(B, stored([11, 12, 13], None, base + list(range(300, 304))))
    idx._check()
    assert idx._closure.closed
    idx.apply(B, BlockRemoved(block_hashes=[12], medium="GPU"))
    assert not idx._closure.closed, "B holds its third block without the second: queries must not binary-search"
    idx._check()
    assert idx.find_matches(base + list(range(300, 304))).workers[B].device == 1


def test_many_workers_beyond_one_word() -> None:
    idx = TieredIndex(4)
    streams = [StreamId(WorkerId(f"w{i}")) for i in range(40)]
    for i, s in enumerate(streams):
        idx.apply(s, stored(list(range(1 + i % 4)), None, TOKS[: 4 * (1 + i % 4)], ["GPU", "CPU"][i % 2]))
    idx._check()
    m = idx.find_matches(TOKS)
    for i, s in enumerate(streams):
        assert m.workers[s].host == 1 + i % 4
        assert m.workers[s].device == (1 + i % 4 if i % 2 == 0 else 0)


def test_vectorised_depths_with_workers_that_never_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots handed out to workers that never stored a block: the scan reads mask words for every slot handed out,
    more than any stored mask has (the compiled table widens its masks only when a slot stores)."""
    monkeypatch.setattr(levels_module, "MAX_RUNS", 0)
    idx = TieredIndex(4)
    streams = [StreamId(WorkerId(f"w{i}")) for i in range(40)]
    for s in streams:
        idx.add_worker(s)
    idx.apply(streams[0], stored([1, 2], None, TOKS[:8]))
    m = idx.find_matches(TOKS)
    assert m.workers[streams[0]].device == 2
    assert all(m.workers[s].device == 0 for s in streams[1:])


def test_a_removed_middle_block_turns_binary_search_off_until_its_children_go() -> None:
    """vLLM evicts any free block: the index notices the hole and scans, and searches again once no
    block is held without its parent."""
    idx = TieredIndex(4)
    idx.apply(A, stored([1, 2, 3, 4], None, TOKS))
    idx.apply(B, stored([11, 12], None, TOKS[:8]))
    assert idx._closure.closed
    assert idx._depths.runs_by_search(idx.request_keys(TOKS)) is not None
    idx.apply(A, BlockRemoved(block_hashes=[2], medium="GPU"))  # block 3 is now held without its parent
    assert not idx._closure.closed
    idx._check()
    assert (idx.find_matches(TOKS).workers[A].device, idx.find_matches(TOKS).workers[B].device) == (1, 2)
    idx.apply(A, stored([2], 1, TOKS[4:8]))  # the hole is filled again
    assert idx._closure.closed and idx.find_matches(TOKS).workers[A].device == 4
    idx.apply(A, BlockRemoved(block_hashes=[2], medium="GPU"))
    idx.apply(A, BlockRemoved(block_hashes=[3], medium="GPU"))  # 4 loses its parent in turn
    assert not idx._closure.closed and idx.find_matches(TOKS).workers[A].device == 1
    idx.apply(A, BlockRemoved(block_hashes=[4], medium="GPU"))
    assert idx._closure.closed and idx.find_matches(TOKS).workers[A].device == 1
    # The last holder of a block removes it while another worker holds its child: that child is loose.
    idx.apply(B, stored([13], 12, TOKS[8:12]))
    idx.apply(B, BlockRemoved(block_hashes=[12], medium="GPU"))
    assert not idx._closure.closed
    idx._check()
    assert idx.find_matches(TOKS).workers[B].device == 1
    again = TieredIndex.restore(idx.snapshot())
    assert not again._closure.closed and again.find_matches(TOKS).workers[B].device == 1
    idx.clear_worker(B)
    assert idx._closure.closed


# --- agreement with the naive model on random event streams -----------------------------------

BS = 2
DOCS = [[d * 1000 + i for i in range(12)] for d in range(3)] + [[0, 1, 2, 3, 9, 9, 9, 9, 9, 9, 9, 9]]
TIER_NAMES = ["GPU", "CPU_PINNED", "DISK", "EXTERNAL"]
WORKERS = [A, B, A1]


def engine_hash(worker: StreamId, tokens: tuple[int, ...]) -> EngineHash:
    """A different (opaque) engine hash scheme per worker, content-chained like SGLang's, in each form the wire
    carries: signed int64 (SGLang), unsigned past 2**63 (vLLM), bytes; small ints for the padding workers. The
    compiled index keeps each in a form of its own (kvtier.indexer.index.keytable.EngineHashes)."""
    # (xxhash, not hash(): a str's hash() changes with PYTHONHASHSEED, and the derandomized examples with it)
    h = xxhash.xxh3_64_intdigest(repr((worker.worker, worker.dp_rank, tokens)).encode())
    if worker == A:
        return h - (1 << 63)
    if worker == B:
        return h | (1 << 63)
    if worker == A1:
        return h.to_bytes(8, "little")
    return h >> 1


@st.composite
def event_streams(draw: st.DrawFn) -> list[tuple[str, StreamId, Event | None]]:
    out: list[tuple[str, StreamId, Event | None]] = []
    for _ in range(draw(st.integers(1, 30))):
        w = draw(st.sampled_from(WORKERS))
        kind = draw(st.sampled_from(["store"] * 5 + ["remove"] * 3 + ["clear", "drop", "orphan", "partial", "restore"]))
        doc = draw(st.sampled_from(DOCS))
        start = draw(st.integers(0, 5))
        n = draw(st.integers(1, 6 - start))
        tier = draw(st.sampled_from(TIER_NAMES))
        hashes = [engine_hash(w, tuple(doc[:(i + 1) * BS])) for i in range(start, start + n)]
        if kind == "store":
            parent = engine_hash(w, tuple(doc[:start * BS])) if start else None
            out.append(("event", w, stored(hashes, parent, doc[start * BS:(start + n) * BS], tier, BS)))
        elif kind == "orphan":
            out.append(("event", w, stored(hashes, 12345, doc[start * BS:(start + n) * BS], tier, BS)))
        elif kind == "remove":
            out.append(("event", w, BlockRemoved(block_hashes=hashes, medium=tier)))
        elif kind == "clear":
            out.append(("event", w, AllBlocksCleared()))
        elif kind in ("restore", "partial"):
            out.append((kind, w, None))
        else:
            out.append(("drop", w, None))
    return out


queries = st.lists(st.tuples(st.sampled_from(DOCS), st.integers(0, 12)), min_size=1, max_size=4)


@given(event_streams(), queries)
def test_fast_index_agrees_with_naive_model(
    events: list[tuple[str, StreamId, Event | None]], qs: list[tuple[list[int], int]]
) -> None:
    _agrees(events, qs)


@given(event_streams(), queries)
def test_vectorised_path_agrees_with_naive_model(
    events: list[tuple[str, StreamId, Event | None]], qs: list[tuple[list[int], int]]
) -> None:
    """find_matches scans every leading block past MAX_RUNS runs of equal masks: check that path too."""
    saved = levels_module.MAX_RUNS
    levels_module.MAX_RUNS = 0
    try:
        _agrees(events, qs)
    finally:
        levels_module.MAX_RUNS = saved


@given(event_streams(), queries, st.integers(14, 40), st.integers(0, 3))
def test_many_workers_sharing_a_prefix_agree_with_naive_model(
    events: list[tuple[str, StreamId, Event | None]], qs: list[tuple[list[int], int]], padding: int, shift: int
) -> None:
    """Slots past the first 64-bit word of a mask, and many workers dropping out of one shared prefix (a
    system prompt) at the same block on several tiers: the depths of all of them are decoded together."""
    _agrees(events, qs, padding=padding, shift=shift)


@given(event_streams(), queries)
def test_general_store_path_agrees_with_naive_model(
    events: list[tuple[str, StreamId, Event | None]], qs: list[tuple[list[int], int]]
) -> None:
    """The compiled masks store most events from their tokens in one kernel call (BlockMasks.insert_tokens); with
    that call declined, every store takes the general path (keys first, then BlockMasks.insert): check it too."""
    saved = BlockMasks.insert_tokens
    BlockMasks.insert_tokens = lambda *args: None  # type: ignore[method-assign,assignment]
    try:
        _agrees(events, qs)
    finally:
        BlockMasks.insert_tokens = saved  # type: ignore[method-assign]


def test_a_branch_under_a_parent_whose_key_has_its_top_bit_set_is_kept_under_that_key() -> None:
    """A chain stored under a parent whose router key is past 2**63 starts a second child there: the set of its
    children must be kept under the key itself. The one-call store reads the parent's key back from an int64
    array, so it must take it as unsigned: a set kept under a negative number is lost to the next removal or
    query."""
    docs = [[d * 1000 + i for i in range(4)] for d in range(40)]
    doc = next(d for d in docs if block_keys(d[:4], 4)[0] >= 1 << 63)
    parent = block_keys(doc[:4], 4)[0]
    idx = TieredIndex(4)
    idx.apply(A, stored([1, 2], None, doc[:4] + list(range(500, 504))))
    idx.apply(A, stored([3], 1, list(range(900, 904))))  # a second child under block 1
    idx._check()
    assert sorted(idx._closure.children(parent)) == sorted(
        [block_keys(doc[:4] + list(range(500, 504)), 4)[1], block_keys(doc[:4] + list(range(900, 904)), 4)[1]])
    idx.apply(A, BlockRemoved(block_hashes=[3, 2, 1], medium="GPU"))
    idx._check()
    assert len(idx) == 0


@st.composite
def closed_streams(draw: st.DrawFn) -> list[tuple[str, StreamId, Event | None]]:
    """Streams a radix engine could send: stores extend a prefix the worker holds on that tier, removals
    take leaves there (blocks no other block it holds there extends). Every tier stays prefix-closed, so
    queries binary-search throughout; DOCS[0] and DOCS[3] share two blocks, so the trees branch."""
    out: list[tuple[str, StreamId, Event | None]] = []
    held: dict[tuple[StreamId, str], set[tuple[int, ...]]] = {}  # (worker, tier) -> blocks, as token prefixes
    for _ in range(draw(st.integers(1, 30))):
        w, doc, tier = draw(st.sampled_from(WORKERS)), draw(st.sampled_from(DOCS)), draw(st.sampled_from(TIER_NAMES))
        h = held.setdefault((w, tier), set())
        have = next(i for i in range(7) if i == 6 or tuple(doc[:(i + 1) * BS]) not in h)
        if draw(st.booleans()) and have < 6:
            n = draw(st.integers(1, 6 - have))
            hashes = [engine_hash(w, tuple(doc[:(i + 1) * BS])) for i in range(have, have + n)]
            parent = engine_hash(w, tuple(doc[:have * BS])) if have else None
            out.append(("event", w, stored(hashes, parent, doc[have * BS:(have + n) * BS], tier, BS)))
            h.update(tuple(doc[:(i + 1) * BS]) for i in range(have, have + n))
        elif have:
            gone: list[int] = []  # deepest first, each a leaf once the deeper ones are gone
            for i in range(have - 1, have - 1 - draw(st.integers(1, have)), -1):
                block = tuple(doc[:(i + 1) * BS])
                if any(len(b) == len(block) + BS and b[:len(block)] == block for b in h):
                    break  # another branch extends it: not a leaf
                h.discard(block)
                gone.append(i)
            if gone:
                hashes = [engine_hash(w, tuple(doc[:(i + 1) * BS])) for i in gone]
                out.append(("event", w, BlockRemoved(block_hashes=hashes, medium=tier)))
    return out


@given(closed_streams(), queries)
def test_binary_search_agrees_with_naive_model_on_radix_engines(
    events: list[tuple[str, StreamId, Event | None]], qs: list[tuple[list[int], int]]
) -> None:
    """Shared documents give branches: a removal may leave children on other workers, never on its own."""
    _agrees(events, qs, always_closed=True)


def _agrees(events: list[tuple[str, StreamId, Event | None]], qs: list[tuple[list[int], int]],
            always_closed: bool = False, padding: int = 0, shift: int = 0) -> None:
    """``padding`` workers join first, each holding 1-3 leading blocks of the first document on some tier
    (``shift`` varies which), so the streams under test get slots past them."""
    fast, ref = TieredIndex(BS), ReferenceIndex(BS)
    for i in range(padding):
        pad, n, tier = StreamId(WorkerId(f"pad{i}")), 1 + (i + shift) % 3, TIER_NAMES[(i * shift) % len(TIER_NAMES)]
        ev = stored([engine_hash(pad, tuple(DOCS[0][:(j + 1) * BS])) for j in range(n)], None, DOCS[0][:n * BS], tier,
                    BS)
        assert fast.apply(pad, ev).value == ref.apply(pad, ev)
    for kind, w, ev in events:
        if kind == "drop":
            fast.remove_worker(w)
            ref.remove_worker(w)
        elif kind == "partial":  # events lost for good (a gap no replay or dump can fill)
            fast.clear_worker(w, partial=True)
            ref.clear_worker(w, partial=True)
        elif kind == "restore":  # a restart from a snapshot: what follows applies to the restored index
            fast = TieredIndex.restore(fast.snapshot())
        else:
            assert ev is not None
            assert fast.apply(w, ev).value == ref.apply(w, ev)
        fast._check()
        assert fast._closure.closed or not always_closed, "a radix engine's stream turned binary search off"
        if fast._closure.closed:  # sound: no worker holds a block on a tier without its parent there
            for doc in DOCS:
                keys = fast.request_keys(doc)
                for st_ in fast.streams:
                    shift = 4 * fast._workers[st_].slot
                    for t in range(4):
                        held = [bool(fast._masks.get(k, 0) >> (shift + t) & 1) for k in keys]
                        assert held == sorted(held, reverse=True), f"{st_} tier {t}: a hole {held} while 'closed'"
        for doc, cut in qs:
            f, r = fast.find_matches(doc[:cut]), ref.find_matches(doc[:cut])
            if fast._closure.closed:  # the search must find exactly the runs a scan finds
                keys = fast.request_keys(doc[:cut])
                ms = _leading_masks(fast, keys)
                searched = fast._depths.runs_by_search(keys)
                assert searched is None or searched == ([(m, i) for i, m in enumerate(ms)
                                                         if i == 0 or m != ms[i - 1]], len(ms))
            assert f.shared_pool == r.shared_pool
            assert f.total_blocks == r.total_blocks
            assert set(f.workers) == set(r.workers)
            for s, o in r.workers.items():
                assert f.workers[s] == o, (s, doc[:cut])
    again = TieredIndex.restore(fast.snapshot())
    again._check()
    for doc, cut in qs:
        assert again.find_matches(doc[:cut]).workers == fast.find_matches(doc[:cut]).workers


def _leading_masks(idx: TieredIndex, keys: list[int]) -> list[int]:
    """The masks of the leading blocks anybody holds, one mapping read each (what the search must agree with)."""
    out = []
    for k in keys:
        m = idx._masks.get(k, 0)
        if not m:
            break
        out.append(m)
    return out


# --- fuzzing: arbitrary events never raise, every rejection is counted ------------------------

any_hash = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=12))
fuzz_events = st.one_of(
    st.builds(lambda hs, p, toks, bs, med: BlockStored(block_hashes=hs, parent_block_hash=p, token_ids=toks,
                                                       block_size=bs, medium=med),
              st.lists(any_hash, max_size=4), st.none() | any_hash,
              st.lists(st.integers(-5, 2**33), max_size=12), st.integers(-3, 6),
              st.sampled_from([None, "GPU", "cpu", "DISK", "shared", "tape", ""])),
    st.builds(lambda hs, med: BlockRemoved(block_hashes=hs, medium=med), st.lists(any_hash, max_size=4),
              st.sampled_from([None, "GPU", "CPU_PINNED", "nvme", "floppy"])),
    st.just(AllBlocksCleared()),
)


@given(st.lists(fuzz_events, max_size=40))
# A well-formed store under an unknown parent is held as an orphan: counted as an unknown parent, not as a
# rejection.
@example([BlockStored(block_hashes=[0], parent_block_hash=0, token_ids=[0, 0], block_size=2, medium=None)])
def test_fuzzed_events_never_raise_and_never_touch_other_workers(events: list[Event]) -> None:
    idx = TieredIndex(2)
    idx.add_worker(A)
    idx.apply(B, stored([1, 2], None, TOKS[:4], bs=2))
    before = idx.worker_hashes(B)
    outcomes = []
    for ev in events:
        outcomes.append(idx.apply(A, ev))
        idx._check()
    assert idx.stats(A).events_rejected == outcomes.count(Outcome.REJECTED)
    assert idx.stats(A).unknown_parents == outcomes.count(Outcome.ORPHANED)
    assert idx.worker_hashes(B) == before
    idx.find_matches(TOKS)
    again = TieredIndex.restore(idx.snapshot())  # whatever was held, orphans of any shape included
    again._check()
    assert again.find_matches(TOKS) == idx.find_matches(TOKS) and again.orphan_blocks(A) == idx.orphan_blocks(A)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 400), st.lists(st.tuples(st.integers(0, 400), st.sampled_from(["GPU", "CPU", "DISK"])),
                                     min_size=1, max_size=6), st.integers(0, 400))
def test_search_over_long_runs_agrees_with_reading_every_block(length: int, holds: list[tuple[int, str]],
                                                               cut: int) -> None:
    """A query's runs of equal masks are searched a few blocks at a time (tablekernel.runs_by_search): over chains
    of hundreds of blocks held to different depths on different tiers, the overlaps equal those the index reads off
    every leading block, and those of the naive model."""
    idx, ref = TieredIndex(1), ReferenceIndex(1)
    tokens = list(range(1000, 1000 + length))
    for w, (depth, medium) in enumerate(holds):
        n = min(depth, length)
        if n:
            ev = stored(list(range(1, n + 1)), None, tokens[:n], medium, bs=1)
            stream = StreamId(WorkerId(f"w{w}"))
            assert idx.apply(stream, ev) is Outcome.APPLIED
            ref.apply(stream, ev)
    query = tokens[:cut] + [7] * (length - cut) if cut < length else tokens
    keys = idx.request_keys(query)
    assert idx._closure.closed
    searched, _ = idx._depths.overlaps(keys, True, idx._workers.end)
    scanned, _ = idx._depths.overlaps(keys, False, idx._workers.end)
    assert searched == scanned
    assert idx.find_matches(query).workers == ref.find_matches(query).workers


def test_search_finds_every_run_end() -> None:
    """The search's steps split a run in four: a run ending at each block of a 97-block chain is found there (a
    step that lost one block at a boundary would miss some of these ends)."""
    length = 97
    tokens = list(range(1000, 1000 + length))
    for end in range(length + 1):
        idx = TieredIndex(1)
        idx.apply(A, stored(list(range(1, length + 1)), None, tokens, bs=1))
        if end:
            idx.apply(B, stored(list(range(1, end + 1)), None, tokens[:end], bs=1))
        got = idx.find_matches(tokens).workers
        assert (got[A].device, got[B].device if B in got else 0) == (length, end)


def _blocks(*ids: int) -> list[int]:
    """Token ids of blocks of 4, block ``i`` holding ``10 i .. 10 i + 3``."""
    return [i * 10 + t for i in ids for t in range(4)]


@pytest.mark.parametrize("general", [False, True], ids=["one-call", "general"])
def test_links_made_before_the_table_grows_hold_after_it(general: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks' table starts small and is rebuilt as it fills (``tablekernel.rehash``), links and all: a chain
    stored first, then enough other blocks to grow the table several times, then a removal inside the chain, must
    break the prefix there, as the naive model says, before and after a snapshot round trip. (The agreement tests'
    streams are too small to grow any table.) Both store paths: the one-call store from tokens, and the general
    one (BlockMasks.insert), each growing the tables and calling its kernel again."""
    if general:
        monkeypatch.setattr(BlockMasks, "insert_tokens", lambda *args: None)
    idx, ref = TieredIndex(1), ReferenceIndex(1)
    chain, other = list(range(1000, 1040)), list(range(5000, 9000))
    cap = idx._masks.r.shape[0]
    for ev in (stored(list(range(1, 41)), None, chain, bs=1), stored(list(range(101, 4101)), None, other, bs=1),
               BlockRemoved(block_hashes=[10], medium=None)):
        assert idx.apply(A, ev).value == ref.apply(A, ev)
    assert idx._masks.r.shape[0] >= 4 * cap  # it grew
    idx._check()
    for index in (idx, TieredIndex.restore(idx.snapshot())):
        assert index.find_matches(chain).workers[A] == ref.find_matches(chain).workers[A] == TierOverlap(9, 9, 9, 9)
        assert index.find_matches(other).workers[A] == ref.find_matches(other).workers[A]


def test_thousands_of_distinct_masks_grow_the_pool_with_freed_ids_kept() -> None:
    """Twelve workers holding blocks in every combination make thousands of distinct masks: past the mask pool's first
    size, after removals have freed ids (the pool's stack of free ids moves as it grows), the index still agrees with
    the naive model on every block, and so does its snapshot restored."""
    workers = [StreamId(WorkerId(f"w{i}")) for i in range(12)]
    idx, ref = TieredIndex(1), ReferenceIndex(1)

    def put(lo: int, hi: int) -> None:
        for j in range(lo, hi):
            for i, w in enumerate(workers):
                if (j >> i) & 1:
                    ev = stored([j + 1], None, [j], bs=1)
                    assert idx.apply(w, ev).value == ref.apply(w, ev)

    put(0, 1000)
    first = idx._masks.pool.pm.shape[0]
    for j in range(1, 1000, 6):  # worker 0 drops some of its blocks: masks die and their ids are freed
        ev = BlockRemoved(block_hashes=[j + 1], medium=None)
        assert idx.apply(workers[0], ev).value == ref.apply(workers[0], ev)
    assert idx._masks.pool.pa[1] > 0  # free ids on the stack
    # One removal of hundreds of blocks reserves a mask each: the pool grows with those free ids on its stack.
    ev = BlockRemoved(block_hashes=[j + 1 for j in range(1000) if (j >> 1) & 1][:300], medium=None)
    assert idx.apply(workers[1], ev).value == ref.apply(workers[1], ev)
    put(1000, 4000)
    assert idx._masks.pool.pm.shape[0] > first  # the pool grew
    idx._check()
    again = TieredIndex.restore(idx.snapshot())
    again._check()
    # (ReferenceIndex.find_matches walks every block: the holders of each block are read from its state instead)
    want = [{s for s, w in ref.workers.items() if w.tiers.get(block_keys([j], 1)[0])} for j in range(4000)]
    for index in (idx, again):
        assert [{s for s, o in index.find_matches([j]).workers.items() if o.device} for j in range(4000)] == want


@pytest.mark.parametrize("partial", [False, True])
def test_clearing_the_only_holder_of_a_branch_forgets_it(partial: bool) -> None:
    """A worker that alone holds a parent with two children (a branch, whose children the closure keeps as a set)
    is cleared: every block it alone held goes, with the branch's set, and another worker's blocks stay, as the
    naive model says; the worker's next stores build the branch again."""
    idx, ref = TieredIndex(4), ReferenceIndex(4)
    doc = _blocks(0, 1)
    events = [(A, stored([1, 2], None, doc)), (A, stored([3], 2, _blocks(2))), (A, stored([4], 2, _blocks(3))),
              (B, stored([7], None, _blocks(5)))]
    for w, ev in events:
        assert idx.apply(w, ev).value == ref.apply(w, ev)
    assert len(list(idx._closure.children(block_keys(doc, 4)[1]))) == 2
    idx.clear_worker(A, partial=partial)
    ref.clear_worker(A, partial)
    idx._check()
    assert len(idx) == 1 and not list(idx._closure.children(block_keys(doc, 4)[1]))
    for q in (doc + _blocks(2), doc + _blocks(3), _blocks(5)):
        assert idx.find_matches(q).workers == ref.find_matches(q).workers
    for w, ev in events[:3]:
        assert idx.apply(w, ev).value == ref.apply(w, ev)
    idx._check()
    assert idx.find_matches(doc + _blocks(3)).workers[A].device == 3


def test_a_store_under_one_of_its_own_blocks_is_rejected() -> None:
    """A chain cannot hang under one of its own blocks. Held as an orphan and grafted when that hash arrived, it
    would re-key the very parent it hangs from, and the index's next look at that hash raised out of the event
    loop: such a store is one rejected event, and the worker's state stays sound."""
    idx = TieredIndex(4)
    idx.apply(B, stored([7], None, _blocks(5)))
    b_before = idx.find_matches(_blocks(5)).workers[B]
    assert idx.apply(A, stored([91, 91, 92], 91, _blocks(0, 0, 0))) is Outcome.REJECTED
    assert "one of its own block hashes" in (idx.stats(A).last_error or "")
    assert idx.apply(A, stored([91, 92], None, _blocks(0, 0))) is Outcome.APPLIED
    assert idx.apply(A, stored([91], None, _blocks(0))) is Outcome.APPLIED
    idx._check()
    assert idx.find_matches(_blocks(5)).workers[B] == b_before


def test_an_event_the_index_raises_on_drops_that_worker_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug the applier's checks let through can break its state midway (forced here: the second block an event
    re-keys raises, the first re-keyed already). The event is then rejected, that worker's blocks are dropped and it
    is marked partial (what it holds is unknown until a dump), and the index serves on: other workers' blocks and
    the index's invariants hold."""
    idx = TieredIndex(4)
    idx.apply(B, stored([7, 8], None, _blocks(0, 2)))
    b_before = idx.find_matches(_blocks(0, 2)).workers[B]
    assert idx.apply(A, stored([4, 1, 3], None, _blocks(0, 2, 2))) is Outcome.APPLIED
    real, calls = BlockMasks._drop_slot_bits, []

    def failing(self: BlockMasks, *args: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        real(self, *args)

    monkeypatch.setattr(BlockMasks, "_drop_slot_bits", failing)
    outcomes = [idx.apply(A, stored([4, 1, 3], None, _blocks(5, 6, 7)))]  # each hash reused for other content
    assert len(calls) == 2
    assert outcomes[-1] is Outcome.REJECTED and idx.stats(A).internal_errors == 1
    assert idx.worker_hashes(A) == {} or not any(idx.worker_hashes(A).values())
    assert idx.is_partial(A)
    idx._check()
    assert idx.find_matches(_blocks(0, 2)).workers[B] == b_before
    assert idx.apply(A, stored([5], None, _blocks(3))) is Outcome.APPLIED  # it serves on, from live events


def test_a_rejection_quoting_a_huge_value_stays_one_short_line(caplog: pytest.LogCaptureFixture) -> None:
    """A rejected event's reason may quote its bad value; one of two million ints is cut to a short line, in
    ``last_error`` and in the log, so a hostile event cannot bloat either."""
    idx = TieredIndex(4)
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=_blocks(0), block_size=4, medium="GPU",
                     extra_keys=[[list(range(2_000_000))]])
    with caplog.at_level("WARNING"):
        assert idx.apply(A, ev) is Outcome.REJECTED
    err = idx.stats(A).last_error or ""
    assert "unrecognised item" in err and len(err) < 400 and err.endswith("characters)")
    assert max(len(r.getMessage()) for r in caplog.records) < 500


def test_a_complete_clear_forgets_the_blocks_remembered_at_a_loss() -> None:
    """After a loss for good the dropped blocks' keys are remembered, so a store under one applies at once; once the
    worker's state is complete again (``AllBlocksCleared``) they are stale, and a store under one waits as an orphan
    rather than being indexed under a block the worker no longer holds."""
    toks = list(range(100, 116))
    idx = TieredIndex(4)
    idx.apply(A, BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks[:8], block_size=4))
    idx.clear_worker(A, partial=True)
    assert idx.apply(A, BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=toks[8:12],
                                    block_size=4)) is Outcome.APPLIED
    assert idx.apply(A, AllBlocksCleared()) is Outcome.APPLIED
    assert idx.apply(A, BlockStored(block_hashes=[4], parent_block_hash=2, token_ids=toks[12:16],
                                    block_size=4)) is Outcome.ORPHANED
    assert idx.find_matches(toks).workers[A] == TierOverlap(0, 0, 0, 0)
    idx._check()


def test_clears_are_counted_per_worker() -> None:
    """``WorkerStats.clears`` counts each time a worker's blocks were dropped (``AllBlocksCleared``, a restart, a
    loss); other workers' counts are untouched."""
    idx = TieredIndex(4)
    idx.add_worker(B)
    idx.apply(A, AllBlocksCleared())
    idx.clear_worker(A, partial=True)
    assert (idx.stats(A).clears, idx.stats(B).clears) == (2, 0)
