"""The ``kvtier`` command line: replay, compare, sweep, gen-trace, fit-latency, engine, indexer."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import json
import logging
import math
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtier.engine.cache import CacheConfig
from kvtier.engine.config import PrefetchPolicy, WritePolicy
from kvtier.hardware.latency import (
    DEFAULT_LATENCY,
    LATENCY_PRESETS,
    MockerLatency,
    ModelPreset,
    fit_latency,
    latency_to_json,
    load_latency_points,
    resolve_latency,
)
from kvtier.hardware.latency import PRESETS as MODEL_PRESETS
from kvtier.hardware.links import (
    DEFAULT_GPU_LINK,
    DEFAULT_KV_LINK,
    DEFAULT_STORAGE_LINK,
    GPU_LINKS,
    KV_LINKS,
    STORAGE_LINKS,
)
from kvtier.indexer.routing.plugins import PluginError, is_plugin_spec
from kvtier.indexer.routing.policies import REGISTRY
from kvtier.indexer.routing.scoring import AUTO_DISCOUNT_BELOW, DEFAULT_OUT_OF_REACH, OUT_OF_REACH
from kvtier.indexer.service.config import ENDPOINT_SPEC, ServiceConfig
from kvtier.kernels.jit import KernelsUnavailable
from kvtier.sim import live
from kvtier.sim.cluster import CACHE_SETTINGS, ClusterConfig
from kvtier.sim.generators import PRESETS, iter_generate
from kvtier.sim.policies import POLICIES, check_policy, policy_label
from kvtier.sim.run import RunConfig, RunResult, load_kernels
from kvtier.sim.source import TraceSource
from kvtier.sim.trace import MAX_TIMESTAMP_MS, TIME_SCALE, Request, TraceError, is_azure, write_mooncake
from kvtier.sim.transport import Recovery
from kvtier.util.fields import ConfigError, Domain, OneLineParser, add_options, did_you_mean
from kvtier.util.outpath import unwritable
from kvtier.util.signals import STOP_SIGNALS, handling
from kvtier.wire.protocol import DEFAULT_BLOCK_SIZE

#: How --policy and --policies name a plugin (kvtier.indexer.routing.plugins).
_PLUGIN_FORMS = "or a plugin: FILE.py:ATTR, MODULE:ATTR, or an entry point of the group kvtier.policies"

# The incumbents route in O(prompt blocks) per request, and all but llmd_precise (fed events, like kv_host) hear no
# events: cheap beside the kv_* policies.
DEFAULT_POLICIES = ("round_robin,least_loaded,approx,kv_device,kv_host,kv_all,dynamo,min_ttft,oracle,"
                    "sglang_cache_aware,power_of_two,llmd,llmd_kv,llmd_precise")

OUT_OF_REACH_HELP = ("goodput policy, for a request whose SLO no worker is expected to meet: keep its cached prefix by "
                     "the usual price (price), weigh its TTFT less against the streams it slows (discount), send it "
                     "where it slows them least (spread), or discount only under a TPOT bound within "
                     f"{AUTO_DISCOUNT_BELOW:g}x an idle worker's decode step (auto)")


class CliError(Exception):
    """A usage problem reported as ``kvtier: error: ...`` with exit status 2."""


#: Domains of options that map to no configuration object (those of ClusterConfig and RunConfig are
#: stated on their fields).
COUNT = Domain(int, lo=1)
#: gen-trace's most requests: some 100 times the largest public traces, written at about 100,000 a second.
GEN_REQUESTS = Domain(int, lo=1, hi=100_000_000)
#: gen-trace reports its progress every this many requests.
GEN_PROGRESS_EVERY = 1_000_000
SEED = Domain(int, lo=0)  # (numpy's generators take no negative seed)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default (``none`` for None); flags show none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                   argparse._HelpAction, argparse._VersionAction))
        if (not action.option_strings or flag or action.required or "default" in text
                or action.default is argparse.SUPPRESS):
            return text
        shown = "none" if action.default is None or action.default == [] else "%(default)s"
        return f"{text} (default: {shown})".strip()


# --- shared options ------------------------------------------------------------------------


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default="builtin:chat",
                   help="Mooncake JSONL, Azure CSV, or builtin:chat|agentic|sysprompt[:N] (N requests: by default "
                        "--limit, else 1,000); default: %(default)s")
    p.add_argument("--limit", type=COUNT.parse, help="use only the first N requests (default: all)")
    p.add_argument("--time-scale", type=TIME_SCALE.parse, default=1.0,
                   help="multiply arrival times (<1 = higher load); closed loop (the default), it moves sessions' "
                        "first turns only, and later turns still follow their think times (--open-loop moves every "
                        "arrival)")
    p.add_argument("--trace-seed", type=SEED.parse, default=0,
                   help="seed of builtin traces, and of an Azure trace's prefix groups")
    p.add_argument("--shared-prefix-blocks", type=Domain(int, lo=0, hi=1 << 20).parse, default=0, metavar="N",
                   help="Azure CSV traces (lengths only): each request's first N 512-token blocks are its prefix "
                        "group's, as a system prompt per application (Dynamo mocker's trace_shared_prefix_ratio); "
                        "0: every prompt unique")
    p.add_argument("--prefix-groups", type=Domain(int, lo=1, hi=1 << 20).parse, default=8, metavar="G",
                   help="Azure CSV traces: the prefix groups requests join at random (seeded by --trace-seed)")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    d = ClusterConfig()
    g = p.add_argument_group("cluster")
    g.add_argument("--workers", type=int, help=f"inference workers (default: {d.workers}, or the pools' sum)")
    add_options(g, ClusterConfig, ["device_tokens", "l3", "l3_tokens"])
    add_options(g, CacheConfig, ["page_size", "host_ratio"])
    g.add_argument("--model", default=d.model, choices=sorted(MODEL_PRESETS), metavar="NAME",
                   help="model preset, its KV bytes per token (hybrid: full-attention + sliding-window KV): "
                        + "; ".join(_describe(p) for p in MODEL_PRESETS.values()))
    add_options(g, ClusterConfig, ["swa_ratio", "draft_model"])
    add_options(g, CacheConfig, ["swa_events", "write_policy", "eviction", "selective_threshold", "load_back",
                                 "prefetch_policy", "prefetch_min_pages", "prefetch_timeout_s"])
    add_options(g, ClusterConfig, ["prefill_budget", "max_running"])
    g.add_argument("--gpu-link", choices=sorted(GPU_LINKS), default=DEFAULT_GPU_LINK,
                   help="host<->device link preset (its bandwidth and source: kvtier.hardware.links)")
    g.add_argument("--storage-link", choices=sorted(STORAGE_LINKS), default=DEFAULT_STORAGE_LINK,
                   help="host<->storage link preset")
    g.add_argument("--h2d-gbps", type=float, help="host<->device bandwidth, GB/s each way (default: --gpu-link's)")
    g.add_argument("--storage-gbps", type=float, help="host<->storage bandwidth, GB/s (default: --storage-link's)")
    g.add_argument("--latency", metavar="NAME|JSON", default=DEFAULT_LATENCY,
                   help=f"iteration-time fit: a preset ({', '.join(LATENCY_PRESETS)}: Dynamo mocker's published "
                        "fit, or one measured by bench/gpu_latency.py) or a JSON from `kvtier fit-latency`")
    g = p.add_argument_group("disaggregated prefill and decode (default: aggregated workers)")
    g.add_argument("--prefill-workers", type=int, default=0, metavar="P",
                   help="prefill workers (with --decode-workers; together they make the cluster)")
    g.add_argument("--decode-workers", type=int, default=0, metavar="D", help="decode workers")
    g.add_argument("--kv-link", choices=sorted(KV_LINKS),
                   help=f"prefill -> decode KV link preset (its bandwidth and source: kvtier.hardware.links; default: "
                        f"{DEFAULT_KV_LINK})")
    g.add_argument("--kv-link-gbps", type=float, help="prefill -> decode bandwidth, GB/s (default: --kv-link's)")
    g.add_argument("--local-prefill-tokens", type=int, default=0, metavar="N",
                   help="a prompt whose part its decode worker lacks is under N tokens prefills there (0: never)")
    add_options(g, ClusterConfig, ["kv_link_sharing", "decode_device_tokens", "decode_max_running"])


def _add_router_args(p: argparse.ArgumentParser, *, itl_series: bool = True) -> None:
    """The router's, replay's and SLO options; ``--itl-series`` only where the command writes it (not sweep)."""
    g = p.add_argument_group("router")
    g.add_argument("--cost", choices=["credit", "ttft"], default="credit", help="cost model of kv policies")
    g.add_argument("--event-delay", type=float, default=0.0, help="engine -> router event delay, seconds")
    g.add_argument("--event-loss", type=float, default=0.0, help="probability an event batch is lost")
    g.add_argument("--recovery", choices=[r.value for r in Recovery], default=Recovery.DUMP.value,
                   help="what the router does about lost batches: none (they stay missing), replay (seq tracking "
                        "and replay, as with SGLang/vLLM engines), dump (replay, then state dumps: kvtier engines)")
    g.add_argument("--replay-buffer", type=int, default=10_000, help="batches each engine keeps for replay")
    g.add_argument("--loss-burst", type=int, default=1,
                   help="batches of a worker lost in a row each time one is (an outage longer than the buffer "
                        "needs a dump or leaves the worker partial)")
    g.add_argument("--host-credit", type=float, default=0.75, help="credit cost: weight of a host-tier block")
    g.add_argument("--disk-credit", type=float, default=0.25,
                   help="credit cost: weight of a disk or external block")
    g.add_argument("--temperature", type=float, default=0.0, help="softmax sampling over costs (0: argmin)")
    g.add_argument("--seed", type=SEED.parse, default=0, help="seed of the router's random choices")
    g = p.add_argument_group("replay")
    g.add_argument("--open-loop", action="store_true",
                   help="release every turn at its trace timestamp (default: a session's next turn arrives its "
                        "think time after the previous answer)")
    g.add_argument("--until", type=float, help="stop simulated time here, seconds (default: run to completion)")
    g.add_argument("--allow-unfinished", action="store_true",
                   help="exit 0 even if some requests did not finish (they are reported as unfinished)")
    g = p.add_argument_group("service-level objectives (goodput: the share of requests meeting every one given)")
    g.add_argument("--sla-ttft-ms", type=float, help="time to first token bound, ms")
    g.add_argument("--sla-tpot-ms", type=float, help="time per output token bound (after the first), ms")
    g.add_argument("--sla-e2e-ms", type=float, help="end-to-end latency bound, ms")
    g.add_argument("--slo-out-of-reach", choices=OUT_OF_REACH, default=DEFAULT_OUT_OF_REACH, help=OUT_OF_REACH_HELP)
    if itl_series:
        g.add_argument("--itl-series", type=Path, metavar="FILE",
                       help="write every request's inter-token gaps (seconds) as JSONL: "
                            '{"policy", "request_id", "itl_s": [...]} per completed request')


def _describe(p: ModelPreset) -> str:
    def size(n: int) -> str:
        return f"{n // 1024} KiB" if n >= 1024 else f"{n} B"

    if not p.swa_layers:
        return f"{p.name} ({size(p.bytes_per_token)})"
    return (f"{p.name} ({size(p.bytes_per_token)} full + {size(p.window_bytes_per_token)} window, "
            f"{p.window_tokens}-token window)")


_DISAGG_AXES = frozenset({"pools", "prefill_workers", "decode_workers"})  # sweep axes that may split the cluster


def _cluster(a: argparse.Namespace, axes: Collection[str] = ()) -> ClusterConfig:
    """The cluster the options describe: every setting of :func:`_add_cluster_args` by its field's name. The
    prefill -> decode link's and the decode pool's options, and a sweep's axes over them, are refused for an
    aggregated cluster (they would change nothing), unless a sweep's ``axes`` may split it."""
    pools = a.prefill_workers + a.decode_workers if a.prefill_workers > 0 and a.decode_workers > 0 else None
    if pools is not None and a.workers is not None and a.workers != pools:
        raise CliError(f"--workers {a.workers} != --prefill-workers {a.prefill_workers} + --decode-workers "
                       f"{a.decode_workers}: give the pools alone")
    if a.prefill_workers == a.decode_workers == 0 and not _DISAGG_AXES & set(axes):
        from kvtier.sim.experiment import DISAGG_ONLY

        inert = [f for f, given in (("--kv-link", a.kv_link is not None),
                                    ("--kv-link-gbps", a.kv_link_gbps is not None),
                                    ("--local-prefill-tokens", a.local_prefill_tokens != 0),
                                    ("--kv-link-sharing", a.kv_link_sharing != "none"),
                                    ("--decode-device-tokens", a.decode_device_tokens is not None),
                                    ("--decode-max-running", a.decode_max_running is not None)) if given]
        inert += [f"grid axis {axis!r}" for axis in DISAGG_ONLY if axis in axes]
        if inert:
            raise CliError(f"{', '.join(inert)}: {'they apply' if len(inert) > 1 else 'it applies'} to a "
                           "disaggregated cluster only; give --prefill-workers and --decode-workers")
    workers = a.workers if a.workers is not None else (pools or ClusterConfig().workers)
    return ClusterConfig.of(
        workers=workers, prefill_workers=a.prefill_workers, decode_workers=a.decode_workers,
        kv_link=a.kv_link or DEFAULT_KV_LINK,
        kv_gbps=a.kv_link_gbps, local_prefill_tokens=a.local_prefill_tokens,
        decode_device_tokens=a.decode_device_tokens, decode_max_running=a.decode_max_running,
        kv_link_sharing=a.kv_link_sharing,
        **{k: getattr(a, k) for k in ("device_tokens", "l3", "l3_tokens", "model", "swa_ratio", "draft_model",
                                      "prefill_budget", "max_running", *CACHE_SETTINGS)},
        h2d_gbps=a.h2d_gbps if a.h2d_gbps is not None else GPU_LINKS[a.gpu_link].gbps,
        storage_gbps=a.storage_gbps if a.storage_gbps is not None else STORAGE_LINKS[a.storage_link].gbps,
        latency=_latency(a.latency))


