"""The indexer service's HTTP front end and routing endpoints: limits, keep-alive, JSON errors,
in-flight bookkeeping with a TTL, and a dead event loop that stops looking healthy."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvtier.indexer.service.app import ConfigError, IndexerService, ServiceConfig, parse_endpoint
from kvtier.sim.cli import main as cli_main
from kvtier.wire import BlockRemoved, BlockStored, EventBatch, Publisher, StorageTier, WorkerId
from kvtier.wire.notices import StreamId
from tests.test_bad_input import NOTICES
from tests.test_service import BS, TOKS, Clock, get, post, stored, wait_for


# Every front-end test runs on both event loops: uvloop where it is installed, and asyncio's own, which
# is what the service falls back to without it.
@pytest.fixture
def request_clock() -> Clock:
    """The routed requests' clock of :func:`svc`'s service (time to live: 0.6 s)."""
    return Clock()


@pytest.fixture(params=["uvloop", "asyncio"])
def svc(request: pytest.FixtureRequest,
        request_clock: Clock) -> Iterator[tuple[Publisher, Publisher, IndexerService]]:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
    pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    eps = [parse_endpoint(f"w{i}={p.endpoint},replay={p.replay_endpoint}") for i, p in enumerate(pubs)]
    s = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", max_body_bytes=64_000,
                                     read_timeout_s=0.5, request_ttl_s=0.6, max_query_tokens=4096,
                                     http_loop=request.param), request_clock=request_clock)
    s.start()
    assert s.health()["http_loop"] == request.param
    yield pubs[0], pubs[1], s
    s.stop()
    for p in pubs:
        p.close()


def conn(s: IndexerService) -> http.client.HTTPConnection:
    host, port = s.address.removeprefix("http://").split(":")
    return http.client.HTTPConnection(host, int(port), timeout=5)


def call(c: http.client.HTTPConnection, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, json.loads(r.read())


def test_route_books_load_until_finish_and_expires_unfinished(svc: tuple[Publisher, Publisher, IndexerService],
                                                              request_clock: Clock) -> None:
    p0, _, s = svc
    p0.publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3, 4], None, 0)]))
    wait_for(lambda: post(s.address + "/query", {"token_ids": TOKS})[1]["workers"]["w0"]["device"] == 4)
    code, body = post(s.address + "/route", {"request_id": "r1", "token_ids": TOKS})
    assert code == 200 and body["worker"] == "w0" and body["request_id"] == "r1"
    m = json.loads(get(s.address + "/metrics?format=json"))
    w0 = m["workers"]["w0"]
    assert (m["requests_in_flight"], w0["requests_running"], w0["requests_prefilling"]) == (1, 1, 1)
    assert w0["pending_prefill_tokens"] == len(TOKS) - 4 * BS and w0["active_blocks"] == len(TOKS) // BS
    assert 'kvtier_requests_running{worker="w0"} 1' in get(s.address + "/metrics")
    assert post(s.address + "/route", {"request_id": "r1", "token_ids": TOKS})[0] == 400  # already in flight
    assert post(s.address + "/requests/r1/first_token", {})[0] == 200
    assert json.loads(get(s.address + "/metrics?format=json"))["workers"]["w0"]["requests_prefilling"] == 0
    assert post(s.address + "/requests/r1/finish", {}) == (200, {"request_id": "r1", "was_in_flight": True})
    assert post(s.address + "/requests/r1/finish", {})[1]["was_in_flight"] is False  # idempotent
    # A finish that says how long the output was teaches the router the output room engines reserve.
    assert post(s.address + "/route", {"request_id": "r2", "token_ids": TOKS})[0] == 200
    assert post(s.address + "/requests/r2/finish", {"output_tokens": -1})[0] == 400
    assert post(s.address + "/requests/r2/finish", {"output_tokens": 300})[0] == 200
    assert s.loads.expected_output == 300
    # Not in flight (never routed here, or booked before a restart, which forgets bookings): no client error.
    assert post(s.address + "/requests/nope/first_token", {}) == (200, {"request_id": "nope", "in_flight": False})
    # A request nobody finishes leaves the load after its TTL (0.6 s here), and not before.
    assert post(s.address + "/route", {"request_id": "lost", "token_ids": TOKS})[0] == 200
    request_clock.t += 0.5
    assert post(s.address + "/route", {"request_id": "kept", "token_ids": TOKS})[0] == 200
    request_clock.t += 0.2
    wait_for(lambda: json.loads(get(s.address + "/metrics?format=json"))["requests_expired"] == 1, timeout=5)
    m = json.loads(get(s.address + "/metrics?format=json"))
    assert m["requests_in_flight"] == 1 and sum(w["requests_running"] for w in m["workers"].values()) == 1
    assert post(s.address + "/requests/kept/finish", {})[1]["was_in_flight"] is True
    assert post(s.address + "/requests/lost/finish", {})[1]["was_in_flight"] is False


def test_keep_alive_and_json_errors_on_one_connection(svc: tuple[Publisher, Publisher, IndexerService]) -> None:
    _, _, s = svc
    c = conn(s)
    for _ in range(20):  # one TCP connection, many requests
        assert call(c, "POST", "/query", {"token_ids": TOKS})[0] == 200
    assert call(c, "GET", "/nope") == (404, {"error": "Not Found"})
    assert call(c, "PUT", "/query")[0] == 405
    code, body = call(c, "POST", "/query", {"token_ids": list(range(5000))})
    assert code == 400 and "at most 4096" in body["error"]
    c.request("POST", "/query", body=b"{not json", headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 400 and "not JSON" in json.loads(r.read())["error"]
    deep = b"[" * 100_000 + b"]" * 100_000
    c.request("POST", "/query", body=deep[:60_000], headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 400 and json.loads(r.read())["error"]
    c.request("POST", "/query", body=b"x" * 100_000, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 413 and "larger than" in json.loads(r.read())["error"]


def test_slow_clients_hold_nothing_and_time_out(svc: tuple[Publisher, Publisher, IndexerService]) -> None:
    _, _, s = svc
    host, port = s.address.removeprefix("http://").split(":")
    slow = []
    for _ in range(50):  # each promises a body and never sends it
        k = socket.create_connection((host, int(port)))
        k.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        slow.append(k)
    t0 = time.monotonic()
    assert post(s.address + "/query", {"token_ids": TOKS})[0] == 200  # served meanwhile
    # A server that waited on each slow body in turn would answer after 50 read timeouts (25 s); a bound far
    # below that, and far above any pause of a loaded machine, tells the two apart.
    assert time.monotonic() - t0 < 10.0
    k = slow[0]
    k.settimeout(5)
    answer = k.recv(4096)
    assert b" 408 " in answer.split(b"\r\n")[0] and b"not received within" in answer
    # The rest of that body may still come, so the connection is closed with the answer, not kept for reuse.
    assert b"connection: close" in answer.lower()
    while chunk := k.recv(4096):  # (a socket left open would time out here)
        answer += chunk
    for k in slow:
        k.close()


def test_oversized_declared_body_is_refused_at_once(svc: tuple[Publisher, Publisher, IndexerService]) -> None:
    """A body declared larger than the cap gets its 413 before anything is read (not a 408 after the read
    deadline, with the service waiting on 100 MB that will never fit)."""
    _, _, s = svc
    host, port = s.address.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as k:
        k.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n{\"token_ids\": [")
        answer = k.recv(4096)
    assert b" 413 " in answer.split(b"\r\n")[0] and b"larger than 64000 bytes" in answer


def test_clients_gone_mid_body_cost_a_line_not_a_traceback(svc: tuple[Publisher, Publisher, IndexerService],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Clients that hang up before sending their body are counted, logged as one line for the first few,
    and leave the service serving: none logs a traceback or anything at ERROR."""
    _, _, s = svc
    host, port = s.address.removeprefix("http://").split(":")
    caplog.set_level(logging.INFO, logger="kvtier.indexer.service.http")
    for _ in range(20):
        k = socket.create_connection((host, int(port)))
        k.sendall(b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.01)  # the handler is waiting for the body
        k.close()
    wait_for(lambda: json.loads(get(s.address + "/metrics?format=json"))["http_disconnects"] == 20)
    records = [r for r in caplog.records if r.name == "kvtier.indexer.service.http"]
    assert records and all(r.levelno == logging.INFO and r.exc_info is None for r in records)
    assert len(records) < 20 and "client went away" in records[0].getMessage()
    assert "kvtier_http_disconnects_total 20" in get(s.address + "/metrics")
    assert post(s.address + "/query", {"token_ids": TOKS})[0] == 200


