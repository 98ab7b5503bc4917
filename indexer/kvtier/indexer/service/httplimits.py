"""What the indexer service's HTTP front end refuses to spend on a client (:mod:`kvtier.indexer.service.http`).

* A body is read and decompressed here, a bounded piece at a time, and refused (413) the moment either its
  bytes on the wire or its decompressed bytes pass the cap: a gzip bomb costs at most the cap in memory and
  its decompression yields to the other connections between pieces.
* JSON nesting deeper than a cap, and more arrays and objects than a cap, are refused (400) before the JSON
  parser sees them: the parser recurses, and spends far more on an empty array than on its two bytes.
* Open connections are capped, one peer's (:func:`~kvtier.indexer.service.clients.peer_key`: its address) and all
  of them: one past its peer's cap gets a JSON 429, one past the total a JSON 503, and either is closed at once,
  before a byte of it is parsed. Only admitted connections count against the total, so that one peer bursting
  past its own cap never takes another's room; while the total is full a new connection is refused before a
  handler is made for it.
* A connection that has not sent a request's headers within a deadline after it opened is closed, and one whose
  body stalled past its deadline (408) is closed with the answer, not kept to read the rest.
* A client that shuts its sending side after its requests (a half-close) still gets their answers.
* Errors aiohttp answers itself (a request it cannot parse) come back as JSON over HTTP/1.1 like every
  other answer, and are counted (``kvtier_http_malformed_requests_total``).
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections import Counter
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http import HttpVersion10, HttpVersion11
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvtier.indexer.service.clients import peer_key

PIECE = 64 << 10  # decompressed bytes produced per step: the most one step holds the event loop for
#: Compressed members a body may hold back to back (each costs a decompressor; a client sends one, or a few).
MAX_MEMBERS = 1024

class BodyTooLarge(Exception):
    """A request body past the cap, on the wire or decompressed."""


class BodiesBusy(Exception):
    """The request bodies being read hold the service's whole budget for them (:class:`BodyBudget`): a 503."""


class BodyBudget:
    """The bytes that the request bodies being read hold together (as received, or as decompressed so far), capped,
    so that many connections each stalling a body just short of its cap do not add up to ``max_connections``
    times ``max_body_bytes``. Used on the HTTP loop's thread only."""

    __slots__ = ("cap", "held", "refused")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.held = 0  # bytes held by bodies being read
        self.refused = 0  # bodies refused for want of room

    def take(self, n: int) -> None:
        """Room for ``n`` more bytes, else :class:`BodiesBusy`. O(1)."""
        if self.held + n > self.cap:
            self.refused += 1
            raise BodiesBusy(f"request bodies being read hold {self.held} bytes; at most {self.cap} "
                             "(max_body_bytes_in_flight): try again")
        self.held += n


class UnsupportedEncoding(Exception):
    """A ``Content-Encoding`` the service does not decode."""


def _decompressor(encoding: str) -> Any:
    """A zlib decompressor for ``encoding``, None for an identity body; :class:`UnsupportedEncoding` else."""
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return None
    if enc in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if enc == "deflate":
        return zlib.decompressobj(32 + zlib.MAX_WBITS)  # zlib-wrapped, as RFC 9110 says (gzip also accepted)
    raise UnsupportedEncoding(f"content-encoding {encoding!r} is not supported; use gzip, deflate or identity")


def check_encoding(encoding: str) -> None:
    """:class:`UnsupportedEncoding` if a body of this ``Content-Encoding`` is not one :func:`read_body` decodes."""
    _decompressor(encoding)


