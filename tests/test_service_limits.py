"""What the indexer service refuses to spend on HTTP clients (README, "Security"), against a real server on
127.0.0.1 port 0: bodies capped as they decompress, nesting, mm_items, request ids, bookings per client and in
all, connections, the header-read deadline, tokens and owners, output_tokens, aiohttp's own errors as JSON;
and the service's other refusals: a snapshot it cannot write, configurations it must not start with, and the
open-files limit."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import http.client
import json
import logging
import os
import re
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.indexer.index.keys import extra_digest, mm_block_extras
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.routing.plugins import PolicyBase, RouteContext
from kvtier.indexer.routing.scoring import slo_met
from kvtier.indexer.service import fdlimit
from kvtier.indexer.service import http as http_front
from kvtier.indexer.service.app import IndexerService, ServiceConfig, load_config, parse_endpoint
from kvtier.indexer.service.clients import MAX_TOKEN_FILE_BYTES, Forbidden, load_tokens, peer_key
from kvtier.indexer.service.deadlines import Deadlines
from kvtier.indexer.service.eventloop import EventLoop
from kvtier.indexer.service.http import MALFORMED_METRIC
from kvtier.indexer.service.httplimits import (
    MAX_MEMBERS,
    BodiesBusy,
    BodyBudget,
    BodyTooLarge,
    check_json_shape,
    read_body,
)
from kvtier.sim.cli import main as cli_main
from kvtier.util.fields import ConfigError
from kvtier.wire import BlockStored, EventBatch, Publisher, WorkerId
from kvtier.wire.notices import StreamId
from tests.test_bad_input import NOTICES
from tests.test_multiprocess import ROOT
from tests.test_service import BS, TOKS, Clock, get, replaced_by_a_directory, wait_for


@contextmanager
def service(request_clock: Clock | None = None, **settings: Any) -> Iterator[IndexerService]:
    """A started service on one (silent) publisher, with ``settings`` over small test defaults (and the routed
    requests' clock ``request_clock``, if given)."""
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    cfg: dict[str, Any] = {"block_size": BS, "listen": "127.0.0.1:0", "max_body_bytes": 64_000,
                           "read_timeout_s": 2.0, "max_query_tokens": 4096, **settings}
    s = IndexerService(ServiceConfig(endpoints=[parse_endpoint(f"w0={pub.endpoint},replay={pub.replay_endpoint}")],
                                     **cfg), request_clock=request_clock or time.monotonic)
    s.start()
    try:
        yield s
    finally:
        s.stop()
        pub.close()


def call(s: IndexerService, method: str, path: str, body: Any = None, token: str | None = None,
         raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any, http.client.HTTPResponse]:
    host, port = s.address.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=5)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    c.request(method, path, body=data, headers=hdrs)
    r = c.getresponse()
    out = json.loads(r.read())
    c.close()
    return r.status, out, r


def metrics(s: IndexerService) -> dict[str, Any]:
    return dict(json.loads(get(s.address + "/metrics?format=json")))


def bomb(mib: int) -> bytes:
    """``mib`` MiB of zeros as gzip (about 1000:1), built from one compressed MiB repeated (each fully flushed,
    so the copies are byte-identical): its trailer's checksum is wrong, and nothing should read that far."""
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zero = bytes(1 << 20)
    first = z.compress(zero) + z.flush(zlib.Z_FULL_FLUSH)
    again = z.compress(zero) + z.flush(zlib.Z_FULL_FLUSH)
    return first + again * (mib - 1) + z.flush()


# --- bodies ------------------------------------------------------------------------------------------------


