"""Every captured frame decodes to the documented events; our encoder reproduces them."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.hashing import chain as engine_chain
from kvtier.engine.hashing import event_hash, iter_chain
from kvtier.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    StorageTier,
    WireFormat,
    decode_payload,
    encode_payload,
    unpack_seq,
)
from kvtier.wire.transport.frames import END_SEQ
from tests.wire_vectors import FILES, Capture, load

NAMES = sorted(FILES)
EXPECTED_TIERS = {
    "store_chain_gpu": StorageTier.DEVICE,
    "store_multi_block_gpu": StorageTier.DEVICE,
    "store_host": StorageTier.HOST,
    "store_l3": StorageTier.DISK,
    "remove_gpu_leaf": StorageTier.DEVICE,
    "remove_host": StorageTier.HOST,
}


@pytest.fixture(params=NAMES)
def capture(request: pytest.FixtureRequest, shared_dir: Path) -> Capture:
    return load(shared_dir, request.param)


def _documented(raw: Any) -> dict[str, Any]:
    """Normalises a documented event (map or array form) to a field dict."""
    if isinstance(raw, dict):
        return raw
    tag = raw[0]
    if tag == "BlockStored":
        keys = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
    elif tag == "BlockRemoved":
        keys = ["block_hashes", "medium"]
    else:
        keys = []
    return {"type": tag, **dict(zip(keys, raw[1:], strict=True))}


def _assert_matches(ev: Event, doc: dict[str, Any]) -> None:
    if doc["type"] == "BlockStored":
        assert isinstance(ev, BlockStored)
        assert ev.block_hashes == doc["block_hashes"]
        assert ev.parent_block_hash == doc["parent_block_hash"]
        assert ev.token_ids == doc["token_ids"]
        assert ev.block_size == doc["block_size"]
        assert ev.lora_id == doc["lora_id"]
        assert ev.medium == doc["medium"]
        assert ev.lora_name == doc.get("lora_name")
    elif doc["type"] == "BlockRemoved":
        assert isinstance(ev, BlockRemoved)
        assert ev.block_hashes == doc["block_hashes"]
        assert ev.medium == doc["medium"]
    else:
        assert doc["type"] == "AllBlocksCleared"
        assert isinstance(ev, AllBlocksCleared)


def test_every_live_frame_decodes_to_documented_events(capture: Capture) -> None:
    assert len(capture.data["batches"]) == 7
    for seq, b in enumerate(capture.data["batches"]):
        topic, seq_frame, payload = capture.frames(b)
        assert topic == b"kv"
        assert unpack_seq(seq_frame) == seq
        batch = decode_payload(payload)
        ts, events, dp_rank = b["decoded"]
        assert batch.ts == ts
        assert batch.dp_rank == dp_rank == 3
        assert len(batch.events) == len(events)
        for ev, doc in zip(batch.events, events, strict=True):
            _assert_matches(ev, _documented(doc))
        if b["name"] in EXPECTED_TIERS:
            assert {e.tier for e in batch.events if not isinstance(e, AllBlocksCleared)} == {
                EXPECTED_TIERS[b["name"]]
            }


def test_block_chain_follows_sglang_hash_scheme(capture: Capture) -> None:
    """SHA-256(parent digest || tokens as uint32 LE); event hash = first 8 bytes (signed, or u64)."""
    d = capture.data
    ps, tokens = d["page_size"], d["tokens"]
    parent = b""
    for i, expected in enumerate(d["block_hashes"]):
        digest = hashlib.sha256(parent + struct.pack(f"<{ps}I", *tokens[i * ps:(i + 1) * ps])).digest()
        value = int.from_bytes(digest[:8], "big", signed=capture.fmt is not WireFormat.VLLM)
        assert value == expected, f"block {i} of {capture.name}"
        parent = digest
    # The engine's chain (tokens packed once per run, a trailing partial page ignored) is the same.
    n = len(d["block_hashes"])
    ours = engine_chain(b"", tokens[:n * ps + ps // 2], ps)
    assert len(ours) == n and all(a == b for a, b in zip(ours, iter_chain(b"", tokens[:n * ps], ps), strict=True))
    if capture.fmt is not WireFormat.VLLM:
        assert [event_hash(x) for x in ours] == d["block_hashes"]
    # The stored events chain the same hashes with correct parents.
    stored = [e for b in d["batches"] for e in decode_payload(capture.frames(b)[2]).events
              if isinstance(e, BlockStored) and e.tier is StorageTier.DEVICE]
    chain = [h for e in stored for h in e.block_hashes]
    assert chain == d["block_hashes"]
    assert [e.parent_block_hash for e in stored] == [None, *(chain[i - 1] for i in (1, 2))]


def test_reencoding_reproduces_or_redecodes(capture: Capture) -> None:
    for b in capture.data["batches"]:
        payload = capture.frames(b)[2]
        batch = decode_payload(payload)
        ours = encode_payload(batch, capture.fmt)
        assert decode_payload(ours) == batch
        if capture.fmt is not WireFormat.VLLM:
            # SGLang (map and array layouts) byte for byte; vLLM writes map16 headers, see test below.
            assert ours == payload, f"{capture.name}/{b['name']}"


def test_vllm_differs_only_in_map_header(shared_dir: Path) -> None:
    """vLLM's msgspec struct has >15 fields, so msgspec writes map16 (0xde 0x0008) even for 8 keys."""
    cap = load(shared_dir, "vllm-0.33.0")
    for b in cap.data["batches"]:
        payload = cap.frames(b)[2]
        ours = encode_payload(decode_payload(payload), WireFormat.VLLM)
        assert ours == payload.replace(b"\xde\x00\x08", b"\x88")


