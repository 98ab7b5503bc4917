"""The one registry of routing policies: names, the tiers each one hears, and the cost model behind each.

The simulator (:func:`kvtier.sim.policies.make_policy`) and the service (``kvtier indexer --policy``) both look a
policy up here and build its cost with :func:`make_cost` from the same :class:`RoutingSettings` (links, latency
fit, chunked-prefill budget, device capacity, credits, sampling), so a policy researched in ``kvtier replay
--policy X`` is the policy ``kvtier indexer --policy X`` runs. Plugins (:mod:`kvtier.indexer.routing.plugins`) are
named by
their spec, not here.

| policy        | kind     | hears                  | cost                                                 |
|---------------|----------|------------------------|------------------------------------------------------|
| round_robin   | blind    | nothing                | none: every worker in turn                           |
| random        | blind    | nothing                | none: seeded uniform choice                          |
| least_loaded  | load     | its own bookkeeping    | fewest running requests, then active blocks          |
| approx        | history  | its own routing        | the ``cost`` setting over a TTL'd routing history    |
| kv_device     | index    | device events          | the ``cost`` setting (credit or ttft)                |
| kv_host       | index    | device + host          | the ``cost`` setting                                 |
| kv_all        | index    | every tier             | the ``cost`` setting                                 |
| kv_swa        | index    | every tier, window KV  | the ``cost`` setting, on the usable (windowed) prefix |
| dynamo        | index    | every tier             | Dynamo kv_router's (:class:`DynamoCost`)             |
| min_ttft      | index    | every tier             | estimated time to first token (:class:`TtftCost`)    |
| goodput       | index    | every tier             | min_ttft; told an SLO, the workers meeting it first, |
|               |          |                        | priced by TTFT, TPOT and the streams it slows (:class:`SloCost`) |
| oracle        | oracle   | the engines themselves | the ``cost`` setting                                 |

The incumbent routers' policies, as baselines (routing-policy plugins of :mod:`kvtier.indexer.routing.incumbents`; each
docstring names its public source and defaults):

| policy             | kind    | hears               | rule                                                      |
|--------------------|---------|---------------------|-----------------------------------------------------------|
| sglang_cache_aware | history | its own routing     | SGLang Model Gateway's cache_aware: approximate trees,    |
|                    |         |                     | the least loaded when in-flight counts are imbalanced     |
| power_of_two       | load    | its own bookkeeping | SGLang Model Gateway's: the less loaded of two at random  |
| llmd               | history | its own routing     | llm-d's default profile less KV utilisation: prefix       |
|                    |         |                     | estimate 3 + queue 2                                      |
| llmd_kv            | history | its own routing     | llm-d's default profile: the same + KV-cache utilisation  |
|                    |         |                     | 2 (needs the capacity)                                    |
| llmd_precise       | index   | device + host       | llm-d's profile, its precise (event-fed) prefix scorer    |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.hardware.latency import PRESETS, LatencyModel, MockerLatency, TransferModel
from kvtier.hardware.links import (
    DEFAULT_GPU_LINK,
    DEFAULT_KV_LINK,
    DEFAULT_STORAGE_LINK,
    GPU_LINKS,
    KV_LINKS,
    STORAGE_LINKS,
)
from kvtier.indexer.routing.incumbents import Llmd, PowerOfTwo, SglangCacheAware
from kvtier.indexer.routing.plugins import RoutingPolicy
from kvtier.indexer.routing.scoring import (
    DEFAULT_OUT_OF_REACH,
    CostModel,
    CreditCost,
    DynamoCost,
    SloCost,
    TierCredits,
    TtftCost,
)
from kvtier.util.fields import ConfigError, did_you_mean
from kvtier.wire.protocol import StorageTier


@dataclass(slots=True, frozen=True)
class RoutingSettings:
    """What every policy's cost is built from, in the simulator and the service alike."""

    cost: str = "credit"  # the cost of kv_* (and approx, oracle): credit (Dynamo-style block credits) or ttft
    model: str = "llama-3.1-8b"  # the served model's preset: KV bytes per token, for transfer times
    h2d_gbps: float = GPU_LINKS[DEFAULT_GPU_LINK].gbps  # host <-> device link, GB/s each way
    storage_gbps: float = STORAGE_LINKS[DEFAULT_STORAGE_LINK].gbps  # storage (and shared pool) -> host, GB/s
    host_credit: float = 0.75  # credit costs: a host block's weight against a device block's
    disk_credit: float = 0.25  # ... a disk or shared-pool block's
    prefill_budget: int = 8192  # the workers' chunked-prefill tokens per iteration
    capacity_tokens: int | None = None  # each worker's device KV, tokens (None: ttft has no decode or memory term)
    latency: LatencyModel = field(default_factory=MockerLatency)  # iteration times (a measured fit, or Dynamo's)
    temperature: float = 0.0  # softmax sampling over costs (0: the lowest, ties at random)
    seed: int = 0  # the router's random choices
    slo_ttft_ms: float | None = None  # the SLO the goodput policy routes for (None: not bounded)
    slo_tpot_ms: float | None = None
    slo_out_of_reach: str = DEFAULT_OUT_OF_REACH  # the goodput policy's order of missing workers (SloCost.out_of_reach)
    kv_gbps: float = KV_LINKS[DEFAULT_KV_LINK].gbps  # disaggregated: the prefill -> decode KV link, GB/s

    def credits(self) -> TierCredits:
        """The credit weights; a shared pool's blocks earn the disk credit."""
        return TierCredits(host=self.host_credit, disk=self.disk_credit, external=self.disk_credit)

    def transfer(self) -> TransferModel:
        """Load times per tier of the model's KV over the configured links."""
        if self.model not in PRESETS:
            raise ConfigError(f"unknown model preset {self.model!r}; known: {sorted(PRESETS)}")
        return TransferModel.for_model(PRESETS[self.model], host_to_device_gbps=self.h2d_gbps,
                                       storage_to_host_gbps=self.storage_gbps,
                                       external_to_host_gbps=self.storage_gbps)


