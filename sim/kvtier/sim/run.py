"""One simulated run: a trace through a cluster behind one routing policy."""

from __future__ import annotations

import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.engine.hashing import hash_backend
from kvtier.indexer.index.keys import BlockKey, key_backend
from kvtier.indexer.index.keytable import warm_tables
from kvtier.indexer.routing.load import LoadTracker
from kvtier.indexer.routing.policies import REGISTRY, RoutingSettings
from kvtier.indexer.routing.scoring import DEFAULT_OUT_OF_REACH, OUT_OF_REACH
from kvtier.sim.cluster import ClusterConfig, Job, build_cluster
from kvtier.sim.core import Environment
from kvtier.sim.disagg import DisaggPolicy
from kvtier.sim.lookahead import Lookahead, lookahead_backend
from kvtier.sim.metrics import RequestRecord, RunSummary, Slo, SummaryBuilder
from kvtier.sim.policies import Choice, KvPolicy, Policy, RouteInput, make_policy, policy_label
from kvtier.sim.source import TraceSource, as_source
from kvtier.sim.trace import MAX_ARRIVAL_S, Request, TokenBank, TraceError, bank_backend
from kvtier.sim.transport import Recovery, SimWire, WireConfig, WireCounters, event_blocks
from kvtier.util.fields import Domain, at_least, check_fields, one_of, positive, within
from kvtier.util.gcpause import rare_collections
from kvtier.wire.notices import Delivery, StreamId
from kvtier.wire.protocol import EventBatch, PackedTokens, WorkerId
from kvtier.wire.tokenarray import token_backend


@dataclass(slots=True, frozen=True)
class RunConfig:
    """How the router behaves in one run."""

    policy: str  # see sim.policies.POLICIES (plugins are checked by sim.policies.check_policy)
    cost: str = field(default="credit", metadata=one_of("credit", "ttft"))  # cost model of kv policies
    # engine -> router event latency, seconds
    event_delay_s: float = field(default=0.0, metadata=within(0, 3600, option="--event-delay"))
    event_loss: float = field(default=0.0, metadata=within(0, 1))  # probability a batch is lost on the way
    host_credit: float = field(default=0.75, metadata=within(0, 1))  # credit model weights
    disk_credit: float = field(default=0.25, metadata=within(0, 1))
    temperature: float = field(default=0.0, metadata=within(0, 1e6))  # softmax sampling of costs (0 = argmin)
    seed: int = field(default=0, metadata=Domain(int, lo=0).meta())  # policy and loss randomness (as --seed)
    closed_loop: bool = True  # a session's next turn waits for this turn's answer (see simulate)
    # stop simulated time here; what has not finished is counted unfinished
    until_s: float | None = field(default=None, metadata=positive(optional=True, option="--until"))
    # what the router does about lost batches: see sim.transport.Recovery
    recovery: str = field(default="dump", metadata=one_of(*Recovery))
    replay_buffer: int = field(default=10_000, metadata=at_least(1))  # batches each engine keeps for replay
    loss_burst: int = field(default=1, metadata=at_least(1))  # batches lost in a row each time one is (an outage)
    # Goodput's service-level objectives, milliseconds (None: not bounded; none given: no goodput)
    sla_ttft_ms: float | None = field(default=None, metadata=positive(optional=True, option="--sla-ttft-ms"))
    sla_tpot_ms: float | None = field(default=None, metadata=positive(optional=True, option="--sla-tpot-ms"))
    sla_e2e_ms: float | None = field(default=None, metadata=positive(optional=True, option="--sla-e2e-ms"))
    # goodput policy: how a request that can meet the SLO on no worker weighs its prefix against the streams it
    # slows (OUT_OF_REACH); kvtier.indexer.routing.scoring.SloCost.out_of_reach
    slo_out_of_reach: str = field(default=DEFAULT_OUT_OF_REACH, metadata=one_of(*OUT_OF_REACH))

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def slo(self) -> Slo:
        def s(ms: float | None) -> float | None:
            return None if ms is None else ms / 1000.0
        return Slo(s(self.sla_ttft_ms), s(self.sla_tpot_ms), s(self.sla_e2e_ms))

    @property
    def label(self) -> str:
        name = policy_label(self.policy)
        spec = REGISTRY.get(self.policy)
        # (a policy that ignores --cost is not labelled with it: round_robin[ttft] would read as a different run)
        return name if self.cost == "credit" or spec is None or not spec.takes_cost else f"{name}[{self.cost}]"


