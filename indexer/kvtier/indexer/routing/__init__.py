"""Routing: where a request should go, from the index's overlaps, the router's own load bookkeeping and a cost.

* :mod:`~kvtier.indexer.routing.policies` -- the one registry of policies (names, tiers heard, cost factory), used
  by the simulator, the service and plugins alike;
* :mod:`~kvtier.indexer.routing.scoring` -- cost models: tier credits, Dynamo's, predicted TTFT, SLO goodput;
* :mod:`~kvtier.indexer.routing.load` -- in-flight work per worker (routed, prefilling, decoding);
* :mod:`~kvtier.indexer.routing.router` -- :class:`Router`: overlaps + load + cost -> a worker;
* :mod:`~kvtier.indexer.routing.plugins` -- the policy protocol (filter, score, pick) and plugin loading;
* :mod:`~kvtier.indexer.routing.incumbents` -- SGLang Model Gateway's, llm-d's and power-of-two policies.

A route costs O(w) over the w workers once the index answered. Imports the index, :mod:`kvtier.hardware` and
below; never the service.
"""