class _Stream:
    """A request's ``content`` that hands out ``data`` in chunks, counting how much was taken."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk, self.taken = data, chunk, 0

    async def iter_any(self) -> AsyncIterator[bytes]:
        while self.taken < len(self.data):
            piece = self.data[self.taken:self.taken + self.chunk]
            self.taken += len(piece)
            yield piece


class _Request:
    def __init__(self, data: bytes, encoding: str, chunk: int = 1 << 16) -> None:
        self.headers = {"Content-Encoding": encoding}
        self.content = _Stream(data, chunk)


def test_a_gzip_bomb_is_refused_while_it_inflates_in_memory_bounded_by_the_cap() -> None:
    """1 MiB of gzip (about 1 GiB of zeros) against a 1 MiB cap: refused after at most one chunk past the cap's
    worth, having held no more than a few caps in memory, not its gigabyte."""
    data = bomb(1 << 10)
    assert len(data) > 1 << 20
    cap = 1 << 20
    req = _Request(data, "gzip")
    tracemalloc.start()
    try:
        with pytest.raises(BodyTooLarge, match="once decompressed"):
            asyncio.run(read_body(req, cap))  # type: ignore[arg-type]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert req.content.taken <= 1 << 16  # the first wire chunk already inflates past the cap
    assert peak < 4 * cap, peak
    # an honest compressed body and a plain one are read whole
    plain = json.dumps({"token_ids": TOKS}).encode()
    assert asyncio.run(read_body(_Request(gzip.compress(plain), "gzip", chunk=7), cap)) == plain  # type: ignore[arg-type]
    assert asyncio.run(read_body(_Request(zlib.compress(plain), "deflate"), cap)) == plain  # type: ignore[arg-type]
    assert asyncio.run(read_body(_Request(plain, "identity"), cap)) == plain  # type: ignore[arg-type]
    two = gzip.compress(plain[:10]) + gzip.compress(plain[10:])  # a gzip body of two members
    assert asyncio.run(read_body(_Request(two, "gzip", chunk=5), cap)) == plain  # type: ignore[arg-type]
    # Each member costs a decompressor: a body of empty members (hundreds of thousands fit the cap) is refused.
    empty = gzip.compress(b"")
    many = empty * MAX_MEMBERS + gzip.compress(plain)
    with pytest.raises(ValueError, match=f"more than {MAX_MEMBERS} gzip members"):
        asyncio.run(read_body(_Request(many, "gzip"), cap))  # type: ignore[arg-type]
    assert asyncio.run(read_body(_Request(many[len(empty):], "gzip"), cap)) == plain  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="truncated"):
        asyncio.run(read_body(_Request(gzip.compress(plain)[:-9], "gzip"), cap))  # type: ignore[arg-type]


def test_a_gzip_bomb_gets_413_over_http_and_other_clients_are_served() -> None:
    with service(max_body_bytes=1 << 20) as s:
        data = bomb(256)  # 256 KiB on the wire, under the cap: only its inflation is past it
        code, out, r = call(s, "POST", "/query", raw=data, headers={"Content-Encoding": "gzip"})
        assert code == 413 and "once decompressed" in out["error"], out
        assert r.getheader("Content-Type") == "application/json"
        assert call(s, "POST", "/query", {"token_ids": TOKS})[0] == 200
        code, out, _ = call(s, "POST", "/query", raw=b"{}", headers={"Content-Encoding": "br"})
        assert code == 415 and "br" in out["error"]


class _Stalled(_Stream):
    """Hands out ``data``, then waits for ``go`` before it ends: a body stalled short of its end."""

    def __init__(self, data: bytes, chunk: int, go: asyncio.Event) -> None:
        super().__init__(data, chunk)
        self.go = go

    async def iter_any(self) -> AsyncIterator[bytes]:
        async for piece in super().iter_any():
            yield piece
        await self.go.wait()


def test_the_bodies_being_read_share_one_budget_given_back_however_they_end() -> None:
    """Bodies stalled short of their end hold what they read (compressed ones, what they inflated to) against one
    budget: the one that would pass it is refused, and whatever ends a read, its bytes are given back."""
    budget = BodyBudget(1 << 20)
    plain = b"1," * (200 << 10)  # 400 KiB

    async def run() -> None:
        go = asyncio.Event()
        reqs = [_Request(b"", encoding) for encoding in ("identity", "gzip", "identity")]
        for r, data in zip(reqs, [plain, gzip.compress(plain), plain], strict=True):
            r.content = _Stalled(data, 1 << 14, go)
        first = asyncio.create_task(read_body(reqs[0], 1 << 20, budget))  # type: ignore[arg-type]
        second = asyncio.create_task(read_body(reqs[1], 1 << 20, budget))  # type: ignore[arg-type]
        for _ in range(10_000):  # until both read all they were sent, and wait for the rest
            if budget.held == 2 * len(plain):
                break
            await asyncio.sleep(0)
        with pytest.raises(BodiesBusy, match=r"at most 1048576 \(max_body_bytes_in_flight\)"):
            await read_body(reqs[2], 1 << 20, budget)  # type: ignore[arg-type]
        assert budget.held == 2 * len(plain) and budget.refused == 1  # (the refused one's part given back)
        first.cancel()  # (a read timeout)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert budget.held == len(plain)
        go.set()
        assert await second == plain and budget.held == 0

    asyncio.run(run())


def test_bodies_past_the_budget_get_503_and_other_clients_are_served() -> None:
    with pytest.raises(ConfigError, match="max_body_bytes_in_flight 1000 is less than max_body_bytes 64000"):
        ServiceConfig(endpoints=[], max_body_bytes=64_000, max_body_bytes_in_flight=1000)
    with service(max_body_bytes=64_000, max_body_bytes_in_flight=100_000) as s:
        host, port = s.address.removeprefix("http://").split(":")
        head = (b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 60000\r\n\r\n")
        stalled = socket.create_connection((host, int(port)))
        stalled.sendall(head + b"[" + b"1," * 25_000)  # 50,001 bytes of 60,000, then nothing
        wait_for(lambda: s._http.bodies.held == 50_001)
        late = socket.create_connection((host, int(port)))
        late.sendall(head + b"[" + b"1," * 25_000)
        late.settimeout(5)
        answer = late.recv(4096)
        assert b" 503 " in answer.split(b"\r\n")[0] and b"max_body_bytes_in_flight" in answer, answer
        assert b"connection: close" in answer.lower()
        assert call(s, "POST", "/query", {"token_ids": TOKS})[0] == 200  # a small body fits beside the stalled one
        assert metrics(s)["http_bodies_refused"] == 1
        assert "kvtier_http_bodies_refused_total 1" in get(s.address + "/metrics")
        stalled.close()
        late.close()
        wait_for(lambda: s._http.bodies.held == 0)


def test_deep_nesting_is_a_json_400_not_a_500(caplog: pytest.LogCaptureFixture) -> None:
    deep = b'{"token_ids": [1, 2], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with service() as s:
        for body in (deep, b'{"token_ids": ' + b"[" * 40 + b"]" * 40 + b"}"):
            code, out, _ = call(s, "POST", "/query", raw=body)
            assert code == 400 and "nested deeper than 32" in out["error"], out
        # brackets inside strings are text, not nesting
        text = json.dumps({"token_ids": TOKS, "lora_name": None, "cache_salt": "[" * 100}).encode()
        assert call(s, "POST", "/query", raw=text)[0] == 200
    assert not any(r.exc_info for r in caplog.records)
    check_json_shape(b"[[[]]]", 3, 8)
    with pytest.raises(ValueError, match="deeper than 2"):
        check_json_shape(b"[[[]]]", 2, 8)


def test_a_body_of_many_empty_arrays_is_a_json_400_before_the_parser_walks_it() -> None:
    """The parser skips an unknown field's arrays one by one, at many times a string's cost per byte: a body of
    them past ``max_json_containers`` is refused by count, while as many brackets in a string are text."""
    with service(max_json_containers=64) as s:
        many = b'{"token_ids": [1, 2, 3, 4], "x": [' + b"[]," * 70 + b"[]]}"
        code, out, _ = call(s, "POST", "/query", raw=many)
        assert code == 400 and out["error"] == "bad request body: 74 JSON arrays and objects; at most 64", out
        assert call(s, "POST", "/query", raw=b'{"token_ids": [1, 2, 3, 4], "x": [' + b"[]," * 60 + b"[]]}")[0] == 200
        text = json.dumps({"token_ids": TOKS, "cache_salt": "[]{}" * 100}).encode()
        assert call(s, "POST", "/query", raw=text)[0] == 200


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests arrays and objects."""
    if isinstance(value, list | dict):
        kids = value.values() if isinstance(value, dict) else value
        return 1 + max(map(_depth, kids), default=0)
    return 0


def _containers(value: Any) -> int:
    """How many arrays and objects a parsed JSON value holds, itself included."""
    if isinstance(value, list | dict):
        kids = value.values() if isinstance(value, dict) else value
        return 1 + sum(map(_containers, kids))
    return 0