@dataclass(slots=True)
class RunResult:
    """Everything one run produced."""

    summary: RunSummary  # aggregates
    records: list[RequestRecord]  # per request, in arrival order (empty when simulate was given a sink)
    decisions: list[int] = field(default_factory=list)  # chosen worker per request, in arrival order (ditto)
    events_published: int = 0  # batches the engines published
    events_lost: int = 0  # batches dropped on the way to the router
    wire: WireCounters = field(default_factory=WireCounters)  # replays, dumps, partial marks
    ttft: Sequence[float] = ()  # seconds, of every completed request, in arrival order (kept with a sink too)
    tpot: Sequence[float] = ()  # likewise (nan for a one-token answer)
    e2e: Sequence[float] = ()  # likewise


def simulate(trace: Sequence[Request] | TraceSource, cluster_cfg: ClusterConfig, run: RunConfig, *,
             bank: TokenBank | None = None, progress: bool = False,
             sink: Callable[[RequestRecord], None] | None = None,
             itl_sink: Callable[[str, list[float]], None] | None = None) -> RunResult:
    """Replays ``trace`` (a list, or a :class:`~kvtier.sim.source.TraceSource` such as a streamed
    :class:`~kvtier.sim.source.MooncakeFile`); deterministic for the configs' seeds.

    Turns of one session (``Request.session``, in trace order) are released closed loop when
    ``run.closed_loop``: a turn arrives ``think_s`` after its predecessor's last token (or, for traces
    without think times, at its own timestamp but never before its predecessor finished); a rejected
    turn releases its successor when it is rejected, as a last token would (its think time after that).
    Open loop uses every timestamp as it is. Simulated time stops at ``run.until_s`` if given; what has not
    finished by then is counted as ``unfinished``.

    Records: without ``sink`` they are returned in :attr:`RunResult.records` (and the routing decisions in
    :attr:`RunResult.decisions`). With ``sink``, each record goes to it once final (completed, rejected, or
    unfinished when the run ends), in arrival order, and the result keeps none: a run then holds the
    requests in flight and six floats per completed request (for exact percentiles), whatever the
    trace's length. The summary is the same either way. Every record that started its prefill is checked to
    have its prompt tokens booked exactly once: device + host + storage + recomputed == prompt.

    ``itl_sink``: called with each completed request's id and every gap between its consecutive tokens (seconds),
    as it finishes; keeping them costs a float per output token of the requests in flight.
    """
    source = as_source(trace)
    total = len(source)
    env = Environment(reserved=total)  # arrivals take their rank as sequence number (see feed below)
    loads = LoadTracker(cluster_cfg.page_size)
    bank = bank or TokenBank()
    rng = random.Random(run.seed)
    records: list[RequestRecord] = []
    decisions: list[int] = []
    builder = SummaryBuilder(cluster_cfg.workers, run.slo)
    builder.split = cluster_cfg.prefill_workers
    # Records in arrival order, waiting for the oldest to be final: the sink sees arrival order.
    waiting: deque[RequestRecord] = deque()
    ps = cluster_cfg.page_size
    streams = [StreamId(WorkerId(f"w{i}")) for i in range(cluster_cfg.workers)]
    bar = _progress(total, run.label) if progress else None
    # Without loss a tracker would only confirm what arrives: skip it (same results, less work).
    recovery = Recovery(run.recovery) if run.event_loss else Recovery.NONE
    wire_cfg = WireConfig(run.event_delay_s, run.event_loss, run.loss_burst, recovery, run.replay_buffer)

    def deliver(deliveries: list[Delivery]) -> None:
        assert isinstance(policy, KvPolicy | DisaggPolicy)
        policy.feed(deliveries)

    def dump(worker: int) -> list[EventBatch]:
        cluster.workers[worker].flush_events()  # the dump must cover every published seq
        return cluster.caches[worker].dump_events()

    wire = SimWire(env, wire_cfg, cluster_cfg.workers, rng, deliver, dump)
    unheard = WireCounters()  # for policies that read no events: counts only, no codec work

    def emit(final: bool) -> None:
        while waiting and (final or waiting[0].finish >= 0 or waiting[0].rejected):
            rec = waiting.popleft()
            _check_accounting(rec)
            builder.add(rec)
            if sink is not None:
                sink(rec)

    def on_event(worker: int, batch: EventBatch) -> None:
        counters.blocks += event_blocks(batch)
        if listening:
            wire.publish(worker, batch)  # (counts it published)
        else:
            counters.published += 1

    def on_first_token(job: Job) -> None:
        if tracked:
            decode_loads.prefill_done(job.req.request_id)

    def on_prefilled(job: Job) -> None:  # disaggregated: the prompt is computed; its decode worker receives it
        if tracked:
            loads.finish(job.req.request_id)
        rec = job.record
        if rec.decode_worker < 0:  # the policy picks the decode side now
            assert isinstance(policy, DisaggPolicy)
            req = job.req
            keys = late_keys.pop(req.request_id, [])
            if tracked:
                cluster.report_progress()
            pair = policy.choose_decode(RouteInput(req.request_id, job.tokens, req.input_length, keys, env.now),
                                        Choice(rec.worker))
            rec.decode_worker = pair.decode
            if tracked:
                decode_loads.add(req.request_id, streams[pair.decode], keys, req.input_length, 0)
        cluster.workers[rec.decode_worker].receive(job)

    def on_finish(job: Job) -> None:
        if tracked:
            decode_loads.finish(job.req.request_id, job.generated)
            if disagg:
                loads.finish(job.req.request_id)  # (rejected before its prefill)
                late_keys.pop(job.req.request_id, None)
        if itl_sink is not None and job.gaps is not None and not job.record.rejected:
            itl_sink(job.req.request_id, job.gaps)
        if bar is not None:
            # Requests per second of wall time is tqdm's rate; simulated time goes in the postfix,
            # formatted only when the bar redraws (tqdm's mininterval), not once per request.
            bar.sim_now = env.now
            bar.update(1)
        if waiting[0] is job.record:
            emit(False)
        nxt = source.successor(job.req.request_id) if run.closed_loop else None
        if nxt is not None:
            release = env.now + nxt.think_s if nxt.think_s is not None else max(env.now, nxt.arrival)
            if release > MAX_ARRIVAL_S:  # (think times add up turn by turn: no trace check sees the sum)
                raise TraceError(f"request {nxt.request_id!r}: its session's turns and think times take it to "
                                 f"{release:,.3f} s, past {MAX_ARRIVAL_S:,.0f} s, where the simulator's clock (seconds "
                                 "in a float) no longer keeps a latency's microseconds")
            env.at(release, lambda: arrive(nxt), priority=2)

    def on_progress(job: Job, generated: int) -> None:
        decode_loads.progress(job.req.request_id, generated)

    # Disaggregated, the prefill pool's bookkeeping holds a request until its prompt is computed, the decode pool's
    # until it finishes; aggregated, one tracker is both.
    disagg = cluster_cfg.disaggregated
    decode_loads = LoadTracker(ps) if disagg else loads
    late_keys: dict[str, list[BlockKey]] = {}  # of requests whose decode worker is picked at handoff
    policy: Policy | DisaggPolicy
    if disagg:
        policy = DisaggPolicy(run.policy, prefill=cluster_cfg.prefill_workers, decode=cluster_cfg.decode_workers,
                              block_size=ps, loads=loads, decode_loads=decode_loads, caches=lambda: cluster.caches,
                              settings=routing_settings(cluster_cfg, run),
                              decode_settings=routing_settings(cluster_cfg.decode_config(), run),
                              local_prefill_tokens=cluster_cfg.local_prefill_tokens)
    else:
        policy = make_policy(run.policy, workers=cluster_cfg.workers, block_size=ps, loads=loads,
                             caches=lambda: cluster.caches, settings=routing_settings(cluster_cfg, run))
    listening = isinstance(policy, KvPolicy) or (isinstance(policy, DisaggPolicy) and policy.listens)
    counters = wire.counters if listening else unheard  # what the run reports of its event path
    # A blind policy (round robin, random) reads neither keys nor load: the router does no such bookkeeping.
    tracked = not policy.blind
    cluster = build_cluster(cluster_cfg, env, on_event, on_first_token, on_finish,
                            on_progress=on_progress if tracked else None, on_prefilled=on_prefilled)

    # Requests released at their arrival time come one at a time, each scheduled when the one before it
    # runs, with a reserved sequence number (its rank in the trace): the order it would have had if all
    # were scheduled up front, without a timer per request waiting in the heap, or the trace in memory.
    # Their token ids, keys and page digests are made ahead, a batch at a time, on a helper thread (sim.lookahead).
    arrivals = Lookahead(source.arrivals(run.closed_loop), bank, ps, keys=tracked)

    def arrive(req: Request) -> None:
        tokens, keys, digests = arrivals.take(req)
        if isinstance(policy, DisaggPolicy):
            arrive_pair(req, tokens, keys, digests)
            return
        if tracked:
            cluster.report_progress()  # (what it routes by: the tokens streamed back so far)
        choice = policy.choose(RouteInput(req.request_id, tokens, req.input_length, keys, env.now))
        rec = RequestRecord(req.request_id, choice.worker, env.now, req.input_length, req.output_length)
        if choice.predicted is not None:
            rec.predicted_blocks = choice.predicted.external
        waiting.append(rec)
        if sink is None:
            records.append(rec)
            decisions.append(choice.worker)
        cached = choice.predicted.external * ps if choice.predicted is not None else 0
        if tracked:
            loads.add(req.request_id, streams[choice.worker], keys, req.input_length,
                      max(0, req.input_length - cached))
        cluster.workers[choice.worker].submit(Job(req, tokens, rec, digests=digests,
                                                  gaps=[] if itl_sink is not None else None), choice.tier)

    def arrive_pair(req: Request, tokens: PackedTokens, keys: list[BlockKey], digests: bytes) -> None:
        assert isinstance(policy, DisaggPolicy)
        if tracked:
            cluster.report_progress()
        pair = policy.choose(RouteInput(req.request_id, tokens, req.input_length, keys, env.now))
        choice = pair.prefill
        first = pair.decode if pair.local else choice.worker
        rec = RequestRecord(req.request_id, first, env.now, req.input_length, req.output_length)
        rec.decode_worker = pair.decode
        if choice.predicted is not None and not pair.local:
            rec.predicted_blocks = choice.predicted.external
        waiting.append(rec)
        if sink is None:
            records.append(rec)
            decisions.append(first)
        job = Job(req, tokens, rec, digests=digests, gaps=[] if itl_sink is not None else None)
        if pair.local:  # prefilled where it decodes
            if tracked:
                decode_loads.add(req.request_id, streams[pair.decode], keys, req.input_length,
                                 max(0, req.input_length - pair.decode_cached))
            cluster.workers[pair.decode].submit(job)
            return
        cached = choice.predicted.external * ps if choice.predicted is not None else 0
        if tracked:
            loads.add(req.request_id, streams[choice.worker], keys, req.input_length,
                      max(0, req.input_length - cached))
            if pair.decode >= 0:
                decode_loads.add(req.request_id, streams[pair.decode], keys, req.input_length, 0)
            else:
                late_keys[req.request_id] = keys
        cluster.workers[choice.worker].submit(job, choice.tier)

    def feed(req: Request) -> None:
        upcoming = next(arrivals, None)
        if upcoming is not None:
            rank, nxt = upcoming
            env.at(nxt.arrival, lambda: feed(nxt), priority=2, seq=rank)
        arrive(req)

    first = next(arrivals, None)
    if first is not None:
        env.at(first[1].arrival, lambda: feed(first[1]), priority=2, seq=first[0])
    try:
        with rare_collections():
            env.run(run.until_s)
    finally:
        if bar is not None:  # (also where the run fails: what is said next starts on a line of its own)
            bar.close()
    emit(True)  # what is left never finished
    rejected = policy.events_rejected if isinstance(policy, KvPolicy | DisaggPolicy) else 0
    summary = builder.summary(run.label, rejected, total=total)
    summary.extra.update(events_published=counters.published, event_blocks=counters.blocks,
                         events_lost=counters.lost, replay_requests=counters.replay_requests, dumps=counters.dumps,
                         partial_marks=counters.partial_marks,
                         rejected_decode=sum(w.rejected_for_decode for w in cluster.workers))
    return RunResult(summary, records, decisions, counters.published, counters.lost, counters, builder.ttft,
                     builder.tpot, builder.e2e)


