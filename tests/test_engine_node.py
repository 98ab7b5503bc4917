"""An engine node publishing over real ZMQ; the indexer's view converges, dumps included."""

from __future__ import annotations

import time

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import Bandwidths, ModeledDataPath
from kvtier.engine.node import EngineNode
from kvtier.engine.storage import PageStore
from kvtier.indexer.consumer import IndexConsumer
from kvtier.indexer.index import TieredIndex
from kvtier.wire import EndpointConfig, ResyncNeeded, ResyncStarted, StorageTier, Subscriber

PS = 4


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
        pump(1.5)
    assert resyncs >= 1
    seen = index.worker_hashes(cfg.stream)
    assert seen == cache.residency()
    assert len(seen[StorageTier.DEVICE]) == 2 and not seen[StorageTier.HOST]  # only what followed the reset
    node.close()
