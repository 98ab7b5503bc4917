"""The wire contract between engines and routers: the event protocol, its msgpack codec for the SGLang
and vLLM encodings, the ZMQ frame layout, and the transport (publisher with replay, subscriber with
per-stream ordering, gap replay and resync).

Both sides build on this package; it imports neither :mod:`kvtier.engine` nor :mod:`kvtier.indexer`.
"""

from kvtier.wire.addresses import bind_address_error, connect_address_error
from kvtier.wire.codec import DecodeError, WireFormat, decode_payload, encode_payload, medium_spelling
from kvtier.wire.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
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
from kvtier.wire.publisher import DumpProvider, Publisher, ReplayStats
from kvtier.wire.stream import StreamTracker
from kvtier.wire.subscriber import EndpointConfig, Subscriber

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