def routing_settings(cluster: ClusterConfig, run: RunConfig) -> RoutingSettings:
    """What the run's policy prices with (:mod:`kvtier.indexer.routing.policies`): the cluster's links, latency fit,
    prefill budget and device capacity, the router's credits and sampling."""
    return RoutingSettings(cost=run.cost, model=cluster.model, h2d_gbps=cluster.h2d_gbps,
                           storage_gbps=cluster.storage_gbps, host_credit=run.host_credit,
                           disk_credit=run.disk_credit, prefill_budget=cluster.prefill_budget,
                           capacity_tokens=cluster.capacity_tokens(), latency=cluster.worker_latency(),
                           temperature=run.temperature, seed=run.seed, slo_ttft_ms=run.sla_ttft_ms,
                           slo_tpot_ms=run.sla_tpot_ms, slo_out_of_reach=run.slo_out_of_reach,
                           kv_gbps=cluster.kv_link_gbps)


#: The table kernels a simulation's index calls (events applied, prompt-key references, routing queries). A run
#: with event loss may call a few more (a cleared worker, a resync), each then loaded on first use; loading
#: the other 13 (a service's) would add to the peak memory of runs that never call them.
SIM_TABLE_KERNELS = ("store_tokens", "remove", "rehash", "has_bit", "ref_add", "ref_drop", "held_prefix",
                     "run_levels", "runs_by_search")


