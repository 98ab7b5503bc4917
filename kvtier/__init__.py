"""kvtier: a reference toolkit for KV-cache-aware routing over tiered KV caches.

Subpackages, each importable on its own:

* :mod:`kvtier.wire` -- the event protocol, codec and ZMQ transport shared by both sides;
* :mod:`kvtier.engine` -- a tiered KV cache engine that publishes events (the producer);
* :mod:`kvtier.indexer` -- the router-side tiered index, cost models, router and service (the consumer);
* :mod:`kvtier.sim` -- a discrete-event simulator replaying traces through engines and router, and the CLI;
* :mod:`kvtier.fields` -- the domains of configuration fields, checked once with one-line errors.

This module imports none of them, so ``import kvtier`` is cheap.
"""

__version__ = "0.1.0"
