"""The index's snapshot format: what :meth:`kvtier.indexer.index.tiered.TieredIndex.snapshot` writes and
``restore`` reads (msgpack).

Version 2 keeps each worker's blocks as arrays: its block keys in ascending order, its tier bits per block (bit
``tier``, one byte each) and the engine hash naming each block (their 64 bits; the hashes themselves where a worker's
fit no 64-bit table), and the index's links as (parent, child) pairs, all as little-endian bytes. A snapshot is then
written and read in a few compiled passes over the tables, not a Python call per block each way, and its bytes are
canonical: the same index writes the same snapshot however its tables' rows lie. What a worker holds outside its
blocks (ghosts, held orphans, loose blocks, window KV) stays plain msgpack: it is small, or exists only for some
engines.

Version 1 (a list per block) is still read, converted here, so that an upgraded service restores the snapshot its
predecessor wrote. Every check a restore needs is made here or where the arrays go into the tables: a damaged
snapshot raises ``ValueError`` (or a ``msgspec`` error) and no index comes of it.
"""

from __future__ import annotations

from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.closure import Links
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.masklayout import SLOT_MASK, TIERS
from kvtier.indexer.index.relearn import MAX_REMEMBERED
from kvtier.wire.protocol import EngineHash

VERSION = 2
_U64 = np.dtype("<u8")

U64 = npt.NDArray[np.uint64]
Orphans = list[tuple[bytes, int, list[bool], list[int | None] | None]]  # kvtier.indexer.index.orphans.OrphanPool.dump


class WorkerRecord(msgspec.Struct, kw_only=True):
    """One worker stream's part of the index."""

    worker: str
    dp_rank: Annotated[int, msgspec.Meta(ge=0)]
    partial: bool  # events were lost for good
    keys: bytes  # its blocks' keys, ascending (uint64, little-endian)
    bits: bytes  # per key, the tiers it holds the block on (bit ``tier``), one byte each
    hashes: bytes | list[EngineHash]  # per key, the engine hash naming it: 64 bits each, or the hashes themselves
    signed: bool | None  # how 64-bit engine hashes read back (kvtier.indexer.index.keytable.EngineHashes.signed)
    window: Annotated[int, msgspec.Meta(ge=0)]  # window length in blocks (0: untracked)
    inferred: bool  # window KV inferred from stores
    window_bits: list[tuple[BlockKey, int]]  # (key, tiers holding its window KV), for workers that track it
    loose: list[list[BlockKey]] | None  # per tier, held blocks whose parent is not held there; None: unknown
    ghosts: list[tuple[EngineHash, BlockKey]]  # engine hash -> key of blocks dropped at a loss
    orphans: Orphans  # stores held for their parent
    closed_tiers: int  # tiers declared prefix-closed (bit ``tier``)
    ups: list[tuple[EngineHash, EngineHash | None]]  # engine hash -> its parent's (kvtier.indexer.index.relearn)


class Snapshot(msgspec.Struct, kw_only=True):
    version: int
    block_size: int
    window_tokens: int
    workers: list[WorkerRecord]
    links: bytes  # (parent, child) key pairs, uint64 little-endian, sorted


class _Version(msgspec.Struct):
    version: Any = None


class Blocks(NamedTuple):
    """A worker record's blocks, checked."""

    keys: U64  # ascending
    bits: npt.NDArray[np.uint8]  # per key, its tiers (1..SLOT_MASK)
    hashes: U64 | list[EngineHash]  # per key, the engine hash naming it
    loose: list[set[int]] | None  # per tier, loose blocks held there
    window: list[tuple[BlockKey, int]]  # (key, window tiers), each a subset of the key's tiers


def pack(arr: npt.NDArray[Any]) -> bytes:
    """``arr`` as little-endian 64-bit words. O(len)."""
    return arr.astype(_U64, copy=False).tobytes()


def _words(data: bytes, what: str) -> U64:
    if len(data) % 8:
        raise ValueError(f"{what}: {len(data)} bytes, not whole 64-bit words")
    out: U64 = np.frombuffer(data, _U64).astype(np.uint64, copy=False)
    return out


