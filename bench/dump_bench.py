"""State-dump benchmark: how long a dump holds the engine lock, and how fast it streams.

A large engine (device and host tiers full of distinct 64-page prompts) answers a DUMP request
over real ZMQ while another client sends a replay request. Printed: the engine lock hold of the
snapshot against building every event under the lock (what dumps did before), the time to the
dump's first frame and to its end, and how long the other client's replay waited.

    python bench/dump_bench.py [--prompts 2000] [--page-size 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import zmq
from benchargs import count

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import ModeledDataPath
from kvtier.engine.node import EngineNode
from kvtier.wire.protocol import EventBatch
from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq


def build(prompts: int, ps: int) -> TieredCache:
    now = [0.0]
    dp = ModeledDataPath(ps * 1024, lambda: now[0])
    cache = TieredCache(CacheConfig(page_size=ps, device_pages=prompts * 64, host_ratio=1.0), dp)
    for i in range(prompts):
        adm = cache.admit(f"r{i}", list(range(i * 100_000, i * 100_000 + 64 * ps)))
        cache.begin_prefill(adm)
        cache.finish_prefill(adm)
        cache.release(adm)
        now[0] += 1.0
        cache.poll()
        cache.flush_events()
    return cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=count(), default=2000, help="distinct 64-page prompts cached (default: 2000)")
    ap.add_argument("--page-size", type=count(), default=16, help="tokens per page (default: 16)")
    ap.add_argument("--repeat", type=count(), default=3, help="runs; medians are printed (default: 3)")
    args = ap.parse_args()
    cache = build(args.prompts, args.page_size)
    full, snap = [], []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        cache.dump_events()
        full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cache.dump_snapshot()
        snap.append(time.perf_counter() - t0)
    print(f"engine: {args.prompts} prompts x 64 pages of {args.page_size} tokens, device and host")
    print(f"lock held by a dump: snapshot {statistics.median(snap) * 1e3:.1f} ms, "
          f"building every event (before) {statistics.median(full) * 1e3:.1f} ms")

    node = EngineNode(cache, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    node.publisher.publish(EventBatch(ts=time.time(), events=[]))  # a dump's seq frame is the last live seq
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    first, end, other_wait, frames = [], [], [], 0
    try:
        for _ in range(args.repeat):
            dumper, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
            for s in (dumper, other):
                s.setsockopt(zmq.RCVHWM, 0)
                s.connect(node.publisher.replay_endpoint or "")
            time.sleep(0.1)
            t0 = time.perf_counter()
            dumper.send_multipart([b"", DUMP_REQUEST])
            other.send_multipart([b"", pack_seq(0)])
            while other.recv_multipart()[-2] != END_SEQ:  # the one buffered batch, then the end
                pass
            other_wait.append(time.perf_counter() - t0)
            msg = dumper.recv_multipart()
            first.append(time.perf_counter() - t0)
            frames = 1
            while msg[-2] != END_SEQ:
                msg = dumper.recv_multipart()
                frames += 1
            end.append(time.perf_counter() - t0)
            dumper.close(0)
            other.close(0)
    finally:
        node.close()
    print(f"dump over ZMQ: {frames} messages, first frame {statistics.median(first) * 1e3:.1f} ms, "
          f"end {statistics.median(end) * 1e3:.0f} ms")
    print(f"another client's replay request sent beside the dump answered in "
          f"{statistics.median(other_wait) * 1e3:.1f} ms (before: after the whole dump)")
    print("target: none set; what a dump costs, and that it holds up no other client's answer")


if __name__ == "__main__":
    main()