def load_kernels() -> dict[str, str]:
    """Imports numba and loads every compiled kernel a run calls (from numba's cache; compiling them when it is
    cold), as importing a compiled extension would: about 0.3 s in a fresh process on the 2-core machine, most of
    it numba's own start-up, and nothing once done. :func:`simulate` loads each on first use anyway; this is for
    a caller that times runs. Per kernel family, ``"numba"`` or ``"python (why)"``. O(1) after the first call."""
    return {"token bank": bank_backend(), "page digests": hash_backend(), "router keys": key_backend(),
            "wire tokens": token_backend(), "index tables": warm_tables(SIM_TABLE_KERNELS),
            "lookahead": lookahead_backend()}


def _check_accounting(r: RequestRecord) -> None:
    if r.prefill_start >= 0:  # else never started: nothing booked yet
        assert min(r.device_tokens, r.host_tokens, r.storage_tokens, r.recomputed_tokens) >= 0, (
            f"request {r.request_id}: a tier booked fewer than 0 tokens ({r.device_tokens} device, {r.host_tokens} "
            f"host, {r.storage_tokens} storage, {r.recomputed_tokens} recomputed)")
        booked = r.device_tokens + r.host_tokens + r.storage_tokens + r.recomputed_tokens
        assert booked == r.input_tokens, (
            f"request {r.request_id}: tokens by tier ({r.device_tokens} device + {r.host_tokens} host + "
            f"{r.storage_tokens} storage + {r.recomputed_tokens} recomputed = {booked}) != prompt {r.input_tokens}")
    if r.first_token >= 0 and r.decode_worker >= 0 and r.prefill_end >= 0:  # its KV reached the decode worker
        moved = r.decode_cached_tokens + r.transferred_tokens
        assert moved == r.input_tokens, (
            f"request {r.request_id}: {r.decode_cached_tokens} tokens held on the decode worker + "
            f"{r.transferred_tokens} transferred = {moved} != prompt {r.input_tokens}")


