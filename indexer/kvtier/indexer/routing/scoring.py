"""Cost models that turn per-worker tier overlaps and load into a routing cost (lower is better).

Three models, each small and documented:

* :class:`CreditCost`: Dynamo's shape. A cached block earns credit by tier (device 1.0,
  host 0.75, disk 0.25 by default); the cost is ``overlap_weight * (blocks to prefill
  + queued prefill blocks) + (active blocks + this request's blocks)``.
* :class:`TtftCost`: an estimate of time to first token in ms, priced as the worker spends it:
  the queued prefill and this request's uncached suffix run in chunked-prefill iterations of
  ``prefill_budget`` tokens, each also carrying one decode step of the running batch, plus the
  load time of each tier's cached blocks, plus a wait when the worker's KV memory is full; the decode
  steps weigh more than once (they are paid again by the session's later turns and by later arrivals).
* :class:`DynamoCost`: NVIDIA Dynamo's kv_router cost as its documentation describes it, the
  baseline every other policy is compared with.

``max_tier`` limits what a model sees, so one class serves kv_device (DEVICE),
kv_host (HOST) and kv_all (EXTERNAL) policies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.hardware.latency import LatencyModel, MockerLatency, TransferModel
from kvtier.indexer.routing.load import WorkerLoad
from kvtier.wire.overlap import TierOverlap
from kvtier.wire.protocol import StorageTier


def visible(o: TierOverlap, max_tier: StorageTier) -> TierOverlap:
    """The overlap as a router that sees only tiers up to ``max_tier`` would know it. O(1)."""
    d = o.device
    h = o.host if max_tier >= StorageTier.HOST else d
    k = o.disk if max_tier >= StorageTier.DISK else h
    e = o.external if max_tier >= StorageTier.EXTERNAL else k
    return TierOverlap(d, h, k, e)


class CostModel(Protocol):
    """Routing cost of sending a request of ``num_tokens`` tokens to one worker.

    ``shared_blocks``: leading prompt blocks that requests in flight on that worker already hold, so
    routing there adds only the rest to its active KV. ``output_tokens``: the output the request is
    expected to generate (:attr:`kvtier.indexer.routing.load.LoadTracker.expected_output`; 0 while unknown).
    """

    def cost(self, num_tokens: int, block_size: int, overlap: TierOverlap, load: WorkerLoad,
             shared_blocks: int = 0, output_tokens: float = 0.0) -> float: ...


@dataclass(slots=True, frozen=True)
class TierCredits:
    """Credit per cached block by the tier it would be served from."""

    device: float = 1.0  # already in device memory
    host: float = 0.75  # one host->device copy away
    disk: float = 0.25  # a storage read and a copy away
    external: float = 0.25  # a fetch from the shared pool away

    def credited_blocks(self, o: TierOverlap) -> float:
        """Blocks' worth of prefill saved. O(1)."""
        return (o.device * self.device + (o.host - o.device) * self.host
                + (o.disk - o.host) * self.disk + (o.external - o.disk) * self.external)

    def visible_credit(self, o: TierOverlap, max_tier: StorageTier) -> float:
        """``credited_blocks(visible(o, max_tier))``, the same float, without building the visible overlap.
        O(1)."""
        return self.visible_credits((o,), max_tier)[0]

    def visible_credits(self, overlaps: Sequence[TierOverlap], max_tier: StorageTier) -> list[float]:
        """:meth:`visible_credit` of each overlap (routing asks it of every worker on every request). Tiers past
        ``max_tier`` get a credit of 0 here, where :func:`visible` moves their levels down to the last tier seen:
        either way each of their terms is 0.0, and ``x + 0.0`` is ``x``, so the floats are the same. O(overlaps)."""
        cd = self.device
        ch = self.host if max_tier >= StorageTier.HOST else 0.0
        ck = self.disk if max_tier >= StorageTier.DISK else 0.0
        ce = self.external if max_tier >= StorageTier.EXTERNAL else 0.0
        return [o.device * cd + (o.host - o.device) * ch + (o.disk - o.host) * ck + (o.external - o.disk) * ce
                for o in overlaps]


