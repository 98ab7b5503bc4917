"""The indexer service's HTTP front end: asyncio (aiohttp) on a thread of its own.

One event loop serves every connection, so hundreds of keep-alive clients cost no threads and a slow
client holds nothing but its own socket. Limits (:mod:`kvtier.indexer.service.httplimits`): a body-size cap, on
the wire and decompressed (413), a deadline to read a body (408), a header-read deadline, a cap on open
connections (503), an idle keep-alive timeout, a listen backlog sized for bursts. State-changing requests
identify their client (:mod:`kvtier.indexer.service.clients`: a token, or the peer). Every answer, errors included,
is JSON (``/metrics`` excepted: Prometheus text). Handlers call the service, whose methods take the
index lock only for the index work itself (keys are hashed before it), so a query never holds up
event application for longer than its lookups.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import msgspec
from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kvtier.indexer.routing.plugins import PluginError
from kvtier.indexer.service.clients import Clients, Forbidden, ServiceUnavailable, TooManyInFlight, Unauthorized
from kvtier.indexer.service.histogram import Histogram
from kvtier.indexer.service.httplimits import (
    BodiesBusy,
    BodyBudget,
    BodyTooLarge,
    GatedServer,
    UnsupportedEncoding,
    check_encoding,
    close_after,
    read_body,
    without_request_bytes,
)
from kvtier.util.ratelog import suffix, worth_logging


class Backend(Protocol):
    """What the front end serves (:class:`kvtier.indexer.service.app.IndexerService`): named here so that this
    module never imports the service that starts it."""

    clients: Clients

    def query(self, body: bytes | Any) -> dict[str, Any]: ...
    def route(self, body: bytes | Any, owner: str = ...) -> dict[str, Any]: ...
    def first_token(self, rid: str, owner: str = ...) -> dict[str, Any]: ...
    def finish(self, rid: str, body: bytes | Any = ..., owner: str = ...) -> dict[str, Any]: ...
    def metrics(self) -> dict[str, Any]: ...
    def metrics_text(self) -> str: ...
    def health(self) -> dict[str, Any]: ...

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: After an answer refusing an ``Expect: 100-continue`` request, the most time spent reading a body sent anyway.
EXPECT_LINGER_S = 0.5
LAG_PROBE_S = 0.01  # the loop-lag probe's sleep: 100 wake-ups a second, a stall of a few ms shows


class _OneLineForBadHttp(logging.Filter):
    """aiohttp logs a full traceback for every request it cannot even parse (its own plain-text 400
    answers the client); bad input deserves one line, and at most a few of them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        # (a body that failed to decode is raised again when aiohttp drains what the handler left unread)
        if not isinstance(exc, HttpProcessingError | RequestPayloadError):
            return True
        self.count += 1
        record.msg, record.args, record.exc_info, record.exc_text = (
            "malformed HTTP request: %s%s", (_first_line(exc), suffix(self.count, MALFORMED_METRIC)), None, None)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return worth_logging(self.count)


def _first_line(exc: BaseException) -> str:
    """What aiohttp says went wrong with a request, in one line: the message of the parser's error, also where a
    body's read wraps it (``RequestPayloadError`` from ``ContentEncodingError``)."""
    cause = exc.__cause__ if isinstance(exc, RequestPayloadError) and exc.__cause__ is not None else exc
    text = without_request_bytes(str(cause.message) if isinstance(cause, HttpProcessingError) else str(cause))
    return (text.strip().splitlines() or [type(cause).__name__])[0].strip()


MALFORMED_METRIC = "kvtier_http_malformed_requests_total"  # where the log line says they are all counted
_BAD_HTTP = _OneLineForBadHttp()
logging.getLogger("aiohttp.server").addFilter(_BAD_HTTP)


_encode = msgspec.json.Encoder().encode  # an order faster than json.dumps on a /query answer


def _json(status: int, body: Any) -> web.Response:
    return web.Response(status=status, body=_encode(body), content_type="application/json")


