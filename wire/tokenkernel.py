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

# Per size class of a token id (0: < 128, 1: < 256, 2: < 65536, 4: the rest; 3 is unused), what encode
# writes: the format byte (none for a positive fixint), then the id's low bytes, big-endian. Tokens of a real
# prompt fall in classes 2 and 4 unpredictably; tables instead of branches keep the loop free of mispredictions.
_ENC_PREFIX = np.array([0, 0xCC, 0xCD, 0, 0xCE], np.uint8)  # format byte
_ENC_HAS_PREFIX = np.array([0, 1, 1, 0, 1], np.int64)  # whether it is written
_ENC_BYTES = np.array([1, 1, 2, 0, 4], np.int64)  # payload bytes
_ENC_SHIFT = np.array([24, 24, 16, 0, 0], np.int64)  # left shift putting the payload in the top of 32 bits


@njit(cache=True)
def encode(tokens: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint8]:
    """The msgpack array of ``tokens``, each int in its shortest unsigned format (as msgspec writes
    it). O(tokens)."""
    n = tokens.size
    out = np.empty(5 + 5 * n, np.uint8)  # each token writes 4 bytes past its format byte, used or not
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
        t = np.int64(tokens[i])
        c = np.int64(t >= 128) + np.int64(t >= 256) + 2 * np.int64(t >= 65536)
        out[p] = _ENC_PREFIX[c]
        p += _ENC_HAS_PREFIX[c]
        u = t << _ENC_SHIFT[c]
        out[p], out[p + 1], out[p + 2], out[p + 3] = (u >> 24) & 0xFF, (u >> 16) & 0xFF, (u >> 8) & 0xFF, u & 0xFF
        p += _ENC_BYTES[c]
    return out[:p]


# Per first byte of an element: payload bytes of the formats decode reads through tables (0 for a positive fixint,
# 1, 2 and 4 for uint 8/16/32; -1 for every other byte), the right shift taking that payload out of the 4 bytes
# after the format byte, and the mask keeping a fixint's own value.
_DEC_BYTES = np.full(256, -1, np.int64)
_DEC_BYTES[:0x80] = 0
_DEC_BYTES[0xCC], _DEC_BYTES[0xCD], _DEC_BYTES[0xCE] = 1, 2, 4
_DEC_SHIFT = np.zeros(256, np.int64)
_DEC_SHIFT[:0x80] = 32
_DEC_SHIFT[0xCC], _DEC_SHIFT[0xCD], _DEC_SHIFT[0xCE] = 24, 16, 0
_DEC_FIXINT = np.zeros(256, np.int64)
_DEC_FIXINT[:0x80] = 0xFF


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
    # The formats msgspec writes for ids under 2**32, while 4 bytes past the format byte are in bounds, through
    # tables (see _DEC_*); anything else, and the last elements, by the general loop below.
    done = 0
    while done < n and p + 5 <= size:
        c = int(b[p])
        width = _DEC_BYTES[c]
        if width < 0:
            break
        word = (np.int64(b[p + 1]) << 24) | (np.int64(b[p + 2]) << 16) | (np.int64(b[p + 3]) << 8) | np.int64(b[p + 4])
        out[done] = (word >> _DEC_SHIFT[c]) | (c & _DEC_FIXINT[c])
        p += 1 + width
        done += 1
    for i in range(done, n):
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


@njit(inline="always")
def _json_space(b: npt.NDArray[np.uint8], p: int, size: int) -> int:
    while p < size and (b[p] == 0x20 or b[p] == 0x0A or b[p] == 0x0D or b[p] == 0x09):
        p += 1
    return p


@njit(cache=True)
def decode_json(b: npt.NDArray[np.uint8]) -> tuple[bool, npt.NDArray[np.uint32]]:
    """``(True, tokens)`` if ``b`` is exactly one JSON array of plain non-negative integers under ``2**32``
    (digits only: no sign, fraction, exponent or leading zero), with JSON whitespace anywhere between; else
    ``(False, empty)``, and the caller decodes it the slow way, for its error or its out-of-range ids. A
    query's prompt arrives this way: a Python int per token cost more than the rest of the query. O(len(b))."""
    fail = np.empty(0, np.uint32)
    size = b.size
    p = _json_space(b, 0, size)
    if p >= size or b[p] != 0x5B:  # [
        return False, fail
    p = _json_space(b, p + 1, size)
    out = np.empty(size // 2 + 1, np.uint32)  # each id takes a digit and a comma, the last one a digit
    n = 0
    if p < size and b[p] == 0x5D:  # ]
        p += 1
    else:
        while True:
            start = p
            v = np.int64(0)
            while p < size:
                d = np.int64(b[p]) - 0x30
                if d < 0 or d > 9:
                    break
                v = v * 10 + d
                p += 1
            # No digit, a leading zero, or past 2**32 (ten digits at most, so v cannot have wrapped).
            if p == start or p - start > 10 or v > 0xFFFFFFFF or (b[start] == 0x30 and p - start > 1):
                return False, fail
            out[n] = v
            n += 1
            p = _json_space(b, p, size)
            if p >= size:
                return False, fail
            if b[p] == 0x2C:  # ,
                p = _json_space(b, p + 1, size)
            elif b[p] == 0x5D:
                p += 1
                break
            else:
                return False, fail
    if _json_space(b, p, size) != size:
        return False, fail
    return True, out[:n]
