"""Dynamo's side of ``bench/indexer_bench.py``: NVIDIA Dynamo's ``dynamo.llm.RadixTree`` driven from Python
on the same workload. Runs in the interpreter that has ``ai-dynamo-runtime`` (and numpy); never imports
kvtier. Usage (the indexer bench runs it): ``python bench/dynamo_index.py WORKERS EVENTS QUERIES OUT.json``.

Stores are JSON events as Dynamo's router receives them, encoded before the clock starts, so apply time
includes Dynamo's JSON parsing (its Python binding takes bytes) but not building them. Queries time
``find_matches`` from the local block hashes, and ``compute_block_hash_for_seq`` plus ``find_matches``
from token ids. Then its snapshot: ``dump_tree_as_events`` (the tree as JSON events), and those events applied to a
new tree (checked to answer the first 200 queries as the first tree did).
"""

from __future__ import annotations

import gc
import json
import sys
import time

USAGE = "usage: python bench/dynamo_index.py WORKERS EVENTS QUERIES OUT.json (run by bench/indexer_bench.py)"


def main() -> None:
    args = sys.argv[1:]
    if len(args) != 4 or not all(a.isdigit() and int(a) > 0 for a in args[:3]):
        print(__doc__ if args[:1] in (["-h"], ["--help"]) else USAGE, file=sys.stderr)
        raise SystemExit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    try:
        from dynamo.llm import RadixTree, compute_block_hash_for_seq
        from index_workload import BLOCKS_PER_TURN, BS, TURNS, conversations, make_queries, rss_bytes
    except ImportError as exc:
        raise SystemExit(f"dynamo_index.py: this interpreter ({sys.executable}) needs ai-dynamo-runtime and numpy: "
                         f"{exc}") from None

    workers, n_events, n_queries, out_path = int(args[0]), int(args[1]), int(args[2]), args[3]
    tree = RadixTree()
    gc.collect()
    rss0 = rss_bytes()
    spent = 0.0
    event_id = blocks = convs = 0
    for _conv, tokens, hashes, where in conversations(n_events, workers):
        local = compute_block_hash_for_seq(tokens, BS)
        frames = []
        for t in range(TURNS):
            lo = t * BLOCKS_PER_TURN
            event_id += 1
            frames.append(json.dumps({"event_id": event_id, "data": {"stored": {
                "parent_hash": hashes[lo - 1] if lo else None,
                "blocks": [{"block_hash": hashes[i], "tokens_hash": local[i]}
                           for i in range(lo, lo + BLOCKS_PER_TURN)]}}}).encode())
        for w in where:
            t0 = time.perf_counter()
            for f in frames:
                tree.apply_event(w, f)
            spent += time.perf_counter() - t0
            blocks += TURNS * BLOCKS_PER_TURN
        convs += 1
    gc.collect()
    rss1 = rss_bytes()
    queries = make_queries(n_queries, convs)
    depths: list[list[int]] = []
    from_keys: list[float] = []
    from_tokens: list[float] = []
    for q in queries:
        local = compute_block_hash_for_seq(q, BS)
        t0 = time.perf_counter()
        scores = tree.find_matches(local).scores
        t1 = time.perf_counter()
        tree.find_matches(compute_block_hash_for_seq(q, BS))
        t2 = time.perf_counter()
        from_keys.append((t1 - t0) * 1e6)
        from_tokens.append((t2 - t1) * 1e6)
        row = [0] * workers
        for (w, _dp), depth in scores.items():
            row[w] = depth
        depths.append(row)
    # Dynamo's snapshot of a tree: its blocks dumped as events (JSON, per worker), which a new tree applies.
    t0 = time.perf_counter()
    dumped = tree.dump_tree_as_events()
    t1 = time.perf_counter()
    again = RadixTree()
    for raw in dumped:
        event = json.loads(raw)
        again.apply_event(event["worker_id"], json.dumps(event["event"]).encode())
    t2 = time.perf_counter()
    for q, row in zip(queries[:200], depths, strict=False):  # the restored tree answers as the first did
        got = [0] * workers
        for (w, _dp), depth in again.find_matches(compute_block_hash_for_seq(q, BS)).scores.items():
            got[w] = depth
        assert got == row, f"Dynamo's tree restored from its dump answers {got}, not {row}"
    with open(out_path, "w") as out:
        json.dump({"blocks": blocks, "apply_s": spent, "rss_growth": rss1 - rss0, "depths": depths,
                   "from_keys_us": from_keys, "from_tokens_us": from_tokens, "dump_s": t1 - t0,
                   "restore_s": t2 - t1, "dump_bytes": sum(len(d) for d in dumped)}, out)


if __name__ == "__main__":
    main()
