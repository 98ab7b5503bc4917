"""Trace specs and parallel execution of runs (local process pool, or Ray on request)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import itertools
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from kvtier.engine.cache import CacheConfig, PrefetchPolicy, WritePolicy
from kvtier.engine.config import Eviction
from kvtier.hardware.latency import resolve_latency
from kvtier.sim.cluster import CACHE_SETTINGS, ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.metrics import RequestRecord
from kvtier.sim.policies import check_policy
from kvtier.sim.report import CsvRecords, ItlSeries
from kvtier.sim.run import RunConfig, RunResult, simulate
from kvtier.sim.source import ListTrace, MooncakeFile, TraceSource, as_source
from kvtier.sim.trace import Request, check_scaled, is_azure, load_azure, load_trace
from kvtier.util.fields import ConfigError, did_you_mean
from kvtier.util.signals import STOP_SIGNALS

#: Requests of a builtin trace at most: each is made in memory before the run (about a kilobyte with its hash ids).
MAX_BUILTIN_REQUESTS = 1_000_000


def resolve_trace(spec: str, *, limit: int | None = None, seed: int = 0, time_scale: float = 1.0,
                  shared_prefix_blocks: int = 0, prefix_groups: int = 8) -> list[Request]:
    """``builtin:KIND[:N]`` (a seeded synthetic workload of N requests) or a trace file path.

    ``time_scale`` < 1 compresses arrivals (a higher request rate), > 1 stretches them. An Azure CSV (lengths only)
    gets ``shared_prefix_blocks`` leading blocks shared within each of ``prefix_groups`` groups
    (:func:`kvtier.sim.trace.load_azure`, seeded by ``seed``).
    """
    if spec.startswith("builtin:"):
        parts = spec.split(":")
        kind = parts[1] if len(parts) > 1 else ""
        if kind not in PRESETS:
            raise ValueError(f"unknown builtin trace {kind!r}{did_you_mean(kind, PRESETS)}; expected one of "
                             f"{', '.join(sorted(PRESETS))}")
        count = parts[2] if len(parts) == 3 else None
        if len(parts) > 3 or (count is not None and not (count.isascii() and count.isdigit() and int(count) >= 1)):
            # (isdigit alone takes '²', which int() refuses)
            raise ValueError(f"trace {spec!r}: expected builtin:KIND[:N] with N >= 1 requests")
        n = int(count) if count is not None else (limit or 1000)
        if n > MAX_BUILTIN_REQUESTS:
            raise ValueError(f"trace {spec!r}: {n:,} requests; a builtin trace holds at most "
                             f"{MAX_BUILTIN_REQUESTS:,} (it is made in memory; gen-trace writes longer ones)")
        reqs = generate(dataclasses.replace(PRESETS[kind], requests=n), seed)
    else:
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"trace {spec!r} not found (give a file or builtin:chat|agentic|sysprompt)")
        if not path.is_file():
            raise ValueError(f"trace {spec!r} is not a file (give a .jsonl or .csv trace)")
        reqs = (load_azure(path, share_prefix_blocks=shared_prefix_blocks, groups=prefix_groups, seed=seed,
                           limit=limit) if is_azure(path) else load_trace(path, limit))
    if limit is not None:
        reqs = reqs[:limit]
    if reqs:  # (an Azure CSV's span is its timestamps', which no cap on a field bounds)
        last = max(reqs, key=lambda r: r.arrival)
        check_scaled(last.arrival, time_scale, f"request {last.request_id!r} of {spec}")
    if time_scale != 1.0:
        reqs = [dataclasses.replace(r, arrival=r.arrival * time_scale) for r in reqs]
    return reqs


def trace_source(spec: str, *, limit: int | None = None, seed: int = 0, time_scale: float = 1.0,
                 shared_prefix_blocks: int = 0, prefix_groups: int = 8) -> TraceSource:
    """The trace :func:`resolve_trace` names, as a run reads it: a Mooncake JSONL file streamed from disk
    (:class:`~kvtier.sim.source.MooncakeFile`, checked whole here, so a bad line fails before any run), anything
    else in memory. O(requests) time; memory: a 17-byte index per request of a file."""
    path = Path(spec)
    if not spec.startswith("builtin:") and path.is_file() and not is_azure(path):
        return MooncakeFile(path, limit=limit, time_scale=time_scale).index()
    return ListTrace(resolve_trace(spec, limit=limit, seed=seed, time_scale=time_scale,
                                   shared_prefix_blocks=shared_prefix_blocks, prefix_groups=prefix_groups))


@dataclass(slots=True, frozen=True)
class RunSpec:
    """One run to execute: a trace, a cluster, a router configuration."""

    trace: TraceSource  # requests (a file-backed source is read where the run executes)
    cluster: ClusterConfig  # cluster configuration
    run: RunConfig  # router configuration
    tag: dict[str, Any]  # grid coordinates (for sweeps)
    # Where the run writes its per-request records as CSV rows (report.CSV_FIELDS, no header), keeping
    # none in memory; None: see keep_records.
    records_csv: Path | None = None
    keep_records: bool = True  # without records_csv: return the records (False: a run's memory stays flat)
    itl_jsonl: Path | None = None  # where the run writes each completed request's inter-token gaps (JSONL)


def execute(job: RunSpec, *, progress: bool = False) -> tuple[dict[str, Any], RunResult]:
    """Runs one job in this process (``progress``: a per-request bar); its records go where
    ``job.records_csv`` and ``job.keep_records`` say.

    The run's cluster is freed before this returns. Its radix trees, page stores and index hold reference
    cycles, so they die only in a full collector pass, which the collector starts seldom over a heap that size:
    a process running job after job (a compare's or a sweep's pool) would hold every finished run's cluster.
    One full pass per run keeps a process's peak at that of its largest run.
    """
    try:
        with contextlib.ExitStack() as stack:
            itl = stack.enter_context(ItlSeries(job.itl_jsonl, job.run.label)).write if job.itl_jsonl else None
            if job.records_csv is None:
                sink = None if job.keep_records else _drop
                return job.tag, simulate(job.trace, job.cluster, job.run, progress=progress, sink=sink,
                                         itl_sink=itl)
            out = stack.enter_context(CsvRecords(job.records_csv, job.run.label))
            return job.tag, simulate(job.trace, job.cluster, job.run, progress=progress, sink=out.write,
                                     itl_sink=itl)
    finally:
        gc.collect()


def _drop(_: RequestRecord) -> None:
    pass


Done = Callable[[dict[str, Any], RunResult], None]


def run_jobs(jobs: Sequence[RunSpec], *, processes: int | None = None, use_ray: bool = False,
             on_done: Done | None = None) -> list[tuple[dict[str, Any], RunResult]]:
    """Runs every job; results come back in ``jobs`` order."""
    if use_ray:
        return _run_ray(jobs, on_done)
    n = processes if processes is not None else min(len(jobs), os.cpu_count() or 1)
    if n <= 1 or len(jobs) == 1:
        out = []
        for j in jobs:
            tag, res = execute(j)
            if on_done:
                on_done(tag, res)
            out.append((tag, res))
        return out
    results: dict[int, tuple[dict[str, Any], RunResult]] = {}
    # Workers ignore Ctrl-C: this process stops the pool at the first failure or interruption (an executor's exit
    # would wait for every run still queued, each interrupted worker going on to the next). A worker that dies
    # (killed for memory) breaks the pool, raised here too.
    context = multiprocessing.get_context()
    pool = ProcessPoolExecutor(max_workers=n, mp_context=context, initializer=_pool_worker,
                               initargs=(os.getpid(), context.get_start_method()))
    try:
        futures = {pool.submit(execute, j): i for i, j in enumerate(jobs)}
        for fut in as_completed(futures):
            tag, res = fut.result()  # a failed run raises here: never swallowed
            results[futures[fut]] = (tag, res)
            if on_done:
                on_done(tag, res)
    except BaseException:
        _stop(pool)
        raise
    pool.shutdown()
    return [results[i] for i in range(len(jobs))]


def _pool_worker(pool_owner: int, start_method: str) -> None:
    """A pool worker's start: it ignores Ctrl-C (its parent stops the pool), dies of a stop signal rather than
    running the handler it inherited, and dies with its parent. A parent killed outright (SIGKILL, out of memory)
    runs no clean-up, and its workers, blocked on the pipe it held, stayed for good, each holding a run's memory.
    Its parent is the pool's owner where workers are forked, a fork server otherwise (which ends with the owner)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    else:  # (no such call: the parent is looked for every second)
        threading.Thread(target=_watch_parent, args=(parent,), name="kvtier-parent-watch", daemon=True).start()
    if os.getppid() != parent or (start_method == "fork" and parent != pool_owner):
        os._exit(1)  # its parent died before the call above: no signal will come


