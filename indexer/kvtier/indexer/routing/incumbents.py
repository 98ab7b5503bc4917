"""The incumbent routers' policies, as baselines: SGLang Model Gateway's ``cache_aware`` and ``power_of_two``, and
llm-d's default scheduling profile.

Each is a routing-policy plugin (:mod:`kvtier.indexer.routing.plugins`), so one object routes in the simulator
(:class:`kvtier.sim.policies.PluginRouted`, or a :class:`~kvtier.sim.policies.KvPolicy` for ``llmd_precise``) and in
the service (``kvtier indexer --policy NAME``), both built from the registry
(:mod:`kvtier.indexer.routing.policies`). Each
routes on the router's own bookkeeping (:class:`~kvtier.indexer.routing.load.LoadTracker`: requests routed and not
finished,
not yet first-token) and, for the cache-aware ones, on a history of what it routed where, which it learns through
``routed`` once a request is booked (``POST /route``; ``POST /query`` asks without teaching); only ``llmd_precise``
reads KV events (the index's overlaps) instead. That history is kept at the router's
block-key granularity (the prompt's full blocks of ``block_size`` tokens, keys chained from the root), where the
originals match tokens or characters: a partial last block never matches.

Each class's docstring names the public source its rules and defaults were read from (documentation and code
paths, at the commits named there); no code or text is copied.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.routing.load import held_prefix
from kvtier.indexer.routing.plugins import PolicyBase, RouteContext, own_policy
from kvtier.util.fields import ConfigError
from kvtier.wire.notices import StreamId


@dataclass(slots=True)
class _Frame:
    """One request's figures, computed once in ``filter`` for its ``score`` and ``pick`` calls."""

    ctx: RouteContext
    values: dict[StreamId, float]


