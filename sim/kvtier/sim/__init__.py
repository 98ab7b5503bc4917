"""Discrete-event simulation of routing over tiered KV caches, and the ``kvtier`` CLI (the top layer).

================  ==================================================================================================
module            holds
================  ==================================================================================================
``core``          a tiny deterministic event loop (SimPy-like: timers, priorities)
``cluster``       simulated workers running the real cache logic (:mod:`kvtier.engine`) on the modeled data path
``kvlink``        a disaggregated cluster's prefill -> decode KV transfers, each NIC shared or not
``disagg``        a policy picking a (prefill, decode) pair over a disaggregated cluster
``run``           one run: a trace through a cluster behind one policy
``policies``      routing policies as the simulator runs them, built from :mod:`kvtier.indexer.routing.policies`
``transport``     the engine -> router event path: delay, loss, and the router's recovery
``trace``, ``source``, ``generators``  traces (Mooncake, Azure, built-in), streamed, and seeded workloads
``lookahead``     token ids, keys and digests of requests about to arrive, made ahead on a helper thread
``metrics``, ``report``  per-request records and summaries; tables, JSON, CSV, plots
``experiment``    trace specs and parallel runs (processes, or Ray)
``live``          a live engine process replaying a trace in wall-clock time (``kvtier engine``)
``cli``           the ``kvtier`` command line
================  ==================================================================================================

Every run is accountable: tokens by tier sum to each prompt, unfinished and rejected requests are counted, and a
change made for speed changes no result (``tests/pinned_results.json``). A run costs O(requests x (pages + workers)).
"""

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
