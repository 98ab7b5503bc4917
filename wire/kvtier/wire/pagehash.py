"""SGLang's page hash chain, the rule behind the block hashes a kvtier engine publishes: ``digest = SHA-256(parent
digest || page tokens as uint32 little-endian)`` (the root's parent digest is empty), and the event hash is the
digest's first 8 bytes as a big-endian signed int64.

Kept here, at the bottom, so that whatever checks a page against its hashes (the engine's chain,
:mod:`kvtier.engine.hashing`, and the L3 store's page headers, :mod:`kvtier.engine.l3.pagefile`) reads one rule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvtier.wire.protocol import PackedTokens, pack_tokens

ROOT_DIGEST = b""


def page_digest(parent_digest: bytes, page_tokens: Sequence[int] | PackedTokens) -> bytes:
    """The 32-byte digest of one page. O(page size)."""
    return hashlib.sha256(parent_digest + pack_tokens(page_tokens)).digest()


def event_hash(digest: bytes) -> int:
    """The int64 hash SGLang publishes for a page digest. O(1)."""
    return int.from_bytes(digest[:8], "big", signed=True)


__all__ = ["ROOT_DIGEST", "event_hash", "page_digest"]