@dataclass(slots=True, frozen=True)
class CreditCost:
    """Dynamo-style cost in blocks; see the module docstring."""

    credits: TierCredits = field(default_factory=TierCredits)  # per-tier credit
    overlap_weight: float = 1.0  # weight of prefill work against decode load
    max_tier: StorageTier = StorageTier.EXTERNAL  # tiers beyond this are ignored

    def cost(self, num_tokens: int, block_size: int, overlap: TierOverlap, load: WorkerLoad,
             shared_blocks: int = 0, output_tokens: float = 0.0) -> float:
        blocks = -(-num_tokens // block_size)
        prefill = blocks - self.credits.visible_credit(overlap, self.max_tier)
        queued = load.pending_prefill_tokens / block_size
        return self.overlap_weight * (prefill + queued) + load.active_blocks + blocks - shared_blocks

    def costs(self, num_tokens: int, block_size: int, overlaps: Sequence[TierOverlap], loads: Sequence[WorkerLoad],
              shared_blocks: Sequence[int], output_tokens: float = 0.0) -> list[float]:
        """:meth:`cost` of each worker (its overlap, load and shared blocks, in order), the same floats, in one call
        (routing prices every candidate on every request). O(workers)."""
        blocks = -(-num_tokens // block_size)
        credits, weight = self.credits.visible_credits(overlaps, self.max_tier), self.overlap_weight
        return [weight * ((blocks - credit) + load.pending_prefill_tokens / block_size)
                + load.active_blocks + blocks - shared
                for credit, load, shared in zip(credits, loads, shared_blocks, strict=True)]


@dataclass(slots=True, frozen=True)
class DynamoCost:
    """Dynamo's kv_router worker cost, rebuilt from its public documentation (Router Design and Routing
    Concepts pages, Dynamo 1.x); the code is kvtier's own. Term by term:

    * ``raw_prefill_blocks = active_prefill_blocks + incoming_prompt_blocks``: prompt-side work already
      routed to the worker and not yet prefilled (cleared when its first token comes back), plus the
      request's prompt, ``ceil(tokens / block_size)`` blocks (load.pending_prefill_tokens, in blocks).
    * ``adjusted_prefill_blocks = max(raw_prefill_blocks - overlap_credit_blocks, 0)``: cached blocks earn
      credit by tier: device 1.0, host 0.75, disk and shared pool 0.25 by default.
    * ``decode_blocks = active_decode_blocks + incoming_active_blocks``: KV blocks of in-flight requests on
      the worker, a prefix they share counted once, plus the request's blocks not already among them.
      Output tokens are not tracked (Dynamo's default), so generated blocks are left out.
    * ``cost = prefill_load_scale * adjusted_prefill_blocks + decode_blocks``; the lowest cost wins, ties
      are broken at random, and a temperature > 0 samples a softmax over the costs (the Router does both).

    Disaggregated (:mod:`kvtier.indexer.routing.disagg`), Dynamo's prefill router leaves decode blocks out
    (``router_track_active_blocks`` off: ``decode_scale`` 0) and its decode router prefill blocks
    (``overlap_score_weight`` 0: ``prefill_load_scale`` 0).
    """

    credits: TierCredits = field(default_factory=TierCredits)  # overlap credit per tier
    prefill_load_scale: float = 1.0  # weight of prefill blocks against decode blocks (overlap_score_weight)
    max_tier: StorageTier = StorageTier.EXTERNAL  # tiers the router receives events for
    decode_scale: float = 1.0  # weight of decode blocks (0: a disaggregated prefill router's)

    def cost(self, num_tokens: int, block_size: int, overlap: TierOverlap, load: WorkerLoad,
             shared_blocks: int = 0, output_tokens: float = 0.0) -> float:
        incoming = -(-num_tokens // block_size)
        raw_prefill = load.pending_prefill_tokens / block_size + incoming
        adjusted = max(raw_prefill - self.credits.visible_credit(overlap, self.max_tier), 0.0)
        decode = (load.active_blocks - load.generated_blocks) + incoming - shared_blocks
        return self.prefill_load_scale * adjusted + self.decode_scale * decode

    def costs(self, num_tokens: int, block_size: int, overlaps: Sequence[TierOverlap], loads: Sequence[WorkerLoad],
              shared_blocks: Sequence[int], output_tokens: float = 0.0) -> list[float]:
        """:meth:`cost` of each worker, the same floats, in one call (as :meth:`CreditCost.costs`). O(workers)."""
        incoming = -(-num_tokens // block_size)
        credits, scale = self.credits.visible_credits(overlaps, self.max_tier), self.prefill_load_scale
        dscale = self.decode_scale
        return [scale * max((load.pending_prefill_tokens / block_size + incoming) - credit, 0.0)
                + dscale * ((load.active_blocks - load.generated_blocks) + incoming - shared)
                for credit, load, shared in zip(credits, loads, shared_blocks, strict=True)]


@dataclass(slots=True, frozen=True)
class TtftCost:
    """Estimated time to first token in ms, with the worker's decode load weighted; see the module docstring.

    The worker prefills first come, first served in chunks of ``prefill_budget`` tokens, so the
    request's first token comes after ``ceil((queued + uncached) / budget)`` iterations. Each costs
    ``prefill_ms(chunk)`` plus, while other requests decode, one decode step at the worker's decode
    utilisation (``context_tokens / capacity_tokens``: every in-flight request's prompt and output, a
    shared prefix once per request that reads it, as attention does). A worker whose in-flight KV (shared
    prefixes once), the output its requests are expected still to write, and this request with its
    expected output would pass ``memory_headroom`` of its capacity cannot admit it until others finish:
    that overflow is charged ``memory_wait_ms`` per unit of capacity. Without a capacity the decode and
    memory terms are left out.

    ``decode_weight`` counts each decode step that many times: the decode batch a worker carries is not
    paid once by this request's first token and gone, as a prefill backlog is. It slows every iteration on
    that worker for as long as the batch runs, so it is paid again by the later turns of the session, which
    come back where their context is cached, and by every request that queues behind this one. With
    ``decode_weight = 1`` the cost is the request's own TTFT estimate, which for a lone request on an idle
    worker equals the simulator's TTFT exactly (no decode step is involved there, so any weight does).
    """

    transfer: TransferModel  # load time per tier
    latency: LatencyModel = field(default_factory=MockerLatency)  # iteration times
    max_tier: StorageTier = StorageTier.EXTERNAL  # tiers beyond this are ignored
    prefill_budget: int = 8192  # chunked-prefill tokens per iteration, as the worker runs them
    capacity_tokens: int | None = None  # device KV per worker, tokens (None: no decode or memory term)
    # Share of device KV the projection may fill before the worker counts as full, once the router knows
    # the output engines reserve (``output_tokens`` > 0): below 1 for the prefixes engines keep locked and
    # the spread of output lengths around their mean.
    memory_headroom: float = 0.9
    # The same while no output length is known (no request has finished with one): the in-flight estimate
    # then misses the output room engines reserve, so the worker counts as full earlier.
    blind_headroom: float = 0.7
    # Cost of a full worker, per unit of projected overflow (of capacity): it holds the request until
    # running requests finish and free their KV, which takes seconds, not milliseconds.
    memory_wait_ms: float = 10_000.0
    # Weight of each decode step in the estimate (see above). Tried 1, 4 and 7 on the Mooncake trace and the
    # built-in chat and agentic traces: 7 was the only one that beat Dynamo's cost on
    # all of them (1 left agentic's median TTFT behind). Chosen, not derived.
    decode_weight: float = 7.0

    def prefill_queue_ms(self, tokens: int, decode_step_ms: float) -> float:
        """Iterations that prefill ``tokens`` in budget-sized chunks, each with a decode step. O(1)."""
        if tokens <= 0:
            return 0.0
        full, rest = divmod(tokens, self.prefill_budget)
        ms = full * (self.latency.prefill_ms(self.prefill_budget) + decode_step_ms)
        if rest:
            ms += self.latency.prefill_ms(rest) + decode_step_ms
        return ms

    def cost(self, num_tokens: int, block_size: int, overlap: TierOverlap, load: WorkerLoad,
             shared_blocks: int = 0, output_tokens: float = 0.0) -> float:
        o = visible(overlap, self.max_tier)
        t = self.transfer
        load_ms = (t.load_ms(StorageTier.HOST, (o.host - o.device) * block_size)
                   + t.load_ms(StorageTier.DISK, (o.disk - o.host) * block_size)
                   + t.load_ms(StorageTier.EXTERNAL, (o.external - o.disk) * block_size))
        uncached = max(0, num_tokens - o.external * block_size)
        step = 0.0
        full = 0.0
        if self.capacity_tokens:
            if load.running > load.prefilling:
                step = self.latency.decode_ms(load.context_tokens / self.capacity_tokens)
            projected = ((load.active_blocks - shared_blocks) * block_size + load.unwritten_tokens + num_tokens
                         + output_tokens)
            headroom = self.memory_headroom if output_tokens > 0 else self.blind_headroom
            full = max(0.0, projected / self.capacity_tokens - headroom) * self.memory_wait_ms
        return load_ms + self.prefill_queue_ms(load.pending_prefill_tokens + uncached,
                                               step * self.decode_weight) + full


#: What a worker that would miss the SLO costs on top of its shortfall: more than any estimate of a worker that meets
#: it, so that one meeting it always wins (ms).
SLO_MISS_MS = 1e9


@dataclass(slots=True, frozen=True)
class SloCost:
    """kvtier's goodput policy: the cheapest worker by ``base`` (:class:`TtftCost`, cache affinity priced in time)
    among those where the request is expected to meet its SLO, else the one it misses by least.

    Two estimates per worker, for this request: its time to first token (``base`` with each decode step counted
    once, the request's own wait) and its time per output token, the decode step at the context the worker would
    attend over midway through the request's decode (the in-flight requests' prompts and outputs so far, this
    prompt, and half of what it and they are expected still to write). A worker passing either bound
    (``ttft_ms``, ``tpot_ms``; None: not bounded) costs :data:`SLO_MISS_MS` times its worst ratio to the bound.
    Piling sessions where their prefixes are wins TTFT and loses every stream's TPOT there once the batch grows:
    this stops adding to a worker before its decode step passes the bound. Without a capacity the TPOT estimate is
    left out. Without bounds it routes exactly as ``base``.
    """

    base: TtftCost  # the cost among the workers meeting the SLO
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    # ``base`` with each decode step counted once: the request's own TTFT estimate (derived, made once)
    own: TtftCost = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "own", dataclasses.replace(self.base, decode_weight=1.0))

    @property
    def max_tier(self) -> StorageTier:
        return self.base.max_tier

    def estimates(self, num_tokens: int, block_size: int, overlap: TierOverlap, load: WorkerLoad,
                  shared_blocks: int = 0, output_tokens: float = 0.0) -> tuple[float, float]:
        """(TTFT, TPOT) the request is expected to see on a worker, ms; TPOT nan without a capacity. O(1)."""
        b = self.base
        ttft = self.own.cost(num_tokens, block_size, overlap, load, shared_blocks, output_tokens)
        if not b.capacity_tokens:
            return ttft, float("nan")
        # Over the request's decode the batch's context grows by half of what it and its neighbours still write.
        context = load.context_tokens + num_tokens + (load.unwritten_tokens + output_tokens) / 2
        return ttft, b.latency.decode_ms(context / b.capacity_tokens)

    def cost(self, num_tokens: int, block_size: int, overlap: TierOverlap, load: WorkerLoad,
             shared_blocks: int = 0, output_tokens: float = 0.0) -> float:
        base = self.base.cost(num_tokens, block_size, overlap, load, shared_blocks, output_tokens)
        if self.ttft_ms is None and self.tpot_ms is None:
            return base
        ttft, tpot = self.estimates(num_tokens, block_size, overlap, load, shared_blocks, output_tokens)
        worst = max(ttft / self.ttft_ms if self.ttft_ms else 0.0,
                    tpot / self.tpot_ms if self.tpot_ms and tpot == tpot else 0.0)
        return base if worst <= 1.0 else SLO_MISS_MS * worst
