"""The simulator's side of disaggregated routing: one policy picking a (prefill, decode) pair.

Which rule each policy applies to each pool is :mod:`kvtier.indexer.routing.disagg`'s; this module builds it over the
simulated workers (``0..P-1`` prefill, ``P..P+D-1`` decode; see :mod:`kvtier.sim.cluster`). The prefill side is the
policy :func:`kvtier.sim.policies.make_policy` builds, its candidates narrowed to the prefill pool; a KV-aware one hears
both pools' events through the real codec, so the decode side prices the decode workers' overlap from the same
index (see the table of :mod:`kvtier.indexer.routing.disagg`). Each pool has its own load bookkeeping (a request is
booked on its prefill worker until its prompt is computed, on its decode worker until it finishes).

Conditional disaggregation (``local_prefill_tokens``) reads the chosen decode worker's device overlap from the index
whatever the policy, as the service's pool does (:class:`kvtier.indexer.routing.disagg.PairRouter`): a policy that
keeps no index of its own (blind, load-based, a routing history, an incumbent's plugin, the oracle) is given one, fed
both pools' events, for that check alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvtier.engine.cache import TieredCache
from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.routing.disagg import decode_cost, decode_rule, prefill_cost, prefills_locally
from kvtier.indexer.routing.load import LoadTracker
from kvtier.indexer.routing.policies import RoutingSettings
from kvtier.indexer.routing.router import Router
from kvtier.sim.policies import (
    Choice,
    KvPolicy,
    LeastLoaded,
    Oracle,
    Policy,
    RandomPolicy,
    RoundRobin,
    RouteInput,
    make_policy,
)
from kvtier.wire.notices import Delivery, StreamId
from kvtier.wire.overlap import OverlapScores, TierOverlap
from kvtier.wire.protocol import WorkerId


@dataclass(slots=True, frozen=True)
class PairChoice:
    """A disaggregated routing decision: worker indices of the whole cluster."""

    prefill: Choice  # the prefill worker, and what the policy expected there
    decode: int  # the decode worker (-1: chosen when the prompt is computed, :meth:`DisaggPolicy.choose_decode`)
    decode_cached: int  # prompt tokens the index shows on the decode worker's device (0: none, or not read)
    local: bool  # prefill on the decode worker (conditional disaggregation)


class _Pool:
    """A blind policy built for ``len(members)`` workers, its choices mapped onto ``members``."""

    blind: ClassVar[bool] = True

    def __init__(self, inner: Policy, members: list[int]) -> None:
        self.inner = inner
        self.members = members
        self.name = inner.name

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        c = self.inner.choose(req, learn=learn)
        return Choice(self.members[c.worker], c.predicted, c.tier)

    def learn(self, req: RouteInput, choice: Choice) -> None:
        self.inner.learn(req, Choice(self.members.index(choice.worker), choice.predicted, choice.tier))


class _PoolLeastLoaded:
    """least_loaded over ``members``, read from their load bookkeeping."""

    blind: ClassVar[bool] = False
    name = "least_loaded"

    def __init__(self, members: list[int], loads: LoadTracker) -> None:
        self.members = members
        self.loads = loads
        self.streams = [StreamId(WorkerId(f"w{i}")) for i in members]

    def choose(self, req: RouteInput, *, learn: bool = True) -> Choice:
        def load(k: int) -> tuple[int, int, int]:
            ld = self.loads.load(self.streams[k])
            return (ld.running, ld.active_blocks, k)
        return Choice(self.members[min(range(len(self.members)), key=load)])

    def learn(self, req: RouteInput, choice: Choice) -> None:
        pass  # (the load is the run's booking)


def _narrow(policy: Policy, members: list[int], loads: LoadTracker, seed: int) -> Policy:
    """``policy`` (built over the whole cluster) choosing among ``members`` only."""
    router = getattr(policy, "router", None)
    if isinstance(router, Router):
        streams: list[StreamId] = getattr(policy, "streams")  # noqa: B009 (every router-backed policy has them)
        router.workers = [streams[i] for i in members]
        return policy
    if isinstance(policy, RoundRobin):
        return _Pool(RoundRobin(len(members)), members)
    if isinstance(policy, RandomPolicy):
        return _Pool(RandomPolicy(len(members), seed), members)
    if isinstance(policy, LeastLoaded):
        return _PoolLeastLoaded(members, loads)
    raise TypeError(f"policy {policy.name!r} cannot be narrowed to a pool")


class DisaggPolicy:
    """Policy ``name`` over a disaggregated cluster of ``prefill`` + ``decode`` workers."""

    def __init__(self, name: str, *, prefill: int, decode: int, block_size: int, loads: LoadTracker,
                 decode_loads: LoadTracker, caches: Callable[[], list[TieredCache]], settings: RoutingSettings,
                 decode_settings: RoutingSettings | None = None, local_prefill_tokens: int = 0) -> None:
        workers = prefill + decode
        self.name = name
        self.block_size = block_size
        self.local_prefill_tokens = local_prefill_tokens
        pre = make_policy(name, workers=workers, block_size=block_size, loads=loads, caches=caches,
                          settings=settings)
        if isinstance(pre, KvPolicy) and pre.router.policy is None:
            pre.router.cost_model = prefill_cost(name, settings)
        self.prefill = _narrow(pre, list(range(prefill)), loads, settings.seed)
        self.kv = pre if isinstance(pre, KvPolicy) else None  # the index both pools' events feed
        members = list(range(prefill, workers))
        self._streams = [StreamId(WorkerId(f"w{i}")) for i in range(workers)]
        # The decode side prices with its own pool's device capacity and latency fit (default: the prefill pool's).
        dset = dataclasses.replace(decode_settings or settings, seed=settings.seed + 1)
        self.rule = decode_rule(name)
        self.decode: Policy | None = None
        self.decode_router: Router | None = None
        if self.rule == "same":
            dec = make_policy(name, workers=workers, block_size=block_size, loads=decode_loads, caches=caches,
                              settings=dset)
            self.decode = _narrow(dec, members, decode_loads, dset.seed)
        else:
            index = self.kv.index if self.kv is not None else TieredIndex(block_size)
            self.decode_router = Router(index, decode_cost(name, dset), loads=decode_loads,
                                        workers=[self._streams[i] for i in members],
                                        temperature=dset.temperature, seed=dset.seed)
        # The index the conditional check reads where the policy keeps none (see the module's docstring).
        self._local: IndexConsumer | None = None
        if local_prefill_tokens and self.kv is None:
            self._local = IndexConsumer(TieredIndex(block_size), wall_clock=lambda: 0.0)
            for s in self._streams:
                self._local.index.add_worker(s)
        self.blind = self._local is None and self.prefill.blind and (self.decode is None or self.decode.blind)
        for kv in (self.kv, self.decode):
            if isinstance(kv, KvPolicy):
                for i, s in enumerate(kv.streams):
                    kv.index.set_role(s, "prefill" if i < prefill else "decode")
        # Dynamo's frontend routes the decode side once the prefill has returned (its mocker too, round robin
        # included); SGLang Model Gateway, llm-d and vLLM's proxy pick both workers when the request arrives. A
        # conditional pool picks both at arrival, as the choice of where to prefill needs the decode worker.
        self.decode_at_handoff = rule_at_handoff(name) and not local_prefill_tokens

    def choose(self, req: RouteInput) -> PairChoice:
        # A conditional pool's prefill side learns only when the prompt goes there (not to its decode worker), as
        # the service's pool does (kvtier.indexer.service.disagg.route_pair); its draws are taken either way.
        conditional = self.local_prefill_tokens > 0
        p = self.prefill.choose(req, learn=not conditional)
        if self.decode_at_handoff:
            return PairChoice(p, -1, 0, False)
        pair = self.choose_decode(req, p)
        if conditional and not pair.local:
            self.prefill.learn(req, p)
        return pair

    def choose_decode(self, req: RouteInput, p: Choice) -> PairChoice:
        """The decode side of the pair (at arrival, or when the prompt is computed: :attr:`decode_at_handoff`)."""
        ps = self.block_size
        if self.decode is not None:
            d = self.decode.choose(req)
            cached = d.predicted.device * ps if d.predicted is not None else self._held(req, d.worker)
            return PairChoice(p, d.worker, cached, prefills_locally(req.num_tokens, cached,
                                                                    self.local_prefill_tokens))
        router = self.decode_router
        assert router is not None
        if self.rule == "dynamo":  # overlap weight 0 and no assumed reuse: load alone decides
            overlaps = OverlapScores(total_blocks=len(req.keys))
            if self.local_prefill_tokens and self.kv is not None:
                overlaps = self.kv.index.find_matches_keys(req.keys)
            dec = router.choose(OverlapScores(total_blocks=len(req.keys)), req.num_tokens, None)
        else:
            # The prefill side's walk of the index (the oracle's: of the engines) found every worker's overlap, the
            # decode pool's too: reused when this request was just routed there (not at handoff, when it has moved on).
            walked = self.kv if self.kv is not None else self.prefill if isinstance(self.prefill, Oracle) else None
            known = walked.last_overlaps if walked is not None and not self.decode_at_handoff else None
            overlaps = known if known is not None else router.index.find_matches_keys(req.keys)
            dec = router.choose(overlaps, req.num_tokens, req.keys)
        worker = self._streams.index(dec.worker)
        o: TierOverlap | None = overlaps.workers.get(dec.worker)
        cached = o.device * ps if o is not None else 0
        if self._local is not None:  # (the decode router's index is an empty one: the policy keeps none)
            cached = self._held(req, worker)
        return PairChoice(p, worker, cached, prefills_locally(req.num_tokens, cached, self.local_prefill_tokens))

    def _held(self, req: RouteInput, worker: int) -> int:
        """Prompt tokens the conditional check's own index shows on decode worker ``worker``'s device (0 where
        there is none: the pool is not conditional, or the policy's index was read). O(blocks)."""
        if self._local is None:
            return 0
        o = self._local.index.find_matches_keys(req.keys).workers.get(self._streams[worker])
        return o.device * self.block_size if o is not None else 0

    def feed(self, deliveries: list[Delivery]) -> None:
        """Both pools' events, into the index (each side's, where the decode side runs a policy of its own; the
        conditional check's, where the policy keeps none)."""
        if self.kv is not None:
            self.kv.feed(deliveries)
        if isinstance(self.decode, KvPolicy):
            self.decode.feed(deliveries)
        if self._local is not None:
            self._local.feed(deliveries)

    @property
    def listens(self) -> bool:
        """Whether it reads engine events (else the run only counts them)."""
        return self.kv is not None or isinstance(self.decode, KvPolicy) or self._local is not None

    @property
    def events_rejected(self) -> int:
        kv = self.kv if self.kv is not None else self.decode
        if isinstance(kv, KvPolicy):
            return kv.events_rejected
        if self._local is not None:
            return sum(self._local.index.stats(s).events_rejected for s in self._local.index.streams)
        return 0


def rule_at_handoff(name: str) -> bool:
    """Whether policy ``name`` picks its decode worker once the prompt is computed (Dynamo's, and the blind ones as
    Dynamo's mocker runs them) rather than when the request arrives."""
    return name in ("dynamo", "round_robin", "random")