async def read_body(request: web.BaseRequest, cap: int, budget: BodyBudget | None = None) -> bytes:
    """The request's body, decompressed as its ``Content-Encoding`` says; :class:`BodyTooLarge` as soon as more
    than ``cap`` bytes came on the wire or came out of the decompressor, :class:`BodiesBusy` as soon as what it holds
    does not fit in ``budget`` with the other bodies being read, ``ValueError`` for a compressed body that does not
    decompress. Memory O(cap); the loop is given back after every PIECE of output."""
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "")
    d = _decompressor(encoding)
    out = bytearray()
    wire = 0
    taken = 0  # of the budget, given back however this ends
    members = 1  # gzip members begun

    def grow(data: bytes) -> None:
        nonlocal taken
        if budget is not None:
            budget.take(len(data))
            taken += len(data)
        out.extend(data)

    try:
        async for chunk in request.content.iter_any():
            wire += len(chunk)
            if wire > cap:
                raise BodyTooLarge(f"body larger than {cap} bytes")
            if d is None:
                grow(chunk)
                continue
            pending: bytes = chunk
            while True:
                if d.eof:  # a gzip body may be several members back to back
                    if not pending:
                        break
                    members += 1
                    if members > MAX_MEMBERS:
                        raise ValueError(f"request body: more than {MAX_MEMBERS} {encoding.strip()} members")
                    d = _decompressor(encoding)
                try:
                    piece = d.decompress(pending, PIECE)
                except zlib.error:
                    raise ValueError(f"request body: Can not decode content-encoding: {encoding.strip()}") from None
                if len(out) + len(piece) > cap:
                    raise BodyTooLarge(f"body larger than {cap} bytes once decompressed")
                grow(piece)
                pending = d.unused_data if d.eof else d.unconsumed_tail
                if not pending and (d.eof or len(piece) < PIECE):
                    break
                await asyncio.sleep(0)  # other connections run between pieces
        if d is not None and not d.eof:
            raise ValueError(f"request body: Can not decode content-encoding: {encoding.strip()} (truncated)")
        return bytes(out)
    finally:  # (a failed read's frames may outlive it in a reference cycle: its bytes go now, not at a collection)
        out.clear()
        if budget is not None:
            budget.held -= taken


def check_json_shape(body: bytes, max_depth: int, max_containers: int) -> None:
    """``ValueError`` if ``body``'s JSON nests arrays and objects deeper than ``max_depth`` (the parser recurses), or
    holds more than ``max_containers`` of them (the parser's work per array or object, skipped in an unknown field
    too, is far more than per byte of a string or a number). Brackets in strings are text. Linear in numpy, at most
    about 14 bytes of scratch per body byte whatever the body holds; a body with at most that many brackets in all
    (any ordinary request) costs two ``bytes.count`` calls.

    Strings are told by the quotes before each bracket: an odd count opens one, and a quote after an odd run of
    backslashes is escaped. That is exact for valid JSON; where a body is not valid JSON the count may differ from
    the decoder's view only past the first byte the decoder refuses, so no nesting the decoder would reach is
    missed. (A regular expression that skips strings would be quadratic on an unterminated string of escaped
    quotes.) Scratch is kept to bytes per body byte where it can be (quote parity by an ``xor`` prefix, backslash
    runs as bits: :func:`_after_odd_runs`): fresh memory, touched once, is most of the check's time."""
    if body.count(b"[") + body.count(b"{") <= min(max_depth, max_containers):
        return
    a = np.frombuffer(body, np.uint8)
    idx: Any = np.int32 if len(a) < 2**31 else np.int64  # depths
    quote = (a == ord('"')).view(np.uint8)
    backslash = a == ord("\\")
    if quote.any() and backslash.any():
        quote[_after_odd_runs(backslash, quote)] = 0  # escaped quotes are text
    del backslash
    outside = np.bitwise_xor.accumulate(quote) == 0  # an even count of quotes up to here: not in a string
    del quote
    opens = ((a == ord("[")) | (a == ord("{"))) & outside
    containers = int(np.count_nonzero(opens))
    if containers > max_containers:
        raise ValueError(f"bad request body: {containers} JSON arrays and objects; at most {max_containers}")
    if containers <= max_depth:
        return  # (each level of nesting opens one)
    closes = ((a == ord("]")) | (a == ord("}"))) & outside
    if containers + int(np.count_nonzero(closes)) < len(a) // 8:  # few brackets: the depth moves only there
        at = np.flatnonzero(opens | closes)
        steps = np.where(opens[at], 1, -1).astype(idx)
    else:
        steps = opens.view(np.int8) - closes.view(np.int8)
    if int(np.add.accumulate(steps, dtype=idx).max()) > max_depth:
        raise ValueError(f"bad request body: JSON nested deeper than {max_depth} levels")


