"""A live engine process: replays a trace through a real EngineNode in wall-clock time.

It publishes the cache's events over ZMQ (with replay and state dumps), so an indexer
service can be tried, or tested, against real engines. Prompts are "computed" instantly;
copies complete after their modeled transfer time on the wall clock. When the trace is
done the process writes its residency (per tier, the event hashes it holds) as JSON and
keeps serving replay and dump requests until SIGTERM or ``--hold`` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from kvtier.engine.cache import CacheConfig, TieredCache
from kvtier.engine.datapath import Bandwidths, ModeledDataPath
from kvtier.engine.node import EngineNode
from kvtier.engine.storage import PageStore
from kvtier.sim.experiment import resolve_trace
from kvtier.sim.trace import TokenBank


def write_residency(cache: TieredCache, path: Path) -> None:
    data = {t.name: sorted(hs) for t, hs in cache.residency().items()}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".res-")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    trace = resolve_trace(args.trace, seed=args.seed, time_scale=1.0 / args.speed)
    cfg = CacheConfig(page_size=args.page_size, device_pages=args.device_pages, host_ratio=args.host_ratio)
    dp = ModeledDataPath(args.page_size * 1024, time.monotonic, Bandwidths(d2h=2e8, h2d=2e8, storage_write=5e7,
                                                                             storage_read=5e7))
    store = PageStore(args.disk_pages) if args.disk_pages else None
    cache = TieredCache(cfg, dp, store, name=args.name)
    node = EngineNode(cache, args.endpoint, args.replay, dp_rank=args.dp_rank)
    bank = TokenBank(seed=args.seed)
    print(f"engine {args.name}: publishing on {node.publisher.endpoint}, replay {node.publisher.replay_endpoint}, "
          f"{len(trace)} requests", flush=True)
    t0 = time.monotonic()
    try:
        for req in trace:
            while not stop["now"] and time.monotonic() - t0 < req.arrival:
                node.step()
                time.sleep(0.002)
            if stop["now"]:
                break
            with node.lock:
                adm = cache.admit(req.request_id, bank.tokens(req))
                if cache.begin_prefill(adm) is not None:
                    cache.finish_prefill(adm)
                cache.release(adm)
            node.flush()
        while dp.ops and not stop["now"]:
            node.step()
            time.sleep(0.002)
        node.step()
        if args.residency:
            with node.lock:
                write_residency(cache, Path(args.residency))
        deadline = time.monotonic() + args.hold
        while not stop["now"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the publisher's thread keeps answering replay and dump requests
    finally:
        node.close()
    return 0


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="kvtier engine", description=__doc__)
    p.add_argument("--name", default="w0", help="engine name (the worker id an indexer should use)")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint to bind")
    p.add_argument("--replay", default="tcp://127.0.0.1:5558", help="ROUTER replay endpoint to bind")
    p.add_argument("--dp-rank", type=int, default=None, help="data-parallel rank carried in each batch")
    p.add_argument("--trace", default="builtin:chat:300", help="trace file or builtin:KIND[:N]")
    p.add_argument("--seed", type=int, default=0, help="seed of builtin traces and token ids")
    p.add_argument("--speed", type=float, default=10.0, help="replay speed-up over the trace's timestamps")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--device-pages", type=int, default=4096, help="device KV pages")
    p.add_argument("--host-ratio", type=float, default=2.0, help="host / device capacity (0: no host)")
    p.add_argument("--disk-pages", type=int, default=16384, help="local L3 pages (0: none)")
    p.add_argument("--residency", help="write the final residency as JSON here")
    p.add_argument("--hold", type=float, default=3600.0, help="seconds to keep serving after the trace")
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
