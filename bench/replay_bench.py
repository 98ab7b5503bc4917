"""Catch-up benchmark: a late subscriber converges on 10,000 buffered batches by replay.

For each publisher, N batches (16 blocks of 64 tokens each, a realistic size) are published
before the subscriber connects; the subscriber joins, reads slowly at first (an indexer busy
applying), and the time until the index holds every block is measured, with the number of
replay requests it took. Publishers: kvtier's own, and the real, unmodified ``ZmqEventPublisher``
of SGLang and of vLLM when their public ``kv_events.py`` is given (their few imports of the rest of
each package are stubbed; neither is a dependency of kvtier or its tests). SGLang's replay socket
keeps ZMQ's default high-water mark and drops what does not fit; the subscriber asks again from
the first missing seq.

    python bench/replay_bench.py [--batches 10000] [--sglang-kv-events PATH] [--vllm-kv-events PATH]

Get the files from the wheels, e.g. ``pip download --no-deps sglang==0.5.23`` and unzip
``sglang/srt/disaggregation/kv_events.py``; ``vllm==0.33.0``: ``vllm/distributed/kv_events.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import math
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchargs import at_least, count, existing_file

from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import BlockStored, EndpointConfig, EventBatch, Publisher, StorageTier, StreamId, Subscriber, WorkerId

BLOCKS, BS = 16, 64  # per batch; --blocks changes BLOCKS


def kvtier_batch(i: int) -> EventBatch:
    return EventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=list(range(i * BLOCKS + 1, (i + 1) * BLOCKS + 1)), parent_block_hash=None,
        token_ids=[i % 50_000 + 7] * (BLOCKS * BS), block_size=BS, medium="GPU")], dp_rank=0)


def _stub(name: str, **attrs: Any) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def load_peer(path: Path, name: str) -> types.ModuleType:
    """Imports a peer's ``kv_events.py`` with its imports of the rest of its package stubbed."""
    class _Addr:  # sglang.srt.utils.network.NetworkAddress, as far as the publisher uses it
        def __init__(self, host: str, port: int) -> None:
            self.host, self.port, self.is_ipv6 = host, port, False

        @classmethod
        def parse(cls, s: str) -> _Addr:
            host, _, port = s.rpartition(":")
            return cls(host, int(port))

        def to_tcp(self) -> str:
            return f"tcp://{self.host}:{self.port}"

    class _Config:  # vllm.config.kv_events.KVEventsConfig: the publisher only stores one
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    _stub("sglang.srt.runtime_context", get_parallel=lambda: types.SimpleNamespace(
        pp_rank=0, attn_tp_rank=0, attn_cp_rank=0))
    _stub("sglang.srt.utils.network", NetworkAddress=_Addr)
    _stub("vllm.config.kv_events", KVEventsConfig=_Config)
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub("vllm.utils.network_utils", get_ip=lambda: "127.0.0.1", get_tcp_uri=lambda h, p: f"tcp://{h}:{p}",
          is_valid_ipv6_address=lambda ip: False, split_zmq_path=lambda p: tuple(p.replace("//", "").split(":")))
    _stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=int)
    if "pydantic" not in sys.modules and importlib.util.find_spec("pydantic") is None:
        # SGLang's config model needs it; the publisher does not.
        _stub("pydantic", BaseModel=object)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot load {path}"
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def peer_publish(mod: types.ModuleType, n: int, ports: tuple[int, int], dp_kw: str) -> tuple[Any, int]:
    """Starts the peer's publisher, publishes n batches through it, waits until it sent them."""
    pub = mod.ZmqEventPublisher(**{dp_kw: 0}, endpoint=f"tcp://*:{ports[0]}",
                                replay_endpoint=f"tcp://*:{ports[1]}")
    for i in range(n):
        ev = mod.BlockStored(block_hashes=list(range(i * BLOCKS + 1, (i + 1) * BLOCKS + 1)), parent_block_hash=None,
                             token_ids=[i % 50_000 + 7] * (BLOCKS * BS), block_size=BS, lora_id=None, medium="GPU",
                             **({"lora_name": None} if dp_kw == "data_parallel_rank" else {}))
        pub.publish(mod.KVEventBatch(ts=time.time(), events=[ev]))
    while pub._event_queue.qsize():  # the peer's own thread sends from its queue
        time.sleep(0.01)
    time.sleep(0.2)
    return pub, n


