"""``kvtier indexer``: the index and router as an HTTP service following engines over ZMQ.

* :mod:`~kvtier.indexer.service.app` -- :class:`IndexerService`: wires the event loop, the router and HTTP;
* :mod:`~kvtier.indexer.service.config` -- settings (command line or TOML) and engine endpoints;
* :mod:`~kvtier.indexer.service.eventloop` -- the thread that follows the engines and copies the index for a
  snapshot, which a helper thread encodes and writes;
* :mod:`~kvtier.indexer.service.persist` -- the snapshot file (the index, each stream's position, a checksum);
* :mod:`~kvtier.indexer.service.http`, :mod:`~kvtier.indexer.service.httplimits`,
  :mod:`~kvtier.indexer.service.requestbody`, :mod:`~kvtier.indexer.service.clients` -- the aiohttp front end,
  what it refuses to spend on a client, request bodies, and who may change state;
* :mod:`~kvtier.indexer.service.deadlines`, :mod:`~kvtier.indexer.service.predictions` -- routed requests'
  deadlines, and predicted against observed latency;
* :mod:`~kvtier.indexer.service.metrics`, :mod:`~kvtier.indexer.service.histogram`,
  :mod:`~kvtier.indexer.service.exposition` -- ``/metrics``;
* :mod:`~kvtier.indexer.service.fdlimit` -- the open-files limit, checked at start.

The only package of kvtier that imports aiohttp.
"""