def _warn_inert(a: argparse.Namespace, axes: Collection[str] = ()) -> None:
    """A line on stderr for each option given that changes nothing in these runs (a setting that reads as if it
    mattered): the L3 tier's and its link's with no L3 tier, the host link's with no tier to load back from, a write
    or prefetch policy's setting under another policy, a sliding-window model's with a full-attention one, the SLO's
    with no SLO, the event-loss recovery's with no loss, an Azure trace's prefix groups with another trace. A sweep
    axis that may make them apply silences them; an option is named once, for its first reason. O(1)."""
    cache, cluster = CacheConfig(), ClusterConfig()
    run = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    inert: list[tuple[str, bool, str]] = []

    def unless(*names: str) -> bool:  # no sweep axis among ``names``
        return not set(names) & set(axes)
    if a.l3 == "none" and unless("l3"):
        inert += [(f"--{name.replace('_', '-')}", getattr(a, name) != default, "without an L3 tier (--l3 disk or "
                   "external)") for name, default in (("l3_tokens", cluster.l3_tokens),
                                                      ("prefetch_policy", cache.prefetch_policy),
                                                      ("prefetch_min_pages", cache.prefetch_min_pages),
                                                      ("prefetch_timeout_s", cache.prefetch_timeout_s),
                                                      ("storage_link", DEFAULT_STORAGE_LINK),
                                                      ("storage_gbps", None))]
        if a.host_ratio == 0 and unless("host_ratio"):
            inert += [(option, given, "without a host or L3 tier (--host-ratio, --l3)")
                      for option, given in (("--gpu-link", a.gpu_link != DEFAULT_GPU_LINK),
                                            ("--h2d-gbps", a.h2d_gbps is not None),
                                            ("--no-load-back", not a.load_back))]
    if a.write_policy != WritePolicy.WRITE_THROUGH_SELECTIVE and unless("write_policy"):
        inert.append(("--selective-threshold", a.selective_threshold != cache.selective_threshold,
                      f"but with --write-policy {WritePolicy.WRITE_THROUGH_SELECTIVE}"))
    if a.prefetch_policy != PrefetchPolicy.TIMEOUT and unless("prefetch_policy"):
        inert.append(("--prefetch-timeout-s", a.prefetch_timeout_s != cache.prefetch_timeout_s,
                      f"but with --prefetch-policy {PrefetchPolicy.TIMEOUT}"))
    if not MODEL_PRESETS[a.model].swa_layers and unless("model"):
        inert += [("--swa-ratio", a.swa_ratio != cluster.swa_ratio, "but with a sliding-window model (--model)"),
                  ("--no-swa-events", not a.swa_events, "but with a sliding-window model (--model)")]
    if a.sla_ttft_ms is a.sla_tpot_ms is None and unless("sla_ttft_ms", "sla_tpot_ms"):  # (routing reads no e2e bound)
        inert.append(("--slo-out-of-reach", a.slo_out_of_reach != run["slo_out_of_reach"],
                      "without a TTFT or TPOT bound (--sla-ttft-ms, --sla-tpot-ms)"))
    if not a.event_loss and unless("event_loss"):
        inert += [(f"--{name.replace('_', '-')}", getattr(a, name) != run[name], "without --event-loss")
                  for name in ("recovery", "replay_buffer", "loss_burst")]
    if not is_azure(a.trace):
        inert += [("--shared-prefix-blocks", a.shared_prefix_blocks != 0, "but with an Azure CSV trace"),
                  ("--prefix-groups", a.prefix_groups != 8, "but with an Azure CSV trace")]
    elif a.shared_prefix_blocks == 0 and unless("shared_prefix_blocks"):
        # (lengths only: no two prompts share a block unless sharing is synthesised, so every hit rate reads 0)
        print("kvtier: warning: an Azure CSV trace holds lengths only: with --shared-prefix-blocks 0 (the default) no "
              "two prompts share a block and nothing can hit; --shared-prefix-blocks N gives each request its prefix "
              "group's first N blocks", file=sys.stderr)
    named: set[str] = set()
    for option, given, why in inert:
        if given and option not in named:
            named.add(option)
            print(f"kvtier: warning: {option} changes nothing {why}", file=sys.stderr)


