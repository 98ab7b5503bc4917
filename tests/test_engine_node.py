"""An engine node publishing over real ZMQ; the indexer's view converges, dumps included."""

from __future__ import annotations

import time
from collections.abc import Iterator

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import Bandwidths, ModeledDataPath
from kvtier.engine.l3.storage import PageStore
from kvtier.engine.node import EngineNode
from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import EndpointConfig, EventBatch, ResyncNeeded, ResyncStarted, StorageTier, Subscriber

PS = 4


def dumping_node(*, device_pages: int, host_ratio: float) -> tuple[EngineNode, list[float]]:
    """An engine node on loopback whose replay buffer (8 batches) is soon outrun, so that an indexer joining late
    needs a state dump; and the clock of its modeled copies, moved by hand."""
    now = [0.0]
    dp = ModeledDataPath(1000, lambda: now[0], Bandwidths(1e6, 1e6, 1e6, 1e6, 1e-6))
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=device_pages, host_ratio=host_ratio), dp)
    return EngineNode(cache, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=8), now


def serve_one(node: EngineNode, now: list[float], i: int, *, pages: int, step_s: float) -> None:
    """Request ``i`` (``pages`` pages of tokens its own) admitted, prefilled and released; then the clock moves on
    ``step_s`` and the node publishes what its copies changed."""
    cache = node.cache
    with node.lock:
        adm = cache.admit(f"r{i}", list(range(i * 1000, i * 1000 + PS * pages)))
        if cache.begin_prefill(adm) is not None:
            cache.finish_prefill(adm)
        cache.release(adm)
    now[0] += step_s
    node.step()


def test_index_converges_through_gaps_and_dumps() -> None:
    now = [0.0]
    dp = ModeledDataPath(1000, lambda: now[0], Bandwidths(1e6, 1e6, 1e6, 1e6, 1e-6))
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=16, host_ratio=1.0), dp, PageStore(32))
    node = EngineNode(cache, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=4)
    cfg = EndpointConfig("e0", node.publisher.endpoint, node.publisher.replay_endpoint, supports_dump=True)
    index = TieredIndex(PS)
    consumer = IndexConsumer(index)
    resyncs = 0
    with Subscriber([cfg], replay_timeout_s=1.0) as sub:

        def pump(seconds: float) -> None:
            nonlocal resyncs
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                out = sub.poll(10)
                resyncs += sum(isinstance(d, ResyncStarted | ResyncNeeded) for d in out)
                consumer.feed(out)

        def converged() -> bool:
            """The index holds the engine's residency, which a resync brought back (the run of lost batches is
            longer than the replay buffer)."""
            return resyncs >= 1 and index.worker_hashes(cfg.stream) == cache.residency()

        pump(0.2)
        # Lose single batches (replay recovers them) and a run longer than the replay buffer (dump).
        node.publisher.live_filter = lambda s: s % 9 != 3 and not 30 <= s < 40
        for i in range(40):
            tokens = list(range(i % 7 * 100, i % 7 * 100 + PS * (1 + i % 5)))
            with node.lock:
                adm = cache.admit(f"r{i}", tokens)
            node.flush()
            now[0] += 0.01
            node.step()
            with node.lock:
                if cache.begin_prefill(adm) is not None:
                    cache.finish_prefill(adm)
                cache.release(adm)
            node.flush()
            pump(0.01)
        node.publisher.live_filter = None
        now[0] += 1.0
        node.step()
        with node.lock:
            cache.reset()
            adm = cache.admit("last", list(range(PS * 2)))
            assert cache.begin_prefill(adm) is not None
            cache.finish_prefill(adm)
        node.flush()
        # Until it converges (replays, a dump and their timeouts run on the wall clock: a loaded machine is slower
        # at them, never wrong), then a while on: it stays so.
        deadline = time.monotonic() + 60.0
        while not converged():
            assert time.monotonic() < deadline, f"the index did not converge after {resyncs} resyncs"
            pump(0.01)
        pump(0.2)
    assert converged()
    seen = index.worker_hashes(cfg.stream)
    assert len(seen[StorageTier.DEVICE]) == 2 and not seen[StorageTier.HOST]  # only what followed the reset
    node.close()


