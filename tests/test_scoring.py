"""Cost models, load bookkeeping and the router."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.hardware.latency import PRESETS, MockerLatency, TransferModel
from kvtier.indexer.index.keys import block_keys
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.routing.load import LoadTracker, WorkerLoad
from kvtier.indexer.routing.router import Router
from kvtier.indexer.routing.scoring import CreditCost, DynamoCost, TierCredits, TtftCost, visible
from kvtier.wire import BlockStored, StorageTier, WorkerId
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import TierOverlap

A, B = StreamId(WorkerId("a")), StreamId(WorkerId("b"))


def test_mocker_latency_matches_published_fit() -> None:
    m = MockerLatency()
    assert m.prefill_ms(1000) == pytest.approx(4.209989e-7 * 1e6 + 15.18344 + 16.50142)
    assert m.prefill_ms(0) == 0.0
    assert m.decode_ms(0.0) == pytest.approx(5.74)
    assert m.decode_ms(0.5) == pytest.approx(-25.74 / 4 + 54.01 / 2 + 5.74)


def test_llama_8b_is_128_kib_per_token() -> None:
    assert PRESETS["llama-3.1-8b"].bytes_per_token == 128 * 1024


def test_visible_collapses_hidden_tiers() -> None:
    o = TierOverlap(1, 3, 5, 8)
    assert visible(o, StorageTier.DEVICE) == TierOverlap(1, 1, 1, 1)
    assert visible(o, StorageTier.HOST) == TierOverlap(1, 3, 3, 3)
    assert visible(o, StorageTier.EXTERNAL) == o


def test_credit_cost_prefers_cheaper_tiers_and_counts_load() -> None:
    cc = CreditCost()
    idle = WorkerLoad()
    on_device = cc.cost(160, 16, TierOverlap(10, 10, 10, 10), idle)
    on_host = cc.cost(160, 16, TierOverlap(0, 10, 10, 10), idle)
    on_disk = cc.cost(160, 16, TierOverlap(0, 0, 10, 10), idle)
    nothing = cc.cost(160, 16, TierOverlap(0, 0, 0, 0), idle)
    assert on_device < on_host < on_disk < nothing
    assert nothing - on_device == pytest.approx(10.0)
    assert on_host - on_device == pytest.approx(2.5)
    busy = WorkerLoad(running=2, active_blocks=40, pending_prefill_tokens=320)
    assert cc.cost(160, 16, TierOverlap(10, 10, 10, 10), busy) == pytest.approx(on_device + 40 + 20)
    assert TierCredits(host=0.5).credited_blocks(TierOverlap(2, 6, 6, 6)) == pytest.approx(4.0)


def test_kv_device_view_ignores_host_hits() -> None:
    dev_only = CreditCost(max_tier=StorageTier.DEVICE)
    assert dev_only.cost(160, 16, TierOverlap(0, 10, 10, 10), WorkerLoad()) == \
        dev_only.cost(160, 16, TierOverlap(0, 0, 0, 0), WorkerLoad())


def test_ttft_cost_adds_queue_transfer_and_prefill() -> None:
    t = TransferModel(bytes_per_token=128 * 1024, host_to_device_gbps=20.0)
    m = TtftCost(t)
    lat = MockerLatency()
    got = m.cost(1600, 16, TierOverlap(50, 80, 80, 80), WorkerLoad(pending_prefill_tokens=500))
    # the queued 500 tokens and the uncached 320 share one chunked-prefill iteration
    want = lat.prefill_ms(500 + 1600 - 80 * 16) + 30 * 16 * 128 * 1024 / 20e6
    assert got == pytest.approx(want)
    # Loading from host beats recomputing when the link is fast.
    assert m.cost(1600, 16, TierOverlap(0, 100, 100, 100), WorkerLoad()) < \
        m.cost(1600, 16, TierOverlap(0, 0, 0, 0), WorkerLoad())


def test_load_tracker_bookkeeping() -> None:
    lt = LoadTracker(block_size=4)
    lt.add("r1", A, keys=[1, 2], prompt_tokens=10, prefill_tokens=100)  # 2 full blocks + a partial one
    lt.add("r2", A, keys=[5], prompt_tokens=4, prefill_tokens=50)
    with pytest.raises(ValueError, match="r1"):
        lt.add("r1", B, [9], 4, 1)
    assert lt.load(A) == WorkerLoad(2, 4, 150, prefilling=2, context_tokens=14, routed_prefill_tokens=150)
    lt.prefill_done("r1")
    lt.prefill_done("r1")
    assert lt.load(A).pending_prefill_tokens == 50 and lt.load(A).prefilling == 1
    lt.finish("r2")
    lt.finish("nope")
    lt._check()
    assert lt.load(A) == WorkerLoad(1, 3, 0, context_tokens=10, routed_prefill_tokens=100)
    assert lt.load(B) == WorkerLoad()


def test_load_counts_a_shared_prefix_once_and_grows_with_decode() -> None:
    lt = LoadTracker(block_size=4)
    lt.add("r1", A, keys=[1, 2, 3], prompt_tokens=12, prefill_tokens=12)
    lt.add("r2", A, keys=[1, 2, 7], prompt_tokens=12, prefill_tokens=4)  # shares blocks 1, 2 with r1
    assert lt.load(A).active_blocks == 4  # 1, 2, 3, 7: the engine holds the shared prefix once
    assert lt.shared_blocks(A, [1, 2, 9]) == 2 and lt.shared_blocks(B, [1]) == 0
    lt.progress("r1", 5)  # 12 + 5 tokens = 5 blocks: two generated blocks
    assert (lt.load(A).active_blocks, lt.load(A).generated_blocks) == (6, 2)
    lt.progress("r1", 8)  # still 5 blocks
    assert lt.load(A).active_blocks == 6
    lt._check()
    lt.finish("r1")
    assert (lt.load(A).active_blocks, lt.load(A).generated_blocks) == (3, 0)  # 1, 2, 7 stay for r2
    lt.finish("r2")
    lt._check()
    assert lt.load(A) == WorkerLoad()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 50), min_size=4, max_size=4), st.sampled_from(list(StorageTier)),
       st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_visible_credit_is_the_credit_of_the_visible_overlap(counts: list[int], max_tier: StorageTier, dev: float,
                                                             host: float, disk: float, ext: float) -> None:
    """The routing loop's shortcut gives exactly (==, not approximately) the float of the two-step form."""
    d, h, k, e = sorted(counts)
    o = TierOverlap(d, h, k, e)
    credits = TierCredits(dev, host, disk, ext)
    assert credits.visible_credit(o, max_tier) == credits.credited_blocks(visible(o, max_tier))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.integers(0, 60), min_size=4, max_size=4), st.integers(0, 40),
                          st.integers(0, 9000), st.integers(0, 20), st.integers(0, 30)), min_size=1, max_size=6),
       st.integers(1, 5000), st.sampled_from(list(StorageTier)), st.floats(0, 1), st.floats(0, 4))
