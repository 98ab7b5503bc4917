"""Engine <-> indexer consistency under arbitrary operations (hypothesis state machines).

Three engines on a manual clock (each with a local disk, or all sharing an external pool) are
driven through arbitrary sequences of requests that share prefixes, held locks, evictions, copies
acknowledged at arbitrary moments (so nodes split while their copies are in flight), load-backs,
L3 writes and prefetches, sliding-window tombstones (SWA configurations), and resets. Every event
batch goes through the real codec bytes into one TieredIndex. After every step, for every worker
and tier, the index's view equals the engine's ``residency()``, ``find_matches`` equals the
overlaps read from the engines, and both ``_check()`` pass. With SWA, the engines also publish their window
KV (kvtier's extension events): the index's window view equals the engine's ``window_residency()``, a
window-aware query equals the engine's ``usable_overlap()``, and a request's device-cached prefix at
prefill is exactly that usable depth.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kvtier.engine.cache import Admission, CacheConfig, PrefetchPolicy, TieredCache, WritePolicy
from kvtier.engine.config import Eviction
from kvtier.engine.datapath import Bandwidths, ModeledDataPath
from kvtier.engine.l3.storage import PageStore
from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire import StorageTier, WorkerId, decode_payload, encode_payload
from kvtier.wire.notices import StreamId
from tests.conftest import SLOW

PS = 2
# Documents share prefixes: B and C start like A, D is unrelated. Requests take a prefix of one
# document, sometimes with a private tail, so matches split nodes at arbitrary pages.
A = list(range(100, 124))
DOCS = [A, A[:8] + list(range(200, 216)), A[:14] + list(range(300, 310)), list(range(400, 424))]
BW = Bandwidths(d2h=1e3, h2d=1e3, storage_write=1e3, storage_read=1e3, latency_s=1e-6)  # 1 page/s
POLICIES = list(WritePolicy)
STEPS: list[int] = []  # one entry per checked step, for the report in the issue note


class Cluster:
    def __init__(self, policy: WritePolicy, l3: str, swa: bool = False, eviction: Eviction = Eviction.NODE) -> None:
        self.now = 0.0
        self.index = TieredIndex(PS)
        # The index treats a shared pool as reachable from every worker, so a cluster has one for all
        # of them (l3="external") or none (each worker its own disk).
        pool = PageStore(24, shared=True)
        stores = [pool, pool, pool] if l3 == "external" else [PageStore(16) for _ in range(3)]
        self.caches: list[TieredCache] = []
        self.streams: list[StreamId] = []
        for i, store in enumerate(stores):
            cfg = CacheConfig(page_size=PS, device_pages=10, host_ratio=1.6, write_policy=policy,
                              selective_threshold=1, prefetch_policy=PrefetchPolicy.BEST_EFFORT,
                              swa_window_pages=2 if swa else 0, swa_pages=5, eviction=eviction)
            dp = ModeledDataPath(1000, lambda: self.now, BW)
            self.caches.append(TieredCache(cfg, dp, store, name=f"w{i}"))
            self.streams.append(StreamId(WorkerId(f"w{i}")))
            self.index.add_worker(self.streams[-1])

    def deliver(self) -> None:
        for cache, stream in zip(self.caches, self.streams, strict=True):
            batch = cache.flush_events(ts=self.now)
            if batch is None:
                continue
            for ev in decode_payload(encode_payload(batch)).events:
                outcome = self.index.apply(stream, ev)
                assert outcome is Outcome.APPLIED, (stream, ev, self.index.stats(stream).last_error)

    def check(self, queries: list[list[int]]) -> None:
        for cache in self.caches:
            cache._check()
        self.index._check()
        # An honest engine's events never break the index midway (it would contain it, and drop the worker).
        assert not [s for s in self.streams if self.index.stats(s).internal_errors], "the index raised on an event"
        for cache, stream in zip(self.caches, self.streams, strict=True):
            seen, truth = self.index.worker_hashes(stream), cache.residency()
            for tier in StorageTier:
                assert seen[tier] == truth[tier], (stream, tier, seen[tier] ^ truth[tier])
            if cache.config.swa_window_pages:
                win_seen, win_truth = self.index.window_hashes(stream), cache.window_residency()
                for tier, held in win_truth.items():
                    assert win_seen[tier] == held, (stream, "window", tier, win_seen[tier] ^ held)
        for q in queries:
            m = self.index.find_matches(q)
            keys = self.index.request_keys(q)
            usable = self.index.find_matches_keys(keys, window_aware=True)
            for cache, stream in zip(self.caches, self.streams, strict=True):
                assert m.workers[stream] == cache.peek_overlap(q), (stream, q)
                assert usable.workers[stream] == cache.usable_overlap(q), (stream, q, usable.raw.get(stream))


class Consistency(RuleBasedStateMachine):
    holds = Bundle("holds")

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[list[int]] = [d[: k * PS] for d in DOCS for k in (1, 3, 7, 12)]

    @initialize(policy=st.sampled_from(POLICIES), l3=st.sampled_from(["disk", "external"]), swa=st.booleans(),
                eviction=st.sampled_from(list(Eviction)))
    def start(self, policy: WritePolicy, l3: str, swa: bool, eviction: Eviction = Eviction.NODE) -> None:
        self.c = Cluster(policy, l3, swa, eviction)

    @staticmethod
    def _tokens(doc: int, pages: int, tail: int) -> list[int]:
        return DOCS[doc][: pages * PS] + [900 + doc * 10 + tail + i for i in range(PS * (tail > 0))]

    @rule(w=st.integers(0, 2), doc=st.integers(0, 3), pages=st.integers(1, 12), tail=st.integers(0, 2))
    def request(self, w: int, doc: int, pages: int, tail: int) -> None:
        cache = self.c.caches[w]
        tokens = self._tokens(doc, pages, tail)
        usable = cache.usable_overlap(tokens).device
        adm = cache.admit("r", tokens)
        plan = cache.begin_prefill(adm)
        if plan is not None:
            assert plan.cached_tokens == usable * PS, (plan, usable)  # the engine reuses what the index says
            cache.finish_prefill(adm)
        cache.release(adm)
        self.c.deliver()

    @rule(target=holds, w=st.integers(0, 2), doc=st.integers(0, 3), pages=st.integers(1, 12))
    def hold(self, w: int, doc: int, pages: int) -> tuple[int, Admission]:
        adm = self.c.caches[w].admit("held", self._tokens(doc, pages, 0))
        self.c.deliver()
        return (w, adm)

    @rule(held=consumes(holds))
    def release(self, held: tuple[int, Admission]) -> None:
        w, adm = held
        self.c.caches[w].release(adm)  # also after a reset: it unlocks nodes of the old tree
        self.c.deliver()

    @rule(dt=st.sampled_from([0.5, 1.0, 2.5, 10.0]))
    def advance(self, dt: float) -> None:
        self.c.now += dt
        for cache in self.c.caches:
            cache.poll()
        self.c.deliver()

    @rule(w=st.integers(0, 2), pages=st.integers(1, 10), host=st.booleans())
    def evict(self, w: int, pages: int, host: bool) -> None:
        cache = self.c.caches[w]
        (cache.evict_host if host else cache.evict_device)(pages)
        self.c.deliver()

    @rule(w=st.integers(0, 2))
    def dump_into_fresh_index(self, w: int) -> None:
        """A state dump, applied to an index that knows nothing, rebuilds the worker exactly: every
        dumped store's parent comes first (dumps are prefix-closed, shared pools included)."""
        cache, stream = self.c.caches[w], self.c.streams[w]
        fresh = TieredIndex(PS)
        for batch in cache.dump_events():
            for ev in decode_payload(encode_payload(batch)).events:
                assert fresh.apply(stream, ev) is Outcome.APPLIED, (stream, ev, fresh.stats(stream).last_error)
        seen, truth = fresh.worker_hashes(stream), cache.residency()
        for tier in StorageTier:
            assert seen[tier] == truth[tier], (stream, tier, seen[tier] ^ truth[tier])
        if cache.config.swa_window_pages:
            assert fresh.window_hashes(stream) == cache.window_residency()

    @rule()
    def router_restarts_from_a_snapshot(self) -> None:
        """The router's index is saved between batches and restored (a restarted service): the views, window KV
        and whether queries may binary-search included, must carry on exactly (the invariant checks them after
        this step and every later one). Links to blocks nobody holds any more are not carried (readers skip
        them), so the bytes of a second snapshot may differ."""
        closed = self.c.index._closure.closed
        self.c.index = TieredIndex.restore(self.c.index.snapshot())
        assert self.c.index._closure.closed == closed, "a restored index lost (or gained) prefix-closure"

    @rule(w=st.integers(0, 2))
    def reset(self, w: int) -> None:
        self.c.caches[w].reset()
        self.c.deliver()

    @invariant()
    def views_agree(self) -> None:
        if hasattr(self, "c"):
            self.c.check(self.queries)
            STEPS.append(1)


