"""msgpack codec for KV event payloads, in the encodings real engines use.

Decoding accepts, without being told which:

* tagged **maps** (SGLang >= 0.5.18, vLLM): ``{"type": "BlockStored", ...}``;
* tagged **arrays** (SGLang 0.5.17): ``["BlockStored", hashes, parent, tokens, ...]``;
* int64, uint64 or ``bytes`` block hashes; unknown extra fields (ignored);
* a batch of two (``[ts, events]``) or three (``[ts, events, dp_rank]``) items.

Encoding writes one of the :class:`WireFormat` layouts. The SGLang 0.5.23 map
layout is the default and is byte-identical to what SGLang sends for the same
field values and ``ts`` (tests pin this against captured frames).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, cast

import msgspec

from kvtier.wire.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    EventBatch,
    PackedTokens,
    StorageTier,
    parse_medium,
)
from kvtier.wire.tokenarray import decode_tokens, encode_tokens, strip_tokens

_U64 = (1 << 64) - 1


class WireFormat(StrEnum):
    """Event encodings on the wire."""

    SGLANG = "sglang"  # SGLang 0.5.23: tagged maps, optional None fields omitted
    SGLANG_ARRAY = "sglang-array"  # SGLang 0.5.17: tagged arrays
    VLLM = "vllm"  # vLLM 0.33: tagged maps, lora_name always present, unsigned hashes


class DecodeError(ValueError):
    """A payload that is not a valid KV event batch; the message says what was wrong."""


# --- decoding: lenient structs, one family per event encoding -------------------------------


class _Stored(msgspec.Struct, gc=False):
    """BlockStored's fields common to both encodings, in wire order (lenient: all but the hashes optional)."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


class _Removed(msgspec.Struct, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = None


class _MapStored(_Stored, tag_field="type", tag="BlockStored"):
    # vLLM's; never in the array layout, whose trailing positions newer publishers may use otherwise.
    extra_keys: list[Any] | None = None
    # vLLM's hybrid-cache metadata (maps only, like extra_keys).
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapRemoved(_Removed, tag_field="type", tag="BlockRemoved"):
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    dp_rank: int | None = None


class _ArrStored(_Stored, array_like=True, tag="BlockStored"):
    # Positions past the medium: SGLang's later fields, or a later publisher's other ones: a name is read,
    # anything else ignored (_text), as unknown fields are.
    lora_name: Any = None
    cache_salt: Any = None


class _ArrRemoved(_Removed, array_like=True, tag="BlockRemoved"):
    pass


class _ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _ArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrStored | _ArrRemoved | _ArrCleared]
    dp_rank: int | None = None


# The same layouts with the token array kept as raw msgpack, for decode_payload(packed_tokens=True).
# A redefined field keeps its position, so the array layout is unchanged.
_NO_TOKENS = msgspec.Raw(b"\x90")


class _MapStoredRaw(_MapStored, tag_field="type", tag="BlockStored"):
    token_ids: msgspec.Raw = _NO_TOKENS  # type: ignore[assignment]


class _MapBatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapStoredRaw | _MapRemoved | _MapCleared]
    dp_rank: int | None = None


class _ArrStoredRaw(_ArrStored, array_like=True, tag="BlockStored"):
    token_ids: msgspec.Raw = _NO_TOKENS  # type: ignore[assignment]


class _ArrBatchRaw(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrStoredRaw | _ArrRemoved | _ArrCleared]
    dp_rank: int | None = None


_map_decoder = msgspec.msgpack.Decoder(_MapBatch)
_arr_decoder = msgspec.msgpack.Decoder(_ArrBatch)
_map_raw_decoder = msgspec.msgpack.Decoder(_MapBatchRaw)
_arr_raw_decoder = msgspec.msgpack.Decoder(_ArrBatchRaw)


def _tokens(raw: _Stored) -> list[int] | PackedTokens:
    t: Any = raw.token_ids
    return decode_tokens(t) if isinstance(t, msgspec.Raw) else cast(list[int], t)


def _text(value: object) -> str | None:
    """An array position that holds a name where it holds a string; None (ignored) where it holds anything else."""
    return value if isinstance(value, str) else None