def test_batch_costs_are_the_floats_of_cost_one_worker_at_a_time(
        workers: list[tuple[list[int], int, int, int, int]], num_tokens: int, max_tier: StorageTier, host: float,
        weight: float) -> None:
    """The router prices every candidate in one ``costs`` call; a change there must not move a single decision, so
    each value equals (==) what ``cost`` gives for that worker alone."""
    overlaps = [TierOverlap(*sorted(c)) for c, *_ in workers]
    loads = [WorkerLoad(running=3, active_blocks=a, pending_prefill_tokens=p, generated_blocks=min(g, a))
             for _, a, p, g, _ in workers]
    shared = [n for *_, n in workers]
    credits = TierCredits(host=host)
    for model in (CreditCost(credits, weight, max_tier), DynamoCost(credits, weight, max_tier)):
        one_by_one = [model.cost(num_tokens, 16, o, load, n, 7.0)
                      for o, load, n in zip(overlaps, loads, shared, strict=True)]
        assert model.costs(num_tokens, 16, overlaps, loads, shared, 7.0) == one_by_one


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=12), min_size=1, max_size=8),
       st.lists(st.integers(0, 2), max_size=14), st.data())
def test_shared_blocks_search_equals_a_scan_of_chained_keys(prompts: list[list[int]], query: list[int],
                                                           data: st.DataObject) -> None:
    """The binary search in load_and_shared relies on chained keys: a held key's whole prefix is held.
    Against a block-by-block scan, with prompts that share prefixes and some finished."""
    def chained(tokens: list[int]) -> list[int]:
        return block_keys(tokens, 1)

    lt = LoadTracker(block_size=1)
    for i, p in enumerate(prompts):
        lt.add(f"r{i}", A, chained(p), len(p), len(p))
    for i in data.draw(st.sets(st.integers(0, len(prompts) - 1))):
        lt.finish(f"r{i}")
    held = {k for p in [prompts[i] for i in range(len(prompts)) if f"r{i}" in lt._inflight] for k in chained(p)}
    keys = chained(query)
    scan = next((n for n, k in enumerate(keys) if k not in held), len(keys))
    assert lt.shared_blocks(A, keys) == scan
    assert lt.load_and_shared(A, keys) == (lt.load(A), scan)
    assert lt.loads_and_shared([B, A], keys) == ([lt.load(B), lt.load(A)], [0, scan])  # B: never routed to


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=8), st.integers(0, 2), st.booleans()), max_size=25))
def test_reference_counts_move_in_bulk_exactly_as_one_at_a_time(steps: list[tuple[list[int], int, bool]]) -> None:
    """add and finish move a prompt's counts in bulk where its keys are distinct (chained keys always are),
    one at a time where a key repeats; either way the counts are what _check recounts from the requests."""
    lt = LoadTracker(block_size=4)
    workers, live = [A, B, StreamId(WorkerId("c"))], []
    for i, (keys, w, done) in enumerate(steps):
        lt.add(f"r{i}", workers[w], keys, 4 * len(keys) + 1, 4)
        live.append(f"r{i}")
        if done and live:
            lt.finish(live.pop(len(live) // 2), generated=3)
        lt._check()
    for rid in live:
        lt.finish(rid)
        lt._check()
    assert all(lt.load(w) == WorkerLoad() for w in workers)


def test_load_tracks_context_read_by_decode_and_output_engines_reserve() -> None:
    lt = LoadTracker(block_size=4)
    lt.add("r1", A, keys=[1, 2, 3], prompt_tokens=12, prefill_tokens=12)
    assert lt.expected_output == 0 and lt.load(A).unwritten_tokens == 0  # nothing learned yet
    lt.finish("r1", 40)  # the first finished output sets the estimate
    assert lt.expected_output == 40
    lt.add("r2", A, keys=[1, 2, 3], prompt_tokens=12, prefill_tokens=0)
    lt.add("r3", A, keys=[1, 2, 7], prompt_tokens=12, prefill_tokens=4)
    ld = lt.load(A)
    # decode reads the shared prefix once per request; memory holds it once
    assert (ld.context_tokens, ld.active_blocks, ld.unwritten_tokens) == (24, 4, 80)
    lt.progress("r2", 10)
    assert (lt.load(A).context_tokens, lt.load(A).unwritten_tokens) == (34, 70)
    lt.progress("r2", 50)  # past the estimate: nothing left to reserve for it
    assert (lt.load(A).context_tokens, lt.load(A).unwritten_tokens) == (74, 40)
    lt._check()
    lt.finish("r2", 56)
    assert lt.expected_output == pytest.approx(40 + (56 - 40) / 32)
    lt.finish("r3")  # length unknown: the estimate stays
    assert lt.expected_output == pytest.approx(40.5) and lt.load(A) == WorkerLoad()
    lt._check()


def test_load_keeps_the_uncached_tokens_routed_until_each_request_finishes() -> None:
    """The goodput policy's TPOT estimate needs the prefill passes a worker's streams share their decode steps with:
    the uncached tokens its in-flight requests brought stay counted past their first token (when the pending prefill
    drops them), until they finish."""
    lt = LoadTracker(block_size=4)
    lt.add("r1", A, keys=[1, 2, 3], prompt_tokens=12, prefill_tokens=12)
    lt.add("r2", A, keys=[1, 2, 3, 4], prompt_tokens=17, prefill_tokens=5)
    lt.add("r3", B, keys=[9], prompt_tokens=4, prefill_tokens=4)
    assert (lt.load(A).routed_prefill_tokens, lt.load(B).routed_prefill_tokens) == (17, 4)
    lt.prefill_done("r1")
    assert (lt.load(A).pending_prefill_tokens, lt.load(A).routed_prefill_tokens) == (5, 17)
    lt._check()
    lt.finish("r1", 30)
    assert lt.load(A).routed_prefill_tokens == 5
    lt.finish("r2")
    lt.finish("r3", 2)
    assert lt.load(A) == WorkerLoad() and lt.load(B) == WorkerLoad()
    lt._check()


def test_ttft_cost_weights_decode_steps_and_prices_reserved_output() -> None:
    lat = MockerLatency()
    m = TtftCost(TransferModel(131072), capacity_tokens=10_000, decode_weight=7.0)
    busy = WorkerLoad(running=3, active_blocks=30, prefilling=1, pending_prefill_tokens=100, context_tokens=4000)
    step = lat.decode_ms(4000 / 10_000)
    got = m.cost(600, 10, TierOverlap(50, 50, 50, 50), busy)
    assert got == pytest.approx(lat.prefill_ms(100 + 100) + 7 * step)  # one iteration, its step counted 7 times
    # The memory projection adds the output in-flight requests still reserve and this request's own, and
    # uses memory_headroom (0.9) once an output length is known, blind_headroom (0.7) before.
    full = WorkerLoad(running=3, active_blocks=700, prefilling=1, unwritten_tokens=1500, context_tokens=4000)
    known = m.cost(600, 10, TierOverlap(0, 0, 0, 0), full, output_tokens=400)
    assert known == pytest.approx(lat.prefill_ms(600) + 7 * step + (9500 / 10_000 - 0.9) * 10_000)
    blind = m.cost(600, 10, TierOverlap(0, 0, 0, 0), full)
    assert blind == pytest.approx(lat.prefill_ms(600) + 7 * step + (9100 / 10_000 - 0.7) * 10_000)


def test_min_ttft_leaves_a_worker_whose_decode_batch_would_slow_the_session() -> None:
    # Worker A holds the request's 40-block prefix but decodes a large batch; B is idle and cold. The
    # request's own TTFT is lower on A (a 160-token prefill and one decode step against 4,160 tokens), so a
    # cost that counts the step once sends it there; weighted as the decode load is paid (by the session's
    # later turns and those queued behind), B wins.
    lat = MockerLatency()
    a = WorkerLoad(running=40, active_blocks=400, context_tokens=150_000)
    once = TtftCost(TransferModel(131072), capacity_tokens=262_144, decode_weight=1.0)
    weighted = TtftCost(TransferModel(131072), capacity_tokens=262_144)
    on_a, on_b = TierOverlap(40, 40, 40, 40), TierOverlap(0, 0, 0, 0)
    step = lat.decode_ms(150_000 / 262_144)
    assert once.cost(4160, 100, on_a, a) == pytest.approx(lat.prefill_ms(160) + step)
    assert once.cost(4160, 100, on_a, a) < once.cost(4160, 100, on_b, WorkerLoad())
    assert weighted.cost(4160, 100, on_a, a) == pytest.approx(lat.prefill_ms(160) + 7 * step)
    assert weighted.cost(4160, 100, on_a, a) > weighted.cost(4160, 100, on_b, WorkerLoad()) == \
        pytest.approx(lat.prefill_ms(4160))


def test_dynamo_cost_terms_by_hand() -> None:
    # 10 blocks of prompt; worker holds 4 on device and 2 more on host; 8 blocks of prompt queued there;
    # 20 active blocks of which 6 were generated (not tracked by Dynamo) and 3 shared with this prompt.
    cost = DynamoCost().cost(40, 4, TierOverlap(4, 6, 6, 6), WorkerLoad(3, 20, 32, 1, generated_blocks=6), 3)
    prefill = max(8 + 10 - (4 * 1.0 + 2 * 0.75), 0)  # 12.5
    decode = (20 - 6) + 10 - 3  # 21
    assert cost == pytest.approx(prefill + decode)
    # Credit can exceed the raw prefill work only down to zero.
    assert DynamoCost(prefill_load_scale=2.0).cost(8, 4, TierOverlap(2, 2, 2, 2), WorkerLoad()) == pytest.approx(2)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.lists(st.one_of(st.integers(0, 5), st.sampled_from(["x", "y"])), max_size=6),
                          st.integers(0, 1), st.booleans()), max_size=25))
