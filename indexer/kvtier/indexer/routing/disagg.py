"""Disaggregated prefill and decode: how each policy picks a (prefill, decode) pair, in the simulator and the service.

A request in a disaggregated pool is prefilled on a prefill worker (which holds the tiered cache: device, host,
storage) and decoded on a decode worker, which receives the prompt's KV over the KV link, all but what its own radix
cache already holds. So a pair has two prices: the prefill side (queue, cache hits by tier, their load times) and the
decode side (the KV still to move, the decode batch the request joins, the memory it needs there). Each policy picks
its prefill worker among the prefill pool by its own rule (:func:`prefill_cost`) and its decode worker among the
decode pool by the rule below (:func:`decode_rule`):

| policy                         | decode worker                                                                    |
|--------------------------------|----------------------------------------------------------------------------------|
| round_robin, random            | the same rule over the decode pool                                               |
| least_loaded                   | the same rule over the decode pool                                               |
| dynamo                         | Dynamo's decode router: ``overlap_score_weight`` 0, no assumed KV reuse, no      |
|                                | prefill tokens tracked: the fewest active blocks, the request's whole prompt     |
|                                | counted; its prefill router leaves decode blocks out (``router_track_active_     |
|                                | blocks`` off). From Dynamo's public replay code (``derive_decode_router_config``)|
| sglang_cache_aware, power_of_  | a second instance of the same policy over the decode pool: SGLang Model Gateway's|
| two, llmd, llmd_kv, llmd_prec. | PD mode runs a policy per pool (``--prefill-policy``, ``--decode-policy``, both  |
|                                | the main one unless set); llm-d's P/D profile handler runs a decode profile,     |
|                                | which kvtier gives the same scorers                                              |
| kv_*, oracle                   | the same cost over the decode pool, on the decode workers' overlap in the tiers  |
|                                | the policy hears (the oracle: the decode engines' own), a shared storage pool    |
|                                | not credited: the KV that need not cross the link (the simulator's decode        |
|                                | workers hold device only; a served one that offloads to host has its host copy   |
|                                | credited as the policy credits host)                                             |
| approx                         | the same cost over the decode pool, seeing no decode overlap (it keeps no index) |
| min_ttft, goodput              | :class:`KvLinkCost`: the transfer of what the decode worker lacks, the decode    |
|                                | step there (the TPOT the request will see and bring), memory, in milliseconds;   |
|                                | goodput's TPOT bound is checked here, its TTFT bound on the prefill side         |

The two sides are priced independently and each minimised, which minimises their sum: the KV transfer depends on
the decode worker only (the prompt's KV is whole on any prefill worker once computed). Each side's router reads its
own pool's bookings: a worker of role ``both`` in a pool with dedicated ones is priced by each side on that side's
bookings alone (``/metrics`` shows their sum).

Conditional disaggregation (:func:`prefills_locally`): a prompt whose part the chosen decode worker lacks on device,
as the index shows it whatever the policy (the simulator's pools read it so too), is under a threshold prefills there,
skipping the transfer, as vLLM's and Dynamo's routers allow. So does a prompt whose two sides picked the same worker
(one of role ``both`` in the service's pool): there is nothing to move.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from kvtier.hardware.latency import PRESETS, LatencyModel, MockerLatency, trailing_kv_bytes
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.routing.load import LoadTracker, LoadView, PoolLoads, WorkerLoad
from kvtier.indexer.routing.plugins import RoutingPolicy, is_plugin_spec
from kvtier.indexer.routing.policies import REGISTRY, RoutingSettings, make_cost, policy_spec
from kvtier.indexer.routing.router import RouteDecision, Router, draws_taken_back
from kvtier.indexer.routing.scoring import SLO_MISS_MS, CostModel, DynamoCost, SloCost
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import TierOverlap
from kvtier.wire.protocol import ROLES, StorageTier

__all__ = ["ROLES", "KvLinkCost", "PairDecision", "PairRouter", "decode_cost", "decode_rule", "pool_routers",
           "prefill_cost", "prefills_locally"]


@dataclass(slots=True, frozen=True)
class KvLinkCost:
    """kvtier's decode-side price of a worker, ms: the prompt's KV it lacks (its device overlap, or the prefix its
    in-flight requests hold, whichever is longer) moved over the KV link, plus the decode step it would run with
    this request in its batch counted ``decode_weight`` times (the TPOT the request will see, and bring to every
    stream there; the weight of :class:`~kvtier.indexer.routing.scoring.TtftCost`), plus a full worker's wait for memory
    (the request reserves its prompt and output there), as ``TtftCost`` charges it."""

    bytes_per_token: int  # KV bytes per prompt token
    kv_gbps: float  # the prefill -> decode link, GB/s
    latency: LatencyModel = field(default_factory=MockerLatency)  # iteration times
    capacity_tokens: int | None = None  # device KV per decode worker (None: no decode or memory term)
    decode_weight: float = 7.0  # see TtftCost.decode_weight
    memory_headroom: float = 0.9  # see TtftCost
    blind_headroom: float = 0.7
    memory_wait_ms: float = 10_000.0
    # The goodput policy's TPOT bound (None: none): a worker whose decode step, midway through the request's decode
    # (as SloCost estimates it), would pass it costs SLO_MISS_MS times its ratio to the bound
    tpot_ms: float | None = None
    window_bytes_per_token: int = 0  # a hybrid model's sliding-window KV per token, moved for the last window
    window_tokens: int = 0  # its window

    @classmethod
    def of(cls, settings: RoutingSettings, tpot_ms: float | None = None) -> KvLinkCost:
        """The cost over the link, latency fit and decode capacity ``settings`` name. O(1)."""
        model = PRESETS[settings.model]
        return cls(model.bytes_per_token, settings.kv_gbps, settings.latency, settings.capacity_tokens,
                   tpot_ms=tpot_ms, window_bytes_per_token=model.window_bytes_per_token,
                   window_tokens=model.window_tokens)

    def with_slo(self, tpot_ms: float | None) -> KvLinkCost:
        """This cost told a request's TPOT bound (the goodput policy's decode side). O(1)."""
        return dataclasses.replace(self, tpot_ms=tpot_ms)

    def transfer_ms(self, tokens: int) -> float:
        """Milliseconds to move the KV of ``tokens`` tokens that end a prompt over the link (with a hybrid model's
        window KV: :func:`~kvtier.hardware.latency.trailing_kv_bytes`). O(1)."""
        nbytes = trailing_kv_bytes(tokens, self.bytes_per_token, self.window_bytes_per_token, self.window_tokens)
        return nbytes / (self.kv_gbps * 1e6)

    def lacking_ms(self, num_tokens: int, block_size: int, overlap: TierOverlap, shared_blocks: int = 0) -> float:
        """Milliseconds to move the prompt's KV a decode worker lacks: all but its device overlap, or the prefix its
        in-flight requests hold, whichever is longer. O(1)."""
        return self.transfer_ms(num_tokens - max(overlap.device, shared_blocks) * block_size)

    def step_ms(self, load: WorkerLoad, num_tokens: int) -> float:
        """The decode worker's step with this request's prompt in its batch, ms (0 without a capacity). O(1)."""
        if not self.capacity_tokens:
            return 0.0
        return self.latency.decode_ms(min(1.0, (load.context_tokens + num_tokens) / self.capacity_tokens))

    def cost(self, num_tokens: int, block_size: int, overlap: TierOverlap, load: WorkerLoad,
             shared_blocks: int = 0, output_tokens: float = 0.0) -> float:
        ms = self.lacking_ms(num_tokens, block_size, overlap, shared_blocks)
        if self.capacity_tokens:
            cap = self.capacity_tokens
            ms += self.step_ms(load, num_tokens) * self.decode_weight
            projected = ((load.active_blocks - shared_blocks) * block_size + load.unwritten_tokens + num_tokens
                         + output_tokens)
            headroom = self.memory_headroom if output_tokens > 0 else self.blind_headroom
            ms += max(0.0, projected / cap - headroom) * self.memory_wait_ms
            if self.tpot_ms:
                context = load.context_tokens + num_tokens + (load.unwritten_tokens + output_tokens) / 2
                tpot = self.latency.decode_ms(context / cap)
                if tpot > self.tpot_ms:
                    return SLO_MISS_MS * tpot / self.tpot_ms
        return ms


def decode_rule(name: str) -> str:
    """How policy ``name`` picks its decode worker: ``"same"`` (its own rule over the decode pool: blind, load and
    plugin policies), ``"dynamo"``, ``"time"`` (:class:`KvLinkCost`) or ``"cost"`` (its cost model over the decode
    pool's overlaps). :class:`~kvtier.util.fields.ConfigError` for an unknown name."""
    if is_plugin_spec(name):  # a user's plugin: a second instance of it over the decode pool
        return "same"
    spec = policy_spec(name)
    if name == "dynamo":
        return "dynamo"
    if name in ("min_ttft", "goodput"):
        return "time"
    if spec.plugin is not None or spec.cost is None:
        return "same"
    return "cost"


def prefill_cost(name: str, settings: RoutingSettings) -> CostModel:
    """Policy ``name``'s cost over the prefill pool: its own, but Dynamo's prefill router leaves decode blocks out
    (a prefill worker holds no decode batch: ``router_track_active_blocks`` off)."""
    if name == "dynamo":
        return DynamoCost(settings.credits(), decode_scale=0.0)
    cost = make_cost(name, settings)
    if isinstance(cost, SloCost):  # the TPOT bound is the decode side's (KvLinkCost), the TTFT bound stays here
        return dataclasses.replace(cost, tpot_ms=None)
    return cost


def decode_cost(name: str, settings: RoutingSettings) -> CostModel:
    """Policy ``name``'s cost over the decode pool (rules ``dynamo``, ``time`` and ``cost`` of :func:`decode_rule`).
    :class:`~kvtier.util.fields.ConfigError` for a policy without one."""
    rule = decode_rule(name)
    if rule == "dynamo":
        return DynamoCost(settings.credits(), prefill_load_scale=0.0)
    if rule == "time":
        return KvLinkCost.of(settings, tpot_ms=settings.slo_tpot_ms if name == "goodput" else None)
    # A decode worker is credited the KV it holds itself: a shared pool's blocks would cross to it as the prefill
    # worker's do. Credited, they were not alike for every decode worker (a tier's credit counts the blocks past the
    # tier above it), so a worker with less of the prompt on device gained more.
    return make_cost(name, settings, deepest=StorageTier.DISK)


def prefills_locally(num_tokens: int, decode_cached_tokens: int, threshold: int) -> bool:
    """Whether a prompt prefills on its decode worker: the part that worker lacks is under ``threshold`` tokens
    (0: never). O(1)."""
    return threshold > 0 and num_tokens - decode_cached_tokens < threshold


@dataclass(slots=True)
class PairDecision:
    """A disaggregated routing decision."""

    prefill: RouteDecision  # among the prefill pool
    decode: RouteDecision  # among the decode pool
    local: bool = False  # prefill on the decode worker (conditional disaggregation)


class PairRouter:
    """Two routers over one index, each restricted to its pool (their ``workers``), each with its own load
    bookkeeping: the prefill pool books a request until its prompt is computed, the decode pool until it finishes.
    ``assume_reuse``: whether the decode side counts prompt blocks its in-flight requests hold once (Dynamo's decode
    router does not)."""

    def __init__(self, prefill: Router, decode: Router, *, assume_reuse: bool = True,
                 local_prefill_tokens: int = 0) -> None:
        if not prefill.workers or not decode.workers:
            raise ValueError("a disaggregated pool needs at least one prefill and one decode worker")
        self.prefill = prefill
        self.decode = decode
        self.assume_reuse = assume_reuse
        self.local_prefill_tokens = local_prefill_tokens

    def route_keys(self, keys: list[BlockKey], num_tokens: int, prefill_cost: CostModel | None = None,
                   decode_cost: CostModel | None = None) -> PairDecision:
        """The pair for a request given as block keys; ``prefill_cost`` and ``decode_cost`` are this request's
        (None: the routers'). O(blocks + workers)."""
        p = self.prefill.route_keys(keys, num_tokens, prefill_cost)
        overlaps = p.overlaps if self.prefill.index is self.decode.index else \
            self.decode.index.find_matches_keys(keys)
        d = self.decode.choose(overlaps, num_tokens, keys if self.assume_reuse else None, decode_cost)
        bs = self.decode.index.block_size
        o = overlaps.workers.get(d.worker)
        cached = 0 if o is None else o.device * bs
        # (a worker of role "both" picked by both sides prefills where it decodes: nothing moves)
        local = d.worker == p.worker or prefills_locally(num_tokens, cached, self.local_prefill_tokens)
        return PairDecision(p, d, local)

    def peek_keys(self, keys: list[BlockKey], num_tokens: int) -> PairDecision:
        """:meth:`route_keys` for a query, which books nothing: both routers' random draws are taken back
        (:meth:`Router.peek_keys <kvtier.indexer.routing.router.Router.peek_keys>`). O(blocks + workers)."""
        with draws_taken_back(self.prefill, self.decode):
            return self.route_keys(keys, num_tokens)


def pool_error(roles: Iterable[str]) -> str | None:
    """Why workers of these roles make no pool (a disaggregated one without a prefill or a decode worker), or None
    (no workers at all is the configuration's own error). O(workers)."""
    have = set(roles)
    if have and have != {"both"} and not (have & {"prefill", "both"} and have & {"decode", "both"}):
        return f"endpoints: a disaggregated pool needs a prefill and a decode worker; roles: {sorted(have)}"
    return None


def pool_routers(name: str, settings: RoutingSettings, index: TieredIndex, roles: Mapping[StreamId, str],
                 loads: LoadTracker, decode_loads: LoadTracker,
                 make: Callable[[], tuple[CostModel, RoutingPolicy | None]],
                 rebuilding: Callable[[], Collection[StreamId]] | None = None,
                 dead: Callable[[], Collection[StreamId]] | None = None,
                 local_prefill_tokens: int = 0, *, decode_settings: RoutingSettings | None = None,
                 make_decode: Callable[[], tuple[CostModel, RoutingPolicy | None]] | None = None) -> PairRouter | None:
    """The service's pair of routers over one index for policy ``name``, or None where every worker serves both
    roles (an aggregated pool). ``make`` builds the policy's cost and plugin as the service does for an aggregated
    pool (called once per pool: a plugin keeps its own history per pool); the registry's policies get their pool
    rules (:func:`prefill_cost`, :func:`decode_rule`). ``loads`` books a request on its prefill worker until its
    first token, ``decode_loads`` on its decode worker until it finishes; each pool's router reads a worker that
    serves both roles with both added (:class:`~kvtier.indexer.routing.load.PoolLoads`). The decode pool is priced with
    ``decode_settings`` and built by ``make_decode`` where its workers differ (default: ``settings``, ``make``).
    :class:`ValueError` for a pool without a prefill or a decode worker."""
    if all(r == "both" for r in roles.values()):
        return None
    if (wrong := pool_error(roles.values())) is not None:
        raise ValueError(wrong)
    prefill = [s for s, r in roles.items() if r in ("prefill", "both")]
    decode = [s for s, r in roles.items() if r in ("decode", "both")]
    known = name in REGISTRY
    cost, plugin = make()
    if known and plugin is None:
        cost = prefill_cost(name, settings)
    rule = decode_rule(name) if known else "same"
    if rule == "same":
        dcost, dplugin = (make_decode or make)()
    else:
        dcost, dplugin = decode_cost(name, decode_settings or settings), None

    def router(c: CostModel, p: RoutingPolicy | None, workers: list[StreamId], ld: LoadView, seed: int) -> Router:
        return Router(index, c, loads=ld, workers=workers, policy=p, rebuilding=rebuilding, window_aware=True,
                      temperature=settings.temperature, seed=seed, dead=dead)
    both = [s for s, r in roles.items() if r == "both"]  # each side prices what the other booked there too
    return PairRouter(router(cost, plugin, prefill, PoolLoads(loads, decode_loads, both) if both else loads,
                             settings.seed),
                      router(dcost, dplugin, decode, PoolLoads(decode_loads, loads, both) if both else decode_loads,
                             settings.seed + 1),
                      assume_reuse=rule != "dynamo", local_prefill_tokens=local_prefill_tokens)
