"""Goodput of kvtier's policies against every incumbent, per workload and SLO level (issue 47, item 4).

For each workload: round robin runs first, and its percentiles set three SLO levels, each a (TTFT, TPOT) pair:
tight (round robin's p50 of each), medium (p90) and loose (p99). Every other policy runs once and its goodput is
read at each level from its per-request latencies; ``goodput`` (kvtier's SLO-aware policy) runs once per level,
told that level's SLO (the knob a user sets). Printed per workload: hit rate, TTFT / TPOT / e2e p50 p90 p99 and
goodput at each level, and for ``goodput`` and ``min_ttft`` whether they meet the target against each incumbent:
goodput at least as high at every level, and no p50/p90/p99 of TTFT, TPOT or e2e more than 2% worse. Last, per
workload and level, which policy has the highest goodput there (``goodput`` told that level's SLO), beside the best
incumbent's: the account of which SLO each policy wins.

    python bench/goodput_table.py                       # every workload (minutes)
    python bench/goodput_table.py --workloads agentic --limit 2000
    python bench/goodput_table.py --latency h200-llama-3.1-8b   # under the iteration times measured on an H200
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from benchargs import count, names

from kvtier.hardware.latency import DEFAULT_LATENCY, LATENCY_PRESETS, resolve_latency
from kvtier.indexer.routing.policies import REGISTRY
from kvtier.indexer.routing.scoring import DEFAULT_OUT_OF_REACH, OUT_OF_REACH
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.experiment import resolve_trace, shared_dir
from kvtier.sim.metrics import Slo, goodput_count
from kvtier.sim.run import RunConfig, RunResult, simulate
from kvtier.sim.trace import Request

DYNAMO_DEFAULT = ClusterConfig.of(workers=16, page_size=64, device_tokens=16_384 * 64, max_running=256,
                               prefill_budget=8192, host_ratio=0.0, h2d_gbps=25.0)


@dataclass(frozen=True, slots=True)
class Workload:
    trace: str  # a trace spec (kvtier.sim.experiment.resolve_trace), "{shared}" for ../shared
    cluster: ClusterConfig
    time_scale: float = 1.0
    shared_prefix_blocks: int = 0  # Azure traces: prefix groups (resolve_trace)


MOONCAKE = "{shared}/traces/mooncake_conversation_trace.jsonl"
WORKLOADS = {
    "mooncake-default": Workload(MOONCAKE, DYNAMO_DEFAULT),
    "mooncake-default-host4x": Workload(MOONCAKE, DYNAMO_DEFAULT.replace(host_ratio=4.0)),
    "mooncake-loaded": Workload(MOONCAKE, DYNAMO_DEFAULT.replace(workers=8, device_tokens=262_144, host_ratio=4.0)),
    "agentic": Workload("builtin:agentic:4000", ClusterConfig.of(workers=16, page_size=64, device_tokens=131_072,
                                                              host_ratio=4.0)),
    "chat": Workload("builtin:chat:1000", ClusterConfig.of(workers=4, device_tokens=32_768, host_ratio=4.0, l3="disk",
                                                        l3_tokens=1_048_576), time_scale=6.0),
    "azure-shared": Workload("{shared}/traces/azure_llm_2023_conv.csv", DYNAMO_DEFAULT, shared_prefix_blocks=4),
}
INCUMBENTS = ["dynamo", "sglang_cache_aware", "llmd"]
OURS = ["min_ttft", "goodput"]
LEVELS = {"tight": 50, "medium": 90, "loose": 99}
FIGURES = [(f"{m} p{p}", m, p) for m in ("TTFT", "TPOT", "e2e") for p in (50, 90, 99)]


def _pct(xs: object, p: float) -> float:
    a = np.asarray(xs, dtype=float)
    a = a[~np.isnan(a)]
    return float(np.percentile(a, p)) if len(a) else float("nan")


def figures(res: RunResult) -> dict[str, float]:
    """Percentiles (ms) of TTFT, TPOT and e2e over the completed requests."""
    series = {"TTFT": res.ttft, "TPOT": res.tpot, "e2e": res.e2e}
    return {label: _pct(series[m], p) * 1000 for label, m, p in FIGURES}


def goodput(res: RunResult, slo: Slo, total: int) -> float:
    return goodput_count(slo, res.ttft, res.tpot, res.e2e) / total


@dataclass(frozen=True, slots=True)
class LevelWinner:
    """Who has the highest goodput at one workload's SLO level, and the figures beside it."""

    workload: str
    level: str
    winner: str  # the policy with the highest goodput there (the first listed, on a tie)
    best: float  # its goodput
    ours: float  # kvtier's goodput policy told this level's SLO (nan where it did not run)
    incumbent: str  # the incumbent with the highest goodput there ("" where none ran)
    incumbent_best: float  # its goodput (nan where none ran)
    requests: int  # the trace's requests (goodput is a share of them)

    def margin(self) -> str:
        """Ours minus the best incumbent's goodput, as a share and in requests."""
        d = self.ours - self.incumbent_best
        return "n/a" if math.isnan(d) else f"{d:+.3f} ({round(d * self.requests):+d})"