def test_counts_move_from_the_compiled_table_to_a_dict_at_the_first_key_it_cannot_hold(
        steps: list[tuple[list[int | str], int, bool]]) -> None:
    """Int keys are counted in a compiled table (kvtier.indexer.index.keyrefs); the first other key moves that worker's
    counts, and its in-flight requests, to a dict. Either way the counts are what _check recounts, and every
    request finishes back to zero."""
    lt = LoadTracker(block_size=4)
    workers, live = [A, B], []
    for i, (keys, w, done) in enumerate(steps):
        lt.add(f"r{i}", workers[w], keys, 4 * len(keys) + 1, 4)
        live.append(f"r{i}")
        assert lt.shared_blocks(workers[w], keys[:1]) == (1 if keys else 0)
        one_by_one = [lt.load_and_shared(x, keys) for x in workers]  # a dict worker beside a compiled one
        assert lt.loads_and_shared(workers, keys) == ([x for x, _ in one_by_one], [n for _, n in one_by_one])
        if done and live:
            lt.finish(live.pop(0), generated=3)
        lt._check()
    for rid in live:
        lt.finish(rid)
        lt._check()
    assert all(lt.load(w) == WorkerLoad() for w in workers)


def test_dynamo_policy_decides_as_computed_by_hand() -> None:
    # a: prompt cached on device, but busy; b: idle and cold. Dynamo's cost weighs both.
    idx = TieredIndex(4)
    toks = list(range(16))
    idx.apply(A, BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=toks, block_size=4))
    idx.add_worker(B)
    lt = LoadTracker(block_size=4)
    router = Router(idx, DynamoCost(), loads=lt, workers=[A, B])
    assert router.route(toks).worker == A  # a: 0 prefill + 4 decode = 4; b: 4 prefill + 4 decode = 8
    lt.add("busy", A, keys=[f"x{i}" for i in range(5)], prompt_tokens=20, prefill_tokens=20)
    d = router.route(toks)
    assert d.costs == {A: pytest.approx(5 + 9), B: pytest.approx(4 + 4)} and d.worker == B


