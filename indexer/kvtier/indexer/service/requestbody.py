"""The JSON bodies of the service's requests, parsed and checked: one clear error naming what is wrong (and
where), never a traceback. A prompt's token array goes straight into packed tokens."""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar, cast

import msgspec

from kvtier.wire.protocol import PackedTokens, pack_tokens
from kvtier.wire.tokenarray import decode_json_tokens


class MmItem(msgspec.Struct, forbid_unknown_fields=True):
    """A multimodal item of a request: its placeholder tokens' position."""

    identifier: str  # the item's hash or id, as the engine keys it
    offset: Annotated[int, msgspec.Meta(ge=0, lt=2**32)]  # first placeholder token
    length: Annotated[int, msgspec.Meta(gt=0, lt=2**32)]  # placeholder tokens


class SloBody(msgspec.Struct, forbid_unknown_fields=True):
    """A request's service-level objective, ms (either may be left out)."""

    ttft_ms: Annotated[float, msgspec.Meta(gt=0, le=86_400_000)] | None = None
    tpot_ms: Annotated[float, msgspec.Meta(gt=0, le=86_400_000)] | None = None


class RequestBody(msgspec.Struct):
    """The JSON body of ``/query`` and ``/route``; unknown fields are ignored."""

    # The prompt's JSON array, left unparsed here: parse_body reads it straight into packed tokens (a Python int
    # per token cost more than the rest of a query), checking each is an int in [0, 2**32).
    token_ids: msgspec.Raw
    lora_name: str | None = None  # LoRA adapter (changes the key space)
    cache_salt: str | None = None  # tenant salt (changes the key space)
    mm_items: list[MmItem] | None = None  # multimodal items (scope the blocks they overlap)
    request_id: str | None = None  # required by /route
    slo: SloBody | None = None  # /route: the request's SLO (the goodput policy routes for it)


class FinishBody(msgspec.Struct, forbid_unknown_fields=True):
    """The optional JSON body of ``/requests/{id}/finish``."""

    # tokens it generated, if known (the service also bounds it by the model's context)
    output_tokens: Annotated[int, msgspec.Meta(ge=0, lt=2**32)] | None = None


_B = TypeVar("_B", RequestBody, FinishBody)
_decoders: dict[type, msgspec.json.Decoder[Any]] = {RequestBody: msgspec.json.Decoder(RequestBody),
                                                     FinishBody: msgspec.json.Decoder(FinishBody)}


#: A backslash pair (skipped), or the escape of a pair's first half with something other than its second half after.
_HIGH_ALONE = re.compile(rb"\\(?:\\|u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2}))")


def _unpaired_surrogate(body: bytes | Any) -> int | None:
    """The byte where ``body`` escapes the first half of a UTF-16 surrogate pair without the second, where something
    follows the escape (msgspec calls such a string near the end "truncated"); None if it has none. O(body)."""
    if not isinstance(body, bytes | bytearray | memoryview):
        return None
    raw = bytes(body)
    for m in _HIGH_ALONE.finditer(raw):
        if m.end() - m.start() == 6 and m.end() < len(raw):
            return m.start()
    return None


def _parse(body: bytes | Any, kind: type[_B], what: str) -> _B:
    try:
        if isinstance(body, bytes | bytearray | memoryview):
            return cast(_B, _decoders[kind].decode(body))
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        at = _unpaired_surrogate(body) if str(exc) == "Input data was truncated" else None
        if at is not None:
            raise ValueError(f"body is not JSON: unpaired utf-16 surrogate escape (byte {at})") from None
        # (msgspec >= 0.23 says a string is not UTF-8 by a DecodeError that does not say where)
        raise ValueError(_invalid_utf8(body) or f"body is not JSON: {exc}") from None
    except UnicodeDecodeError:  # (msgspec < 0.23: a string it reads is not UTF-8)
        bad = _invalid_utf8(body)
        if bad is None:
            raise
        raise ValueError(bad) from None


def _invalid_utf8(body: bytes | Any) -> str | None:
    """Where a body's bytes stop being UTF-8: the first bad byte and its place in the body, not in the string that
    holds it; None for a body that is UTF-8, or not bytes. O(body)."""
    if not isinstance(body, bytes | bytearray | memoryview):
        return None
    try:
        bytes(body).decode()
    except UnicodeDecodeError as exc:
        return f"body is not JSON: invalid UTF-8 at byte {exc.start} (0x{exc.object[exc.start]:02x})"
    return None


def packed_token_ids(token_ids: list[int]) -> PackedTokens:
    """A request's token ids packed for hashing; ``ValueError`` naming the first that is no uint32, in the
    form msgspec names a bad element (``$.token_ids[3]``). O(tokens)."""
    try:
        return pack_tokens(token_ids)
    except ValueError:
        bad = next(i for i, t in enumerate(token_ids) if not 0 <= t < 2**32)
        raise ValueError(f"bad request body: token id {token_ids[bad]} is not in [0, 2**32) - at `$.token_ids[{bad}]`"
                         ) from None


def parse_body(body: bytes | Any) -> tuple[RequestBody, PackedTokens]:
    """A request body from raw JSON bytes or an already decoded object, and its prompt packed; ``ValueError``
    naming what is wrong (and where, e.g. ``$.token_ids[3]``). O(body)."""
    if not isinstance(body, bytes | bytearray | memoryview):
        try:
            body = msgspec.json.encode(body)
        except TypeError as exc:
            raise ValueError(f"bad request body: {exc}") from None
    req = _parse(body, RequestBody, "request body")
    try:
        tokens = decode_json_tokens(req.token_ids)
    except msgspec.ValidationError as exc:  # its path is the array's own ("$[3]", none at its root): say where
        text = str(exc)
        text = text.replace("`$", "`$.token_ids") if " - at `$" in text else f"{text} - at `$.token_ids`"
        raise ValueError(f"bad request body: {text}") from None
    return req, tokens if isinstance(tokens, bytes) else packed_token_ids(tokens)


def parse_finish(body: bytes | Any) -> FinishBody:
    """A finish body (empty: nothing known); ``ValueError`` naming what is wrong. O(body)."""
    if isinstance(body, bytes | bytearray | memoryview) and not bytes(body).strip():
        return FinishBody()
    return _parse(body, FinishBody, "finish body")
