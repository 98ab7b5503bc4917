"""Index snapshots (:mod:`kvtier.indexer.index.snapshot`): every part of the index comes back, a snapshot written by
the previous format (version 1) still restores, the bytes are canonical, and damaged snapshots are refused whole."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.indexer.index.keys import BlockKey, block_keys
from kvtier.indexer.index.masklayout import TIERS
from kvtier.indexer.index.snapshot import WorkerRecord
from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire import AllBlocksCleared, BlockRemoved, BlockStored, StorageTier, WorkerId, window_group
from kvtier.wire.notices import StreamId

BS = 4
TOKS = list(range(1000, 1000 + 64 * BS))
OTHER = list(range(5000, 5000 + 16 * BS))  # a second prompt
FORK = list(range(9000, 9000 + 8 * BS))  # a continuation of TOKS[:4 blocks] that branches off
V1 = Path(__file__).with_name("index_snapshot_v1.msgpack")  # written by the version-1 writer from varied_index()

S, S1, U, Y, G, ORPH, W, X = (StreamId(WorkerId(n), dp) for n, dp in
                            [("sglang", 0), ("sglang", 1), ("vllm", 0), ("bytes", 0), ("lost", 0), ("orphans", 0),
                             ("swa", 0), ("gone", 0)])
SIGNED = [-(1 << 62) - i for i in range(64)]  # SGLang-like engine hashes (int64)
UNSIGNED = [(1 << 63) + 7919 * i for i in range(64)]  # vLLM-like engine hashes (past 2**63)
BYTES = [bytes([i]) * 32 for i in range(64)]  # hashes that fit no table (kept in a dict)


def store(hashes: list[Any], first: int, n: int, parent: Any, medium: str = "GPU", toks: list[int] = TOKS,
          **group: Any) -> BlockStored:
    """Blocks ``first .. first + n - 1`` of ``toks``, named by ``hashes[first:first + n]``, under ``parent``."""
    return BlockStored(block_hashes=hashes[first:first + n], parent_block_hash=parent,
                       token_ids=toks[first * BS:(first + n) * BS], block_size=BS, medium=medium, **group)


def varied_index() -> TieredIndex:
    """An index holding one of everything a snapshot keeps: signed, unsigned and ``bytes`` engine hashes; every tier;
    a parent with a set of children; loose blocks (a middle block evicted); a worker lost for good (ghosts, and a
    store regaining what a later one proves held); held orphans; announced window KV; declared closed tiers; a data
    parallel rank; a freed slot."""
    idx = TieredIndex(BS)
    idx.add_worker(X)  # slot 0, freed below: the others' slots do not start at 0
    idx.set_prefix_closed(S, [StorageTier.DEVICE, StorageTier.HOST])
    ok = Outcome.APPLIED
    assert idx.apply(S, store(SIGNED, 0, 10, None)) is ok
    assert idx.apply(S, store(SIGNED, 0, 6, None, "CPU")) is ok
    assert idx.apply(S, store(SIGNED, 0, 3, None, "DISK")) is ok
    assert idx.apply(S, store(SIGNED, 0, 2, None, "EXTERNAL")) is ok
    fork = [-(1 << 61) - i for i in range(8)]
    assert idx.apply(S, store(fork, 4, 3, SIGNED[3], toks=TOKS[:4 * BS] + FORK)) is ok  # block 3 gets two children
    assert idx.apply(S1, store(SIGNED, 0, 5, None)) is ok
    assert idx.apply(U, store(UNSIGNED, 0, 8, None)) is ok
    assert idx.apply(U, store(UNSIGNED, 0, 4, None, "CPU")) is ok
    assert idx.apply(U, BlockRemoved(block_hashes=[UNSIGNED[2]], medium="GPU")) is ok  # blocks 3.. loose on device
    assert idx.apply(Y, store(BYTES, 0, 4, None, "CPU")) is ok
    idx.set_prefix_closed(G, [StorageTier.DEVICE])
    assert idx.apply(G, store(SIGNED, 0, 6, None)) is ok
    idx.clear_worker(G, partial=True)  # lost for good: ghosts
    assert idx.apply(G, store(SIGNED, 6, 2, SIGNED[5])) is ok  # regains blocks 0..5 (closed device)
    assert idx.apply(G, store(SIGNED, 0, 3, None, toks=OTHER)) is ok
    assert idx.apply(ORPH, store(UNSIGNED, 2, 3, UNSIGNED[1])) is Outcome.ORPHANED  # parent unknown: held
    assert idx.apply(ORPH, store(UNSIGNED, 5, 1, UNSIGNED[4], "CPU")) is Outcome.ORPHANED
    assert idx.apply(ORPH, store(UNSIGNED, 0, 1, None, toks=OTHER)) is ok
    assert idx.apply(W, store(SIGNED, 0, 6, None)) is ok
    assert idx.apply(W, store(SIGNED, 3, 3, SIGNED[2], **window_group(2 * BS))) is ok
    idx.remove_worker(X)
    idx._check()
    return idx


def describe(idx: TieredIndex) -> dict[Any, Any]:
    """Everything the index knows, by stream and block key (independent of slots and table layout)."""
    out: dict[Any, Any] = {"block_size": idx.block_size, "window_tokens": idx.window_tokens,
                           "closed": idx._closure.closed}
    for s in sorted(idx.streams):
        w = idx._workers[s]
        loose = [sorted(idx._closure.loose.get((w.slot, t), ())) for t in range(TIERS)]
        out[s] = {
            "hashes": sorted(w.hashes.items(), key=repr), "tiers": idx.worker_hashes(s),
            "windows": idx.window_hashes(s), "counts": list(w.counts), "partial": w.partial, "window": w.window,
            # (ghosts and their parents in order: the oldest are forgotten first)
            "inferred": w.inferred, "closed_tiers": w.closed_tiers, "ghosts": list(w.ghosts.items()),
            "ups": list(w.ups.items()), "orphans": w.orphans.dump(), "loose": loose,
            "unknown": w.slot in idx._closure.unknown, "signed": w.hashes.signed,
            "dict": w.hashes.py is not None,
        }
    held = {BlockKey(k) for k, _ in idx._masks.items()}
    out["links"] = sorted((p, sorted(c for c in idx._closure.children(p) if c in held)) for p in idx._closure.kids)
    out["links"] = [(p, c) for p, c in out["links"] if c]
    for toks in (TOKS, OTHER, TOKS[:4 * BS] + FORK):
        out[("query", toks[0])] = idx.find_matches_keys(block_keys(toks, BS), window_aware=True)
    return out


def later(idx: TieredIndex) -> TieredIndex:
    """What happens after a restart: the orphans' parent comes, a store extends a ghost, a parent is removed."""
    assert idx.apply(ORPH, store(UNSIGNED, 0, 2, None)) is Outcome.APPLIED  # grafts the held runs
    assert idx.apply(S, BlockRemoved(block_hashes=[SIGNED[3]], medium="GPU")) is Outcome.APPLIED
    assert idx.apply(U, store(UNSIGNED, 2, 1, UNSIGNED[1])) is Outcome.APPLIED  # no block is loose again
    assert idx.apply(Y, AllBlocksCleared()) is Outcome.APPLIED
    idx._check()
    return idx


