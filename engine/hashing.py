"""SGLang's page hash chain: the engine-side block hashes published in events.

``digest = SHA-256(parent digest || page tokens as uint32 little-endian)`` (the root's
parent digest is empty); the event hash is the digest's first 8 bytes as a big-endian
signed int64. Pinned against captured SGLang frames in the tests.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

ROOT_DIGEST = b""


def page_digest(parent_digest: bytes, page_tokens: Sequence[int]) -> bytes:
    """The 32-byte digest of one page. O(page size)."""
    return hashlib.sha256(parent_digest + array("I", page_tokens).tobytes()).digest()


def event_hash(digest: bytes) -> int:
    """The int64 hash SGLang publishes for a page digest. O(1)."""
    return int.from_bytes(digest[:8], "big", signed=True)


def iter_chain(parent_digest: bytes, tokens: Sequence[int], page_size: int) -> Iterator[bytes]:
    """Like :func:`chain`, lazily: a caller that stops at the first miss hashes no further."""
    d = parent_digest
    for i in range(0, len(tokens) - page_size + 1, page_size):
        d = page_digest(d, tokens[i:i + page_size])
        yield d


def chain(parent_digest: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Digests of the full pages of ``tokens`` following ``parent_digest``. O(len(tokens))."""
    out = []
    d = parent_digest
    for i in range(0, len(tokens) - page_size + 1, page_size):
        d = page_digest(d, tokens[i:i + page_size])
        out.append(d)
    return out
