"""Cross-check kvtier's simulator and routing against NVIDIA Dynamo 1.6.1's mocker on the same clusters.

Runs Dynamo's Rust mocker (``dynamo._core.run_mocker_trace_replay``, from ``ai-dynamo-runtime``) and
kvtier's simulator on one trace and cluster and prints them side by side: round robin (where the two
simulators must agree), Dynamo's kv_router against kvtier's ``dynamo`` policy (its documented cost rebuilt),
and kvtier's own ``min_ttft``. Beside hit rate and TTFT, what a user feels after the first token: TPOT
(per request, (e2e - TTFT) / (tokens - 1), over requests of two tokens or more), ITL (every gap between
consecutive tokens, token-weighted) and end-to-end latency. Clusters: Dynamo's default one (16 workers,
16,384 pages of 64 tokens), device only and with a 4x host tier, and a loaded one (8 workers, 4,096 pages,
host 4x) where memory runs short.

Dynamo is optional and never needed by the tests. Install it with ``pip install -e '.[crosscheck]'``,
or into a scratch virtualenv and pass its interpreter with ``--dynamo-python``: it runs in a subprocess
either way. Without it, only kvtier's side is printed.

    python bench/crosscheck_dynamo.py                       # full Mooncake trace, every cluster
    python bench/crosscheck_dynamo.py --limit 3000 --dynamo-python /tmp/dyn/bin/python --clusters loaded
    python bench/crosscheck_dynamo.py --dynamo-python /tmp/dyn/bin/python --disagg 8:8 --clusters default

Targets (issues 10 and 47): round robin within 0.5% relative hit rate and 2% on each TTFT, TPOT and e2e
percentile; the ``dynamo`` policy within 1 point of Dynamo's kv_router hit rate (whose runs differ by up to about a
point on one trace: ``--dynamo-runs N`` judges against the mean of N). The hit rates part by eviction:
kvtier's engines evict whole radix nodes by default (SGLang's radix cache), the mocker frees blocks one by one as
vLLM's block pool does; ``--eviction page`` runs kvtier's engines the vLLM way.

``--disagg P:D`` (issue 48) runs each cluster as P prefill and D decode workers of the same size (or decode workers
of ``--decode-device-tokens`` and ``--decode-max-running``, as both simulators take a decode pool's engine args), in
both simulators: prefill workers hold the host tier, decode workers their device cache; a finished prefill sends its
decode worker the part of the prompt it lacks (Dynamo's ``kv_transfer_timing_mode = destination_missing``) over a
``--kv-link-gbps`` link, after the prefill, and the first token is the decode worker's first step. Round robin then
must agree within 2% on hit rate as well. Where the two differ by design: a kvtier decode worker admits a request
once its prompt and whole output fit (no preemption); the mocker's decode worker admits on the prompt's blocks and
preempts as outputs grow. Where decode memory runs short (``loaded``) that moves the tail of TTFT, the wait for a
decode worker, while the prefill side and TPOT still agree.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from benchargs import count, executable, names, positive

from kvtier.hardware.latency import PRESETS
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.experiment import shared_dir
from kvtier.sim.run import RunConfig, simulate
from kvtier.sim.trace import Request, load_mooncake, write_mooncake

# What Dynamo's side runs, in the interpreter that has ai-dynamo-runtime: one JSON line per run.
_DYNAMO_SCRIPT = r"""
import json, sys, time
import dynamo._core as c
args = json.loads(sys.argv[1])
engine = {"block_size": args["page_size"], "num_gpu_blocks": args["device_blocks"],
          "max_num_seqs": args["max_running"], "max_num_batched_tokens": args["prefill_budget"]}
if args["host_blocks"]:
    engine["kv_cache_bytes_per_token"] = args["bytes_per_token"]
    engine["native_host_offload"] = {"num_host_blocks": args["host_blocks"], "d2h_bandwidth_gbps": args["h2d_gbps"],
                                     "h2d_bandwidth_gbps": args["h2d_gbps"]}
