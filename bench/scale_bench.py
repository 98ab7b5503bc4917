"""Simulator scale benchmark (issue 11, item 3): a million-request trace replayed in one process.

``kvtier gen-trace`` writes a seeded chat trace of ``--requests`` requests (streamed: it never holds the
trace), then ``kvtier replay`` replays it on ``--workers`` workers for each policy, streaming the trace
from the file and the per-request records to requests.csv. Each replay is the CLI in a fresh process;
its wall time and peak memory come from its summary.json. A replay of the first tenth of the trace runs
first, so the table shows whether memory stays flat as the trace grows tenfold.

Target on the 2-core machine: 1,000,000 requests on 64 workers in under 15 minutes per replay, with
bounded memory: the whole replay's peak at most 1.25x the tenth's (what grows with the trace is a few bytes per
request: the file's index and three floats per finished request; the caches fill within the first tenth on a long
trace, so a short one may miss the memory target while its caches are still filling).

    python bench/scale_bench.py [--requests 1000000] [--workers 64] [--policies round_robin,kv_all]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchargs import count, positive

from kvtier.indexer.routing.plugins import is_plugin_spec
from kvtier.indexer.routing.policies import REGISTRY

TARGET_S = 15 * 60
TARGET_GROWTH = 1.25  # the whole replay's peak over the tenth's


def kvtier(*args: str) -> None:
    """Runs ``kvtier args``; its progress lines (stderr) are kept out of the table, and shown only if it fails."""
    run = subprocess.run([sys.executable, "-m", "kvtier", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True, check=False)
    if run.returncode:
        raise SystemExit(f"scale_bench: kvtier {' '.join(args)} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")


def replay(trace: Path, workers: int, policy: str, limit: int | None, out: Path) -> dict[str, float]:
    args = ["replay", "--trace", str(trace), "--workers", str(workers), "--policy", policy, "--no-plots",
            "--out", str(out)]
    kvtier(*args, *(["--limit", str(limit)] if limit else []))
    doc = json.loads((out / "summary.json").read_text())
    s = doc["runs"][0]
    return {"requests": doc["meta"]["requests"], "wall_s": doc["meta"]["wall_s"],
            "peak_mib": doc["meta"]["peak_rss_mib"], "unfinished": s["unfinished"], "hit": s["hit_rate"],
            "p50_ms": s["ttft_p50"] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=count(10), default=1_000_000, help="trace length (default: 1,000,000)")
    ap.add_argument("--workers", type=count(), default=64, help="inference workers (default: 64)")
    ap.add_argument("--rate", type=positive, default=20.0, help="new chat sessions per second (default: 20)")
    ap.add_argument("--policies", default="round_robin,kv_all", help="comma-separated (default: round_robin,kv_all)")
    ap.add_argument("--out", type=Path, default=Path("out/bench/scale"),
                    help="trace and results (default: out/bench/scale)")
    ap.add_argument("--no-tenth", action="store_true", help="skip the replay of the first tenth")
    a = ap.parse_args()
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in REGISTRY and not is_plugin_spec(p)]
    if unknown or not policies:  # (before the trace is made and the first policy replayed)
        ap.error(f"--policies: {', '.join(unknown) or 'none given'}; expected built-in policies "
                 f"({', '.join(REGISTRY)}) or plugins (module:attr, file.py:attr, an entry point)")
    a.out.mkdir(parents=True, exist_ok=True)
    trace = a.out / f"chat-{a.requests}-rate{a.rate:g}.jsonl"
    if not trace.exists():
        t0 = time.perf_counter()
        kvtier("gen-trace", "--kind", "chat", "--requests", str(a.requests), "--rate", str(a.rate), "-o", str(trace))
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(f"gen-trace: {a.requests:,} requests in {time.perf_counter() - t0:.1f} s, peak {peak:,.0f} MiB, "
              f"{trace.stat().st_size / 2**20:,.0f} MiB file")
    print(f"replay: {trace.name}, {a.workers} workers; target: every full replay < {TARGET_S // 60} min, its peak "
          f"<= {TARGET_GROWTH:g}x the tenth's")
    print(f"{'policy':<12} {'requests':>10} {'unfin':>6} {'wall s':>8} {'req/s':>7} {'peak MiB':>9} {'hit':>6} "
          f"{'p50 ms':>7}  target")
    misses = 0
    for policy in policies:
        limits = [None] if a.no_tenth else [a.requests // 10, None]
        tenth_peak = None
        for limit in limits:
            r = replay(trace, a.workers, policy, limit, a.out / f"{policy}-{limit or 'all'}")
            if limit:
                tenth_peak, verdict = r["peak_mib"], ""
            else:
                fast = r["wall_s"] < TARGET_S
                flat = tenth_peak is None or r["peak_mib"] <= TARGET_GROWTH * tenth_peak
                misses += not (fast and flat)
                verdict = ("MET" if fast else "MISS") + f" < {TARGET_S // 60} min"
                if tenth_peak is not None:
                    verdict += (f", {'MET' if flat else 'MISS'} peak {r['peak_mib'] / tenth_peak:.2f}x the tenth's "
                                f"(<= {TARGET_GROWTH:g}x)")
            print(f"{policy:<12} {r['requests']:>10,} {r['unfinished']:>6} {r['wall_s']:>8.1f} "
                  f"{r['requests'] / r['wall_s']:>7.0f} {r['peak_mib']:>9,.0f} {r['hit']:>6.3f} {r['p50_ms']:>7.1f}  "
                  f"{verdict}", flush=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