def level_winners(name: str, goods: dict[str, dict[str, float]], requests: int) -> list[LevelWinner]:
    """Per level, the policy with the highest goodput: ``goods`` maps each row to its goodput per level, where a
    ``goodput@LEVEL`` row counts at its own level only (it was told that SLO)."""
    out = []
    for lv in LEVELS:
        at = {label: g[lv] for label, g in goods.items() if not label.startswith("goodput@") or label.endswith(lv)}
        winner = max(at, key=lambda label: at[label])
        peers = {p: at[p] for p in INCUMBENTS if p in at}
        inc = max(peers, key=lambda p: peers[p]) if peers else ""
        out.append(LevelWinner(name, lv, winner, at[winner], at.get(f"goodput@{lv}", float("nan")), inc,
                               peers.get(inc, float("nan")), requests))
    return out


def run_workload(name: str, w: Workload, policies: list[str], limit: int | None,
                 out_of_reach: str = DEFAULT_OUT_OF_REACH) -> tuple[dict[str, int], list[LevelWinner]]:
    trace: list[Request] = resolve_trace(w.trace.format(shared=shared_dir()), limit=limit, time_scale=w.time_scale,
                                         shared_prefix_blocks=w.shared_prefix_blocks)
    n = len(trace)
    rr = simulate(trace, w.cluster, RunConfig("round_robin"))
    slos = {lv: Slo(ttft_s=_pct(rr.ttft, p), tpot_s=_pct(rr.tpot, p)) for lv, p in LEVELS.items()}
    print(f"\n{name}: {n} requests, {w.cluster.workers} workers x {w.cluster.device_tokens:,} device tokens, host "
          f"x{w.cluster.host_ratio:g}, l3={w.cluster.l3}; SLO levels from round robin: "
          + "; ".join(f"{lv} {s.describe()}" for lv, s in slos.items()))
    rows: dict[str, tuple[float, dict[str, float], dict[str, float]]] = {}

    def add(label: str, res: RunResult, good: dict[str, float]) -> None:
        rows[label] = (res.summary.hit_rate, figures(res), good)

    add("round_robin", rr, {lv: goodput(rr, s, n) for lv, s in slos.items()})
    for p in policies:
        if p == "goodput":  # told each level's SLO: one run per level, each judged at its own level
            runs = {lv: simulate(trace, w.cluster, RunConfig(p, sla_ttft_ms=s.ttft_s * 1000 if s.ttft_s else None,
                                                             sla_tpot_ms=s.tpot_s * 1000 if s.tpot_s else None,
                                                             slo_out_of_reach=out_of_reach))
                    for lv, s in slos.items()}
            for lv, res in runs.items():
                add(f"goodput@{lv}", res, {lv2: goodput(res, s2, n) for lv2, s2 in slos.items()})
        else:
            res = simulate(trace, w.cluster, RunConfig(p))
            add(p, res, {lv: goodput(res, s, n) for lv, s in slos.items()})
    head = f"{'policy':<20}{'hit':>7}" + "".join(f"{h:>10}" for h, _, _ in FIGURES) + "".join(
        f"{'good ' + lv:>12}" for lv in LEVELS)
    print(head)
    for label, (hit, fig, good) in rows.items():
        print(f"{label:<20}{hit:7.3f}" + "".join(f"{fig[h]:10.1f}" for h, _, _ in FIGURES)
              + "".join(f"{good[lv]:12.3f}" for lv in LEVELS))
    misses: dict[str, int] = {}  # by policy (goodput's rows together)
    for ours in [r for r in rows if r in OURS or r.startswith("goodput@")]:
        for peer in [p for p in INCUMBENTS if p in rows]:
            _, fo, go = rows[ours]
            _, fp, gp = rows[peer]
            levels = [lv for lv in LEVELS if not ours.startswith("goodput@") or ours.endswith(lv)]
            worse_good = [lv for lv in levels if go[lv] < gp[lv] - 1e-9]
            worse_fig = [h for h, _, _ in FIGURES if fo[h] > fp[h] * 1.02]
            ok = not worse_good and not worse_fig
            policy = ours.split("@")[0]
            misses[policy] = misses.get(policy, 0) + (not ok)
            lower = f"goodput lower at {', '.join(worse_good)}" if worse_good else ""
            worse = f"worse than 2%: {', '.join(worse_fig)}" if worse_fig else ""
            why = "" if ok else f" ({'; '.join(x for x in (lower, worse) if x)})"
            print(f"  {'MET ' if ok else 'MISS'} {ours} vs {peer}{why}")
    return misses, level_winners(name, {label: good for label, (_, _, good) in rows.items()}, n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", type=names(WORKLOADS), default=",".join(WORKLOADS),
                    help=f"comma-separated, from {', '.join(WORKLOADS)}")
    ap.add_argument("--policies", type=names(REGISTRY), default=",".join(INCUMBENTS + OURS),
                    help="comma-separated policies beside round robin (default: %(default)s)")
    ap.add_argument("--limit", type=count(), help="first N requests of each trace only")
    ap.add_argument("--latency", default=DEFAULT_LATENCY, metavar="NAME|JSON",
                    help=f"iteration-time fit of every workload: a preset ({', '.join(LATENCY_PRESETS)}) or a JSON")
    ap.add_argument("--out-of-reach", default=DEFAULT_OUT_OF_REACH, choices=OUT_OF_REACH,
                    help="the goodput policy's order of workers that miss the SLO (SloCost.out_of_reach)")
    a = ap.parse_args()
    try:
        latency = resolve_latency(a.latency)
    except ValueError as exc:
        ap.error(f"--latency: {exc}")
    misses: dict[str, int] = {}
    winners: list[LevelWinner] = []
    for name in a.workloads:
        w = WORKLOADS[name]
        w = Workload(w.trace, w.cluster.replace(latency=latency), w.time_scale, w.shared_prefix_blocks)
        m, won = run_workload(name, w, a.policies, a.limit, a.out_of_reach)
        for policy, missed in m.items():
            misses[policy] = misses.get(policy, 0) + missed
        winners += won
    print(f"\nhighest goodput per workload and SLO level (goodput told that level's SLO):\n"
          f"{'workload':<25}{'level':<8}{'winner':<20}{'goodput':>8}{'ours':>8}  {'best incumbent':<20}{'goodput':>8}"
          f"  ours - it (requests)")
    for v in winners:
        print(f"{v.workload:<25}{v.level:<8}{v.winner:<20}{v.best:8.3f}{v.ours:8.3f}  {v.incumbent:<20}"
              f"{v.incumbent_best:8.3f}  {v.margin()}")
    total = sum(misses.values())
    if not misses:  # (the targets compare ours with an incumbent: without both, nothing was judged)
        print(f"\nno target judged: --policies needs one of {', '.join(OURS)} and one of {', '.join(INCUMBENTS)}")
    else:
        print(f"\n{total} target(s) missed ({', '.join(f'{p}: {m}' for p, m in misses.items())})" if total
              else "\nevery target met")
    return 1 if total else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