def _latency(spec: str) -> MockerLatency:
    try:
        return resolve_latency(spec)
    except ValueError as exc:
        raise CliError(f"--latency {exc}") from None


def _run_cfg(a: argparse.Namespace, policy: str) -> RunConfig:
    check_policy(policy)
    return RunConfig(policy, a.cost, a.event_delay, a.event_loss, a.host_credit, a.disk_credit, a.temperature,
                     a.seed, closed_loop=not a.open_loop, until_s=a.until, recovery=a.recovery,
                     replay_buffer=a.replay_buffer, loss_burst=a.loss_burst, sla_ttft_ms=a.sla_ttft_ms,
                     sla_tpot_ms=a.sla_tpot_ms, sla_e2e_ms=a.sla_e2e_ms, slo_out_of_reach=a.slo_out_of_reach)


def _trace(a: argparse.Namespace) -> TraceSource:
    from kvtier.sim.experiment import trace_source

    try:
        return trace_source(a.trace, limit=a.limit, seed=a.trace_seed, time_scale=a.time_scale,
                            shared_prefix_blocks=a.shared_prefix_blocks, prefix_groups=a.prefix_groups)
    except (TraceError, FileNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"trace {a.trace}: {exc.strerror or exc}") from None


def _meta(a: argparse.Namespace, n_requests: int, run: RunConfig, axes: Collection[str] = ()) -> dict[str, Any]:
    """What every run of a command depends on, bar its policy: the trace and how it was read, the cluster (that a
    sweep's ``axes`` vary), and the router's settings (``run``'s, whose policy each run names itself)."""
    return {"trace": a.trace, "requests": n_requests,
            "trace_settings": {"limit": a.limit, "seed": a.trace_seed, "time_scale": a.time_scale,
                               "shared_prefix_blocks": a.shared_prefix_blocks, "prefix_groups": a.prefix_groups},
            "cluster": _cluster(a, axes).settings(),
            "run": {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name != "policy"},
            "slo_ms": {"ttft": a.sla_ttft_ms, "tpot": a.sla_tpot_ms, "e2e": a.sla_e2e_ms}}


#: How long loading the compiled kernels may take before the CLI says why it is quiet, seconds.
KERNEL_NOTICE_S = 2.0


def _load_kernels_saying_so(load: Callable[[], object], whose: str, first: str, takes: str) -> None:
    """Loads ``whose`` compiled kernels (``load``: the simulator's before the runs, which forked run processes
    inherit; the index's before the service starts). Loading takes about a second from numba's cache; the first
    ``first`` after an install compiles them, which ``takes`` on 2 cores: past :data:`KERNEL_NOTICE_S` a line says
    so, and when they are ready how long it took."""
    done = threading.Event()
    said = threading.Event()

    def notice() -> None:
        if not done.wait(KERNEL_NOTICE_S):
            said.set()
            print(f"kvtier: loading {whose} compiled kernels (the first {first} after an install compiles them "
                  f"into numba's cache, {takes} on 2 cores)...", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    watcher = threading.Thread(target=notice, daemon=True)
    watcher.start()
    try:
        load()
    finally:
        done.set()
        watcher.join()
    if said.is_set():
        print(f"kvtier: kernels ready after {time.monotonic() - t0:.0f} s; once cached they load in about a second",
              file=sys.stderr, flush=True)


class _RunsProgress:
    """Runs finished: a bar on a terminal, else a line per run (a CI log, a pipe), so a long comparison is never
    silent; while no run finishes, the bar's clock is refreshed, or a line says how long it has been, every
    :attr:`heartbeat_s` (a run of a long trace takes minutes)."""

    heartbeat_s = 15.0

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.total, self.count, self.t0 = total, 0, time.monotonic()
        self.bar = tqdm(total=total, desc="runs", unit="run", disable=None)
        self.lines = bool(self.bar.disable)
        self._lock = threading.Lock()  # (the heartbeat thread and the thread reporting runs done)
        self._last = self.t0  # when a line or a run was last shown
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="kvtier-runs-progress", daemon=True)

    def done(self, tag: dict[str, Any], res: RunResult) -> None:
        with self._lock:
            self.count += 1
            self.bar.update(1)
            self._last = time.monotonic()
            if self.lines:
                what = " ".join(f"{k}={v}" for k, v in tag.items())
                print(f"kvtier: run {self.count}/{self.total} done ({what}; {res.summary.requests} requests) after "
                      f"{self._last - self.t0:.1f} s", file=sys.stderr, flush=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s / 3):
            with self._lock:
                now = time.monotonic()
                if now - self._last < self.heartbeat_s:
                    continue
                self._last = now
                if self.lines:
                    print(f"kvtier: {self.count}/{self.total} runs done after {now - self.t0:.0f} s; the others are "
                          "running", file=sys.stderr, flush=True)
                else:
                    self.bar.refresh()

    def __enter__(self) -> _RunsProgress:
        self._beat.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._beat.join()
        self.bar.close()


