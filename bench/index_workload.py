"""The indexer benchmark's workload, in plain numpy so that Dynamo's interpreter can build it too.

16 shared system prompts of 32 blocks; 8-turn conversations of 512 blocks of 16 tokens, one store of 64
blocks per turn; a quarter of the conversations also live on a second worker; 512-block queries, 40% of
which diverge from a cached conversation part-way. Deterministic: both sides of
``bench/indexer_bench.py`` (kvtier's index here, Dynamo's RadixTree in ``bench/dynamo_index.py``) see
the same blocks on the same workers and the same queries.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

BS = 16  # tokens per block
TURNS = 8  # stores per conversation
BLOCKS_PER_TURN = 64  # blocks per store
CONV_BLOCKS = TURNS * BLOCKS_PER_TURN  # blocks per conversation
SYS_BLOCKS = 32  # blocks of each shared system prompt
N_SYS = 16  # distinct system prompts
VOCAB = 128_000  # token ids are drawn below this


def conversation_tokens(conv: int) -> np.ndarray:
    sys_prompt = np.random.default_rng(1_000_000 + conv % N_SYS).integers(0, VOCAB, SYS_BLOCKS * BS)
    rest = np.random.default_rng(conv).integers(0, VOCAB, (CONV_BLOCKS - SYS_BLOCKS) * BS)
    return np.concatenate([sys_prompt, rest]).astype(np.int64)


def engine_hashes(conv: int) -> list[int]:
    """Content-chained like SGLang's: system-prompt blocks hash the same in every conversation."""
    sys_part = [(conv % N_SYS) << 40 | i for i in range(SYS_BLOCKS)]
    return sys_part + [(1 << 62) | conv << 16 | i for i in range(SYS_BLOCKS, CONV_BLOCKS)]


def placement(conv: int, workers: int) -> list[int]:
    """The workers holding a conversation: one, or two for every fourth (where there are two workers)."""
    first = conv % workers
    if conv % 4 or workers < 2:
        return [first]
    return [first, (first + 1 + conv % 3 % (workers - 1)) % workers]  # (an offset of 1..workers-1: another worker)


def conversations(n_events: int, workers: int) -> Iterator[tuple[int, list[int], list[int], list[int]]]:
    """``(conv, token ids, engine hashes, workers)`` until ``n_events`` stores have been placed."""
    events = conv = 0
    while events < n_events:
        where = placement(conv, workers)
        yield conv, conversation_tokens(conv).tolist(), engine_hashes(conv), where
        events += TURNS * len(where)
        conv += 1


def make_queries(n: int, convs: int, seed: int = 7) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for q in range(n):
        tokens = conversation_tokens(int(rng.integers(0, convs)))
        if q % 5 < 2:  # 40% diverge part-way
            cut = int(rng.integers(1, CONV_BLOCKS)) * BS
            tokens = tokens.copy()
            tokens[cut:] = rng.integers(0, VOCAB, len(tokens) - cut)
        out.append(tokens.tolist())
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def percentile(xs: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s)) - 1))]
