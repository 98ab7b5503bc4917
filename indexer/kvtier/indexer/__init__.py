"""Router side of kvtier: router block keys, the tiered per-worker index (with held orphan stores),
the consumer that applies subscriber deliveries to it, cost models, in-flight load, the router,
routing-policy plugins, and the ``kvtier indexer`` HTTP service.

Three sub-packages: :mod:`kvtier.indexer.index` (the index), :mod:`kvtier.indexer.routing` (router, costs, load,
the policy registry, plugins) and :mod:`kvtier.indexer.service` (HTTP, config, persistence, metrics). This facade
re-exports their public names lazily: each module is imported when one of its names is first used, so a router
embedding the index loads neither routing nor the service (nor aiohttp).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.util.lazy import lazy_exports

if TYPE_CHECKING:
    from kvtier.hardware.latency import PRESETS, LatencyModel, MockerLatency, ModelPreset, TransferModel
    from kvtier.indexer.index.closure import PrefixClosure
    from kvtier.indexer.index.consumer import ConsumerCounters, IndexConsumer
    from kvtier.indexer.index.keys import BlockKey, block_keys, chain_keys, split_extra_keys
    from kvtier.indexer.index.orphans import OrphanPool, OrphanStats
    from kvtier.indexer.index.tiered import Outcome, TieredIndex, WorkerStats
    from kvtier.indexer.routing.load import LoadTracker, WorkerLoad
    from kvtier.indexer.routing.plugins import PolicyBase, RouteContext, RoutingPolicy, load_policy
    from kvtier.indexer.routing.router import RouteDecision, Router
    from kvtier.indexer.routing.scoring import CostModel, CreditCost, DynamoCost, TierCredits, TtftCost, visible
    from kvtier.indexer.service.app import IndexerService, ServiceConfig

__getattr__, __dir__ = lazy_exports(__name__, {
    "IndexerService": "kvtier.indexer.service.app",
    "ServiceConfig": "kvtier.indexer.service.app",
    "PRESETS": "kvtier.hardware.latency",
    "LatencyModel": "kvtier.hardware.latency",
    "MockerLatency": "kvtier.hardware.latency",
    "ModelPreset": "kvtier.hardware.latency",
    "TransferModel": "kvtier.hardware.latency",
    "PrefixClosure": "kvtier.indexer.index.closure",
    "ConsumerCounters": "kvtier.indexer.index.consumer",
    "IndexConsumer": "kvtier.indexer.index.consumer",
    "BlockKey": "kvtier.indexer.index.keys",
    "block_keys": "kvtier.indexer.index.keys",
    "chain_keys": "kvtier.indexer.index.keys",
    "split_extra_keys": "kvtier.indexer.index.keys",
    "OrphanPool": "kvtier.indexer.index.orphans",
    "OrphanStats": "kvtier.indexer.index.orphans",
    "Outcome": "kvtier.indexer.index.tiered",
    "TieredIndex": "kvtier.indexer.index.tiered",
    "WorkerStats": "kvtier.indexer.index.tiered",
    "LoadTracker": "kvtier.indexer.routing.load",
    "WorkerLoad": "kvtier.indexer.routing.load",
    "PolicyBase": "kvtier.indexer.routing.plugins",
    "RouteContext": "kvtier.indexer.routing.plugins",
    "RoutingPolicy": "kvtier.indexer.routing.plugins",
    "load_policy": "kvtier.indexer.routing.plugins",
    "RouteDecision": "kvtier.indexer.routing.router",
    "Router": "kvtier.indexer.routing.router",
    "CostModel": "kvtier.indexer.routing.scoring",
    "CreditCost": "kvtier.indexer.routing.scoring",
    "DynamoCost": "kvtier.indexer.routing.scoring",
    "TierCredits": "kvtier.indexer.routing.scoring",
    "TtftCost": "kvtier.indexer.routing.scoring",
    "visible": "kvtier.indexer.routing.scoring",
})

__all__ = [
    "PRESETS",
    "BlockKey",
    "ConsumerCounters",
    "CostModel",
    "CreditCost",
    "DynamoCost",
    "IndexConsumer",
    "IndexerService",
    "LatencyModel",
    "LoadTracker",
    "MockerLatency",
    "ModelPreset",
    "OrphanPool",
    "OrphanStats",
    "Outcome",
    "PolicyBase",
    "PrefixClosure",
    "RouteContext",
    "RouteDecision",
    "Router",
    "RoutingPolicy",
    "ServiceConfig",
    "TierCredits",
    "TieredIndex",
    "TransferModel",
    "TtftCost",
    "WorkerLoad",
    "WorkerStats",
    "block_keys",
    "chain_keys",
    "load_policy",
    "split_extra_keys",
    "visible",
]
