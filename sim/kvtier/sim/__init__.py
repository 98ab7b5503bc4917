"""Discrete-event simulation of routing over tiered KV caches, and the ``kvtier`` CLI."""

from kvtier.sim.cluster import Cluster, ClusterConfig, SimWorker
from kvtier.sim.core import Environment, Timer
from kvtier.sim.experiment import RunSpec, resolve_trace, run_grid, run_jobs, trace_source
from kvtier.sim.generators import PRESETS, WorkloadSpec, generate, iter_generate
from kvtier.sim.metrics import RequestRecord, RunSummary, SummaryBuilder, summarize
from kvtier.sim.policies import POLICIES, Choice, Policy, RouteInput, make_policy
from kvtier.sim.run import RunConfig, RunResult, load_kernels, simulate
from kvtier.sim.source import ListTrace, MooncakeFile, TraceSource, as_source
from kvtier.sim.trace import (
    Request,
    TokenBank,
    TraceError,
    load_azure,
    load_mooncake,
    load_trace,
    prefix_reuse,
    read_mooncake,
    write_mooncake,
)
from kvtier.sim.transport import Recovery, SimWire, WireConfig, WireCounters

__all__ = [
    "POLICIES",
    "PRESETS",
    "Choice",
    "Cluster",
    "ClusterConfig",
    "Environment",
    "ListTrace",
    "MooncakeFile",
    "Policy",
    "Recovery",
    "Request",
    "RequestRecord",
    "RouteInput",
    "RunConfig",
    "RunResult",
    "RunSpec",
    "RunSummary",
    "SimWire",
    "SimWorker",
    "SummaryBuilder",
    "Timer",
    "TokenBank",
    "TraceError",
    "TraceSource",
    "WireConfig",
    "WireCounters",
    "WorkloadSpec",
    "as_source",
    "generate",
    "iter_generate",
    "load_azure",
    "load_kernels",
    "load_mooncake",
    "load_trace",
    "make_policy",
    "prefix_reuse",
    "read_mooncake",
    "resolve_trace",
    "run_grid",
    "run_jobs",
    "simulate",
    "summarize",
    "trace_source",
    "write_mooncake",
]