def test_two_indexers_one_dumping_one_probing_both_converge() -> None:
    """Indexer A joins late (past the replay buffer) and needs a dump that takes a second to build;
    indexer B is in sync and probes every 50 ms with a 200 ms timeout. B's probes are answered
    while A's dump is built, and even unanswered they never clear B; both end exact."""
    node, now = dumping_node(device_pages=4096, host_ratio=1.0)
    cache, build = node.cache, node.publisher._dump_provider
    assert build is not None

    def slow_dump() -> tuple[int, Iterator[EventBatch]]:
        time.sleep(1.0)  # a large engine's snapshot and first batches
        seq, batches = build()
        return seq, iter(batches)

    node.publisher._dump_provider = slow_dump
    cfg = EndpointConfig("e0", node.publisher.endpoint, node.publisher.replay_endpoint, supports_dump=True)
    idx_a, idx_b = TieredIndex(PS), TieredIndex(PS)
    con_a, con_b = IndexConsumer(idx_a), IndexConsumer(idx_b)

    def serve(i: int) -> None:
        serve_one(node, now, i, pages=8, step_s=0.05)

    with Subscriber([cfg], replay_timeout_s=0.2) as sub_b:
        tracker_b = sub_b._conns[cfg.stream].tracker
        tracker_b.probe_s = 0.05
        # B's catch-up from seq 0 is answered before the engine publishes: else, on a slow start, the 8-batch buffer
        # can move past seq 0 before the answer goes out, and B would need a dump, which this test is not about.
        deadline = time.monotonic() + 5.0
        while tracker_b.recovering and time.monotonic() < deadline:
            con_b.feed(sub_b.poll(10))
        assert not tracker_b.recovering, "B's catch-up was not answered"
        for i in range(200):  # B follows live from the start
            serve(i)
            con_b.feed(sub_b.poll(1))
        # A joins 200+ batches late. Its timeout is far past the dump's second: a loaded machine may take several
        # to build and send it, and a dump asked again would restart it.
        with Subscriber([cfg], replay_timeout_s=60.0) as sub_a:
            deadline = time.monotonic() + 60.0
            i = 200
            while i < 260 or not (idx_a.worker_hashes(cfg.stream) == idx_b.worker_hashes(cfg.stream)
                                  == cache.residency()):
                assert time.monotonic() < deadline, f"A or B did not converge: {sub_a.stats(cfg.stream)}"
                if i < 260:
                    serve(i)
                    i += 1
                con_a.feed(sub_a.poll(5))
                con_b.feed(sub_b.poll(5))
            for _ in range(20):  # a while on: they stay so (B's probes go on)
                con_a.feed(sub_a.poll(5))
                con_b.feed(sub_b.poll(5))
            truth = cache.residency()
            assert sub_a.stats(cfg.stream).resyncs == 1 and idx_a.worker_hashes(cfg.stream) == truth
        st_b = sub_b.stats(cfg.stream)
        assert st_b.resyncs == 0 and idx_b.stats(cfg.stream).clears == 0
        assert idx_b.worker_hashes(cfg.stream) == truth and not idx_b.is_partial(cfg.stream)
    node.close()


def test_a_dump_cut_short_is_asked_again_and_the_index_converges() -> None:
    """The first dump answer stops after two of its batches (its provider fails: no end marker), and the engine
    evicts and stores while the indexer waits. The indexer must not take the part it got for the whole: it asks
    again after its timeout, starts over from the new answer, and ends with the engine's residency exactly,
    none of the first answer's evicted blocks left."""
    node, now = dumping_node(device_pages=1200, host_ratio=0.0)
    cache, build = node.cache, node.publisher._dump_provider
    assert build is not None

    def serve(i: int) -> None:
        serve_one(node, now, i, pages=2, step_s=0.01)

    first_part: set[int] = set()
    calls = [0]

    def cut_short(seq: int, batches: Iterator[EventBatch]) -> Iterator[EventBatch]:
        for _ in range(2):
            b = next(batches)
            first_part.update(h for ev in b.events for h in getattr(ev, "block_hashes", ()))
            yield b
        for i in range(600, 800):  # the engine goes on: 400 new pages evict 400 of the 1,200 dumped
            serve(i)
        raise RuntimeError("dump cut short")

    def dump() -> tuple[int, Iterator[EventBatch]]:
        calls[0] += 1
        seq, batches = build()
        return (seq, cut_short(seq, iter(batches))) if calls[0] == 1 else (seq, iter(batches))

    node.publisher._dump_provider = dump
    for i in range(600):  # 1,200 pages, published before the indexer joins: far past the replay buffer
        serve(i)
    cfg = EndpointConfig("e0", node.publisher.endpoint, node.publisher.replay_endpoint, supports_dump=True)
    index = TieredIndex(PS)
    consumer = IndexConsumer(index)
    with Subscriber([cfg], replay_timeout_s=0.5) as sub:
        end = time.monotonic() + 6.0
        while time.monotonic() < end and not (calls[0] == 2 and index.worker_hashes(cfg.stream) == cache.residency()):
            consumer.feed(sub.poll(10))
        st = sub.stats(cfg.stream)
    truth = cache.residency()
    assert calls[0] == 2 and node.publisher.replay_stats.dump_errors == 1
    assert len(first_part) == 2 * 256 * 2, "the first answer did not stop after two batches"
    assert first_part - truth[StorageTier.DEVICE], "nothing the first answer named was evicted"
    assert index.worker_hashes(cfg.stream) == truth and not index.is_partial(cfg.stream)
    assert st.resyncs == 1
    node.close()
