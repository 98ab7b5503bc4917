"""``POST /route`` for a disaggregated pool: the (prefill, decode) pair, booked on both pools.

The pair comes from :class:`kvtier.indexer.routing.disagg.PairRouter`. The prefill worker is booked until the
request's first token (its prompt is computed and handed over by then), the decode worker until it finishes; a
prompt that prefills on its decode worker (``local_prefill``) is booked there alone, prefill included.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.routing.disagg import PairRouter
from kvtier.indexer.routing.plugins import note_routed

if TYPE_CHECKING:
    from kvtier.indexer.service.app import IndexerService


def route_pair(svc: IndexerService, pair: PairRouter, rid: str, keys: list[BlockKey], tokens: int, owner: str,
               t0: float) -> dict[str, Any]:
    """Routes and books request ``rid`` on a pair; answers ``{"prefill": ..., "decode": ...}``, each as an aggregated
    pool's answer over its pool (overlaps of every worker, costs of the pool's, its ``recommended`` worker), every
    worker's ``role`` beside its flags. Caller holds the service's lock. O(blocks + workers)."""
    decision = pair.route_keys(keys, tokens)
    p, d = decision.prefill, decision.decode
    bs = svc.index.block_size
    if decision.local:
        o = d.overlaps.workers.get(d.worker)
        svc.decode_loads.add(rid, d.worker, keys, tokens, max(0, tokens - (o.device * bs if o else 0)))
    else:
        o = p.overlaps.workers.get(p.worker)
        svc.loads.add(rid, p.worker, keys, tokens, max(0, tokens - (o.external * bs if o else 0)))
        svc.decode_loads.add(rid, d.worker, keys, tokens, 0)
        svc.index.note_routed(p.worker, keys)
        note_routed(pair.prefill.policy, keys, tokens, p.worker)
    svc.index.note_routed(d.worker, keys)  # its KV lands there too
    note_routed(pair.decode.policy, keys, tokens, d.worker)
    svc._deadlines.book(rid, time.monotonic())
    svc.clients.book(rid, owner)
    out: dict[str, Any] = {"request_id": rid, "prefill": svc._answer(p), "decode": svc._answer(d),
                           "local_prefill": decision.local}
    for side in ("prefill", "decode"):
        for s in (p if side == "prefill" else d).overlaps.workers:
            out[side]["workers"][str(s)]["role"] = svc.index.role(s)
    out["worker"] = out["decode" if decision.local else "prefill"]["recommended"]
    svc.request_seconds["route"].observe(time.perf_counter() - t0)
    return out