def converge(cfg: EndpointConfig, n: int, slow_s: float, timeout: float = 120.0) -> tuple[float, int, int]:
    """Joins late and returns (seconds until the index holds all n batches' blocks, replay requests, resyncs)."""
    index = TieredIndex(BS)
    index.add_worker(cfg.stream)
    consumer = IndexConsumer(index)
    want = n * BLOCKS
    t0 = time.perf_counter()
    with Subscriber([cfg]) as sub:
        time.sleep(slow_s)  # the catch-up request is out; nobody reads for a while
        deadline = time.monotonic() + timeout
        while index.block_counts(cfg.stream)[StorageTier.DEVICE] < want and time.monotonic() < deadline:
            consumer.feed(sub.poll(20))
        took = time.perf_counter() - t0
        st = sub.stats(cfg.stream)
        got = index.block_counts(cfg.stream)[StorageTier.DEVICE]
        if got < want:
            print(f"  did not converge: {got} of {want} blocks after {timeout:.0f} s")
        return took if got >= want else math.inf, st.reasks + 1, st.resyncs


def run(label: str, make: Callable[[], tuple[EndpointConfig, Callable[[], None]]], n: int, repeat: int,
        slow_s: float) -> bool:
    """One publisher's row; False if a run did not converge."""
    times, asks, resyncs = [], [], []
    for _ in range(repeat):
        cfg, close = make()
        try:
            t, a, r = converge(cfg, n, slow_s)
        finally:
            close()
        times.append(t)
        asks.append(a)
        resyncs.append(r)
    failed = sum(math.isinf(t) for t in times)
    took = f"converged in {statistics.median(times):6.2f} s" if not failed else \
        f"did NOT converge in {failed} of {repeat} runs"
    print(f"{label:<28} {took} (median of {repeat}, {slow_s:.1f} s of it not reading), replay requests {asks}, "
          f"resyncs {resyncs}")
    return not failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=count(), default=10_000, help="batches buffered before the join (default: 10000)")
    ap.add_argument("--repeat", type=count(), default=3, help="runs per publisher (default: 3)")
    ap.add_argument("--slow", type=at_least(0), default=1.0, help="seconds not reading after the join (default: 1)")
    ap.add_argument("--blocks", type=count(), default=16, help="blocks of 64 tokens per batch (default: 16)")
    ap.add_argument("--sglang-kv-events", type=existing_file, help="SGLang's sglang/srt/disaggregation/kv_events.py")
    ap.add_argument("--vllm-kv-events", type=existing_file, help="vLLM's vllm/distributed/kv_events.py")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    global BLOCKS
    BLOCKS = args.blocks
    n = args.batches
    stream = StreamId(WorkerId("w0"))

    def make_kvtier() -> tuple[EndpointConfig, Callable[[], None]]:
        p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=max(n, 1))
        for i in range(n):
            p.publish(kvtier_batch(i))
        return EndpointConfig(stream.worker, p.endpoint, p.replay_endpoint), p.close

    print(f"{n} batches of {BLOCKS} blocks x {BS} tokens buffered before a subscriber joins")
    ok = run("kvtier Publisher", make_kvtier, n, args.repeat, args.slow)
    for label, path, dp_kw in (("SGLang ZmqEventPublisher", args.sglang_kv_events, "attn_dp_rank"),
                               ("vLLM ZmqEventPublisher", args.vllm_kv_events, "data_parallel_rank")):
        if path is None:
            print(f"{label:<28} skipped (pass --{label.split()[0].lower()}-kv-events PATH)")
            continue
        mod = load_peer(path, f"peer_{label.split()[0].lower()}")
        port = [21000 + (0 if dp_kw == "attn_dp_rank" else 100)]

        def make_peer(mod: types.ModuleType = mod, dp_kw: str = dp_kw, port: list[int] = port
                      ) -> tuple[EndpointConfig, Callable[[], None]]:
            port[0] += 2
            pub, _ = peer_publish(mod, n, (port[0], port[0] + 1), dp_kw)
            cfg = EndpointConfig(stream.worker, f"tcp://127.0.0.1:{port[0]}", f"tcp://127.0.0.1:{port[0] + 1}")
            return cfg, pub.shutdown

        ok = run(label, make_peer, n, args.repeat, args.slow) and ok
    print(f"target: every run converges (the peers' publishers beside kvtier's where given): {'MET' if ok else 'MISS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
