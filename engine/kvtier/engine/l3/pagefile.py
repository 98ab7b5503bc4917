"""The on-disk format of one L3 page: a small self-describing header, then the KV bytes.

::

    fixed   <4s H H I Q Q>  magic b"KVTP", version, flags (0), meta length, payload length, checksum
    meta    msgpack PageHeader (key, layout tag, event hash, parent, depth, token ids)
    payload the page's KV bytes

The checksum is xxh3-64 over ``meta + payload``, so a flipped bit anywhere after the fixed part, a
truncated file, or a page of another key or layout is detected on read and never served. The header
carries everything an engine needs to announce the page again, which is what makes a restart warm:
the store adopts valid pages from their headers alone (:func:`read_header`), without reading KV bytes.
Adoption still never announces a damaged header: a page's key is its digest (SHA-256 over its parent's digest
and its token ids, :mod:`kvtier.wire.pagehash`) and its event hashes are read off the digests, so the key, the
parent, the hashes and the tokens of a header check each other (:func:`_check_chain`, one hash of a page's
tokens).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import msgspec
import xxhash

from kvtier.wire.pagehash import ROOT_DIGEST, event_hash, page_digest

MAGIC = b"KVTP"
VERSION = 1
_FIXED = struct.Struct("<4sHHIQQ")
FIXED_SIZE = _FIXED.size  # bytes before the meta
_MAX_META = 1 << 20  # a header longer than this is damage, not a page
#: Key prefix of a page's draft-model KV (speculative decoding), stored beside the target page (its header is the
#: target page's, the key prefixed).
DRAFT_PREFIX = "d:"


class PageFileError(ValueError):
    """A page file is damaged, truncated, or belongs to another key or layout."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What makes two engines' page bytes interchangeable.

    Pages of different models, page sizes, dtypes, KV sizes per token or parallel shards have different bytes for
    the same tokens; the store keeps each layout in its own directory (:meth:`tag`) and checks the tag in every
    header, so engines of different models sharing one pool are never served each other's pages.
    """

    model: str = "unknown"  # model name or preset
    page_size: int = 16  # tokens per page
    dtype: str = "bfloat16"  # KV element type
    tp_size: int = 1  # tensor-parallel ranks; each stores its own shard of a page
    tp_rank: int = 0
    pp_size: int = 1  # pipeline-parallel stages; each stores its own layers
    pp_rank: int = 0
    kv_bytes_per_token: int = 0  # KV bytes of one token on this shard (0: not part of the layout)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("layout: the model name must not be empty")
        if self.page_size < 1 or self.tp_size < 1 or self.pp_size < 1:
            raise ValueError(f"layout: page_size, tp_size and pp_size must be >= 1, got {self}")
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"layout: ranks must be in [0, size), got {self}")
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"layout: kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")

    def tag(self) -> str:
        """A readable, filesystem-safe directory name, one per layout: the fields joined by ``-``, the model's
        characters outside ``[A-Za-z0-9._-]`` and the dtype's outside ``[A-Za-z0-9._]`` escaped as ``%XX`` (UTF-8),
        so that no two layouts share a tag. Read from the right, the fields after the model are fixed in form."""
        kv = f"-kv{self.kv_bytes_per_token}" if self.kv_bytes_per_token else ""
        return (f"{_escape(self.model, _MODEL_SAFE)}-ps{self.page_size}-{_escape(self.dtype, _DTYPE_SAFE)}"
                f"-tp{self.tp_rank}of{self.tp_size}-pp{self.pp_rank}of{self.pp_size}{kv}")


_MODEL_SAFE = re.compile(rb"[^A-Za-z0-9._-]")
_DTYPE_SAFE = re.compile(rb"[^A-Za-z0-9._]")


def _escape(name: str, unsafe: re.Pattern[bytes]) -> str:
    """``name`` with each byte ``unsafe`` matches (``%`` is always escaped) as ``%XX``; a leading dot too, so that a
    tag is never a hidden file. Injective."""
    raw = name.encode("utf-8", "surrogatepass")
    out = unsafe.sub(lambda m: b"%%%02X" % m.group()[0], raw).decode("ascii")
    return "%2E" + out[1:] if out.startswith(".") else out


class PageHeader(msgspec.Struct, array_like=True, frozen=True):
    """What a page file says about itself (the meta part)."""

    key: str  # the store key ("d:" + key for a draft-model companion)
    layout: str  # Layout.tag() of the engine that wrote it
    event_hash: int  # the hash published in events
    parent_key: str | None  # L3 key of the parent page; None under the root
    parent_hash: int | None  # event hash of the parent page
    depth: int  # pages from the root
    tokens: bytes  # token ids, uint32 little-endian


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(PageHeader)


def encode(header: PageHeader, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The file's parts, to be written in order (``writelines``: no copy of the payload)."""
    meta = _enc.encode(header)
    h = xxhash.xxh3_64(meta)
    h.update(payload)
    fixed = _FIXED.pack(MAGIC, VERSION, 0, len(meta), len(payload), h.intdigest())
    return [fixed, meta, payload]


