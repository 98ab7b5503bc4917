"""Token ids, router keys and page digests made ahead on a helper thread (kvtier.sim.lookahead): the same as made
on arrival, and the engine's check of digests handed to it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.hashing import ROOT_DIGEST, chain
from kvtier.engine.radix import RadixTree
from kvtier.indexer.index.keys import KeyList, block_keys
from kvtier.sim import lookahead as la
from kvtier.sim.cluster import ClusterConfig
from kvtier.sim.generators import PRESETS, generate
from kvtier.sim.run import RunConfig, simulate
from kvtier.sim.source import ListTrace
from kvtier.sim.trace import HASH_BLOCK, Request, TokenBank

from .jit_paths import python_path

compiled = pytest.mark.skipif(not la.lookahead_backend().startswith("numba"), reason="numba does not run here")


def _request(i: int, length: int, first_id: int) -> Request:
    blocks = -(-length // HASH_BLOCK)
    return Request(f"r{i}", float(i), length, 4, list(range(first_id, first_id + blocks)))


lengths = st.lists(st.integers(1, 3 * HASH_BLOCK + 7), min_size=1, max_size=2 * la.BATCH + 40)


@compiled
@settings(max_examples=25, deadline=None)
@given(lengths=lengths, page_size=st.sampled_from([16, 64, 100, 512]), keys=st.booleans(), seed=st.integers(0, 3))
def test_every_request_gets_the_tokens_keys_and_digests_it_would_get_on_arrival(lengths: list[int], page_size: int,
                                                                                keys: bool, seed: int) -> None:
    # Prompts from 1 token (no page) through a few blocks (the Python key path below 4 blocks), across batches.
    reqs = [_request(i, n, 1000 * i) for i, n in enumerate(lengths)]
    bank = TokenBank(seed)
    ahead = la.Lookahead(iter(enumerate(reqs)), bank, page_size, keys)
    seen = []
    for rank, req in ahead:
        assert len(ahead._due) <= 2 * la.BATCH + 1, "read further ahead than two batches"
        tokens, got_keys, digests = ahead.take(req)
        assert tokens == bank.packed(req), f"request {rank}: other token ids"
        assert got_keys == (block_keys(tokens, page_size) if keys else []), f"request {rank}: other keys"
        if isinstance(got_keys, KeyList):
            assert got_keys.arr.tolist() == list(got_keys)
        assert digests == b"".join(chain(ROOT_DIGEST, tokens, page_size)), f"request {rank}: other digests"
        seen.append(rank)
    assert seen == list(range(len(reqs)))
    assert not ahead._due


@compiled
def test_what_is_read_ahead_is_bounded_by_tokens_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace of long prompts is read ahead by tokens, not only by requests: at most two batches of
    :data:`BATCH_TOKENS` and one request are outstanding (128 prompts of 16M tokens each took gigabytes)."""
    monkeypatch.setattr(la, "BATCH_TOKENS", 10 * HASH_BLOCK)
    lengths = [3 * HASH_BLOCK, 1, 7 * HASH_BLOCK, 12 * HASH_BLOCK, 2, 5 * HASH_BLOCK] * 20
    reqs = [_request(i, n, 1000 * i) for i, n in enumerate(lengths)]
    bank = TokenBank(0)
    ahead = la.Lookahead(iter(enumerate(reqs)), bank, 64, True)
    for _, req in ahead:
        due = sum(r.input_length for r in reqs if id(r) in ahead._due)
        assert due <= 2 * la.BATCH_TOKENS + max(lengths), f"{due} tokens read ahead"
        assert ahead.take(req)[0] == bank.packed(req)
    assert not ahead._due and ahead._ahead_tokens == 0


