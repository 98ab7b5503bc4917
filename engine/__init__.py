"""Producer side of kvtier: a tiered KV cache engine that publishes real wire-format events."""

from engine.cache import Admission, CacheConfig, PrefetchPolicy, PrefillPlan, TieredCache, WritePolicy
from engine.datapath import Bandwidths, CopyKind, CopyOp, DataPath, ModeledDataPath, TorchDataPath
from engine.hashing import chain, event_hash, page_digest
from engine.node import EngineNode
from engine.pool import PageId, PagePool, PoolExhausted
from engine.radix import Node, RadixTree
from engine.storage import PageMeta, PageStore, StoreError

__all__ = [
    "Admission",
    "Bandwidths",
    "CacheConfig",
    "CopyKind",
    "CopyOp",
    "DataPath",
    "EngineNode",
    "ModeledDataPath",
    "Node",
    "PageId",
    "PageMeta",
    "PagePool",
    "PageStore",
    "PoolExhausted",
    "PrefetchPolicy",
    "PrefillPlan",
    "RadixTree",
    "StoreError",
    "TieredCache",
    "TorchDataPath",
    "WritePolicy",
    "chain",
    "event_hash",
    "page_digest",
]