def _fixed(data: bytes | memoryview) -> tuple[int, int, int]:
    if len(data) < FIXED_SIZE:
        raise PageFileError(f"{len(data)} bytes, shorter than the {FIXED_SIZE}-byte header")
    magic, version, flags, meta_len, payload_len, checksum = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise PageFileError(f"not a kvtier page file (magic {bytes(magic)!r})")
    if version != VERSION:
        raise PageFileError(f"page file version {version}, this kvtier reads {VERSION}")
    if flags != 0:
        raise PageFileError(f"unknown flags {flags:#x}")
    if meta_len > _MAX_META:
        raise PageFileError(f"header of {meta_len} bytes")
    return meta_len, payload_len, checksum


def _meta(raw: bytes | memoryview, key: str, layout: str) -> PageHeader:
    try:
        header = _dec.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # (a string of the header is not UTF-8)
        raise PageFileError(f"unreadable header: {exc}") from None
    if header.key != key:
        raise PageFileError(f"holds page {header.key!r}, not {key!r}")
    if header.layout != layout:
        raise PageFileError(f"written for layout {header.layout!r}, not {layout!r}")
    _check_chain(header)
    return header


def _check_chain(h: PageHeader) -> None:
    """Raises :class:`PageFileError` unless ``h``'s key is the digest of its parent's and its tokens (both keys as
    written: lowercase hex), its event hashes those of the two digests, and its depth 0 exactly when it has no
    parent (that it is its parent's plus one, the store checks: :func:`kvtier.engine.l3.storage._choose`). O(page
    size)."""
    if (h.parent_key is None) != (h.depth == 0) or (h.parent_key is None) != (h.parent_hash is None) \
            or h.depth < 0:
        raise PageFileError(f"depth {h.depth} with parent {h.parent_key!r}")
    try:
        parent = ROOT_DIGEST if h.parent_key is None else bytes.fromhex(h.parent_key)
        digest = page_digest(parent, h.tokens)
    except ValueError:  # a parent key that is no hex, or tokens that are no whole uint32s
        raise PageFileError("parent key or token ids malformed") from None
    if digest.hex() != h.key.removeprefix(DRAFT_PREFIX) or (parent and parent.hex() != h.parent_key):
        raise PageFileError("its key is not the digest of its parent and tokens")
    if h.event_hash != event_hash(digest) or (parent and h.parent_hash != event_hash(parent)):
        raise PageFileError("its event hashes are not its digests'")


def decode(data: bytes | memoryview, key: str, layout: str) -> tuple[PageHeader, memoryview]:
    """Verifies a whole page file; returns its header and payload. Raises :class:`PageFileError`. O(size)."""
    view = memoryview(data)
    meta_len, payload_len, checksum = _fixed(view)
    if len(view) != FIXED_SIZE + meta_len + payload_len:
        raise PageFileError(f"{len(view)} bytes, the header says {FIXED_SIZE + meta_len + payload_len}")
    if xxhash.xxh3_64_intdigest(view[FIXED_SIZE:]) != checksum:
        raise PageFileError("checksum mismatch")
    header = _meta(view[FIXED_SIZE:FIXED_SIZE + meta_len], key, layout)
    return header, view[FIXED_SIZE + meta_len:]


def read_header(path: str, key: str, layout: str) -> PageHeader:
    """Reads and checks only a page file's header and size (adoption on start). O(header)."""
    with open(path, "rb") as f:
        head = f.read(FIXED_SIZE)
        meta_len, payload_len, _ = _fixed(head)
        meta = f.read(meta_len)
        if len(meta) != meta_len:
            raise PageFileError("truncated header")
        size = f.seek(0, 2)
    if size != FIXED_SIZE + meta_len + payload_len:
        raise PageFileError(f"{size} bytes, the header says {FIXED_SIZE + meta_len + payload_len}")
    return _meta(meta, key, layout)
