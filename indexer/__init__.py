"""Router side of kvtier: router block keys, the tiered per-worker index (with held orphan stores),
the consumer that applies subscriber deliveries to it, cost models, in-flight load, the router,
routing-policy plugins, and the ``kvtier indexer`` HTTP service.

The wire contract it consumes lives in :mod:`kvtier.wire`. The service (and with it aiohttp)
is imported only when ``IndexerService`` or ``ServiceConfig`` is first used, so a router embedding
the index starts fast and small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.indexer.closure import PrefixClosure
from kvtier.indexer.consumer import ConsumerCounters, IndexConsumer
from kvtier.indexer.index import Outcome, TieredIndex, WorkerStats
from kvtier.indexer.keys import BlockKey, block_keys, chain_keys, split_extra_keys
from kvtier.indexer.latency import PRESETS, LatencyModel, MockerLatency, ModelPreset, TransferModel
from kvtier.indexer.load import LoadTracker, WorkerLoad
from kvtier.indexer.orphans import OrphanPool, OrphanStats
from kvtier.indexer.plugins import PolicyBase, RouteContext, RoutingPolicy, load_policy
from kvtier.indexer.router import RouteDecision, Router
from kvtier.indexer.scoring import CostModel, CreditCost, DynamoCost, TierCredits, TtftCost, visible

if TYPE_CHECKING:
    from kvtier.indexer.service import IndexerService, ServiceConfig

_LAZY = {"IndexerService", "ServiceConfig"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvtier.indexer import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