def _to_event(raw: object, tokens: PackedTokens | None = None) -> Event:
    """The event of a decoded struct; ``tokens``: a BlockStored's token ids, where they were read beforehand
    (:func:`~kvtier.wire.tokenarray.strip_tokens`)."""
    if isinstance(raw, _MapStored):
        return BlockStored(
            block_hashes=raw.block_hashes, parent_block_hash=raw.parent_block_hash,
            token_ids=_tokens(raw) if tokens is None else tokens,
            block_size=raw.block_size, lora_id=raw.lora_id, medium=raw.medium, lora_name=raw.lora_name,
            cache_salt=raw.cache_salt, extra_keys=raw.extra_keys, group_idx=raw.group_idx,
            kv_cache_spec_kind=raw.kv_cache_spec_kind, kv_cache_spec_sliding_window=raw.kv_cache_spec_sliding_window)
    if isinstance(raw, _MapRemoved):
        return BlockRemoved(block_hashes=raw.block_hashes, medium=raw.medium, group_idx=raw.group_idx,
                            kv_cache_spec_kind=raw.kv_cache_spec_kind,
                            kv_cache_spec_sliding_window=raw.kv_cache_spec_sliding_window)
    if isinstance(raw, _Stored):
        return BlockStored(
            block_hashes=raw.block_hashes,
            parent_block_hash=raw.parent_block_hash,
            token_ids=_tokens(raw) if tokens is None else tokens,
            block_size=raw.block_size,
            lora_id=raw.lora_id,
            medium=raw.medium,
            lora_name=_text(raw.lora_name),
            cache_salt=_text(raw.cache_salt),
        )
    if isinstance(raw, _Removed):
        return BlockRemoved(block_hashes=raw.block_hashes, medium=raw.medium)
    return AllBlocksCleared()


def decode_payload(payload: bytes | memoryview, *, packed_tokens: bool = False) -> EventBatch:
    """Decode one msgpack payload into an :class:`EventBatch`. O(payload size).

    Tries the map encoding first (what current engines send), then the array
    encoding. Raises :class:`DecodeError` naming what was wrong with the payload;
    never any other exception. ``packed_tokens``: each BlockStored's ``token_ids`` comes as
    :data:`~kvtier.wire.protocol.PackedTokens` (what the index hashes; it decodes without a Python int per
    token), or as a list where an id is outside ``[0, 2**32)`` (for the index to reject).
    """
    if packed_tokens:
        stripped = strip_tokens(payload)
        if stripped is not None:
            try:
                return _decode(stripped[0], _map_raw_decoder, _arr_raw_decoder, stripped[1])
            except DecodeError:
                pass  # the error is reported as the whole payload gives it, below
        return _decode(payload, _map_raw_decoder, _arr_raw_decoder, None)
    return _decode(payload, _map_decoder, _arr_decoder, None)


def _decode(payload: bytes | memoryview, maps: msgspec.msgpack.Decoder[Any], arrays: msgspec.msgpack.Decoder[Any],
            tokens: list[PackedTokens | None] | None) -> EventBatch:
    """:func:`decode_payload` with these decoders; ``tokens``: per event, token ids read beforehand (or None)."""
    try:
        batch: Any
        try:
            batch = maps.decode(payload)
        except msgspec.DecodeError as map_err:
            try:
                batch = arrays.decode(payload)
            except msgspec.DecodeError:
                raise DecodeError(f"not a KV event batch: {map_err}") from None
        if tokens is None:
            events = [_to_event(e) for e in batch.events]
        else:
            assert len(tokens) == len(batch.events), "the stripped batch has other events than the payload"
            events = [_to_event(e, t) for e, t in zip(batch.events, tokens, strict=True)]
        return EventBatch(ts=batch.ts, events=events, dp_rank=batch.dp_rank)
    except (DecodeError, AssertionError):
        raise
    except msgspec.DecodeError as exc:  # a raw token array that is not an array of ints
        raise DecodeError(f"not a KV event batch: token_ids: {exc}") from None
    except Exception as exc:  # msgspec raises only DecodeError, but a codec must never leak others
        raise DecodeError(f"not a KV event batch: {type(exc).__name__}: {exc}") from None


# --- encoding: exact field layouts of each publisher -----------------------------------------


class _SgStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int] | msgspec.Raw  # Raw: written from packed tokens (see _wire_tokens)
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None  # SGLang omits None-valued optional fields
    cache_salt: str | None = None


class _SgRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: list[EngineHash]
    medium: str | None


class _VlStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int] | msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None  # vLLM always sends it
    extra_keys: list[Any] | None = None  # vLLM omits it when None


class _WindowStored(_SgStored):
    """A window-KV BlockStored (see kvtier.wire.protocol.WINDOW_KIND): the publisher's own fields, then the
    hybrid-cache fields vLLM names them with."""

    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _WindowRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


#: Canonical medium spelling per wire format and tier.
_SPELLING: dict[WireFormat, dict[StorageTier, str]] = {
    WireFormat.SGLANG: {
        StorageTier.DEVICE: "GPU",
        StorageTier.HOST: "CPU_PINNED",
        StorageTier.DISK: "DISK",
        StorageTier.EXTERNAL: "EXTERNAL",
    },
    WireFormat.VLLM: {
        StorageTier.DEVICE: "GPU",
        StorageTier.HOST: "CPU",
        StorageTier.DISK: "STORAGE",
        StorageTier.EXTERNAL: "EXTERNAL",
    },
}
_SPELLING[WireFormat.SGLANG_ARRAY] = _SPELLING[WireFormat.SGLANG]


