"""The KV event protocol: storage tiers, the three event types and the batch.

This is the contract between engines (producers) and the indexer (consumer), as
described in SPEC section 1. The classes here are the decoded, wire-independent
model; :mod:`indexer.codec` maps them to and from the SGLang and vLLM encodings.

Engine block hashes are opaque: SGLang sends signed int64, vLLM unsigned uint64,
newer engines raw ``bytes``. They are kept exactly as received, so equality is
the only operation the indexer relies on.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NewType, TypeAlias

import msgspec

#: An engine's own block hash: int64, uint64 or bytes, compared only for equality.
EngineHash: TypeAlias = int | bytes

#: Identifies one worker (one engine instance) in the cluster.
WorkerId = NewType("WorkerId", str)

#: Token ids packed as uint32 little-endian, ``TOKEN_BYTES`` a token: the form both block-hash schemes
#: digest (SPEC section 2), and the form an engine keeps cached prompts in (a list of ints costs about
#: 36 bytes a token, and comparing two pages is a ``memcmp`` here).
#: (An alias, not a NewType: every slice of it is one too.)
PackedTokens: TypeAlias = bytes
TOKEN_BYTES = 4
#: Tokens per KV block (an engine's page) where nothing says otherwise: the one default of the engine's page, the
#: simulator's and the indexer's block. A router must use its engines' own size (vLLM's default is 16, SGLang's
#: page size 1); the indexer reports workers whose stores come in another (``/health`` wrong_block_size_workers).
DEFAULT_BLOCK_SIZE = 64
#: What a worker serves: prefill, decode (a disaggregated pool), or both (aggregated, the default).
ROLES = ("prefill", "decode", "both")


def pack_tokens(tokens: Sequence[int] | PackedTokens) -> PackedTokens:
    """``tokens`` packed (returned as is if already ``bytes``); ``ValueError`` if an id is not a uint32.
    O(tokens)."""
    if isinstance(tokens, bytes):
        return tokens
    try:
        a = array("I", tokens)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_tokens(packed: bytes) -> list[int]:
    """The token ids of ``packed`` (see :data:`PackedTokens`). O(tokens)."""
    a = array("I", packed)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


class StorageTier(IntEnum):
    """Where a KV block lives. Ordered from fastest to slowest."""

    DEVICE = 0  # GPU HBM (L1)
    HOST = 1  # pinned CPU memory (L2)
    DISK = 2  # per-worker local storage (L3)
    EXTERNAL = 3  # storage pool shared by all workers (L3, e.g. Mooncake store)


#: Every medium spelling seen across engines (shared/wire/README.md), upper-cased.
_MEDIUM_TO_TIER: dict[str, StorageTier] = {
    "GPU": StorageTier.DEVICE,
    "DEVICE": StorageTier.DEVICE,
    "CPU": StorageTier.HOST,
    "CPU_PINNED": StorageTier.HOST,
    "CPU_TIER1": StorageTier.HOST,
    "DISK": StorageTier.DISK,
    "STORAGE": StorageTier.DISK,
    "NVME": StorageTier.DISK,
    "CPU_TIER2": StorageTier.DISK,
    "EXTERNAL": StorageTier.EXTERNAL,
    "REMOTE": StorageTier.EXTERNAL,
    "SHARED": StorageTier.EXTERNAL,
    "NETWORK": StorageTier.EXTERNAL,
}

# Exact-case cache in front of the case-insensitive table: the hot path sees a few spellings only.
_medium_cache: dict[str | None, StorageTier] = {None: StorageTier.DEVICE}


class UnknownMediumError(ValueError):
    """A medium string that names no known storage tier."""


def parse_medium(medium: str | None) -> StorageTier:
    """Map a wire medium string to its tier; ``None`` (absent) means device.

    Case-insensitive. O(1). Raises :class:`UnknownMediumError` naming the spelling.
    """
    tier = _medium_cache.get(medium)
    if tier is not None:
        return tier
    assert medium is not None
    tier = _MEDIUM_TO_TIER.get(medium.strip().upper())
    if tier is None:
        raise UnknownMediumError(
            f"unknown medium {medium!r}; expected one of {sorted(_MEDIUM_TO_TIER)} (any case)"
        )
    if len(_medium_cache) < 64:
        _medium_cache[medium] = tier
    return tier


class BlockStored(msgspec.Struct, kw_only=True, gc=False):
    """One or more consecutive blocks became resident on ``medium``.

    Invariant (checked by the indexer, not here): ``len(token_ids) ==
    len(block_hashes) * block_size``; ``block_hashes[0]``'s parent is
    ``parent_block_hash`` (``None`` under the root) and each further hash's parent
    is the previous one.
    """

    block_hashes: list[EngineHash]  # engine hashes, parent first
    parent_block_hash: EngineHash | None = None  # engine hash of the first block's parent
    #: block_size tokens per block, concatenated: a list, or packed (PackedTokens: kvtier's engines publish
    #: them so, and decode_payload(packed_tokens=True) gives them so); the wire carries the same ints.
    token_ids: list[int] | PackedTokens = []
    block_size: int = 0  # tokens per block
    lora_id: int | None = None  # engine-local LoRA adapter id
    medium: str | None = None  # wire spelling of the tier; None means device
    lora_name: str | None = None  # LoRA adapter name (vLLM); changes the router key space
    cache_salt: str | None = None  # per-tenant salt (SGLang); changes the router key space
    #: vLLM: per block, the untagged extra keys of its hash (LoRA name, (mm id, offset) pairs,
    #: cache salt, prompt-embedding digests); see kvtier.indexer.index.keys.split_extra_keys.
    extra_keys: list[Any] | None = None
    group_idx: int | None = None  # vLLM hybrid models: the KV cache group the blocks belong to
    kv_cache_spec_kind: str | None = None  # that group's kind; WINDOW_KIND: window KV only (see below)
    kv_cache_spec_sliding_window: int | None = None  # that group's window, tokens

    @property
    def tier(self) -> StorageTier:
        return parse_medium(self.medium)

    @property
    def num_tokens(self) -> int:
        """How many token ids ``token_ids`` holds (-1 for packed bytes of a length no token count
        gives). O(1)."""
        t = self.token_ids
        if isinstance(t, bytes):
            return len(t) // TOKEN_BYTES if len(t) % TOKEN_BYTES == 0 else -1
        return len(t)


class BlockRemoved(msgspec.Struct, kw_only=True, gc=False):
    """Blocks stopped being resident on ``medium`` (other tiers are unaffected)."""

    block_hashes: list[EngineHash]  # engine hashes of the removed blocks
    medium: str | None = None  # wire spelling of the tier; None means device
    group_idx: int | None = None  # as BlockStored's
    kv_cache_spec_kind: str | None = None  # as BlockStored's
    kv_cache_spec_sliding_window: int | None = None  # as BlockStored's

    @property
    def tier(self) -> StorageTier:
        return parse_medium(self.medium)


class AllBlocksCleared(msgspec.Struct, kw_only=True, gc=False):
    """The engine dropped every block on every tier (``reset()``)."""


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared

#: ``kv_cache_spec_kind`` of events about sliding-window KV only (vLLM's spelling for its sliding-window
#: cache groups). A kvtier SWA engine publishes its window KV this way: ``BlockStored`` when a page's window
#: KV is computed, loaded or backed up, ``BlockRemoved`` when it is dropped (a tombstone, SPEC section 3) or
#: its tier copy goes. The full-attention events are unchanged, so a consumer that filters cache groups by
#: kind, as Dynamo's router does, keeps its full-attention view (kvtier.indexer.window has the rest).
WINDOW_KIND = "sliding_window"
#: The group index kvtier engines give their window-KV events (the full-attention group is 0).
WINDOW_GROUP = 1


def window_group(window_tokens: int) -> dict[str, Any]:
    """The fields that make a ``BlockStored`` / ``BlockRemoved`` about window KV (keyword arguments). O(1)."""
    return {"group_idx": WINDOW_GROUP, "kv_cache_spec_kind": WINDOW_KIND,
            "kv_cache_spec_sliding_window": window_tokens}


def is_window_event(ev: BlockStored | BlockRemoved) -> bool:
    """True if ``ev`` is about sliding-window KV only (case-insensitive kind). O(1)."""
    kind = ev.kv_cache_spec_kind
    return kind is not None and kind.lower() == WINDOW_KIND


class EventBatch(msgspec.Struct, kw_only=True, gc=False):
    """The payload of one live message: ``[ts, [events...], dp_rank]``."""

    ts: float  # publisher wall clock, seconds
    events: list[Event]  # in the order the engine produced them
    dp_rank: int | None = None  # data-parallel rank of the publishing engine, if any