Consistency.TestCase.settings = settings(max_examples=3000 if SLOW else 400, stateful_step_count=100 if SLOW else 60,
                                         deadline=None)
TestConsistency = Consistency.TestCase


def test_a_prefetched_chain_loads_back_without_evicting_its_own_parent() -> None:
    """A fixed sequence of steps; the machine checks its invariant after each. In a shared pool, worker 2's
    request for doc 3 prefetches its first two pages from L3 (written by worker 0) and loads them back; a longer
    request for doc 3 prefetches four, and when they land the first two are on device, held by no request (they
    came below what each request held at admission). Loading the next node must not make room by evicting that
    parent, a device leaf then: the child would land on device under a parent that is not."""
    m = Consistency()
    steps: list[Callable[[], object]] = [
        lambda: m.start(policy=WritePolicy.WRITE_BACK, l3="external", swa=False),
        lambda: m.request(w=0, doc=3, pages=4, tail=0),
        lambda: m.request(w=0, doc=0, pages=10, tail=0),
        *[lambda: m.advance(1.0)] * 2,
        *[lambda: m.advance(2.5)] * 3,
        lambda: m.hold(w=2, doc=3, pages=2),
        lambda: m.request(w=2, doc=0, pages=6, tail=0),
        lambda: m.advance(1.5),
        lambda: m.request(w=2, doc=0, pages=1, tail=2),
        lambda: m.hold(w=2, doc=3, pages=10),
        lambda: m.advance(1.0),
        lambda: m.advance(10.0),
        lambda: m.advance(2.5),
    ]
    for step in steps:
        step()
        m.views_agree()