def medium_spelling(tier: StorageTier, fmt: WireFormat = WireFormat.SGLANG) -> str:
    """The medium string ``fmt``'s publisher uses for ``tier``. O(1)."""
    return _SPELLING[fmt][tier]


def _unsigned(h: EngineHash | None) -> EngineHash | None:
    return h & _U64 if isinstance(h, int) else h


def _wire_tokens(ev: BlockStored) -> list[int] | msgspec.Raw:
    """``ev``'s token ids as written: a list as is, packed tokens as the same msgpack array, pre-encoded."""
    t = ev.token_ids
    return msgspec.Raw(encode_tokens(t)) if isinstance(t, bytes) else t


def _encode_window(ev: BlockStored | BlockRemoved, fmt: WireFormat) -> object:
    medium = medium_spelling(parse_medium(ev.medium), fmt)
    vllm = fmt is WireFormat.VLLM
    hashes = [_unsigned(h) for h in ev.block_hashes] if vllm else ev.block_hashes
    meta = (ev.group_idx, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
    if isinstance(ev, BlockStored):
        parent = _unsigned(ev.parent_block_hash) if vllm else ev.parent_block_hash
        return _WindowStored(hashes, parent, _wire_tokens(ev), ev.block_size,  # type: ignore[arg-type]
                             ev.lora_id, medium, ev.lora_name, ev.cache_salt, *meta)
    return _WindowRemoved(hashes, medium, *meta)  # type: ignore[arg-type]


def _vllm_extra_keys(ev: BlockStored) -> list[Any] | None:
    """vLLM's per-block extra keys for ``ev``: its own, where it has them (decoded from vLLM); else, for a salted
    store that starts a chain (no parent), the salt in block 0's, after the LoRA name every block then carries, as
    vLLM orders them. A later store's salt is not vLLM's to send (its hashes carry it, and the router keeps the
    parent's key space). O(blocks)."""
    if ev.extra_keys is not None or ev.cache_salt is None or ev.parent_block_hash is not None:
        return ev.extra_keys
    lora = [ev.lora_name] if ev.lora_name else []
    return [[*lora, ev.cache_salt], *([*lora] if lora else None for _ in ev.block_hashes[1:])]


def _encode_event(ev: Event, fmt: WireFormat) -> object | None:
    if isinstance(ev, BlockStored | BlockRemoved) and ev.kv_cache_spec_kind is not None:
        # The array layout has no field for it: a consumer of that layout would read a window removal as a
        # full-attention one, so such events are left out of it.
        return None if fmt is WireFormat.SGLANG_ARRAY else _encode_window(ev, fmt)
    if isinstance(ev, BlockStored):
        medium = medium_spelling(parse_medium(ev.medium), fmt)
        if fmt is WireFormat.SGLANG:
            return _SgStored(ev.block_hashes, ev.parent_block_hash, _wire_tokens(ev), ev.block_size,
                             ev.lora_id, medium, ev.lora_name, ev.cache_salt)
        if fmt is WireFormat.VLLM:
            return _VlStored([_unsigned(h) for h in ev.block_hashes],  # type: ignore[misc]
                             _unsigned(ev.parent_block_hash), _wire_tokens(ev), ev.block_size,
                             ev.lora_id, medium, ev.lora_name, _vllm_extra_keys(ev))
        return ["BlockStored", ev.block_hashes, ev.parent_block_hash, _wire_tokens(ev), ev.block_size,
                ev.lora_id, medium]
    if isinstance(ev, BlockRemoved):
        medium = medium_spelling(parse_medium(ev.medium), fmt)
        if fmt is WireFormat.SGLANG_ARRAY:
            return ["BlockRemoved", ev.block_hashes, medium]
        hashes = [_unsigned(h) for h in ev.block_hashes] if fmt is WireFormat.VLLM else ev.block_hashes
        return _SgRemoved(hashes, medium)  # type: ignore[arg-type]
    if fmt is WireFormat.SGLANG_ARRAY:
        return ["AllBlocksCleared"]
    return _MapCleared()


_encoder = msgspec.msgpack.Encoder()


def encode_payload(batch: EventBatch, fmt: WireFormat = WireFormat.SGLANG) -> bytes:
    """Encode ``batch`` as ``fmt``'s publisher would. O(batch size).

    Medium strings are re-spelled in ``fmt``'s canonical spelling (a vLLM ``CPU``
    becomes SGLang ``CPU_PINNED``); vLLM hashes are written unsigned, and a cache salt goes in vLLM's extra keys
    (:func:`_vllm_extra_keys`). The array layout (SGLang 0.5.17) has no field for a LoRA name or a salt: they are
    not written there. Events carrying vLLM's hybrid-cache fields (window KV) keep them in the map layouts and are
    left out of the array layout.
    Raises :class:`indexer.protocol.UnknownMediumError` for an unknown medium.
    """
    events = [e for e in (_encode_event(ev, fmt) for ev in batch.events) if e is not None]
    return _encoder.encode([float(batch.ts), events, batch.dp_rank])