def test_default_encoding_is_sglang_map(shared_dir: Path) -> None:
    cap = load(shared_dir, "sglang-0.5.23")
    for b in cap.data["batches"]:
        payload = cap.frames(b)[2]
        assert encode_payload(decode_payload(payload)) == payload


def test_cross_format_translation_keeps_events(capture: Capture) -> None:
    for b in capture.data["batches"]:
        batch = decode_payload(capture.frames(b)[2])
        for fmt in WireFormat:
            again = decode_payload(encode_payload(batch, fmt))
            assert [type(e) for e in again.events] == [type(e) for e in batch.events]
            for e1, e2 in zip(batch.events, again.events, strict=True):
                if isinstance(e1, BlockStored | BlockRemoved):
                    assert isinstance(e2, BlockStored | BlockRemoved)
                    assert e1.tier == e2.tier
                    mask = (1 << 64) - 1
                    assert [h & mask for h in e1.block_hashes] == [  # type: ignore[operator]
                        h & mask for h in e2.block_hashes]  # type: ignore[operator]


def test_replay_vectors(capture: Capture) -> None:
    import base64

    req = [base64.b64decode(f) for f in capture.data["replay_request"]["frames_b64"]]
    assert req[0] == b"" and unpack_seq(req[1]) == 5
    resp = [[base64.b64decode(f) for f in fr] for fr in capture.data["replay_response"]]
    with_topic = capture.name != "sglang-0.5.17"
    for frames in resp:
        assert len(frames) == (4 if with_topic else 3)
        assert frames[0] == b""
    seqs = [fr[-2] for fr in resp]
    assert seqs[-1] == END_SEQ and resp[-1][-1] == b""
    assert [unpack_seq(s) for s in seqs[:-1]] == [5, 6]
    live = {unpack_seq(capture.frames(b)[1]): capture.frames(b)[2] for b in capture.data["batches"]}
    for frames in resp[:-1]:
        assert frames[-1] == live[unpack_seq(frames[-2])]


def test_the_publishers_replay_answer_is_the_captures(capture: Capture) -> None:
    """kvtier's publisher, given the captured batches, answers the captured replay request frame for frame as the
    captured publisher did: each batch with its topic (where that version sends one) and seq, then the end marker,
    whose topic frame is empty (it carried the topic)."""
    import base64

    import zmq

    from kvtier.wire import Publisher

    req = [base64.b64decode(f) for f in capture.data["replay_request"]["frames_b64"]]
    want = [[base64.b64decode(f) for f in fr] for fr in capture.data["replay_response"]]
    live = sorted((unpack_seq(capture.frames(b)[1]), capture.frames(b)) for b in capture.data["batches"])
    got: list[list[bytes]] = []
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", topic=live[0][1][0],
                   replay_with_topic=capture.name != "sglang-0.5.17") as pub:
        for seq, frames in live:
            assert pub.publish_payload(frames[2]) == seq
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            dealer.connect(pub.replay_endpoint or "")
            dealer.send_multipart(req)
            while not got or got[-1][-2] != END_SEQ:
                assert dealer.poll(5000), got
                got.append(dealer.recv_multipart())
        finally:
            dealer.close(0)
    assert got == want