_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _stop(pool: ProcessPoolExecutor) -> None:
    """Ends the runs under way and cancels the others: ``kill_workers`` from Python 3.14; before it, the
    executor's worker processes (its ``_processes``) are killed once it is shut down. Returns once every worker
    has exited."""
    kill = getattr(pool, "kill_workers", None)
    if kill is not None:
        kill()
        pool.shutdown(wait=True, cancel_futures=True)
        return
    workers = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # (reaps them; where a worker died, ends the others)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in workers:
        proc.kill()  # (not SIGTERM: a handler the worker inherited from this process could swallow it)
    for proc in workers:
        proc.join()
    if manager is not None:
        manager.join()


def _run_ray(jobs: Sequence[RunSpec], on_done: Done | None) -> list[tuple[dict[str, Any], RunResult]]:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray needs Ray: pip install ray (or drop --ray for a local pool)") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(execute)
    refs = [remote.remote(j) for j in jobs]
    out = []
    for ref in refs:
        tag, res = ray.get(ref)
        if on_done:
            on_done(tag, res)
        out.append((tag, res))
    return out


def _bool(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"{text!r} is not true or false")
    return text.lower() == "true"


def _reader(convert: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """``convert``, whose ValueError says the value is not ``what``."""
    def cast(text: str) -> Any:
        try:
            return convert(text)
        except ValueError:
            raise ValueError(f"{text!r} is not {what}") from None
    return cast


def _choice(kind: type[StrEnum]) -> Callable[[str], Any]:
    return _reader(kind, f"one of {', '.join(m.value for m in kind)}")


def _latency(text: str) -> str:
    """A ``latency`` value: a preset's name or a fit's path, checked as ``--latency`` checks it and kept as given
    (the run's tag names it); :data:`_TO_CONFIG` resolves it."""
    resolve_latency(text)
    return text


_CASTS: dict[str, Callable[[str], Any]] = {
    "int": _reader(int, "an integer"), "float": _reader(float, "a number"), "str": str, "bool": _bool,
    "WritePolicy": _choice(WritePolicy), "PrefetchPolicy": _choice(PrefetchPolicy), "Eviction": _choice(Eviction),
    "MockerLatency": _latency}


def _caster(annotation: str) -> Callable[[str], Any]:
    """How a sweep reads a setting of this type (a type without one is a KeyError: no setting goes unread)."""
    return _CASTS[annotation.removesuffix(" | None")]


def _pools(text: str) -> str:
    """A ``pools`` value: ``P:D`` prefill and decode workers, or ``agg`` (aggregated, ``workers`` as set)."""
    p, sep, d = text.partition(":")
    if text != "agg" and not (sep and p.isascii() and p.isdigit() and d.isascii() and d.isdigit()
                              and int(p) > 0 and int(d) > 0):
        raise ValueError(f"{text!r} is not P:D (two counts >= 1) or agg")
    return text


def _pool_sizes(text: str) -> dict[str, int]:
    p, _, d = text.partition(":")
    return {"prefill_workers": 0, "decode_workers": 0} if text == "agg" else \
        {"prefill_workers": int(p), "decode_workers": int(d)}


#: Sweep keys: which config holds them and how to read their values. ``pools`` sets prefill_workers and
#: decode_workers together (``pools=agg,8:8,4:12``: splits of one cluster, where the two axes would cross).
_FIELDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    **{f.name: ("cluster", _caster(str(f.type))) for f in dataclasses.fields(ClusterConfig) if f.name != "cache"},
    **{f.name: ("cluster", _caster(str(f.type))) for f in dataclasses.fields(CacheConfig) if f.name in CACHE_SETTINGS},
    **{f.name: ("run", _caster(str(f.type))) for f in dataclasses.fields(RunConfig)},
    "pools": ("pools", _pools),
}
#: Axes whose grid value (what the run's tag shows) is not the setting's own: how the setting is made from it.
_TO_CONFIG: dict[str, Callable[[Any], Any]] = {"latency": resolve_latency}


