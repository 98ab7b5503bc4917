"""Codec properties: round trips in every format, leniency, and clear errors."""

from __future__ import annotations

import contextlib
import struct

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.wire import (
    WINDOW_KIND,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EventBatch,
    StorageTier,
    UnknownMediumError,
    WireFormat,
    decode_payload,
    encode_payload,
    is_window_event,
    medium_spelling,
    pack_tokens,
    parse_medium,
    unpack_tokens,
    window_group,
)

SPELLINGS = {
    StorageTier.DEVICE: ["GPU", "DEVICE"],
    StorageTier.HOST: ["CPU", "CPU_PINNED", "CPU_TIER1"],
    StorageTier.DISK: ["DISK", "STORAGE", "NVME", "CPU_TIER2"],
    StorageTier.EXTERNAL: ["EXTERNAL", "REMOTE", "SHARED", "NETWORK"],
}


@pytest.mark.parametrize("tier,spelling", [(t, s) for t, ss in SPELLINGS.items() for s in ss])
def test_every_medium_spelling_any_case(tier: StorageTier, spelling: str) -> None:
    for variant in (spelling, spelling.lower(), spelling.title()):
        assert parse_medium(variant) is tier


def test_missing_medium_is_device() -> None:
    assert parse_medium(None) is StorageTier.DEVICE
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}]])
    ev = decode_payload(payload).events[0]
    assert isinstance(ev, BlockRemoved) and ev.tier is StorageTier.DEVICE


def test_unknown_medium_names_the_spelling() -> None:
    with pytest.raises(UnknownMediumError, match="'TAPE'"):
        parse_medium("TAPE")


hashes = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.binary(min_size=1, max_size=32),
)
tiers = st.sampled_from(list(StorageTier))


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    bs = draw(st.integers(1, 8))
    n = draw(st.integers(1, 4))
    return BlockStored(
        block_hashes=draw(st.lists(hashes, min_size=n, max_size=n)),
        parent_block_hash=draw(st.none() | hashes),
        token_ids=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n * bs, max_size=n * bs)),
        block_size=bs,
        lora_id=draw(st.none() | st.integers(0, 100)),
        medium=medium_spelling(draw(tiers)),
        lora_name=draw(st.none() | st.text(max_size=8)),
        cache_salt=draw(st.none() | st.text(max_size=8)),
    )


events = st.one_of(
    stored(),
    st.builds(lambda h, t: BlockRemoved(block_hashes=h, medium=medium_spelling(t)),
              st.lists(hashes, min_size=1, max_size=4), tiers),
    st.just(AllBlocksCleared()),
)
batches = st.builds(
    lambda ts, evs, dp: EventBatch(ts=ts, events=evs, dp_rank=dp),
    st.floats(0, 1e10, allow_nan=False), st.lists(events, max_size=6), st.none() | st.integers(0, 7),
)


@given(batches)
def test_sglang_map_round_trip_is_exact(batch: EventBatch) -> None:
    assert decode_payload(encode_payload(batch)) == batch


@given(batches)
def test_array_round_trip_keeps_core_fields(batch: EventBatch) -> None:
    again = decode_payload(encode_payload(batch, WireFormat.SGLANG_ARRAY))
    for a, b in zip(batch.events, again.events, strict=True):
        if isinstance(a, BlockStored):
            # SGLang 0.5.17's array layout has no lora_name / cache_salt positions.
            assert isinstance(b, BlockStored)
            assert (a.block_hashes, a.parent_block_hash, a.token_ids, a.block_size, a.lora_id, a.tier) == (
                b.block_hashes, b.parent_block_hash, b.token_ids, b.block_size, b.lora_id, b.tier)
        else:
            assert a == b


@given(batches)
def test_vllm_round_trip_writes_unsigned(batch: EventBatch) -> None:
    again = decode_payload(encode_payload(batch, WireFormat.VLLM))
    for ev in again.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(not isinstance(h, int) or 0 <= h < 2**64 for h in ev.block_hashes)
        if isinstance(ev, BlockStored):
            p = ev.parent_block_hash
            assert not isinstance(p, int) or 0 <= p < 2**64


def test_a_chain_of_signed_hashes_published_as_vllm_grafts_whole() -> None:
    """vLLM's hashes are unsigned: a kvtier engine's (signed) chain encoded as vLLM must name each parent as it names
    the block, or every store under a hash with its top bit set arrives with a parent nobody stored."""
    from kvtier.indexer.index.tiered import Outcome, TieredIndex
    from kvtier.wire.notices import StreamId
    from kvtier.wire.protocol import WorkerId

    hashes = [-5, 9, -(2**63), 2**63 - 1, -1]
    events = [BlockStored(block_hashes=[h], parent_block_hash=hashes[i - 1] if i else None,
                          token_ids=[2 * i, 2 * i + 1], block_size=2, medium="GPU") for i, h in enumerate(hashes)]
    idx, w = TieredIndex(2), StreamId(WorkerId("w0"))
    got = decode_payload(encode_payload(EventBatch(ts=1.0, events=events), WireFormat.VLLM))
    assert [idx.apply(w, ev) for ev in got.events] == [Outcome.APPLIED] * len(hashes)
    assert idx.find_matches(list(range(2 * len(hashes)))).workers[w].device == len(hashes)


