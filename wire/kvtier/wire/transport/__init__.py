"""The ZMQ transport of the wire contract: publisher with a replay buffer and dumps, subscriber with per-stream
ordering, gap replay and resync. Imports pyzmq; the rest of :mod:`kvtier.wire` does not.

* :mod:`~kvtier.wire.transport.frames` -- the multipart frame layout (topic, seq, payload) and its checks;
* :mod:`~kvtier.wire.transport.addresses` -- endpoint address checks with one-line errors;
* :mod:`~kvtier.wire.transport.publisher` -- PUB socket, replay ROUTER, dumps (rate limited per peer);
* :mod:`~kvtier.wire.transport.subscriber` -- SUB sockets over many endpoints, delivering in order per stream;
* :mod:`~kvtier.wire.transport.stream`, :mod:`~kvtier.wire.transport.streamstate`,
  :mod:`~kvtier.wire.transport.seqhistory` -- per-stream sequence tracking: gaps, restarts, duplicates;
* :mod:`~kvtier.wire.transport.recovery`, :mod:`~kvtier.wire.transport.replayrequest`,
  :mod:`~kvtier.wire.transport.backoff` -- asking a publisher for a replay or a dump, and when to give up.
"""
