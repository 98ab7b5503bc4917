"""An engine cache's sizes and policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvtier.util.fields import ConfigError, Domain, at_least, check_fields, one_of, within
from kvtier.wire.protocol import DEFAULT_BLOCK_SIZE


class WritePolicy(StrEnum):
    """When device pages get a host copy."""

    WRITE_THROUGH = "write_through"  # as soon as they are computed
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once matched `selective_threshold` times
    WRITE_BACK = "write_back"  # when evicted from the device


class Eviction(StrEnum):
    """What making device room frees."""

    NODE = "node"  # whole radix nodes, least recently used leaf first (SGLang's radix cache)
    PAGE = "page"  # only the pages needed, a leaf's last pages first (vLLM's block pool, Dynamo's mocker)


class PrefetchPolicy(StrEnum):
    """How long a request waits for its L3 prefetch before computing the rest."""

    BEST_EFFORT = "best_effort"  # never waits; uses what has arrived
    WAIT_COMPLETE = "wait_complete"  # waits for the whole prefetch
    TIMEOUT = "timeout"  # waits up to `prefetch_timeout_s`


#: Device, host and window-KV pages of one cache at most: its pools are made when it starts (some 40 bytes a page).
MAX_CACHE_PAGES = 1 << 28


def count_pages(device_pages: int, host_ratio: float, window_pages: int) -> float:
    """Pages a cache's pools hold (device, host, window KV), each bookkept in memory from the start: what the caps
    on one cache (:data:`MAX_CACHE_PAGES`) and on a simulated cluster count. A float: sizes past any cap stay
    exact enough to refuse, and a message can quote them."""
    return device_pages * (1.0 + host_ratio) + window_pages


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """Sizes and policies of one engine's cache. Each field's domain, default and help are stated once, here: the
    simulator's cluster holds one of these (:class:`kvtier.sim.cluster.ClusterConfig`) and the command line is
    generated from these fields (:func:`kvtier.util.fields.add_options`)."""

    page_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=at_least(
        1, help="tokens per KV page (= the router's block size)"))
    device_pages: int = field(default=1024, metadata=at_least(1, help="device KV capacity, pages"))
    host_ratio: float = field(default=2.0, metadata=within(0, 1024, help="host / device capacity (0: no host tier)"))
    write_policy: WritePolicy = field(default=WritePolicy.WRITE_THROUGH, metadata=one_of(
        *WritePolicy, help="when device pages get a host copy"))
    eviction: Eviction = field(default=Eviction.NODE, metadata=one_of(
        *Eviction, help="device eviction: whole radix nodes (SGLang) or only the pages needed, last first (vLLM)"))
    selective_threshold: int = field(default=2, metadata=at_least(
        1, help="write_through_selective: hits before a page is backed up to host"))
    load_back: bool = field(default=True, metadata=Domain(bool, help=(
        "host hits are recomputed instead of loaded back to device")).meta())
    l3_write_behind: bool = True  # copy host backups to the L3 store (a simulated cluster: whenever it has one)
    prefetch_policy: PrefetchPolicy = field(default=PrefetchPolicy.WAIT_COMPLETE, metadata=one_of(
        *PrefetchPolicy, help="how long a request waits for its L3 prefetch"))
    prefetch_min_pages: int = field(default=1, metadata=at_least(
        1, help="shortest L3 hit worth prefetching, pages"))
    prefetch_timeout_s: float = field(default=0.05, metadata=within(
        0, 3600, help="prefetch policy timeout: the longest wait, seconds"))
    # sliding-window attention: pages of window KV a prefix needs (0: no SWA)
    swa_window_pages: int = field(default=0, metadata=at_least(0))
    swa_pages: int = field(default=0, metadata=at_least(0))  # window-KV pool size in pages (0: as many as device)
    swa_events: bool = field(default=True, metadata=Domain(bool, help=(
        "hybrid models: engines publish no window-KV events (as SGLang): kv_swa infers their window KV, the "
        "other policies over-count")).meta())

    def __post_init__(self) -> None:
        check_fields(self)
        pages = count_pages(self.device_pages, self.host_ratio, self.window_pool_pages)
        if pages > MAX_CACHE_PAGES:
            raise ConfigError(f"--device-pages {self.device_pages}, --host-ratio {self.host_ratio:g}: {pages:,.0f} "
                              f"device, host and window-KV pages; a cache holds at most {MAX_CACHE_PAGES:,} (every "
                              "page is bookkept in memory)")

    @property
    def window_pool_pages(self) -> int:
        """Pages of the window-KV pool: ``swa_pages``, or as many as device pages where that is 0; none without a
        window."""
        return (self.swa_pages or self.device_pages) if self.swa_window_pages else 0

    @property
    def host_pages(self) -> int:
        return int(self.device_pages * self.host_ratio)