@own_policy
class SglangCacheAware(PolicyBase):
    """SGLang Model Gateway's (SMG, formerly sgl-router) ``cache_aware`` policy, in its approximate-tree mode
    (no KV events).

    Sources: the SMG documentation, ``docs/concepts/routing/cache-aware.md`` of lightseekorg/smg (the two-state
    decision model, defaults 0.3 / 64 / 1.5, ``max-tree-size`` 67,108,864, eviction every 120 s), and its code
    at lightseekorg/smg 73da68c: ``model_gateway/src/policies/cache_aware.rs`` (``select_worker``,
    ``is_imbalanced``, ``select_worker_with_tokens``), ``model_gateway/src/main.rs`` (the CLI defaults) and
    ``crates/kv_index/src/token_tree.rs`` (match, insert, ``evict_tenant_by_size``).

    Rules, per request, over the candidate workers:

    * load = requests the router has in flight on the worker (``WorkerLoad.running``: routed, not finished);
    * imbalanced when ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``: the least
      loaded worker, ties to the one this router sent fewer requests, then to the first listed (SMG's
      ``(load, processed, index)``);
    * otherwise the longest prefix of the prompt that any worker's tree holds; match rate = its tokens / the
      prompt's tokens. Above ``cache_threshold``: the worker holding it (several: here the one that routed its
      last block most recently, a deterministic choice; SMG's node answers the tenant it cached, refreshed on about
      one touch in 16, else any holder). At or below: the least loaded worker, as
      above (SMG's code and its docs today); ``fallback="smallest_tree"`` takes the worker whose tree holds the
      fewest tokens instead (what SMG's source header and the older sgl-router describe).
    * Every routed prompt is inserted into its worker's tree, in either state.

    One tree per worker (SMG keeps one multi-tenant tree, the same thing per tenant), bounded to
    ``max_tree_size`` tokens per worker by evicting least recently used leaves. SMG evicts on a timer
    (``eviction_interval`` 120 s) and lets a tree overshoot in between; here the bound is kept at each insert, so
    decisions need no clock and are the same in the simulator and the service. SMG's KV-usage imbalance triggers
    (``balance_token_usage_threshold``, ``overload_token_usage_threshold``) are off by default and not modeled.
    """

    name = "sglang_cache_aware"

    def __init__(self, block_size: int, *, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 67_108_864,
                 fallback: str = "least_loaded") -> None:
        if block_size < 1:
            raise ConfigError(f"sglang_cache_aware: block_size must be >= 1, got {block_size}")
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(f"sglang_cache_aware: cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0 or max_tree_size < 0:
            raise ConfigError("sglang_cache_aware: balance thresholds and max_tree_size must be >= 0")
        if fallback not in ("least_loaded", "smallest_tree"):
            raise ConfigError(f"sglang_cache_aware: fallback must be least_loaded or smallest_tree, got {fallback!r}")
        self.block_size = block_size
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.fallback = fallback
        # Per worker: prompt block key -> the stamp of its last insert, least recent first. A key is always
        # touched after its descendants (inserts walk leaf to root), so the least recent key is a leaf and the
        # held keys stay prefix-closed through eviction.
        self._trees: dict[StreamId, OrderedDict[BlockKey, int]] = {}
        self._processed: dict[StreamId, int] = {}  # requests this router sent each worker
        self._stamp = 0
        self._frame: _Frame | None = None

    def tree_tokens(self, worker: StreamId) -> int:
        """Tokens the worker's tree holds."""
        return len(self._trees.get(worker, ())) * self.block_size

    def held(self, worker: StreamId, keys: Sequence[BlockKey]) -> int:
        """Leading blocks of ``keys`` the worker's tree holds. O(log blocks)."""
        tree = self._trees.get(worker)
        return 0 if tree is None else held_prefix(tree, keys)

    def filter(self, ctx: RouteContext, workers: list[StreamId]) -> list[StreamId]:
        self._frame = _Frame(ctx, {w: float(self.held(w, ctx.keys)) for w in workers})
        return workers

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        """Minus the match rate the worker's tree gives the prompt (what /query reports as its cost)."""
        assert self._frame is not None and self._frame.ctx is ctx
        return -self._frame.values[worker] * self.block_size / max(1, ctx.num_tokens)

    def _least_loaded(self, ctx: RouteContext, workers: list[StreamId]) -> StreamId:
        return min(enumerate(workers), key=lambda p: (ctx.load(p[1]).running, self._processed.get(p[1], 0), p[0]))[1]

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        assert self._frame is not None and self._frame.ctx is ctx
        workers = list(scores)
        loads = [ctx.load(w).running for w in workers]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return self._least_loaded(ctx, workers)
        held = self._frame.values
        matched = max(held[w] for w in workers)
        if matched * self.block_size / max(1, ctx.num_tokens) > self.cache_threshold:
            last = ctx.keys[int(matched) - 1]
            holders = [w for w in workers if held[w] == matched]
            return max(holders, key=lambda w: self._trees[w][last])
        if self.fallback == "smallest_tree":
            return min(enumerate(workers), key=lambda p: (self.tree_tokens(p[1]), p[0]))[1]
        return self._least_loaded(ctx, workers)

    def routed(self, keys: Sequence[BlockKey], num_tokens: int, worker: StreamId) -> None:
        """The request was booked on ``worker``: its prompt goes into that worker's tree. O(blocks)."""
        self._processed[worker] = self._processed.get(worker, 0) + 1
        tree = self._trees.setdefault(worker, OrderedDict())
        self._stamp += 1
        for k in reversed(keys):  # leaf first: a key ends more recent than every key below it
            tree[k] = self._stamp
            tree.move_to_end(k)
        limit = self.max_tree_size // self.block_size
        while len(tree) > limit:
            tree.popitem(last=False)


@own_policy
class PowerOfTwo(PolicyBase):
    """SGLang Model Gateway's ``power_of_two`` policy: two distinct workers drawn at random, the less loaded wins.

    Sources: the SMG documentation, ``docs/configuration/routing.md`` of lightseekorg/smg ("samples two workers,
    picks least loaded"), and its code at lightseekorg/smg 73da68c, ``model_gateway/src/policies/power_of_two.rs``:
    the first index uniform, the second uniform among the others; the first wins ties. Load is the router's
    in-flight request count (``WorkerLoad.running``), what SMG compares when its load monitor has no backend
    token-usage figures for both workers; where it has them (polled every ``load_monitor_interval``, 10 s, from
    backends that report them) SMG compares those instead, which the router here does not see. Draws come from
    a generator seeded by ``seed``, kept as ``rng`` so that a ``POST /query`` takes its draws back.
    """

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        return float(ctx.load(worker).running)

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        workers = list(scores)
        n = len(workers)
        if n == 1:
            return workers[0]
        i = self.rng.randrange(n)
        j = (i + 1 + self.rng.randrange(n - 1)) % n
        return workers[i] if scores[workers[i]] <= scores[workers[j]] else workers[j]


@own_policy
class Llmd(PolicyBase):
    """llm-d's inference scheduler, default scheduling profile: a prefix-cache scorer weighted 3 and a queue scorer
    weighted 2, summed, and the max-score picker (ties uniformly at random); a KV-cache-utilisation scorer as an
    option (``kv_weight``: ``llmd_kv``, which is llm-d's default profile whole; ``llmd`` is that profile without
    it).

    Sources: llm-d/llm-d-inference-scheduler at 520af47 (the Gateway API Inference Extension's endpoint picker,
    kubernetes-sigs/gateway-api-inference-extension, now lives there):
    ``pkg/epp/config/loader/defaults.go`` (the default profile: queue-scorer 2, kv-cache-utilization-scorer 2,
    prefix-cache-scorer 3; this policy leaves the utilisation scorer out unless ``kv_weight`` is given, and
    ``llmd_kv`` is that profile with it),
    ``pkg/epp/framework/plugins/scheduling/scorer/queuedepth/queue.go`` (min-max normalised waiting queue: 1 for
    every endpoint when all queues are equal), ``.../scorer/kvcacheutilization/kvcache_utilization.go`` (1 - KV
    usage), ``.../scorer/prefix/plugin.go`` (matched blocks / total blocks),
    ``.../picker/maxscore/picker.go`` (shuffle, then highest score first) and
    ``pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix/`` (the prefix estimate: the
    prompt's block hashes, at most 256 blocks (``maxPrefixBlocksToMatch``), a block counted for every endpoint
    holding it while any endpoint does; each endpoint's hashes in an LRU of its GPU block count (``autoTune``),
    else 31,250 (``lruCapacityPerServer``), added in prompt order once the request is scheduled).

    The prefix scorer here is that estimate mode, llm-d's default (the ``prefix-cache-scorer`` of the default
    profile). ``mode="precise"`` (``llmd_precise``) swaps in its precise mode instead, which must be configured in
    llm-d (``precise-prefix-cache-scorer``, fed by vLLM's KV events through llm-d/llm-d-kv-cache): the blocks held
    from the start of the prompt, each weighted by the best tier holding it (``pkg/kvcache/backend.go``: gpu 1.0,
    cpu 0.8; ``kvblock_scorer.go``: the longest prefix), over the prompt's full blocks, at most 1
    (``.../scorer/preciseprefixcache/utils.go``). Here those come from the event-fed index's device and host
    overlaps (what vLLM announces: its GPU and CPU tiers), under the same 3 + 2 weights, so that the two modes
    differ in the prefix scorer only (llm-d's sample precise configuration weighs it 2, KV utilisation 1, queue
    1). The inputs
    llm-d scrapes from vLLM's metrics come from the router's own bookkeeping instead, so the policy is the same
    object in the simulator and the service: the waiting queue is the requests routed to the worker and not yet
    at their first token (``WorkerLoad.prefilling``), KV usage the blocks its in-flight requests hold
    (``WorkerLoad.active_blocks``) over its device capacity, ``capacity_tokens``, which also sizes each LRU. Both
    are current at every decision, where llm-d's scraped metrics lag by its polling interval: under a burst this
    flatters llm-d. The precise mode weighs the blocks past the device prefix 0.8 (host), where llm-d weighs a
    block by its best tier, so a block back on the GPU past a gap there scores 1.0 in llm-d.
    """

    name = "llmd"
    MAX_PREFIX_BLOCKS = 256  # maxPrefixBlocksToMatch's default
    DEFAULT_LRU_BLOCKS = 31_250  # lruCapacityPerServer's default, without a GPU block count
    HOST_WEIGHT = 0.8  # the precise scorer's weight of a block on the CPU tier (the GPU's is 1.0)

    def __init__(self, block_size: int, *, prefix_weight: float = 3.0, queue_weight: float = 2.0,
                 kv_weight: float = 0.0, capacity_tokens: int | None = None, seed: int = 0,
                 name: str = "llmd", mode: str = "estimate") -> None:
        if block_size < 1:
            raise ConfigError(f"{name}: block_size must be >= 1, got {block_size}")
        if mode not in ("estimate", "precise"):
            raise ConfigError(f"{name}: mode must be estimate or precise, got {mode!r}")
        if min(prefix_weight, queue_weight, kv_weight) < 0:
            raise ConfigError(f"{name}: scorer weights must be >= 0")
        if kv_weight > 0 and not capacity_tokens:
            raise ConfigError(f"{name}: the KV-cache-utilisation scorer needs each worker's device capacity "
                              "(capacity_tokens, --capacity-tokens)")
        self.name = name
        self.mode = mode
        self.block_size = block_size
        self.prefix_weight, self.queue_weight, self.kv_weight = prefix_weight, queue_weight, kv_weight
        self.capacity_tokens = capacity_tokens
        self.lru_blocks = capacity_tokens // block_size if capacity_tokens else self.DEFAULT_LRU_BLOCKS
        self.rng = random.Random(seed)
        self._holders: dict[BlockKey, set[StreamId]] = {}  # block hash -> endpoints whose LRU holds it
        self._lrus: dict[StreamId, OrderedDict[BlockKey, None]] = {}  # least recent first
        self._frame: _Frame | None = None
        self._total = 0
        self._queue = (0, 0)

    def matches(self, keys: Sequence[BlockKey]) -> dict[StreamId, int]:
        """Per endpoint, the leading blocks it is credited with: while any endpoint holds a block, every holder
        counts it. O(matched blocks x holders)."""
        out: dict[StreamId, int] = {}
        for k in keys[:self.MAX_PREFIX_BLOCKS]:
            holders = self._holders.get(k)
            if not holders:
                break
            for w in holders:
                out[w] = out.get(w, 0) + 1
        return out

    def filter(self, ctx: RouteContext, workers: list[StreamId]) -> list[StreamId]:
        if self.mode == "precise":
            found = {w: (o := ctx.overlap(w)).device + self.HOST_WEIGHT * (o.host - o.device) for w in workers}
            self._frame = _Frame(ctx, found)
            self._total = len(ctx.keys)
        else:
            blocks = self.matches(ctx.keys)
            self._frame = _Frame(ctx, {w: float(blocks.get(w, 0)) for w in workers})
            self._total = min(-(-ctx.num_tokens // self.block_size), self.MAX_PREFIX_BLOCKS)
        queues = [ctx.load(w).prefilling for w in workers]
        self._queue = (min(queues), max(queues))
        return workers

    def scorers(self, ctx: RouteContext, worker: StreamId) -> tuple[float, float, float]:
        """The prefix, queue and KV-utilisation scores of ``worker``, each in [0, 1] (after ``filter``)."""
        assert self._frame is not None and self._frame.ctx is ctx
        prefix = min(1.0, self._frame.values[worker] / self._total) if self._total else 0.0
        lo, hi = self._queue
        load = ctx.load(worker)
        queue = 1.0 if hi == lo else (hi - load.prefilling) / (hi - lo)
        kv = 0.0
        if self.capacity_tokens:
            kv = 1.0 - min(1.0, load.active_blocks * self.block_size / self.capacity_tokens)
        return prefix, queue, kv

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        """Minus the weighted sum of the scorers (lower is better, as every plugin's)."""
        prefix, queue, kv = self.scorers(ctx, worker)
        total = self.prefix_weight * prefix + self.queue_weight * queue
        if self.kv_weight:
            total += self.kv_weight * kv
        return -total

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        best = min(scores.values())
        tied = [w for w, s in scores.items() if s == best]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    def routed(self, keys: Sequence[BlockKey], num_tokens: int, worker: StreamId) -> None:
        """The request was booked on ``worker``: in estimate mode its blocks join the worker's LRU, in prompt order
        (the first block ends least recent), evicting the least recent past capacity. O(blocks). The precise mode
        learns from events only."""
        if self.mode == "precise":
            return
        lru = self._lrus.setdefault(worker, OrderedDict())
        for k in keys[:self.MAX_PREFIX_BLOCKS]:
            if k in lru:
                lru.move_to_end(k)
                continue
            lru[k] = None
            self._holders.setdefault(k, set()).add(worker)
            if len(lru) > self.lru_blocks:
                old, _ = lru.popitem(last=False)
                holders = self._holders[old]
                holders.discard(worker)
                if not holders:
                    del self._holders[old]