#: Settings of the prefill -> decode link and the decode pool: an aggregated grid point has none (see
#: :func:`grid_jobs`).
DISAGG_ONLY = ("kv_link", "kv_gbps", "kv_link_sharing", "local_prefill_tokens", "decode_device_tokens",
               "decode_max_running")

#: The grid axes whose name is not their command-line option's (--event-delay sets event_delay_s).
_AXIS_OF_OPTION = {"event_delay": "event_delay_s", "until": "until_s", "kv_link_gbps": "kv_gbps"}

#: Grid points of one sweep at most: its jobs are all made before the first runs.
MAX_GRID_POINTS = 10_000


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["device_tokens=65536,131072", "policy=kv_device,kv_all"]`` -> axis -> values."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"grid axis {item!r}: expected NAME=V1,V2,...")
        if key not in _FIELDS:
            meant = _AXIS_OF_OPTION.get(key)
            hint = f" (it is {meant!r}, as summary.json names it)" if meant else did_you_mean(key, _FIELDS)
            raise ValueError(f"grid axis {key!r} is not a setting{hint}; known: {', '.join(sorted(_FIELDS))}")
        if key in grid:
            raise ValueError(f"grid axis {key!r} is given twice: give its values once, as {key}=V1,V2,...")
        cast = _FIELDS[key][1]
        try:
            grid[key] = [cast(v) for v in values.split(",")]
        except ValueError as exc:
            raise ValueError(f"grid axis {key!r}: {exc}") from None
        twice = sorted(str(v) for v, n in Counter(grid[key]).items() if n > 1)
        if twice:
            raise ValueError(f"grid axis {key!r}: {', '.join(twice)} given twice (each point would run twice)")
    both = sorted({"prefill_workers", "decode_workers"} & set(grid)) if "pools" in grid else []
    if both:  # (the later would silently win)
        raise ValueError(f"grid axes 'pools' and {', '.join(map(repr, both))} both size the cluster: give one")
    points = math.prod(len(v) for v in grid.values())
    if points > MAX_GRID_POINTS:
        raise ValueError(f"--grid: {points:,} points; a sweep runs at most {MAX_GRID_POINTS:,} (each is a whole run)")
    return grid


