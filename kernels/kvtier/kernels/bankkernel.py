"""Token ids of trace hash ids (:class:`kvtier.sim.trace.TokenBank`), compiled with numba.

Each hash id stands for 512 token ids, each a SplitMix64 mix of its position and the id's key. The numpy
path makes eight temporary arrays per batch and reduces with a 64-bit modulo, a large share of a replay
whose blocks are mostly new. Here it is one pass (figures: ``bench/MEASUREMENTS.md``). Imported through
:func:`kvtier.kernels.jit.load`; :mod:`kvtier.sim.trace` keeps the numpy path, with the same results.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

# Every operand is uint64: numba, like numpy, widens uint64 mixed with a signed int to float64.
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
#: The vocabulary TokenBank passes, a compile-time constant in the loop below: LLVM turns a modulo by a constant
#: into multiplies, where a modulo by an argument is a 64-bit division per token (2.5 -> 2.0 ns a token).
_VOCAB = np.uint64(128_000)


@njit(inline="always")
def _mix(x: np.uint64) -> np.uint64:
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


@njit(inline="always")
def _fill(out: npt.NDArray[np.uint32], ids: npt.NDArray[np.uint64], seed_key: np.uint64,
          positions: npt.NDArray[np.uint64], vocab: np.uint64) -> None:
    m = positions.size
    for i in range(ids.size):
        key = _mix(ids[i] ^ seed_key)
        base = i * m
        for j in range(m):
            out[base + j] = _mix(key + positions[j]) % vocab


@njit(cache=True)
def blocks(ids: npt.NDArray[np.uint64], seed_key: np.uint64, positions: npt.NDArray[np.uint64],
           vocab: np.uint64) -> npt.NDArray[np.uint32]:
    """The token ids of each hash id in ``ids``, one block of ``positions.size`` after another:
    ``mix(mix(id ^ seed_key) + position) % vocab``, as ``TokenBank._blocks`` computes them. O(tokens)."""
    out = np.empty(ids.size * positions.size, np.uint32)
    if vocab == _VOCAB:  # inlined with the constant: the same values as the general call below
        _fill(out, ids, seed_key, positions, _VOCAB)
    else:
        _fill(out, ids, seed_key, positions, vocab)
    return out
