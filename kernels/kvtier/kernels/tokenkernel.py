"""Msgpack arrays of token ids to and from packed tokens (uint32 LE), compiled with numba.

A BlockStored carries its token ids as a msgpack array of ints. Decoding that into a list of Python ints
and packing it for the router's keys costs a Python object per token (and the engine side the reverse);
here each direction is one pass over bytes (figures: ``bench/MEASUREMENTS.md``). Imported through
:func:`kvtier.kernels.jit.load` by :mod:`kvtier.wire.tokenarray`, which has the pure-Python path with the same results.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvtier.kernels.unaligned import load, store64

_r64 = load(64)

# Per size class of a token id (0: < 128, 1: < 256, 2: < 65536, 4: the rest; 3 is unused), what encode
# writes: the format byte (none for a positive fixint), then the id's low bytes, big-endian. Tokens of a real
# prompt fall in classes 2 and 4 unpredictably; tables instead of branches keep the loop free of mispredictions.
_ENC_PREFIX = np.array([0, 0xCC, 0xCD, 0, 0xCE], np.uint64)  # format byte
_ENC_SHIFT = np.array([24, 24, 16, 0, 0], np.uint64)  # left shift putting the payload in the top of 32 bits
_ENC_AFTER = np.array([0, 8, 8, 0, 8], np.uint64)  # left shift putting the payload after the format byte
_B0, _B1, _B2, _B3 = np.uint64(0xFF), np.uint64(0xFF00), np.uint64(0xFF0000), np.uint64(0xFF000000)
_S8, _S24 = np.uint64(8), np.uint64(24)
_LOW32 = np.uint64(0xFFFFFFFF)


@njit(inline="always")
def _bswap32(x: np.uint64) -> np.uint64:
    """The low 4 bytes of ``x`` in reverse order (LLVM makes this one instruction)."""
    return ((x >> _S24) & _B0) | ((x >> _S8) & _B1) | ((x << _S8) & _B2) | ((x << _S24) & _B3)


@njit(cache=True)
def encode(tokens: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint8]:
    """The msgpack array of ``tokens``, each int in its shortest unsigned format (as msgspec writes
    it). O(tokens)."""
    n = tokens.size
    out = np.empty(5 + 5 * n + 8, np.uint8)  # each token writes a whole word, of which it keeps up to 5 bytes
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
        t = np.uint64(tokens[i])
        c = int(t >= 128) + int(t >= 256) + 2 * int(t >= 65536)
        be = _bswap32((t << _ENC_SHIFT[c]) & _LOW32)  # in memory: the payload's bytes, big-endian, first
        store64(out, p, _ENC_PREFIX[c] | (be << _ENC_AFTER[c]))
        # The bytes written are c + 1 in every class (1, 2, 3, 5): the next position is an add away from this
        # one, with no table load on the chain from one element's position to the next's.
        p += c + 1
    return out[:p]


@njit(inline="always")
def _be(b: npt.NDArray[np.uint8], p: int, size: int) -> int:
    v = 0
    for k in range(size):
        v = (v << 8) | int(b[p + k])
    return v


@njit(inline="always")
def _array_head(b: npt.NDArray[np.uint8], p: int, size: int) -> tuple[int, int]:
    """``(elements, position after the header)`` of the msgpack array at ``p``, or ``(-1, p)`` if none is
    there."""
    if p >= size:
        return -1, p
    c = int(b[p])
    if 0x90 <= c <= 0x9F:
        return c & 0x0F, p + 1
    if c == 0xDC and p + 3 <= size:
        return _be(b, p + 1, 2), p + 3
    if c == 0xDD and p + 5 <= size:
        return _be(b, p + 1, 4), p + 5
    return -1, p


@njit(cache=True)
def _read_ints(b: npt.NDArray[np.uint8], p: int, size: int, n: int, out: npt.NDArray[np.uint32], o: int) -> int:
    """Reads ``n`` msgpack ints in ``[0, 2**32)`` (any int format) from ``p`` into ``out[o:o + n]``; the
    position after them, or -1 if an element is something else, out of range, or past ``size``. O(n)."""
    if n > size - p:  # every element takes at least a byte
        return -1
    # The formats msgspec writes for ids under 2**32 (positive fixint, uint 8/16/32), while a word from the
    # format byte is in bounds; anything else, and the last elements, by the general loop below.
    done = 0
    while done < n and p + 8 <= size:  # one word read per element: its format byte and the 4 bytes after it
        head = _r64(b, p)
        c = int(head & _B0)
        fix = c < 0x80
        if not (fix or 0xCC <= c <= 0xCE):
            break
        # Arithmetic, not a table, on the chain from one element's position to the next's (a load is slower).
        width = 0 if fix else 1 << (c - 0xCC)
        word = np.int64(_bswap32((head >> _S8) & _LOW32))
        out[o + done] = c if fix else word >> (32 - 8 * width)
        p += 1 + width
        done += 1
    for i in range(done, n):
        if p >= size:
            return -1
        c = int(b[p])
        if c < 0x80:  # positive fixint
            v, w = c, 1
        elif 0xCC <= c <= 0xD3:  # uint 8/16/32/64, or int 8/16/32/64 (accepted when non-negative)
            signed = c >= 0xD0
            w = 1 << (c - (0xD0 if signed else 0xCC))
            if p + w >= size or (signed and b[p + 1] >= 0x80):
                return -1
            if w == 8 and _be(b, p + 1, 4) != 0:  # past 32 bits
                return -1
            v = _be(b, p + 1 + w - min(w, 4), min(w, 4))
            w += 1
        else:
            return -1
        out[o + i] = v  # under 2**32: no format read above holds more
        p += w
    return p


@njit(cache=True)
def decode(b: npt.NDArray[np.uint8]) -> tuple[bool, npt.NDArray[np.uint32]]:
    """``(True, tokens)`` if ``b`` is exactly one msgpack array of ints in ``[0, 2**32)`` (any int
    format), else ``(False, empty)``: the caller then decodes it the slow way, for its error or its
    out-of-range ids. O(len(b))."""
    fail = np.empty(0, np.uint32)
    size = b.size
    n, p = _array_head(b, 0, size)
    if n < 0 or n > size - p:
        return False, fail
    out = np.empty(n, np.uint32)
    if _read_ints(b, p, size, n, out, 0) != size:
        return False, fail
    return True, out


# --- a whole event batch: its token arrays taken out --------------------------------------------------------

# Per first byte of a msgpack object (see the format's spec): bytes of its fixed part past the first byte (-1:
# none is valid there), bytes of a length field that follows (0: none), and how each length counts (1: payload
# bytes, as str/bin; 2: payload bytes after a type byte, as ext; 3: child objects, as array; 4: child pairs, as
# map).
_FIX = np.full(256, -1, np.int64)
_LEN = np.zeros(256, np.int64)
_KIND = np.zeros(256, np.int64)
_FIX[:0x80] = 0  # positive fixint
_FIX[0xE0:] = 0  # negative fixint
_FIX[0x80:0xC0] = 0  # fixmap, fixarray, fixstr: the count is in the first byte
_FIX[0xC0] = _FIX[0xC2] = _FIX[0xC3] = 0  # nil, false, true
for _c, _n in ((0xCA, 4), (0xCB, 8), (0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8), (0xD0, 1), (0xD1, 2), (0xD2, 4),
               (0xD3, 8), (0xD4, 2), (0xD5, 3), (0xD6, 5), (0xD7, 9), (0xD8, 17)):
    _FIX[_c] = _n  # floats, ints, fixext (type byte + data)
for _c, _n, _k in ((0xC4, 1, 1), (0xC5, 2, 1), (0xC6, 4, 1), (0xC7, 1, 2), (0xC8, 2, 2), (0xC9, 4, 2), (0xD9, 1, 1),
                   (0xDA, 2, 1), (0xDB, 4, 1), (0xDC, 2, 3), (0xDD, 4, 3), (0xDE, 2, 4), (0xDF, 4, 4)):
    _FIX[_c], _LEN[_c], _KIND[_c] = 0, _n, _k
_TOKEN_IDS = np.frombuffer(b"token_ids", np.uint8)
_BLOCK_STORED = np.frombuffer(b"BlockStored", np.uint8)


@njit(cache=True)
def _head(b: npt.NDArray[np.uint8], p: int, size: int) -> tuple[int, int]:
    """``(position after the object's own bytes, child objects)`` of the msgpack object at ``p``: a scalar, str,
    bin or ext ends there; an array or a map has its children next. ``(-1, 0)`` if it is not valid msgpack
    or runs past ``size``."""
    if p >= size:
        return -1, 0
    c = int(b[p])
    fix = _FIX[c]
    if fix < 0:
        return -1, 0
    q = p + 1 + fix
    lw = _LEN[c]
    if lw == 0:
        if 0x80 <= c <= 0x8F:
            return q, 2 * (c & 0x0F)
        if 0x90 <= c <= 0x9F:
            return q, c & 0x0F
        if 0xA0 <= c <= 0xBF:
            q += c & 0x1F
        return (q, 0) if q <= size else (-1, 0)
    if q + lw > size:
        return -1, 0
    n = _be(b, q, lw)
    q += lw
    kind = _KIND[c]
    if kind == 3:
        return q, n
    if kind == 4:
        return q, 2 * n
    q += n + (1 if kind == 2 else 0)
    return (q, 0) if q <= size else (-1, 0)


@njit(cache=True)
def _skip(b: npt.NDArray[np.uint8], p: int, size: int) -> int:
    """The position after the msgpack object at ``p`` (children and all), or -1. O(its bytes)."""
    left = 1
    while left:
        p, children = _head(b, p, size)
        if p < 0:
            return -1
        left += children - 1
    return p


@njit(cache=True)
def _is_str(b: npt.NDArray[np.uint8], p: int, size: int, want: npt.NDArray[np.uint8]) -> bool:
    """Whether the object at ``p`` is the str ``want`` (in any str format)."""
    c = int(b[p])
    if 0xA0 <= c <= 0xBF:
        n, q = c & 0x1F, p + 1
    elif c == 0xD9 and p + 2 <= size:
        n, q = int(b[p + 1]), p + 2
    elif c == 0xDA and p + 3 <= size:
        n, q = _be(b, p + 1, 2), p + 3
    else:
        return False
    if n != want.size or q + n > size:
        return False
    for i in range(n):  # noqa: SIM110 (numba compiles no generator)
        if b[q + i] != want[i]:
            return False
    return True


@njit(inline="always")
def _take_array(b: npt.NDArray[np.uint8], p: int, size: int, out: npt.NDArray[np.uint8], o: int, copied: int,
                tokens: npt.NDArray[np.uint32], nt: int, spans: npt.NDArray[np.int64], ev: int) -> tuple[int, int, int]:
    """Takes the token array at ``p`` out of the batch: its ids go to ``tokens[nt:]`` as event ``ev``'s, and ``out``
    gets the batch from ``copied`` up to the array, then an empty array. ``(position after the array, bytes in
    out, ids read)``; a position of -1 if it is not an array of ids in range."""
    n, q = _array_head(b, p, size)
    end = _read_ints(b, q, size, n, tokens, nt) if n >= 0 else -1
    if end < 0:
        return -1, o, nt
    spans[ev, 0], spans[ev, 1], spans[ev, 2] = 1, nt, n
    out[o:o + p - copied] = b[copied:p]
    o += p - copied
    out[o] = 0x90
    return end, o + 1, nt + n


@njit(cache=True)
def strip_tokens(b: npt.NDArray[np.uint8]) -> tuple[int, npt.NDArray[np.uint8], npt.NDArray[np.uint32],
                                                    npt.NDArray[np.int64]]:
    """An event batch ``[ts, [events...], ...]`` with each BlockStored's token array taken out: ``(events, the
    batch with every such array written as an empty one, the token ids, spans)``; ``spans[i]`` = [1, first,
    count] where event ``i``'s ids are ``tokens[first:first + count]``, else [0, 0, 0]. The token arrays are the
    ``token_ids`` value of a map event, and the fourth element of an array event tagged ``BlockStored``. ``events``
    is -1 where the batch is not plainly that (not msgpack, other top-level shapes, a token array with an
    element not an int in ``[0, 2**32)``, a map with ``token_ids`` twice, trailing bytes): the caller then
    decodes the whole payload the slow way, for its error or its out-of-range ids. O(len(b))."""
    size = b.size
    fail = (-1, np.empty(0, np.uint8), np.empty(0, np.uint32), np.empty((0, 3), np.int64))
    top, p = _array_head(b, 0, size)
    if top < 2:
        return fail
    p = _skip(b, p, size)  # ts
    if p < 0:
        return fail
    ne, p = _array_head(b, p, size)
    if ne < 0 or ne > size - p:
        return fail
    out = np.empty(size, np.uint8)
    tokens = np.empty(size, np.uint32)  # each id takes a byte at least
    spans = np.zeros((ne, 3), np.int64)
    o = 0  # bytes written to out
    copied = 0  # input bytes up to here are in out
    nt = 0  # token ids read
    for ev in range(ne):
        if p >= size:
            return fail
        c = int(b[p])
        fields, q = -1, p
        if 0x80 <= c <= 0x8F:
            fields, q = c & 0x0F, p + 1
        elif c == 0xDE and p + 3 <= size:
            fields, q = _be(b, p + 1, 2), p + 3
        if fields >= 0:  # a map: find its token_ids
            p = q
            for _ in range(fields):
                if p >= size:
                    return fail
                key = _is_str(b, p, size, _TOKEN_IDS)
                p = _skip(b, p, size)
                if p < 0:
                    return fail
                if key:
                    if spans[ev, 0]:
                        return fail
                    end, o, nt = _take_array(b, p, size, out, o, copied, tokens, nt, spans, ev)
                    if end < 0:
                        return fail
                    copied = p = end
                else:
                    p = _skip(b, p, size)
                    if p < 0:
                        return fail
            continue
        n, q = _array_head(b, p, size)
        if n >= 4 and q < size and _is_str(b, q, size, _BLOCK_STORED):  # [tag, hashes, parent, token_ids, ...]
            p = q
            for _ in range(3):
                p = _skip(b, p, size)
                if p < 0:
                    return fail
            end, o, nt = _take_array(b, p, size, out, o, copied, tokens, nt, spans, ev)
            if end < 0:
                return fail
            copied = p = end
            for _ in range(n - 4):
                p = _skip(b, p, size)
                if p < 0:
                    return fail
            continue
        p = _skip(b, p, size)  # another event: copied as it is
        if p < 0:
            return fail
    for _ in range(top - 2):
        p = _skip(b, p, size)
        if p < 0:
            return fail
    if p != size:
        return fail
    out[o:o + size - copied] = b[copied:size]
    o += size - copied
    return ne, out[:o], tokens[:nt], spans


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