def test_unknown_fields_are_ignored_in_both_layouts() -> None:
    m = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
         "block_size": 2, "lora_id": None, "medium": "GPU", "group_idx": 3, "extra_keys": [[1]]}
    ev = decode_payload(msgspec.msgpack.encode([1.0, [m], 0])).events[0]
    assert isinstance(ev, BlockStored) and ev.block_hashes == [7]
    arr = ["BlockStored", [7], None, [1, 2], 2, None, "GPU", "lora", "salt", "future", 42]
    ev = decode_payload(msgspec.msgpack.encode([1.0, [arr], 0])).events[0]
    assert isinstance(ev, BlockStored) and ev.lora_name == "lora" and ev.cache_salt == "salt"
    # Past the medium, an array's positions are a later publisher's: what is not a name there is ignored (it
    # failed the whole batch, the events beside it too).
    for later in ([None, [["ad"]]], [7], [{"k": 1}, "salt"]):
        for packed in (False, True):
            batch = decode_payload(msgspec.msgpack.encode(
                [1.0, [["BlockStored", [7], None, [1, 2], 2, None, "GPU", *later], ["AllBlocksCleared"]], 3]),
                packed_tokens=packed)
            ev = batch.events[0]
            assert isinstance(ev, BlockStored) and ev.block_hashes == [7] and ev.lora_name is None
            assert ev.cache_salt == (later[1] if later[1:] and isinstance(later[1], str) else None)
            assert batch.events[1] == AllBlocksCleared() and batch.dp_rank == 3


def test_two_item_batch_has_no_dp_rank() -> None:
    batch = decode_payload(msgspec.msgpack.encode([2.5, [["AllBlocksCleared"]]]))
    assert batch.dp_rank is None and batch.events == [AllBlocksCleared()]


def test_uint64_and_bytes_hashes() -> None:
    big = 2**64 - 1
    m = {"type": "BlockRemoved", "block_hashes": [big, b"\x01" * 32], "medium": "cpu"}
    ev = decode_payload(msgspec.msgpack.encode([0.0, [m]])).events[0]
    assert isinstance(ev, BlockRemoved) and ev.block_hashes == [big, b"\x01" * 32]


@pytest.mark.parametrize("payload,fragment", [
    (b"\xc1\x00garbage", "not a KV event batch"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockMoved", "block_hashes": [1]}]]), "BlockMoved"),
    (msgspec.msgpack.encode([1.0, [["Teleported", [1]]]]), "not a KV event batch"),
    (msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])[:-3], "truncated"),
    (msgspec.msgpack.encode({"ts": 1.0}), "not a KV event batch"),
    (b"", "not a KV event batch"),
])
def test_malformed_payloads_raise_decode_error(payload: bytes, fragment: str) -> None:
    with pytest.raises(DecodeError, match=fragment):
        decode_payload(payload)


@given(st.binary(max_size=200))
def test_random_bytes_only_ever_raise_decode_error(data: bytes) -> None:
    with contextlib.suppress(DecodeError):  # any other exception fails the test
        decode_payload(data)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_packed_tokens_round_trip_as_uint32_little_endian(tokens: list[int]) -> None:
    packed = pack_tokens(tokens)
    assert packed == struct.pack(f"<{len(tokens)}I", *tokens)
    assert unpack_tokens(packed) == tokens
    assert pack_tokens(packed) is packed  # already packed: passed through


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["7"]])
def test_packing_a_bad_token_id_is_a_value_error(bad: list[object]) -> None:
    with pytest.raises(ValueError, match="token ids must be integers"):
        pack_tokens(bad)  # type: ignore[arg-type]


# --- window-KV events (kvtier's SWA extension, vLLM's hybrid cache-group fields) ----------------------------


class _SglangStored(msgspec.Struct, tag_field="type", tag="BlockStored"):
    """SGLang 0.5.23's BlockStored as its public kv_events.py declares it (a consumer that knows nothing else)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class _SglangRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class _SglangBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_SglangStored | _SglangRemoved]
    dp_rank: int | None = None


def _window_batch() -> EventBatch:
    return EventBatch(ts=1.0, events=[
        BlockStored(block_hashes=[-5, 7], parent_block_hash=3, token_ids=list(range(8)), block_size=4, medium="GPU",
                    **window_group(128)),
        BlockRemoved(block_hashes=[7], medium="CPU_PINNED", **window_group(128))],
        dp_rank=0)


@pytest.mark.parametrize("fmt", [WireFormat.SGLANG, WireFormat.VLLM])
def test_window_events_round_trip_in_map_layouts(fmt: WireFormat) -> None:
    back = decode_payload(encode_payload(_window_batch(), fmt))
    assert [is_window_event(e) for e in back.events] == [True, True]  # type: ignore[arg-type]
    stored, removed = back.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert (stored.group_idx, stored.kv_cache_spec_sliding_window, stored.token_ids) == (1, 128, list(range(8)))
    assert removed.kv_cache_spec_kind == WINDOW_KIND


def test_window_events_decode_in_a_consumer_that_ignores_the_fields() -> None:
    """The frame stays valid SGLang wire: a consumer with SGLang's own structs decodes it (unknown fields
    are ignored); one that filters cache groups by kind, as Dynamo's router does, drops these events."""
    raw = _window_batch()
    decoded = msgspec.msgpack.decode(encode_payload(raw), type=_SglangBatch)
    assert [type(e).__name__ for e in decoded.events] == ["_SglangStored", "_SglangRemoved"]
    as_maps = msgspec.msgpack.decode(encode_payload(raw))[1]
    assert [m["kv_cache_spec_kind"] for m in as_maps] == [WINDOW_KIND, WINDOW_KIND]


def test_window_events_are_left_out_of_the_array_layout() -> None:
    """SGLang 0.5.17's array layout has no field for them: a consumer would read a window removal as a device one."""
    batch = _window_batch()
    batch.events.append(BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4))
    back = decode_payload(encode_payload(batch, WireFormat.SGLANG_ARRAY))
    assert len(back.events) == 1 and not is_window_event(back.events[0])  # type: ignore[arg-type]