pools = {}
if args["disagg"]:
    # Prefill workers hold the tiers; decode workers their device cache, receiving what they lack over the KV link.
    link = {"kv_transfer_bandwidth": args["kv_gbps"], "kv_bytes_per_token": args["bytes_per_token"],
            "kv_transfer_timing_mode": "destination_missing"}
    decode = {**{k: v for k, v in engine.items() if k not in ("native_host_offload", "kv_cache_bytes_per_token")},
              "num_gpu_blocks": args["decode_blocks"], "max_num_seqs": args["decode_running"]}
    pools = {"prefill_engine_args": {"engine": {**engine, **link, "worker_type": "prefill"}},
             "decode_engine_args": {"engine": {**decode, **link, "worker_type": "decode"}},
             "num_prefill_workers": args["disagg"][0], "num_decode_workers": args["disagg"][1]}
for mode in ("round_robin", "kv_router"):
    router = c.KvRouterConfig(host_cache_hit_weight=args["host_credit"]) if mode == "kv_router" else None
    t0 = time.perf_counter()
    where = pools or {"extra_engine_args": {"engine": engine}, "num_workers": args["workers"]}
    s = c.run_mocker_trace_replay([args["trace"]], router_config=router, router_mode=mode, **where).summary
    pct = {f"{m}_{p}": s[f"{'median' if p == 'p50' else p}_{m}_ms"] for m in ("ttft", "tpot", "itl", "e2e_latency")
           for p in ("p50", "p90", "p99")}
    print(json.dumps({"mode": mode, "hit": s["prefix_cache_reused_ratio"], "done": s["completed_requests"],
                      "wall_s": time.perf_counter() - t0, **pct}), flush=True)
"""

#: The latency columns compared, ms: (label, Row field).
LATENCIES = [(f"{m} {p}", f"{k}_{p}") for m, k in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"),
                                                   ("e2e", "e2e")) for p in ("p50", "p90", "p99")]


@dataclass(slots=True)
class Row:
    """One run's figures; latencies in ms."""

    hit: float  # prompt-token hit rate
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float  # per request, over those of two tokens or more
    tpot_p90: float
    tpot_p99: float
    itl_p50: float  # every inter-token gap
    itl_p90: float
    itl_p99: float
    e2e_p50: float
    e2e_p90: float
    e2e_p99: float
    wall_s: float  # wall time of the run


def crosscheck_cluster(workers: int) -> ClusterConfig:
    """The cluster both simulators run, device only: 16,384 pages of 64 tokens a worker, 256 running,
    8,192 batched tokens, 25 GB/s host links (used once a host tier is added)."""
    return ClusterConfig.of(workers=workers, page_size=64, device_tokens=16_384 * 64, max_running=256,
                         prefill_budget=8192, host_ratio=0.0, h2d_gbps=25.0)


def clusters(workers: int) -> dict[str, ClusterConfig]:
    """Every cluster cross-checked, by name: Dynamo's default cluster device only and with a 4x host tier, and a
    loaded one (8 workers of 4,096 pages, host 4x), where memory runs short and admission, preemption and the
    output room an engine reserves decide the latencies."""
    base = crosscheck_cluster(workers)
    return {"default": base, "default-host4x": base.replace(host_ratio=4.0),
            "loaded": base.replace(workers=8, device_tokens=262_144, host_ratio=4.0)}


def dynamo_python(explicit: str | None) -> str | None:
    """The interpreter to run Dynamo with: ``explicit``, else this one if it has ai-dynamo-runtime."""
    if explicit:
        return explicit
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        return None
    return sys.executable