def _index() -> TieredIndex:
    idx = TieredIndex(4)
    toks = list(range(16))
    idx.apply(A, BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks[:8], block_size=4))
    idx.apply(B, BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=toks,
                             block_size=4, medium="CPU"))
    return idx


def test_router_picks_lowest_cost_and_breaks_ties_fairly() -> None:
    idx = _index()
    toks = list(range(16))
    assert Router(idx, CreditCost()).route(toks).worker == B  # 4 host blocks (3.0) > 2 device (2.0)
    assert Router(idx, CreditCost(max_tier=StorageTier.DEVICE)).route(toks).worker == A
    fresh = [StreamId(WorkerId(f"w{i}")) for i in range(4)]
    picks = [Router(idx, CreditCost(), workers=fresh, seed=s).route(toks).worker for s in range(200)]
    assert picks == [Router(idx, CreditCost(), workers=fresh, seed=s).route(toks).worker for s in range(200)]
    counts = [picks.count(w) for w in fresh]
    assert min(counts) > 30, f"ties must be spread over every tied worker, got {counts}"


def test_router_temperature_sampling_is_seeded() -> None:
    idx = _index()
    toks = list(range(16))
    picks = [Router(idx, CreditCost(), temperature=1.0, seed=s).route(toks).worker for s in range(40)]
    again = [Router(idx, CreditCost(), temperature=1.0, seed=s).route(toks).worker for s in range(40)]
    assert picks == again and set(picks) == {A, B}
    with pytest.raises(ValueError, match="temperature"):
        Router(idx, CreditCost(), temperature=-1)


