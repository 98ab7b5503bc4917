"""vLLM's per-block extra keys (salt, LoRA, multimodal) map into the router's key space as vLLM
scopes its block hashes; SGLang's ``cache_salt`` lands in the same space."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.indexer.index.keys import block_keys, extra_digest, mm_block_extras, split_extra_keys
from kvtier.indexer.index.tiered import Outcome, TieredIndex
from kvtier.wire import BlockStored, EventBatch, StreamId, WireFormat, WorkerId, decode_payload, encode_payload

BS = 4
TOKS = list(range(100, 116))
V, S = StreamId(WorkerId("vllm")), StreamId(WorkerId("sglang"))


def vllm_store(hashes: list[int], tokens: list[int], extra: list[Any] | None, lora: str | None = None,
               parent: int | None = None) -> BlockStored:
    """Through vLLM's wire encoding and back, as the indexer receives it (tuples become lists)."""
    ev = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                     medium="GPU", lora_name=lora, extra_keys=extra)
    got = decode_payload(encode_payload(EventBatch(ts=1.0, events=[ev]), WireFormat.VLLM)).events[0]
    assert isinstance(got, BlockStored)
    return got


def depth(idx: TieredIndex, stream: StreamId, **kw: Any) -> int:
    return idx.find_matches(TOKS, **kw).workers[stream].device


def test_vllm_salt_in_extra_keys_scopes_the_chain_like_sglang_cache_salt() -> None:
    idx = TieredIndex(BS)
    # vLLM puts the salt only in the first block's extra keys; the chain carries it on.
    assert idx.apply(V, vllm_store([1, 2], TOKS[:8], [("tenant-a",), None])) is Outcome.APPLIED
    assert idx.apply(V, vllm_store([3], TOKS[8:12], None, parent=2)) is Outcome.APPLIED
    idx.apply(S, BlockStored(block_hashes=[11, 12, 13], token_ids=TOKS[:12], block_size=BS, cache_salt="tenant-a"))
    assert depth(idx, V) == 0 and depth(idx, V, cache_salt="tenant-b") == 0
    assert depth(idx, V, cache_salt="tenant-a") == 3
    assert depth(idx, S, cache_salt="tenant-a") == 3  # the same key space from either engine


def test_vllm_lora_name_in_extra_keys_is_the_namespace_and_salt_follows_it() -> None:
    idx = TieredIndex(BS)
    idx.apply(V, vllm_store([1, 2], TOKS[:8], [("adapter", "s"), ("adapter",)], lora="adapter"))
    assert depth(idx, V, lora_name="adapter", cache_salt="s") == 2
    assert depth(idx, V, lora_name="adapter") == 0 and depth(idx, V, cache_salt="s") == 0


def test_multimodal_items_scope_the_blocks_they_overlap() -> None:
    idx = TieredIndex(BS)
    # An image of 6 placeholder tokens at offset 2: blocks 0 and 1 carry it (offset relative to each
    # block start, as vLLM publishes), block 2 does not, but the chain carries it on.
    extras = [(("img-1", 2),), (("img-1", -2),), None]
    idx.apply(V, vllm_store([1, 2, 3], TOKS[:12], extras))
    assert depth(idx, V) == 0
    assert depth(idx, V, mm_items=[("img-1", 2, 6)]) == 3
    assert depth(idx, V, mm_items=[("img-2", 2, 6)]) == 0  # another image, same placeholder tokens
    assert depth(idx, V, mm_items=[("img-1", 3, 5)]) == 0  # the same image elsewhere
    assert mm_block_extras(12, BS, [("img-1", 2, 6)])[2] is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d" * 31, "e" * 32, "f" * 300, "g" * 70_000]),
                         st.integers(0, 40), st.integers(1, 20)), max_size=8),
       st.integers(0, 48))
def test_multimodal_extras_are_each_blocks_overlapping_items_in_offset_order(
        items: list[tuple[str, int, int]], num_tokens: int) -> None:
    """The sweep gives, per block, the items that overlap it (offset relative to the block's start) in offset
    order, ties in the order given: the definition, checked block by block over every item (identifiers of every
    msgpack string size, as a block inside one item hashes only its offset after the item's hashed prefix)."""
    got = mm_block_extras(num_tokens, BS, items)
    if not items:
        assert got is None
        return
    ordered = sorted(items, key=lambda m: m[1])
    assert got == [extra_digest([(i, off - b * BS) for i, off, n in ordered if off < (b + 1) * BS and off + n > b * BS])
                   for b in range(num_tokens // BS)]


def test_prompt_embedding_digests_scope_their_block() -> None:
    idx = TieredIndex(BS)
    idx.apply(V, vllm_store([1, 2], TOKS[:8], [None, (b"\x01" * 32,)]))
    assert depth(idx, V) == 1  # a router cannot know the embeddings: only block 0 matches


@pytest.mark.parametrize("extra,reason", [
    ([("a",), None, None], "3 extra_keys entries for 2 blocks"),
    ([None, ("late-salt",)], "salt scopes block 0 only"),
    ([(3.5,), None], "unrecognised item"),
    (["oops", None], "expected a list or null"),
])
def test_malformed_extra_keys_cost_one_event(extra: list[Any], reason: str) -> None:
    idx = TieredIndex(BS)
    ev = BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=BS, extra_keys=extra)
    assert idx.apply(V, ev) is Outcome.REJECTED and reason in (idx.stats(V).last_error or "")
    assert idx.apply(V, BlockStored(block_hashes=[1, 2], token_ids=TOKS[:8], block_size=BS)) is Outcome.APPLIED


def test_captured_vllm_frames_without_extra_keys_keep_their_keys() -> None:
    assert split_extra_keys(None, None) == (None, None)
    assert split_extra_keys([None, None], None) == (None, None)
    assert block_keys(TOKS, BS, mm_items=[]) == block_keys(TOKS, BS)


def test_orphan_with_extra_keys_grafts_in_its_scope() -> None:
    """An orphan's extra keys are read when it arrives and scope its blocks when it is grafted."""
    idx = TieredIndex(BS)
    assert idx.apply(V, vllm_store([2, 3], TOKS[4:12], [(("img-1", 0),), None], parent=1)) is Outcome.ORPHANED
    idx.apply(V, vllm_store([1], TOKS[:4], None))
    assert depth(idx, V, mm_items=[("img-1", 4, 4)]) == 3 and depth(idx, V) == 1


@pytest.mark.parametrize("lora", [None, "ad"])
def test_a_salted_store_encoded_as_vllm_keeps_its_key_space(lora: str | None) -> None:
    """vLLM carries a request's cache salt in its first block's extra keys (after the LoRA name, which every block
    carries): a salted store encoded in vLLM's format decodes into the same key space it was stored in; the salt
    is kept, or the blocks would be indexed as unsalted."""
    ev = BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=TOKS[:12], block_size=BS,
                     medium="GPU", lora_name=lora, cache_salt="s1")
    got = decode_payload(encode_payload(EventBatch(ts=1.0, events=[ev]), WireFormat.VLLM)).events[0]
    assert isinstance(got, BlockStored)
    assert got.extra_keys == [[*([lora] if lora else []), "s1"], *([[lora]] * 2 if lora else [None, None])]
    idx = TieredIndex(BS)
    assert idx.apply(V, got) is Outcome.APPLIED
    assert idx.find_matches(TOKS, lora_name=lora, cache_salt="s1").workers[V].device == 3
    assert idx.find_matches(TOKS, lora_name=lora).workers[V].device == 0