def grid_jobs(trace: Sequence[Request] | TraceSource, base_cluster: ClusterConfig, base_run: RunConfig,
              grid: dict[str, list[Any]], *, keep_records: bool = True) -> list[RunSpec]:
    """One job per combination of ``grid``, in grid order; ``keep_records``: see :class:`RunSpec`.

    An aggregated point has no prefill -> decode link nor decode pool: its axes of :data:`DISAGG_ONLY` are tagged
    None (not applicable) and left at the base cluster's values, and it runs once, not once per value of them (the
    first combination that reaches it stands for the others)."""
    jobs = []
    source = as_source(trace)
    seen: set[tuple[tuple[str, Any], ...]] = set()  # aggregated points' tags, made once
    for combo in itertools.product(*grid.values()):
        tag = dict(zip(grid.keys(), combo, strict=True))
        try:
            changes: dict[str, Any] = _pool_sizes(tag["pools"]) if "pools" in tag else {}
            if changes and not changes["prefill_workers"] and base_cluster.disaggregated:
                changes["workers"] = base_cluster.workers  # aggregated: the same GPUs
            changes.update((k, _TO_CONFIG[k](v) if k in _TO_CONFIG else v) for k, v in tag.items()
                           if _FIELDS[k][0] == "cluster")
            cluster = base_cluster.replace(**changes)
            idle = [k for k in DISAGG_ONLY if k in tag and not cluster.disaggregated]
            if idle:
                tag.update(dict.fromkeys(idle))
                if tuple(tag.items()) in seen:
                    continue
                seen.add(tuple(tag.items()))
                cluster = base_cluster.replace(**{k: v for k, v in changes.items() if k not in idle})
            _check_axes(tag, base_cluster, cluster)
            run = dataclasses.replace(base_run, **{k: v for k, v in tag.items() if _FIELDS[k][0] == "run"})
            check_policy(run.policy)
        except ConfigError as exc:
            raise ConfigError(f"--grid {' '.join(f'{k}={v}' for k, v in tag.items())}: {exc}") from None
        jobs.append(RunSpec(source, cluster, run, tag, keep_records=keep_records))
    return jobs


