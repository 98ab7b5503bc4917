"""A request's hold on a :class:`kvtier.engine.cache.TieredCache`, and what its prefill computes."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.engine.pool import PageId
from kvtier.engine.radix import Node
from kvtier.wire.protocol import PackedTokens


@dataclass(slots=True, eq=False)
class Admission:
    """One request's hold on the cache, from admission to release."""

    request_id: str  # caller's id
    tokens: PackedTokens  # the prompt (4 bytes a token)
    last: Node  # deepest matched node; locked while admitted
    device_pages: int  # pages already on device at admission
    host_pages: int  # pages found on host (loaded back unless load_back=False)
    l3_pages: int  # pages found in the L3 store (prefetched)
    waits: set[int] = field(default_factory=set)  # op ids of loads the request needs
    prefetch_op: int | None = None  # the L3 prefetch, while in flight
    private: list[PageId] = field(default_factory=list)  # device pages for the tail and decode
    compute: list[PageId] = field(default_factory=list)  # device pages for pages to compute
    swa: list[PageId] = field(default_factory=list)  # window-KV pages for computed and tombstoned pages
    started: bool = False  # prefill began: late prefetches no longer load to device
    # The digests of the prompt's full pages, joined, when the caller made them ahead (the simulator's lookahead);
    # empty: each node computes its own (RadixTree.add_child checks those it is given)
    digests: bytes = b""
    released: bool = False  # release() was called
    epoch: int = 0  # the cache's reset count at admission: a reset voids the admission


@dataclass(slots=True)
class PrefillPlan:
    """What a request computes: the rest of its prompt after the device-cached prefix."""

    cached_tokens: int  # tokens whose KV is on device
    compute_tokens: int  # tokens to prefill
