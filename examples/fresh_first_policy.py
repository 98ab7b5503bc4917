"""An example routing-policy plugin for kvtier (see kvtier.indexer.routing.plugins).

"Fresh first": workers whose index lost events for good (partial) are skipped while any other can
take the request; among the rest, the cost is the prompt tokens left to compute (device hits free,
host hits at a quarter, disk at half) plus a penalty per request already running there.

    kvtier compare --policies round_robin,kv_all,examples/fresh_first_policy.py:FreshFirst
    kvtier indexer --endpoint w0=tcp://... --policy examples/fresh_first_policy.py:FreshFirst

Packaged plugins register an entry point instead, in their pyproject.toml:

    [project.entry-points."kvtier.policies"]
    fresh_first = "my_package.policies:FreshFirst"
"""

from __future__ import annotations

from kvtier.indexer.routing.plugins import PolicyBase, RouteContext
from kvtier.wire import StreamId


class FreshFirst(PolicyBase):
    name = "fresh_first"
    running_penalty_tokens = 512.0  # one running request costs as much as this many tokens to compute

    def filter(self, ctx: RouteContext, workers: list[StreamId]) -> list[StreamId]:
        fresh = [w for w in workers if w not in ctx.partial]
        return fresh or workers

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        o, bs = ctx.overlap(worker), ctx.block_size
        device, host, disk = o.device * bs, (o.host - o.device) * bs, (o.disk - o.host) * bs
        left = ctx.num_tokens - device - 0.75 * host - 0.5 * disk
        return left + self.running_penalty_tokens * ctx.load(worker).running