def _setting_cost(s: RoutingSettings, tier: StorageTier) -> CostModel:
    if s.cost == "credit":
        return CreditCost(s.credits(), max_tier=tier)
    if s.cost == "ttft":
        return _ttft(s, tier)
    raise ConfigError(f"unknown cost model {s.cost!r}; expected 'credit' or 'ttft'")


def _ttft(s: RoutingSettings, tier: StorageTier) -> CostModel:
    return TtftCost(s.transfer(), s.latency, tier, s.prefill_budget, s.capacity_tokens)


def _slo(s: RoutingSettings, tier: StorageTier) -> CostModel:
    base = TtftCost(s.transfer(), s.latency, tier, s.prefill_budget, s.capacity_tokens)
    return SloCost(base, s.slo_ttft_ms, s.slo_tpot_ms, out_of_reach=s.slo_out_of_reach)


def _dynamo(s: RoutingSettings, tier: StorageTier) -> CostModel:
    return DynamoCost(s.credits(), max_tier=tier)


@dataclass(slots=True, frozen=True)
class PolicySpec:
    """One routing policy: what it hears and how it prices a worker."""

    name: str
    kind: str  # blind, load, history, index (the event-fed index) or oracle (the engines' true state)
    tier: StorageTier | None  # the deepest tier whose events (or state) it sees; None: none
    cost: Callable[[RoutingSettings, StorageTier], CostModel] | None = None  # None: no cost model
    window_aware: bool = False  # scores SWA engines on their usable prefix (window-KV events, or inferred)
    doc: str = ""
    # A routing-policy plugin built from the settings and the block size (the incumbents): the object that routes
    # in the simulator and in the service alike, over the index of the tiers up to ``tier`` (an index policy) or
    # over no events at all. None: the router's cost model routes.
    plugin: Callable[[RoutingSettings, int], RoutingPolicy] | None = None

    @property
    def takes_cost(self) -> bool:
        """Whether the settings' ``cost`` (credit or ttft) chooses its cost model; the others ignore it."""
        return self.cost is _setting_cost

    @property
    def served(self) -> bool:
        """Whether ``kvtier indexer`` runs it: the event-fed ones, and the plugins it ships."""
        return self.kind == "index" or self.plugin is not None or self.name in ("round_robin", "least_loaded")


def _llmd_kv(s: RoutingSettings, block_size: int) -> RoutingPolicy:
    return Llmd(block_size, kv_weight=2.0, capacity_tokens=s.capacity_tokens, seed=s.seed, name="llmd_kv")


