"""The wire contract between engines and routers, at the bottom of kvtier.

* :mod:`~kvtier.wire.protocol` -- storage tiers, the three event types (stored, removed, all cleared), the batch;
* :mod:`~kvtier.wire.codec` -- msgpack encodings of SGLang and vLLM (and kvtier's extensions), decoded strictly;
* :mod:`~kvtier.wire.tokenarray` -- token-id arrays to and from packed tokens;
* :mod:`~kvtier.wire.notices` -- what a stream tracker hands its consumer (batches in order, gaps, restarts);
* :mod:`~kvtier.wire.overlap` -- results of prefix-overlap queries;
* :mod:`~kvtier.wire.pagehash` -- SGLang's page hash chain (page digests and the event hashes read off them);
* :mod:`kvtier.wire.transport` -- the ZMQ transport (sub-package): publisher, subscriber, recovery.

Decoding is O(payload) and a malformed payload raises :class:`DecodeError` with nothing applied. The contract
imports nothing above it (kernels and utilities only) and not its own transport; this facade loads the transport's
names (and pyzmq) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.util.lazy import lazy_exports
from kvtier.wire.codec import DecodeError, WireFormat, decode_payload, encode_payload, medium_spelling
from kvtier.wire.notices import (
    Delivery,
    GapDetected,
    GapFilled,
    MalformedFrame,
    PublisherRestarted,
    Received,
    ResyncDone,
    ResyncNeeded,
    ResyncStarted,
    StreamId,
    StreamStats,
)
from kvtier.wire.overlap import OverlapScores, TierOverlap
from kvtier.wire.protocol import (
    TOKEN_BYTES,
    WINDOW_GROUP,
    WINDOW_KIND,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    PackedTokens,
    StorageTier,
    UnknownMediumError,
    WorkerId,
    is_window_event,
    pack_tokens,
    parse_medium,
    unpack_tokens,
    window_group,
)

if TYPE_CHECKING:
    from kvtier.wire.transport.addresses import bind_address_error, connect_address_error
    from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
    from kvtier.wire.transport.publisher import DumpProvider, Publisher, ReplayStats
    from kvtier.wire.transport.stream import StreamTracker
    from kvtier.wire.transport.subscriber import EndpointConfig, Subscriber

__getattr__, __dir__ = lazy_exports(__name__, {
    "bind_address_error": "kvtier.wire.transport.addresses",
    "connect_address_error": "kvtier.wire.transport.addresses",
    "DUMP_REQUEST": "kvtier.wire.transport.frames",
    "END_SEQ": "kvtier.wire.transport.frames",
    "pack_seq": "kvtier.wire.transport.frames",
    "unpack_seq": "kvtier.wire.transport.frames",
    "DumpProvider": "kvtier.wire.transport.publisher",
    "Publisher": "kvtier.wire.transport.publisher",
    "ReplayStats": "kvtier.wire.transport.publisher",
    "StreamTracker": "kvtier.wire.transport.stream",
    "EndpointConfig": "kvtier.wire.transport.subscriber",
    "Subscriber": "kvtier.wire.transport.subscriber",
})

__all__ = [
    "DUMP_REQUEST",
    "END_SEQ",
    "TOKEN_BYTES",
    "WINDOW_GROUP",
    "WINDOW_KIND",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "Delivery",
    "DumpProvider",
    "EndpointConfig",
    "EngineHash",
    "Event",
    "EventBatch",
    "GapDetected",
    "GapFilled",
    "MalformedFrame",
    "OverlapScores",
    "PackedTokens",
    "Publisher",
    "PublisherRestarted",
    "Received",
    "ReplayStats",
    "ResyncDone",
    "ResyncNeeded",
    "ResyncStarted",
    "StorageTier",
    "StreamId",
    "StreamStats",
    "StreamTracker",
    "Subscriber",
    "TierOverlap",
    "UnknownMediumError",
    "WireFormat",
    "WorkerId",
    "bind_address_error",
    "connect_address_error",
    "decode_payload",
    "encode_payload",
    "is_window_event",
    "medium_spelling",
    "pack_seq",
    "pack_tokens",
    "parse_medium",
    "unpack_seq",
    "unpack_tokens",
    "window_group",
]
