"""Indexer restart-to-ready: from a snapshot, from a state dump, from a replay of every batch.

An engine holds a large state (``--prompts`` distinct 64-page prompts on device and host: 384k
(block, tier) entries at the default, like the 388k-key state of the service issue). A fresh
``IndexerService`` subscribes and the time until its index holds exactly the engine's residency is
measured three ways: the engine's replay buffer holds every batch (replay from seq 0); the buffer
holds only the last 100 (a state dump: each prompt publishes two batches, hence at least 100 prompts); and a
restart from the snapshot the previous service wrote on stop, with 80 batches published while it was down (resume
from the saved seq, after checking that the engine still holds the batch applied last: one batch more sent). The
first service synced by a dump, which leaves no batch to resume after, so a live batch reaches it before it stops,
as one always does from an engine at work. Each row says what the engine's replay socket sent meanwhile (replayed
batches, dumps): the snapshot's row replays and dumps nothing but the batches published while the service was down.

    python bench/restart_bench.py [--prompts 3000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from benchargs import count

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import ModeledDataPath
from kvtier.engine.node import EngineNode
from kvtier.indexer.service.app import IndexerService, ServiceConfig, parse_endpoint
from kvtier.wire import StorageTier

PS = 16


def engine(prompts: int, buffer: int) -> tuple[EngineNode, list[float]]:
    now = [0.0]
    cache = TieredCache(CacheConfig(page_size=PS, device_pages=prompts * 64 + 64, host_ratio=1.0),
                        ModeledDataPath(PS * 1024, lambda: now[0]))
    node = EngineNode(cache, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=buffer, clock=time.time)
    return node, now


def serve(node: EngineNode, now: list[float], i: int) -> None:
    cache = node.cache
    with node.lock:
        adm = cache.admit(f"r{i}", list(range(i * 100_000, i * 100_000 + 64 * PS)))
        cache.begin_prefill(adm)
        cache.finish_prefill(adm)
        cache.release(adm)
    node.flush()
    now[0] += 1.0
    node.step()


def truth(node: EngineNode) -> dict[StorageTier, set[int]]:
    with node.lock:
        return node.cache.residency()


def ready_time(node: EngineNode, cfg: ServiceConfig, svc: IndexerService | None = None) -> tuple[float,
                                                                                                 IndexerService]:
    """Seconds until a new service (or ``svc``, already running) holds exactly the engine's residency."""
    want = truth(node)
    counts = {t: len(h) for t, h in want.items()}
    t0 = time.perf_counter()
    if svc is None:
        svc = IndexerService(cfg)
        svc.start()
    stream = cfg.endpoints[0].stream
    while True:
        with svc._lock:  # (the counts first: cheap, and equal counts are not yet the same blocks)
            got = svc.index.block_counts(stream)
            if got == counts and svc.index.worker_hashes(stream) == want:
                return time.perf_counter() - t0, svc
        if time.perf_counter() - t0 > 300:
            raise SystemExit(f"not ready after 300 s: {got} vs {want}")
        time.sleep(0.01)


def sent(node: EngineNode, since: tuple[int, int, int]) -> str:
    """What the engine's replay socket sent since ``since`` (its messages, dumps and requests then): batches replayed
    or dumped (its messages less one end marker per request), and dumps answered."""
    st = node.publisher.replay_stats
    return f"{st.messages - since[0] - (st.requests - since[2])} batches sent, {st.dumps - since[1]} dumps"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=count(100), default=3000,
                    help="distinct 64-page prompts cached, at least 100: their 200 batches overflow the dump row's "
                         "buffer of 100 (default: 3000)")
    args = ap.parse_args()
    misses = 0
    for label, buffer in (("replay from seq 0", 1 << 30), ("state dump", 100)):
        dumps = label == "state dump"
        node, now = engine(args.prompts, buffer)
        for i in range(args.prompts):
            serve(node, now, i)
        pub = node.publisher
        ep = parse_endpoint(f"e0={pub.endpoint},replay={pub.replay_endpoint}" + (",dump" if dumps else ""))
        entries = sum(map(len, truth(node).values()))
        with tempfile.TemporaryDirectory() as d:
            snap = Path(d) / "index.snap"
            cfg = ServiceConfig(endpoints=[ep], block_size=PS, listen="127.0.0.1:0", replay_timeout_s=10.0,
                                snapshot_path=str(snap) if dumps else None)
            st = pub.replay_stats
            mark = (st.messages, st.dumps, st.requests)
            took, svc = ready_time(node, cfg)
            print(f"{label:<20} ready in {took:6.2f} s ({entries} block entries, {pub.last_seq + 1} batches published; "
                  f"{sent(node, mark)})")
            if dumps:
                serve(node, now, args.prompts + 40)  # a live batch: what the snapshot resumes after
                ready_time(node, cfg, svc)
            published = pub.last_seq + 1
            svc.stop()
            wrote = svc.snapshot_seconds
            if not dumps:
                node.close()
                continue
            for i in range(args.prompts, args.prompts + 40):  # 80 batches published while the service is down
                serve(node, now, i)
            mark = (st.messages, st.dumps, st.requests)
            took, svc = ready_time(node, cfg)
            print(f"{'from snapshot':<20} ready in {took:6.2f} s (snapshot {snap.stat().st_size / 1e6:.1f} MB, written "
                  f"in {wrote:.2f} s; {pub.last_seq + 1 - published} batches published since; "
                  f"{sent(node, mark)}, the first the check that the engine still holds the batch applied last)")
            resumed = pub.replay_stats.dumps == mark[1]
            misses += not resumed
            print(f"target: a restart from the snapshot resumes at its seq, no dump: {'MET' if resumed else 'MISS'}")
            svc.stop()
        node.close()
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
