"""One policy registry (kvtier.indexer.routing.policies): a policy named in ``kvtier replay --policy X`` and in ``kvtier
indexer --policy X`` is the same cost under the same settings, and routes a trace's requests the same way."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.routing.plugins import note_routed
from kvtier.indexer.routing.policies import POLICIES, REGISTRY, RoutingSettings, make_cost
from kvtier.indexer.routing.scoring import TtftCost
from kvtier.indexer.service.app import IndexerService, ServiceConfig, parse_endpoint
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.policies import KvPolicy, PluginRouted, RouteInput
from kvtier.sim.run import RunConfig, routing_settings, simulate
from kvtier.wire.notices import Delivery

CLUSTER = ClusterConfig.of(workers=3, page_size=16, device_tokens=32_768, host_ratio=1.0, l3="disk", l3_tokens=131_072,
                        h2d_gbps=25.0, prefill_budget=4096)


def _service(run: RunConfig) -> IndexerService:
    """``kvtier indexer --policy X`` told the cluster's settings as an operator would (not started: no sockets)."""
    eps = [parse_endpoint(f"w{i}=tcp://127.0.0.1:{i + 1}") for i in range(CLUSTER.workers)]
    return IndexerService(ServiceConfig(
        endpoints=eps, block_size=CLUSTER.page_size, listen="127.0.0.1:0", policy=run.policy, cost=run.cost,
        model=CLUSTER.model, h2d_gbps=CLUSTER.h2d_gbps, storage_gbps=CLUSTER.storage_gbps,
        prefill_budget=CLUSTER.prefill_budget, capacity_tokens=CLUSTER.capacity_tokens(),
        host_credit=run.host_credit, disk_credit=run.disk_credit, temperature=run.temperature, seed=run.seed))


RUNS = [RunConfig("kv_host", host_credit=0.6, seed=7), RunConfig("kv_all", cost="ttft", seed=3),
        RunConfig("dynamo", host_credit=0.5, disk_credit=0.1, seed=1), RunConfig("min_ttft", seed=5),
        RunConfig("llmd_precise", seed=3)]  # (an incumbent's plugin over the event-fed index)


@pytest.mark.parametrize("run", RUNS, ids=[r.label for r in RUNS])
def test_a_policy_routes_alike_in_the_simulator_and_the_service(run: RunConfig,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a whole simulated run, the service's router (built by ``kvtier indexer``'s path from its own
    settings) is fed every event the simulated router hears and shares its in-flight bookkeeping; on every request
    it must price every worker alike and choose the same one."""
    svc = _service(run)
    assert svc.router.cost_model == make_cost(run.policy, routing_settings(CLUSTER, run))
    shadow = IndexConsumer(svc.index, wall_clock=lambda: 0.0)
    compared = [0]
    feed, choose = KvPolicy.feed, KvPolicy.choose

    def feed_both(self: KvPolicy, deliveries: list[Delivery]) -> None:
        shadow.feed(deliveries)
        feed(self, deliveries)

    def choose_both(self: KvPolicy, req: RouteInput) -> Any:
        assert self.router.cost_model == svc.router.cost_model
        svc.router.loads = self.router.loads  # (the one bookkeeping of what was routed and is in flight)
        theirs = svc.router.route_keys(req.keys, req.num_tokens)
        ours = choose(self, req)
        assert str(theirs.worker) == f"w{ours.worker}", f"request {req.request_id}: {theirs.costs}"
        compared[0] += 1
        return ours

    monkeypatch.setattr(KvPolicy, "feed", feed_both)
    monkeypatch.setattr(KvPolicy, "choose", choose_both)
    reqs = generate(dataclasses.replace(PRESETS["chat"], requests=300, system_tokens=1024, user_tokens=600), 2)
    res = simulate(reqs, CLUSTER, run)
    assert compared[0] == 300 and res.summary.requests == 300
    assert res.summary.hit_host > 0  # the lower tiers took part


PLUGINS = [RunConfig("sglang_cache_aware"), RunConfig("power_of_two", seed=4), RunConfig("llmd", seed=6),
           RunConfig("llmd_kv", seed=2)]


@pytest.mark.parametrize("run", PLUGINS, ids=[r.label for r in PLUGINS])
def test_an_incumbent_routes_alike_in_the_simulator_and_the_service(run: RunConfig,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The incumbents hear no events: the service's plugin, built by ``kvtier indexer``'s path from its own
    settings, shares the simulated router's in-flight bookkeeping and learns each booked route as the service's
    ``/route`` teaches it; on every request it must score every worker alike and choose the same one."""
    svc = _service(run)
    assert svc.router.policy is not None and svc.router.policy.name == run.policy
    compared = [0]
    choose = PluginRouted.choose

    def choose_both(self: PluginRouted, req: RouteInput) -> Any:
        svc.router.loads = self.router.loads  # (the one bookkeeping of what was routed and is in flight)
        theirs = svc.router.route_keys(req.keys, req.num_tokens)
        note_routed(svc.router.policy, req.keys, req.num_tokens, theirs.worker)  # what IndexerService.route does
        ours = choose(self, req)
        assert str(theirs.worker) == f"w{ours.worker}", f"request {req.request_id}: {theirs.costs}"
        compared[0] += 1
        return ours

    monkeypatch.setattr(PluginRouted, "choose", choose_both)
    reqs = generate(dataclasses.replace(PRESETS["chat"], requests=300, system_tokens=1024, user_tokens=600), 2)
    res = simulate(reqs, CLUSTER, run)
    assert compared[0] == 300 and res.summary.requests == 300 and len(set(res.decisions)) == CLUSTER.workers


def test_every_registry_policy_runs_in_the_simulator_and_the_served_ones_in_the_service() -> None:
    reqs = generate(dataclasses.replace(PRESETS["chat"], requests=40), 1)
    for name in POLICIES:
        assert simulate(reqs, CLUSTER, RunConfig(name)).summary.requests == 40, name
        if REGISTRY[name].served:
            assert _service(RunConfig(name)).router is not None


def test_settings_reach_the_cost() -> None:
    s = RoutingSettings(cost="ttft", h2d_gbps=12.5, storage_gbps=3.0, prefill_budget=2048, capacity_tokens=9_999)
    cm = make_cost("kv_host", s)
    assert isinstance(cm, TtftCost) and cm == make_cost("kv_host", dataclasses.replace(s))
    assert cm.prefill_budget == 2048 and cm.transfer.host_to_device_gbps == 12.5
    assert make_cost("kv_host", dataclasses.replace(s, h2d_gbps=54.0)) != cm
