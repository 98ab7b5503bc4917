"""Token arrays on the wire from and to packed tokens (kvtier.wire.tokenarray), compiled and in Python."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager

import msgspec
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvtier.wire import BlockStored, EventBatch, decode_payload, encode_payload
from kvtier.wire import tokenarray as ta
from kvtier.wire.codec import DecodeError, WireFormat
from kvtier.wire.protocol import pack_tokens
from tests.jit_paths import python_path

#: Where msgpack changes an unsigned int's format (fixint, uint8, uint16, uint32).
EDGE_IDS = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]
#: Where it changes an array header's format (fixarray, array16, array32).
EDGE_LENGTHS = [0, 1, 15, 16, 17, 65535, 65536, 70_000]

ids = st.lists(st.sampled_from(EDGE_IDS) | st.integers(0, 2**32 - 1), max_size=300)


def python_tokens() -> AbstractContextManager[None]:
    return python_path(ta._KERNELS)


@pytest.fixture(params=["loaded", "python"])
def path(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "python":
        with python_tokens():
            yield "python"
    else:
        yield ta.token_backend()


def test_backend_follows_kvtier_jit() -> None:
    # scripts/test.sh runs this module again with KVTIER_JIT=0
    expected = "python (KVTIER_JIT=0)" if os.environ.get("KVTIER_JIT") == "0" else "numba"
    assert ta.token_backend() == expected


@pytest.mark.parametrize("n", EDGE_LENGTHS)
def test_encoding_is_msgspecs_at_every_format_edge(path: str, n: int) -> None:
    tokens = [EDGE_IDS[i % len(EDGE_IDS)] for i in range(n)]
    raw = ta.encode_tokens(pack_tokens(tokens))
    assert raw == msgspec.msgpack.encode(tokens), f"{path}: {n} tokens encode differently from msgspec"
    assert ta.decode_tokens(raw) == pack_tokens(tokens)


@given(tokens=ids)
def test_round_trip_and_same_bytes_as_a_list_either_way(tokens: list[int]) -> None:
    packed = pack_tokens(tokens)
    wire = msgspec.msgpack.encode(tokens)
    compiled = (ta.encode_tokens(packed), ta.decode_tokens(wire))
    kernels = ta._KERNELS.get()
    if kernels is not None:  # msgspec's own bytes never fall back to the Python path
        assert kernels.decode(np.frombuffer(wire, np.uint8))[0]
    with python_tokens():
        python = (ta.encode_tokens(packed), ta.decode_tokens(wire))
    assert compiled == python == (wire, packed)


FORMATS = {"int8": (0xD0, 1), "int16": (0xD1, 2), "int32": (0xD2, 4), "int64": (0xD3, 8), "uint64": (0xCF, 8)}


@pytest.mark.parametrize(("fmt", "value"), [(f, v) for f, (_, size) in FORMATS.items() for v in (0, 5, 2**31, 2**32 - 1)
                                            if v < 1 << (8 * size - (0 if f == "uint64" else 1))])
def test_other_encoders_int_formats_decode_when_in_range(path: str, fmt: str, value: int) -> None:
    code, size = FORMATS[fmt]
    raw = bytes([0x92, code]) + value.to_bytes(size, "big") + b"\x07"
    assert ta.decode_tokens(raw) == pack_tokens([value, 7])


def _element(draw: st.DrawFn) -> bytes:
    """One msgpack int element in any format, with any value it holds (as other encoders may write ids,
    negative and past 32 bits included), or, rarely, an element that is not an int (a float, a string)."""
    kind = draw(st.sampled_from(["fixint", "uint8", "uint16", "uint32", *FORMATS, "other"]))
    if kind == "other":
        return draw(st.sampled_from([b"\xff", b"\xcb" + bytes(8), b"\xa1x", b"\xc0"]))
    if kind == "fixint":
        return bytes([draw(st.integers(0, 0x7F))])
    code, size = {**FORMATS, "uint8": (0xCC, 1), "uint16": (0xCD, 2), "uint32": (0xCE, 4)}[kind]
    signed = code >= 0xD0
    bits = 8 * size
    value = draw(st.integers(-(1 << (bits - 1)) if signed else 0, (1 << (bits - (1 if signed else 0))) - 1)
                 | st.integers(0, min(2**32, 1 << (bits - (1 if signed else 0))) - 1))
    return bytes([code]) + value.to_bytes(size, "big", signed=signed)


@given(elements=st.lists(st.composite(_element)(), max_size=40))
@example(elements=[b"\xd0\x80", b"\xce\x00\x00\x00\x05"])  # a negative int8 where 4 bytes follow it
@example(elements=[b"\xd1\x00\x05", b"\xcf" + (2**32).to_bytes(8, "big"), b"\x01"])  # int16, then past 32 bits
@example(elements=[b"\xcd\x01\x00", b"\xcb" + bytes(8), b"\x02"])  # a float after a uint16
def test_arrays_mixing_every_int_format_decode_as_msgspec_does(elements: list[bytes]) -> None:
    raw = bytes([0xDC]) + len(elements).to_bytes(2, "big") + b"".join(elements)
    try:
        expected: object = msgspec.msgpack.decode(raw, type=list[int])
    except msgspec.DecodeError:
        expected = msgspec.DecodeError
    got = []
    for python in (False, True):
        with python_tokens() if python else contextlib.nullcontext():
            try:
                got.append(ta.decode_tokens(raw))
            except msgspec.DecodeError:
                got.append(msgspec.DecodeError)
    if isinstance(expected, list) and all(0 <= t < 2**32 for t in expected):
        expected = pack_tokens(expected)  # in range: packed; else the list, for the index to reject
    assert got == [expected, expected]


@pytest.mark.parametrize("tokens", [[-1], [2**32], [3, 2**40], [2**64 - 1]])
def test_ids_outside_uint32_stay_a_list_for_the_index_to_reject(path: str, tokens: list[int]) -> None:
    assert ta.decode_tokens(msgspec.msgpack.encode(tokens)) == tokens


@pytest.mark.parametrize("raw", [b"", b"\x91", b"\x92\x01", b"\x91\xa1x", b"\x91\xc0", b"\x91\xcb" + bytes(8),
                                 b"\x81\x01\x02", b"\x91\xcd\x01", b"\xdc\x00", b"\x91\x91\x01"])
def test_malformed_arrays_raise_msgspecs_decode_error(path: str, raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        ta.decode_tokens(raw)


def test_trailing_bytes_after_the_array_are_not_tokens(path: str) -> None:
    with pytest.raises(msgspec.DecodeError):
        ta.decode_tokens(b"\x91\x01\x02")


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=64).map(lambda t: t[:len(t) // 4 * 4]),
       fmt=st.sampled_from(list(WireFormat)))
@example(tokens=[1, 2, 3, 4], fmt=WireFormat.SGLANG)
def test_packed_and_listed_events_are_the_same_frame(tokens: list[int], fmt: WireFormat) -> None:
    def batch(t: list[int] | bytes) -> EventBatch:
        return EventBatch(ts=1.5, events=[BlockStored(block_hashes=list(range(len(tokens) // 4)), parent_block_hash=9,
                                                      token_ids=t, block_size=4, medium="GPU")])
    frame = encode_payload(batch(tokens), fmt)
    assert encode_payload(batch(pack_tokens(tokens)), fmt) == frame
    (ev,) = decode_payload(frame, packed_tokens=True).events
    assert isinstance(ev, BlockStored) and ev.token_ids == pack_tokens(tokens) and ev.num_tokens == len(tokens)
    (listed,) = decode_payload(frame).events
    assert isinstance(listed, BlockStored) and listed.token_ids == tokens


def test_a_frame_with_a_bad_token_array_is_one_decode_error() -> None:
    frame = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                           "token_ids": [1, "x"], "block_size": 2, "medium": "GPU"}], None])
    with pytest.raises(DecodeError, match="token_ids"):
        decode_payload(frame, packed_tokens=True)
    with pytest.raises(DecodeError, match="token_ids"):
        decode_payload(frame)


# --- a query's JSON array -----------------------------------------------------------------------------

#: JSON text of one array element: plain ids (in and past uint32, with and without leading zeros), and the
#: forms msgspec reads differently or rejects (signs, fractions, exponents, strings, null, nesting).
_JSON_ELEMENTS = st.sampled_from(["0", "7", "4294967295", "4294967296", "99999999999", "12345678901234567890123",
                                  "007", "-0", "-3", "1.0", "1e3", "2E1", '"5"', "null", "true", "[1]", "{}", "",
                                  " 5", "5 ", "\t6\n"]) | st.integers(0, 2**33).map(str)


def _json_outcome(raw: bytes) -> object:
    try:
        return ta.decode_json_tokens(raw)
    except msgspec.ValidationError as exc:
        return ("invalid", str(exc))
    except msgspec.DecodeError:
        return msgspec.DecodeError


@given(elements=st.lists(_JSON_ELEMENTS, max_size=30), sep=st.sampled_from([",", ", ", " ,\n", ",,"]),
       pad=st.sampled_from(["", " ", "\n\t", "x"]))
@example(elements=["4294967295", "4294967296"], sep=",", pad="")  # the last id in range, then the first past it
@example(elements=["12345678901234567890123"], sep=",", pad="")  # past int64 while the digits are read
@example(elements=[str(2**64 + 5)], sep=",", pad="")  # wraps in 64 bits to an id in range
@example(elements=["007"], sep=",", pad="")  # a leading zero is not JSON
@example(elements=["-0", "5"], sep=",", pad="")  # a sign: msgspec reads -0 as 0
@example(elements=["1", "2"], sep=",,", pad="")  # an empty element
@example(elements=[], sep=",", pad="\n\t")
def test_json_arrays_decode_as_msgspec_reads_them(elements: list[str], sep: str, pad: str) -> None:
    raw = f"{pad}[{pad}{sep.join(elements)}{pad}]{pad}".encode()
    try:
        expected: object = msgspec.json.decode(raw, type=list[int])
        if isinstance(expected, list) and all(0 <= t < 2**32 for t in expected):
            expected = pack_tokens(expected)  # in range: packed; else the list, for the caller to reject
    except msgspec.ValidationError as exc:
        expected = ("invalid", str(exc))
    except msgspec.DecodeError:
        expected = msgspec.DecodeError
    with python_tokens():
        slow = _json_outcome(raw)
    assert [_json_outcome(raw), slow] == [expected, expected]


def test_plain_json_ids_take_the_compiled_path() -> None:
    """A prompt as routers send it never falls back to msgspec's list (the point of the kernel)."""
    if ta._KERNELS.get() is None:
        pytest.skip("no compiled kernels (KVTIER_JIT=0 or no numba)")
    tokens = [0, 9, 10, 65535, 65536, 2**32 - 1] * 400
    for text in (json.dumps(tokens), json.dumps(tokens, indent=1), str(tokens).replace(" ", "")):
        ok, got = ta._KERNELS.get().decode_json(np.frombuffer(text.encode(), np.uint8))
        assert ok and got.tolist() == tokens
