"""Block keys in one compiled pass: XXH3-64 and the key chain of :mod:`kvtier.indexer.index.keys`, in numba.

:func:`kvtier.indexer.index.keys.chain_keys` makes two xxhash calls per block from Python (one for the
block's tokens, one to chain it): an interpreter round trip per block, which costs a query more than the
lookups it feeds. Here the whole chain runs as one compiled loop over the packed tokens (figures:
``bench/MEASUREMENTS.md``).

Imported only by :mod:`kvtier.indexer.index.keys`, lazily, the first time keys are needed, so that
``import kvtier.indexer`` does not pay for numba (see ``keys.key_backend``). Compiled functions are
cached on disk (``cache=True``): the first process compiles them, later ones load them.

The hash follows the XXH3 specification (64-bit variant with a seed; every input length, so the tests
can check it against the ``xxhash`` library on any input). Arithmetic is on ``uint64`` throughout:
numba turns a ``uint64`` mixed with a plain ``int`` into a float, so every constant and shift count is
a ``uint64``.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvtier.kernels.unaligned import load

_u = np.uint64

# XXH3's default secret (192 bytes), from the specification.
_SECRET = np.frombuffer(bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e"), dtype=np.uint8)

_P32_1, _P32_2, _P32_3 = _u(0x9E3779B1), _u(0x85EBCA77), _u(0xC2B2AE3D)
_P64_1, _P64_2, _P64_3 = _u(0x9E3779B185EBCA87), _u(0xC2B2AE3D27D4EB4F), _u(0x165667B19E3779F9)
_P64_4, _P64_5 = _u(0x85EBCA77C2B2AE63), _u(0x27D4EB2F165667C5)
_MX1, _MX2 = _u(0x165667919E3779F9), _u(0x9FB21C651E98DF25)
_M32 = _u(0xFFFFFFFF)
_STRIPE = 64  # bytes per stripe of the long-input loop
_S8, _S16, _S24, _S28, _S29, _S32 = _u(8), _u(16), _u(24), _u(28), _u(29), _u(32)
_S33, _S35, _S37, _S40, _S47 = _u(33), _u(35), _u(37), _u(40), _u(47)


_r64 = load(64)  # the keys are little-endian, as the machine must be (see kvtier.kernels.unaligned)
_r32 = load(32)


@njit(inline="always")
def _fold(a: np.uint64, b: np.uint64) -> np.uint64:
    """The 128-bit product of ``a`` and ``b``, its halves xor-ed (from four 32x32-bit products)."""
    lo_lo = (a & _M32) * (b & _M32)
    hi_lo = (a >> _S32) * (b & _M32)
    lo_hi = (a & _M32) * (b >> _S32)
    hi_hi = (a >> _S32) * (b >> _S32)
    cross = (lo_lo >> _S32) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> _S32) + (cross >> _S32) + hi_hi
    lower = (cross << _S32) | (lo_lo & _M32)
    return lower ^ upper


@njit(inline="always")
def _avalanche(h: np.uint64) -> np.uint64:
    h ^= h >> _S37
    h *= _MX1
    return h ^ (h >> _S32)


@njit(inline="always")
def _avalanche64(h: np.uint64) -> np.uint64:
    h ^= h >> _S33
    h *= _P64_2
    h ^= h >> _S29
    h *= _P64_3
    return h ^ (h >> _S32)


@njit(inline="always")
def _swap64(x: np.uint64) -> np.uint64:
    x = ((x & _u(0x00FF00FF00FF00FF)) << _S8) | ((x >> _S8) & _u(0x00FF00FF00FF00FF))
    x = ((x & _u(0x0000FFFF0000FFFF)) << _S16) | ((x >> _S16) & _u(0x0000FFFF0000FFFF))
    return (x << _S32) | (x >> _S32)


@njit(inline="always")
def _mix16(b: npt.NDArray[np.uint8], i: int, s: npt.NDArray[np.uint8], j: int, seed: np.uint64) -> np.uint64:
    return _fold(_r64(b, i) ^ (_r64(s, j) + seed), _r64(b, i + 8) ^ (_r64(s, j + 8) - seed))


@njit(inline="always")
def _words(first: np.uint64, last: np.uint64, n: int, seed: np.uint64) -> np.uint64:
    """XXH3-64 of an input of 9 to 16 bytes with ``seed``, given its first and its last 8 bytes."""
    s = _SECRET
    lo = first ^ ((_r64(s, 24) ^ _r64(s, 32)) + seed)
    hi = last ^ ((_r64(s, 40) ^ _r64(s, 48)) - seed)
    return _avalanche(_u(n) + _swap64(lo) + hi + _fold(lo, hi))


@njit(cache=True)
def _custom_secret(seed: np.uint64) -> npt.NDArray[np.uint8]:
    """The secret of the long-input loop for ``seed``: each 16-byte lane of the default secret with
    ``seed`` added to its low word and subtracted from its high word."""
    out = np.empty(_SECRET.size, np.uint8)
    for k in range(_SECRET.size // 8):
        w = _r64(_SECRET, 8 * k) + seed if k % 2 == 0 else _r64(_SECRET, 8 * k) - seed
        for j in range(8):
            out[8 * k + j] = np.uint8((w >> _u(8 * j)) & _u(0xFF))
    return out


@njit(inline="always")
def _lanes(a0: np.uint64, a1: np.uint64, b: npt.NDArray[np.uint8], i: int, s: npt.NDArray[np.uint8],
           j: int) -> tuple[np.uint64, np.uint64]:
    """One pair of accumulators after a stripe's two lanes at ``b[i:i + 16]``: each lane's value goes to
    its neighbour, its 32x32-bit product with the secret to itself."""
    v0, v1 = _r64(b, i), _r64(b, i + 8)
    k0, k1 = v0 ^ _r64(s, j), v1 ^ _r64(s, j + 8)
    return a0 + v1 + (k0 & _M32) * (k0 >> _S32), a1 + v0 + (k1 & _M32) * (k1 >> _S32)


@njit(inline="always")
def _scramble(a: np.uint64, s: npt.NDArray[np.uint8], j: int) -> np.uint64:
    return ((a ^ (a >> _S47)) ^ _r64(s, j)) * _P32_1


@njit(cache=True)
def _long(b: npt.NDArray[np.uint8], off: int, n: int, cs: npt.NDArray[np.uint8]) -> np.uint64:
    """Inputs over 240 bytes: eight accumulators over 64-byte stripes, scrambled after each block of
    16 stripes, then merged. ``cs`` is :func:`_custom_secret` of the seed. The accumulators are locals
    (registers), one pair per :func:`_lanes` call."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1
    per_block = (cs.size - _STRIPE) // 8
    block = _STRIPE * per_block
    blocks = (n - 1) // block
    last = (n - 1 - blocks * block) // _STRIPE  # stripes in the last, partial block
    for blk in range(blocks + 1):
        base = off + blk * block
        for st in range(per_block if blk < blocks else last):
            p, q = base + st * _STRIPE, st * 8
            a0, a1 = _lanes(a0, a1, b, p, cs, q)
            a2, a3 = _lanes(a2, a3, b, p + 16, cs, q + 16)
            a4, a5 = _lanes(a4, a5, b, p + 32, cs, q + 32)
            a6, a7 = _lanes(a6, a7, b, p + 48, cs, q + 48)
        if blk < blocks:
            q = cs.size - _STRIPE
            a0, a1, a2, a3 = _scramble(a0, cs, q), _scramble(a1, cs, q + 8), _scramble(a2, cs, q + 16), \
                _scramble(a3, cs, q + 24)
            a4, a5, a6, a7 = _scramble(a4, cs, q + 32), _scramble(a5, cs, q + 40), _scramble(a6, cs, q + 48), \
                _scramble(a7, cs, q + 56)
    p, q = off + n - _STRIPE, cs.size - _STRIPE - 7
    a0, a1 = _lanes(a0, a1, b, p, cs, q)
    a2, a3 = _lanes(a2, a3, b, p + 16, cs, q + 16)
    a4, a5 = _lanes(a4, a5, b, p + 32, cs, q + 32)
    a6, a7 = _lanes(a6, a7, b, p + 48, cs, q + 48)
    h = _u(n) * _P64_1
    h += _fold(a0 ^ _r64(cs, 11), a1 ^ _r64(cs, 19))
    h += _fold(a2 ^ _r64(cs, 27), a3 ^ _r64(cs, 35))
    h += _fold(a4 ^ _r64(cs, 43), a5 ^ _r64(cs, 51))
    h += _fold(a6 ^ _r64(cs, 59), a7 ^ _r64(cs, 67))
    return _avalanche(h)


