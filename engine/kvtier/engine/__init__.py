"""Producer side of kvtier: a tiered KV cache engine (device, host, L3) that publishes real wire-format events.

================  ==================================================================================================
module            holds
================  ==================================================================================================
``cache``         :class:`TieredCache`: the engine's cache (HiCache-like): admit, prefill, decode, finish; events out
``radix``         page-granular radix tree over token ids, with each node's tier residency
``pool``          fixed-size page pools with a free list (device and host memory)
``admission``     a request's hold on the cache and what its prefill computes
``eviction``      making room: least recently used first, leaves before parents
``copies``        copies in flight between tiers, from submission to acknowledgement
``prefetch``      L3 -> host -> device prefetch of a prompt's stored pages
``l3link``        the engine's side of its L3 store: write-behind and announcements
``l3``            the L3 store itself (sub-package): page files, local or shared by many engines
``datapath``      asynchronous copies: modeled (the simulator) or real torch copies
``hashing``       SGLang's page hash chain (the engine hashes in events)
``events``        the events produced since the last flush, in transition order (SPEC section 1)
``window``        sliding-window attention: which pages' window KV a request needs
``dump``, ``views``  state dumps for a resyncing router; read-only views (what a perfect index would answer)
``node``          a cache behind a ZMQ publisher: what one serving process runs
================  ==================================================================================================

Invariants: on every tier the cache is prefix-closed (a page is held only with its parent there; only leaves are
evicted), and the events it publishes, applied in order, make an index hold exactly what the cache holds
(checked by the hypothesis machines in ``tests/test_consistency.py``).
Complexity: admit and finish are O(pages of the prompt); an eviction O(pages evicted); a flush O(events).
Imports the wire contract, kernels and utilities; never the indexer.
"""

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