_TEXT = st.text(alphabet='[]{}"\\ab\u00e9', max_size=8)
_JSON = st.recursive(st.none() | st.integers(-9, 9) | _TEXT,
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_TEXT, kids, max_size=3), max_leaves=40)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(value=_JSON, ascii_only=st.booleans())
def test_the_shape_check_sees_the_nesting_and_the_containers_the_decoder_would(value: Any, ascii_only: bool) -> None:
    """Brackets, quotes and backslashes in strings are text; the check refuses a body exactly when the value it
    encodes nests deeper than allowed, or holds more arrays and objects than allowed."""
    body = json.dumps(value, ensure_ascii=ascii_only).encode()
    depth, containers = _depth(value), _containers(value)
    check_json_shape(body, max(depth, 2), max(containers, 4))
    if depth > 2:
        with pytest.raises(ValueError, match=f"deeper than {depth - 1} levels"):
            check_json_shape(body, depth - 1, max(containers, 4))
    if containers > 4:
        with pytest.raises(ValueError, match=f"^bad request body: {containers} JSON arrays and objects; at most "
                                             f"{containers - 1}$"):
            check_json_shape(body, max(depth, 2), containers - 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tail", [b'"' + b'\\"' * 1_000_000, b'"' * 2_000_000, b'"a",' * 500_000])
def test_the_depth_check_is_linear_in_a_hostile_body(tail: bytes) -> None:
    """An unterminated string of escaped quotes, a run of bare quotes and many strings, 2 MB each behind 40 brackets:
    a check that rescanned from every quote (quadratic) would run for hours; this one is refused within the test's
    timeout, as deeper than allowed."""
    with pytest.raises(ValueError, match="deeper than 32"):
        check_json_shape(b"[" * 40 + tail, 32, 1 << 20)


def test_caps_on_mm_items_token_ids_and_request_id_length() -> None:
    with service(max_mm_items=2, max_request_id_bytes=8) as s:
        items = [{"identifier": f"i{k}", "offset": 4 * k, "length": 4} for k in range(3)]
        code, out, _ = call(s, "POST", "/query", {"token_ids": TOKS, "mm_items": items})
        assert code == 400 and "3 mm_items; at most 2" in out["error"]
        assert call(s, "POST", "/query", {"token_ids": TOKS, "mm_items": items[:2]})[0] == 200
        code, out, _ = call(s, "POST", "/query", {"token_ids": [1] * 4097})
        assert code == 400 and "at most 4096" in out["error"]
        code, out, _ = call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "x" * 9})
        assert code == 400 and "longer than 8 bytes" in out["error"]
        assert call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "x" * 8})[0] == 200
        code, out, _ = call(s, "POST", "/query", {"token_ids": TOKS, "mm_items": [
            {"identifier": "i", "offset": 2**70, "length": 4}]})
        assert code == 400, out
        # A prompt's items are disjoint: overlapping ones, which would make every block hash every item, get 400.
        code, out, _ = call(s, "POST", "/query", {"token_ids": TOKS, "mm_items": [
            {"identifier": "a", "offset": 4, "length": 8}, {"identifier": "b", "offset": 0, "length": 5}]})
        assert code == 400 and "the item at offset 4 starts inside the one at offset 0 (length 5)" in out["error"]
        assert call(s, "POST", "/query", {"token_ids": TOKS, "mm_items": [
            {"identifier": "a", "offset": 5, "length": 8}, {"identifier": "b", "offset": 0, "length": 5}]})[0] == 200
        # An item's placeholders are prompt tokens: one that ends past the prompt is refused, not hashed silently.
        for offset, length in ((len(TOKS), 1), (len(TOKS) - 2, 3), (2**31, 4)):
            code, out, _ = call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "mm", "mm_items": [
                {"identifier": "a", "offset": offset, "length": length}]})
            assert code == 400 and out["error"] == (f"mm_items: the item at offset {offset} (length {length}) ends "
                                                    f"past the prompt's {len(TOKS)} tokens"), out
        assert call(s, "POST", "/query", {"token_ids": TOKS, "mm_items": [
            {"identifier": "a", "offset": len(TOKS) - 3, "length": 3}]})[0] == 200


@pytest.mark.timeout(60)
def test_a_long_multimodal_identifier_is_hashed_once_per_item_not_per_block() -> None:
    """One item over a 1,048,576-token prompt (65,536 blocks of 16) with a 4 MB identifier: hashing the identifier
    for every block would be 275 GB of work; each block inside the item hashes its offset only."""
    ident = "x" * (4 << 20)
    extras = mm_block_extras(1 << 20, 16, [(ident, 0, 1 << 20)])
    assert extras is not None and len(extras) == 1 << 16
    assert extras[0] == extra_digest([(ident, 0)]) and extras[-1] == extra_digest([(ident, -(1 << 20) + 16)])


# --- tokens, owners, bookings ------------------------------------------------------------------------------


def test_tokens_guard_state_changes_and_only_the_owner_releases(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("# two clients\nalpha\n\nbeta\n")
    with service(auth_token_file=str(tmp_path / "tokens")) as s:
        assert call(s, "POST", "/query", {"token_ids": TOKS})[0] == 200  # reads need no token
        for token in (None, "gamma", "alph", "alphaa"):
            code, out, r = call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "r1"}, token=token)
            assert code == 401 and "Bearer" in out["error"] and r.getheader("WWW-Authenticate") == "Bearer"
        code, _, _ = call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "r1"},
                          headers={"Authorization": "Basic alpha"})
        assert code == 401
        assert call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "r1"}, token="alpha")[0] == 200
        assert call(s, "POST", "/requests/r1/finish", {})[0] == 401
        code, out, _ = call(s, "POST", "/requests/r1/finish", {}, token="beta")
        assert code == 403 and "another client" in out["error"]
        assert call(s, "POST", "/requests/r1/first_token", {}, token="beta")[0] == 403
        assert len(s.clients) == 1 and metrics(s)["requests_in_flight"] == 1  # still booked
        assert call(s, "POST", "/requests/r1/first_token", {}, token="alpha")[0] == 200
        assert call(s, "POST", "/requests/r1/finish", {}, token="alpha")[1]["was_in_flight"] is True
        m = metrics(s)
        assert (m["requests_in_flight"], m["auth_refused"], m["owner_refused"]) == (0, 6, 2)
        assert "kvtier_owner_refused_total 2" in get(s.address + "/metrics")


def test_without_tokens_the_owner_is_the_peer() -> None:
    with service() as s:
        s.route({"token_ids": TOKS, "request_id": "r1"}, owner="peer:10.0.0.1")
        with pytest.raises(Forbidden):
            s.finish("r1", b"", owner="peer:10.0.0.2")
        # over HTTP from 127.0.0.1: another peer's booking is not ours to release
        assert call(s, "POST", "/requests/r1/finish", {})[0] == 403
        assert call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "r2"})[0] == 200
        assert call(s, "POST", "/requests/r2/finish", {})[1]["was_in_flight"] is True


