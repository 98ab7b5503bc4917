"""Producer side of kvtier: a tiered KV cache engine that publishes real wire-format events."""

from kvtier.engine.admission import Admission, PrefillPlan
from kvtier.engine.cache import CacheConfig, PrefetchPolicy, TieredCache, WritePolicy
from kvtier.engine.datapath import Bandwidths, CopyKind, CopyOp, DataPath, ModeledDataPath, TorchDataPath
from kvtier.engine.dump import NodeRun, Snapshot, dump_batches
from kvtier.engine.hashing import PageDigests, chain, event_hash, page_digest
from kvtier.engine.l3.pagetree import PageMeta
from kvtier.engine.l3.storage import PageStore, StoreError
from kvtier.engine.node import EngineNode
from kvtier.engine.pool import PageId, PagePool, PoolExhausted
from kvtier.engine.radix import Node, RadixTree

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
    "NodeRun",
    "PageDigests",
    "PageId",
    "PageMeta",
    "PagePool",
    "PageStore",
    "PoolExhausted",
    "PrefetchPolicy",
    "PrefillPlan",
    "RadixTree",
    "Snapshot",
    "StoreError",
    "TieredCache",
    "TorchDataPath",
    "WritePolicy",
    "chain",
    "dump_batches",
    "event_hash",
    "page_digest",
]
