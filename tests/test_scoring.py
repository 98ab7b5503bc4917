"""Cost models, load bookkeeping and the router."""

from __future__ import annotations

import pytest

from kvtier.indexer.index import TieredIndex
from kvtier.indexer.latency import PRESETS, MockerLatency, TransferModel
from kvtier.indexer.load import LoadTracker, WorkerLoad
from kvtier.indexer.router import Router
from kvtier.indexer.scoring import CreditCost, TierCredits, TtftCost, visible
from kvtier.wire import BlockStored, StorageTier, WorkerId
from kvtier.wire.overlap import TierOverlap
from kvtier.wire.stream import StreamId

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
    lt = LoadTracker()
    lt.add("r1", A, blocks=10, prefill_tokens=100)
    lt.add("r2", A, blocks=5, prefill_tokens=50)
    with pytest.raises(ValueError, match="r1"):
        lt.add("r1", B, 1, 1)
    assert lt.load(A) == WorkerLoad(2, 15, 150, prefilling=2)
    lt.prefill_done("r1")
    lt.prefill_done("r1")
    assert lt.load(A).pending_prefill_tokens == 50 and lt.load(A).prefilling == 1
    lt.finish("r2")
    lt.finish("nope")
    lt._check()
    assert lt.load(A) == WorkerLoad(1, 10, 0) and lt.load(B) == WorkerLoad()


def _index() -> TieredIndex:
    idx = TieredIndex(4)
    toks = list(range(16))
    idx.apply(A, BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=toks[:8], block_size=4))
    idx.apply(B, BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=toks,
                             block_size=4, medium="CPU"))
    return idx


def test_router_picks_lowest_cost_and_breaks_ties_by_order() -> None:
    idx = _index()
    toks = list(range(16))
    assert Router(idx, CreditCost()).route(toks).worker == B  # 4 host blocks (3.0) > 2 device (2.0)
    assert Router(idx, CreditCost(max_tier=StorageTier.DEVICE)).route(toks).worker == A
    fresh = [StreamId(WorkerId("x")), StreamId(WorkerId("y"))]
    d = Router(idx, CreditCost(), workers=fresh).route(toks)
    assert d.worker == fresh[0] and d.costs[fresh[0]] == d.costs[fresh[1]]


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
