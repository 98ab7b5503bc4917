"""Router-side block keys, computed from token ids (SPEC section 2).

Per block ``local = xxh3_64(tokens as uint32 LE, seed=1337)``; chained
``key[0] = local[0]``, ``key[i] = xxh3_64(le64(key[i-1]) || le64(local[i]), seed=1337)``.
These are the keys Dynamo's router computes, so requests hashed either way agree.

A LoRA adapter name or a cache salt opens a separate key space: the first key is
then ``xxh3_64(le64(ns) || le64(local[0]))`` with ``ns = xxh3_64(utf8(lora_name "\\0" salt))``,
and the chain carries the difference into every later key.

Multimodal inputs and prompt embeddings scope single blocks, as in vLLM's block hashes: a block
with such extra keys gets ``key[i] = xxh3_64(le64(chained key) || le64(extra))`` where ``extra`` is
the xxh3 of the msgpack of its extra items, in order. vLLM 0.33 publishes them per block in
``BlockStored.extra_keys``, untagged: the LoRA name first (when ``lora_name`` is set), then
``(mm_identifier, offset in block)`` pairs, then the cache salt (first block of a request only),
then prompt-embedding digests (bytes). :func:`split_extra_keys` maps that list into this key
space (the salt joins the namespace, the rest becomes per-block extras), and :func:`mm_block_extras`
computes the same extras for a query from its multimodal items' positions, as vLLM does.

Two implementations compute the same keys: a compiled loop (:mod:`kvtier.kernels.keykernel`, numba),
loaded on first use, and xxhash calls from Python, used when numba cannot be imported, when the
environment sets ``KVTIER_JIT=0``, for chains with per-block extras, and for chains too short to repay
the compiled call. :func:`key_backend` says which one runs.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NewType, cast

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from kvtier.kernels import jit
from kvtier.wire.protocol import TOKEN_BYTES, PackedTokens, pack_tokens

#: A router-side block key: identifies a block together with its whole prefix.
BlockKey = NewType("BlockKey", int)


class KeyList(list[BlockKey]):
    """Keys from the compiled chain, with the ``uint64`` array they came as (``arr``): the index's compiled tables
    read the array instead of converting the list back (:meth:`kvtier.indexer.index.keytable.KeyTable.array`)."""

    __slots__ = ("arr",)

    def __init__(self, arr: npt.NDArray[np.uint64]) -> None:
        super().__init__(arr.tolist())
        self.arr = arr  # the same keys (readers check the length, in case the list was changed)


SEED = 1337
_PAIR = struct.Struct("<QQ")
_h = xxhash.xxh3_64_intdigest

#: Chains of fewer blocks go through Python: the compiled call's fixed cost (argument typing, the result
#: list) is about that of two blocks' xxhash calls.
_MIN_COMPILED_BLOCKS = 4
_SEED = np.uint64(SEED)
#: The compiled chain, warmed with the argument types chain_keys passes (a read-only byte view).
_KERNELS = jit.LazyKernels("kvtier.kernels.keykernel", lambda k: k.chain(
    np.frombuffer(bytes(2 * TOKEN_BYTES), np.uint8), TOKEN_BYTES, np.uint64(0), False, _SEED))


def key_backend(load: bool = True) -> str:
    """``"numba"`` when chains are computed by the compiled kernel, else ``"python (why)"``; ``load``
    imports and compiles it now (a service calls this at start so that the first request does not pay),
    else ``"not loaded"`` before the first chain. O(1) after the first call."""
    if load:
        _KERNELS.get()
    return _KERNELS.backend or "not loaded"


def namespace(lora_name: str | None, cache_salt: str | None) -> int | None:
    """The key-space id for a LoRA name and cache salt; ``None`` for the base space. O(1)."""
    if lora_name is None and cache_salt is None:
        return None
    return _h(f"{lora_name or ''}\0{cache_salt or ''}".encode(), seed=SEED)


def chain_keys(
    token_ids: Sequence[int] | PackedTokens,
    block_size: int,
    parent: BlockKey | None = None,
    ns: int | None = None,
    extras: Sequence[int | None] | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (ids, or packed) continuing the chain after ``parent``.

    A trailing partial block gets no key. ``ns`` (from :func:`namespace`) applies
    only under the root (``parent is None``): the parent key already carries it.
    ``extras`` (one per block, from :func:`extra_digest`) scope single blocks.
    O(len(token_ids)).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    buf = pack_tokens(token_ids)
    step = block_size * TOKEN_BYTES
    n = len(buf) // step
    if not n:
        return []
    base = parent if parent is not None else ns
    if extras is None and n >= _MIN_COMPILED_BLOCKS and (kernels := _KERNELS.get()) is not None:
        return KeyList(kernels.chain(np.frombuffer(buf, np.uint8), step, np.uint64(base or 0), base is not None, _SEED))
    # Hot path (every event applied and every query): the seed goes positionally (xxhash parses keyword
    # arguments at several times the cost of a 64-byte hash) and blocks are hashed from a view, not copied.
    h = _h
    view = memoryview(buf)
    local = [h(view[off:off + step], SEED) for off in range(0, n * step, step)]
    pack = _PAIR.pack
    prev = local[0] if base is None else h(pack(base, local[0]), SEED)
    if extras is None:
        keys = [prev]
        keys += [prev := h(pack(prev, loc), SEED) for loc in local[1:]]
        return cast(list[BlockKey], keys)
    keys = []
    for i, loc in enumerate(local):
        if i:
            prev = h(pack(prev, loc), SEED)
        e = extras[i] if i < len(extras) else None
        if e is not None:
            prev = h(pack(prev, e), SEED)
        keys.append(prev)
    return cast(list[BlockKey], keys)


_encode = msgspec.msgpack.Encoder().encode


def extra_digest(items: Sequence[Any]) -> int | None:
    """The per-block extra of ``items`` (multimodal pairs, embedding digests); None if empty. O(items).

    Pairs are hashed as lists, so a tuple sent by an engine and the list msgpack decodes it to agree.
    """
    if not items:
        return None
    norm = [list(i) if isinstance(i, tuple) else i for i in items]
    return _h(_encode(norm), seed=SEED)


def split_extra_keys(
    extra_keys: Sequence[Any] | None, lora_name: str | None
) -> tuple[str | None, list[int | None] | None]:
    """Maps vLLM's published per-block ``extra_keys`` into this key space: ``(cache salt, per-block extras)``.

    Per block, in vLLM's order: the LoRA name when ``lora_name`` is set (carried by the namespace
    already, so dropped), ``(identifier, offset)`` pairs, the cache salt (a string, first block of
    a request only), prompt-embedding digests (bytes). Raises ``ValueError`` for an entry of another
    shape. O(items).
    """
    if not extra_keys:
        return None, None
    salt: str | None = None
    per_block: list[int | None] = []
    for i, entry in enumerate(extra_keys):
        if entry is None:
            per_block.append(None)
            continue
        if not isinstance(entry, list | tuple):
            raise ValueError(f"extra_keys[{i}] is {type(entry).__name__}, expected a list or null")
        items = list(entry)
        if lora_name is not None and items and items[0] == lora_name:
            items = items[1:]
        scoped: list[Any] = []
        for item in items:
            if isinstance(item, str):
                if i != 0 or salt is not None:
                    raise ValueError(f"extra_keys[{i}]: unexpected string {item!r} (a salt scopes block 0 only)")
                salt = item
            elif isinstance(item, bytes) or (isinstance(item, list | tuple) and len(item) == 2
                                             and isinstance(item[0], str) and type(item[1]) is int):
                scoped.append(item)
            else:
                raise ValueError(f"extra_keys[{i}]: unrecognised item {item!r}")
        per_block.append(extra_digest(scoped))
    return salt, per_block if any(e is not None for e in per_block) else None


def mm_block_extras(
    num_tokens: int, block_size: int, mm_items: Sequence[tuple[str, int, int]]
) -> list[int | None] | None:
    """Per-block extras of a query from its multimodal items ``(identifier, offset, length)``,
    placed as vLLM places them: each block lists ``(identifier, item offset - block start)`` for the
    items overlapping it, in item order (by offset). One sweep over the blocks with the items that overlap the
    current one: O(blocks + items log items + the (block, item) overlaps). A block inside one item hashes only its
    offset on top of that item's hashed prefix (:func:`extra_digest` of the pair, streamed), so a long identifier
    costs once per item, not once per block."""
    if not mm_items:
        return None
    items = sorted(mm_items, key=lambda m: m[1])
    out: list[int | None] = []
    active: list[tuple[str, int, int]] = []  # items begun before this block's end, in offset order
    nxt = 0  # the first item not begun yet
    prefixes: dict[tuple[str, int, int], Any] = {}  # item -> xxh3 of its lone pair's msgpack but the offset
    for b in range(num_tokens // block_size):
        start, end = b * block_size, (b + 1) * block_size
        while nxt < len(items) and items[nxt][1] < end:
            active.append(items[nxt])
            nxt += 1
        if active:
            active = [m for m in active if m[1] + m[2] > start]  # those ended before this block go
        if len(active) == 1:
            item = active[0]
            base = prefixes.get(item)
            if base is None:  # [[identifier, 0]] with its final 0 (one byte) left for the offset
                base = prefixes[item] = xxhash.xxh3_64(_encode([[item[0], 0]])[:-1], seed=SEED)
            h = base.copy()
            h.update(_encode(item[1] - start))
            out.append(h.intdigest())
        else:
            out.append(extra_digest([(ident, off - start) for ident, off, _ in active]))
    return out


def block_keys(
    token_ids: Sequence[int] | PackedTokens,
    block_size: int,
    *,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[tuple[str, int, int]] | None = None,
) -> list[BlockKey]:
    """Keys of a request's full blocks (token ids, or packed), from the root. O(len(token_ids) +
    multimodal items)."""
    buf = pack_tokens(token_ids)
    extras = mm_block_extras(len(buf) // TOKEN_BYTES, block_size, mm_items or ())
    return chain_keys(buf, block_size, None, namespace(lora_name, cache_salt), extras)
