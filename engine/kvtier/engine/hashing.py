"""SGLang's page hash chain: the engine-side block hashes published in events.

``digest = SHA-256(parent digest || page tokens as uint32 little-endian)`` (the root's
parent digest is empty); the event hash is the digest's first 8 bytes as a big-endian
signed int64 (the rule: :mod:`kvtier.wire.pagehash`). Pinned against captured SGLang frames in the tests.

A node's chain runs as one compiled loop over OpenSSL's SHA-256 where numba and libcrypto load
(:mod:`kvtier.kernels.shakernel`), else page by page through ``hashlib``; a node keeps its digests joined
(:class:`PageDigests`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from kvtier.kernels.jit import LazyKernels
from kvtier.wire.pagehash import ROOT_DIGEST as ROOT_DIGEST  # the rule itself (re-exported: the engine's names)
from kvtier.wire.pagehash import event_hash as event_hash
from kvtier.wire.pagehash import page_digest as page_digest
from kvtier.wire.protocol import TOKEN_BYTES, PackedTokens, pack_tokens

DIGEST_BYTES = 32  # SHA-256


def event_hashes(digests: list[bytes]) -> list[int]:
    """:func:`event_hash` of each digest, in one pass over their joined bytes (a prompt's pages are hashed
    by the hundred). O(digests)."""
    joined = b"".join(digests)
    assert len(joined) == DIGEST_BYTES * len(digests), "page digests are 32 bytes each"
    return _joined_event_hashes(joined)


def _joined_event_hashes(joined: bytes) -> list[int]:
    """:func:`event_hash` of each 32-byte digest of ``joined``. O(digests)."""
    words: list[int] = np.frombuffer(joined, dtype=">i8")[::DIGEST_BYTES // 8].tolist()
    return words


class PageDigests(Sequence[bytes]):
    """A node's page digests, kept as their 32-byte strings joined: a node of 134 pages is one bytes object,
    not 134 (a replay of the Mooncake trace made 1.6M of them). Reads as a sequence of ``bytes``; equal to a
    list of the same digests. Immutable. Indexing O(1); slicing O(pages sliced)."""

    __slots__ = ("joined",)

    def __init__(self, joined: bytes = b"") -> None:
        assert len(joined) % DIGEST_BYTES == 0, f"{len(joined)} bytes is not whole 32-byte digests"
        self.joined = joined  # the digests back to back, page order

    @classmethod
    def of(cls, digests: Sequence[bytes]) -> PageDigests:
        return cls(b"".join(digests))

    def __len__(self) -> int:
        return len(self.joined) // DIGEST_BYTES

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> PageDigests: ...

    def __getitem__(self, i: int | slice) -> bytes | PageDigests:
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            assert step == 1, "page digests slice with step 1 only"
            return PageDigests(self.joined[start * DIGEST_BYTES:max(start, stop) * DIGEST_BYTES])
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"page {i} of {n}")
        return self.joined[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES]

    def __iter__(self) -> Iterator[bytes]:
        j = self.joined
        return (j[o:o + DIGEST_BYTES] for o in range(0, len(j), DIGEST_BYTES))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PageDigests):
            return self.joined == other.joined
        if isinstance(other, list | tuple):
            return (len(other) == len(self) and all(isinstance(d, bytes) for d in other)
                    and b"".join(other) == self.joined)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, so unhashable like them

    def __repr__(self) -> str:
        return f"PageDigests({[d.hex()[:8] for d in self]})"


def iter_chain(parent_digest: bytes, tokens: Sequence[int] | PackedTokens, page_size: int) -> Iterator[bytes]:
    """Like :func:`chain`, lazily: a caller that stops at the first miss hashes no further."""
    buf = memoryview(pack_tokens(tokens))  # pages are read in place, not sliced out as copies
    step = page_size * TOKEN_BYTES
    d = parent_digest
    sha256 = hashlib.sha256
    for off in range(0, len(buf) - step + 1, step):
        d = sha256(d + buf[off:off + step]).digest()
        yield d


def _warm(k: Any) -> None:
    """Compiles (or loads) the kernel for the read-only arrays :func:`chain` passes, and checks it against
    ``hashlib`` once: a library that hashed differently would silently change every event hash."""
    pages = np.frombuffer(bytes(range(256)) * 3, np.uint8).reshape(3, 256)
    parent = np.frombuffer(b"\x01" * DIGEST_BYTES, np.uint8)
    for p in (parent, parent[:0]):
        out = np.empty((3, DIGEST_BYTES), np.uint8)
        want = list(iter_chain(p.tobytes(), pages.tobytes(), 64))
        got = [bytes(r) for r in out] if k.chain(p, pages, out) else want
        assert got == want, "the compiled SHA-256 chain disagrees with hashlib"


#: The compiled chain (:mod:`kvtier.kernels.shakernel`), where numba and OpenSSL's libcrypto load.
_KERNELS = LazyKernels("kvtier.kernels.shakernel", _warm)
_MIN_PAGES = 4  # below this the kernel's fixed cost (array views, dispatch) outweighs the hashlib loop


def chain(parent_digest: bytes, tokens: Sequence[int] | PackedTokens, page_size: int) -> list[bytes]:
    """Digests of the full pages of ``tokens`` following ``parent_digest`` (a trailing partial page has
    none). O(len(tokens))."""
    return list(chain_hashes(parent_digest, tokens, page_size)[0])


def chain_hashes(parent_digest: bytes, tokens: Sequence[int] | PackedTokens,
                 page_size: int) -> tuple[PageDigests, list[int]]:
    """:func:`chain`'s digests and their :func:`event_hash` values. O(len(tokens))."""
    packed = pack_tokens(tokens)
    step = page_size * TOKEN_BYTES
    n = len(packed) // step
    k = _KERNELS.get() if n >= _MIN_PAGES else None
    if k is not None:
        out = np.empty((n, DIGEST_BYTES), np.uint8)
        pages = np.frombuffer(packed, np.uint8, n * step).reshape(n, step)
        if k.chain(np.frombuffer(parent_digest, np.uint8), pages, out):
            return joined_hashes(out.tobytes())
    digests = list(iter_chain(parent_digest, packed, page_size))
    return PageDigests.of(digests), event_hashes(digests)


def joined_hashes(joined: bytes) -> tuple[PageDigests, list[int]]:
    """Digests made elsewhere, joined (32 bytes each, page order), with their :func:`event_hash` values.
    O(digests)."""
    return PageDigests(joined), _joined_event_hashes(joined)


def hash_backend() -> str:
    """How :func:`chain` hashes: ``"numba"`` (OpenSSL from a compiled loop) or ``"python (why)"``. Loads the
    kernel if it is not loaded yet."""
    _KERNELS.get()
    return str(_KERNELS.backend)