def _half_closed(s: IndexerService, data: bytes) -> bytes:
    """Sends ``data``, shuts the socket's sending side (as ``nc -N`` or a proxy does after a request), and reads
    until the service closes the connection."""
    host, port = s.address.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as k:
        k.sendall(data)
        k.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := k.recv(65536):  # (a connection left open would time out here)
            answer += chunk
    return answer


def test_a_client_that_half_closes_after_its_requests_gets_every_answer(
        svc: tuple[Publisher, Publisher, IndexerService]) -> None:
    """A client may shut its sending side once its request is out and read the answer on the other: what it sent
    in full is answered, then the connection closes. A body cut short by the shutdown can never end: that
    connection closes at once, unanswered, and counts as a client gone."""
    _, _, s = svc
    answer = _half_closed(s, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"status"' in answer
    body = json.dumps({"token_ids": TOKS}).encode()
    query = (b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    answer = _half_closed(s, query + query)  # two pipelined requests
    assert answer.count(b"HTTP/1.1 200 ") == 2 and answer.count(b'"recommended"') == 2
    gone = json.loads(get(s.address + "/metrics?format=json"))["http_disconnects"]
    assert _half_closed(s, query[:-5]) == b""
    wait_for(lambda: json.loads(get(s.address + "/metrics?format=json"))["http_disconnects"] == gone + 1)
    assert post(s.address + "/query", {"token_ids": TOKS})[0] == 200


def refuse_subscriptions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every subscription fails at once (ZMQ refusing its sockets): the event loop dies as it starts. (An address
    ZMQ would refuse is refused earlier, by the configuration.)"""
    from kvtier.indexer.service import eventloop

    def refuse(*args: object, **kwargs: object) -> None:
        raise zmq.ZMQError(zmq.EPROTONOSUPPORT)

    monkeypatch.setattr(eventloop, "Subscriber", refuse)


def test_dead_event_loop_is_not_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_subscriptions(monkeypatch)
    s = IndexerService(ServiceConfig(endpoints=[parse_endpoint("a=tcp://127.0.0.1:1")], listen="127.0.0.1:0"))
    s.start()
    try:
        wait_for(s.failed.is_set)
        with pytest.raises(Exception, match="503"):
            get(s.address + "/health")
        code, body = post(s.address + "/query", {"token_ids": [1, 2, 3]})
        assert code == 503 and "event loop died" in body["error"]
    finally:
        s.stop()
    with pytest.raises(ConfigError, match="same worker stream twice"):
        IndexerService(ServiceConfig(endpoints=[parse_endpoint("a=tcp://127.0.0.1:1"),
                                                parse_endpoint("a=tcp://127.0.0.1:2")]))


def test_a_failed_event_loop_restarts_when_configured_then_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``loop_restarts``, a loop that cannot start is tried again (after the back-off, then twice it),
    the service answering meanwhile as degraded; once the restarts are spent it is down, as without them."""
    from kvtier.indexer.service import eventloop

    monkeypatch.setattr(eventloop, "_RESTART_BACKOFF_S", 1.0)  # a window wide enough for a loaded machine
    refuse_subscriptions(monkeypatch)
    s = IndexerService(ServiceConfig(endpoints=[parse_endpoint("a=tcp://127.0.0.1:1")], listen="127.0.0.1:0",
                                     loop_restarts=2))
    t0 = time.monotonic()
    s.start()
    try:
        h = json.loads(get(s.address + "/health"))
        assert h["status"] == "degraded" and h["recovering_workers"] == ["a"] and not s.failed.is_set()
        wait_for(s.failed.is_set, timeout=10)
        assert time.monotonic() - t0 >= 3.0 and s.loop_restarts == 2
        m = json.loads(get(s.address + "/metrics?format=json"))
        assert m["loop_restarts"] == 2 and "kvtier_loop_restarts_total 2" in get(s.address + "/metrics")
        with pytest.raises(Exception, match="503"):
            get(s.address + "/health")
    finally:
        s.stop()


@contextlib.contextmanager
def restartable_pair() -> Iterator[tuple[list[Publisher], IndexerService, Callable[[str], int]]]:
    """Two workers' publishers and a started service allowed one event-loop restart, w0 holding blocks 1-3 and w1
    blocks 11-12; with a function of a worker's device overlap of TOKS."""
    pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    eps = [parse_endpoint(f"w{i}={p.endpoint},replay={p.replay_endpoint}") for i, p in enumerate(pubs)]
    s = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", replay_timeout_s=1.0,
                                     loop_restarts=1))
    s.start()
    try:
        def device(w: str) -> int:
            return int(post(s.address + "/query", {"token_ids": TOKS})[1]["workers"][w]["device"])

        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([1, 2, 3], None, 0)]))
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([11, 12], None, 0)]))
        wait_for(lambda: device("w0") == 3 and device("w1") == 2)
        yield pubs, s, device
    finally:
        s.stop()
        for p in pubs:
            p.close()