def test_bookings_are_capped_per_client_429_and_in_all_503(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("alpha\nbeta\n")
    clock = Clock()
    with service(clock, auth_token_file=str(tmp_path / "tokens"), max_in_flight=3, max_in_flight_per_client=2,
                 request_ttl_s=0.5) as s:
        def book(rid: str, token: str) -> tuple[int, Any]:
            code, out, _ = call(s, "POST", "/route", {"token_ids": TOKS, "request_id": rid}, token=token)
            return code, out

        assert book("a1", "alpha")[0] == book("a2", "alpha")[0] == 200
        code, out = book("a3", "alpha")
        assert code == 429 and "at most 2 per client" in out["error"]
        assert book("b1", "beta")[0] == 200
        code, out = book("b2", "beta")
        assert code == 503 and "at most 3" in out["error"]
        assert metrics(s)["bookings_refused"] == 2
        assert call(s, "POST", "/requests/a1/finish", {}, token="alpha")[0] == 200
        assert book("b2", "beta")[0] == 200  # room again
        # bookings that expire free their client's room too
        clock.t += 0.5
        wait_for(lambda: metrics(s)["requests_in_flight"] == 0)
        assert len(s.clients) == 0
        assert book("a4", "alpha")[0] == book("a5", "alpha")[0] == 200


def test_bookings_are_capped_in_prompt_blocks_per_client_429_and_in_all_503(tmp_path: Path) -> None:
    """A booking holds its prompt's block keys until it ends: the blocks in flight are capped, a client's and in all,
    whatever the count of bookings, and a finish or an expiry gives them back."""
    (tmp_path / "tokens").write_text("alpha\nbeta\n")
    clock = Clock()
    with service(clock, auth_token_file=str(tmp_path / "tokens"), max_in_flight_blocks=20,
                 max_in_flight_blocks_per_client=12, request_ttl_s=0.5) as s:
        def book(rid: str, token: str, blocks: int) -> tuple[int, Any]:
            code, out, _ = call(s, "POST", "/route", {"token_ids": TOKS[:blocks * BS], "request_id": rid},
                                token=token)
            return code, out

        assert book("a1", "alpha", 8)[0] == 200
        code, out = book("a2", "alpha", 5)  # 13 > 12
        assert code == 429 and "8 prompt blocks in flight" in out["error"]
        assert "max_in_flight_blocks_per_client 12" in out["error"]
        assert book("a2", "alpha", 4)[0] == 200  # 12: at the cap, not past it
        assert book("b1", "beta", 8)[0] == 200  # 20 in all
        code, out = book("b2", "beta", 1)
        assert code == 503 and "max_in_flight_blocks 20" in out["error"]
        m = metrics(s)
        assert (m["blocks_in_flight"], m["requests_in_flight"], m["bookings_refused"]) == (20, 3, 2)
        assert "kvtier_blocks_in_flight 20" in get(s.address + "/metrics")
        assert call(s, "POST", "/requests/a1/finish", {}, token="alpha")[0] == 200
        assert metrics(s)["blocks_in_flight"] == 12
        assert book("b2", "beta", 4)[0] == 200  # beta: 12, at its cap
        assert book("b3", "beta", 1)[0] == 429
        clock.t += 0.5
        wait_for(lambda: metrics(s)["requests_in_flight"] == 0)  # expired: every block given back
        assert metrics(s)["blocks_in_flight"] == 0 and s.clients.blocks == 0
        assert book("a3", "alpha", 8)[0] == 200


@pytest.mark.parametrize(("address", "key"), [
    ("10.0.0.1", "10.0.0.1"), ("::ffff:10.0.0.1", "10.0.0.1"), ("2001:db8::1", "2001:db8::1"),
    ("2001:db8:0:0::1", "2001:db8::1"), ("fe80::1%eth0", "fe80::1%eth0"), ("fe80::1%eth1", "fe80::1%eth1"),
    (None, "?"), ("", "?"), ("not an address", "not an address")])
def test_a_peer_is_its_address(address: str | None, key: str) -> None:
    """One address is one peer however it is written (an IPv4 peer seen by a dual-stack socket included); two
    addresses are two peers, a link-local one on each interface too."""
    assert peer_key(address) == key


def test_an_ipv6_listen_address_may_be_bracketed() -> None:
    cfg = ServiceConfig(endpoints=[parse_endpoint("w0=tcp://127.0.0.1:1")], listen="[::1]:8077")
    assert cfg.host_port == ("::1", 8077)
    assert ServiceConfig(endpoints=cfg.endpoints, listen="::1:8077").host_port == ("::1", 8077)


def test_round_robin_takes_a_turn_per_booking_not_per_query() -> None:
    """A query books nothing, so it moves no turn: it names the worker the next route goes to, and the routes alone
    go round."""
    eps = [parse_endpoint(f"w{i}=tcp://127.0.0.1:{i + 1}") for i in range(3)]
    s = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", policy="round_robin"))
    routed = []
    for i in range(4):
        asked = {s.query({"token_ids": TOKS})["recommended"] for _ in range(3)}
        routed.append(s.route({"token_ids": TOKS, "request_id": f"r{i}"})["worker"])
        assert asked == {routed[-1]}
    assert routed == ["w0", "w1", "w2", "w0"]


class PicksNobody(PolicyBase):
    """A plugin that breaks its protocol: it picks a worker it did not score."""

    name = "picks_nobody"

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        return 0.0

    def pick(self, ctx: RouteContext, scores: dict[StreamId, float]) -> StreamId:
        return StreamId(WorkerId("nobody"))


class ScoresWrong(PolicyBase):
    """A plugin whose own code fails: its score raises a ValueError, as a bad request would."""

    name = "scores_wrong"

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        raise ValueError("no such table")


class LearnsWrong(PolicyBase):
    """A plugin whose routing-history hook fails: queries (which book nothing) work, routes do not."""

    name = "learns_wrong"

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        return 0.0

    def routed(self, keys: Any, num_tokens: int, worker: StreamId) -> None:
        raise KeyError(worker)


class Exits(PolicyBase):
    """A plugin that calls sys.exit while scoring: the service's event loop must answer, and go on."""

    name = "exits"

    def score(self, ctx: RouteContext, worker: StreamId) -> float:
        raise SystemExit(5)


@pytest.mark.parametrize(("plugin", "says", "paths"), [
    ("Exits", "policy 'exits': score() raised SystemExit: 5", ("/query", "/route")),
    ("PicksNobody", "policy 'picks_nobody': picked StreamId(", ("/query", "/route")),
    ("ScoresWrong", "policy 'scores_wrong': score() raised ValueError: no such table", ("/query", "/route")),
    ("LearnsWrong", "policy 'learns_wrong': routed() raised KeyError: ", ("/route",))])
def test_a_failing_plugin_is_a_500_naming_it_not_the_clients_400(
        plugin: str, says: str, paths: tuple[str, ...], caplog: pytest.LogCaptureFixture) -> None:
    """Whatever a plugin does wrong (breaks its protocol, or raises: even a ValueError is its bug, not the request's)
    is answered 500 naming it, logged and counted, and books nothing: no client booking, no load."""
    with service(policy=f"tests.test_service_limits:{plugin}") as s:
        for path in ("/query", "/route"):
            code, out, _ = call(s, "POST", path, {"token_ids": TOKS, "request_id": "r1"} if path == "/route"
                                else {"token_ids": TOKS})
            assert (code == 500 and out["error"].startswith(says)) if path in paths else code == 200, (path, out)
        assert len(s.clients) == 0 and s.loads.load(s.index.streams[0]).running == 0  # nothing booked
        n = len(paths)
        assert metrics(s)["plugin_errors"] == n and f"kvtier_plugin_errors_total {n}" in get(s.address + "/metrics")
    name = says.split("'")[1]
    assert sum(f"'{name}'" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR) == n


@pytest.mark.parametrize(("slo", "ttft", "tpot", "meets"), [
    ({"ttft_ms": 100}, 50.0, float("nan"), True), ({"ttft_ms": 100}, 150.0, 5.0, False),
    ({"tpot_ms": 10}, 50.0, float("nan"), None), ({"ttft_ms": 100, "tpot_ms": 10}, 150.0, float("nan"), False),
    ({"ttft_ms": 100, "tpot_ms": 10}, 50.0, 9.0, True), ({"ttft_ms": 100, "tpot_ms": 10}, 50.0, 11.0, False)])
def test_meets_slo_is_null_where_a_bound_cannot_be_checked(slo: dict[str, float], ttft: float, tpot: float,
                                                           meets: bool | None) -> None:
    assert slo_met(ttft, tpot, slo.get("ttft_ms"), slo.get("tpot_ms")) is meets


def test_a_route_without_a_tpot_prediction_does_not_claim_its_tpot_bound() -> None:
    with service() as s:  # no capacity_tokens: no TPOT predicted
        out = s.route({"token_ids": TOKS, "request_id": "r1", "slo": {"ttft_ms": 60_000, "tpot_ms": 50}})
        assert out["predicted"]["tpot_ms"] is None and out["predicted"]["meets_slo"] is None


def test_output_tokens_are_bounded_by_the_context() -> None:
    with service(max_context_tokens=1000) as s:
        assert call(s, "POST", "/route", {"token_ids": TOKS, "request_id": "r1"})[0] == 200
        for n in (1208925819614629174706176, 1001, -1):
            code, out, _ = call(s, "POST", "/requests/r1/finish", raw=b'{"output_tokens": %d}' % n)
            assert code == 400, (n, out)
        assert call(s, "POST", "/requests/r1/finish", {"output_tokens": 1000})[0] == 200
        assert s.loads.expected_output == 1000


# --- connections -------------------------------------------------------------------------------------------


# The connection-level limits live in the protocol objects each event loop drives: both loops are checked.
LOOPS = [pytest.param("uvloop", marks=pytest.mark.skipif(find_spec("uvloop") is None, reason="no uvloop")),
         "asyncio"]


def _open(s: IndexerService) -> socket.socket:
    host, port = s.address.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


@contextmanager
def _holding(s: IndexerService, n: int) -> Iterator[None]:
    """``n`` connections held open (counted by the server) for the body of the ``with``; closed after it, and the
    server's count back to none."""
    held = [_open(s) for _ in range(n)]
    try:
        wait_for(lambda: metrics_open(s) == n)
        yield
    finally:
        for k in held:
            k.close()
    wait_for(lambda: metrics_open(s) == 0)


def _refused(s: IndexerService) -> tuple[bytes, str]:
    """Opens a connection that the server answers without a request and closes: the answer's head and error."""
    with _open(s) as k:
        answer = b""
        while chunk := k.recv(4096):  # ends when the server closes it
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, str(json.loads(body)["error"])


@pytest.mark.parametrize("loop", LOOPS)
def test_one_connection_past_the_cap_gets_a_json_503_and_is_closed(loop: str) -> None:
    with service(max_connections=4, header_timeout_s=60.0, http_loop=loop) as s:
        with _holding(s, 4):
            head, error = _refused(s)
            assert head.startswith(b"HTTP/1.1 503 ") and b"application/json" in head
            assert "too many open connections (at most 4)" in error
            assert s._http.counters()["http_connections_refused"] == 1
        assert call(s, "POST", "/query", {"token_ids": TOKS})[0] == 200


@pytest.mark.parametrize("loop", LOOPS)
def test_one_peer_past_its_cap_gets_a_json_429_and_another_peer_is_served(loop: str) -> None:
    """One peer cannot hold every connection: past its own cap it is turned away, while another peer (a second
    loopback address) still connects and is answered."""
    with service(max_connections=8, max_connections_per_peer=3, header_timeout_s=60.0, http_loop=loop) as s:
        with _holding(s, 3):
            head, error = _refused(s)
            assert head.startswith(b"HTTP/1.1 429 ") and b"application/json" in head
            assert "too many open connections from this peer (at most 3)" in error
            counters = s._http.counters()
            assert (counters["http_connections_refused_per_peer"], counters["http_connections_refused"]) == (1, 0)
            host, port = s.address.removeprefix("http://").split(":")
            other = http.client.HTTPConnection(host, int(port), timeout=5, source_address=("127.0.0.2", 0))
            other.request("POST", "/query", body=json.dumps({"token_ids": TOKS}))
            assert other.getresponse().status == 200
            other.close()
        # Every peer's count back to none (the loop thread updates it a moment after the count of open ones)
        wait_for(lambda: s._http._server is not None and not s._http._server.peers)
        assert call(s, "POST", "/query", {"token_ids": TOKS})[0] == 200  # room again for the first peer
        assert "kvtier_http_connections_refused_per_peer_total 1" in get(s.address + "/metrics")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_peer_bursting_past_its_cap_takes_no_room_from_another(loop: str) -> None:
    """Connections refused at their peer's cap never count against the total: with the event loop held while one
    peer opens four times its cap and another peer one connection (accepted together when the loop wakes), the
    first peer's surplus gets 429 and the other peer is served, none refused at the total."""
    with service(max_connections=4, max_connections_per_peer=2, header_timeout_s=60.0, http_loop=loop) as s:
        http_loop = s._http._loop
        http_loop.call_soon_threadsafe(time.sleep, 0.5)  # the loop accepts nothing meanwhile
        burst = [_open(s) for _ in range(8)]
        host, port = s.address.removeprefix("http://").split(":")
        other = socket.create_connection((host, int(port)), timeout=5, source_address=("127.0.0.2", 0))
        try:
            other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := other.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
            statuses = []
            for k in burst[2:]:  # the loop takes them in order: the first two are admitted
                k.settimeout(0.2)
                with contextlib.suppress(TimeoutError):
                    statuses.append(k.recv(12))
            assert statuses == [b"HTTP/1.1 429"] * 6
            counters = s._http.counters()
            assert (counters["http_connections_refused_per_peer"], counters["http_connections_refused"]) == (6, 0)
        finally:
            other.close()
            for k in burst:
                k.close()
        wait_for(lambda: metrics_open(s) == 0)


def _exchange(s: IndexerService, head: bytes, body: bytes = b"") -> tuple[bytes, bytes, bool]:
    """Sends a request's head, and ``body`` only once the server said ``100 Continue``: the first answer's status
    line, the final answer (the first one if it was final), and, after a first answer that was final, whether the
    server then closed the connection at once (within the socket's 5 s timeout; aiohttp's lingering close would
    wait 10 s for a body)."""
    with _open(s) as k:
        k.sendall(head)
        got = b""

        def answer() -> bytes:  # the next whole answer (its Content-Length bytes of body, if any)
            nonlocal got
            while b"\r\n\r\n" not in got:
                got += k.recv(4096) or _closed()
            top, _, got = got.partition(b"\r\n\r\n")
            length = next((int(ln.split(b":")[1]) for ln in top.split(b"\r\n")
                           if ln.lower().startswith(b"content-length:")), 0)
            while len(got) < length:
                got += k.recv(4096) or _closed()
            out, got = top + b"\r\n\r\n" + got[:length], got[length:]
            return out

        first = answer()
        if first.startswith(b"HTTP/1.1 100 "):
            k.sendall(body)
            return first.partition(b"\r\n")[0], answer(), False  # (a keep-alive connection: not waited on)
        try:
            closed = not got and k.recv(1) == b""
        except TimeoutError:
            closed = False
        return first.partition(b"\r\n")[0], first, closed


def _closed() -> bytes:
    raise AssertionError("the server closed the connection mid-answer")


@pytest.mark.parametrize("loop", LOOPS)
def test_expect_100_continue_is_refused_before_the_body_when_it_would_be_refused_unread(
        loop: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that asks before sending its body is not told to send one that is then refused: a declared length
    past the cap (413), an encoding that is not decoded (415), a state change without a token (401), an expectation
    other than 100-continue (417) are answered at once, in JSON, and the connection closed (within half a second
    when no body comes; a body sent anyway is read and dropped first, so that its client reads the answer); a
    request that passes them gets ``100 Continue``, and an HTTP/1.0 one's expectation is ignored (RFC 9110). A
    client gone before it was told to go on costs no traceback."""
    (tmp_path / "tokens").write_text("alpha\n")
    with service(http_loop=loop, auth_token_file=str(tmp_path / "tokens")) as s:
        def head(path: str, length: int, *extra: str, version: str = "1.1") -> bytes:
            lines = [f"POST {path} HTTP/{version}", "Host: x", "Content-Type: application/json",
                     f"Content-Length: {length}", *extra]
            return ("\r\n".join(lines) + "\r\n\r\n").encode()

        body = json.dumps({"token_ids": TOKS}).encode()
        for path, extra, status, said in [
                ("/query", ("Expect: 100-continue",), b"413", "body larger than 64000 bytes"),
                ("/query", ("Expect: 100-continue", "Content-Encoding: br"), b"415", "'br' is not supported"),
                ("/route", ("Expect: 100-continue",), b"401", "Bearer"),
                ("/query", ("Expect: something-else",), b"417", "Expect: something-else is not supported")]:
            size = 10**6 if status == b"413" else len(body)
            first, final, closed = _exchange(s, head(path, size, *extra), body)
            assert first.startswith(b"HTTP/1.1 " + status), (path, extra, first)
            assert said in json.loads(final.partition(b"\r\n\r\n")[2])["error"]
            assert closed, (path, extra)
        first, final, closed = _exchange(s, head("/query", len(body), "Expect: 100-continue"), body)
        assert first.startswith(b"HTTP/1.1 100 ") and final.startswith(b"HTTP/1.1 200 ")
        route = json.dumps({"token_ids": TOKS, "request_id": "r1"}).encode()
        first, final, _ = _exchange(s, head("/route", len(route), "Expect: 100-continue",
                                            "Authorization: Bearer alpha"), route)
        assert first.startswith(b"HTTP/1.1 100 ") and final.startswith(b"HTTP/1.1 200 ") and len(s.clients) == 1
        with _open(s) as k:  # HTTP/1.0: no 100 Continue, no 417; the body is read as it comes
            k.sendall(head("/query", len(body), "Expect: 100-continue", version="1.0") + body)
            assert k.recv(12) == b"HTTP/1.0 200"
        # A body sent without waiting is read and dropped: its client reads the 413, no reset. (The linger made long
        # here, so that the body has time to come whatever the load; the connection closes once it has come.)
        monkeypatch.setattr(http_front, "EXPECT_LINGER_S", 30.0)
        with _open(s) as k:
            k.sendall(head("/query", 1 << 20, "Expect: 100-continue") + bytes(1 << 20))
            answer = b""
            while chunk := k.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 413 ") and b"body larger than 64000 bytes" in answer
        with _open(s) as k:  # GET too answers an unknown expectation in JSON
            k.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nExpect: magic\r\n\r\n")
            answer = k.recv(4096)
            assert answer.startswith(b"HTTP/1.1 417 ") and b"application/json" in answer
        for rst in (False, True):  # gone before the 100 Continue was written (with a FIN, or a reset)
            with _open(s) as k:
                if rst:
                    k.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                k.sendall(head("/query", len(body), "Expect: 100-continue"))
        wait_for(lambda: metrics_open(s) == 0)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def metrics_open(s: IndexerService) -> int:
    return s._http.counters()["http_connections_open"]


@pytest.mark.parametrize("loop", LOOPS)
def test_sockets_that_send_no_headers_are_closed_at_the_deadline(loop: str, caplog: pytest.LogCaptureFixture) -> None:
    with service(header_timeout_s=0.3, http_loop=loop) as s:
        with _open(s) as idle, _open(s) as slow:
            slow.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\n")  # headers begun, never ended
            assert idle.recv(1) == b"" and slow.recv(1) == b""  # closed by the server, not a timeout
        assert s._http.counters()["http_header_timeouts"] == 2
        # a closing is counted, not an error: anyone can open idle sockets, and each must not log a traceback
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        # a connection that sent its request is not cut by it, and stays usable after the deadline
        host, port = s.address.removeprefix("http://").split(":")
        c = http.client.HTTPConnection(host, int(port), timeout=5)
        for _ in range(2):
            c.request("POST", "/query", body=json.dumps({"token_ids": TOKS}))
            assert c.getresponse().read() and c.sock is not None
            threading.Event().wait(0.4)
        c.close()
        assert "kvtier_http_header_timeouts_total 2" in get(s.address + "/metrics")


@pytest.mark.parametrize("loop", LOOPS)
def test_requests_aiohttp_cannot_parse_get_json_over_http_1_1_and_are_counted(
        loop: str, caplog: pytest.LogCaptureFixture) -> None:
    with service(http_loop=loop) as s:
        with _open(s) as k:
            k.sendall(b"GARBAGE\r\n\r\n")
            answer = b""
            while chunk := k.recv(4096):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 "), head
        assert b"application/json" in head and json.loads(body)["error"]
        text = get(s.address + "/metrics")
        assert f"{MALFORMED_METRIC} 1" in text  # the metric the log line names exists
    logged = [r.getMessage() for r in caplog.records if "malformed HTTP" in r.getMessage()]
    assert all(MALFORMED_METRIC in m for m in logged if "counted in" in m)


# --- snapshots, configuration, open files ------------------------------------------------------------------


def test_a_snapshot_that_cannot_be_written_is_reported(tmp_path: Path) -> None:
    snap = tmp_path / "idx.snap"
    with service(snapshot_path=str(snap), snapshot_interval_s=0.1) as s:
        wait_for(lambda: snap.exists())

        wait_for(lambda: replaced_by_a_directory(snap))
        wait_for(lambda: s.health()["status"] == "degraded")
        h = s.health()
        assert "snapshot" in h["snapshot_error"] and h["partial_workers"] == h["recovering_workers"] == []
        assert metrics(s)["snapshot_failures"] >= 1
        assert "kvtier_snapshot_failures_total" in get(s.address + "/metrics")
        snap.rmdir()
        wait_for(lambda: s.health()["status"] == "ok")
        assert "snapshot_error" not in s.health()


@pytest.mark.parametrize("where", ["capture", "encode"])
def test_a_snapshot_that_fails_on_a_bug_leaves_the_loop_running(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writing a snapshot is beside the point of the loop: a bug there (an index that cannot be read back whole) is
    reported as a failed snapshot, and the index goes on following the engines (the loop died, every worker's
    /query with it), whether it is in the copy made on the loop's thread or in the encoding on the writer's."""
    from kvtier.indexer.service import persist

    def broken(*args: Any) -> Any:
        raise KeyError(12345)

    if where == "capture":
        monkeypatch.setattr(TieredIndex, "capture", broken)
    else:
        monkeypatch.setattr(persist, "encode", broken)
    snap = tmp_path / "idx.snap"
    with service(snapshot_path=str(snap), snapshot_interval_s=0.1) as s:
        wait_for(lambda: metrics(s)["snapshot_failures"] >= 2)
        h = s.health()
        assert h["status"] == "degraded" and "KeyError: 12345" in h["snapshot_error"] and not s.failed.is_set()
        assert s._loop.is_alive() and not snap.exists()


def test_events_are_applied_while_a_snapshot_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop copies the index for a periodic snapshot and a helper thread encodes and writes the copy: the index
    applied no event for as long as a whole snapshot took (seconds for millions of blocks). Here the write is held
    until a batch published after the copy is applied and found by a query; the file then holds the index as it was
    copied, no second copy is taken while the first is being written, and the snapshot taken at stop holds the
    batch."""
    from kvtier.indexer.service import persist

    write, held, release = persist.write, threading.Event(), threading.Event()
    capture, copies, first = persist.capture, [], []

    def counted_capture(*args: Any) -> persist.Pending:
        copies.append(1)
        return capture(*args)

    def held_write(path: Path, pending: persist.Pending) -> int:
        if release.is_set():
            return write(path, pending)
        held.set()
        assert release.wait(30)
        n = write(path, pending)
        first.append(len(persist.load(path, BS)[0]))
        return n

    monkeypatch.setattr(persist, "capture", counted_capture)
    monkeypatch.setattr(persist, "write", held_write)
    snap = tmp_path / "idx.snap"
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    s = IndexerService(ServiceConfig(endpoints=[parse_endpoint(f"w0={pub.endpoint},replay={pub.replay_endpoint}")],
                                     block_size=BS, listen="127.0.0.1:0", snapshot_path=str(snap),
                                     snapshot_interval_s=0.1))
    s.start()
    try:
        assert held.wait(30), "no periodic snapshot began"
        pub.publish(EventBatch(ts=0.0, events=[BlockStored(block_hashes=[1], token_ids=list(range(BS)),
                                                             block_size=BS)]))
        wait_for(lambda: s.query({"token_ids": list(range(BS))})["workers"]["w0"]["device"] == 1)
        time.sleep(0.3)  # three intervals more: the write still held, no copy is taken
        assert len(copies) == 1 and s.snapshots == 0 and not snap.exists()
        release.set()
        wait_for(lambda: s.snapshots >= 1)
        assert first == [0]  # the index as copied, before the batch came
        assert 0 < metrics(s)["snapshot_pause_seconds"] <= metrics(s)["snapshot_seconds"]
    finally:
        release.set()
        s.stop()
        pub.close()
    index, _ = persist.load(snap, BS)
    assert len(index) == 1


class _NoSubscriber:
    """What EventLoop._save_behind asks of a subscriber: the streams' positions (none)."""

    def positions(self) -> dict[StreamId, tuple[int, int | None]]:
        return {}


def _loop(tmp_path: Path, **settings: Any) -> EventLoop:
    cfg = ServiceConfig(endpoints=[], block_size=BS, snapshot_path=str(tmp_path / "s"), **settings)
    return EventLoop(cfg, TieredIndex(BS), threading.Lock(), Deadlines(10.0), lambda rid: None, {})


def test_a_snapshot_error_stays_while_the_next_write_is_under_way(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With every write failing (a full disk), the copy's success on the loop thread cleared the error before the
    write on the helper thread ran: /health read "ok" for as long as each write took."""
    from kvtier.indexer.service import persist

    gate, entered = threading.Event(), threading.Event()

    def failing_write(path: Path, pending: persist.Pending) -> int:
        entered.set()
        assert gate.wait(10)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persist, "write", failing_write)
    loop = _loop(tmp_path)
    loop._sub = _NoSubscriber()  # type: ignore[assignment]
    for failures in (1, 2):
        gate.clear()
        assert loop._save_behind()
        assert entered.wait(10)
        if failures == 2:
            assert loop.snapshot_error is not None, "the error was cleared while a failing write was under way"
        gate.set()
        assert loop._writing is not None
        loop._writing.result()
        assert loop.snapshot_failures == failures and "No space left on device" in (loop.snapshot_error or "")


def test_a_service_without_snapshots_takes_none() -> None:
    """Without a snapshot path the periodic snapshot still ran, failed on its missing path and left /health
    degraded from the first interval on (30 s by default), for every deployment without snapshots."""
    with service(snapshot_interval_s=0.1) as s:
        loop = s._loop
        wait_for(lambda: loop._sub is not None)
        time.sleep(0.5)  # five intervals
        assert loop.snapshot_failures == 0 and loop.snapshots == 0 and s.health()["status"] == "ok", s.health()


def test_a_snapshot_copy_is_whole_while_routing_marks_window_kv() -> None:
    """Routing marks inferred window KV from the HTTP threads (under the service's lock) while the event loop copies
    the index for a snapshot (without it): the copy iterated the window-KV dict, and a mark that added a key meanwhile
    failed the snapshot ("dictionary changed size during iteration"). The copy of that dict is made under the lock.
    Here half the blocks have window KV, another thread marks the other half one by one, as routing does, and thread
    switches are as frequent as the interpreter allows, so that a copy that can be interleaved is."""
    from kvtier.indexer.service import persist

    index = TieredIndex(BS, window_tokens=BS)
    stream = StreamId(WorkerId("w0"))
    toks = list(range(BS * 20_000))
    index.apply(stream, BlockStored(block_hashes=list(range(1, 20_001)), token_ids=toks, block_size=BS))
    keys = index.request_keys(toks)
    go, stop, lock = threading.Event(), threading.Event(), threading.Lock()

    def route() -> None:
        while not stop.is_set():
            go.wait()
            for k in keys[1::2]:
                with lock:
                    index.note_routed(stream, [k])
            go.clear()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    router = threading.Thread(target=route)
    router.start()
    try:
        for _ in range(20):
            index._win.bits.clear()
            for k in keys[::2]:
                index.note_routed(stream, [k])
            go.set()
            persist.capture(index, {}, lock)
            while go.is_set():
                time.sleep(0.001)
    finally:
        stop.set()
        go.set()
        router.join()
        sys.setswitchinterval(old)


def test_stop_waits_for_the_snapshots_it_writes_on_its_way_out(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """On stop the loop waits for the periodic write in flight, then writes the last snapshot; join gave up after
    5 s, and a process exiting then lost the last snapshot (the loop's thread is a daemon)."""
    from kvtier.indexer.service import persist

    write, started = persist.write, threading.Event()

    def slow_write(path: Path, pending: persist.Pending) -> int:
        started.set()
        time.sleep(3.0)  # a large index's snapshot
        return write(path, pending)

    monkeypatch.setattr(persist, "write", slow_write)
    loop = _loop(tmp_path, snapshot_interval_s=0.1)
    loop.start()
    assert started.wait(10)  # a periodic write is in flight
    loop.stop()
    loop.join()
    assert not loop._thread.is_alive() and loop.snapshots == 2


class _Gated:
    """Holds the event loop's next poll once ``armed``, until ``gate`` opens: a pass that applies a catch-up's
    deliveries for seconds (a poll takes up to 10,000 batches)."""

    def __init__(self) -> None:
        self.armed, self.entered, self.gate = threading.Event(), threading.Event(), threading.Event()

    def subscriber(self) -> type[Any]:
        from kvtier.wire.transport.subscriber import Subscriber
        gated = self

        class GatedSubscriber(Subscriber):
            def poll(self, *a: Any, **k: Any) -> Any:
                if gated.armed.is_set():
                    gated.entered.set()
                    assert gated.gate.wait(30)
                return super().poll(*a, **k)
        return GatedSubscriber


@pytest.mark.parametrize("finishes", [True, False])
def test_a_stop_during_a_long_pass_writes_the_last_snapshot_or_says_it_did_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finishes: bool) -> None:
    """A stop came while the loop applied a long poll (a catch-up): join waited 5 s, then only while a snapshot was
    being written, which the loop had not reached. The process exited 0 with the loop's daemon thread mid-pass, and
    the last snapshot was never written. A stop now waits for the pass and the snapshot; one that outlasts even
    that wait is a failed snapshot, which the service exits 1 for."""
    from kvtier.indexer.service import eventloop

    held = _Gated()
    monkeypatch.setattr(eventloop, "Subscriber", held.subscriber())
    monkeypatch.setattr(eventloop, "_STOP_WAIT_S", 30.0 if finishes else 0.3)
    loop = _loop(tmp_path)
    loop.start()
    try:
        held.armed.set()
        assert held.entered.wait(10)  # the loop is mid-pass
        loop.stop()
        if finishes:
            threading.Timer(0.5, held.gate.set).start()  # the pass ends well within the wait
        loop.join(timeout_s=0.1)
        if finishes:
            assert not loop._thread.is_alive() and loop.snapshots == 1 and loop.snapshot_error is None
            assert (tmp_path / "s").is_file()
        else:
            assert loop._thread.is_alive() and loop.snapshots == 0 and loop.snapshot_failures == 1
            assert "not written: the event loop was still applying events 0.4 s after the stop" in (
                loop.snapshot_error or ""), loop.snapshot_error
    finally:
        held.gate.set()
        loop._thread.join(10)


def test_a_start_whose_port_is_taken_says_so_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A start whose HTTP port could not be bound waited for the event loop's last snapshot, as a stop does: a
    minute more where its pass was long, before the port's error, for a service that never served. It is said
    within the loop's first wait, and the snapshot path is let go once the loop ends."""
    from kvtier.indexer.service import eventloop

    held = _Gated()
    monkeypatch.setattr(eventloop, "Subscriber", held.subscriber())
    monkeypatch.setattr(eventloop, "_STOP_WAIT_S", 60.0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        snap = tmp_path / "index.snap"
        svc = IndexerService(ServiceConfig(endpoints=[parse_endpoint("w0=tcp://127.0.0.1:1")], block_size=BS,
                                           listen=f"127.0.0.1:{taken.getsockname()[1]}", snapshot_path=str(snap)))
        held.armed.set()  # the loop's first pass is long
        t0 = time.monotonic()
        try:
            with pytest.raises(OSError):
                svc.start()
            assert time.monotonic() - t0 < 30
        finally:
            held.gate.set()
            svc._loop._thread.join(10)
    again = IndexerService(ServiceConfig(endpoints=[parse_endpoint("w0=tcp://127.0.0.1:1")], block_size=BS,
                                         listen="127.0.0.1:0", snapshot_path=str(snap)))
    again.start()  # (the path is free)
    again.stop()


@pytest.mark.parametrize(("text", "expected"), [
    ('block_size = 1180591620717411303424\n', "block_size: 1180591620717411303424 is not allowed"),
    ("snapshot_interval_s = 1e-9\n", "snapshot_interval_s: 1e-09 is not allowed"),
    ("kv_gbps = 1e-300\n", "kv_gbps: 1e-300 is not allowed; expected a number in [0.001, 1000000]"),
    ('[[endpoints]]\nworker = "w1"\nendpoint = "tcp://127.0.0.1:1"\n', "both subscribe to tcp://127.0.0.1:1"),
    # two streams one name: worker w0's rank 1 and a worker named w0/dp1 (one would vanish from every answer)
    ('[[endpoints]]\nworker = "w0"\ndp_rank = 1\nendpoint = "tcp://127.0.0.1:2"\n[[endpoints]]\nworker = "w0/dp1"\n'
     'endpoint = "tcp://127.0.0.1:3"\n',
     "endpoints: worker 'w0' rank 1 and worker 'w0/dp1' are both named w0/dp1 in every answer"),
    ("max_connections = 0\n", "max_connections: 0 is not allowed"),
    ('auth_token_file = "/nonexistent/tokens"\n', "auth_token_file /nonexistent/tokens"),
])
def test_configurations_refused_in_one_line_exit_2(text: str, expected: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "svc.toml"
    path.write_text(f'listen = "127.0.0.1:0"\n{text}[[endpoints]]\nworker = "w0"\nendpoint = "tcp://127.0.0.1:1"\n')
    assert cli_main(["indexer", "--config", str(path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and expected in err[0], err


@pytest.mark.parametrize("kind", ["fifo", "directory", "too large", "not UTF-8"])
def test_a_token_file_is_a_regular_file_under_its_cap(kind: str, tmp_path: Path) -> None:
    """A FIFO as auth_token_file blocked start-up for ever, waiting for a writer; it is refused at once, like a
    directory and a file past the cap (read no further than one byte past it)."""
    path = tmp_path / "tokens"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "too large":
        path.write_bytes(b"t" * (MAX_TOKEN_FILE_BYTES + 1))
    else:
        path.write_bytes(b"token-one\ncaf\xe9\n")
    want = {"fifo": "is not a regular file", "directory": "is a directory",
            "too large": f"larger than {MAX_TOKEN_FILE_BYTES:,} bytes",
            "not UTF-8": "not UTF-8 (invalid continuation byte at byte 13): expected tokens, one a line"}[kind]
    with pytest.raises(ConfigError, match=re.escape(f"auth_token_file {path}: {want}")):
        load_tokens(str(path))


def test_a_config_that_is_not_utf8_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "svc.toml"
    path.write_bytes(b'listen = "127.0.0.1:\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)
    assert cli_main(["indexer", "--config", str(path)]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "svc.toml: not UTF-8" in err[0], err


def test_the_open_files_limit_is_raised_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"now": (256, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda _: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda _, v: limits.__setitem__("now", v))
    want = fdlimit.needed(3, 1024)
    assert fdlimit.ensure(3, 1024) == want and limits["now"] == (want, 4096)  # soft raised within the hard
    limits["now"] = (256, 512)
    with pytest.raises(ConfigError, match=r"open-files limit 512 \(hard\) is below the \d+"):
        fdlimit.ensure(3, 1024)
    assert fdlimit.ensure(3, 100) == 256  # enough already: left alone


def test_a_service_whose_open_files_cannot_be_raised_exits_2() -> None:
    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    out = subprocess.run([sys.executable, "-m", "kvtier", "indexer", "--endpoint", "w0=tcp://127.0.0.1:1",
                          "--listen", "127.0.0.1:0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         preexec_fn=low)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip() and not ln.startswith(NOTICES)]  # (a slow load)
    assert out.returncode == 2 and len(lines) == 1 and "open-files limit 200" in lines[0], out.stderr


def test_a_clients_blocks_are_given_back_booking_by_booking() -> None:
    """Releasing one of a client's bookings gives back its blocks at once, while the client still has others in
    flight: the per-client block cap counts only what is still booked."""
    from kvtier.indexer.service.clients import Clients, TooManyInFlight

    c = Clients(None, max_in_flight=10, max_per_client=10, max_blocks=1000, max_blocks_per_client=25)
    c.book("r1", "peer:a", 10)
    c.book("r2", "peer:a", 10)
    with pytest.raises(TooManyInFlight):
        c.check_room("peer:a", 15)
    c.release("r1")
    c.check_room("peer:a", 15)  # 10 still booked + 15: within the cap
    assert c.blocks == 10


def test_a_body_of_exactly_the_cap_is_read_and_one_byte_more_is_refused() -> None:
    """``max_body_bytes`` and ``max_body_bytes_in_flight`` are inclusive caps: a body of exactly the cap is read
    whole, one byte past it refused, on the wire as in the shared budget."""
    cap = 1000
    assert asyncio.run(read_body(_Request(b"x" * cap, "identity"), cap)) == b"x" * cap  # type: ignore[arg-type]
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(_Request(b"x" * (cap + 1), "identity"), cap))  # type: ignore[arg-type]
    budget = BodyBudget(cap)
    budget.take(cap)
    with pytest.raises(BodiesBusy):
        budget.take(1)
    assert (budget.held, budget.refused) == (cap, 1)
