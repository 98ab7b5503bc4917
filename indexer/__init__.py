"""Router side of kvtier: router block keys, the tiered per-worker index, cost models, in-flight load,
the router, and the ``kvtier indexer`` HTTP service.

The wire contract it consumes lives in :mod:`kvtier.wire`. The service (and with it ``http.server``)
is imported only when ``IndexerService`` or ``ServiceConfig`` is first used, so a router embedding
the index starts fast and small.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.indexer.index import Outcome, TieredIndex, WorkerStats
from kvtier.indexer.keys import BlockKey, block_keys, chain_keys
from kvtier.indexer.latency import PRESETS, LatencyModel, MockerLatency, ModelPreset, TransferModel
from kvtier.indexer.load import LoadTracker, WorkerLoad
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
    "CostModel",
    "CreditCost",
    "DynamoCost",
    "IndexerService",
    "LatencyModel",
    "LoadTracker",
    "MockerLatency",
    "ModelPreset",
    "Outcome",
    "RouteDecision",
    "Router",
    "ServiceConfig",
    "TierCredits",
    "TieredIndex",
    "TransferModel",
    "TtftCost",
    "WorkerLoad",
    "WorkerStats",
    "block_keys",
    "chain_keys",
    "visible",
]