def _fail_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop's next application of a delivery fails (an injected bug), and none after it."""
    from kvtier.indexer.index.consumer import IndexConsumer

    real, failures = IndexConsumer.feed, []

    def feed_failing_once(self: IndexConsumer, deliveries: Any) -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("injected")
        real(self, deliveries)

    monkeypatch.setattr(IndexConsumer, "feed", feed_failing_once)


def test_a_restarted_event_loop_resumes_streams_and_rebuilds_the_torn_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop fails while applying w0's batch: w0's position already counts that batch, which the index
    holds in part or not at all, so w0 is rebuilt from its publisher's replay (resumed, block 5 would be
    an orphan under the missing block 4); w1 resumes after its last batch with its blocks kept."""
    with restartable_pair() as (pubs, s, device):
        _fail_once(monkeypatch)  # the loop dies before the batch is applied, though its stream's position counts it
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([4], 3, 3)]))
        wait_for(lambda: s.loop_restarts == 1)
        assert not s.failed.is_set()
        w1 = s.index.block_counts(StreamId(WorkerId("w1")))
        assert w1[StorageTier.DEVICE] == 2  # resumed, not cleared
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([5], 4, 4)]))
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([13], 12, 2)]))
        wait_for(lambda: device("w0") == 5 and device("w1") == 3)
        wait_for(lambda: json.loads(get(s.address + "/health"))["status"] == "ok")
        assert s.loop_restarts == 1 and not s.failed.is_set()


def test_a_restarted_event_loop_goes_on_counting_from_where_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each life of the loop has a subscriber of its own, whose counters start at 0: after a restart every stream's
    counters (batches delivered, gaps, resyncs...) went down, which Prometheus reads as a counter reset."""
    from dataclasses import astuple


    with restartable_pair() as (pubs, s, device):
        before = {w: astuple(st) for w, st in s._loop.stream_stats().items()}
        assert {w.worker: st[1] for w, st in before.items()} == {"w0": 1, "w1": 1}  # (delivered)
        _fail_once(monkeypatch)
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([13], 12, 2)]))
        wait_for(lambda: s.loop_restarts == 1)
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([14], 13, 3)]))
        wait_for(lambda: device("w1") == 4)
        after = s._loop.stream_stats()
        for w, st in before.items():
            assert all(a >= b for a, b in zip(astuple(after[w]), st, strict=True)), (w, st, after[w])
        assert after[StreamId(WorkerId("w1"))].delivered >= 3  # 1 before, the failed one, the one after


