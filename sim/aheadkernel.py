"""Token ids and router keys of a batch of requests in one compiled call that releases the GIL
(:class:`kvtier.sim.lookahead.Lookahead` runs it on a helper thread, ahead of the simulated clock).

Both are what the simulator's main thread computes per request otherwise, with the same kernels: the token
bank's (:func:`kvtier.sim.bankkernel.blocks`) and the router's key chain (:func:`kvtier.indexer.keykernel.chain_into`).
One call per batch, because a thread that comes back from a call releasing the GIL waits for the main thread
to hand the GIL over (up to the interpreter's 5 ms switch interval): a call per request would spend its time
waiting. Imported through :func:`kvtier.wire.jit.load`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvtier.indexer.keykernel import chain_into
from kvtier.sim.bankkernel import blocks


@njit(cache=True, nogil=True)
def prepare(ids: npt.NDArray[np.uint64], first_block: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64],
            seed_key: np.uint64, positions: npt.NDArray[np.uint64], vocab: np.uint64, step: int,
            key_seed: np.uint64) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    """For requests whose hash ids are ``ids[first_block[r]:first_block[r + 1]]`` and whose prompts have
    ``lengths[r]`` tokens: ``(tokens, keys, first_key)``. Request ``r``'s token ids are
    ``tokens[first_block[r] * positions.size:][:lengths[r]]``, and its keys (the chain of its full ``step``-byte
    blocks from the root, as ``kvtier.indexer.keys.block_keys`` computes them) ``keys[first_key[r]:first_key[r + 1]]``;
    no keys when ``step`` is 0. O(tokens)."""
    tokens = blocks(ids, seed_key, positions, vocab)
    n = lengths.size
    first_key = np.zeros(n + 1, np.int64)
    if step > 0:
        for r in range(n):
            first_key[r + 1] = first_key[r] + lengths[r] * 4 // step
    keys = np.empty(first_key[n], np.uint64)
    raw = tokens.view(np.uint8)
    m = positions.size
    for r in range(n):
        if first_key[r + 1] > first_key[r]:
            start = first_block[r] * m * 4
            chain_into(raw[start:start + lengths[r] * 4], step, np.uint64(0), False, key_seed,
                       keys[first_key[r]:first_key[r + 1]])
    return tokens, keys, first_key
