"""Token id arrays on the wire to and from packed tokens: a BlockStored's ``token_ids`` (a msgpack array of
ints) both ways, and a query's (a JSON array) in.

The engine keeps a page's tokens packed (:data:`~kvtier.wire.protocol.PackedTokens`) and the router hashes
packed tokens, so the array is written from and read into packed bytes directly, without a Python int per
token: by the numba kernels of :mod:`kvtier.kernels.tokenkernel` where they load (:mod:`kvtier.kernels.jit`),
else through msgspec and :func:`~kvtier.wire.protocol.pack_tokens`. Both give the same bytes.
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvtier.kernels import jit
from kvtier.wire.protocol import PackedTokens, pack_tokens, unpack_tokens

_ints = msgspec.msgpack.Decoder(list[int])
_json_ints = msgspec.json.Decoder(list[int])
_encode = msgspec.msgpack.Encoder().encode
#: The kernels, warmed with the argument types used here (read-only views of bytes).
_KERNELS = jit.LazyKernels("kvtier.kernels.tokenkernel", lambda k: (k.decode(
    np.frombuffer(bytes(k.encode(np.frombuffer(bytes(8), "<u4"))), np.uint8)),
    k.decode_json(np.frombuffer(b"[1]", np.uint8)),
    k.strip_tokens(np.frombuffer(b"\x93\x00\x90\xc0", np.uint8))))


def token_backend() -> str:
    """``"numba"`` or ``"python (why)"``, loading and compiling the kernels now (so that the first event
    does not pay). O(1) after the first call."""
    _KERNELS.get()
    return str(_KERNELS.backend)


def encode_tokens(packed: PackedTokens) -> bytes:
    """The msgpack array of the token ids in ``packed``: the bytes msgspec writes for
    ``unpack_tokens(packed)``. O(tokens)."""
    k = _KERNELS.get()
    if k is None:
        return _encode(unpack_tokens(packed))
    return bytes(k.encode(np.frombuffer(packed, "<u4")))  # ValueError if not whole tokens, as unpack_tokens


def decode_tokens(raw: bytes | memoryview | msgspec.Raw) -> PackedTokens | list[int]:
    """The token ids of a msgpack array: packed when every one is an int in ``[0, 2**32)``, else as
    msgspec decodes them (a list; an out-of-range id is the index's to reject). ``msgspec.DecodeError``
    if ``raw`` is not an array of ints. O(len(raw))."""
    return _decode(raw, "decode", _ints)


def decode_json_tokens(raw: bytes | memoryview | msgspec.Raw) -> PackedTokens | list[int]:
    """The token ids of a JSON array, as :func:`decode_tokens` reads a msgpack one: packed when every one is
    an int in ``[0, 2**32)``, else as msgspec decodes them (a list; an out-of-range id is the caller's to
    reject). ``msgspec.ValidationError`` (its path relative to the array, ``$[3]``) or
    ``msgspec.DecodeError`` if ``raw`` is not a JSON array of ints. O(len(raw))."""
    return _decode(raw, "decode_json", _json_ints)


def strip_tokens(payload: bytes | memoryview) -> tuple[bytes, list[PackedTokens | None]] | None:
    """An event batch with its BlockStored token arrays taken out, for a codec to decode the rest: ``(the batch
    with each such array written empty, per event its token ids packed or None)``; the arrays are read in the
    same pass that finds them, where msgspec would walk each one to skip it (90% of a batch's decoding time).
    None where the compiled kernels do not run or the batch is not plainly such (see
    :func:`kvtier.kernels.tokenkernel.strip_tokens`): decode it whole. O(len(payload))."""
    k = _KERNELS.get()
    if k is None:
        return None
    events, stripped, tokens, spans = k.strip_tokens(np.frombuffer(payload, np.uint8))
    if events < 0:
        return None
    # (uint32 is "<u4" here: the kernels load on little-endian machines only)
    per_event: list[PackedTokens | None] = [tokens[first:first + n].tobytes() if has else None
                                            for has, first, n in spans.tolist()]
    return stripped.tobytes(), per_event


def _decode(raw: bytes | memoryview | msgspec.Raw, kernel: str,
            slow: msgspec.msgpack.Decoder[list[int]] | msgspec.json.Decoder[list[int]]) -> PackedTokens | list[int]:
    """The compiled ``kernel`` where it loads and takes ``raw``; else msgspec's ``slow`` decoder, packed when in
    range."""
    k = _KERNELS.get()
    if k is not None:
        ok, tokens = getattr(k, kernel)(np.frombuffer(raw, np.uint8))
        if ok:
            return bytes(tokens.astype("<u4", copy=False))
    ids = slow.decode(raw)
    try:
        return pack_tokens(ids)
    except ValueError:
        return ids


__all__ = ["decode_json_tokens", "decode_tokens", "encode_tokens", "strip_tokens", "token_backend"]
