"""Drives a TieredCache on a manual clock and mirrors its events into a real index."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.engine.cache import Admission, CacheConfig, TieredCache
from kvtier.engine.datapath import Bandwidths, ModeledDataPath
from kvtier.engine.l3.storage import PageStore
from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire import Event, EventBatch, StorageTier, WorkerId, decode_payload, encode_payload
from kvtier.wire.notices import StreamId

PAGE_BYTES = 1000
# 1 page per second on every link: a copy of n pages completes n s (+1 us) after it starts.
BW = Bandwidths(d2h=1e3, h2d=1e3, storage_write=1e3, storage_read=1e3, latency_s=1e-6)


@dataclass
class Harness:
    config: CacheConfig
    store: PageStore | None = None
    name: str = "w0"
    index: TieredIndex | None = None
    now: float = 0.0
    log: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dp = ModeledDataPath(PAGE_BYTES, lambda: self.now, BW)
        self.cache = TieredCache(self.config, self.dp, self.store, name=self.name)
        if self.index is None:
            self.index = TieredIndex(self.config.page_size)
        self.stream = StreamId(WorkerId(self.name))
        self.index.add_worker(self.stream)

    def deliver(self) -> list[Event]:
        """Flushes the cache's events through the codec bytes into the index."""
        batch = self.cache.flush_events(ts=self.now)
        if batch is None:
            return []
        wire = decode_payload(encode_payload(batch))
        assert self.index is not None
        for ev in wire.events:
            assert self.index.apply(self.stream, ev) is Outcome.APPLIED, (ev, self.index.stats(self.stream))
        self.log.extend(wire.events)
        return wire.events

    def advance(self, dt: float = 1.0) -> list[Event]:
        """Moves the clock, handles completed copies, delivers their events, checks consistency."""
        self.now += dt
        self.cache.poll()
        events = self.deliver()
        self.check()
        return events

    def settle(self) -> list[Event]:
        out = []
        for _ in range(500):
            out += self.advance(1.0)
            if not self.dp.ops:
                break
        return out

    def check(self) -> None:
        self.cache._check()
        assert self.index is not None
        self.index._check()
        seen = self.index.worker_hashes(self.stream)
        truth = self.cache.residency()
        for tier in StorageTier:
            assert seen[tier] == truth[tier], (tier, seen[tier] ^ truth[tier])
        if self.cache.config.swa_window_pages and self.cache.config.swa_events:
            win_seen, win_truth = self.index.window_hashes(self.stream), self.cache.window_residency()
            for tier, held in win_truth.items():
                assert win_seen[tier] == held, ("window", tier, win_seen[tier] ^ held)

    def run(self, rid: str, tokens: list[int], output: int = 0, release: bool = True) -> Admission:
        """Admit, wait for loads, prefill, (release): one request end to end."""
        adm = self.cache.admit(rid, tokens)
        self.deliver()
        for _ in range(50):
            if not self.cache.waiting_for(adm):
                break
            self.advance(1.0)
        plan = self.cache.begin_prefill(adm, output)
        assert plan is not None, "no device room"
        self.cache.finish_prefill(adm)
        if release:
            self.cache.release(adm)
        self.deliver()
        self.check()
        return adm

    def apply_all(self, batches: list[EventBatch]) -> None:
        assert self.index is not None
        for b in batches:
            for ev in decode_payload(encode_payload(b)).events:
                self.index.apply(self.stream, ev)
