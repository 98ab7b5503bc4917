"""Decoding an event batch with its token arrays read by the compiled kernel (``strip_tokens``) gives what msgspec
alone gives: the same events, or the same error, on well-formed batches of every layout and on broken ones."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvtier.wire import tokenarray
from kvtier.wire.codec import DecodeError, EventBatch, decode_payload
from kvtier.wire.tokenarray import strip_tokens

from .jit_paths import python_path

pytestmark = pytest.mark.skipif(not tokenarray.token_backend().startswith("numba"),
                                reason="compiled token kernels not loaded")

# Ids in every int format msgpack has (fixint up to uint64 and the signed ones), mostly valid, some not.
token = st.one_of(st.integers(0, 127), st.integers(0, 2**16), st.integers(0, 2**32 - 1),
                  st.integers(-2**63, 2**64 - 1))
scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                   st.text(max_size=40), st.binary(max_size=40))
extra = st.recursive(scalar, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                      max_size=3), max_leaves=8)
hashes = st.lists(st.integers(-2**63, 2**64 - 1) | st.binary(min_size=1, max_size=8), min_size=1, max_size=4)


@st.composite
def map_event(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["BlockStored"] * 4 + ["BlockRemoved", "AllBlocksCleared", "Other"]))
    ev: dict[str, Any] = {"type": kind}
    if kind != "AllBlocksCleared":
        ev["block_hashes"] = draw(hashes)
    if kind == "BlockStored" or draw(st.booleans()):  # a removal may carry a token_ids field too (ignored)
        valid = draw(st.booleans())
        ev["token_ids"] = draw(st.lists(st.integers(0, 2**32 - 1) if valid else token, max_size=40))
    if kind == "BlockStored":
        ev.update(parent_block_hash=draw(st.none() | st.integers(-2**63, 2**63 - 1)), block_size=draw(
            st.integers(0, 8)), lora_id=draw(st.none() | st.integers(0, 9)), medium=draw(st.sampled_from(
                ["GPU", "CPU_PINNED", "DISK", None])))
    for name in draw(st.lists(st.sampled_from(["lora_name", "cache_salt", "future"]), max_size=2)):
        ev[name] = draw(extra if name == "future" or draw(st.integers(0, 9)) == 0 else st.none() | st.text(max_size=8))
    items = list(ev.items())
    order = draw(st.permutations(range(len(items))))
    return {items[i][0]: items[i][1] for i in order}


@st.composite
def array_event(draw: st.DrawFn) -> list[Any]:
    kind = draw(st.sampled_from(["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]))
    if kind == "BlockStored":
        ev: list[Any] = [kind, draw(hashes), draw(st.none() | st.integers(-2**63, 2**63 - 1)),
                         draw(st.lists(st.integers(0, 2**32 - 1) | token, max_size=40)), draw(st.integers(0, 8)),
                         None, "GPU"]
        names = st.none() | st.text(max_size=8)  # lora_name and cache_salt, then whatever a later layout adds
        return ev[:draw(st.integers(3, 7))] + draw(st.lists(names, max_size=2)) + draw(st.lists(extra, max_size=1))
    if kind == "BlockRemoved":
        return [kind, draw(hashes), "GPU"]
    return [kind]


batch = st.builds(lambda ts, evs, tail: [ts, evs, *tail], st.floats(0, 1e9) | st.integers(0, 9),
                  st.lists(map_event(), max_size=4) | st.lists(array_event(), max_size=4),
                  st.lists(st.none() | st.integers(0, 7), max_size=1))


def _both(payload: bytes) -> tuple[EventBatch | str, EventBatch | str]:
    """The batch (or the error message) with the kernel's token arrays, and with msgspec's."""
    out: list[EventBatch | str] = []
    for strip in (True, False):
        try:
            if strip:
                out.append(decode_payload(payload, packed_tokens=True))
            else:
                with python_path(tokenarray._KERNELS):
                    out.append(decode_payload(payload, packed_tokens=True))
        except DecodeError as exc:
            out.append(str(exc))
    return out[0], out[1]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(batch, st.data())
def test_stripped_decoding_agrees_with_msgspec(obj: list[Any], data: st.DataObject) -> None:
    payload = msgspec.msgpack.encode(obj)
    fast, slow = _both(payload)
    assert fast == slow
    event(f"decoded: {not isinstance(fast, str)}")
    cut = data.draw(st.integers(0, len(payload)))  # and every truncation, and a flipped byte
    a, b = _both(payload[:cut])
    assert a == b
    if payload:
        i = data.draw(st.integers(0, len(payload) - 1))
        broken = payload[:i] + bytes([data.draw(st.integers(0, 255))]) + payload[i + 1:]
        a, b = _both(broken)
        assert a == b


@settings(max_examples=200, deadline=None, derandomize=True)
@given(batch)
def test_the_stripped_batch_is_the_batch_with_empty_token_arrays(obj: list[Any]) -> None:
    payload = msgspec.msgpack.encode(obj)
    got = strip_tokens(payload)
    in_range = True
    want = msgspec.msgpack.decode(payload)
    expect: list[bytes | None] = []
    for ev in want[1]:
        ids: Any = None
        if isinstance(ev, dict) and "token_ids" in ev:
            ids, ev["token_ids"] = ev["token_ids"], []
        elif isinstance(ev, list) and len(ev) >= 4 and ev[0] == "BlockStored":
            ids, ev[3] = ev[3], []
        else:
            expect.append(None)
            continue
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in ids):
            in_range = False
            break
        expect.append(b"".join(t.to_bytes(4, "little") for t in ids))
    if not in_range:
        assert got is None  # decoded whole, for its out-of-range ids
        return
    assert got is not None
    stripped, tokens = got
    assert msgspec.msgpack.decode(stripped) == want and tokens == expect


def test_a_map_with_token_ids_twice_and_trailing_bytes_are_left_to_msgspec() -> None:
    one = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [1], "token_ids": [1]}]])
    assert strip_tokens(one) is not None
    twice = one.replace(b"\x83", b"\x84", 1) + b"\xa9token_ids\x91\x02"  # the map with a 4th pair
    assert msgspec.msgpack.decode(twice)[1][0]["token_ids"] == [2]
    assert strip_tokens(twice) is None
    assert strip_tokens(one + b"\x00") is None
    assert _both(twice)[0] == _both(twice)[1]
