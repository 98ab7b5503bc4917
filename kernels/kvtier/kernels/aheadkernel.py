"""Token ids, router keys and engine page digests of a batch of requests in one compiled call that releases the
GIL (:class:`kvtier.sim.lookahead.Lookahead` runs it on a helper thread, ahead of the simulated clock).

Each is what the simulator's main thread computes otherwise, with the same kernels: the token bank's
(:func:`kvtier.kernels.bankkernel.blocks`), the router's key chain (:func:`kvtier.kernels.keykernel.chain_into`) and
the engine's SHA-256 page chain (:func:`kvtier.kernels.shakernel.chain_pages`, OpenSSL's, whose addresses the
caller passes). One call per batch, because a thread that comes back from a call releasing the GIL waits for the
main thread to hand the GIL over (up to the interpreter's switch interval): a call per request would spend its
time waiting. Imported through :func:`kvtier.kernels.jit.load`; raises ``ImportError`` where the SHA-256 kernel
cannot load (no suitable libcrypto), and the lookahead is then off.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvtier.kernels.bankkernel import blocks
from kvtier.kernels.keykernel import chain_into
from kvtier.kernels.shakernel import DIGEST_BYTES, FINAL, INIT, UPDATE, chain_pages

#: What :func:`prepare` takes as ``sha``: the addresses of OpenSSL's functions that :mod:`kvtier.kernels.shakernel`
#: loaded (the engine checks the first digest of each node made from them against ``hashlib``).
SHA = np.array([INIT, UPDATE, FINAL], np.int64)


@njit(cache=True, nogil=True)
def prepare(ids: npt.NDArray[np.uint64], first_block: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64],
            seed_key: np.uint64, positions: npt.NDArray[np.uint64], vocab: np.uint64, step: int,
            key_seed: np.uint64, page_bytes: int, sha: npt.NDArray[np.int64]) -> tuple[
                npt.NDArray[np.uint32], npt.NDArray[np.uint64], npt.NDArray[np.int64], npt.NDArray[np.uint8],
                npt.NDArray[np.int64]]:
    """For requests whose hash ids are ``ids[first_block[r]:first_block[r + 1]]`` and whose prompts have
    ``lengths[r]`` tokens: ``(tokens, keys, first_key, digests, first_page)``.

    Request ``r``'s token ids are ``tokens[first_block[r] * positions.size:][:lengths[r]]``; its router keys (the
    chain of its full ``step``-byte blocks from the root, as ``kvtier.indexer.index.keys.block_keys`` computes them)
    ``keys[first_key[r]:first_key[r + 1]]``, none when ``step`` is 0; the page digests of its full
    ``page_bytes``-byte pages from the root (``kvtier.engine.hashing.chain``), rows
    ``first_page[r]:first_page[r + 1]`` of ``digests``, none when ``page_bytes`` is 0 or the library failed
    (``first_page[-1]`` is then -1). ``sha``: the addresses of SHA256_Init, _Update and _Final. O(tokens)."""
    tokens = blocks(ids, seed_key, positions, vocab)
    n = lengths.size
    first_key = np.zeros(n + 1, np.int64)
    first_page = np.zeros(n + 1, np.int64)
    for r in range(n):
        first_key[r + 1] = first_key[r] + (lengths[r] * 4 // step if step > 0 else 0)
        first_page[r + 1] = first_page[r] + (lengths[r] * 4 // page_bytes if page_bytes > 0 else 0)
    keys = np.empty(first_key[n], np.uint64)
    digests = np.empty((first_page[n], DIGEST_BYTES), np.uint8)
    raw = tokens.view(np.uint8)
    m = positions.size
    root = np.empty(0, np.uint8)
    for r in range(n):
        start = first_block[r] * m * 4
        if first_key[r + 1] > first_key[r]:
            chain_into(raw[start:start + lengths[r] * 4], step, np.uint64(0), False, key_seed,
                       keys[first_key[r]:first_key[r + 1]])
        pages = first_page[r + 1] - first_page[r]
        if pages > 0 and first_page[n] >= 0:
            rows = raw[start:start + pages * page_bytes].reshape(pages, page_bytes)
            if not chain_pages(sha[0], sha[1], sha[2], root, rows, digests[first_page[r]:first_page[r + 1]]):
                first_page[n] = -1
    return tokens, keys, first_key, digests, first_page
