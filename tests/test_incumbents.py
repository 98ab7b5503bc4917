"""The incumbent routers' policies (kvtier.indexer.routing.incumbents): each decision rule on hand-built contexts,
each policy
in the simulator on a small trace, and each served by ``kvtier indexer``."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.routing.incumbents import Llmd, PowerOfTwo, SglangCacheAware
from kvtier.indexer.routing.load import LoadTracker
from kvtier.indexer.routing.plugins import RouteContext, RoutingPolicy, route_with
from kvtier.indexer.routing.policies import REGISTRY, RoutingSettings, make_plugin
from kvtier.indexer.service.app import IndexerService, ServiceConfig, parse_endpoint
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.run import RunConfig, simulate
from kvtier.util.fields import ConfigError
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import OverlapScores, TierOverlap
from kvtier.wire.protocol import WorkerId

BS = 16
W = [StreamId(WorkerId(f"w{i}")) for i in range(3)]
INCUMBENTS = ["sglang_cache_aware", "power_of_two", "llmd", "llmd_kv", "llmd_precise"]
_BUSY = itertools.count(10**9)  # keys of the requests that only make load: distinct from every prompt's


def keys(prefix: int, n: int) -> list[BlockKey]:
    """``n`` chained block keys of a prompt family ``prefix`` (prompts of one family share their leading keys)."""
    return [BlockKey(prefix * 10_000 + i) for i in range(n)]


def busy(loads: LoadTracker, worker: StreamId, running: int, prefilling: int | None = None, tag: str = "") -> None:
    """Books ``running`` one-block requests on ``worker``, the first ``prefilling`` of them not yet at first token."""
    for i in range(running):
        rid = f"{tag}{worker}-{i}"
        loads.add(rid, worker, [BlockKey(next(_BUSY))], BS, BS)
        if prefilling is not None and i >= prefilling:
            loads.prefill_done(rid)


def route(policy: RoutingPolicy, ks: Sequence[BlockKey], tokens: int, loads: LoadTracker,
          workers: list[StreamId] = W, overlaps: OverlapScores | None = None) -> tuple[StreamId, dict[StreamId, float]]:
    ctx = RouteContext(tokens, BS, ks, overlaps or OverlapScores(len(ks)), loads, frozenset())
    return route_with(policy, ctx, list(workers))


# --- sglang_cache_aware ----------------------------------------------------------------------------------------


def test_sglang_follows_the_longest_match_above_the_threshold() -> None:
    p, loads = SglangCacheAware(BS), LoadTracker(BS)
    p.routed(keys(1, 8), 8 * BS, W[1])
    p.routed(keys(1, 3), 3 * BS, W[2])
    busy(loads, W[1], 40)  # busier, but not imbalanced (40 - 0 <= 64)
    chosen, scores = route(p, keys(1, 10), 10 * BS, loads)
    assert chosen == W[1] and scores[W[1]] == pytest.approx(-0.8) and scores[W[2]] == pytest.approx(-0.3)


def test_sglang_at_or_below_the_threshold_goes_to_the_least_loaded_or_the_smallest_tree() -> None:
    loads = LoadTracker(BS)
    busy(loads, W[0], 5)
    busy(loads, W[2], 1)
    for fallback, want in (("least_loaded", W[1]), ("smallest_tree", W[2])):
        p = SglangCacheAware(BS, fallback=fallback)
        p.routed(keys(1, 3), 3 * BS, W[0])  # 3 of the prompt's 10 blocks: a match rate of exactly 0.3
        p.routed(keys(2, 6), 6 * BS, W[1])
        p.routed(keys(3, 2), 2 * BS, W[2])  # the smallest tree
        assert route(p, keys(1, 10), 10 * BS, loads)[0] == want, fallback
        # One block more is a rate of 0.4 > 0.3: the match wins, whatever the fallback.
        p.routed(keys(1, 4), 4 * BS, W[0])
        assert route(p, keys(1, 10), 10 * BS, loads)[0] == W[0], fallback


def test_sglang_routes_to_the_least_loaded_only_when_both_imbalance_thresholds_are_passed() -> None:
    def chosen(l0: int, l1: int, l2: int) -> StreamId:
        p, loads = SglangCacheAware(BS), LoadTracker(BS)
        p.routed(keys(1, 10), 10 * BS, W[0])  # a full match on w0
        for w, n in zip(W, (l0, l1, l2), strict=True):
            busy(loads, w, n)
        return route(p, keys(1, 10), 10 * BS, loads)[0]

    assert chosen(100, 10, 30) == W[1]  # 90 > 64 and 100 > 1.5 * 10: imbalanced, the least loaded
    assert chosen(74, 10, 30) == W[0]  # 64 is not > 64: balanced, the match
    assert chosen(210, 140, 150) == W[0]  # 70 > 64 but 210 is not > 1.5 * 140
    assert chosen(211, 140, 150) == W[1]  # both


def test_sglang_least_loaded_ties_go_to_the_worker_sent_fewer_requests_then_the_first() -> None:
    p, loads = SglangCacheAware(BS), LoadTracker(BS)
    assert route(p, keys(9, 4), 4 * BS, loads)[0] == W[0]  # no match, all idle, none sent anything: the first
    p.routed(keys(5, 1), BS, W[0])
    p.routed(keys(6, 1), BS, W[1])
    assert route(p, keys(9, 4), 4 * BS, loads)[0] == W[2]


def test_sglang_equal_matches_go_to_the_worker_that_routed_the_block_last() -> None:
    p, loads = SglangCacheAware(BS), LoadTracker(BS)
    p.routed(keys(1, 5), 5 * BS, W[2])
    p.routed(keys(1, 5), 5 * BS, W[0])
    assert route(p, keys(1, 5), 5 * BS, loads)[0] == W[0]
    p.routed(keys(1, 6), 6 * BS, W[2])  # touches blocks 0-4 again, and one more
    assert route(p, keys(1, 5), 5 * BS, loads)[0] == W[2]


def test_sglang_trees_are_bounded_by_evicting_least_recent_leaves() -> None:
    p = SglangCacheAware(BS, max_tree_size=5 * BS)
    p.routed(keys(1, 4), 4 * BS, W[0])
    p.routed(keys(2, 3), 3 * BS, W[0])  # 7 blocks > 5: family 1's two deepest go, leaf first
    assert p.tree_tokens(W[0]) == 5 * BS
    assert p.held(W[0], keys(1, 4)) == 2 and p.held(W[0], keys(2, 3)) == 3
    p.routed(keys(1, 2), 2 * BS, W[0])  # family 1 touched again: family 2's leaves are now the oldest
    p.routed(keys(3, 2), 2 * BS, W[0])
    assert p.held(W[0], keys(1, 4)) == 2 and p.held(W[0], keys(2, 3)) == 1 and p.held(W[0], keys(3, 2)) == 2
    assert p.tree_tokens(W[0]) == 5 * BS and p.tree_tokens(W[1]) == 0


def test_sglang_rejects_bad_settings_in_one_line() -> None:
    for kwargs, why in (({"cache_threshold": 1.5}, "cache_threshold"), ({"fallback": "x"}, "fallback"),
                        ({"balance_abs_threshold": -1}, "thresholds")):
        with pytest.raises(ConfigError, match=why):
            SglangCacheAware(BS, **kwargs)


# --- power_of_two ---------------------------------------------------------------------------------------------


def test_power_of_two_takes_the_less_loaded_of_two_distinct_draws() -> None:
    loads = LoadTracker(BS)
    busy(loads, W[1], 1)
    busy(loads, W[2], 2)
    p = PowerOfTwo(seed=3)
    picks = collections.Counter(route(p, keys(1, 2), 2 * BS, loads)[0] for _ in range(3000))
    # The busiest never wins (it loses to either other); the idlest wins whenever drawn: 2 pairs of 3.
    assert picks[W[2]] == 0 and 1800 <= picks[W[0]] <= 2200 and picks[W[0]] + picks[W[1]] == 3000
    # Equal loads: the first drawn wins, uniform over the workers; the same seed draws the same.
    idle = LoadTracker(BS)
    a, b = PowerOfTwo(seed=5), PowerOfTwo(seed=5)
    drawn = [route(a, keys(1, 2), 2 * BS, idle)[0] for _ in range(600)]
    assert drawn == [route(b, keys(1, 2), 2 * BS, idle)[0] for _ in range(600)]
    assert sorted(collections.Counter(drawn)) == W and all(150 <= n <= 250 for n in collections.Counter(drawn).values())
    assert route(PowerOfTwo(), keys(1, 2), 2 * BS, loads, [W[2]])[0] == W[2]  # one candidate


# --- llmd -----------------------------------------------------------------------------------------------------


def test_llmd_weighs_prefix_3_against_queue_2() -> None:
    loads = LoadTracker(BS)
    busy(loads, W[0], 4, prefilling=4)  # the longest queue
    busy(loads, W[1], 2, prefilling=1)
    busy(loads, W[2], 6, prefilling=0)  # running, none waiting: the shortest queue
    p = Llmd(BS)
    p.routed(keys(1, 10), 10 * BS, W[0])
    chosen, scores = route(p, keys(1, 10), 10 * BS, loads)
    # w0: 3 * 1 + 2 * 0; w1: 3 * 0 + 2 * (4 - 1) / 4; w2: 2 * 1
    assert chosen == W[0] and scores == {W[0]: -3.0, W[1]: -1.5, W[2]: -2.0}
    # Half the prompt matched (the partial last block counts in the total): 1.5 < 2, the shortest queue wins.
    chosen, scores = route(p, keys(1, 10), 20 * BS - 3, loads)
    assert chosen == W[2] and scores[W[0]] == pytest.approx(-1.5)


def test_llmd_equal_queues_score_1_and_ties_go_at_random() -> None:
    p, loads = Llmd(BS, seed=1), LoadTracker(BS)
    chosen = collections.Counter(route(p, keys(1, 4), 4 * BS, loads)[0] for _ in range(300))
    assert set(chosen) == set(W) and all(s == -2.0 for s in route(p, keys(1, 4), 4 * BS, loads)[1].values())


def test_llmd_prefix_estimate_counts_every_holder_while_any_holds_and_caps_at_256_blocks() -> None:
    p = Llmd(BS, capacity_tokens=3 * BS)  # an LRU of 3 blocks per worker
    p.routed(keys(1, 4), 4 * BS, W[1])  # 4 blocks into 3: its first block, the least recent, is evicted
    assert p.matches(keys(1, 4)) == {}  # nobody holds block 0: counting stops there
    p.routed(keys(1, 2), 2 * BS, W[0])
    assert p.matches(keys(1, 4)) == {W[0]: 2, W[1]: 3}  # w1 is credited blocks 1-3 while w0 holds block 0
    assert route(p, keys(1, 4), 4 * BS, LoadTracker(BS))[0] == W[1]
    big = Llmd(BS)
    big.routed(keys(2, 300), 300 * BS, W[0])
    assert big.matches(keys(2, 300)) == {W[0]: 256}
    assert route(big, keys(2, 300), 300 * BS, LoadTracker(BS))[1][W[0]] == -(3.0 + 2.0)


def test_llmd_kv_utilisation_scorer_is_an_option_that_needs_the_capacity() -> None:
    loads = LoadTracker(BS)
    busy(loads, W[0], 16, prefilling=0)  # all 16 blocks in use, none waiting
    busy(loads, W[1], 1, prefilling=1)  # 1 of 16 in use, one waiting
    busy(loads, W[2], 16, prefilling=4)  # full, the longest queue
    plain = Llmd(BS, capacity_tokens=16 * BS)
    with_kv = Llmd(BS, kv_weight=2.0, capacity_tokens=16 * BS)
    assert route(plain, keys(1, 2), 2 * BS, loads)[0] == W[0]  # the shortest queue
    chosen, scores = route(with_kv, keys(1, 2), 2 * BS, loads)
    assert chosen == W[1]
    assert scores == pytest.approx({W[0]: -2.0, W[1]: -(2 * 0.75 + 2 * 15 / 16), W[2]: 0.0})
    with pytest.raises(ConfigError, match="capacity"):
        Llmd(BS, kv_weight=2.0)
    assert REGISTRY["llmd_kv"].served and make_plugin("llmd_kv", RoutingSettings(capacity_tokens=1024), BS).name \
        == "llmd_kv"


def test_llmd_precise_scores_the_indexed_prefix_gpu_1_cpu_0_8_and_learns_nothing_from_routes() -> None:
    p, loads = Llmd(BS, mode="precise"), LoadTracker(BS)
    ov = OverlapScores(10, {W[0]: TierOverlap(4, 8, 8, 8), W[1]: TierOverlap(6, 6, 6, 6),
                            W[2]: TierOverlap(0, 0, 10, 10)})  # w2's blocks are on disk: vLLM announces none
    chosen, scores = route(p, keys(1, 10), 10 * BS + 5, loads, overlaps=ov)  # total: the 10 full blocks
    assert chosen == W[0] and scores == pytest.approx({W[0]: -(3 * 0.72 + 2), W[1]: -(3 * 0.6 + 2), W[2]: -2.0})
    p.routed(keys(1, 10), 10 * BS, W[2])
    assert p.matches(keys(1, 10)) == {} and route(p, keys(1, 10), 10 * BS, loads, overlaps=ov)[0] == W[0]
    with pytest.raises(ConfigError, match="mode"):
        Llmd(BS, mode="exact")


# --- in the simulator and the service -----------------------------------------------------------------------------

CLUSTER = ClusterConfig.of(workers=3, page_size=64, device_tokens=32_768, host_ratio=1.0, l3="disk", l3_tokens=131_072)


def test_each_runs_in_the_simulator_with_sane_hit_rates() -> None:
    reqs = generate(dataclasses.replace(PRESETS["chat"], requests=300, system_tokens=1024, user_tokens=600), 1)
    rr = simulate(reqs, CLUSTER, RunConfig("round_robin")).summary
    for name in INCUMBENTS:
        res = simulate(reqs, CLUSTER, RunConfig(name, seed=2))
        s, spread = res.summary, collections.Counter(res.decisions)
        assert s.requests == len(reqs) and s.policy == name and len(spread) == CLUSTER.workers, name
        assert min(spread.values()) > len(reqs) / CLUSTER.workers / 2, (name, spread)  # no worker starved
        if name == "power_of_two":  # cache-blind: about round robin's reuse
            assert abs(s.hit_rate - rr.hit_rate) < 0.1, (name, s.hit_rate, rr.hit_rate)
        else:  # sessions kept where their prefixes went: more reuse than round robin's
            assert s.hit_rate > rr.hit_rate + 0.05, (name, s.hit_rate, rr.hit_rate)
        assert res.decisions == simulate(reqs, CLUSTER, RunConfig(name, seed=2)).decisions, name  # deterministic


def _service(policy: str, capacity: int | None = 4096, **settings: Any) -> IndexerService:
    eps = [parse_endpoint(f"w{i}=tcp://127.0.0.1:{i + 1}") for i in range(3)]
    return IndexerService(ServiceConfig(endpoints=eps, block_size=4, listen="127.0.0.1:0", policy=policy,
                                        capacity_tokens=capacity, **settings))


@pytest.mark.parametrize("name", INCUMBENTS)
def test_each_is_served_and_learns_from_routes_not_queries(name: str) -> None:
    svc = _service(name)
    plugin = svc.router.policy
    assert plugin is not None and plugin.name == name
    toks = list(range(1000, 1032))  # 8 blocks of 4
    out = svc.query({"token_ids": toks})
    assert out["recommended"] in {"w0", "w1", "w2"} and set(out["costs"]) == {"w0", "w1", "w2"}
    first = svc.route({"request_id": "a", "token_ids": toks})["worker"]
    if isinstance(plugin, SglangCacheAware):
        assert plugin.tree_tokens(StreamId(WorkerId(first))) == 32  # /route taught it; /query did not
        assert sum(plugin.tree_tokens(w) for w in W) == 32
    if isinstance(plugin, Llmd):  # the estimate learns the route; the precise mode waits for the engine's events
        want = {} if plugin.mode == "precise" else {StreamId(WorkerId(first)): 8}
        assert plugin.matches(svc.index.request_keys(toks)) == want
    svc.first_token("a")
    svc.finish("a")
    if name not in ("power_of_two", "llmd_precise"):  # the prompt again goes where its prefix was routed
        assert svc.route({"request_id": "b", "token_ids": toks})["worker"] == first


def test_the_kv_utilisation_profile_needs_the_capacity_in_the_service() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        _service("llmd_kv", capacity=None)


@pytest.mark.parametrize("name,temperature", [("power_of_two", 0.0), ("llmd", 0.0), ("kv_all", 0.0),
                                              ("kv_all", 0.5)])
def test_a_query_takes_no_random_draw_from_later_routes(name: str, temperature: float) -> None:
    """A query books nothing, so it must not move the draws a policy makes (two at random for power_of_two, a
    tie-break for llmd and the router's cost models, a softmax sample at a temperature): routes with a query
    before each go where they go without, and each query names the worker its route then gets."""
    prompts = [list(range(100 * i, 100 * i + 16)) for i in range(40)]
    plain, queried = (_service(name, temperature=temperature, seed=3) for _ in range(2))
    alone = [plain.route({"request_id": str(i), "token_ids": t})["worker"] for i, t in enumerate(prompts)]
    got, said = [], []
    for i, t in enumerate(prompts):
        said.append(queried.query({"token_ids": t})["recommended"])
        got.append(queried.route({"request_id": str(i), "token_ids": t})["worker"])
    assert len(set(alone)) > 1  # the draws do decide
    assert got == alone and said == got


def test_power_of_two_gives_a_tie_to_the_first_worker_drawn() -> None:
    """SMG's power_of_two: the first index uniform, the second among the others, and the first wins a tie."""
    import random

    from kvtier.wire import WorkerId
    from kvtier.wire.notices import StreamId

    class Drawn(random.Random):
        """Draws as scripted: the pair (first, second) each pick compares."""

        def __init__(self, draws: list[int]) -> None:
            super().__init__(0)
            self.draws = draws

        def randrange(self, *args: object, **kw: object) -> int:  # type: ignore[override]
            return self.draws.pop(0)

    ws = [StreamId(WorkerId(f"w{i}")) for i in range(4)]
    p = PowerOfTwo()
    for first, offset in ((2, 0), (3, 2), (0, 1)):  # the second is (first + 1 + offset) mod 4
        p.rng = Drawn([first, offset])
        assert p.pick(None, dict.fromkeys(ws, 1.0)) == ws[first]  # type: ignore[arg-type]
        second = (first + 1 + offset) % 4
        p.rng = Drawn([first, offset])
        assert p.pick(None, {**dict.fromkeys(ws, 1.0), ws[second]: 0.5}) == ws[second]  # type: ignore[arg-type]
