"""After a loss for good, a store on a tier the engine keeps prefix-closed regains the chain it proves held."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.indexer.index.keytable import EngineHashes
from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire import BlockRemoved, BlockStored, StorageTier, WorkerId
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import TierOverlap

W, V = StreamId(WorkerId("sglang")), StreamId(WorkerId("vllm"))
TOKS = list(range(100, 124))  # six blocks of 4
DEV, HOST, DISK = StorageTier.DEVICE, StorageTier.HOST, StorageTier.DISK
# SGLang-like engine hashes (signed int64), per block of TOKS
H = [-(1 << 62) - i for i in range(1, 7)]


def stored(first: int, n: int, parent: int | None, medium: str = "GPU") -> BlockStored:
    """Blocks ``first .. first + n - 1`` of TOKS (0-based), under ``parent``."""
    return BlockStored(block_hashes=H[first:first + n], parent_block_hash=parent,
                       token_ids=TOKS[4 * first:4 * (first + n)], block_size=4, medium=medium)


@pytest.fixture
def new_index() -> Iterator[Callable[[], TieredIndex]]:
    """Makes indexes."""
    yield lambda: TieredIndex(4)


def held_then_lost(make: Callable[[], TieredIndex], closed: set[StorageTier], medium: str = "GPU") -> TieredIndex:
    """Worker W (declared closed on ``closed``) and V (declared nothing) each held blocks 0-3 on ``medium``, then
    lost events for good."""
    idx = make()
    assert isinstance(idx._workers.add(W).hashes, EngineHashes)
    idx.set_prefix_closed(W, closed)
    for s in (W, V):
        assert idx.apply(s, stored(0, 4, None, medium)) is Outcome.APPLIED
        idx.clear_worker(s, partial=True)
    idx._check()
    return idx


def test_a_device_store_under_a_dropped_block_regains_its_chain_on_device(new_index: Callable[[], TieredIndex]) -> None:
    """The SGLang case: the hot prefix (blocks 0-3) was dropped at the loss; a new request extends it on device. The
    store proves blocks 0-3 are on device (a radix tree's device tier is prefix-closed): a probe answers 5 again.
    The same stream from a worker declared nothing (vLLM: a block can be held without its parent) regains nothing."""
    idx = held_then_lost(new_index, {DEV})
    for s in (W, V):
        assert idx.find_matches(TOKS).workers[s] == TierOverlap(0, 0, 0, 0)
        assert idx.apply(s, stored(4, 1, H[3])) is Outcome.APPLIED
        idx._check()
    assert idx.find_matches(TOKS).workers[W] == TierOverlap(5, 5, 5, 5)
    assert idx.worker_hashes(W)[DEV] == set(H[:5]) and idx.stats(W).relearned == 4
    assert idx.find_matches(TOKS).workers[V] == TierOverlap(0, 0, 0, 0)
    assert idx.worker_hashes(V)[DEV] == {H[4]} and idx.stats(V).relearned == 0
    assert idx.is_partial(W)  # what else it held before the loss is still unknown
    # The regained chain hangs under the root: none of W's blocks is loose (V's block 4 is: its parent is unknown).
    assert [t for (slot, t) in idx._closure.loose if slot == idx._workers[W].slot] == []
    # Regained blocks go as any other: a removal names them by engine hash.
    idx.apply(W, BlockRemoved(block_hashes=[H[4], H[3]], medium="GPU"))
    idx._check()
    assert idx.find_matches(TOKS).workers[W].device == 3


def test_a_store_proves_nothing_on_another_tier_nor_on_an_open_one(new_index: Callable[[], TieredIndex]) -> None:
    """A device store proves the chain on device only; a host store proves nothing on a worker whose host tier is
    not declared closed (SGLang), and its chain on host where it is (kvtier's engine); a disk store never (L3)."""
    idx = held_then_lost(new_index, {DEV})
    idx.apply(W, stored(4, 1, H[3], "CPU_PINNED"))
    idx._check()
    assert idx.worker_hashes(W)[HOST] == {H[4]} and idx.worker_hashes(W)[DEV] == set()
    idx = held_then_lost(new_index, {DEV, HOST}, "CPU_PINNED")
    idx.apply(W, stored(4, 1, H[3], "CPU_PINNED"))
    idx._check()
    assert idx.worker_hashes(W)[HOST] == set(H[:5]) and idx.worker_hashes(W)[DEV] == set()
    assert idx.find_matches(TOKS).workers[W] == TierOverlap(0, 5, 5, 5)
    idx = held_then_lost(new_index, {DEV, HOST}, "DISK")
    idx.apply(W, stored(4, 1, H[3], "DISK"))
    idx._check()
    assert idx.worker_hashes(W)[DISK] == {H[4]}


def test_a_chain_regained_on_one_tier_is_regained_on_another_when_a_store_there_proves_it(
        new_index: Callable[[], TieredIndex]) -> None:
    """Blocks 0-3 regained on host (kvtier's engine), then a device store under block 3, which the index now names
    (held on host only): the chain is regained on device too, and nothing is left loose."""
    idx = held_then_lost(new_index, {DEV, HOST})
    idx.apply(W, stored(4, 1, H[3], "CPU_PINNED"))
    assert idx.worker_hashes(W)[DEV] == set()
    idx.apply(W, stored(4, 1, H[3]))
    idx._check()
    assert idx.worker_hashes(W)[DEV] == set(H[:5]) and idx.worker_hashes(W)[HOST] == set(H[:5])
    assert [t for (slot, t) in idx._closure.loose if slot == idx._workers[W].slot] == []


def test_a_chain_stops_where_the_index_holds_it_and_is_not_guessed_past_what_it_knows(
        new_index: Callable[[], TieredIndex]) -> None:
    """A store under block 3 while blocks 0-1 are held on device again (re-announced after the loss): blocks 2-3
    are regained under them. A dropped block whose parent the index did not know at the loss (it held the block on
    disk alone, its parent removed from there) regains nothing: the chain above it would be a guess."""
    idx = held_then_lost(new_index, {DEV})
    idx.apply(W, stored(0, 2, None))
    idx.apply(W, stored(4, 2, H[3]))
    idx._check()
    assert idx.worker_hashes(W)[DEV] == set(H[:6]) and idx.stats(W).relearned == 2
    idx = new_index()
    idx.set_prefix_closed(W, {DEV})
    idx.apply(W, stored(0, 4, None, "DISK"))
    idx.apply(W, BlockRemoved(block_hashes=[H[0]], medium="DISK"))  # L3 drops pages one by one
    idx.clear_worker(W, partial=True)
    assert idx.apply(W, stored(4, 1, H[3])) is Outcome.APPLIED
    idx._check()
    assert idx.worker_hashes(W)[DEV] == {H[4]} and idx.stats(W).relearned == 0


def test_a_second_loss_keeps_the_parent_of_a_block_stored_under_one_dropped_at_the_first(
        new_index: Callable[[], TieredIndex]) -> None:
    """Blocks 0-3 dropped at a first loss, blocks 0-3 stored again on host, block 4 stored under block 3 on disk, then
    blocks 0-3 removed from host: block 4 is held with no parent held. A second loss drops block 4; a device store
    under it proves blocks 0-4 on device. The index saw block 4 stored under block 3, a block it remembers from the
    first loss, so it regains the whole chain (found by the slow profile of tests/test_partial_recovery.py)."""
    idx = held_then_lost(new_index, {DEV, HOST})
    idx.apply(W, stored(0, 4, None, "CPU_PINNED"))
    idx.apply(W, stored(4, 1, H[3], "DISK"))
    idx.apply(W, BlockRemoved(block_hashes=H[:4], medium="CPU_PINNED"))
    idx._check()
    assert idx.worker_hashes(W)[DISK] == {H[4]} and idx.worker_hashes(W)[HOST] == set()
    idx.clear_worker(W, partial=True)
    idx.apply(W, stored(5, 1, H[4]))
    idx._check()
    assert idx.worker_hashes(W)[DEV] == set(H[:6]) and idx.stats(W).relearned == 5
    assert idx.find_matches(TOKS).workers[W].device == 6


def test_a_snapshot_keeps_what_a_later_store_needs_to_regain_a_chain(new_index: Callable[[], TieredIndex]) -> None:
    """A router restarted from its snapshot between the loss and the store regains the same chain."""
    idx = held_then_lost(new_index, {DEV})
    again = TieredIndex.restore(idx.snapshot())
    again._check()
    assert again.prefix_closed(W) == {DEV} and again.prefix_closed(V) == set()
    for index in (idx, again):
        index.apply(W, stored(4, 1, H[3]))
        index._check()
        assert index.find_matches(TOKS).workers[W].device == 5


def test_what_is_remembered_of_dropped_blocks_is_bounded(new_index: Callable[[], TieredIndex],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Ghosts and their parents are kept up to a fixed number of entries, the oldest forgotten first: a chain whose
    link was forgotten regains nothing."""
    import kvtier.indexer.index.applier as applier_module
    import kvtier.indexer.index.tiered as index_module
    monkeypatch.setattr(index_module, "MAX_REMEMBERED", 3)
    monkeypatch.setattr(applier_module, "MAX_REMEMBERED", 3)
    idx = held_then_lost(new_index, {DEV})
    w = idx._workers[W]
    assert len(w.ghosts) == 3 and len(w.ups) == 3  # of the 4 blocks dropped
    idx.apply(W, stored(4, 1, H[3]))
    assert idx.worker_hashes(W)[DEV] == {H[4]}


def test_stores_under_a_prefix_held_again_remember_their_parents_in_bounded_room(
        new_index: Callable[[], TieredIndex], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every new conversation under a hot prefix dropped at a loss and stored again records its parent: on a busy
    partial worker that grew ``ups`` by one entry per conversation up to a million, pushing out what the loss had
    recorded, and on a worker declared nothing prefix-closed (vLLM), which never reads them. They are kept below a
    room of their own, never pushing a loss's entries out, and only where a store can prove a chain."""
    import kvtier.indexer.index.applier as applier_module

    monkeypatch.setattr(applier_module, "UPS_OF_HELD_AGAIN", 8)
    idx = held_then_lost(new_index, {DEV})
    for s in (W, V):
        idx.apply(s, stored(0, 4, None))  # held again
    w, v = idx._workers[W], idx._workers[V]
    at_loss = dict(w.ups)
    assert len(at_loss) == 4 and not v.ups
    for i in range(50):  # conversations under the prefix
        for s in (W, V):
            idx.apply(s, BlockStored(block_hashes=[10**9 + i], parent_block_hash=H[3], token_ids=[7 + i] * 4,
                                     block_size=4))
    assert len(w.ups) == 8 and at_loss.items() <= w.ups.items() and not v.ups
