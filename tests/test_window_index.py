"""Window KV in the index: announced by window events (tracked) or inferred from stores (engines that send
none, as SGLang), and the usable overlap a window-aware query answers."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from kvtier.indexer.index.keys import block_keys
from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.run import RunConfig, simulate
from kvtier.wire import BlockRemoved, BlockStored, StorageTier, WorkerId, window_group
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import window_cut

A, B = StreamId(WorkerId("a")), StreamId(WorkerId("b"))
BS = 4
WINDOW = 2 * BS  # two blocks
TOKS = list(range(500, 500 + 16 * BS))  # 16 blocks


def stored(first: int, last: int, medium: str = "GPU", toks: list[int] = TOKS, **group: object) -> BlockStored:
    """Blocks ``first..last-1`` of ``toks`` (engine hash = block number + 1), chained to block first-1."""
    return BlockStored(block_hashes=list(range(first + 1, last + 1)), parent_block_hash=first or None,
                       token_ids=toks[first * BS:last * BS], block_size=BS, medium=medium, **group)


def query(idx: TieredIndex, blocks: int, toks: list[int] = TOKS) -> dict[StreamId, tuple[int, int]]:
    """Per worker: (usable device, usable host) overlap of the first ``blocks`` blocks of ``toks``."""
    res = idx.find_matches_keys(block_keys(toks[:blocks * BS], BS), window_aware=True)
    return {s: (o.device, o.host) for s, o in res.workers.items()}


def test_inferred_window_sits_on_the_tail_of_each_chain_a_batch_stores() -> None:
    idx = TieredIndex(BS, window_tokens=WINDOW)
    # One batch stores a 10-block prompt as two events (a front and its last part, as SGLang's nodes):
    # only blocks 8 and 9 keep window KV.
    assert idx.apply_events(A, [stored(0, 6), stored(6, 10)]) == [Outcome.APPLIED] * 2
    assert query(idx, 10)[A] == (10, 10)
    assert query(idx, 7)[A] == (0, 0)  # a prefix ending mid-prompt: the window before it was freed
    raw = idx.find_matches_keys(block_keys(TOKS[:7 * BS], BS))
    assert raw.workers[A].device == 7  # the full-attention view still holds it
    # A later batch extends the prompt: the earlier tail keeps its window (cached blocks keep window KV).
    idx.apply_events(A, [stored(10, 14)])
    assert query(idx, 10)[A] == (10, 10) and query(idx, 14)[A] == (14, 14) and query(idx, 12)[A] == (10, 10)
    res = idx.find_matches_keys(block_keys(TOKS[:14 * BS], BS), window_aware=True)
    assert res.inferred == {A} and res.windows[A] == 2 and res.raw[A].device == 14
    assert res.as_dict()["window_inferred"] == ["a"]
    idx._check()


def test_inferred_window_per_tier_and_removal() -> None:
    idx = TieredIndex(BS, window_tokens=WINDOW)
    idx.apply_events(A, [stored(0, 8)])
    idx.apply_events(A, [stored(0, 4, "CPU_PINNED"), stored(4, 8, "CPU_PINNED")])  # backed up, then evicted
    idx.apply_events(A, [BlockRemoved(block_hashes=[5, 6, 7, 8], medium="GPU")])
    # Device holds 0..3 with no window at its end; host holds all 8 with the window on 6, 7.
    assert query(idx, 8)[A] == (0, 8)
    idx.apply_events(A, [BlockRemoved(block_hashes=[8], medium="CPU_PINNED")])
    assert query(idx, 8)[A] == (0, 0)  # the host tail lost block 7 and, with it, the only window
    idx._check()


def test_apply_one_by_one_continues_the_last_batch() -> None:
    idx = TieredIndex(BS, window_tokens=WINDOW)
    idx.apply(A, stored(0, 3))
    idx.apply(A, stored(3, 6))  # no batch boundary between them: one chain
    assert query(idx, 3)[A] == (0, 0) and query(idx, 6)[A] == (6, 6)


def test_window_events_switch_a_worker_to_tracked_and_drop_inferred_bits() -> None:
    idx = TieredIndex(BS, window_tokens=WINDOW)
    idx.apply_events(A, [stored(0, 8)])
    idx.apply_events(B, [stored(0, 8)])
    assert query(idx, 8) == {A: (8, 8), B: (8, 8)}
    # A announces window KV of blocks 2, 3 only (say its engine kept a shorter tail): from now on its events rule.
    win = window_group(WINDOW)
    assert idx.apply_events(A, [stored(2, 4, **win)]) == [Outcome.APPLIED]
    assert query(idx, 8)[A] == (4, 4)
    assert query(idx, 8)[B] == (8, 8)  # another worker's inference is untouched
    res = idx.find_matches_keys(block_keys(TOKS[:8 * BS], BS), window_aware=True)
    assert res.inferred == {B}
    idx.apply_events(A, [stored(8, 12)])  # tracked: stores carry no window by themselves
    assert query(idx, 12)[A] == (4, 4)
    idx.apply_events(A, [BlockRemoved(block_hashes=[3, 4], medium="GPU", **win)])
    assert query(idx, 12)[A] == (0, 0)
    idx._check()


def test_without_a_window_workers_stay_untracked() -> None:
    idx = TieredIndex(BS)
    idx.apply_events(A, [stored(0, 8)])
    res = idx.find_matches_keys(block_keys(TOKS[:5 * BS], BS), window_aware=True)
    assert res.workers[A].device == 5 and not res.windows and not res.inferred


def test_snapshot_keeps_inferred_windows() -> None:
    idx = TieredIndex(BS, window_tokens=WINDOW)
    idx.apply_events(A, [stored(0, 6), stored(6, 10)])
    idx.apply_events(B, [stored(0, 4), stored(2, 4, **window_group(WINDOW))])
    back = TieredIndex.restore(idx.snapshot())
    assert back.window_tokens == WINDOW
    assert query(back, 10) == query(idx, 10) == {A: (10, 10), B: (4, 4)}
    res = back.find_matches_keys(block_keys(TOKS[:10 * BS], BS), window_aware=True)
    assert res.inferred == {A}
    back._check()
    # A new worker of the restored index infers too.
    back.apply_events(StreamId(WorkerId("c")), [stored(0, 5)])
    assert query(back, 5)[StreamId(WorkerId("c"))] == (5, 5)


def test_tiers_beyond_host_need_no_window() -> None:
    idx = TieredIndex(BS, window_tokens=WINDOW)
    idx.apply_events(A, [stored(0, 8, "DISK")])
    assert idx.find_matches_keys(block_keys(TOKS[:5 * BS], BS), window_aware=True).workers[A].disk == 5
    assert idx.block_counts(A)[StorageTier.DISK] == 8


def test_note_routed_marks_a_window_the_engine_recomputes_without_a_store() -> None:
    idx = TieredIndex(BS, window_tokens=WINDOW)
    idx.apply_events(A, [stored(0, 10)])
    idx.apply_events(B, [stored(0, 10)])
    assert query(idx, 6) == {A: (0, 0), B: (0, 0)}
    # A prompt of 6 blocks goes to A: A recomputes its window (blocks 4, 5) onto blocks it holds, publishing
    # nothing; the router marks it from its own decision.
    idx.note_routed(A, block_keys(TOKS[:6 * BS], BS))
    assert query(idx, 6) == {A: (6, 6), B: (0, 0)}
    idx.note_routed(A, block_keys(TOKS[:12 * BS] + [1] * BS, BS))  # blocks A does not hold: left to stores
    assert query(idx, 13)[A] == (10, 10)
    idx._check()


def test_inferred_windows_agree_with_the_engines_in_a_simulated_cluster() -> None:
    """Device-only SWA engines that send no window events, with a window pool large enough to drop nothing:
    every admission's inferred usable overlap is the engine's (no over- or under-count)."""
    trace = generate(dataclasses.replace(PRESETS["chat"], requests=200, system_tokens=1024, user_tokens=600), 1)
    cluster = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=0.0, l3="none",
                            model="gpt-oss-20b", swa_ratio=0.8, swa_events=False)
    blind = simulate(trace, cluster, RunConfig("kv_swa")).summary
    assert blind.requests == 200 and blind.unfinished == 0
    assert blind.usable_mae_blocks == 0.0 and blind.overcount_blocks == 0.0
    raw = simulate(trace, cluster, RunConfig("kv_all")).summary
    assert raw.overcount_blocks > 1.0  # the full-attention view over-counts on the same cluster


@given(st.lists(st.booleans(), max_size=12), st.integers(0, 12), st.integers(0, 6))
def test_window_cut_is_its_definition(ok: list[bool], limit: int, window: int) -> None:
    """The longest reusable prefix of a sliding-window model: the largest cut ``c <= limit`` whose ``window`` blocks
    before it (fewer near the start: a prefix shorter than the window needs all of its own) have window KV. The
    engine and the index both call it, so only this test says what it returns."""
    limit = min(limit, len(ok))
    want = limit if window <= 0 else max(
        (c for c in range(limit + 1) if all(ok[max(0, c - window):c])), default=0)
    assert window_cut(ok, limit, window) == want


def test_window_cut_by_hand() -> None:
    t, f = True, False
    assert window_cut([t, t], 2, 4) == 2  # shorter than the window: all of it has window KV
    assert window_cut([t, t, t, f, t], 5, 4) == 3
    assert window_cut([t, f, t], 3, 4) == 1
    assert window_cut([f, t, t, t, t], 5, 4) == 5  # the window before the cut is whole again
    assert window_cut([t, t, t], 3, 0) == 3  # no window: every block is reusable


def test_an_announced_window_not_a_multiple_of_the_block_size_covers_the_partial_block() -> None:
    """A sliding window of 9 tokens over blocks of 4 spans 3 blocks: a prefix is usable only where its last 3
    blocks have window KV, not 2."""
    idx = TieredIndex(BS)
    idx.apply_events(A, [stored(0, 8)])
    idx.apply_events(A, [stored(6, 8, **window_group(WINDOW + 1))])
    assert query(idx, 8)[A][0] < 8  # block 5's window KV is missing
    idx.apply_events(A, [stored(5, 6, **window_group(WINDOW + 1))])
    assert query(idx, 8)[A][0] == 8
