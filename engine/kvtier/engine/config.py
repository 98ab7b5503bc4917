"""An engine cache's sizes and policies."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from kvtier.util.fields import at_least, check_fields, one_of, within


class WritePolicy(StrEnum):
    """When device pages get a host copy."""

    WRITE_THROUGH = "write_through"  # as soon as they are computed
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # once matched `selective_threshold` times
    WRITE_BACK = "write_back"  # when evicted from the device


class PrefetchPolicy(StrEnum):
    """How long a request waits for its L3 prefetch before computing the rest."""

    BEST_EFFORT = "best_effort"  # never waits; uses what has arrived
    WAIT_COMPLETE = "wait_complete"  # waits for the whole prefetch
    TIMEOUT = "timeout"  # waits up to `prefetch_timeout_s`


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """Sizes and policies of one engine's cache."""

    page_size: int = field(default=16, metadata=at_least(1))  # tokens per page (= block size in events)
    device_pages: int = field(default=1024, metadata=at_least(1))  # device KV capacity in pages
    # host pages = host_ratio * device_pages; 0 disables the host tier
    host_ratio: float = field(default=2.0, metadata=within(0, 1024))
    write_policy: WritePolicy = field(default=WritePolicy.WRITE_THROUGH, metadata=one_of(*WritePolicy))
    # hits before write_through_selective backs a node up
    selective_threshold: int = field(default=2, metadata=at_least(1))
    load_back: bool = True  # load host hits to device (else recompute them)
    l3_write_behind: bool = True  # copy host backups to the L3 store
    prefetch_policy: PrefetchPolicy = field(default=PrefetchPolicy.BEST_EFFORT, metadata=one_of(*PrefetchPolicy))
    # L3 hit length below which no prefetch is started
    prefetch_min_pages: int = field(default=1, metadata=at_least(0))
    prefetch_timeout_s: float = field(default=0.05, metadata=within(0, 3600))  # for PrefetchPolicy.TIMEOUT
    # sliding-window attention: pages of window KV a prefix needs (0: no SWA)
    swa_window_pages: int = field(default=0, metadata=at_least(0))
    swa_pages: int = field(default=0, metadata=at_least(0))  # window-KV pool size in pages (0: as many as device)
    # publish window-KV events (kvtier's SWA extension, kvtier.wire.WINDOW_KIND); False: as SGLang, none
    swa_events: bool = True

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def host_pages(self) -> int:
        return int(self.device_pages * self.host_ratio)