def _check_axes(tag: dict[str, Any], base: ClusterConfig, cluster: ClusterConfig) -> None:
    """:class:`ConfigError` where an axis of ``tag`` would not take effect in ``cluster`` (its row would report a
    setting that never ran): ``workers`` where the pools size the cluster, ``kv_link`` where ``--kv-link-gbps``
    overrides its bandwidth, a ``pools`` split with other than the base cluster's workers (the splits of one
    cluster keep its GPUs: an aggregated base's ``--workers``, a disaggregated one's pools)."""
    if "workers" in tag and cluster.workers != tag["workers"]:
        raise ConfigError(f"a disaggregated cluster's workers are its pools' ({cluster.prefill_workers} + "
                          f"{cluster.decode_workers}): sweep pools, prefill_workers or decode_workers instead")
    if tag.get("kv_link") is not None and cluster.kv_gbps is not None:
        raise ConfigError(f"--kv-link-gbps {cluster.kv_gbps:g} sets the link's bandwidth, whatever its preset: drop "
                          "one")
    whole = tag.get("workers", base.workers)
    if tag.get("pools", "agg") != "agg" and cluster.workers != whole:
        raise ConfigError(f"{cluster.workers} workers, the cluster {whole}: a split keeps the cluster's workers "
                          f"(give --workers {cluster.workers}, or sweep prefill_workers and decode_workers to resize "
                          "it)")


def run_grid(trace: Sequence[Request] | TraceSource, cluster: ClusterConfig, run: RunConfig, grid: dict[str, list[Any]],
             processes: int | None = None) -> list[tuple[dict[str, Any], RunResult]]:
    """Every combination of ``grid`` (keys are ClusterConfig or RunConfig fields), in grid order."""
    return run_jobs(grid_jobs(trace, cluster, run, grid), processes=processes)


def shared_dir(start: Path | None = None) -> Path:
    """The ``shared/`` folder beside the checkout (``KVTIER_SHARED`` overrides)."""
    env = os.environ.get("KVTIER_SHARED")
    if env:
        return Path(env)
    here = (start or Path.cwd()).resolve()
    for d in [here, *here.parents]:
        if (d / "shared" / "traces").is_dir():
            return d / "shared"
    raise FileNotFoundError("no shared/traces folder above the working directory; set KVTIER_SHARED")


__all__ = ["RunSpec", "execute", "grid_jobs", "parse_grid", "resolve_trace", "run_grid", "run_jobs", "shared_dir",
           "trace_source"]
