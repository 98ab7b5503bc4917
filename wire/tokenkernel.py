"""Msgpack arrays of token ids to and from packed tokens (uint32 LE), compiled with numba.

A BlockStored carries its token ids as a msgpack array of ints. Decoding that into a list of Python ints
and packing it for the router's keys cost 108 + 45 us per 4,096 tokens (and the engine side the
reverse); here each direction is one pass over bytes. Imported through :func:`kvtier.wire.jit.load` by
:mod:`kvtier.wire.tokenarray`, which has the pure-Python path with the same results.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit


@njit(cache=True)
def encode(tokens: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint8]:
    """The msgpack array of ``tokens``, each int in its shortest unsigned format (as msgspec writes
    it). O(tokens)."""
    n = tokens.size
    out = np.empty(5 + 5 * n, np.uint8)
    if n < 16:
        out[0] = 0x90 | n
        p = 1
    elif n < 65536:
        out[0], out[1], out[2] = 0xDC, n >> 8, n & 0xFF
        p = 3
    else:
        out[0], out[1], out[2], out[3], out[4] = 0xDD, n >> 24, (n >> 16) & 0xFF, (n >> 8) & 0xFF, n & 0xFF
        p = 5
    for i in range(n):
        t = tokens[i]
        if t < 128:
            out[p] = t
            p += 1
        elif t < 256:
            out[p], out[p + 1] = 0xCC, t
            p += 2
        elif t < 65536:
            out[p], out[p + 1], out[p + 2] = 0xCD, t >> 8, t & 0xFF
            p += 3
        else:
            out[p], out[p + 1], out[p + 2], out[p + 3], out[p + 4] = 0xCE, t >> 24, (t >> 16) & 0xFF, \
                (t >> 8) & 0xFF, t & 0xFF
            p += 5
    return out[:p]


@njit(inline="always")
def _be(b: npt.NDArray[np.uint8], p: int, size: int) -> int:
    v = 0
    for k in range(size):
        v = (v << 8) | int(b[p + k])
    return v


@njit(cache=True)
def decode(b: npt.NDArray[np.uint8]) -> tuple[bool, npt.NDArray[np.uint32]]:
    """``(True, tokens)`` if ``b`` is exactly one msgpack array of ints in ``[0, 2**32)`` (any int
    format), else ``(False, empty)``: the caller then decodes it the slow way, for its error or its
    out-of-range ids. O(len(b))."""
    fail = np.empty(0, np.uint32)
    size = b.size
    if size == 0:
        return False, fail
    c = int(b[0])
    if 0x90 <= c <= 0x9F:
        n, p = c & 0x0F, 1
    elif c == 0xDC and size >= 3:
        n, p = _be(b, 1, 2), 3
    elif c == 0xDD and size >= 5:
        n, p = _be(b, 1, 4), 5
    else:
        return False, fail
    if n > size - p:  # every element takes at least a byte
        return False, fail
    out = np.empty(n, np.uint32)
    for i in range(n):
        if p >= size:
            return False, fail
        c = int(b[p])
        if c < 0x80:  # positive fixint
            v, w = c, 1
        elif 0xCC <= c <= 0xD3:  # uint 8/16/32/64, or int 8/16/32/64 (accepted when non-negative)
            signed = c >= 0xD0
            w = 1 << (c - (0xD0 if signed else 0xCC))
            if p + w >= size or (signed and b[p + 1] >= 0x80):
                return False, fail
            if w == 8 and _be(b, p + 1, 4) != 0:  # past 32 bits
                return False, fail
            v = _be(b, p + 1 + w - min(w, 4), min(w, 4))
            w += 1
        else:
            return False, fail
        out[i] = v  # under 2**32: no format read above holds more
        p += w
    if p != size:
        return False, fail
    return True, out