@njit(cache=True)
def xxh3(b: npt.NDArray[np.uint8], off: int, n: int, seed: np.uint64, cs: npt.NDArray[np.uint8]) -> np.uint64:
    """XXH3-64 of ``b[off:off + n]`` with ``seed``; ``cs`` is ``_custom_secret(seed)`` (read only for inputs
    over 240 bytes). Equals ``xxhash.xxh3_64_intdigest(bytes(b[off:off + n]), seed)``. O(n)."""
    s = _SECRET
    if n <= 16:
        if n > 8:
            return _words(_r64(b, off), _r64(b, off + n - 8), n, seed)
        if n >= 4:
            sd = seed ^ (_swap64(seed & _M32) & ~_M32)  # the low word, byte-swapped, into the high word
            x = (_r32(b, off + n - 4) + (_r32(b, off) << _S32)) ^ ((_r64(s, 8) ^ _r64(s, 16)) - sd)
            x ^= ((x << _u(49)) | (x >> _u(15))) ^ ((x << _S24) | (x >> _S40))  # two rotations
            x *= _MX2
            x ^= (x >> _S35) + _u(n)
            x *= _MX2
            return x ^ (x >> _S28)
        if n > 0:
            c = (_u(b[off]) << _S16) | (_u(b[off + (n >> 1)]) << _S24) | _u(b[off + n - 1]) | (_u(n) << _S8)
            return _avalanche64(c ^ ((_r32(s, 0) ^ _r32(s, 4)) + seed))
        return _avalanche64(seed ^ (_r64(s, 56) ^ _r64(s, 64)))
    if n <= 128:
        h = _u(n) * _P64_1
        if n > 32:
            if n > 64:
                if n > 96:
                    h += _mix16(b, off + 48, s, 96, seed)
                    h += _mix16(b, off + n - 64, s, 112, seed)
                h += _mix16(b, off + 32, s, 64, seed)
                h += _mix16(b, off + n - 48, s, 80, seed)
            h += _mix16(b, off + 16, s, 32, seed)
            h += _mix16(b, off + n - 32, s, 48, seed)
        h += _mix16(b, off, s, 0, seed)
        h += _mix16(b, off + n - 16, s, 16, seed)
        return _avalanche(h)
    if n <= 240:
        h = _u(n) * _P64_1
        for k in range(8):
            h += _mix16(b, off + 16 * k, s, 16 * k, seed)
        h = _avalanche(h)
        for k in range(8, n // 16):
            h += _mix16(b, off + 16 * k, s, 16 * (k - 8) + 3, seed)
        h += _mix16(b, off + n - 16, s, 136 - 17, seed)
        return _avalanche(h)
    return _long(b, off, n, cs)


@njit(inline="always")
def _pair(a: np.uint64, c: np.uint64, seed: np.uint64) -> np.uint64:
    """XXH3-64 of ``le64(a) || le64(c)`` (16 bytes) with ``seed``, without the bytes."""
    return _words(a, c, 16, seed)


@njit(cache=True)
def chain(buf: npt.NDArray[np.uint8], step: int, base: np.uint64, has_base: bool,
          seed: np.uint64) -> npt.NDArray[np.uint64]:
    """The chained keys of the full ``step``-byte blocks of ``buf``: block ``i``'s key is
    ``pair(key[i-1], local[i])``, with ``key[-1] = base`` when ``has_base``, else ``key[0] = local[0]``.
    O(len(buf))."""
    out = np.empty(buf.size // step, np.uint64)
    chain_into(buf, step, base, has_base, seed, out)
    return out


@njit(cache=True)
def chain_into(buf: npt.NDArray[np.uint8], step: int, base: np.uint64, has_base: bool, seed: np.uint64,
               out: npt.NDArray[np.uint64]) -> None:
    """:func:`chain` written into ``out`` (one entry per full block of ``buf``; the index's store kernel keeps
    it for the store that follows). O(len(buf))."""
    n = buf.size // step
    cs = _custom_secret(seed) if step > 240 else _SECRET
    prev = base
    for i in range(n):
        loc = xxh3(buf, i * step, step, seed, cs)
        prev = _pair(prev, loc, seed) if (i or has_base) else loc
        out[i] = prev
