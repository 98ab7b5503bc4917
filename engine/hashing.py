"""SGLang's page hash chain: the engine-side block hashes published in events.

``digest = SHA-256(parent digest || page tokens as uint32 little-endian)`` (the root's
parent digest is empty); the event hash is the digest's first 8 bytes as a big-endian
signed int64. Pinned against captured SGLang frames in the tests.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import numpy as np

from kvtier.wire.protocol import TOKEN_BYTES, PackedTokens, pack_tokens

ROOT_DIGEST = b""
_DIGEST_BYTES = 32  # SHA-256


def page_digest(parent_digest: bytes, page_tokens: Sequence[int] | PackedTokens) -> bytes:
    """The 32-byte digest of one page. O(page size)."""
    return hashlib.sha256(parent_digest + pack_tokens(page_tokens)).digest()


def event_hash(digest: bytes) -> int:
    """The int64 hash SGLang publishes for a page digest. O(1)."""
    return int.from_bytes(digest[:8], "big", signed=True)


def event_hashes(digests: list[bytes]) -> list[int]:
    """:func:`event_hash` of each digest, in one pass over their joined bytes (a prompt's pages are hashed
    by the hundred). O(digests)."""
    joined = b"".join(digests)
    assert len(joined) == _DIGEST_BYTES * len(digests), "page digests are 32 bytes each"
    words: list[int] = np.frombuffer(joined, dtype=">i8")[::_DIGEST_BYTES // 8].tolist()
    return words


def iter_chain(parent_digest: bytes, tokens: Sequence[int] | PackedTokens, page_size: int) -> Iterator[bytes]:
    """Like :func:`chain`, lazily: a caller that stops at the first miss hashes no further."""
    buf = memoryview(pack_tokens(tokens))  # pages are read in place, not sliced out as copies
    step = page_size * TOKEN_BYTES
    d = parent_digest
    sha256 = hashlib.sha256
    for off in range(0, len(buf) - step + 1, step):
        d = sha256(d + buf[off:off + step]).digest()
        yield d


def chain(parent_digest: bytes, tokens: Sequence[int] | PackedTokens, page_size: int) -> list[bytes]:
    """Digests of the full pages of ``tokens`` following ``parent_digest`` (a trailing partial page has
    none). O(len(tokens))."""
    return list(iter_chain(parent_digest, tokens, page_size))