def test_a_restarted_event_loop_rebuilds_every_stream_with_a_batch_of_the_failed_poll_unapplied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One poll hands over a batch of w0 and then one of w1, and applying w0's fails: w1's position counts its
    batch too, which the index never got. Resumed, w1 would lose block 13 for good (not partial, /health ok) and
    hold block 14 as an orphan; it is rebuilt from its publisher's replay instead."""
    from kvtier.indexer.index.consumer import IndexConsumer
    from kvtier.wire.notices import Received
    from kvtier.wire.transport.subscriber import Subscriber

    with restartable_pair() as (pubs, s, device):
        w0, w1 = StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))
        real_poll, real_feed = Subscriber.poll, IndexConsumer.feed
        armed, polling = [True], threading.Event()

        def poll_both(self: Subscriber, timeout_ms: int = 100, max_messages: int = 10_000) -> list[Any]:
            """Until both new batches are in, one poll: w0's first (the order a real poll may hand them in)."""
            if not armed[0]:
                return real_poll(self, timeout_ms, max_messages)
            polling.set()
            got: list[Any] = []
            deadline = time.monotonic() + 10.0
            while {d.stream for d in got if isinstance(d, Received)} != {w0, w1} and time.monotonic() < deadline:
                got += real_poll(self, timeout_ms, max_messages)
            armed[0] = False
            return sorted(got, key=lambda d: d.stream != w0)  # (stable: each stream's order kept)

        def feed_failing_on_w0(self: IndexConsumer, deliveries: Any) -> None:
            if not armed[0] and deliveries[0].stream == w0 and not s.loop_restarts:
                raise RuntimeError("injected")
            real_feed(self, deliveries)

        monkeypatch.setattr(Subscriber, "poll", poll_both)
        monkeypatch.setattr(IndexConsumer, "feed", feed_failing_on_w0)
        assert polling.wait(10.0)  # (a poll begun before the patch could take w0's batch alone)
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([4], 3, 3)]))
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([13], 12, 2)]))
        wait_for(lambda: s.loop_restarts == 1)
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([14], 13, 3)]))
        wait_for(lambda: device("w0") == 4 and device("w1") == 4)
        wait_for(lambda: json.loads(get(s.address + "/health"))["status"] == "ok")
        assert s.index.orphan_blocks(w1) == 0 and not s.index.is_partial(w1) and not s.failed.is_set()