def _closing(resp: web.Response) -> web.Response:
    resp.force_close()
    return resp


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """The front end's event loop: ``uvloop`` (libuv; 10-25 % more closed-loop queries per second than
    asyncio's own selector loop in ``bench/service_bench.py``), ``asyncio``, or ``auto`` (uvloop where it is
    installed, else asyncio). ``ImportError`` if ``uvloop`` is asked for and missing."""
    if kind not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"event loop {kind!r}: expected auto, uvloop or asyncio")
    if kind != "asyncio":
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return cast(asyncio.AbstractEventLoop, uvloop.new_event_loop())
    return asyncio.new_event_loop()


class HttpFrontEnd:
    """Serves ``service`` on ``host:port`` (port 0 picks one) until :meth:`stop`."""

    def __init__(self, service: Backend, host: str, port: int, *, max_body_bytes: int,
                 read_timeout_s: float, keepalive_s: float, backlog: int = 1024, loop: str = "auto",
                 max_connections: int = 1024, max_connections_per_peer: int | None = None,
                 header_timeout_s: float = 10.0, max_body_bytes_in_flight: int = 256 << 20) -> None:
        self._svc = service
        self._host, self._port = host, port
        self._max_body = max_body_bytes
        self.bodies = BodyBudget(max_body_bytes_in_flight)  # what the bodies being read hold together
        self._read_timeout = read_timeout_s
        self._keepalive = keepalive_s
        self._backlog = backlog
        self._max_connections = max_connections
        self._max_per_peer = max_connections_per_peer
        self._header_timeout = header_timeout_s
        self._server: GatedServer | None = None  # the connection handlers' manager, once serving
        self._listener: asyncio.AbstractServer | None = None  # the listening socket
        self.payload_errors = 0  # bodies that could not be read (a broken chunked encoding, say)
        self._loop = new_event_loop(loop)
        self.loop_kind = type(self._loop).__module__.partition(".")[0]  # "uvloop" or "asyncio", as run
        self._runner: web.AppRunner | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-http", daemon=True)
        self.port = port
        self.loop_lag = Histogram()  # how late the loop woke from each LAG_PROBE_S sleep (its only writer)
        self.disconnects = 0  # requests whose client went away before its body arrived
        self.plugin_errors = 0  # requests a plugin policy failed (it broke its protocol)
        self._lag_probe: asyncio.Future[None] | None = None  # the loop-lag probe's task, once serving

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Binds and starts serving; raises what binding raised (a port in use, a bad host)."""
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start())
        except BaseException as exc:  # reported to start()'s caller
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._cleanup())
        # Handlers of connections still open (a client mid-request) end here, not at interpreter exit.
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()

    async def _start(self) -> None:
        app = web.Application(client_max_size=self._max_body, middlewares=[self._errors])
        app.router.add_post("/query", self._query, expect_handler=self._expect)
        app.router.add_post("/route", self._route, expect_handler=self._expect)
        app.router.add_post("/requests/{rid}/first_token", self._first_token, expect_handler=self._expect)
        app.router.add_post("/requests/{rid}/finish", self._finish, expect_handler=self._expect)
        app.router.add_get("/metrics", self._metrics, expect_handler=self._expect)
        app.router.add_get("/health", self._health, expect_handler=self._expect)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=self._keepalive)
        await self._runner.setup()  # the application's startup (frozen routes, middlewares)
        # Our own server on the app's handler (not a TCPSite): it caps connections and headers' arrival, and
        # bodies are decompressed by read_body, where their size is capped as they inflate.
        app_server = self._runner.server
        assert app_server is not None
        self._server = GatedServer(app_server.request_handler, request_factory=app_server.request_factory,
                                   loop=asyncio.get_running_loop(), max_connections=self._max_connections,
                                   max_per_peer=self._max_per_peer,
                                   header_timeout_s=self._header_timeout, keepalive_timeout=self._keepalive,
                                   access_log=None, auto_decompress=False)
        self._listener = await asyncio.get_running_loop().create_server(
            self._server, self._host, self._port, backlog=self._backlog, reuse_address=True)
        sockets = getattr(self._listener, "sockets", None)  # asyncio.Server, or uvloop's (not a subclass)
        assert sockets, "HTTP site did not bind"
        self.port = int(sockets[0].getsockname()[1])
        self._lag_probe = asyncio.ensure_future(self._probe_lag())  # cancelled with every task at stop

    async def _probe_lag(self) -> None:
        """Sleeps LAG_PROBE_S at a time and counts how late each wake-up came: time the loop could not run
        (a handler that blocked it, the GIL held by the event thread, the process descheduled)."""
        clock = asyncio.get_running_loop().time
        while True:
            t0 = clock()
            await asyncio.sleep(LAG_PROBE_S)
            self.loop_lag.observe(max(0.0, clock() - t0 - LAG_PROBE_S))

    async def _cleanup(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            self._server.pre_shutdown()
            await self._server.shutdown(2.0)
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        """Closes every connection and the listening socket. Idempotent."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)

    # --- plumbing ------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Turns every failure into a JSON error with the right status."""
        try:
            return await handler(request)
        except Exception as exc:
            return self._failure(request, exc)

    def _failure(self, request: web.Request, exc: Exception) -> web.Response:
        """The JSON answer to a request that raised ``exc``."""
        if isinstance(exc, web.HTTPRequestEntityTooLarge):
            return _closing(_json(413, {"error": f"body larger than {self._max_body} bytes"}))
        if isinstance(exc, BodyTooLarge):  # mid-body: the connection closes once aiohttp's lingering close has read
            # and dropped the rest (up to 10 s), so that a client still sending reads its answer, not a reset
            return _closing(_json(413, {"error": str(exc)}))
        if isinstance(exc, BodiesBusy):  # mid-body too: closed as a body too large is
            return _closing(_json(503, {"error": str(exc)}))
        if isinstance(exc, UnsupportedEncoding):
            return _closing(_json(415, {"error": str(exc)}))
        if isinstance(exc, Unauthorized):
            resp = _json(401, {"error": str(exc)})
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        if isinstance(exc, Forbidden):
            return _json(403, {"error": str(exc)})
        if isinstance(exc, TooManyInFlight):
            return _json(exc.status, {"error": str(exc)})
        if isinstance(exc, web.HTTPRequestTimeout):  # a stalled body: its connection is not worth holding any longer
            return close_after(request, _json(exc.status, {"error": exc.reason}))
        if isinstance(exc, web.HTTPException):
            return _json(exc.status, {"error": exc.reason})
        if isinstance(exc, ServiceUnavailable):
            return _json(503, {"error": str(exc)})
        if isinstance(exc, ConnectionError):
            # The client went away mid-request (routers cancel, load balancers reset): nobody to answer, and
            # nothing wrong with the service, so one line now and then rather than a traceback each.
            self.disconnects += 1
            if worth_logging(self.disconnects):
                log.info("http: %s %s: client went away (%s)%s", request.method, request.path, exc,
                         suffix(self.disconnects))
            return _json(400, {"error": "connection lost"})  # aiohttp drops it: the socket is closed
        if isinstance(exc, PluginError):  # the configured policy's fault, not the request's
            self.plugin_errors += 1
            if worth_logging(self.plugin_errors):
                log.error("http: %s %s: %s%s", request.method, request.path, exc,
                          suffix(self.plugin_errors, "kvtier_plugin_errors_total"))
            return _json(500, {"error": str(exc)})
        if isinstance(exc, ValueError | LookupError):
            return _json(400, {"error": str(exc)})
        log.error("http: %s %s failed", request.method, request.path, exc_info=exc)
        return _json(500, {"error": f"internal error: {type(exc).__name__}"})

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """A request that asks ``Expect: 100-continue`` before it sends its body: what would refuse it unread (a
        declared length past the cap, an encoding not decoded, a state change without a valid token) is answered
        now and the connection closed (a body sent anyway is read and dropped for at most EXPECT_LINGER_S first, so
        that its client reads the answer, not a reset, and it is never read as a next request), so that a client is
        never told to send a body that is then refused; else ``100 Continue``. An HTTP/1.0 request's expectation is
        ignored, as RFC 9110 says."""
        if request.version != HttpVersion11:
            return None
        try:
            expect = request.headers[hdrs.EXPECT]
            if expect.lower() != "100-continue":
                raise web.HTTPExpectationFailed(reason=f"Expect: {expect} is not supported; only 100-continue")
            if request.content_length is not None and request.content_length > self._max_body:
                raise web.HTTPRequestEntityTooLarge(max_size=self._max_body, actual_size=request.content_length)
            check_encoding(request.headers.get(hdrs.CONTENT_ENCODING, ""))
            if request.path == "/route" or request.path.startswith("/requests/"):  # they change state
                self._client(request)
        except Exception as exc:
            return close_after(request, self._failure(request, exc), EXPECT_LINGER_S)
        try:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        except ConnectionError as exc:  # the client left before it was told to go on
            return self._failure(request, exc)
        request.writer.output_size = 0  # (aiohttp's count of the answer's bytes: the answer is still to come)
        return None

    async def _body(self, request: web.Request) -> bytes:
        """The raw body (the service decodes and validates it in one pass). A declared length over the cap is
        refused before a byte of the body is read."""
        if request.content_length is not None and request.content_length > self._max_body:
            raise web.HTTPRequestEntityTooLarge(max_size=self._max_body, actual_size=request.content_length)
        try:
            return await asyncio.wait_for(read_body(request, self._max_body, self.bodies), self._read_timeout)
        except TimeoutError:
            raise web.HTTPRequestTimeout(reason=f"body not received within {self._read_timeout:g} s") from None
        except RequestPayloadError as exc:  # (a broken chunked encoding, say)
            self.payload_errors += 1
            raise web.HTTPBadRequest(reason=f"request body: {_first_line(exc)}") from None

    def _client(self, request: web.Request) -> str:
        """Who is changing state (:meth:`Clients.identify <kvtier.indexer.service.clients.Clients.identify>`)."""
        return self._svc.clients.identify(request.headers.get("Authorization"), request.remote)

    def counters(self) -> dict[str, int]:
        """The front end's counters for ``/metrics`` (read without a lock: each is one int, one writer)."""
        srv = self._server
        return {"http_disconnects": self.disconnects,
                "http_malformed_requests": self.payload_errors + (srv.malformed if srv else 0),
                "http_connections_open": srv.open if srv else 0,
                "http_connections_refused": srv.refused if srv else 0,
                "http_connections_refused_per_peer": srv.refused_per_peer if srv else 0,
                "http_header_timeouts": srv.header_timeouts if srv else 0,
                "http_bodies_refused": self.bodies.refused,
                "plugin_errors": self.plugin_errors}

    # --- endpoints -----------------------------------------------------------------------

    async def _query(self, request: web.Request) -> web.Response:
        return _json(200, self._svc.query(await self._body(request)))

    async def _route(self, request: web.Request) -> web.Response:
        owner = self._client(request)  # before the body is read: no token, nothing read
        return _json(200, self._svc.route(await self._body(request), owner))

    async def _first_token(self, request: web.Request) -> web.Response:
        owner = self._client(request)
        return _json(200, self._svc.first_token(request.match_info["rid"], owner))

    async def _finish(self, request: web.Request) -> web.Response:
        owner = self._client(request)
        return _json(200, self._svc.finish(request.match_info["rid"], await self._body(request), owner))

    async def _metrics(self, request: web.Request) -> web.Response:
        if request.query.get("format") == "json":
            return _json(200, self._svc.metrics())
        return web.Response(body=self._svc.metrics_text().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _health(self, request: web.Request) -> web.Response:
        h = self._svc.health()
        return _json(503 if h["status"] == "down" else 200, h)
