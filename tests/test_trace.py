"""Trace loading, token derivation and generators."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from kvtier.sim import trace as trace_module
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.source import MooncakeFile
from kvtier.sim.trace import (
    HASH_BLOCK,
    VOCAB,
    Request,
    TokenBank,
    TraceError,
    load_azure,
    load_mooncake,
    prefix_reuse,
    write_mooncake,
)
from kvtier.wire import pack_tokens, unpack_tokens

from .jit_paths import python_path


def test_mooncake_trace_loads_and_matches_published_reuse(shared_dir: Path) -> None:
    reqs = load_mooncake(shared_dir / "traces" / "mooncake_conversation_trace.jsonl")
    assert len(reqs) == 12_031
    assert reqs[0].hash_ids[:3] == [0, 1, 2] and reqs[0].input_length == 6758
    assert abs(reqs[-1].arrival - 3537) < 1.0
    assert prefix_reuse(reqs, 16) == pytest.approx(0.374, abs=5e-4)  # traces/README.md


@pytest.mark.parametrize("line,fragment", [
    ("{not json", "not JSON"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1}', "missing field"),
    ('{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "expected ceil"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ('[1, 2]', "JSON object"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1], "request_id": [1]}',
     "request_id must be a string or an integer, got "),  # (was taken as the id "[1]")
    ('{"timestamp": "1\x01"}', "not JSON: Invalid control character at column 17"),  # (the message ended at "at")
])
def test_malformed_mooncake_line_is_named(tmp_path: Path, line: str, fragment: str) -> None:
    p = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    p.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{fragment}"):
        load_mooncake(p)


def test_an_id_a_record_without_one_would_get_is_named_as_such(tmp_path: Path) -> None:
    """Line 2 names no id (null, as none) and gets r1, which line 1 named: the message said line 2 used 'r1' as if it
    named it."""
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1], "request_id": "r1"}\n'
                 '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1], "request_id": null}\n')
    with pytest.raises(TraceError, match=r":2: no request_id, and the one a record without one gets, 'r1' \(r<its "
                                         r"index>\), is line 1's"):
        load_mooncake(p)


def test_backwards_timestamp_is_named(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                 '{"timestamp": 4, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=":2: timestamp goes backwards"):
        load_mooncake(p)


def test_a_byte_order_mark_before_the_first_line_is_skipped(tmp_path: Path) -> None:
    """Spreadsheets and some editors write one when saving UTF-8; the first record (a CSV's header) must not carry
    it into its first field, and a streamed replay, which seeks to each line, must read line 1 the same."""
    bom = "\ufeff"
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(bom + '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}\n'
                     '{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": [8]}\n', encoding="utf-8")
    assert [r.hash_ids for r in load_mooncake(jsonl)] == [[7], [8]]
    assert [r.hash_ids for r in MooncakeFile(jsonl)] == [[7], [8]]
    csv = tmp_path / "t.csv"
    csv.write_text(bom + "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,3\n", encoding="utf-8")
    assert [(r.input_length, r.output_length) for r in load_azure(csv)] == [(12, 3)]


def test_azure_csv_lengths_and_synthesised_sharing(shared_dir: Path, tmp_path: Path) -> None:
    reqs = load_azure(shared_dir / "traces" / "azure_llm_2023_conv.csv", limit=500)
    assert len(reqs) == 500 and reqs[0].input_length == 374 and reqs[0].output_length == 44
    assert prefix_reuse(reqs, 16) == 0.0  # no sharing unless asked
    shared = load_azure(shared_dir / "traces" / "azure_llm_2023_code.csv", share_prefix_blocks=2, groups=4,
                        limit=500)
    assert prefix_reuse(shared, 16) > 0.1
    assert all(len(r.hash_ids) == -(-r.input_length // HASH_BLOCK) for r in shared)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,3\n2023-11-16 18:15:47,x,1\n")
    with pytest.raises(TraceError, match=r"bad\.csv:3"):
        load_azure(bad)


def test_tokens_are_deterministic_and_partial_blocks_are_prefixes() -> None:
    bank = TokenBank(seed=3)
    a = Request("a", 0, 700, 1, [5, 9])
    b = Request("b", 0, 1024, 1, [5, 9])
    ta, tb = bank.tokens(a), TokenBank(seed=3).tokens(b)
    assert len(ta) == 700 and len(tb) == 1024
    assert tb[:700] == ta
    assert bank.tokens(Request("c", 0, 512, 1, [6])) != ta[:512]


def test_token_ids_are_in_the_vocabulary_distinct_per_hash_id_and_packed_alike() -> None:
    bank = TokenBank(seed=0)
    ids = list(range(20_000)) + [2**63, 2**64 - 1]  # Mooncake ids are small; any uint64 must work
    blocks = [bank.block(h) for h in ids]
    assert all(b.min() >= 0 and b.max() < VOCAB and len(b) == HASH_BLOCK for b in blocks)
    assert len({b[:64].tobytes() for b in blocks}) == len(ids), "two hash ids share their first page"
    assert TokenBank(seed=1).block(7).tolist() != bank.block(7).tolist(), "the seed changes the tokens"
    req = Request("r", 0, 1000, 1, [3, 11])
    assert bank.packed(req) == pack_tokens(bank.tokens(req))
    assert unpack_tokens(bank.packed(req)) == bank.tokens(req)


@pytest.mark.parametrize("kind", sorted(PRESETS))
def test_generators_are_seeded_and_valid(kind: str, tmp_path: Path) -> None:

    spec = dataclasses.replace(PRESETS[kind], requests=200)
    a, b = generate(spec, 7), generate(spec, 7)
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    assert generate(spec, 8)[5].to_json() != a[5].to_json()
    assert all(a[i].arrival <= a[i + 1].arrival for i in range(len(a) - 1))
    p = tmp_path / "g.jsonl"
    write_mooncake(a, p)
    again = load_mooncake(p)
    assert [r.hash_ids for r in again] == [r.hash_ids for r in a]
    assert prefix_reuse(a, 64) > 0.3


def test_token_derivation_is_pinned() -> None:
    # scripts/test.sh runs this module a second time with KVTIER_JIT=0: the values hold on both paths
    bank = TokenBank(seed=0)
    assert bank.block(7)[:3].tolist() == [89050, 93385, 94898]
    assert bank.block(2**64 - 1)[-2:].tolist() == [70089, 108456]
    assert TokenBank(seed=5).block(0)[510:].tolist() == [73514, 119508]


def test_compiled_token_derivation_agrees_with_the_numpy_path() -> None:
    bank = TokenBank(seed=0)
    kernels = trace_module._KERNELS.get()
    if kernels is None:
        pytest.skip(f"compiled path not loaded: {trace_module._KERNELS.backend}")
    ids = [0, 1, 7, 2**32, 2**63, 2**64 - 1, *range(100, 20_000, 97)]
    compiled = bank._blocks(ids)
    trace_module._KERNELS.module = None  # the numpy path of the same bank
    try:
        assert (bank._blocks(ids) == compiled).all()
    finally:
        trace_module._KERNELS.module = kernels


def test_compiled_derivation_of_another_vocabulary_takes_the_general_loop() -> None:
    # The kernel reduces by TokenBank's vocabulary as a constant; any other goes through the same mix, by division.
    kernels = trace_module._KERNELS.get()
    if kernels is None:
        pytest.skip(f"compiled path not loaded: {trace_module._KERNELS.backend}")
    assert int(kernels._VOCAB) == VOCAB
    ids = np.array([0, 7, 2**64 - 1, *range(100, 5_000, 389)], np.uint64)
    key = TokenBank(seed=3)._seed_key[0]
    for vocab in (VOCAB, 50_000, 3):
        want = (trace_module._mix(trace_module._mix(ids ^ key)[:, None] + trace_module._POSITIONS[None, :])
                % np.uint64(vocab)).ravel()
        assert (kernels.blocks(ids, key, trace_module._POSITIONS, np.uint64(vocab)) == want).all(), vocab


def test_packed_prompts_agree_on_both_paths_through_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    if trace_module._KERNELS.get() is None:
        pytest.skip(f"compiled path not loaded: {trace_module._KERNELS.backend}")
    reqs = generate(dataclasses.replace(PRESETS["chat"], requests=40), seed=3)  # turns repeat earlier hash ids
    compiled = [TokenBank(seed=1).packed(r) for r in reqs]
    monkeypatch.setattr(TokenBank, "CACHE_BLOCKS", 5)  # the numpy path's cache evicts all along
    bank = TokenBank(seed=1)
    with python_path(trace_module._KERNELS):
        assert [bank.packed(r) for r in reqs] == compiled
        assert 0 < len(bank._packed) <= 5
    assert all(len(p) == 4 * r.input_length for p, r in zip(compiled, reqs, strict=True))