def test_a_service_stopped_while_its_loop_waits_to_restart_still_saves_its_snapshot(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The snapshot written on stop then holds the index and where each stream resumes: the stream whose
    batch was torn is left out, to be rebuilt on the next start."""
    from kvtier.indexer.index.consumer import IndexConsumer
    from kvtier.indexer.service import eventloop, persist

    monkeypatch.setattr(eventloop, "_RESTART_BACKOFF_S", 30.0)  # still waiting when stop comes
    pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    eps = [parse_endpoint(f"w{i}={p.endpoint},replay={p.replay_endpoint}") for i, p in enumerate(pubs)]
    snap = tmp_path / "index.snap"
    s = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", replay_timeout_s=1.0,
                                     loop_restarts=1, snapshot_path=str(snap)))
    s.start()
    try:
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([1, 2], None, 0)]))
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([11, 12], None, 0)]))
        wait_for(lambda: post(s.address + "/query", {"token_ids": TOKS})[1]["workers"]["w1"]["device"] == 2
                 and post(s.address + "/query", {"token_ids": TOKS})[1]["workers"]["w0"]["device"] == 2)

        def fail(self: IndexConsumer, deliveries: Any) -> None:
            raise RuntimeError("injected")

        monkeypatch.setattr(IndexConsumer, "feed", fail)
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([3], 2, 2)]))
        wait_for(lambda: s.loop_restarts == 1)
    finally:
        s.stop()
        for p in pubs:
            p.close()
    index, positions = persist.load(snap, BS)
    assert set(positions) == {StreamId(WorkerId("w1"))} and positions[StreamId(WorkerId("w1"))][0] == 1
    assert index.block_counts(StreamId(WorkerId("w1")))[StorageTier.DEVICE] == 2
    assert index.block_counts(StreamId(WorkerId("w0")))[StorageTier.DEVICE] == 0  # cleared: rebuilt next start


def test_cli_exits_non_zero_when_the_event_loop_dies_and_on_a_busy_port() -> None:
    # The CLI in a process whose ZMQ refuses every subscription (as refuse_subscriptions does in this one).
    dies = ("import sys, zmq\nfrom kvtier.indexer.service import eventloop\n"
            "def refuse(*a, **k): raise zmq.ZMQError(zmq.EPROTONOSUPPORT)\n"
            "eventloop.Subscriber = refuse\nfrom kvtier.sim.cli import main\n"
            "sys.exit(main(['indexer', '--endpoint', 'a=tcp://127.0.0.1:1', '--listen', '127.0.0.1:0']))")
    r = subprocess.run([sys.executable, "-c", dies], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "event loop died: ZMQError: Protocol not supported" in r.stderr, r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "kvtier", "indexer", "--endpoint", "a=tcp://127.0.0.1:1",
                            "--listen", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith(NOTICES))  # (a slow load: notices)
    assert r.returncode == 2 and err.startswith("kvtier: error: cannot listen on") and "Traceback" not in r.stderr


def test_queries_do_not_wait_for_a_backlog_of_events(svc: tuple[Publisher, Publisher, IndexerService],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Events are applied a batch per lock hold: a burst of batches does not stall queries. Checked by counting
    the batches applied in each of the event loop's lock holds, not by timing queries."""
    p0, _, s = svc
    loop = s._loop
    holds = {"batches": 0, "worst": 0, "fed": 0}

    class CountingLock:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __enter__(self) -> None:
            self.inner.acquire()
            holds["batches"] = 0

        def __exit__(self, *exc: object) -> None:
            holds["worst"] = max(holds["worst"], holds["batches"])
            self.inner.release()

        def let_waiters_in(self) -> None:  # (between the slices of a large batch: a new hold)
            holds["worst"] = max(holds["worst"], holds["batches"])
            self.inner.let_waiters_in()
            holds["batches"] = 0

    feed = loop.consumer.feed

    def counted(deliveries: Any) -> Any:
        deliveries = list(deliveries)
        holds["batches"] += len(deliveries)
        holds["fed"] += len(deliveries)
        return feed(deliveries)

    monkeypatch.setattr(loop, "_lock", CountingLock(loop._lock))
    monkeypatch.setattr(loop.consumer, "feed", counted)
    done = threading.Event()

    def burst() -> None:
        for i in range(3000):
            p0.publish(EventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=[10_000 + i], parent_block_hash=None, token_ids=[i % 1000 + 5] * BS, block_size=BS)]))
        done.set()

    threading.Thread(target=burst).start()
    c = conn(s)
    queries = 0
    while not done.is_set() or queries == 0:
        assert call(c, "POST", "/query", {"token_ids": TOKS})[0] == 200
        queries += 1
    wait_for(lambda: holds["fed"] >= 3000, timeout=30)
    assert holds["worst"] == 1, holds


def test_restart_resumes_from_the_snapshot(tmp_path: Any) -> None:
    """Stop (snapshot on stop), events published while down, start again: the index is restored and
    each stream resumes after its last applied batch (no replay from 0, no resync); a publisher that
    restarted meanwhile is detected and rebuilt; a corrupt snapshot is a one-line config error."""
    snap = tmp_path / "index.snap"
    pubs = [Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") for _ in range(2)]
    eps = [parse_endpoint(f"w{i}={p.endpoint},replay={p.replay_endpoint}") for i, p in enumerate(pubs)]
    cfg = ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", snapshot_path=str(snap))
    try:
        s = IndexerService(cfg)
        s.start()
        for i in range(30):  # 8 distinct blocks, stored (and removed) over and over
            pubs[0].publish(EventBatch(ts=time.time(), events=[stored([100 + i % 8], None, i % 8)]))
            if i < 22:
                pubs[0].publish(EventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[100 + i % 8])]))
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([1, 2], None, 0)]))
        wait_for(lambda: json.loads(get(s.address + "/metrics?format=json"))["batches_applied"] == 53)
        s.stop()
        assert snap.exists() and s.snapshots >= 1
        pubs[0].publish(EventBatch(ts=time.time(), events=[stored([100], None, 0, "CPU")]))  # while down
        pubs[1].close()  # w1's engine restarts: a new process, new seqs, other content
        pubs[1] = Publisher(eps[1].endpoint, eps[1].replay_endpoint)
        pubs[1].publish(EventBatch(ts=time.time(), events=[stored([5], None, 3)]))
        s2 = IndexerService(cfg)
        assert s2.restored_from == str(snap) and len(s2.index) > 0
        s2.start()
        try:
            wait_for(lambda: 100 in s2.view(eps[0].stream)[StorageTier.HOST])
            wait_for(lambda: s2.view(eps[1].stream)[StorageTier.DEVICE] == {5})
            m = json.loads(get(s2.address + "/metrics?format=json"))["workers"]
            assert m["w0"]["resyncs"] == 0 and m["w0"]["restarts"] == 0  # resumed, not replayed from 0
            assert len(s2.view(eps[0].stream)[StorageTier.DEVICE]) == 8
            assert m["w1"]["restarts"] == 1 and not m["w1"]["partial"]
        finally:
            s2.stop()
    finally:
        for p in pubs:
            p.close()
    snap.write_bytes(b"\x93garbage")
    with pytest.raises(ConfigError, match="snapshot"):
        IndexerService(cfg)