class Capture(NamedTuple):
    """An index's state copied out of its tables, for :func:`encode` (on another thread, if need be: the index may
    change meanwhile)."""

    head: Snapshot  # all but the blocks and links, whose fields are left empty
    blocks: list[tuple[U64, npt.NDArray[np.uint8], U64 | list[EngineHash]]]  # per worker: keys, tier bits, hashes
    links: Links  # kvtier.indexer.index.closure.PrefixClosure.link_pairs


def encode(c: Capture) -> bytes:
    """The snapshot's bytes: each worker's blocks, loose blocks and window KV in ascending key order, the links of
    parents with one child by parent, then each set of children by parent and child; ghosts and their parents oldest
    first, as the index forgets them (the same index, the same bytes). Fills ``c.head``. O(blocks log blocks)."""
    for rec, (keys, bits, hashes) in zip(c.head.workers, c.blocks, strict=True):
        order = np.argsort(keys)  # (keys are distinct: any sort is canonical)
        rec.keys, rec.bits = pack(keys[order]), bits[order].tobytes()
        rec.hashes = [hashes[i] for i in order.tolist()] if isinstance(hashes, list) else pack(hashes[order])
        rec.window_bits.sort()
        if rec.loose is not None:
            for tier in rec.loose:
                tier.sort()
    parents, children, sets = c.links
    order = np.argsort(parents)  # (a parent with one child is in one pair)
    sets = sorted((p, sorted(kids)) for p, kids in sets)
    c.head.links = link_bytes(np.concatenate([parents[order], np.array([p for p, k in sets for _ in k], np.uint64)]),
                              np.concatenate([children[order], np.array([x for _, k in sets for x in k], np.uint64)]))
    return msgspec.msgpack.encode(c.head)


def decode(data: bytes) -> Snapshot:
    """The snapshot in ``data``, version 1 converted; ``ValueError`` or a ``msgspec`` error where it is not one.
    O(len(data))."""
    version = msgspec.msgpack.decode(data, type=_Version).version
    if version == VERSION:
        return msgspec.msgpack.decode(data, type=Snapshot)
    if version == 1:
        return _from_v1(msgspec.msgpack.decode(data))
    raise ValueError(f"unsupported snapshot version {version!r}")


def blocks(rec: WorkerRecord) -> Blocks:
    """``rec``'s blocks as arrays, with every check the tables do not make themselves: keys ascending (so none
    twice), tier bits of the worker's own slot on every block, one engine hash per block, loose blocks and window KV
    held where they say, window KV only with a window, and no more remembered from a loss than the index keeps.
    ``ValueError`` naming the worker. O(blocks + loose + window)."""
    where = f"worker {rec.worker!r} rank {rec.dp_rank}"
    if (rec.inferred or rec.window_bits) and not rec.window:
        raise ValueError(f"{where}: window KV without a window")
    if len(rec.ghosts) > MAX_REMEMBERED or len(rec.ups) > MAX_REMEMBERED:
        raise ValueError(f"{where}: more than {MAX_REMEMBERED} blocks remembered from a loss")
    if not all(0 <= key < 1 << 64 for _, key in rec.ghosts):
        raise ValueError(f"{where}: a block remembered from a loss with a key outside 0..2**64-1")
    keys = _words(rec.keys, f"{where}: keys")
    bits = np.frombuffer(rec.bits, np.uint8)
    n = len(keys)
    if len(bits) != n:
        raise ValueError(f"{where}: {n} blocks, {len(bits)} tier bits")
    if n and not (keys[1:] > keys[:-1]).all():
        raise ValueError(f"{where}: block keys not ascending (one given twice?)")
    if n and not ((bits > 0) & (bits <= SLOT_MASK)).all():
        raise ValueError(f"{where}: a block held on no tier, or with bits past the worker's own")
    hashes = rec.hashes if isinstance(rec.hashes, list) else _words(rec.hashes, f"{where}: engine hashes")
    if len(hashes) != n:
        raise ValueError(f"{where}: {n} blocks, {len(hashes)} engine hashes")
    loose = None
    if rec.loose is not None:
        if len(rec.loose) != TIERS:
            raise ValueError(f"{where}: loose blocks of {len(rec.loose)} tiers, not {TIERS}")
        loose = [_held(keys, bits, t, tier, where, "loose block") for t, tier in enumerate(rec.loose)]
    for key, wbits in rec.window_bits:
        i = int(np.searchsorted(keys, np.uint64(key))) if 0 <= key < 1 << 64 else n
        if i == n or int(keys[i]) != key or not 0 < wbits <= SLOT_MASK or wbits & ~int(bits[i]):
            raise ValueError(f"{where}: window KV of block {key:#x} on tiers {wbits:#x} it does not hold")
    return Blocks(keys, bits, hashes, loose, rec.window_bits)


