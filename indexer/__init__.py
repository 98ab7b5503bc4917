"""Router side of kvtier: the event protocol, its wire codec and transport, the tiered index,
cost models, the router, and the ``kvtier indexer`` service."""

from indexer.codec import DecodeError, WireFormat, decode_payload, encode_payload, medium_spelling
from indexer.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
from indexer.index import Outcome, TieredIndex, WorkerStats
from indexer.keys import BlockKey, block_keys, chain_keys
from indexer.latency import PRESETS, LatencyModel, MockerLatency, ModelPreset, TransferModel
from indexer.load import LoadTracker, WorkerLoad
from indexer.overlap import OverlapScores, TierOverlap
from indexer.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    StorageTier,
    UnknownMediumError,
    WorkerId,
    parse_medium,
)
from indexer.publisher import DumpProvider, Publisher
from indexer.router import RouteDecision, Router
from indexer.scoring import CostModel, CreditCost, TierCredits, TtftCost, visible
from indexer.service import IndexerService, ServiceConfig
from indexer.stream import (
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
    StreamTracker,
)
from indexer.subscriber import EndpointConfig, Subscriber

__all__ = [
    "DUMP_REQUEST",
    "END_SEQ",
    "PRESETS",
    "AllBlocksCleared",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "CostModel",
    "CreditCost",
    "DecodeError",
    "Delivery",
    "DumpProvider",
    "EndpointConfig",
    "EngineHash",
    "Event",
    "EventBatch",
    "GapDetected",
    "GapFilled",
    "IndexerService",
    "LatencyModel",
    "LoadTracker",
    "MalformedFrame",
    "MockerLatency",
    "ModelPreset",
    "Outcome",
    "OverlapScores",
    "Publisher",
    "PublisherRestarted",
    "Received",
    "ResyncDone",
    "ResyncNeeded",
    "ResyncStarted",
    "RouteDecision",
    "Router",
    "ServiceConfig",
    "StorageTier",
    "StreamId",
    "StreamStats",
    "StreamTracker",
    "Subscriber",
    "TierCredits",
    "TierOverlap",
    "TieredIndex",
    "TransferModel",
    "TtftCost",
    "UnknownMediumError",
    "WireFormat",
    "WorkerId",
    "WorkerLoad",
    "WorkerStats",
    "block_keys",
    "chain_keys",
    "decode_payload",
    "encode_payload",
    "medium_spelling",
    "pack_seq",
    "parse_medium",
    "unpack_seq",
    "visible",
]