def test_cost_models_by_name() -> None:
    eps = [parse_endpoint("a=tcp://127.0.0.1:1")]
    for cost in ("credit", "ttft"):
        assert IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", cost=cost)).router.cost_model
    from kvtier.indexer.routing.scoring import CreditCost, DynamoCost, TtftCost

    dyn = IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy="dynamo")).router.cost_model
    assert isinstance(dyn, DynamoCost)

    kv_host = IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy="kv_host")).router.cost_model
    assert isinstance(kv_host, CreditCost) and kv_host.max_tier is StorageTier.HOST
    ttft = IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy="min_ttft",
                                        capacity_tokens=65_536)).router.cost_model
    assert isinstance(ttft, TtftCost) and ttft.capacity_tokens == 65_536
    for name in ("round_robin", "least_loaded"):
        assert IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy=name)).router.policy
    with pytest.raises(ConfigError, match="capacity_tokens"):
        ServiceConfig(endpoints=eps, capacity_tokens=0)
    with pytest.raises(ConfigError, match="cost: 'magic' is not allowed; expected one of credit, ttft"):
        IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", cost="magic"))
    # Policies that read what a service does not have (the engines' own state, a seeded coin) say so.
    for name, says in (("oracle", "simulator only"), ("random", "simulator only"),
                       ("teleport", "no 'kvtier.policies' entry point has that name; built-in policies: "
                                    "round_robin, least_loaded, kv_device")):
        with pytest.raises(ConfigError, match=says):
            IndexerService(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy=name))


def test_unparseable_http_gets_400_and_one_log_line(svc: tuple[Publisher, Publisher, IndexerService],
                                                    caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.indexer.service import http as http_front

    # The line is thinned per process (the first ten, then every thousandth): counted from none here, whatever
    # malformed requests earlier tests in this process sent.
    monkeypatch.setattr(http_front._BAD_HTTP, "count", 0)
    _, _, s = svc
    host, port = s.address.removeprefix("http://").split(":")
    with caplog.at_level(logging.WARNING):
        for raw in (b"GARBAGE\r\n\r\n", b"POST /query HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}"):
            with socket.create_connection((host, int(port)), timeout=5) as k:
                k.sendall(raw)
                assert b" 400 " in k.recv(4096).split(b"\r\n")[0]
        time.sleep(0.1)
    assert not any(r.exc_info for r in caplog.records)
    assert [r.getMessage() for r in caplog.records if "malformed HTTP" in r.getMessage()]
    assert post(s.address + "/query", {"token_ids": TOKS})[0] == 200  # and the service goes on


def test_a_body_that_cannot_be_decompressed_gets_a_json_400_and_one_log_line(
        svc: tuple[Publisher, Publisher, IndexerService], caplog: pytest.LogCaptureFixture) -> None:
    """A gzip or deflate body that does not decompress is bad input: a 400 with a JSON error naming the encoding,
    not a 500, and no traceback or ERROR logged, ours or aiohttp's as it drains the body."""
    _, _, s = svc
    with caplog.at_level(logging.INFO):
        for encoding in ("gzip", "deflate"):
            c = conn(s)
            c.request("POST", "/query", body=b"not compressed at all",
                      headers={"Content-Type": "application/json", "Content-Encoding": encoding})
            r = c.getresponse()
            assert r.status == 400, (encoding, r.status)
            assert json.loads(r.read()) == {"error": f"request body: Can not decode content-encoding: {encoding}"}
            c.close()
        time.sleep(0.1)
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records if r.exc_info]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    c = conn(s)  # a body that does decompress is read as usual
    c.request("POST", "/query", body=gzip.compress(json.dumps({"token_ids": TOKS}).encode()),
              headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert c.getresponse().status == 200


def test_workers_being_rebuilt_are_skipped_while_others_can_serve() -> None:
    """w1's replay socket never answers: its catch-up is under way (``recovering``) until its tries time out, and
    the router sends nothing there meanwhile; w0 is in sync. The streams' clock stands still here, so the tries never
    time out however slowly the machine runs the test (once they do, w1 is given up and may win a tie)."""
    import zmq

    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    rport = silent.bind_to_random_port("tcp://127.0.0.1")
    good = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    lonely = Publisher("tcp://127.0.0.1:0")
    eps = [parse_endpoint(f"w0={good.endpoint},replay={good.replay_endpoint}"),
           parse_endpoint(f"w1={lonely.endpoint},replay=tcp://127.0.0.1:{rport}")]
    s = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", replay_timeout_s=2.0),
                       clock=Clock())
    s.start()
    try:
        wait_for(lambda: post(s.address + "/query", {"token_ids": TOKS})[1]["workers"]["w1"]["recovering"]
                 and not post(s.address + "/query", {"token_ids": TOKS})[1]["workers"]["w0"]["recovering"])
        picks = {post(s.address + "/query", {"token_ids": TOKS[: 4 * (1 + i % 8)]})[1]["recommended"]
                 for i in range(30)}
        assert picks == {"w0"}
        assert json.loads(get(s.address + "/health"))["recovering_workers"] == ["w1"]
    finally:
        s.stop()
        good.close()
        lonely.close()
        silent.close(0)