def _held(keys: U64, bits: npt.NDArray[np.uint8], tier: int, want: list[BlockKey], where: str,
          what: str) -> set[int]:
    """``want`` as a set, each checked to be among ``keys`` held on ``tier``. O(want log keys)."""
    if not want:
        return set()
    if not keys.size:
        raise ValueError(f"{where}: {what} {want[0]:#x} not held on tier {tier}")
    arr = np.array(want, dtype=np.uint64)
    at = np.minimum(np.searchsorted(keys, arr), len(keys) - 1)
    ok = (keys[at] == arr) & (bits[at] >> tier & 1).astype(bool)
    if not ok.all():
        raise ValueError(f"{where}: {what} {int(arr[np.flatnonzero(~ok)[0]]):#x} not held on tier {tier}")
    return set(want)


def links(snap: Snapshot) -> tuple[U64, U64]:
    """The snapshot's links as (parents, children). ``ValueError`` for a parent without its child. O(links)."""
    words = _words(snap.links, "links")
    if len(words) % 2:
        raise ValueError(f"links: {len(words)} keys, not (parent, child) pairs")
    pairs = words.reshape(-1, 2)
    return np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])


def link_bytes(parents: U64, children: U64) -> bytes:
    """Inverse of :func:`links`. O(links)."""
    return pack(np.stack([parents, children], axis=1))


def _from_v1(obj: Any) -> Snapshot:
    """A version-1 snapshot (a list per block; fields appended to each worker's record as they were added) as
    version 2. O(blocks)."""
    block_size, window_tokens = int(obj["block_size"]), int(obj.get("window_tokens", 0))
    default_window = -(-window_tokens // block_size) if block_size > 0 else 0
    workers = []
    for worker, dp_rank, partial, entries, *swa in obj["workers"]:
        ehs = [eh for eh, _, _ in entries]
        keys = np.array([key for _, key, _ in entries], dtype=np.uint64)  # (OverflowError outside 0..2**64)
        bits = np.array([b for _, _, b in entries], dtype=np.int64)
        wrong = bits[(bits <= 0) | (bits > SLOT_MASK)]
        if len(wrong):
            raise ValueError(f"worker {worker!r}: a block with tier bits {int(wrong[0])}")
        order = np.argsort(keys, kind="stable")
        window, inferred = default_window, bool(default_window)
        window_bits: list[tuple[BlockKey, int]] = []
        if swa:  # written since window KV is tracked
            window, window_bits = int(swa[0]), [(BlockKey(int(k)), int(b)) for k, b in swa[1]]
            inferred = bool(swa[2]) if len(swa) > 2 else False
        workers.append(WorkerRecord(
            worker=worker, dp_rank=dp_rank, partial=bool(partial), keys=pack(keys[order]),
            bits=bits[order].astype(np.uint8).tobytes(), hashes=[ehs[i] for i in order.tolist()], signed=None,
            window=window, inferred=inferred, window_bits=window_bits,
            # Loose blocks were written with the links; without them the worker is not known to be prefix-closed.
            loose=swa[3] if len(swa) > 3 and "links" in obj else None,
            ghosts=swa[4] if len(swa) > 5 else [], orphans=swa[5] if len(swa) > 5 else [],
            closed_tiers=int(swa[6]) if len(swa) > 7 else 0, ups=swa[7] if len(swa) > 7 else []))
    pairs = [(p, c) for p, kids in obj.get("links", ()) for c in kids]
    par = np.array([p for p, _ in pairs], dtype=np.uint64)
    kid = np.array([c for _, c in pairs], dtype=np.uint64)
    # Through msgpack once more, so that every field is checked as a version-2 snapshot's is.
    snap = Snapshot(version=VERSION, block_size=block_size, window_tokens=window_tokens, workers=workers,
                    links=link_bytes(par, kid))
    return msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=Snapshot)