# --- commands ------------------------------------------------------------------------------


def _check_output(option: str, path: str | Path) -> None:
    """:class:`CliError` naming ``option`` if the file ``path`` could not be written. O(1)."""
    problem = unwritable(path)
    if problem is not None:
        raise CliError(f"{option} {path}: {problem}")


def _not_an_input(a: argparse.Namespace, option: str, path: Path) -> None:
    """:class:`CliError` if writing ``path`` would overwrite one of the run's input files (``--trace``,
    ``--latency`` or a sweep's ``latency`` values, a policy plugin's file), which a later run would then read.
    O(policies + grid values)."""
    latency = getattr(a, "latency", None)
    named = [("--trace", getattr(a, "trace", None)), ("--latency", None if latency in LATENCY_PRESETS else latency)]
    for item in getattr(a, "grid", None) or []:
        axis, _, values = item.partition("=")
        if axis.strip() == "latency":
            named += [("--grid latency", v) for v in values.split(",") if v not in LATENCY_PRESETS]
    for option_name in ("policy", "policies"):
        specs = getattr(a, option_name, None)
        for spec in specs.split(",") if isinstance(specs, str) else []:
            file, _, _ = spec.strip().rpartition(":")
            if file.endswith(".py"):
                named.append((f"--{option_name} plugin", file))
    inputs = {os.path.realpath(p): name for name, p in named if p and Path(p).is_file()}
    clash = inputs.get(os.path.realpath(path))
    if clash is not None:
        raise CliError(f"{option} {path}: is the {clash} file the run reads; name another file")


def _is_stdout_file(path: Path) -> bool:
    """Whether ``path`` is the regular file this process's standard output writes to (``/dev/stdout`` with stdout
    redirected to a file): written there too, the one would overwrite the other. O(1)."""
    try:
        st, out = os.stat(path), os.fstat(1)
    except OSError:  # (no such file yet; stdout closed)
        return False
    return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (out.st_dev, out.st_ino)


