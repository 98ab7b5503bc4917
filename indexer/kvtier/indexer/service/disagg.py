"""``POST /route`` for a disaggregated pool: the (prefill, decode) pair, booked on both pools.

The pair comes from :class:`kvtier.indexer.routing.disagg.PairRouter`. The prefill worker is booked until the
request's first token (its prompt is computed and handed over by then), the decode worker until it finishes; a
prompt that prefills on its decode worker (``local_prefill``) is booked there alone, prefill included.

What it predicts for the pair (:func:`predict_pair`), before booking: the TTFT is the prefill worker's (its queue,
tier loads and the prompt's uncached part, as an aggregated pool's worker is predicted), plus the KV the decode
worker lacks moved over the KV link, plus the decode worker's first step, which makes the first token; the TPOT is
the decode worker's (its batch midway through the request's decode). A local prefill is predicted on its decode
worker alone, as an aggregated worker.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.routing.disagg import KvLinkCost, PairDecision, PairRouter
from kvtier.indexer.routing.plugins import note_routed
from kvtier.indexer.routing.scoring import CostModel, SloCost
from kvtier.indexer.service.requestbody import SloBody
from kvtier.wire.overlap import TierOverlap

if TYPE_CHECKING:
    from kvtier.indexer.service.app import IndexerService

_NONE = TierOverlap(0, 0, 0, 0)


def predict_pair(svc: IndexerService, pair: PairRouter, decision: PairDecision, keys: list[BlockKey],
                 tokens: int) -> tuple[float, float]:
    """Predicted (TTFT, TPOT) in ms of a request on its pair (see the module docstring), before it is booked, each
    worker's load as its pool's router reads it; TPOT nan without a configured capacity. Caller holds the service's
    lock. O(blocks)."""
    bs = svc.index.block_size
    d = decision.decode
    (dload,), (dshared,) = pair.decode.loads.loads_and_shared([d.worker], keys)
    held = d.overlaps.workers.get(d.worker, _NONE)  # (a load-based decode side reads no overlap)
    ttft, tpot = svc._decode_predictor.estimates(tokens, bs, held, dload, dshared, pair.decode.loads.expected_output)
    if decision.local:
        return ttft, tpot
    p = decision.prefill
    (pload,), (pshared,) = pair.prefill.loads.loads_and_shared([p.worker], keys)
    ttft, _ = svc._predictor.estimates(tokens, bs, p.overlaps.workers.get(p.worker, _NONE), pload, pshared)
    link = svc.kv_link
    return ttft + link.lacking_ms(tokens, bs, held, dshared) + link.step_ms(dload, tokens), tpot


def _request_costs(pair: PairRouter, slo: SloBody | None) -> tuple[CostModel | None, CostModel | None]:
    """The pair's costs for a request that states ``slo``: the goodput policy's prefill side told its TTFT bound, its
    decode side its TPOT bound; (None, None) for other policies or without an SLO (the routers' own)."""
    pre, dec = pair.prefill.cost_model, pair.decode.cost_model
    if slo is None or not isinstance(pre, SloCost):
        return None, None
    return (dataclasses.replace(pre, ttft_ms=slo.ttft_ms),
            dec.with_slo(slo.tpot_ms) if isinstance(dec, KvLinkCost) else None)


def route_pair(svc: IndexerService, pair: PairRouter, rid: str, keys: list[BlockKey], tokens: int, slo: SloBody | None,
               owner: str, t0: float) -> tuple[dict[str, Any], float, float]:
    """Routes and books request ``rid`` on a pair; answers ``{"prefill": ..., "decode": ...}``, each as an aggregated
    pool's answer over its pool (overlaps of every worker, costs of the pool's, its ``recommended`` worker), every
    worker's ``role`` beside its flags, with the predicted TTFT and TPOT in ms (:func:`predict_pair`), which
    :attr:`~kvtier.indexer.service.app.IndexerService.predictions` holds until the reports come. Caller holds the
    service's lock. O(blocks + workers)."""
    decision = pair.route_keys(keys, tokens, *_request_costs(pair, slo))
    p, d = decision.prefill, decision.decode
    bs = svc.index.block_size
    ttft_ms, tpot_ms = predict_pair(svc, pair, decision, keys, tokens)
    # Routing-history policies learn it first, as a hook may fail (PluginError), and then nothing is booked.
    if not decision.local:
        note_routed(pair.prefill.policy, keys, tokens, p.worker)
    note_routed(pair.decode.policy, keys, tokens, d.worker)  # its KV lands there too
    svc.predictions.routed(rid, svc._deadlines.clock(), ttft_ms, tpot_ms)
    if decision.local:
        o = d.overlaps.workers.get(d.worker)
        svc.decode_loads.add(rid, d.worker, keys, tokens, max(0, tokens - (o.device * bs if o else 0)))
    else:
        o = p.overlaps.workers.get(p.worker)
        svc.loads.add(rid, p.worker, keys, tokens, max(0, tokens - (o.external * bs if o else 0)))
        svc.decode_loads.add(rid, d.worker, keys, tokens, 0)
        svc.index.note_routed(p.worker, keys)
    svc.index.note_routed(d.worker, keys)  # its KV lands there too
    svc._deadlines.book(rid, svc._deadlines.clock())
    svc.clients.book(rid, owner, len(keys))
    out = {"request_id": rid, **pair_answer(svc, decision)}
    svc.request_seconds["route"].observe(time.perf_counter() - t0)
    return out, ttft_ms, tpot_ms


def pair_answer(svc: IndexerService, decision: PairDecision) -> dict[str, Any]:
    """``{"prefill": ..., "decode": ..., "local_prefill": ..., "worker": ...}``: each side as an aggregated pool's
    answer over its pool, every worker's ``role`` beside its flags; ``worker`` the one the request goes to first
    (its decode worker for a local prefill). Caller holds the service's lock. O(workers)."""
    p, d = decision.prefill, decision.decode
    out: dict[str, Any] = {"prefill": svc._answer(p), "decode": svc._answer(d), "local_prefill": decision.local}
    for side, dec in (("prefill", p), ("decode", d)):
        for s in dec.overlaps.workers:
            out[side]["workers"][str(s)]["role"] = svc.index.role(s)
    out["worker"] = out["decode" if decision.local else "prefill"]["recommended"]
    return out