def test_router_with_no_workers_says_so() -> None:
    with pytest.raises(LookupError, match="no workers"):
        Router(TieredIndex(4), CreditCost()).route([1, 2, 3, 4])


def test_ttft_cost_charges_a_worker_whose_memory_would_overflow() -> None:
    lat = MockerLatency()
    cost = TtftCost(TransferModel(131072), capacity_tokens=1000, blind_headroom=0.7, memory_wait_ms=10_000,
                    decode_weight=1.0)
    roomy = cost.cost(100, 10, TierOverlap(0, 0, 0, 0), WorkerLoad(running=1, active_blocks=50, context_tokens=500))
    step = lat.decode_ms(0.5)
    assert roomy == pytest.approx(lat.prefill_ms(100) + step)  # 600 of 1000 tokens: under the headroom
    full = cost.cost(100, 10, TierOverlap(0, 0, 0, 0), WorkerLoad(running=1, active_blocks=65, context_tokens=650))
    assert full == pytest.approx(lat.prefill_ms(100) + lat.decode_ms(0.65) + (750 / 1000 - 0.7) * 10_000)
    # a prefix the worker's in-flight requests already hold takes no new room
    shared = cost.cost(100, 10, TierOverlap(0, 0, 0, 0), WorkerLoad(running=1, active_blocks=65, context_tokens=650),
                       10)
    assert shared == pytest.approx(lat.prefill_ms(100) + lat.decode_ms(0.65))


