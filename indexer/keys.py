"""Router-side block keys, computed from token ids (SPEC section 2).

Per block ``local = xxh3_64(tokens as uint32 LE, seed=1337)``; chained
``key[0] = local[0]``, ``key[i] = xxh3_64(le64(key[i-1]) || le64(local[i]), seed=1337)``.
These are the keys Dynamo's router computes, so requests hashed either way agree.

A LoRA adapter name or a cache salt opens a separate key space: the first key is
then ``xxh3_64(le64(ns) || le64(local[0]))`` with ``ns = xxh3_64(utf8(lora_name "\\0" salt))``,
and the chain carries the difference into every later key.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

#: A router-side block key: identifies a block together with its whole prefix.
BlockKey = NewType("BlockKey", int)

SEED = 1337
_PAIR = struct.Struct("<QQ")
_h = xxhash.xxh3_64_intdigest


def namespace(lora_name: str | None, cache_salt: str | None) -> int | None:
    """The key-space id for a LoRA name and cache salt; ``None`` for the base space. O(1)."""
    if lora_name is None and cache_salt is None:
        return None
    return _h(f"{lora_name or ''}\0{cache_salt or ''}".encode(), seed=SEED)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array("I", token_ids).tobytes()
    except OverflowError:
        raise ValueError("token ids must fit in uint32") from None


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent: BlockKey | None = None,
    ns: int | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` continuing the chain after ``parent``.

    A trailing partial block gets no key. ``ns`` (from :func:`namespace`) applies
    only under the root (``parent is None``): the parent key already carries it.
    O(len(token_ids)).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    buf = _token_bytes(token_ids)
    step = block_size * 4
    n = len(token_ids) // block_size
    keys: list[BlockKey] = []
    prev = parent
    pack = _PAIR.pack
    for off in range(0, n * step, step):
        local = _h(buf[off:off + step], seed=SEED)
        if prev is None:
            prev = BlockKey(local if ns is None else _h(pack(ns, local), seed=SEED))
        else:
            prev = BlockKey(_h(pack(prev, local), seed=SEED))
        keys.append(prev)
    return keys


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[BlockKey]:
    """Keys of a request's full blocks, from the root. O(len(token_ids))."""
    return chain_keys(token_ids, block_size, None, namespace(lora_name, cache_salt))
