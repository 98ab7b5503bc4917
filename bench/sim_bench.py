"""Simulator benchmark: the full Mooncake conversation trace on 16 workers with kv_all.

Prints wall time, simulated requests per second of wall time and peak memory.
Targets on the 2-core dev machine: the whole trace (12,031 requests) in <= 60 s; peak memory <= 4 GiB.

    python bench/sim_bench.py [--limit N] [--policy kv_all]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.run import RunConfig, simulate
from kvtier.sim.trace import load_mooncake

TRACE = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--policy", default="kv_all")
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    reqs = load_mooncake(args.trace, args.limit)
    t0 = time.perf_counter()
    res = simulate(reqs, ClusterConfig(workers=args.workers), RunConfig(args.policy))
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    s = res.summary
    print(f"{len(reqs)} requests, {args.workers} workers, {args.policy}: wall {wall:.1f} s (target <= 60 s), "
          f"{len(reqs) / wall:,.0f} simulated requests/s, peak memory {peak:.2f} GiB (target <= 4 GiB)")
    print(f"simulated {s.makespan_s:,.0f} s of serving; hit rate {s.hit_rate:.3f} "
          f"(device {s.hit_device:.3f}, host {s.hit_host:.3f}); TTFT p50 {s.ttft_p50:.3f} s, p99 {s.ttft_p99:.3f} s; "
          f"{res.events_published:,} event batches")


if __name__ == "__main__":
    main()