def test_key_array_takes_int_keys_only() -> None:
    """The compiled counts hold ints in [0, 2**64): any other key keeps the worker's counts in a dict."""
    from kvtier.indexer.index.keyrefs import key_array
    assert key_array([3, 2**64 - 1]).tolist() == [3, 2**64 - 1]
    assert key_array(np.array([3, 4])).tolist() == [3, 4]
    for bad in ([-1], [2**64], [True], ["x"], [1.0], np.array([-1]), np.array([1.0])):
        assert key_array(bad) is None, bad
    lt = LoadTracker(block_size=4)
    lt.add("r1", A, np.array([5, 6], np.uint64), 8, 8)
    assert lt.shared_blocks(A, [5, 6, 7]) == 2 and lt.shared_blocks(A, np.array([5, 9])) == 1
    lt.finish("r1")
    lt._check()


def test_a_key_the_compiled_counts_cannot_hold_moves_the_worker_to_a_dict_with_its_requests_in_flight() -> None:
    """Requests in flight on a worker whose counts move to a dict (a key past 2**64 arrived) keep their keys there:
    shared prefixes, loads and finishes agree with the dict from then on."""
    lt = LoadTracker(block_size=4)
    lt.add("r1", A, [1, 2, 3], 12, 12)
    lt.add("r2", A, [1, 2, 7], 12, 4)
    lt.add("r3", B, [1, 2], 8, 8)
    lt._check()
    from kvtier.indexer.index.keyrefs import KeyRefs, compiled
    assert isinstance(lt._workers[A].refs, KeyRefs) == compiled()
    lt.add("r4", A, [1, 2**64], 8, 4)  # not a uint64: A's counts become a dict, r1 and r2 with them
    assert isinstance(lt._workers[A].refs, dict) and lt._workers[A].refs[1] == 3
    assert lt.load(A).active_blocks == 5 and lt.shared_blocks(A, [1, 2, 3, 9]) == 3
    lt._check()
    lt.finish("r1")
    assert lt.load(A).active_blocks == 4 and lt.shared_blocks(A, [1, 2, 3]) == 2
    lt._check()
    for rid in ("r2", "r3", "r4"):
        lt.finish(rid)
        lt._check()
    assert lt.load(A) == WorkerLoad() and lt.load(B) == WorkerLoad() and not lt._workers[A].refs


def test_ttft_cost_counts_a_shared_pool_hit_as_cached() -> None:
    """Blocks found only in the shared pool (external tier) are loaded, not recomputed: the TTFT estimate charges
    their load time and prefills only the rest of the prompt."""
    t = TransferModel(bytes_per_token=128 * 1024, host_to_device_gbps=20.0, storage_to_host_gbps=5.0,
                      external_to_host_gbps=5.0)
    m = TtftCost(t)
    lat = MockerLatency()
    got = m.cost(1600, 16, TierOverlap(0, 0, 0, 80), WorkerLoad())
    want = t.load_ms(StorageTier.EXTERNAL, 80 * 16) + lat.prefill_ms(1600 - 80 * 16)
    assert got == pytest.approx(want)


def test_pool_loads_give_a_worker_serving_both_roles_the_longer_sides_prefix() -> None:
    """A worker of role "both" in a disaggregated pool: its engine holds what either side's in-flight requests hold,
    so the prefix a new request shares there is the longer of the two sides' (a worker of one role: its own side's)."""
    from kvtier.indexer.routing.load import PoolLoads

    own, other = LoadTracker(block_size=4), LoadTracker(block_size=4)
    other.add("d1", A, keys=[1, 2, 3], prompt_tokens=12, prefill_tokens=0)
    own.add("p1", A, keys=[1], prompt_tokens=4, prefill_tokens=4)
    other.add("d2", B, keys=[1, 2, 3], prompt_tokens=12, prefill_tokens=0)
    view = PoolLoads(own, other, [A])
    assert view.shared_blocks(A, [1, 2, 3, 4]) == 3
    assert view.loads_and_shared([A, B], [1, 2, 3, 4])[1] == [3, 0]
    assert view.load(A).running == 2


def _two_workers_a_cached() -> tuple[TieredIndex, list[int]]:
    """An index where worker A holds the prompt on device and B holds nothing."""
    idx = TieredIndex(block_size=4)
    idx.add_worker(A)
    idx.add_worker(B)
    prompt = list(range(16))
    idx.apply(A, BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=prompt, block_size=4))
    return idx, prompt


def test_router_routes_when_every_worker_looks_dead() -> None:
    """A worker whose publisher looks gone is never chosen while another is alive; when every one looks gone the
    request is still routed (by cost), not refused."""
    idx, prompt = _two_workers_a_cached()
    assert Router(idx, CreditCost(), dead=lambda: {A}).route(prompt).worker == B
    assert Router(idx, CreditCost(), dead=lambda: {A, B}).route(prompt).worker == A