def test_a_snapshot_restores_every_part_of_the_index() -> None:
    idx = varied_index()
    back = TieredIndex.restore(idx.snapshot())
    back._check()
    assert describe(back) == describe(idx)
    assert describe(later(back)) == describe(later(idx))


def test_a_snapshot_written_by_the_version_1_writer_restores() -> None:
    """An upgraded service restores the snapshot the previous version wrote (the file was written from
    :func:`varied_index` by that version's ``TieredIndex.snapshot``)."""
    old = TieredIndex.restore(V1.read_bytes())
    old._check()
    idx = varied_index()
    assert describe(old) == describe(idx)
    assert describe(later(old)) == describe(later(idx))


def test_a_restored_index_forgets_the_oldest_blocks_remembered_from_a_loss_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocks remembered from losses (ghosts, and their parents) are forgotten oldest first; a snapshot wrote
    them sorted, so a restored index forgot the newest instead."""
    from kvtier.indexer.index import snapshot, tiered

    monkeypatch.setattr(tiered, "MAX_REMEMBERED", 4)
    monkeypatch.setattr(snapshot, "MAX_REMEMBERED", 4)
    idx = TieredIndex(BS)
    for hashes, toks in (([200, 300], TOKS[:8]), ([10, 11], OTHER[:8])):  # two losses, the older ghosts sort last
        assert idx.apply(S, BlockStored(block_hashes=hashes, token_ids=toks, block_size=BS)) is Outcome.APPLIED
        idx.clear_worker(S, partial=True)
    assert idx.apply(S, BlockStored(block_hashes=[7], token_ids=FORK[:4], block_size=BS)) is Outcome.APPLIED
    back = TieredIndex.restore(idx.snapshot())
    for x in (idx, back):
        x.clear_worker(S, partial=True)  # one more: the oldest goes
    assert list(back._workers[S].ghosts) == list(idx._workers[S].ghosts)
    assert set(idx._workers[S].ghosts) == {300, 10, 11, 7}  # (200, the oldest, went)


def test_snapshot_bytes_are_canonical() -> None:
    """The same index writes the same bytes, however its tables' rows happen to lie (restored, or grown
    otherwise): a snapshot can be compared and deduplicated by its bytes."""
    n = 3000
    toks = list(range(n * BS))
    idx = TieredIndex(BS)
    for lo in range(0, n, 500):
        parent = UNSIGNED[0] + 7919 * (lo - 1) if lo else None
        hashes = [UNSIGNED[0] + 7919 * i for i in range(lo, lo + 500)]
        assert idx.apply(U, BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                        token_ids=toks[lo * BS:(lo + 500) * BS], block_size=BS)) is Outcome.APPLIED
    idx.apply(S, store(SIGNED, 0, 10, None, "CPU"))
    data = idx.snapshot()
    back = TieredIndex.restore(data)
    assert back.snapshot() == data
    assert TieredIndex.restore(back.snapshot()).find_matches(toks) == idx.find_matches(toks)


@pytest.mark.parametrize("kept", [[7], [7, -3], [7, 1 << 63], []])
def test_snapshot_bytes_are_canonical_for_hashes_once_moved_to_a_dict(kept: list[int]) -> None:
    """A worker's hashes move to a dict for good when one fits no table (a bytes hash); once that one is gone, a
    restore puts those left back in a table, which wrote them packed where the dict wrote a list: the same index,
    other bytes."""
    idx = TieredIndex(BS)
    assert idx.apply(S, BlockStored(block_hashes=[b"h" * 32], parent_block_hash=None, token_ids=TOKS[:BS],
                                    block_size=BS)) is Outcome.APPLIED
    for i, eh in enumerate(kept):
        assert idx.apply(S, BlockStored(block_hashes=[eh], parent_block_hash=None, token_ids=OTHER[i * BS:(i + 1) * BS],
                                        block_size=BS)) is Outcome.APPLIED
    idx.apply(S, BlockRemoved(block_hashes=[b"h" * 32]))
    assert idx._workers[S].hashes.py is not None  # (in a dict)
    data = idx.snapshot()
    back = TieredIndex.restore(data)
    back._check()
    layout = ("dict", "signed")  # (where the hashes live, and their signedness where a dict holds them)
    assert ({k: v for k, v in describe(back)[S].items() if k not in layout}
            == {k: v for k, v in describe(idx)[S].items() if k not in layout})
    assert back.snapshot() == data


def test_snapshot_bytes_are_canonical_whatever_hashes_went_before() -> None:
    """A table kept its signedness after the negative hash that set it went, where a dict's export finds it from the
    hashes held: the same hashes, other bytes, depending on whether they once moved to a dict."""
    def held_7(detour: bool) -> bytes:
        idx = TieredIndex(BS)
        idx.apply(S, BlockStored(block_hashes=[-3], parent_block_hash=None, token_ids=TOKS[:BS], block_size=BS))
        if detour:  # (a bytes hash moves the worker's hashes to a dict for good)
            idx.apply(S, BlockStored(block_hashes=[b"h" * 32], parent_block_hash=None, token_ids=OTHER[:BS],
                                     block_size=BS))
        idx.apply(S, BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=FORK[:BS], block_size=BS))
        idx.apply(S, BlockRemoved(block_hashes=[-3]))
        if detour:
            idx.apply(S, BlockRemoved(block_hashes=[b"h" * 32]))
        return idx.snapshot()

    assert held_7(False) == held_7(True)
    assert TieredIndex.restore(held_7(False)).snapshot() == held_7(False)


def _record(**change: Any) -> bytes:
    """A snapshot of one worker holding blocks 1 and 2 (engine hashes 7 and 8) with ``change`` made to its record."""
    keys = np.array([1, 2], "<u8").tobytes()
    rec = {"worker": "a", "dp_rank": 0, "partial": False, "keys": keys, "bits": bytes([1, 3]),
           "hashes": np.array([7, 8], "<u8").tobytes(), "signed": None, "window": 0, "inferred": False,
           "window_bits": [], "loose": [[], [2], [], []], "ghosts": [], "orphans": [], "closed_tiers": 0, "ups": []}
    rec.update(change)
    return msgspec.msgpack.encode({"version": 2, "block_size": 4, "window_tokens": 0, "workers": [rec],
                                   "links": np.array([1, 2], "<u8").tobytes()})


def test_the_record_used_for_damage_is_sound() -> None:
    idx = TieredIndex.restore(_record())
    idx._check()
    assert idx.worker_hashes(StreamId(WorkerId("a"))) == {StorageTier.DEVICE: {7, 8}, StorageTier.HOST: {8},
                                                           StorageTier.DISK: set(), StorageTier.EXTERNAL: set()}


@pytest.mark.parametrize("change", [
    {"keys": b"\x01" * 12},  # not whole keys
    {"bits": bytes([1])},  # fewer tier bits than keys
    {"bits": bytes([1, 0])},  # a block held on no tier
    {"bits": bytes([1, 16])},  # bits past the worker's own slot
    {"keys": np.array([1, 1], "<u8").tobytes()},  # one block twice
    {"hashes": np.array([7, 7], "<u8").tobytes()},  # one engine hash for two blocks
    {"hashes": np.array([7], "<u8").tobytes()},  # fewer engine hashes than blocks
    {"hashes": [7, 7]},  # as a list, one engine hash twice
    {"hashes": [7]},
    {"signed": None, "hashes": np.array([7, 1 << 63], "<u8").tobytes()},  # hashes past 2**63 said to be signed-less
    {"loose": [[], [2]]},  # loose blocks of fewer tiers
    {"loose": [[], [1], [], []]},  # a loose block the worker does not hold there
    {"dp_rank": -1},
    {"worker": 5},
    {"ghosts": [[7, -1]]},  # a remembered block outside the key space (a later store under 7 failed midway)
    {"inferred": True},  # window KV inferred without a window
])
def test_a_damaged_snapshot_is_refused_whole(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="not an index snapshot"):
        TieredIndex.restore(_record(**change))


def _orphan(block_size: int = 4, tokens: int = 8, parent: int = 10) -> list[Any]:
    """A held orphan run of two blocks (engine hashes 11 and 12, under ``parent``), as a snapshot records it."""
    store = BlockStored(block_hashes=[11, 12], parent_block_hash=parent, token_ids=list(range(100, 100 + tokens)),
                        block_size=block_size)
    return [msgspec.msgpack.encode(store), int(StorageTier.DEVICE), [True, True], None]


def test_a_held_orphan_run_restores_and_grafts_under_its_parent() -> None:
    idx = TieredIndex.restore(_record(orphans=[_orphan()]))
    a = StreamId(WorkerId("a"))
    assert idx.apply(a, BlockStored(block_hashes=[10], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                                    block_size=4)) is Outcome.APPLIED
    idx._check()
    assert idx.worker_hashes(a)[StorageTier.DEVICE] == {7, 8, 10, 11, 12}
    assert idx.find_matches([1, 2, 3, 4, *range(100, 108)]).workers[a].device == 3


@pytest.mark.parametrize("run", [
    _orphan(tokens=4),  # token ids of one block for two
    _orphan(block_size=2, tokens=4),  # blocks of another size than the index's: keys no query could match
    _orphan(parent=12),  # under one of its own blocks
])
def test_a_held_orphan_run_no_store_could_make_is_refused(run: list[Any]) -> None:
    """Restore checked a held run's flags and key scopes, not what a store is checked for before it is held: the
    parent's store then was reported rejected although applied, the run lost (token ids out of step), or the run
    was indexed under keys no query can match (blocks of another size)."""
    with pytest.raises(ValueError, match="not an index snapshot: a held orphan run no store could make"):
        TieredIndex.restore(_record(orphans=[run]))


def test_msgpack_nested_past_the_decoders_depth_is_refused() -> None:
    for data in (b"\x81\xa7version" + b"\x91" * 200_000 + b"\x02",
                 b"\x84\xa7version\x01\xaablock_size\x04\xa7workers\x90\xa5links" + b"\x91" * 200_000 + b"\x90"):
        with pytest.raises(ValueError, match="not an index snapshot"):
            TieredIndex.restore(data)


def test_damaged_links_are_refused() -> None:
    for links in (b"\x01" * 12, np.array([1], "<u8").tobytes()):  # not whole keys; a parent without its child
        data = msgspec.msgpack.decode(_record())
        data["links"] = links
        with pytest.raises(ValueError, match="not an index snapshot"):
            TieredIndex.restore(msgspec.msgpack.encode(data))


_SNAPSHOT = varied_index().snapshot()
_FIELDS = msgspec.structs.fields(WorkerRecord)
_ANY = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=24)
                    | st.text(max_size=4), lambda inner: st.lists(inner, max_size=4), max_leaves=8)


@given(worker=st.integers(0, 7), field=st.sampled_from([f.name for f in _FIELDS]), value=_ANY)
def test_a_snapshot_with_any_field_of_a_worker_replaced_restores_sound_or_is_refused(worker: int, field: str,
                                                                                    value: Any) -> None:
    """Whatever a damaged or hostile file holds in a worker's record, a restore raises ``ValueError`` or gives an index
    whose every invariant holds: never another exception, never an index that breaks later."""
    obj = msgspec.msgpack.decode(_SNAPSHOT)
    obj["workers"][worker % len(obj["workers"])][field] = value
    _restored_sound_or_refused(msgspec.msgpack.encode(obj))


@given(field=st.sampled_from(["version", "block_size", "window_tokens", "workers", "links"]), value=_ANY)
def test_a_snapshot_with_any_top_field_replaced_restores_sound_or_is_refused(field: str, value: Any) -> None:
    obj = msgspec.msgpack.decode(_SNAPSHOT)
    obj[field] = value
    _restored_sound_or_refused(msgspec.msgpack.encode(obj))


@given(flips=st.lists(st.tuples(st.integers(0, len(_SNAPSHOT) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_a_snapshot_with_bytes_changed_restores_sound_or_is_refused(flips: list[tuple[int, int]]) -> None:
    data = bytearray(_SNAPSHOT)
    for at, byte in flips:
        data[at] = byte
    _restored_sound_or_refused(bytes(data))


def test_a_small_snapshot_restores_in_memory_of_its_size() -> None:
    """4,096 workers holding nothing and 100,000 links, a 2 MB file: the restore widened every mask to 256 words
    and compared a child's mask with its parent's per link, 426 MB at its peak."""
    rec = msgspec.msgpack.decode(msgspec.msgpack.encode(WorkerRecord(
        worker="", dp_rank=0, partial=False, keys=b"", bits=b"", hashes=b"", signed=None, window=0, inferred=False,
        window_bits=[], loose=None, ghosts=[], orphans=[], closed_tiers=0, ups=[])))
    data = msgspec.msgpack.encode({"version": 2, "block_size": BS, "window_tokens": 0,
                                   "workers": [{**rec, "worker": f"w{i}"} for i in range(4096)],
                                   "links": np.arange(1, 200_001, dtype="<u8").tobytes()})
    tracemalloc.start()
    try:
        idx = TieredIndex.restore(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(idx.streams) == 4096 and idx._masks.words == 1
    assert peak < 16 * len(data), f"{peak / 1e6:.0f} MB to restore {len(data) / 1e6:.1f} MB"


def _restored_sound_or_refused(data: bytes) -> None:
    try:
        idx = TieredIndex.restore(data)
    except ValueError as exc:
        assert str(exc).startswith("not an index snapshot: "), exc
        return
    idx._check()
    idx.find_matches(TOKS)
    again = TieredIndex.restore(idx.snapshot())  # (the bytes may differ: a damaged set of children can name the dead)
    assert describe(again) == describe(idx)
