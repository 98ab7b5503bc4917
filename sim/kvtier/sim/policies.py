"""Routing policies as the simulator runs them.

Which policies exist, what each hears and the cost it routes with come from the one registry,
:mod:`kvtier.indexer.routing.policies` (its table lists them); this module builds the simulator's side of each: the
real index fed engine events through the real codec and filtered to the tiers the policy hears (:class:`KvPolicy`),
the engines' true state (:class:`Oracle`), a routing history (:class:`Approx`), an incumbent router's plugin over
its own history and bookkeeping (:class:`PluginRouted`), or no state at all. Every policy
sees the router's own bookkeeping of in-flight work (a LoadTracker).

Every KV-aware policy counts a prefix that in-flight requests share once in a worker's load, and
breaks cost ties at random (seeded): see :class:`kvtier.indexer.routing.router.Router`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from kvtier.engine.cache import TieredCache
from kvtier.hardware.latency import PRESETS
from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.routing.load import LoadTracker
from kvtier.indexer.routing.plugins import RoutingPolicy, is_plugin_spec, load_policy, note_routed
from kvtier.indexer.routing.policies import POLICIES as POLICIES  # (the names, re-exported)
from kvtier.indexer.routing.policies import REGISTRY, RoutingSettings, make_cost, make_plugin, policy_spec
from kvtier.indexer.routing.router import Router
from kvtier.indexer.routing.scoring import CostModel, CreditCost, visible
from kvtier.util.fields import ConfigError
from kvtier.wire.notices import Delivery, StreamId
from kvtier.wire.overlap import OverlapScores, TierOverlap
from kvtier.wire.protocol import BlockRemoved, BlockStored, Event, PackedTokens, StorageTier, WorkerId, parse_medium

MIN_TTFT_RATIONALE = """\
``min_ttft`` sends each request to the worker where its first token is expected soonest, from every
tier's events (:class:`kvtier.indexer.routing.scoring.TtftCost` over device, host and storage overlaps, with
the router's in-flight load). It prices everything in the unit the user waits in:

* tiers: a cached block saves its prefill time and costs its transfer time over the configured link
  (``--gpu-link``, ``--storage-link``), so a host or disk hit is worth what it saves on that hardware,
  not a fixed 0.75 or 0.25 of a block;
* queueing: prompts already routed to the worker and not yet prefilled run before this one, in
  chunked-prefill iterations of the worker's budget, and prefill time grows faster than linearly with
  the tokens of a pass;
