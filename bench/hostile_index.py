"""Hostile shapes against the index: what one event of one publisher costs the index's lock, at two sizes.

A publisher may send, within every limit the service checks, events whose cost grows faster than their size if the
index has a quadratic path: the service's lock is held while one applies, so every query waits on it. Each case is
timed at ``n`` and ``4 * n`` blocks; a linear path costs about 4x more at the larger size, a quadratic one 16x.

  orphan removal   one store of N blocks under an unknown parent (held as an orphan), then one BlockRemoved naming
                   all N; timed: the removal
  orphan same hash the same, every block with one engine hash; timed: the removal
  parent churn     N stores and removals of one-block children under a parent another worker holds; timed: one
                   removal of the parent

Target: each case's larger size costs <= 6x its smaller (linear, with room for caches), and the larger is under
100 ms. No peer has these paths to compare. The median of ``--repeat`` runs is printed.

    python bench/hostile_index.py [--blocks 4096] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from benchargs import count

from kvtier.indexer.index.tiered import TieredIndex
from kvtier.wire import BlockRemoved, BlockStored, EngineHash, WorkerId
from kvtier.wire.notices import StreamId

BS = 4
A, B = StreamId(WorkerId("a")), StreamId(WorkerId("b"))
LIMIT_MS = 100.0
RATIO = 6.0


def _store(hashes: list[EngineHash], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS, medium="GPU")


def orphan_removal(n: int, same: bool) -> float:
    idx = TieredIndex(BS)
    hashes: list[EngineHash] = [7] * n if same else list(range(1000, 1000 + n))
    idx.apply(A, _store(hashes, 99, list(range(n * BS))))
    removal = BlockRemoved(block_hashes=hashes, medium="GPU")
    t0 = time.perf_counter()
    idx.apply(A, removal)
    return time.perf_counter() - t0


def parent_churn(n: int) -> float:
    idx = TieredIndex(BS)
    parent = _store([7], None, [1, 2, 3, 4])
    idx.apply(B, parent)
    idx.apply(A, parent)
    for i in range(n):
        idx.apply(A, _store([1000 + i], 7, [i, i, i, 9]))
        idx.apply(A, BlockRemoved(block_hashes=[1000 + i], medium="GPU"))
    t0 = time.perf_counter()
    idx.apply(B, BlockRemoved(block_hashes=[7], medium="GPU"))
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=count(), default=4096, help="the smaller size (the larger is 4x)")
    ap.add_argument("--repeat", type=count(), default=3, help="runs per case and size (median)")
    a = ap.parse_args()
    cases: list[tuple[str, Callable[[int], float]]] = [
        ("orphan removal", lambda n: orphan_removal(n, False)),
        ("orphan same hash", lambda n: orphan_removal(n, True)),
        ("parent churn", parent_churn),
    ]
    orphan_removal(64, False)  # compile the kernels outside the timings
    parent_churn(64)
    ok = True
    print(f"{'case':<18}{a.blocks:>10,} blocks{4 * a.blocks:>10,} blocks   ratio   (target <= {RATIO:g}x and "
          f"<= {LIMIT_MS:g} ms)")
    for name, case in cases:
        small, large = (statistics.median(case(n) for _ in range(a.repeat)) * 1e3 for n in (a.blocks, 4 * a.blocks))
        ratio = large / max(small, 1e-6)
        met = ratio <= RATIO and large <= LIMIT_MS
        ok &= met
        print(f"{name:<18}{small:>13.2f} ms{large:>13.2f} ms {ratio:7.1f}x   {'MET' if met else 'MISS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