_E, _D, _H = StorageTier.EXTERNAL, StorageTier.DEVICE, StorageTier.HOST
_SPECS = [
    PolicySpec("round_robin", "blind", None, doc="every worker in turn"),
    PolicySpec("random", "blind", None, doc="a seeded uniform choice"),
    PolicySpec("least_loaded", "load", None, doc="fewest running requests, then fewest active blocks"),
    PolicySpec("approx", "history", _D, _setting_cost,
               doc="its own routing history with a TTL, no events (Dynamo's --no-kv-events mode)"),
    PolicySpec("kv_device", "index", _D, _setting_cost, doc="device events only"),
    PolicySpec("kv_host", "index", _H, _setting_cost, doc="device and host events"),
    PolicySpec("kv_all", "index", _E, _setting_cost, doc="every tier's events"),
    PolicySpec("kv_swa", "index", _E, _setting_cost, window_aware=True,
               doc="every tier, SWA engines scored on their usable prefix"),
    PolicySpec("dynamo", "index", _E, _dynamo, doc="NVIDIA Dynamo kv_router's cost, from its documentation"),
    PolicySpec("min_ttft", "index", _E, _ttft, doc="kvtier's own: the least estimated time to first token"),
    PolicySpec("goodput", "index", _E, _slo,
               doc="kvtier's own: told an SLO (TTFT, TPOT), the workers where the request meets it first, then "
                   "the least TTFT / 12 + TPOT + slowdown of the streams there"),
    PolicySpec("oracle", "oracle", _E, _setting_cost, doc="the engines' true state, no events"),
    PolicySpec("sglang_cache_aware", "history", None, doc="SGLang Model Gateway's cache_aware, from its code",
               plugin=lambda s, bs: SglangCacheAware(bs)),
    PolicySpec("power_of_two", "load", None, doc="SGLang Model Gateway's power_of_two, from its code",
               plugin=lambda s, bs: PowerOfTwo(s.seed)),
    PolicySpec("llmd", "history", None,
               doc="llm-d's default profile less its KV-utilisation scorer (prefix estimate 3, queue 2), from its code",
               plugin=lambda s, bs: Llmd(bs, capacity_tokens=s.capacity_tokens, seed=s.seed)),
    PolicySpec("llmd_kv", "history", None,
               doc="llm-d's default profile: llmd with its KV-utilisation scorer (weight 2)",
               plugin=lambda s, bs: _llmd_kv(s, bs)),
    PolicySpec("llmd_precise", "index", _H, _setting_cost, doc="llmd with llm-d's precise prefix scorer",
               plugin=lambda s, bs: Llmd(bs, capacity_tokens=s.capacity_tokens, seed=s.seed, name="llmd_precise",
                                         mode="precise")),
]
#: Every built-in policy, by name, in the order tables list them.
REGISTRY: dict[str, PolicySpec] = {s.name: s for s in _SPECS}
POLICIES = list(REGISTRY)


def policy_spec(name: str) -> PolicySpec:
    """The built-in policy ``name``; :class:`ConfigError` (one line) naming the known ones otherwise."""
    spec = REGISTRY.get(name)
    if spec is None and name.endswith(".py"):
        raise ConfigError(f"policy {name!r}: a plugin file is named with the policy in it, {name}:ATTR (its class, "
                          "factory or instance)")
    if spec is None:
        raise ConfigError(f"unknown policy {name!r}{did_you_mean(name, POLICIES)}; expected one of "
                          f"{', '.join(POLICIES)}, module:attr, file.py:attr, or an entry point of the group "
                          "kvtier.policies")
    return spec


def make_plugin(name: str, settings: RoutingSettings, block_size: int) -> RoutingPolicy:
    """A fresh plugin of built-in policy ``name`` (an incumbent's) under ``settings``: the simulator and the service
    each build their own with this, from the same settings. :class:`ConfigError` for a policy without one."""
    spec = policy_spec(name)
    if spec.plugin is None:
        raise ConfigError(f"policy {name!r} is not a plugin")
    return spec.plugin(settings, block_size)


def make_cost(name: str, settings: RoutingSettings, deepest: StorageTier | None = None) -> CostModel:
    """The cost model of built-in policy ``name`` under ``settings``: the one object both the simulator and the
    service route with; ``deepest``: it credits no tier past that one (nor past the policy's own). :class:`ConfigError`
    for a policy without one (blind or load-only)."""
    spec = policy_spec(name)
    if spec.cost is None or spec.tier is None:
        raise ConfigError(f"policy {name!r} prices no cache: it has no cost model")
    return spec.cost(settings, spec.tier if deepest is None else min(spec.tier, deepest))