def _after_odd_runs(backslash: npt.NDArray[np.bool_], quote: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
    """The quotes right after a run of backslashes of odd length (escaped ones), found with the whole body as one
    bit string (a Python int), as SIMD JSON parsers find them a word at a time: adding a run's first bit to the run
    carries past its end, so the bit after each run comes out, and a run's length is odd where that bit's position
    parity differs from its first's. O(body): some ten bit strings of scratch (a byte and a quarter per body byte)."""
    n = len(backslash)
    size = (n + 7) // 8 + 1  # (a carry past the last byte)
    b = int.from_bytes(np.packbits(backslash, bitorder="little").tobytes(), "little")
    q = int.from_bytes(np.packbits(quote.view(np.bool_), bitorder="little").tobytes(), "little")
    even = int.from_bytes(b"\x55" * size, "little")  # bits at even positions
    odd = even << 1
    first = b & ~(b << 1)  # each run's first backslash
    after_even = (b + (first & even)) & ~b  # the bit after each run that starts at an even position
    after_odd = (b + (first & odd)) & ~b
    escaped = q & ((after_even & odd) | (after_odd & even))
    bits = np.frombuffer(escaped.to_bytes(size, "little"), np.uint8)
    out: npt.NDArray[np.bool_] = np.unpackbits(bits, count=n, bitorder="little").view(np.bool_)
    return out


def _json_error(status: int, message: str) -> bytes:
    """A complete HTTP/1.1 answer with a JSON error, closing the connection (for a socket nothing parsed)."""
    from http import HTTPStatus

    import msgspec

    body = msgspec.json.encode({"error": message})
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


class _Refused(asyncio.Protocol):
    """A connection refused before a handler is made for it: its answer, then closed, without reading from it."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sink = cast(asyncio.Transport, transport)  # (uvloop's transports are no asyncio.Transport subclass)
        sink.write(self._answer)
        sink.close()


_QUOTED_BYTES = re.compile(r"""[:\s]*\bb(['"]).*""", re.DOTALL)


def without_request_bytes(text: str) -> str:
    """aiohttp's message about a request it could not parse, without the request bytes it quotes (``b'...'``): a
    header line past the size limit may be an ``Authorization`` one, whose token is never to be echoed or logged."""
    return _QUOTED_BYTES.sub("", text)


class _Handler(RequestHandler):
    """aiohttp's connection handler, plus: the header-read deadline, the open-connection counts, and JSON errors
    over HTTP/1.1 for what aiohttp answers itself."""

    __slots__ = ("_deadline", "_eof", "_gate", "_peer", "_taken")

    def __init__(self, gate: GatedServer, **kwargs: Any) -> None:
        super().__init__(gate, **kwargs)
        self._gate = gate
        self._deadline: asyncio.TimerHandle | None = None
        self._peer: str | None = None  # its peer's key, once admitted under the peer's cap
        self._taken: BaseRequest | None = None  # the request aiohttp's loop took last (GatedServer.take)
        self._eof = False  # the client shut its sending side: close once what it sent is answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peername = transport.get_extra_info("peername")
        peer = peer_key(peername[0] if isinstance(peername, tuple) and peername else None)
        refusal = self._gate.admit(peer)
        if refusal is not None:  # answered, then closed: its task ends as the transport goes
            # (uvloop's transports are no asyncio.Transport subclass)
            cast(asyncio.Transport, transport).write(refusal)
            self.force_close()
            return
        self._peer = peer
        self._deadline = self._loop.call_later(self._gate.header_timeout_s, self._headers_due)

    def _headers_due(self) -> None:
        """Closes the connection if no request's headers arrived yet (an idle or a byte-a-minute socket)."""
        self._deadline = None
        if self._request_count == 0 and self.transport is not None:
            self._gate.header_timeouts += 1
            self.force_close()  # (closes the transport and lets go of it)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._gate.closed(self._peer)
        self._peer = None
        self._taken = None  # (it refers back to this handler)
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]  # (asyncio's protocol: True keeps it open)
        """The client shut its sending side. A client may do that once its requests are out (``nc -N``, some
        proxies) and read the answers on the other side, where aiohttp closes the connection and answers nothing.
        What came in full (the request in hand, pipelined ones queued behind it) is answered, and then the
        connection closes: True keeps the transport open to write them. Without a request, or with a body the
        shutdown cut short (it can never end), it closes now, as aiohttp does; so does a request whose answer is
        out and whose unread body is being lingered over (a body held back by aiohttp's flow control counts as
        cut short too)."""
        pending = [payload for _, payload in self._messages]
        if self._taken is not None and self._waiter is None:  # start() is busy with it (not waiting for the next)
            pending.append(self._taken.content)
        if not pending or not all(p.is_eof() for p in pending):
            return None
        self._eof = True
        if not self._messages:  # else once the last queued one is taken (GatedServer.take)
            self.close()  # (after the request in hand: aiohttp's loop takes no more)
        return True

    def linger(self, seconds: float) -> None:
        """After its answer, the connection reads and drops what is left of the request's body for at most
        ``seconds`` (aiohttp's default: 10 s, holding the connection), then closes; 0: at once. (aiohttp 3.x's
        attribute, read when the answer has gone.)"""
        self._lingering_time = seconds

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's own answers (a request it could not parse, mostly) as JSON over HTTP/1.1, not text/plain
        over the HTTP/1.0 of the placeholder request aiohttp makes for what it could not parse."""
        super().handle_error(request, status, exc, message)  # logs it (one line: kvtier.indexer.service.http's filter)
        if status == 400:
            self._gate.malformed += 1
        if request._message.version == HttpVersion10 and request.method == "UNKNOWN":  # aiohttp's placeholder
            # (internals of aiohttp 3.x: the version the answer's status line is written with, and its cache)
            request._version = HttpVersion11
            request._cache.pop("version", None)
        text = "internal error" if status == 500 else without_request_bytes(message or "")
        resp = web.json_response({"error": (text or f"HTTP {status}").strip().splitlines()[0]}, status=status)
        resp.force_close()
        return resp


def close_after(request: web.Request, resp: web.Response, linger_s: float = 0.0) -> web.Response:
    """``resp``, after which ``request``'s connection closes: at once, or once ``linger_s`` has been spent reading
    and dropping the rest of its body (a client that sends it anyway then reads its answer, not a reset)."""
    if isinstance(request.protocol, _Handler):
        request.protocol.linger(linger_s)
    resp.force_close()
    return resp


class GatedServer(web.Server):
    """aiohttp's server with caps on open connections, per peer and in all, and a header-read deadline (see the
    module's text). What holds: :attr:`open` counts the connections admitted and not yet closed, and :attr:`peers`
    each peer's share of them (no entry for a peer with none); both change on the event loop's thread only."""

    def __init__(self, *args: Any, max_connections: int, header_timeout_s: float, max_per_peer: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer if max_per_peer is not None else max_connections
        self.header_timeout_s = header_timeout_s
        self.open = 0  # connections admitted and not yet closed
        self.peers: Counter[str] = Counter()  # peer key -> its connections admitted and not yet closed
        self.refused = 0  # connections turned away at the cap
        self.refused_per_peer = 0  # connections turned away at a peer's cap
        self.header_timeouts = 0  # connections closed for sending no headers in time
        self.malformed = 0  # requests aiohttp could not parse (400)
        self._factory = self.request_factory
        self.request_factory = self.take

    def take(self, message: Any, payload: StreamReader, protocol: RequestHandler, writer: AbstractStreamWriter,
             task: asyncio.Task[None]) -> BaseRequest:
        """The request aiohttp's loop makes for a message it takes off its queue, remembered by its connection's
        handler, which looks at its body when the client shuts its sending side (:meth:`_Handler.eof_received`)."""
        request = self._factory(message, payload, protocol, writer, task)
        if isinstance(protocol, _Handler):
            protocol._taken = request
            if protocol._eof and not protocol._messages:  # the last the client sent: closed after its answer
                protocol.close()
        return request

    def __call__(self) -> Any:  # an asyncio protocol factory
        if self.open >= self.max_connections:  # full whoever the peer is: refused without building a handler
            self.refused += 1
            return _Refused(self._full())
        return _Handler(self, loop=self._loop, **self._kwargs)

    def _full(self) -> bytes:
        return _json_error(503, f"too many open connections (at most {self.max_connections})")

    def admit(self, peer: str) -> bytes | None:
        """A new connection from ``peer``: None if admitted (and counted), else the answer refusing it (429 past the
        peer's cap, else 503 past the total). O(1)."""
        if self.peers[peer] >= self.max_per_peer:
            self.refused_per_peer += 1
            return _json_error(429, f"too many open connections from this peer (at most {self.max_per_peer})")
        if self.open >= self.max_connections:  # (filled since the factory made its handler: one accept batch)
            self.refused += 1
            return self._full()
        self.open += 1
        self.peers[peer] += 1
        return None

    def closed(self, peer: str | None) -> None:
        """A handler's connection ended; ``peer``: its peer's key where :meth:`admit` admitted it, else None."""
        if peer is not None:
            self.open -= 1
            self.peers[peer] -= 1
            if not self.peers[peer]:
                del self.peers[peer]