@compiled
def test_a_request_not_read_ahead_is_made_when_it_arrives() -> None:
    # A closed-loop session's later turn comes from the source's successor, not through the lookahead.
    bank = TokenBank()
    first, later = _request(0, 700, 1), _request(1, 1500, 1)
    ahead = la.Lookahead(iter([(0, first)]), bank, 64, keys=True)
    assert next(ahead) == (0, first)
    assert ahead.take(later) == (bank.packed(later), block_keys(bank.packed(later), 64), b"")
    assert ahead.take(first)[0] == bank.packed(first)


@compiled
def test_a_failure_on_the_helper_is_raised_where_the_request_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        SHA = la._KERNELS.get().SHA

        def prepare(self, *args: object) -> None:
            raise RuntimeError("helper failed")

    ahead = la.Lookahead(iter([(0, _request(0, 600, 5))]), TokenBank(), 64, keys=True)
    monkeypatch.setattr(ahead, "_k", Broken())
    _, req = next(ahead)
    with pytest.raises(RuntimeError, match="helper failed"):
        ahead.take(req)


def test_without_the_kernel_the_arrivals_pass_through_and_each_request_is_made_on_arrival() -> None:
    reqs = [_request(i, 900, 10 * i) for i in range(5)]
    bank = TokenBank()
    with python_path(la._KERNELS):
        ahead = la.Lookahead(iter(enumerate(reqs)), bank, 64, keys=True)
        for _, req in ahead:
            assert not ahead._due
            assert ahead.take(req) == (bank.packed(req), block_keys(bank.packed(req), 64), b"")


class _OtherBank(TokenBank):
    def packed(self, req: Request) -> bytes:
        return bytes(4 * req.input_length)


def test_a_bank_subclass_is_asked_for_its_own_tokens() -> None:
    req = _request(0, 300, 1)
    ahead = la.Lookahead(iter([(0, req)]), _OtherBank(), 64, keys=False)
    assert next(ahead) == (0, req)
    assert ahead.take(req) == (bytes(1200), [], b"")


def _chat(n: int) -> list[Request]:
    return generate(dataclasses.replace(PRESETS["chat"], requests=n, system_tokens=1024, user_tokens=600), 3)


@pytest.mark.parametrize("closed_loop", [True, False])
def test_runs_give_the_same_results_with_and_without_the_lookahead(closed_loop: bool) -> None:
    reqs = _chat(3 * la.BATCH)  # sessions: later turns arrive closed loop, past the lookahead
    cfg = ClusterConfig.of(workers=3, page_size=64, device_tokens=65_536, host_ratio=1.0)
    run = RunConfig("kv_host", closed_loop=closed_loop)
    ahead = simulate(ListTrace(reqs), cfg, run)

    def one_by_one(self: la.Lookahead) -> Iterator[tuple[int, Request]]:
        return self._arrivals

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(la.Lookahead, "__iter__", one_by_one)
        mp.setattr(la.Lookahead, "__next__", lambda self: next(self._arrivals))
        plain = simulate(ListTrace(reqs), cfg, run)
    assert ahead.decisions == plain.decisions
    assert repr(ahead.summary) == repr(plain.summary)  # (repr: NaN figures compare unequal)
    assert ahead.records == plain.records


def test_the_engine_refuses_digests_cut_at_the_wrong_page() -> None:
    bank = TokenBank()
    tokens = bank.packed(_request(0, 640, 1))  # 10 pages of 64
    digests = b"".join(chain(ROOT_DIGEST, tokens, 64))
    tree = RadixTree(64)
    first = tree.add_child(tree.root, tokens[:4 * 256], digests[:4 * 32])
    assert first.digests == chain(ROOT_DIGEST, tokens[:4 * 256], 64)
    with pytest.raises(AssertionError, match="out of sync"):
        tree.add_child(first, tokens[4 * 256:], digests[5 * 32:] + digests[:32])
    node = tree.add_child(first, tokens[4 * 256:], digests[4 * 32:])
    assert node.hashes == tree.add_child(RadixTree(64).root, tokens, b"").hashes[4:]