* load: each of those iterations also carries one decode step of the worker's running batch, whose
  duration rises with the context it attends over (every in-flight request's prompt and output). That
  step is counted ``decode_weight`` (7) times: unlike a prefill backlog, which is gone in milliseconds,
  a decode batch keeps slowing every iteration on that worker, for the later turns of the session (which
  come back where their context is) and for every request queued behind this one;
* memory: engines reserve room for a request's output when they admit it; the router learns the mean
  output length from finished requests and charges a worker whose in-flight KV, the output still to be
  written, and this request would pass 90% of its device memory, in seconds per unit of overflow.

Where it wins: Dynamo adds decode blocks to prefill blocks one for one, so a worker holding a request's
prefix loses it to an idle worker as soon as its decode load exceeds the blocks the hit saves; min_ttft
keeps the prefix where the decode load costs less than the recompute, in milliseconds on the modeled
hardware, and stops before the batch or the reserved memory make the worker slower for everyone. The
measured comparison is the README's results table (``kvtier compare``, ``bench/crosscheck_dynamo.py``).
"""


@dataclass(slots=True)
class RouteInput:
    """What the router knows about a request."""

    request_id: str  # unique id
    tokens: PackedTokens  # prompt token ids, packed (kvtier.wire.pack_tokens)
    num_tokens: int  # prompt length
    keys: list[BlockKey]  # router block keys of the prompt
    now: float  # simulated time


@dataclass(slots=True, frozen=True)
class Choice:
    """A routing decision."""

    worker: int  # chosen worker index
    predicted: TierOverlap | None = None  # what the policy expected there (KV-aware policies)
    tier: StorageTier = StorageTier.EXTERNAL  # the deepest tier the policy can see


class Policy(Protocol):
    name: str
    #: Routes without reading the request's keys or the router's in-flight bookkeeping (round robin, random):
    #: the simulation then computes neither, as such a router would not. Results are the same either way.
    blind: ClassVar[bool]

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        """The worker for ``req``. What the policy learns from sending it there (a round-robin turn, a routing
        history, a plugin's ``routed``) is learned now, or with ``learn=False`` only if :meth:`learn` is called:
        a conditional disaggregated pool's prefill side, whose prompt may prefill on its decode worker instead,
        learns only when the prompt goes where it chose, as the service's pool does. Random draws are taken
        either way."""
        ...

    def learn(self, req: RouteInput, choice: Choice) -> None:
        """Learns that ``req`` went to ``choice`` (after ``choose(req, learn=False)``)."""
        ...


def _streams(n: int) -> list[StreamId]:
    return [StreamId(WorkerId(f"w{i}")) for i in range(n)]


@dataclass(slots=True)
class RoundRobin:
    workers: int  # cluster size
    name: str = "round_robin"
    _next: int = 0
    blind: ClassVar[bool] = True

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        c = Choice(self._next)
        if learn:
            self.learn(req, c)
        return c

    def learn(self, req: RouteInput, choice: Choice) -> None:
        self._next = (self._next + 1) % self.workers  # the turn moves when a request goes to it


@dataclass(slots=True)
class RandomPolicy:
    workers: int  # cluster size
    seed: int = 0  # rng seed
    name: str = "random"
    blind: ClassVar[bool] = True
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        return Choice(self._rng.randrange(self.workers))

    def learn(self, req: RouteInput, choice: Choice) -> None:
        pass  # (its draw is taken in choose)


@dataclass(slots=True)
class LeastLoaded:
    workers: int  # cluster size
    loads: LoadTracker  # router bookkeeping
    name: str = "least_loaded"
    blind: ClassVar[bool] = False

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        streams = _streams(self.workers)

        def load(i: int) -> tuple[int, int, int]:
            ld = self.loads.load(streams[i])
            return (ld.running, ld.active_blocks, i)

        return Choice(min(range(self.workers), key=load))

    def learn(self, req: RouteInput, choice: Choice) -> None:
        pass  # (the load is the run's booking)


class KvPolicy:
    """Routes with the real index, fed only the events of tiers up to ``max_tier``."""

    blind: ClassVar[bool] = False

    def __init__(self, name: str, workers: int, block_size: int, cost: CostModel, loads: LoadTracker,
                 max_tier: StorageTier, temperature: float = 0.0, seed: int = 0,
                 plugin: RoutingPolicy | None = None, window_aware: bool = False, window_tokens: int = 0) -> None:
        self.name = name
        self.max_tier = max_tier
        self.streams = _streams(workers)
        self.index = TieredIndex(block_size, window_tokens=window_tokens)
        for s in self.streams:
            self.index.add_worker(s)
        self.router = Router(self.index, cost, loads=loads, workers=self.streams, temperature=temperature, seed=seed,
                             policy=plugin, window_aware=window_aware)
        # The service's consumer, so loss and recovery act on the index exactly as in a deployment.
        self.consumer = IndexConsumer(self.index, wall_clock=lambda: 0.0, keep=self._listens)
        self.last_overlaps: OverlapScores | None = None  # every worker's, of the latest request routed

    def _listens(self, ev: Event) -> bool:
        # A router that only listens to lower tiers never sees the others; one that is not window-aware
        # filters window-KV events out, as Dynamo's router does with vLLM's sliding-window cache groups.
        return not (isinstance(ev, BlockStored | BlockRemoved) and (
            parse_medium(ev.medium) > self.max_tier
            or (ev.kv_cache_spec_kind is not None and not self.router.window_aware)))

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        d = self.router.route_keys(req.keys, req.num_tokens)
        self.last_overlaps = d.overlaps
        i = self.streams.index(d.worker)
        c = Choice(i, visible(d.overlaps.workers[d.worker], self.max_tier), self.max_tier)
        if learn:
            self.learn(req, c)
        return c

    def learn(self, req: RouteInput, choice: Choice) -> None:
        w = self.streams[choice.worker]
        if self.router.window_aware:
            self.index.note_routed(w, req.keys)
        note_routed(self.router.policy, req.keys, req.num_tokens, w)  # as the service does as it books

    def feed(self, deliveries: list[Delivery]) -> None:
        """Deliveries of the modeled event path (:mod:`kvtier.sim.transport`), recovery notices included."""
        self.consumer.feed(deliveries)

    @property
    def events_rejected(self) -> int:
        return sum(self.index.stats(s).events_rejected for s in self.streams)


class Oracle:
    """The same cost model and router, with overlaps read from the engines themselves."""

    blind: ClassVar[bool] = False

    def __init__(self, workers: int, caches: Callable[[], list[TieredCache]], block_size: int, cost: CostModel,
                 loads: LoadTracker, temperature: float = 0.0, seed: int = 0) -> None:
        self.name = "oracle"
        self.streams = _streams(workers)
        self._caches = caches
        self.router = Router(TieredIndex(block_size), cost, loads=loads, workers=self.streams,
                             temperature=temperature, seed=seed)
        self.last_overlaps: OverlapScores | None = None  # every worker's, as the engines held them, latest request

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        scores = OverlapScores(total_blocks=len(req.keys))
        for s, cache in zip(self.streams, self._caches(), strict=True):
            scores.workers[s] = cache.usable_overlap(req.tokens)  # what the engine would reuse (SWA: the cut)
        self.last_overlaps = scores
        d = self.router.choose(scores, req.num_tokens, req.keys)
        i = self.streams.index(d.worker)
        return Choice(i, scores.workers[d.worker])

    def learn(self, req: RouteInput, choice: Choice) -> None:
        pass  # (it reads the engines)


class Approx:
    """Predicts each worker's cache from where it sent earlier requests (no events), with a TTL (120 s, refreshed
    by each request routed over a block), as Dynamo's --no-kv-events mode does, and prices it with the run's cost
    model (``--cost``, default ``credit``), not Dynamo's; Dynamo also prunes that tree past 2**20 blocks, which is
    not modelled (``incumbents.SglangCacheAware`` is SGLang's gateway's approximate tree)."""

    blind: ClassVar[bool] = False

    def __init__(self, workers: int, block_size: int, cost: CostModel, loads: LoadTracker,
                 ttl_s: float = 120.0) -> None:
        self.name = "approx"
        self.streams = _streams(workers)
        self.ttl = ttl_s
        self._seen: list[dict[BlockKey, float]] = [{} for _ in range(workers)]  # key -> last routed
        self.router = Router(TieredIndex(block_size), cost, loads=loads, workers=self.streams)
        self._routed = 0

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        scores = OverlapScores(total_blocks=len(req.keys))
        horizon = req.now - self.ttl
        for s, seen in zip(self.streams, self._seen, strict=True):
            n = 0
            for k in req.keys:
                t = seen.get(k)
                if t is None or t < horizon:
                    break
                n += 1
            scores.workers[s] = TierOverlap(n, n, n, n)
        d = self.router.choose(scores, req.num_tokens, req.keys)
        choice = Choice(self.streams.index(d.worker), scores.workers[d.worker], StorageTier.DEVICE)
        if learn:
            self.learn(req, choice)
        return choice

    def learn(self, req: RouteInput, choice: Choice) -> None:
        seen = self._seen[choice.worker]
        for k in req.keys:
            seen[k] = req.now
        self._routed += 1
        if self._routed % 1024 == 0:
            self._prune(req.now - self.ttl)

    def _prune(self, horizon: float) -> None:
        for i, seen in enumerate(self._seen):
            self._seen[i] = {k: t for k, t in seen.items() if t >= horizon}


class PluginRouted:
    """A plugin that hears no events (an incumbent router's policy: :mod:`kvtier.indexer.routing.incumbents`),
    routing on
    the router's bookkeeping and what it learns of its own routing (``routed``), as ``kvtier indexer`` runs it."""

    blind: ClassVar[bool] = False

    def __init__(self, workers: int, block_size: int, plugin: RoutingPolicy, loads: LoadTracker) -> None:
        self.name = plugin.name
        self.plugin = plugin
        self.streams = _streams(workers)
        self.router = Router(TieredIndex(block_size), CreditCost(), loads=loads, workers=self.streams, policy=plugin)

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        d = self.router.choose(OverlapScores(total_blocks=len(req.keys)), req.num_tokens, req.keys)
        c = Choice(self.streams.index(d.worker))
        if learn:
            self.learn(req, c)
        return c

    def learn(self, req: RouteInput, choice: Choice) -> None:
        note_routed(self.plugin, req.keys, req.num_tokens, self.streams[choice.worker])


def check_policy(name: str) -> None:
    """Raises :class:`~kvtier.util.fields.ConfigError` (one line) unless ``name`` is a built-in policy or a
    plugin that loads. Imports the plugin's module."""
    if name in REGISTRY:
        return
    if not is_plugin_spec(name):
        policy_spec(name)  # (raises, naming the known ones)
    try:
        load_policy(name)  # fail here, with one line, rather than inside the run
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def policy_label(name: str) -> str:
    """What tables, plots and files call policy ``name``: a plugin's declared ``name`` rather than the spec that
    loads it (``fresh_first``, not ``examples/fresh_first_policy.py:FreshFirst``); a plugin that declares a
    built-in policy's name keeps its spec beside it, so that it never reads as the built-in one."""
    if name in REGISTRY or not is_plugin_spec(name):
        return name
    try:
        declared = str(load_policy(name).name)
    except ValueError:
        return name  # (check_policy reports it)
    return f"{declared} ({name})" if declared in REGISTRY or not declared else declared


def make_policy(name: str, *, workers: int, block_size: int, loads: LoadTracker,
                caches: Callable[[], list[TieredCache]], settings: RoutingSettings | None = None) -> Policy:
    """The simulator's side of policy ``name`` (a built-in one, or a plugin spec), its cost from the registry
    (:func:`kvtier.indexer.routing.policies.make_cost`) under ``settings``."""
    s = settings or RoutingSettings()
    if name not in REGISTRY and is_plugin_spec(name):
        # A plugin (kvtier.indexer.routing.plugins) routes on everything the index hears, like the service.
        plugin = load_policy(name)
        return KvPolicy(plugin.name, workers, block_size, CreditCost(), loads, StorageTier.EXTERNAL, plugin=plugin)
    spec = policy_spec(name)
    if spec.plugin is not None:
        plugin = make_plugin(name, s, block_size)
        if spec.kind == "index" and spec.tier is not None:  # it reads the index: fed the events of its tiers
            return KvPolicy(name, workers, block_size, make_cost(name, s), loads, spec.tier, plugin=plugin)
        return PluginRouted(workers, block_size, plugin, loads)
    if spec.kind == "blind":
        return RoundRobin(workers) if name == "round_robin" else RandomPolicy(workers, s.seed)
    if spec.kind == "load":
        return LeastLoaded(workers, loads)
    cm, tier = make_cost(name, s), spec.tier
    assert tier is not None
    if spec.kind == "history":
        return Approx(workers, block_size, cm, loads)
    if spec.kind == "oracle":
        return Oracle(workers, caches, block_size, cm, loads, s.temperature, s.seed)
    # A window-aware policy knows the served model, so engines that send no window events get their window KV
    # inferred.
    return KvPolicy(name, workers, block_size, cm, loads, tier, s.temperature, s.seed,
                    window_aware=spec.window_aware,
                    window_tokens=PRESETS[s.model].window_tokens if spec.window_aware else 0)
