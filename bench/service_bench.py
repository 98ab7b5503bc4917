"""Indexer service benchmark: the HTTP front end under load while the index applies live events.

Three processes: ``kvtier indexer`` (the service, as users run it), 8 publishers streaming KV events
at it, and this load generator (aiohttp keep-alive connections, on uvloop where installed: it shares the
machine's cores with the service, so the leaner it is, the more the figures are the service's). Printed:

1. 200 concurrent keep-alive connections, each sending queries back to back: errors and resets
   (target: 0 and 0).
2. An open-loop load of ``--rate`` queries/s of 2,048 tokens (send times fixed in advance, so a slow
   answer delays no later send and latency includes queueing): p50 / p99 (target p99 <= 50 ms at
   1,000 q/s).
3. The highest offered rate, stepping up, that still holds p99 <= 50 ms.

Under each open-loop run, where its time went: how late this client sent (its own stalls count in the
latency), and from the service's latency histograms (``/metrics``) the p99 and max of its time per query,
requests' waits for the index lock, event batches' waits for it and holds of it, and its HTTP loop's lag.

Each open-loop run begins 2 s after the one before it ends, events flowing throughout: the closed-loop burst
of step 1 saturates both cores, and a run begun at once would measure the service catching up with the
publishers' backlog as much as its steady state. Each run's client opens 64 keep-alive connections before its
clock starts, as a router keeps a warm pool.

Each target prints MET or MISS beside it, and the run exits 1 if one is missed. No peer is run beside it: none of
them serves these queries over HTTP.

    python bench/service_bench.py [--rate 1000] [--seconds 5] [--events-per-s 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from benchargs import count, positive

TOKENS, BS, DOCS, PUBLISHERS = 2048, 16, 64, 8
SETTLE_S = 2.0  # pause before each open-loop run, events still flowing
WARM_CONNECTIONS = 64  # keep-alive connections each open-loop run opens before its clock starts
_T = TypeVar("_T")

PUBLISHER_SCRIPT = """
import random, sys, time
from kvtier.wire import BlockStored, EventBatch, Publisher
rate, docs, tokens, bs = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pubs = [Publisher(f"tcp://127.0.0.1:{p}") for p in sys.argv[5:]]
rng = random.Random(0)
doc = lambda d: [(d * 7919 + i) % 50000 + 10 for i in range(tokens)]
period, nxt, h = 1.0 / rate, time.monotonic(), 1
while True:
    for p in pubs:
        d, n = rng.randrange(docs), rng.randrange(1, tokens // bs + 1)
        hashes = list(range(h, h + n)); h += n
        p.publish(EventBatch(ts=time.time(), events=[BlockStored(block_hashes=hashes, parent_block_hash=None,
                  token_ids=doc(d)[: n * bs], block_size=bs, medium="GPU")]))
    nxt += period
    time.sleep(max(0.0, nxt - time.monotonic()))
"""


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Runs the load generator's coroutine on uvloop where installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def bodies() -> list[bytes]:
    return [json.dumps({"token_ids": [(d * 7919 + i) % 50000 + 10 for i in range(TOKENS)]}).encode()
            for d in range(DOCS)]


async def hammer(url: str, conns: int, per_conn: int, payloads: list[bytes]) -> tuple[int, int, float]:
    """``conns`` keep-alive connections, each sending ``per_conn`` queries back to back."""
    errors = resets = 0
    connector = aiohttp.TCPConnector(limit=conns, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def one(i: int) -> None:
            nonlocal errors, resets
            for k in range(per_conn):
                try:
                    async with s.post(url, data=payloads[(i + k) % len(payloads)],
                                      headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        errors += r.status != 200
                except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                    resets += 1
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(conns)))
        return errors, resets, conns * per_conn / (time.perf_counter() - t0)


async def open_loop(url: str, rate: float, seconds: float,
                    payloads: list[bytes]) -> tuple[list[float], list[float], int]:
    """Sends at fixed times (``rate`` per second); returns latencies from the scheduled send, how late each
    send left this client (its own stalls, which the latency includes), and errors."""
    lat: list[float] = []
    late: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=512)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:

        async def one(at: float, body: bytes) -> None:
            nonlocal errors
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            late.append(time.perf_counter() - at)
            try:
                async with s.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    errors += r.status != 200
            except (aiohttp.ClientError, TimeoutError):
                errors += 1
                return
            lat.append(time.perf_counter() - at)

        # Warm connections first, as a router keeps them: otherwise the run's first hiccup makes the client
        # open dozens of connections at once, and their setup (both sides, on these 2 cores) is measured.
        async def warm() -> None:
            async with s.get(url.rsplit("/", 1)[0] + "/health") as r:
                await r.read()

        await asyncio.gather(*(warm() for _ in range(WARM_CONNECTIONS)))
        start = time.perf_counter() + 0.2
        n = int(rate * seconds)
        await asyncio.gather(*(one(start + i / rate, payloads[i % len(payloads)]) for i in range(n)))
    return lat, late, errors


def metrics(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/metrics?format=json") as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def p(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def hist_ms(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``p99/max`` (ms, the upper bounds of their buckets) of what a service histogram counted between two
    metrics reads."""
    counts = [y[1] - x[1] for x, y in zip(before["buckets"], after["buckets"], strict=True)]
    total = counts[-1]
    if not total:
        return "-"
    per = [n - m for n, m in zip(counts, [0, *counts[:-1]], strict=True)]  # cumulative -> per bucket
    bounds = [float("inf") if le is None else le * 1e3 for le, _ in after["buckets"]]
    p99 = next(b for b, n in zip(bounds, counts, strict=True) if n >= 0.99 * total)
    top = max(b for b, n in zip(bounds, per, strict=True) if n)
    return f"{p99:g}/{top:g}"


def where(m0: dict[str, Any], m1: dict[str, Any], late: list[float]) -> str:
    """Where a run's time went: the client's own send delay, and the service's time per query, its wait for
    the index lock, event batches' waits for it (queries holding up event application) and holds of it, and
    the HTTP loop's lag (p99/max bucket bounds, ms; see kvtier.indexer.service.histogram)."""
    a, b = m0["latency"], m1["latency"]
    parts = ", ".join(f"{name} {hist_ms(a[key], b[key])}" for name, key in (
        ("query", "query_seconds"), ("lock wait", "lock_wait_seconds"), ("batch wait", "apply_wait_seconds"),
        ("batch hold", "apply_hold_seconds"), ("loop lag", "http_loop_lag_seconds")))
    client = f"{p(late, 0.99):.1f}/{max(late, default=0) * 1e3:.1f}"
    return f"client send late p99/max {client} ms; service p99/max <= {parts} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=positive, default=1000.0, help="open-loop queries per second (default: 1000)")
    ap.add_argument("--seconds", type=positive, default=5.0, help="length of each open-loop run (default: 5)")
    ap.add_argument("--events-per-s", type=positive, default=50.0,
                    help="event batches per second per publisher (default: 50; 8 publishers)")
    ap.add_argument("--connections", type=count(), default=200, help="concurrent keep-alive clients (default: 200)")
    ap.add_argument("--http-loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                    help="the service's event loop (default: auto, uvloop where installed)")
    args = ap.parse_args()
    ports = free_ports(PUBLISHERS + 1)
    http_port, pub_ports = ports[0], ports[1:]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    pubs = subprocess.Popen([sys.executable, "-c", PUBLISHER_SCRIPT, str(args.events_per_s), str(DOCS), str(TOKENS),
                             str(BS), *map(str, pub_ports)], env=env)
    cmd = [sys.executable, "-m", "kvtier", "indexer", "--listen", f"127.0.0.1:{http_port}", "--block-size", str(BS),
           "--http-loop", args.http_loop]
    for i, port in enumerate(pub_ports):
        cmd += ["--endpoint", f"w{i}=tcp://127.0.0.1:{port}"]
    svc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{http_port}"
    try:
        assert svc.stdout is not None
        print(svc.stdout.readline().strip())  # "kvtier indexer: ... HTTP on ..."
        time.sleep(2.0)  # events flowing
        payloads = bodies()
        m0 = metrics(url)
        print(f"service: {PUBLISHERS} publishers x {args.events_per_s:g} batches/s; queries of {TOKENS} tokens")
        errors, resets, qps = run(hammer(url + "/query", args.connections, 20, payloads))
        misses = int(bool(errors or resets))
        print(f"{args.connections} concurrent keep-alive connections x 20 queries: {errors} errors, {resets} resets, "
              f"{qps:.0f} q/s closed-loop ({'MISS' if misses else 'MET'} target: 0 errors, 0 resets)")
        # Each measured run starts from a settled service: the closed-loop burst above saturates both cores,
        # and the batches the publishers sent meanwhile are still being applied for a moment after it.
        time.sleep(SETTLE_S)
        m_run = metrics(url)
        lat, late, errs = run(open_loop(url + "/query", args.rate, args.seconds, payloads))
        ok = not errs and p(lat, 0.99) <= 50.0
        misses += not ok
        print(f"open loop {args.rate:g} q/s for {args.seconds:g} s: p50 {p(lat, 0.5):.1f} ms, "
              f"p99 {p(lat, 0.99):.1f} ms, {errs} errors ({'MET' if ok else 'MISS'} target p99 <= 50 ms, no error)")
        print(f"    {where(m_run, metrics(url), late)}")
        best = 0.0
        for rate in [250, 500, 750, 1000, 1250, 1500, 2000, 2500, 3000, 4000]:
            time.sleep(SETTLE_S)
            m_run = metrics(url)
            lat, late, errs = run(open_loop(url + "/query", rate, min(args.seconds, 3.0), payloads))
            ok = not errs and p(lat, 0.99) <= 50.0
            print(f"  {rate:5d} q/s: p50 {p(lat, 0.5):7.1f} ms, p99 {p(lat, 0.99):7.1f} ms, {errs} errors"
                  f"{'' if ok else '  <- over'}")
            print(f"      {where(m_run, metrics(url), late)}")
            if not ok:
                break
            best = rate
        m1 = metrics(url)
        applied = m1["batches_applied"] - m0["batches_applied"]
        print(f"highest offered rate holding p99 <= 50 ms: {best:g} q/s; meanwhile the index applied {applied} "
              f"batches ({m1['indexed_blocks']} blocks indexed)")
        # How long queries held up event application: the worst delay from a batch's publish to its
        # application over the whole run (publishers and service share this machine's 2 cores too).
        worst = max(w["apply_lag_max_seconds"] for w in m1["workers"].values())
        print(f"event apply lag, worst over every batch of the run: {worst * 1e3:.1f} ms")
        if "gc_pause_max_seconds" in m1:  # the collector stops every thread of the service while it runs
            print(f"service's garbage collector over the run: {m1['gc_full_passes'] - m0['gc_full_passes']} full "
                  f"passes of {m1['gc_passes'] - m0['gc_passes']}, "
                  f"{(m1['gc_pause_seconds'] - m0['gc_pause_seconds']) * 1e3:.1f} ms in all, "
                  f"longest pause since start {m1['gc_pause_max_seconds'] * 1e3:.1f} ms")
    finally:
        svc.terminate()
        pubs.terminate()
        svc.wait(10)
        pubs.wait(10)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