def test_a_flood_of_bad_events_from_one_worker_is_counted_per_worker_and_logged_sparingly(
        svc: tuple[Publisher, Publisher, IndexerService], caplog: pytest.LogCaptureFixture) -> None:
    p0, p1, s = svc
    p1.publish(EventBatch(ts=time.time(), events=[stored([1, 2], None, 0)]))
    wrong_size = BlockStored(block_hashes=[7], parent_block_hash=None, token_ids=list(range(BS + 1)),
                             block_size=BS + 1)
    with caplog.at_level(logging.WARNING, logger="kvtier.indexer.index.applier"):
        for _ in range(30):
            p0.publish(EventBatch(ts=time.time(), events=[wrong_size] * 100))
        wait_for(lambda: json.loads(get(s.address + "/metrics?format=json"))["workers"]["w0"]["events_rejected"]
                 == 3000, timeout=10)
    m = json.loads(get(s.address + "/metrics?format=json"))["workers"]
    assert m["w1"]["events_rejected"] == 0 and m["w1"]["events_applied"] == 1  # the other worker is untouched
    assert 'kvtier_events_rejected_total{worker="w0"} 3000' in get(s.address + "/metrics")
    lines = [r.getMessage() for r in caplog.records if "event rejected" in r.getMessage()]
    assert 10 <= len(lines) <= 13 and "further ones logged every 1000th" in lines[9], lines[-3:]
    assert post(s.address + "/query", {"token_ids": TOKS})[1]["workers"]["w1"]["device"] == 2
    code, body = post(s.address + "/query", {"token_ids": [True, 2]})  # a boolean is no token id
    assert code == 400 and "Expected `int`, got `bool`" in body["error"]


def test_deadlines_expire_only_requests_still_in_flight() -> None:
    from kvtier.indexer.service.deadlines import Deadlines

    d = Deadlines(ttl_s=10.0)
    d.book("a", 0.0)
    d.book("b", 1.0)
    with pytest.raises(ValueError, match="already in flight"):
        d.book("a", 2.0)
    assert d.finish("a") and not d.finish("a")
    d.book("a", 5.0)  # booked again: its first deadline (10.0) is stale
    assert not d.due(9.9) and d.due(10.0)
    assert d.expire(11.0) == ["b"] and "a" in d and d.expired == 1
    d._check()
    assert d.expire(15.0) == ["a"] and len(d) == 0 and d.expired == 2
    # A wave of expiries comes out in batches (the event loop takes one per hold of the service's lock).
    for i in range(5):
        d.book(f"r{i}", float(i))
    assert d.expire(100.0, limit=2) == ["r0", "r1"] and d.due(100.0)
    assert d.expire(100.0, limit=2) == ["r2", "r3"] and d.expire(100.0, limit=2) == ["r4"]
    assert not d.due(100.0) and d.expired == 7


def test_finished_requests_leave_the_deadline_heap_bounded() -> None:
    """Routes finished long before their time to live hold no memory until it: the deadlines kept stay within about
    twice those in flight, and the ones in flight still expire, in order."""
    from kvtier.indexer.service.deadlines import Deadlines

    d = Deadlines(ttl_s=600.0)
    d.book("kept", 0.0)
    for i in range(100_000):
        d.book(f"r{i}", i * 1e-3)
        d.finish(f"r{i}")
    assert len(d) == 1 and len(d._heap) <= 2 * len(d) + 1025
    d._check()
    assert d.expire(700.0) == ["kept"]