def _out_dir(a: argparse.Namespace, *names: str) -> Path:
    """``--out``, made if need be, once it is known that ``names`` can be written in it (and would overwrite no
    input): checked now, not once every run is done and its results have nowhere to go. O(1)."""
    if not a.out:
        raise CliError("--out: empty; name a directory")
    out_dir = Path(a.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"--out {a.out}: is not a directory; name a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"--out {a.out}: {exc.strerror or exc}") from None
    for name in names:
        problem = unwritable(out_dir / name)
        if problem is not None:
            raise CliError(f"--out {a.out}: {name} {problem}")
        _not_an_input(a, f"--out {a.out}:", out_dir / name)
    return out_dir


def _compare(a: argparse.Namespace, policies: list[str]) -> int:
    from kvtier.sim.experiment import RunSpec, execute, run_jobs
    from kvtier.sim.report import PLOTS, join_csv, join_files, plot, remove_stale, table, wholes, write_json

    trace = _trace(a)
    cluster = _cluster(a)
    runs = [_run_cfg(a, p) for p in policies]  # (before --out is made: a refused policy leaves nothing behind)
    names = ("summary.json", "requests.csv", *([] if a.no_plots else PLOTS))
    # --itl-series is checked now, not once every run is done; before --out is made, unless it is to go in --out
    # (its directory is missing until then)
    itl_in_out = a.itl_series is not None and a.out and not a.itl_series.parent.exists() and \
        os.path.realpath(a.itl_series.parent) == os.path.realpath(a.out)
    if a.itl_series is not None:
        if not itl_in_out:
            _check_output("--itl-series", a.itl_series)
        _not_an_input(a, "--itl-series", a.itl_series)
        own = {os.path.realpath(Path(a.out) / n) for n in (".", *names)} if a.out else set()
        if os.path.realpath(a.itl_series) in own:
            raise CliError(f"--itl-series {a.itl_series}: is --out or one of its own outputs; name another file")
        if _is_stdout_file(a.itl_series):
            raise CliError(f"--itl-series {a.itl_series}: is the file this run's standard output goes to, where "
                           "the results table is printed; name another file")
    out_dir = _out_dir(a, *names)
    if itl_in_out:
        _check_output("--itl-series", a.itl_series)
    # Each run streams its records to a part of requests.csv (in its own process), so no process holds a
    # long trace's records; the parts are joined in policy order.
    parts = [out_dir / f".requests.{i}.csv" for i in range(len(policies))]
    # (in --out, not beside --itl-series: that may be a device, /dev/stdout)
    itl_parts = ([out_dir / f".itl.{i}.jsonl" for i in range(len(policies))]
                 if a.itl_series is not None else [None] * len(policies))
    jobs = [RunSpec(trace, cluster, run, {"policy": policy_label(p)}, records_csv=part, itl_jsonl=itl)
            for p, run, part, itl in zip(policies, runs, parts, itl_parts, strict=True)]
    _warn_inert(a)  # (once every option is checked: a refused one gets its error alone)
    print(f"kvtier: {len(trace)} requests from {a.trace}, {cluster.describe_workers()}, "
          f"{cluster.describe_devices()}, host x{cluster.host_ratio:g}, l3={cluster.l3}; "
          f"policies: {', '.join(policies)}", file=sys.stderr)
    t0 = time.monotonic()
    _load_kernels_saying_so(load_kernels, "the simulator's", "run", "a minute or two")
    # The outputs are written under hidden names, then renamed into place together: a compare that stops leaves
    # neither its parts nor a summary beside a half-joined requests.csv.
    outputs = [out_dir / "summary.json", out_dir / "requests.csv"]
    if a.itl_series is not None:
        outputs.append(a.itl_series)
    with _removed_on_failure([*parts, *(p for p in itl_parts if p is not None)]), wholes(outputs) as staged:
        if getattr(a, "progress", False):
            results = [execute(jobs[0], progress=True)]
        else:
            with _RunsProgress(len(jobs)) as bar:
                results = run_jobs(jobs, processes=a.jobs, on_done=bar.done)
        wall, peak = time.monotonic() - t0, _peak_rss_mib()
        summaries = [res.summary for _, res in results]
        write_json(staged[0], summaries, {**_meta(a, len(trace), jobs[0].run), "wall_s": round(wall, 3),
                                          "peak_rss_mib": round(peak, 1)})
        join_csv(staged[1], parts)
        if a.itl_series is not None:
            join_files(staged[2], [p for p in itl_parts if p is not None])
    _print_table(table(summaries), outputs[0])  # (once the results are on disk: a closed stdout loses none)
    _warn(summaries)
    written = list(outputs)
    if not a.no_plots:
        where = (f"{a.trace}, {cluster.describe_workers()}, {cluster.describe_devices()}, "
                 f"host x{cluster.host_ratio:g}, l3 {cluster.l3}")
        with _interrupt_after():
            written += plot(out_dir, summaries, [res for _, res in results], where, runs[0].slo)
    remove_stale(out_dir, PLOTS, written)
    print(f"\nran in {wall:.1f} s, peak memory {peak:,.0f} MiB (largest process); wrote "
          f"{', '.join(str(p) for p in written)}", file=sys.stderr)
    return _unfinished_status(a, summaries, len(trace))


class Stopped(KeyboardInterrupt):
    """A stop signal (SIGTERM: ``kill``, ``timeout``, a supervisor; SIGHUP: the terminal closed) taken as a Ctrl-C
    is: the runs under way end, their parts are removed, and the exit status is the signal's."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stopping(signum: int, frame: object) -> None:
    raise Stopped(signum)


def _stop_signals() -> contextlib.AbstractContextManager[bool]:
    """Raises :class:`Stopped` on a stop signal while the command runs (see :mod:`kvtier.util.signals`). O(1)."""
    return handling(STOP_SIGNALS, _stopping)


@contextlib.contextmanager
def _interrupt_after() -> Iterator[None]:
    """Holds a Ctrl-C (or a stop signal) while the plots are drawn and written, and raises it once they are:
    matplotlib runs weakref callbacks, where Python prints an interrupt and drops it (the command then went on and
    exited 0). See :mod:`kvtier.util.signals` for the signals ignored and the threads. O(1)."""
    held: list[int] = []
    with handling((signal.SIGINT, *STOP_SIGNALS), lambda signum, frame: held.append(signum)):
        yield
    if held:
        raise KeyboardInterrupt if held[0] == signal.SIGINT else Stopped(held[0])


@contextlib.contextmanager
def _removed_on_failure(parts: list[Path]) -> Iterator[None]:
    """Removes the ``parts`` (hidden files each run streams its records to, joined once every run is done) when
    what it wraps fails or is interrupted, so that a stopped run leaves none behind. O(parts)."""
    try:
        yield
    except BaseException:
        for part in parts:
            part.unlink(missing_ok=True)
        raise


def _print_table(text: str, saved: Path) -> None:
    """Prints the results table on stdout; one that cannot take it (closed, as by ``| head``, or full) costs a
    warning, not the outputs still to write: the table is in ``saved``. Later prints to stdout go nowhere."""
    try:
        print(text, flush=True)
    except OSError as exc:
        print(f"kvtier: warning: the results table could not be printed ({exc.strerror or exc}); it is in {saved}",
              file=sys.stderr)
        with contextlib.suppress(OSError, ValueError):  # (so that the exit's flush does not fail again)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _warn(summaries: list[Any]) -> None:
    """What the table shows only as a number and no routing policy fixes: overload, rejected requests."""
    from kvtier.sim.report import run_warnings

    for why in run_warnings(summaries):
        print(f"kvtier: warning: {why}", file=sys.stderr)


def _peak_rss_mib() -> float:
    """Peak resident memory of this process or its largest run process so far, MiB."""
    import resource

    kib = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return kib / (1024 * 1024 if sys.platform == "darwin" else 1024)  # macOS counts bytes, Linux KiB


def _unfinished_status(a: argparse.Namespace, summaries: list[Any], total: int,
                       stops: list[str | None] | None = None) -> int:
    """1 (with the reason on stderr) if some requests did not finish, unless --allow-unfinished. ``stops``: where
    each run was told to stop, as its setting is named (default: ``--until``, where given)."""
    until = f"--until {a.until:g}" if a.until is not None else None
    for s, stop in zip(summaries, stops or [until] * len(summaries), strict=True):
        if s.unfinished:
            why = f"the run stopped at {stop} s" if stop is not None else "they never completed"
            print(f"kvtier: {s.unfinished} of {total} requests did not finish under {s.policy} ({why})",
                  file=sys.stderr)
    short = [s for s in summaries if s.unfinished]
    if short and not a.allow_unfinished:
        print("kvtier: error: unfinished requests (pass --allow-unfinished to accept them)", file=sys.stderr)
        return 1
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    if a.policies is None:  # kvtier's SLO-aware policy where there is an SLO to be told (without: min_ttft's rows)
        slo = any(v is not None for v in (a.sla_ttft_ms, a.sla_tpot_ms, a.sla_e2e_ms))
        a.policies = DEFAULT_POLICIES + (",goodput" if slo else "")
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    if not policies:
        raise CliError(f"--policies: {a.policies!r} names no policy; expected a comma-separated list from "
                       f"{', '.join(POLICIES)} or plugins")
    unknown = [p for p in policies if p not in REGISTRY and not is_plugin_spec(p)]
    if len(unknown) > 1:  # (one: the registry's line)
        raise CliError(f"--policies: unknown policies {', '.join(repr(p) + did_you_mean(p, POLICIES) for p in unknown)}"
                       f"; expected names from {', '.join(POLICIES)}, or plugins")
    named: dict[str, str] = {}
    for p in policies:
        label = policy_label(p)
        if label in named:
            raise CliError(f"--policies: {named[label]} and {p} are both called {label!r} in the results")
        named[label] = p
    return _compare(a, policies)


def cmd_replay(a: argparse.Namespace) -> int:
    a.jobs = 1
    a.progress = True  # one run in this process: a per-request progress bar
    return _compare(a, [a.policy])


def cmd_sweep(a: argparse.Namespace) -> int:
    from kvtier.sim.experiment import grid_jobs, parse_grid, run_jobs
    from kvtier.sim.report import SWEEP_PLOTS, remove_stale, table, whole, write_sweep

    try:
        grid = parse_grid(a.grid)
        run = _run_cfg(a, a.policy)
        jobs = grid_jobs(_trace(a), _cluster(a, grid), run, grid, keep_records=False)
    except ValueError as exc:  # ConfigError included
        raise CliError(str(exc)) from None
    # What every grid point shares (the trace, the cluster and run settings the grid varies from, the grid) beside
    # the points, as summary.json keeps it
    meta = {**_meta(a, len(jobs[0].trace) if jobs else 0, run, grid), "grid": grid}
    _warn_inert(a, grid)
    if a.ray and importlib.util.find_spec("ray") is None:
        raise CliError("--ray needs Ray: pip install ray (or drop --ray for a local process pool)")
    out_dir = _out_dir(a, "sweep.json", "sweep.csv", *([] if a.no_plots else SWEEP_PLOTS))
    print(f"kvtier sweep: {len(jobs)} runs over {', '.join(grid)}"
          f" on {'Ray' if a.ray else 'a local process pool'}", file=sys.stderr)
    t0 = time.monotonic()
    _load_kernels_saying_so(load_kernels, "the simulator's", "run", "a minute or two")
    with _RunsProgress(len(jobs)) as bar:
        results = run_jobs(jobs, processes=a.jobs, use_ray=a.ray, on_done=bar.done)
    wall, peak = time.monotonic() - t0, _peak_rss_mib()
    rows = []
    summaries = []
    for tag, res in results:
        s = res.summary
        s.policy = " ".join(f"{k}={v}" for k, v in tag.items() if v is not None)  # (None: not applicable)
        summaries.append(s)
        rows.append({**tag, **{k: None if isinstance(v, float) and math.isnan(v) else v  # (strict JSON: no NaN)
                               for k, v in s.as_dict().items() if k not in ("policy", "extra", "slo")},
                     **s.extra})
    with whole(out_dir / "sweep.json") as part:
        part.write_text(json.dumps({"meta": meta, "runs": rows}, indent=2, default=str))
    _print_table(table(summaries, first="grid point"), out_dir / "sweep.json")
    _warn(summaries)
    with _interrupt_after():
        written = [out_dir / "sweep.json", *write_sweep(out_dir, rows, list(grid), plots=not a.no_plots)]
    remove_stale(out_dir, SWEEP_PLOTS, written)
    where = " (this process: Ray's workers not counted)" if a.ray else " (largest process)"
    print(f"\nran in {wall:.1f} s, peak memory {peak:,.0f} MiB{where}; wrote {', '.join(str(p) for p in written)}",
          file=sys.stderr)
    # (a grid's until_s stops its own points)
    stops = [f"until_s={tag['until_s']:g}" if tag.get("until_s") is not None else
             (f"--until {a.until:g}" if a.until is not None else None) for tag, _ in results]
    return _unfinished_status(a, summaries, len(jobs[0].trace) if jobs else 0, stops)


def cmd_gen_trace(a: argparse.Namespace) -> int:
    spec = replace(PRESETS[a.kind], requests=a.requests, **({"rate": a.rate} if a.rate is not None else {}))
    last = 0.0

    def stream() -> Iterator[Request]:
        nonlocal last
        for i, req in enumerate(iter_generate(spec, a.seed), 1):  # written as generated: in flat memory
            if req.arrival * 1000 > MAX_TIMESTAMP_MS:  # (a trace holding it is refused when read)
                raise CliError(f"--rate {spec.rate:g}: request {req.request_id} would arrive at {req.arrival:.3g} s, "
                               f"past the {MAX_TIMESTAMP_MS / 1000:g} s a trace's timestamps may reach")
            last = req.arrival
            yield req
            if i % GEN_PROGRESS_EVERY == 0:
                print(f"kvtier: {i:,} of {a.requests:,} requests written", file=sys.stderr, flush=True)

    from kvtier.sim.report import whole

    _check_output("-o", a.output)
    try:
        with whole(Path(a.output)) as part:  # (no partial trace left behind, and a device or FIFO written through)
            n = write_mooncake(stream(), part)
    except OSError as exc:
        raise CliError(f"-o {a.output}: {exc.strerror or exc}") from None
    print(f"wrote {n} {a.kind} requests over {last:.0f} s to {a.output}", file=sys.stderr)
    return 0


def cmd_tokens(a: argparse.Namespace) -> int:
    """Prints one request's prompt as the indexer's query body, ``{"token_ids": [...]}``: the tokens ``kvtier
    engine --trace T --seed S`` serves for it, so a query of a running engine's prefix hits."""
    from kvtier.sim.experiment import resolve_trace
    from kvtier.sim.trace import TokenBank

    try:  # (by index, the records up to it alone are read: the first of a million-line trace at once)
        reqs = resolve_trace(a.trace, seed=a.seed, limit=None if a.request is not None else (a.index or 0) + 1)
    except (TraceError, FileNotFoundError, ValueError) as exc:
        raise CliError(str(exc)) from None
    if a.request is not None:
        found = [r for r in reqs if r.request_id == a.request]
        if not found:
            raise CliError(f"--request {a.request!r}: no such request in {a.trace} (ids: {reqs[0].request_id} ...)")
        req = found[0]
    elif (a.index or 0) >= len(reqs):
        raise CliError(f"--index {a.index}: {a.trace} has {len(reqs)} requests")  # (fewer than the limit read)
    else:
        req = reqs[a.index or 0]
    print(json.dumps({"token_ids": TokenBank(seed=a.seed).tokens(req)}))
    return 0


def cmd_fit_latency(a: argparse.Namespace) -> int:
    from kvtier.sim.report import whole

    _check_output("-o", a.output)  # (said before the fit is printed, not after it)
    if Path(a.csv).is_file() and os.path.realpath(a.output) == os.path.realpath(a.csv):  # (the points, lost)
        raise CliError(f"-o {a.output}: is the points file the fit reads; name another file")
    if _is_stdout_file(Path(a.output)):
        raise CliError(f"-o {a.output}: is the file this command's standard output goes to, where the fit is "
                       "printed; name another file")
    try:
        prefill, decode = load_latency_points(str(a.csv))
        fit = fit_latency(prefill, decode, a.kv_pool_tokens)
    except OSError as exc:
        raise CliError(f"{a.csv}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    default = MockerLatency()
    print(f"prefill_ms = {fit.prefill_a:.6g}*T^2 + {fit.prefill_b:.6g}*T + {fit.prefill_c:.6g}   "
          f"({len(prefill)} points, rmse {_rmse(prefill, lambda x: fit.prefill_ms(round(x))):.3g} ms)")
    decoded = f"({len(decode)} points, rmse {_rmse(decode, fit.decode_ms):.3g} ms)" if decode else "(kept: no points)"
    print(f"decode_ms  = max({fit.decode_floor:g}, {fit.decode_a:.6g}*u^2 + {fit.decode_b:.6g}*u + {fit.decode_c:.6g})"
          f"   {decoded}")
    for tokens in (512, 2048, 8192):
        print(f"  prefill {tokens:>5} tokens: {fit.prefill_ms(tokens):8.2f} ms "
              f"(mocker fit {default.prefill_ms(tokens):8.2f})")
    try:
        with whole(Path(a.output)) as part:  # (a failed write leaves the previous fit whole)
            part.write_text(latency_to_json(fit))
    except OSError as exc:
        raise CliError(f"-o {a.output}: {exc.strerror or exc}") from None
    print(f"wrote {a.output}; use it with --latency {a.output}", file=sys.stderr)
    return 0


def _rmse(points: list[tuple[float, float]], f: Callable[[float], float]) -> float:
    return math.sqrt(math.fsum((f(x) - y) * (f(x) - y) for x, y in points) / len(points))  # (inf, not an error)


def cmd_indexer(a: argparse.Namespace) -> int:
    # The service (and aiohttp) is imported only for this command, so the simulator starts lean.
    from kvtier.indexer.service.app import ConfigError, ServiceConfig, load_config, parse_endpoint, serve
    from kvtier.indexer.service.app import load_kernels as load_index_kernels

    try:
        cfg = load_config(a.config) if a.config else ServiceConfig(endpoints=[])
        eps = cfg.endpoints + [parse_endpoint(s) for s in a.endpoint]
        given = (("block_size", a.block_size), ("listen", a.listen), ("cost", a.cost), ("snapshot_path", a.snapshot),
                 ("policy", a.policy), ("model", a.model), ("window_tokens", a.window_tokens),
                 ("http_loop", a.http_loop), ("loop_restarts", a.loop_restarts), ("gpu_link", a.gpu_link),
                 ("storage_link", a.storage_link), ("h2d_gbps", a.h2d_gbps), ("storage_gbps", a.storage_gbps),
                 ("host_credit", a.host_credit), ("disk_credit", a.disk_credit), ("temperature", a.temperature),
                 ("seed", a.seed), ("prefill_budget", a.prefill_budget), ("capacity_tokens", a.capacity_tokens),
                 ("decode_capacity_tokens", a.decode_capacity_tokens),
                 ("latency_path", a.latency), ("slo_out_of_reach", a.slo_out_of_reach), ("kv_link", a.kv_link),
                 ("kv_gbps", a.kv_link_gbps), ("local_prefill_tokens", a.local_prefill_tokens),
                 ("liveness_timeout_s", a.liveness_timeout),
                 ("auth_token_file", str(a.auth_token_file) if a.auth_token_file is not None else None),
                 *((name, getattr(a, name)) for name in _INDEXER_LIMITS))
        overrides: dict[str, Any] = {k: v for k, v in given if v is not None}
        cfg = replace(cfg, endpoints=eps, **overrides)
        if not cfg.endpoints:
            raise ConfigError("give at least one --endpoint or a --config with [[endpoints]]")
        cfg.routing_settings()  # (its errors now, not after a first start's compilation)
        serve(cfg, functools.partial(_load_kernels_saying_so, load_index_kernels, "the index's", "start",
                                     "half a minute or more"), [("the --config file", a.config)] if a.config else [])
    except ConfigError as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:  # the HTTP port: in use, or an address this host does not have
        raise CliError(f"cannot listen on {cfg.listen}: {exc.strerror or exc}") from None
    return 0


#: `kvtier indexer`'s limits on HTTP clients and publishers: option (--max-connections ...) -> (type, help); each is
#: the ServiceConfig setting of the same name (its domain checked there), default the config's, else the README's.
_INDEXER_LIMITS: dict[str, tuple[type, str]] = {
    "max_body_bytes": (int, "request body cap, on the wire and decompressed (413)"),
    "max_body_bytes_in_flight": (int, "what all request bodies being read hold together (503, closed)"),
    "max_query_tokens": (int, "token ids per request (400)"),
    "max_mm_items": (int, "multimodal items per request (400)"),
    "max_json_depth": (int, "JSON nesting depth of a body (400)"),
    "max_json_containers": (int, "JSON arrays and objects in a body (400)"),
    "max_request_id_bytes": (int, "request_id length, UTF-8 bytes (400)"),
    "max_in_flight": (int, "bookings in flight in all (503)"),
    "max_in_flight_per_client": (int, "bookings in flight per client (429)"),
    "max_in_flight_blocks": (int, "prompt blocks the bookings in flight hold, in all (503)"),
    "max_in_flight_blocks_per_client": (int, "prompt blocks one client's bookings in flight hold (429)"),
    "max_connections": (int, "open HTTP connections (one more: 503, closed)"),
    "max_connections_per_peer": (int, "open HTTP connections from one peer address (429, closed)"),
    "header_timeout_s": (float, "seconds a new connection has to send its request headers"),
    "read_timeout_s": (float, "seconds a request body has to arrive (408)"),
    "max_context_tokens": (int, "the served model's context: output_tokens a finish may report (400)"),
    "max_frame_bytes": (int, "the largest ZMQ frame taken from a publisher (a larger one drops its connection; "
                             "its events are recovered as lost ones are)"),
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:  # (run from a source tree that was never installed)
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvtier", description="KV-cache-aware routing toolkit", formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"kvtier {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add = functools.partial(sub.add_parser, formatter_class=HelpFormatter)

    p = add("compare", help="several routing policies on one trace and cluster; table, JSON, CSV, plots")
    _add_trace_args(p)
    _add_cluster_args(p)
    _add_router_args(p)
    p.add_argument("--policies",
                   help=f"comma-separated, from {', '.join(POLICIES)}; {_PLUGIN_FORMS} (default: {DEFAULT_POLICIES}; "
                        "and goodput where an --sla-* bound is given)")
    p.add_argument("--out", default="out/compare", help="output directory")
    p.add_argument("--jobs", type=COUNT.parse, help="parallel processes (default: one per core)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=cmd_compare)

    p = add("replay", help="one policy on one trace")
    _add_trace_args(p)
    _add_cluster_args(p)
    _add_router_args(p)
    p.add_argument("--policy", default="kv_all", help=f"one of {', '.join(POLICIES)}; {_PLUGIN_FORMS} "
                                                      "(default: %(default)s)")
    p.add_argument("--out", default="out/replay", help="output directory")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.set_defaults(func=cmd_replay)

    p = add("sweep", help="a grid over cluster and router settings")
    _add_trace_args(p)
    _add_cluster_args(p)
    _add_router_args(p, itl_series=False)
    p.add_argument("--policy", default="kv_all",
                   help="policy unless the grid has a policy axis, as replay's --policy (default: %(default)s)")
    p.add_argument("--grid", nargs="+", required=True, metavar="NAME=V1,V2",
                   help="axes, e.g. device_tokens=65536,131072 host_ratio=0,2 policy=kv_device,kv_all "
                        "pools=agg,8:8,4:12 (splits of --workers into prefill:decode workers; or prefill_workers= and "
                        "decode_workers=, which resize the cluster). NAME is a setting as summary.json's "
                        "meta.cluster and meta.run name it: mostly the option's, event_delay_s for --event-delay")
    p.add_argument("--out", default="out/sweep", help="output directory")
    p.add_argument("--jobs", type=COUNT.parse, help="parallel processes (default: one per core)")
    p.add_argument("--ray", action="store_true", help="run on a Ray cluster (RAY_ADDRESS or a local one)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (one per measure across the grid)")
    p.set_defaults(func=cmd_sweep)

    p = add("gen-trace", help="write a seeded synthetic trace as Mooncake JSONL")
    p.add_argument("--kind", choices=sorted(PRESETS), default="chat", help="workload generator")
    p.add_argument("--requests", type=GEN_REQUESTS.parse, default=1000,
                   help=f"requests to generate (at most {GEN_REQUESTS.hi:,}; a line on stderr every "
                        f"{GEN_PROGRESS_EVERY:,})")
    p.add_argument("--rate", type=TIME_SCALE.parse, help="new sessions per second (default: the preset's)")
    p.add_argument("--seed", type=SEED.parse, default=0, help="generator seed")
    p.add_argument("-o", "--output", required=True, help="JSONL file to write")
    p.set_defaults(func=cmd_gen_trace)

    p = add("tokens", help="print a trace request's prompt as the indexer's query body {\"token_ids\": [...]}",
            description="The token ids `kvtier engine --trace T --seed S` serves for one request of T: pipe them to "
                        "the indexer's POST /query or /route to ask about a prefix the engine holds.")
    p.add_argument("--trace", required=True, help="the engine's --trace (a file or builtin:KIND[:N])")
    p.add_argument("--seed", type=SEED.parse, default=0, help="the engine's --seed (builtin traces and token ids)")
    which = p.add_mutually_exclusive_group()
    # (no default value: argparse takes an option given with its default's value for one not given)
    which.add_argument("--index", type=SEED.parse, help="the request's position in the trace (default: 0)")
    which.add_argument("--request", help="the request's id (instead of --index)")
    p.set_defaults(func=cmd_tokens)

    p = add("fit-latency", help="fit the prefill/decode latency model to measured points",
            description="Fits prefill_ms = a*T^2 + b*T + c (T: uncached tokens in a pass) and decode_ms = "
                        "a*u^2 + b*u + c (u: KV utilisation) by least squares to a CSV with columns kind,x,ms "
                        "(kind: prefill or decode), and writes the fit as JSON for --latency.")
    p.add_argument("csv", type=Path, help="measured points: kind,x,ms")
    p.add_argument("-o", "--output", default="latency.json", help="JSON file to write")
    p.add_argument("--kv-pool-tokens", type=SEED.parse, default=0, metavar="N",
                   help="the device KV pool, tokens, the decode utilisations are of (bench/gpu_latency.py prints "
                        "it); a simulated pool of another size is then charged for the same KV in use")
    p.set_defaults(func=cmd_fit_latency)

    p = add("engine", help="a live engine replaying a trace and publishing KV events over ZMQ",
                       description="Replays a trace through a real tiered cache, publishing its events (with "
                                   "replay and state dumps) for `kvtier indexer` to consume.")
    live.build_parser(p)
    p.set_defaults(func=live.run)

    p = add("indexer", help="subscribe to engines' KV events and answer overlap queries over HTTP",
                       description="Subscribes to engine ZMQ endpoints, keeps the tiered index, "
                                   "serves POST /query, POST /route (with /requests/{id}/first_token and "
                                   "/finish), GET /metrics and GET /health.")
    p.add_argument("--config", type=Path, help="TOML file with settings and [[endpoints]] tables")
    p.add_argument("--endpoint", action="append", default=[], metavar="SPEC",
                   help=f"{ENDPOINT_SPEC} (repeatable)")
    p.add_argument("--block-size", type=int, help="tokens per KV block: the engines' page size "
                   f"(default: the config's, else {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--listen", help="HTTP host:port (default: the config's, else 127.0.0.1:8000)")
    p.add_argument("--cost", choices=["credit", "ttft"],
                   help="the kv_* policies' cost, as the simulator's --cost (default: the config's, else credit)")
    p.add_argument("--policy", help="a policy by name, the simulator's with the same cost under the same settings "
                                    f"({', '.join(n for n, s in REGISTRY.items() if s.served)}), or a "
                                    "routing-policy plugin: module:attr, file.py:attr or an entry point of "
                                    "kvtier.policies (default: the config's, else kv_all)")
    g = p.add_argument_group("routing settings (as the simulator's; default: the config's, else the simulator's "
                             "defaults)")
    g.add_argument("--gpu-link", choices=sorted(GPU_LINKS), help="host<->device link preset")
    g.add_argument("--storage-link", choices=sorted(STORAGE_LINKS), help="storage link preset")
    g.add_argument("--h2d-gbps", type=float, help="host<->device bandwidth, GB/s (overrides --gpu-link)")
    g.add_argument("--storage-gbps", type=float, help="storage bandwidth, GB/s (overrides --storage-link)")
    g.add_argument("--kv-link", choices=sorted(KV_LINKS),
                   help="endpoints with roles: the prefill -> decode KV link preset")
    g.add_argument("--kv-link-gbps", type=float, help="prefill -> decode bandwidth, GB/s (overrides --kv-link)")
    g.add_argument("--local-prefill-tokens", type=int, metavar="N",
                   help="endpoints with roles: a prompt whose part its decode worker lacks is under N tokens "
                        "prefills there (0: never)")
    g.add_argument("--latency", metavar="NAME|JSON",
                   help=f"iteration-time fit: a preset ({', '.join(LATENCY_PRESETS)}) or a JSON from "
                        f"`kvtier fit-latency` (default: the config's, else {DEFAULT_LATENCY})")
    g.add_argument("--slo-out-of-reach", choices=OUT_OF_REACH, help=OUT_OF_REACH_HELP)
    g.add_argument("--prefill-budget", type=int, help="the workers' chunked-prefill tokens per iteration")
    g.add_argument("--capacity-tokens", type=int, help="each worker's device KV, tokens (ttft costs)")
    g.add_argument("--decode-capacity-tokens", type=int,
                   help="endpoints with roles: each decode worker's device KV, tokens (default: --capacity-tokens)")
    g.add_argument("--host-credit", type=float, help="credit cost: weight of a host-tier block")
    g.add_argument("--disk-credit", type=float, help="credit cost: weight of a disk or shared-pool block")
    g.add_argument("--temperature", type=float, help="softmax sampling over costs (0: argmin)")
    g.add_argument("--seed", type=int, help="seed of the router's random choices")
    p.add_argument("--snapshot", help="file the index is saved to (every 30 s and on stop) and restored from on "
                                      "start, resuming each stream after its last applied batch (default: none)")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), metavar="NAME",
                   help="the served model's preset: the ttft cost's transfer bytes and, for hybrid models, the "
                        "sliding window (default: the config's, else llama-3.1-8b)")
    p.add_argument("--window-tokens", type=int, metavar="N",
                   help="sliding window, tokens, for engines that send no window-KV events (SGLang): their window "
                        "KV is inferred from their stores and /query says window_kv: inferred; 0: scored on full "
                        "attention (default: the config's, else the --model preset's)")
    p.add_argument("--http-loop", choices=["auto", "uvloop", "asyncio"],
                   help="the HTTP front end's event loop; auto takes uvloop where it is installed "
                        "(default: the config's, else auto)")
    p.add_argument("--loop-restarts", type=int, metavar="N",
                   help="times a failed event loop starts again (back-off 0.5 s doubling to 30 s; each stream "
                        "resumes after its last applied batch) before the service exits non-zero "
                        "(default: the config's, else 0)")
    p.add_argument("--liveness-timeout", type=float, metavar="S",
                   help="seconds a worker's publisher may send nothing (no batch, no answer to the idle probes) "
                        "before it is taken for gone: not routed to while another worker is alive, listed by "
                        "/health, until heard again; endpoints with a replay socket only (default: the "
                        "config's, else 5)")
    g = p.add_argument_group("limits on HTTP clients (README, Security; default: the config's, else the README's)")
    g.add_argument("--auth-token-file", type=Path, metavar="FILE",
                   help="tokens, one a line: /route, first_token and finish then need 'Authorization: Bearer "
                        "<token>', and only the token that booked a request may release it (default: no token)")
    for name, (kind, text) in _INDEXER_LIMITS.items():
        g.add_argument("--" + name.replace("_", "-"), type=kind, metavar="N", help=text)
    _say_service_defaults(p)
    p.set_defaults(func=cmd_indexer)
    return parser


def _say_service_defaults(p: argparse.ArgumentParser) -> None:
    """``kvtier indexer``'s options default to None, so that a --config's settings stand unless given: each one
    whose help names no default says the one it stands for, ServiceConfig's."""
    given = {f.name: f.default for f in dataclasses.fields(ServiceConfig)}
    for action in p._actions:
        default = given.get(action.dest)
        if action.default is None and default is not None and "default" not in (action.help or ""):
            action.help = f"{action.help} (default: the config's, else {default})"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line parsed; arguments no option takes are refused by the parser they were given to: the
    subcommand's (``kvtier compare: error: ...``, its --help named) or, before the subcommand, kvtier's own, with
    the nearest of that parser's options to a misspelt one."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        given = sys.argv[1:] if argv is None else argv
        # kvtier's own options take no value, so the subcommand is the first argument that is not an option. Left
        # over arguments keep their order: each is found from the end, at or before where the one after it was.
        at, end, where = given.index(args.command), len(given), []
        for x in reversed(extra):
            end = next((i for i in range(end - 1, -1, -1) if given[i] == x), at)  # (not found: the subcommand's)
            where.append(end)
        top = [x for x, i in zip(extra, reversed(where), strict=True) if i < at]
        subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        owner = parser if top else subs.choices[args.command]
        extra = top or extra
        options = [o for action in owner._actions for o in action.option_strings if o.startswith("--")]
        near = [m for x in extra if x.startswith("--")
                for m in difflib.get_close_matches(x.partition("=")[0], options, n=1, cutoff=0.75)]
        hint = f"; did you mean {', '.join(dict.fromkeys(near))}?" if near else ""
        owner.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with _stop_signals():
            return int(args.func(args))
    # (KernelsUnavailable: no numba here, so the index cannot run; PluginError: a plugin broke the protocol mid-run)
    except (CliError, ConfigError, TraceError, KernelsUnavailable, PluginError) as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or socket the command needed
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"kvtier: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or a stop signal mid-run (or mid-import of a plugin): no traceback,
        # the shell's status
        return _said_interrupted(exc)
    except SystemError as exc:  # Ctrl-C inside a compiled kernel: numba's dispatch wraps it in a SystemError
        cause = _interrupted(exc)
        if cause is None:
            raise
        return _said_interrupted(cause)


def _said_interrupted(exc: KeyboardInterrupt) -> int:
    """Says that the run was stopped, and by what: the exit status, the shell's for that signal."""
    if isinstance(exc, Stopped):
        print(f"kvtier: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    print("kvtier: interrupted", file=sys.stderr)
    return 130


def _interrupted(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (or stop signal) that caused ``exc`` (its cause or context, at any depth), if one did.
    O(chain)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


__all__ = ["RunResult", "build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