def run_dynamo(python: str, trace: Path, cfg: ClusterConfig, host_credit: float) -> dict[str, Row]:
    args = {"trace": str(trace), "workers": cfg.workers, "page_size": cfg.page_size,
            "device_blocks": cfg.device_tokens // cfg.page_size, "max_running": cfg.max_running,
            "prefill_budget": cfg.prefill_budget,
            "host_blocks": int(cfg.device_tokens * cfg.host_ratio) // cfg.page_size,
            "h2d_gbps": cfg.h2d_gbps, "bytes_per_token": PRESETS[cfg.model].bytes_per_token, "host_credit": host_credit,
            "disagg": [cfg.prefill_workers, cfg.decode_workers] if cfg.disaggregated else None,
            "kv_gbps": cfg.kv_link_gbps}
    if cfg.disaggregated:  # the decode pool's own engine args
        dec = cfg.decode_config()
        args |= {"decode_blocks": dec.device_tokens // dec.page_size, "decode_running": dec.max_running}
    # Dynamo logs each routing decision at info level (DYN_LOG), 12,000 lines a Mooncake run: not its speed.
    env = {**os.environ, "RUST_LOG": "error", "DYN_LOG": "error"}
    out = subprocess.run([python, "-c", _DYNAMO_SCRIPT, json.dumps(args)], capture_output=True, text=True,
                         env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"Dynamo's mocker failed ({python}):\n{out.stderr[-2000:]}")
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            lat = {f: d[f.replace("e2e_", "e2e_latency_")] for _, f in LATENCIES}
            rows[d["mode"]] = Row(hit=d["hit"], wall_s=d["wall_s"], **lat)
    return rows


def run_kvtier(trace_reqs: list[Request], cfg: ClusterConfig, policy: str) -> Row:
    gaps: list[float] = []
    t0 = time.perf_counter()
    s = simulate(trace_reqs, cfg, RunConfig(policy), itl_sink=lambda _, g: gaps.extend(g)).summary
    wall = time.perf_counter() - t0
    itl = np.percentile(np.asarray(gaps), [50, 90, 99]) * 1000 if gaps else [math.nan] * 3
    return Row(s.hit_rate, s.ttft_p50 * 1e3, s.ttft_p90 * 1e3, s.ttft_p99 * 1e3, s.tpot_p50 * 1e3, s.tpot_p90 * 1e3,
               s.tpot_p99 * 1e3, float(itl[0]), float(itl[1]), float(itl[2]), s.e2e_p50 * 1e3, s.e2e_p90 * 1e3,
               s.e2e_p99 * 1e3, wall)


def _fmt(r: Row) -> str:
    return f"{r.hit:7.4f} " + " ".join(f"{getattr(r, f):7.1f}" for _, f in LATENCIES) + f" {r.wall_s:6.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, help="Mooncake JSONL (default: the shared conversation trace)")
    ap.add_argument("--limit", type=count(), help="first N requests only")
    ap.add_argument("--workers", type=count(), default=16, help="workers of the default and default-host4x clusters")
    ap.add_argument("--clusters", type=names(clusters(16)), default="default,default-host4x,loaded",
                    help="comma-separated, from default, default-host4x, loaded")
    ap.add_argument("--disagg", metavar="P:D",
                    help="disaggregated: P prefill and D decode workers in place of each cluster's workers "
                         "(--kv-link-gbps: their link)")
    ap.add_argument("--eviction", choices=["node", "page"], default="node",
                    help="kvtier's device eviction: whole radix nodes (its default, as SGLang) or only the pages "
                         "needed, last first (as vLLM's block pool and Dynamo's mocker); default: %(default)s")
    ap.add_argument("--kv-link-gbps", type=positive, default=50.0, help="with --disagg: prefill -> decode GB/s")
    ap.add_argument("--decode-device-tokens", type=count(), help="with --disagg: a decode worker's device KV, tokens "
                    "(default: the cluster's); both simulators' decode engines get it")
    ap.add_argument("--decode-max-running", type=count(), help="with --disagg: a decode worker's batch (default: the "
                    "cluster's)")
    ap.add_argument("--dynamo-python", type=executable,
                    help="interpreter with ai-dynamo-runtime==1.6.1 (default: this one, if it has it)")
    ap.add_argument("--dynamo-runs", type=count(), default=1,
                    help="runs of Dynamo's mocker per cluster: its kv_router's hit rate varies from run to run, and "
                         "the `dynamo` policy is judged against their mean (default: %(default)s)")
    a = ap.parse_args(argv)
    path = a.trace or shared_dir() / "traces" / "mooncake_conversation_trace.jsonl"
    reqs = load_mooncake(path, limit=a.limit)
    known = clusters(a.workers)
    if a.disagg:
        p, _, d = a.disagg.partition(":")
        if not (p.isdigit() and d.isdigit() and int(p) > 0 and int(d) > 0):
            ap.error(f"--disagg {a.disagg!r}: expected P:D, two counts >= 1")
        known = {f"{name}-{a.disagg}": cfg.replace(prefill_workers=int(p), decode_workers=int(d),
                                                    kv_gbps=a.kv_link_gbps, decode_device_tokens=a.decode_device_tokens,
                                                    decode_max_running=a.decode_max_running)
                 for name, cfg in known.items()}
    elif a.decode_device_tokens or a.decode_max_running:
        ap.error("--decode-device-tokens and --decode-max-running size a disaggregated cluster's decode pool: give "
                 "--disagg P:D")
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.jsonl"
        write_mooncake(reqs, trace)  # the same requests, also when --limit cuts the file
        py = dynamo_python(a.dynamo_python)
        print(f"{len(reqs)} requests from {path.name}; 256 running, 8,192 batched tokens, pages of 64 tokens, "
              f"25 GB/s host links; Dynamo: {py or 'not installed (pip install -e .[crosscheck])'}")
        header = "    hit " + " ".join(f"{h:>7}" for h, _ in LATENCIES) + " wall s"
        misses = 0
        for name in a.clusters:
            cfg = known[f"{name}-{a.disagg}" if a.disagg else name].replace(eviction=a.eviction)
            runs = [run_dynamo(py, trace, cfg, host_credit=0.75) for _ in range(a.dynamo_runs)] if py else []
            dyn = runs[0] if runs else {}
            ours = {p: run_kvtier(reqs, cfg, p) for p in ("round_robin", "dynamo", "min_ttft")}
            pools = f", host x{cfg.host_ratio:g}"
            if cfg.disaggregated:  # (an aggregated cluster has no decode pool to describe)
                dec = cfg.decode_config()
                pools = (f" ({cfg.prefill_workers} prefill, host x{cfg.host_ratio:g}; {cfg.decode_workers} decode, "
                         f"device only, {dec.device_tokens // dec.page_size:,} pages, {dec.max_running} running; KV "
                         f"link {cfg.kv_link_gbps:g} GB/s, the part a decode worker lacks)")
            print(f"\n{name}: {cfg.workers} workers, {cfg.device_tokens // cfg.page_size:,} pages each{pools}; "
                  f"kvtier evicts by {a.eviction}"
                  f"\n{'run':<20}{header}")
            rows = [("Dynamo round_robin", dyn.get("round_robin")), ("kvtier round_robin", ours["round_robin"]),
                    ("Dynamo kv_router", dyn.get("kv_router")), ("kvtier dynamo", ours["dynamo"]),
                    ("kvtier min_ttft", ours["min_ttft"])]
            for label, row in rows:
                if row is not None:
                    print(f"{label:<20}{_fmt(row)}")
            if dyn:
                router_hits = [r["kv_router"].hit for r in runs]
                if len(runs) > 1:
                    print(f"Dynamo kv_router hit rate over {len(runs)} runs: "
                          + ", ".join(f"{h:.4f}" for h in router_hits)
                          + f" (spread {(max(router_hits) - min(router_hits)) * 100:.2f} points)")
                misses += _targets(dyn, ours, hit_tolerance=0.02 if cfg.disaggregated else 0.005,
                                   router_hit=sum(router_hits) / len(router_hits))
    return 1 if misses else 0


def _targets(dyn: dict[str, Row], ours: dict[str, Row], hit_tolerance: float, router_hit: float) -> int:
    """Prints each target MET or MISS against Dynamo's runs (``dyn``: the first; ``router_hit``: its kv_router's
    mean hit rate over every run) and returns the misses."""
    d, k = dyn["round_robin"], ours["round_robin"]
    rr_hit = abs(k.hit / d.hit - 1)
    off = {h: getattr(k, f) / getattr(d, f) - 1 for h, f in LATENCIES}
    gap = (ours["dynamo"].hit - router_hit) * 100
    lead = (ours["min_ttft"].hit - router_hit) * 100
    checks = [(f"round robin hit rate within {hit_tolerance:.1%} (off by {rr_hit:.2%})", rr_hit <= hit_tolerance)]
    checks += [(f"round robin {h} within 2% ({off[h]:+.2%})", abs(off[h]) <= 0.02) for h, _ in LATENCIES
               if not h.startswith("ITL")]
    checks.append((f"dynamo policy within 1 point of Dynamo's kv_router ({gap:+.2f} points)", abs(gap) <= 1.0))
    ratios = ", ".join(f"{h} {v + 1:.3f}" for h, v in off.items())
    print(f"round robin kvtier/Dynamo: hit {k.hit / d.hit:.4f}; {ratios}"
          f"; wall {k.wall_s / d.wall_s:.1f}x; min_ttft vs kv_router {lead:+.2f} points of hit rate")
    for text, ok in checks:
        print(f"  {'MET ' if ok else 'MISS'} {text}")
    return sum(not ok for _, ok in checks)


if __name__ == "__main__":
    sys.exit(main())