class _ProgressLines:
    """A replay's progress with no terminal (a CI log, a pipe), where tqdm's bar would write carriage returns into
    the log: a line every :attr:`interval_s` as requests finish, with the simulated clock."""

    interval_s = 15.0

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.n, self.sim_now = total, label.strip(), 0, 0.0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            print(f"kvtier: {self.label}: {self.n:,} of {self.total:,} requests done after {now - self.t0:.0f} s "
                  f"(sim {self.sim_now:,.0f} s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int, label: str, terminal: bool | None = None):  # type: ignore[no-untyped-def]
    """A requests bar on a terminal (``terminal``, default: whether stderr is one), else :class:`_ProgressLines`."""
    if not (sys.stderr.isatty() if terminal is None else terminal):
        return _ProgressLines(total, label)
    from tqdm import tqdm

    class _SimBar(tqdm):  # type: ignore[type-arg]
        """A requests bar whose postfix is the simulated clock, e.g. ``sim 1,234 s``."""

        sim_now = 0.0

        @property
        def format_dict(self):  # type: ignore[no-untyped-def]
            d = super().format_dict
            d["postfix"] = f"sim {self.sim_now:,.0f} s"
            return d

    return _SimBar(total=total, desc=f"{label:>14}", unit="req", leave=False, mininterval=0.5)
