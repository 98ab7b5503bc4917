"""KV-aware routing: overlaps from the index, load from the router's bookkeeping, a cost model."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.routing.load import LoadTracker, LoadView
from kvtier.indexer.routing.plugins import RouteContext, RoutingPolicy, is_own, route_with
from kvtier.indexer.routing.scoring import CostModel
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import OverlapScores, TierOverlap

_NONE = TierOverlap(0, 0, 0, 0)
_TIE = 1e-9  # relative cost difference below which two workers tie (float noise, not preference)


@dataclass(slots=True, frozen=True)
class RouteDecision:
    """Which worker a request goes to, and why."""

    worker: StreamId  # the chosen worker
    costs: dict[StreamId, float]  # cost of every candidate
    overlaps: OverlapScores  # what the index said


class Router:
    """Chooses the lowest-cost worker, or samples by softmax when ``temperature > 0``.

    Workers whose costs tie (within ``_TIE`` relative) are chosen among uniformly with the router's
    seeded generator: always taking the first would pile every cold request on one worker, and
    decisions stay deterministic for a seed.
    """

    def __init__(
        self,
        index: TieredIndex,
        cost_model: CostModel,
        *,
        loads: LoadView | None = None,
        workers: Sequence[StreamId] | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        policy: RoutingPolicy | None = None,
        rebuilding: Callable[[], Collection[StreamId]] | None = None,
        window_aware: bool = False,
        dead: Callable[[], Collection[StreamId]] | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.index = index
        self.cost_model = cost_model
        self.loads: LoadView = loads if loads is not None else LoadTracker(index.block_size)
        self.workers = list(workers) if workers is not None else None
        self.temperature = temperature
        self._rng = random.Random(seed)
        self.policy = policy  # a plugin (kvtier.indexer.routing.plugins) replaces the cost model and the pick
        # Workers whose index is being rebuilt right now (catch-up, full replay, dump): their overlaps
        # say little until it ends, in seconds, so they are skipped while any other worker can serve.
        # Partial workers (events lost for good, for as long as no dump comes) are not skipped: what
        # their index shows is a lower bound, which the costs already price as such.
        self.rebuilding = rebuilding
        # Workers whose publisher looks gone (no batch, no probe answer for a while): a dead engine is cleared
        # or partial, so it looks idle and cheap; it is never chosen while another worker is alive.
        self.dead = dead
        # Sliding-window models: score workers that announce window KV on their usable prefix
        # (kvtier.indexer.index.windowkv); the others on their full-attention one.
        self.window_aware = window_aware

    def route(self, token_ids: list[int], *, lora_name: str | None = None,
              cache_salt: str | None = None, mm_items: Sequence[tuple[str, int, int]] | None = None) -> RouteDecision:
        """Routes a request given as token ids (multimodal items as ``(identifier, offset, length)``).
        O(tokens + workers)."""
        keys = self.index.request_keys(token_ids, lora_name=lora_name, cache_salt=cache_salt, mm_items=mm_items)
        return self.route_keys(keys, len(token_ids))

    def route_keys(self, keys: list[BlockKey], num_tokens: int, cost_model: CostModel | None = None) -> RouteDecision:
        """Routes a request given as precomputed block keys (``cost_model``: this request's, else the router's).
        O(blocks + workers)."""
        return self.choose(self.index.find_matches_keys(keys, window_aware=self.window_aware), num_tokens, keys,
                           cost_model)

    def peek_keys(self, keys: list[BlockKey], num_tokens: int) -> RouteDecision:
        """:meth:`route_keys` for a query, which books nothing: the random draws it makes (a tie-break, a softmax
        sample, the draws of a policy that keeps its generator as ``rng``) are taken back, so that queries never
        change where a later request goes, and a query names the worker the next route of the same prompt gets
        while nothing else changes (one without an SLO: a query is not priced by the request's SLO).
        O(blocks + workers)."""
        with draws_taken_back(self):
            return self.route_keys(keys, num_tokens)

    def choose(self, overlaps: OverlapScores, num_tokens: int, keys: list[BlockKey] | None = None,
               cost_model: CostModel | None = None) -> RouteDecision:
        """Applies the cost model (``cost_model``, else the router's) to given overlaps (an oracle passes true
        ones). With the request's ``keys``, prompt blocks that in-flight requests already hold on a worker are not
        counted again in its load. O(workers + shared blocks)."""
        candidates = self.workers if self.workers is not None else list(overlaps.workers)
        if not candidates:
            raise LookupError("no workers to route to")
        if self.dead is not None:
            gone = self.dead()
            if gone:
                candidates = [w for w in candidates if w not in gone] or candidates
        if self.rebuilding is not None:
            busy = self.rebuilding()
            if busy:
                candidates = [w for w in candidates if w not in busy] or candidates
        bs = self.index.block_size
        if self.policy is not None:
            partial = frozenset(s for s in self.index.streams if self.index.is_partial(s))
            # (a user's plugin is shown copies of the overlaps and loads: one that changes them changes no answer or
            # booking; kvtier's own policies read them as they are)
            own = is_own(self.policy)
            shown = overlaps if own else dataclasses.replace(overlaps, workers=dict(overlaps.workers))
            ctx = RouteContext(num_tokens, bs, keys or [], shown, self.loads, partial, guarded=not own)
            chosen, scores = route_with(self.policy, ctx, list(candidates))
            return RouteDecision(chosen, scores, overlaps)
        # The hot loop of routing (once per worker and request): the built-in models price every candidate in
        # one call (``costs``, the same floats as ``cost`` one by one), others one worker at a time.
        known = overlaps.workers.get
        found = [known(w, _NONE) for w in candidates]
        loads, shared = self.loads.loads_and_shared(candidates, keys or ())
        expected = self.loads.expected_output
        model = cost_model or self.cost_model
        batch = getattr(model, "costs", None)
        if batch is not None:
            values: list[float] = batch(num_tokens, bs, found, loads, shared, expected)
        else:
            cost = model.cost
            values = [cost(num_tokens, bs, o, load, n, expected)
                      for o, load, n in zip(found, loads, shared, strict=True)]
        return RouteDecision(self._pick(candidates, values), dict(zip(candidates, values, strict=True)), overlaps)

    def _pick(self, candidates: list[StreamId], costs: list[float]) -> StreamId:
        """The lowest of ``costs`` (one per candidate, in order), ties at random; or a softmax sample."""
        if self.temperature == 0.0:
            best = min(costs)
            limit = best + _TIE * max(1.0, abs(best))
            tied = [w for w, c in zip(candidates, costs, strict=True) if c <= limit]
            return tied[0] if len(tied) == 1 else self._rng.choice(tied)
        lo, hi = min(costs), max(costs)
        span = (hi - lo) or 1.0
        weights = [math.exp(-(c - lo) / (span * self.temperature)) for c in costs]
        return self._rng.choices(candidates, weights)[0]


@contextmanager
def draws_taken_back(*routers: Router) -> Iterator[None]:
    """Restores, on leaving, the random generators of ``routers`` and of their policies (a policy's ``rng``): what
    runs inside (a query's pick) leaves the draws of later picks as they were. O(routers)."""
    gens = [g for r in routers for g in (r._rng, getattr(r.policy, "rng", None)) if isinstance(g, random.Random)]
    states = [g.getstate() for g in gens]
    try:
        yield
    finally:
        for g, state in zip(gens, states, strict=True):
            g.setstate(state)