def test_a_header_past_the_limit_is_refused_without_echoing_it(svc: tuple[Publisher, Publisher, IndexerService],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp refuses a header line past its size limit quoting the line's bytes; an ``Authorization`` header's
    token is in them, so neither the JSON 400 nor the log line quotes request bytes."""
    _, _, s = svc
    host, port = s.address.removeprefix("http://").split(":")
    secret = "s3cr3t" * 2000
    with caplog.at_level("WARNING"), socket.create_connection((host, int(port)), timeout=5) as k:
        k.sendall(b"POST /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret.encode() + b"\r\n"
                  b"Content-Length: 2\r\n\r\n{}")
        answer = b""
        while chunk := k.recv(65536):
            answer += chunk
    assert b" 400 " in answer.split(b"\r\n")[0] and b"s3cr3t" not in answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"].startswith("Got more than")
    assert not any("s3cr3t" in r.getMessage() for r in caplog.records)


def test_a_large_batch_lets_waiting_requests_in_between_its_slices(
        svc: tuple[Publisher, Publisher, IndexerService], monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's size is bounded only by the largest frame (64 MiB): one of a million cheap events held the index
    lock for seconds, and every request waited, /health included (a liveness probe would restart the service). A
    batch is applied in slices, and the requests waiting when one ends go first. Here /health is asked while the
    batch's first event is applied, and the batch's last event waits until it is answered."""
    from kvtier.indexer.index.consumer import SLICE_WORK
    from kvtier.indexer.index.tiered import TieredIndex
    from kvtier.wire import AllBlocksCleared

    p0, _, s = svc
    n = 3 * SLICE_WORK
    answered, seen = threading.Event(), [0]
    apply = TieredIndex._apply

    def watched(index: TieredIndex, w: Any, event: Any) -> Any:
        if index is s.index and isinstance(event, AllBlocksCleared):
            seen[0] += 1
            if seen[0] == 1:
                threading.Thread(target=lambda: (get(s.address + "/health"), answered.set()), daemon=True).start()
                deadline = time.monotonic() + 10.0
                while not s._lock._waiting:  # (the request is in: it waits for the lock this batch holds)
                    assert time.monotonic() < deadline, "/health never came to the lock"
                    time.sleep(0.001)
            elif seen[0] == n:
                assert answered.wait(10.0), "/health was not answered before the batch's last event"
        return apply(index, w, event)

    monkeypatch.setattr(TieredIndex, "_apply", watched)
    p0.publish(EventBatch(ts=time.time(), events=[AllBlocksCleared() for _ in range(n)]))
    wait_for(lambda: seen[0] == n and s.metrics()["batches_applied"] >= 1, timeout=30)
    assert answered.is_set()


def test_what_needs_no_kernel_is_refused_before_they_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The first start after an install compiles the index's kernels for half a minute: a snapshot path that cannot
    be written, the config file or the token file given as the snapshot, a token file with no token, a plugin that
    is not there, or a port taken already is refused before that, not after."""
    from kvtier.indexer.service import app

    def loaded() -> None:
        raise AssertionError("the kernels were loaded before the check")

    monkeypatch.setattr(app, "load_kernels", loaded)
    config = tmp_path / "kvtier.toml"
    config.write_text('[[endpoints]]\nworker = "w"\nendpoint = "tcp://127.0.0.1:2"\n')
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    empty = tmp_path / "empty"
    empty.write_text("# none yet\n")
    base = ["indexer", "--endpoint", "a=tcp://127.0.0.1:1", "--listen", "127.0.0.1:0"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [
            (["--snapshot", str(tmp_path / "no" / "x.snap")], "does not exist"),
            (["--config", str(config), "--snapshot", str(config)],
             f"snapshot {config}: is the --config file, which the service reads; name another file"),
            (["--auth-token-file", str(tokens), "--snapshot", str(tokens)],
             f"snapshot {tokens}: is auth_token_file, which the service reads; name another file"),
            (["--auth-token-file", str(empty)], f"auth_token_file {empty}: holds no token"),
            (["--policy", str(tmp_path / "none.py")], "none.py"),
            (["--listen", f"127.0.0.1:{busy.getsockname()[1]}"], "cannot listen on 127.0.0.1"),
        ]
        for args, message in cases:
            assert cli_main([*base[:3], *args] if "--listen" in args else [*base, *args]) == 2, args
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err, (args, err)


def test_the_checks_before_the_kernels_run_no_plugin_code_and_name_what_they_cannot_remove(tmp_path: Path) -> None:
    """The checks made before the kernels load find a plugin's file without running it (its module would run
    twice, once more at the start); a snapshot's left-over temporary file that cannot be removed (a directory) is
    named as the snapshot's problem, not as a port that cannot be listened on."""
    from kvtier.indexer.service.app import preflight

    ran = tmp_path / "ran"
    plugin = tmp_path / "mine.py"
    plugin.write_text(f"open({str(ran)!r}, 'a').write('x')\nclass Mine:\n    name = 'mine'\n")
    eps = [parse_endpoint("a=tcp://127.0.0.1:1")]
    preflight(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy=f"{plugin}:Mine"))
    assert not ran.exists()
    with pytest.raises(ConfigError, match=r"policy 'kvall': not module:attr, and no 'kvtier.policies' entry point "
                                          r"has that name \(did you mean 'kv_all'\?\); built-in policies: "):
        preflight(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", policy="kvall"))
    snap = tmp_path / "x.snap"
    (tmp_path / ".x.snap.tmp-999999999").mkdir()  # (a writer long gone; not a file)
    with pytest.raises(ConfigError, match=r"snapshot .*x\.snap: Is a directory: .*\.x\.snap\.tmp-999999999$"):
        preflight(ServiceConfig(endpoints=eps, listen="127.0.0.1:0", snapshot_path=str(snap)))
