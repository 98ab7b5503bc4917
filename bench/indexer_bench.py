"""Indexer benchmark: apply throughput, find_matches latency and memory per indexed block.

Workload (issue 3): 16 workers; 8-turn conversations of 512 blocks of 16 tokens, one
BlockStored of 64 blocks per turn; 16 shared system prompts of 32 blocks; a quarter of the
conversations also live on a second worker. Then 512-block queries, 40% of which diverge
from a cached conversation part-way.

Targets on the 2-core dev machine: apply >= 1,000,000 blocks/s; find_matches p50 <= 20 us
from keys and <= 150 us from 8,192 token ids; <= 200 bytes per (block, worker) entry.

    python bench/indexer_bench.py                    # full size (100,000 events, 10,000 queries)
    python bench/indexer_bench.py --events 2000 --queries 200   # quick
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import numpy as np

from kvtier.indexer.index import Outcome, TieredIndex
from kvtier.indexer.keys import block_keys
from kvtier.wire import BlockStored, EngineHash, WorkerId
from kvtier.wire.stream import StreamId

BS = 16
TURNS = 8
BLOCKS_PER_TURN = 64
CONV_BLOCKS = TURNS * BLOCKS_PER_TURN
SYS_BLOCKS = 32
N_SYS = 16
VOCAB = 128_000


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def conversation_tokens(conv: int) -> np.ndarray:
    sys_prompt = np.random.default_rng(1_000_000 + conv % N_SYS).integers(0, VOCAB, SYS_BLOCKS * BS)
    rest = np.random.default_rng(conv).integers(0, VOCAB, (CONV_BLOCKS - SYS_BLOCKS) * BS)
    return np.concatenate([sys_prompt, rest]).astype(np.int64)


def engine_hashes(conv: int) -> list[int]:
    # Content-chained like SGLang: system-prompt blocks hash the same in every conversation.
    sys_part = [(conv % N_SYS) << 40 | i for i in range(SYS_BLOCKS)]
    return sys_part + [(1 << 62) | conv << 16 | i for i in range(SYS_BLOCKS, CONV_BLOCKS)]


def conversation_events(conv: int, tokens: np.ndarray) -> list[BlockStored]:
    hashes: list[EngineHash] = list(engine_hashes(conv))
    toks = tokens.tolist()
    out = []
    for t in range(TURNS):
        lo = t * BLOCKS_PER_TURN
        out.append(BlockStored(
            block_hashes=hashes[lo:lo + BLOCKS_PER_TURN],
            parent_block_hash=hashes[lo - 1] if lo else None,
            token_ids=toks[lo * BS:(lo + BLOCKS_PER_TURN) * BS], block_size=BS, medium="GPU"))
    return out


def placement(conv: int, workers: int) -> list[int]:
    first = conv % workers
    return [first, (first + 1 + conv % 3) % workers] if conv % 4 == 0 else [first]


def apply_phase(index: TieredIndex, streams: list[StreamId], n_events: int) -> tuple[float, int, int, int]:
    """Returns (seconds spent in apply, events, blocks, conversations)."""
    spent = 0.0
    events = blocks = conv = 0
    while events < n_events:
        evs = conversation_events(conv, conversation_tokens(conv))
        for w in placement(conv, len(streams)):
            gc_was = gc.isenabled()
            t0 = time.perf_counter()
            for ev in evs:
                outcome = index.apply(streams[w], ev)
                assert outcome is Outcome.APPLIED, outcome
            spent += time.perf_counter() - t0
            if not gc_was:
                gc.enable()
            events += len(evs)
            blocks += len(evs) * BLOCKS_PER_TURN
        conv += 1
    return spent, events, blocks, conv


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


def percentile(xs: list[float], p: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(p) - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=10_000)
    args = ap.parse_args()

    streams = [StreamId(WorkerId(f"w{i}")) for i in range(args.workers)]
    index = TieredIndex(BS)
    gc.collect()
    rss0 = rss_bytes()
    spent, events, blocks, convs = apply_phase(index, streams, args.events)
    gc.collect()
    rss1 = rss_bytes()
    entries = sum(sum(index.block_counts(s).values()) for s in streams)
    print(f"workload: {args.workers} workers, {convs} conversations, {events} BlockStored events, "
          f"{blocks} blocks stored, {entries} (block, worker) entries, {len(index)} distinct blocks")
    print(f"apply:          {blocks / spent:12,.0f} blocks/s   {events / spent:10,.0f} events/s   "
          f"(target >= 1,000,000 blocks/s)")
    print(f"memory:         {(rss1 - rss0) / entries:12,.0f} bytes per (block, worker) entry "
          f"(RSS growth {(rss1 - rss0) / 2**20:,.0f} MiB; target <= 200)")

    queries = make_queries(args.queries, convs)
    keyed = [block_keys(q, BS) for q in queries]
    from_keys, from_tokens = [], []
    matched = 0
    for q, keys in zip(queries, keyed, strict=True):
        t0 = time.perf_counter()
        r = index.find_matches_keys(keys)
        t1 = time.perf_counter()
        index.find_matches(q)
        t2 = time.perf_counter()
        from_keys.append((t1 - t0) * 1e6)
        from_tokens.append((t2 - t1) * 1e6)
        matched += max(o.device for o in r.workers.values())
    print(f"find_matches:   from keys p50 {percentile(from_keys, 50):7.1f} us  p99 {percentile(from_keys, 99):7.1f} us"
          f"   (target p50 <= 20 us)")
    print(f"                from {CONV_BLOCKS * BS} token ids p50 {percentile(from_tokens, 50):7.1f} us  "
          f"p99 {percentile(from_tokens, 99):7.1f} us   (target p50 <= 150 us)")
    print(f"                mean best device overlap {matched / len(queries):.0f} of {CONV_BLOCKS} blocks")


if __name__ == "__main__":
    main()
