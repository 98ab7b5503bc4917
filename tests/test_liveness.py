"""Liveness: a worker whose publisher is gone (no batch, no probe answer for ``liveness_timeout_s``) is not routed
to and is reported; a restarted dump-capable engine is asked for a dump and leaves ``partial``.

The tracker tests drive time by hand. The service test runs real ZMQ publishers on loopback and moves the
streams' clock by hand (``IndexerService(clock=...)``), waiting on conditions with a bounded poll: no assumption
about how fast the machine is.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier.indexer.index.consumer import IndexConsumer
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.indexer.service.app import ConfigError, IndexerService, ServiceConfig, load_config, parse_endpoint
from kvtier.sim.cli import main as cli_main
from kvtier.wire import (
    DUMP_REQUEST,
    END_SEQ,
    BlockStored,
    EventBatch,
    Publisher,
    ResyncDone,
    ResyncNeeded,
    StorageTier,
    StreamId,
    StreamTracker,
    WorkerId,
    encode_payload,
    pack_seq,
)
from tests.test_service import Clock, get, post

BS = 4
TOKS = list(range(1000, 1000 + 8 * BS))
S = StreamId(WorkerId("w"), 0)


def stored(hashes: list[int], parent: int | None, lo: int) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=TOKS[lo * BS:(lo + len(hashes)) * BS],
                       block_size=BS, medium="GPU")


def batch(*events: BlockStored) -> EventBatch:
    return EventBatch(ts=0.0, events=list(events))


# --- the tracker, by hand ---------------------------------------------------------------------


def caught_up(t: StreamTracker, now: float, last: int) -> None:
    """Start, then batches 0..last live, the catch-up answered empty."""
    t.start(now)
    t.outbox.clear()
    t.on_reply(END_SEQ, b"", now)
    for seq in range(last + 1):
        t.on_live(seq, encode_payload(batch()), now)


def answer_probes(t: StreamTracker, now: float) -> None:
    """The publisher answers whatever was asked: nothing past what was published (an end marker)."""
    if t.outbox:
        t.outbox.clear()
        t.on_reply(END_SEQ, b"", now)


def test_a_probed_publisher_stays_heard_and_a_gone_one_falls_silent() -> None:
    alive = StreamTracker(S, can_replay=True, can_dump=False, timeout_s=1.0, probe_s=0.5)
    gone = StreamTracker(S, can_replay=True, can_dump=False, timeout_s=1.0, probe_s=0.5)
    blind = StreamTracker(S, can_replay=False, can_dump=False, probe_s=0.5)  # nothing can be asked of it
    for t in (alive, gone):
        caught_up(t, 0.0, 2)
    blind.start(0.0)
    now = 0.0
    for _ in range(40):  # 10 s, idle: every stream is probed after 0.5 s of quiet
        now += 0.25
        for t in (alive, gone, blind):
            t.on_tick(now)
        answer_probes(alive, now)
        gone.outbox.clear()  # (no answer ever comes)
        assert not alive.silent(now, 2.0)
        assert gone.silent(now, 2.0) is (now >= 2.0)  # last heard at 0
        assert not blind.silent(now, 2.0)
    gone.on_live(3, encode_payload(batch()), now)  # heard again
    assert not gone.silent(now, 2.0) and gone.silent(now + 2.0, 2.0)


def test_a_dump_capable_stream_given_up_keeps_asking_for_a_dump_until_one_comes() -> None:
    """An engine killed, then restarted: the dumps asked while it was gone time out and the stream is marked
    partial; it is asked again (paced by the resync backoff) until the restarted engine answers, and the
    worker is then whole again. A failed dump is never the last one asked."""
    t = StreamTracker(S, can_replay=True, can_dump=True, timeout_s=1.0, probe_s=1.0)
    index = TieredIndex(BS)
    consumer = IndexConsumer(index)
    index.add_worker(S)
    now = 0.0
    t.start(now)
    t.outbox.clear()
    consumer.feed(t.on_reply(END_SEQ, b"", now))
    consumer.feed(t.on_live(0, encode_payload(batch(stored([1, 2], None, 0))), now))
    t.on_disconnect()  # killed
    gave_up, dumps = 0, 0
    for _ in range(240):  # 60 s without an answer
        now += 0.25
        out = t.on_tick(now)
        consumer.feed(out)
        gave_up += sum(isinstance(d, ResyncNeeded) for d in out)
        dumps += t.outbox.count(DUMP_REQUEST)
        t.outbox.clear()
    assert gave_up >= 3 and index.is_partial(S) and t.silent(now, 5.0)
    assert dumps >= 3 * gave_up  # asked again and again, a few tries each time
    # Restarted: it answers the next dump asked, with its whole state as of its seq 4.
    while DUMP_REQUEST not in t.outbox:
        now += 0.25
        consumer.feed(t.on_tick(now))
    t.outbox.clear()  # (sent)
    out = t.on_reply(pack_seq(4), encode_payload(batch(stored([7, 8, 9], None, 2))), now)
    out += t.on_reply(END_SEQ, b"", now)
    consumer.feed(out)
    assert ResyncDone(S, 4) in out and not t.recovering and not index.is_partial(S)
    assert index.worker_hashes(S)[StorageTier.DEVICE] == {7, 8, 9} and t.expected == 5
    assert not t.silent(now, 5.0)
    for _ in range(40):  # whole again: no more dumps, only idle probes
        now += 0.25
        consumer.feed(t.on_tick(now))
        assert DUMP_REQUEST not in t.outbox
        answer_probes(t, now)
    assert not index.is_partial(S) and not t.silent(now, 5.0)


def test_a_dump_from_a_publisher_that_published_nothing_yet_is_taken_whole() -> None:
    """A restarted engine that has published nothing numbers its dump batches -1, the end marker's bytes; its
    end marker has an empty payload, a dump batch never does. So the first dump batch is not taken for the end
    marker ("publisher sent no state dump"): the dump is applied whole and the stream is no longer partial, before
    the engine publishes anything."""
    t = StreamTracker(S, can_replay=True, can_dump=True, timeout_s=1.0, probe_s=None)
    index = TieredIndex(BS)
    consumer = IndexConsumer(index)
    t.start(0.0)
    t.outbox.clear()
    t.on_reply(END_SEQ, b"", 0.0)
    consumer.feed(t.request_resync("test", 0.0))  # a full replay from 0, unanswered: then a dump
    now = 0.0
    while DUMP_REQUEST not in t.outbox:
        assert now < 10.0
        t.outbox.clear()
        now += 0.25
        consumer.feed(t.on_tick(now))
    t.outbox.clear()
    out = t.on_reply(END_SEQ, encode_payload(batch(stored([5, 6], None, 0))), now)
    out += t.on_reply(END_SEQ, b"", now)
    consumer.feed(out)
    assert ResyncDone(S, -1) in out and not index.is_partial(S) and not t.recovering
    assert index.worker_hashes(S)[StorageTier.DEVICE] == {5, 6} and t.expected == 0
    consumer.feed(t.on_live(0, encode_payload(batch(stored([7], 6, 2))), now))  # its first batch follows
    assert index.worker_hashes(S)[StorageTier.DEVICE] == {5, 6, 7}


def test_a_publisher_that_answers_a_dump_with_nothing_is_not_asked_again() -> None:
    """An endpoint marked dump-capable whose publisher cannot dump answers with the end marker alone: the
    stream is partial, and asking again would only clear, time after time, what its live events rebuild."""
    t = StreamTracker(S, can_replay=True, can_dump=True, timeout_s=1.0, probe_s=None)
    t.start(0.0)
    t.outbox.clear()
    t.on_reply(END_SEQ, b"", 0.0)
    t.on_live(0, encode_payload(batch()), 0.0)
    t.request_resync("test", 0.0)
    t.outbox.clear()
    t.on_reply(pack_seq(5), encode_payload(batch()), 0.0)  # the buffer no longer reaches back: a dump
    t.on_reply(END_SEQ, b"", 0.0)
    assert t.outbox == [DUMP_REQUEST]
    t.outbox.clear()
    out = t.on_reply(END_SEQ, b"", 0.0)
    assert [d for d in out if isinstance(d, ResyncNeeded)]
    now = 0.0
    for _ in range(400):  # 100 s
        now += 0.25
        t.on_tick(now)
        assert DUMP_REQUEST not in t.outbox
        t.outbox.clear()


# --- the service, over loopback ----------------------------------------------------------------


def health(svc: IndexerService) -> dict[str, Any]:
    return dict(json.loads(get(svc.address + "/health")))


def run_clock(clock: Clock, cond: Callable[[], bool], *, step: float, pause: float = 0.05,
              limit_s: float = 60.0) -> None:
    """Moves the clock by ``step`` every ``pause`` of real time until ``cond`` holds (then leaves it still)."""
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        clock.t += step
        time.sleep(pause)


def query(svc: IndexerService) -> dict[str, Any]:
    code, body = post(svc.address + "/query", {"token_ids": TOKS})
    assert code == 200, body
    return body


def test_a_gone_engine_is_not_routed_to_and_comes_back_whole_after_a_restart() -> None:
    p0 = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    p1 = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    eps = [parse_endpoint(f"w0={p0.endpoint},replay={p0.replay_endpoint},dump"),
           parse_endpoint(f"w1={p1.endpoint},replay={p1.replay_endpoint}")]
    clock = Clock()
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", replay_timeout_s=1.0,
                                       liveness_timeout_s=5.0), clock=clock)
    svc.start()
    restarted: Publisher | None = None
    try:
        p0.publish(batch(stored([1, 2, 3], None, 0)))  # w0 holds the query's first 3 blocks
        p1.publish(batch(stored([50], None, 7)))  # w1 holds nothing of it
        # (the clock moves: a batch published before the subscription was up is found by the idle probe)
        w0, w1 = StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))
        run_clock(clock, lambda: query(svc)["workers"]["w0"]["device"] == 3
                  and svc.view(w1).get(StorageTier.DEVICE) == {50} and not health(svc)["recovering_workers"], step=0.1)
        assert health(svc)["dead_workers"] == []

        p0.close()  # the engine is gone: no batch, no probe answer from now on

        def only_w0_dead_and_settled() -> bool:
            h = health(svc)
            return h["dead_workers"] == ["w0"] and h["partial_workers"] == ["w0"] and not h["recovering_workers"]

        run_clock(clock, only_w0_dead_and_settled, step=0.25)
        # The clock stands still from here on: w1 answered its last probe within the timeout, w0 did not.
        h = health(svc)
        assert h["status"] == "degraded"
        body = query(svc)
        assert body["workers"]["w0"]["dead"] and not body["workers"]["w1"]["dead"]
        assert body["recommended"] == "w1"  # w0 is cleared and idle, so it would tie half the time
        for i in range(20):
            code, routed = post(svc.address + "/route", {"token_ids": TOKS, "request_id": f"r{i}"})
            assert code == 200 and routed["worker"] == "w1", routed
        m = json.loads(get(svc.address + "/metrics?format=json"))
        assert m["dead_workers"] == 1 and m["workers"]["w0"]["dead"] and not m["workers"]["w1"]["dead"]
        text = get(svc.address + "/metrics")
        assert "kvtier_dead_workers 1" in text and 'kvtier_dead{worker="w0"} 1' in text

        # The engine restarts on the same addresses with a new state, published (seq 0) and dumpable.
        state = [stored([7, 8], None, 0)]
        pub = Publisher(eps[0].endpoint, eps[0].replay_endpoint,
                        dump_provider=lambda: (pub.last_seq, iter([batch(*state)])))
        restarted = pub
        pub.publish(batch(*state))

        def whole_again() -> bool:
            h = health(svc)
            return (h["status"] == "ok" and not h["dead_workers"]
                    and svc.view(w0).get(StorageTier.DEVICE) == {7, 8})

        run_clock(clock, whole_again, step=0.1)
        body = query(svc)
        assert body["workers"]["w0"]["device"] == 2 and not body["workers"]["w0"]["partial"]
        code, routed = post(svc.address + "/route", {"token_ids": TOKS, "request_id": "back"})
        assert code == 200 and routed["worker"] == "w0"  # routable again, and the better choice
    finally:
        svc.stop()
        for p in (p0, p1, restarted):
            if p is not None:
                p.close()


class VacantPorts:
    """Two loopback TCP ports that nothing listens on, held bound (not listening) until :meth:`release`: a connection
    to either is refused. A closed publisher's addresses are no such thing: ZMQ tears its listeners down on a thread
    of its own after ``close()`` returns, so a subscriber connecting at once may still reach it."""

    def __init__(self) -> None:
        self._socks = [socket.socket() for _ in range(2)]
        for s in self._socks:
            s.bind(("127.0.0.1", 0))
        self.live, self.replay = (f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in self._socks)

    def release(self) -> None:
        """Frees both ports for a publisher to bind (again: nothing)."""
        for s in self._socks:
            s.close()

    def __enter__(self) -> VacantPorts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def idle_engine_comes_up(svc: IndexerService, clock: Clock, vacant: VacantPorts) -> Publisher:
    """Worker w0's engine, at ``vacant``'s addresses, is not up when the service starts: its stream is given up with
    nothing at hand, dead and partial. The engine then starts and publishes nothing: it is alive while its live
    connection holds, through a minute of idleness. Returns its publisher."""
    run_clock(clock, lambda: health(svc)["dead_workers"] == ["w0"] == health(svc)["partial_workers"], step=0.25)
    vacant.release()
    pub = Publisher(vacant.live, vacant.replay)
    run_clock(clock, lambda: health(svc)["dead_workers"] == [], step=0.25, limit_s=15.0)
    clock.t += 60.0
    assert health(svc)["dead_workers"] == []
    return pub


def test_an_engine_that_cannot_dump_started_after_the_indexer_is_alive_while_idle() -> None:
    """An SGLang or vLLM engine started after the indexer: the replay asked at start goes unanswered and the stream is
    given up with nothing at hand, which no idle probe can ask from. The engine then came up and stayed idle (nothing
    routed to it yet), and was listed dead for good: the router sent it nothing, so it never published. A live
    connection to the publisher now shows it up; once gone again, it is silent as before."""
    vacant = VacantPorts()  # its addresses, with nobody behind them yet
    clock = Clock()
    svc = IndexerService(ServiceConfig(endpoints=[parse_endpoint(f"w0={vacant.live},replay={vacant.replay}")],
                                       block_size=BS, listen="127.0.0.1:0", replay_timeout_s=1.0,
                                       liveness_timeout_s=5.0), clock=clock)
    svc.start()
    pub: Publisher | None = None
    try:
        pub = idle_engine_comes_up(svc, clock, vacant)
        # Its first batches: the state is whole from here. A PUB drops what it sends before the subscriber's
        # subscription reached it (ZMQ's slow joiner), which the connection seen does not rule out: a block a batch
        # until the index holds every one (a later batch's seq shows an earlier one missing, which a replay brings).
        sent = 0
        deadline = time.monotonic() + 60.0
        while not query(svc)["workers"]["w0"]["device"]:  # until one arrived: the subscription is in place
            assert time.monotonic() < deadline, f"none of the {sent} batches sent reached the index"
            pub.publish(batch(stored([sent + 1], sent or None, sent)))
            sent += 1
            clock.t += 0.1
            time.sleep(0.05)
        run_clock(clock, lambda: health(svc)["status"] == "ok" and query(svc)["workers"]["w0"]["device"] == sent,
                  step=0.1)
        pub.close()
        pub = None
        run_clock(clock, lambda: health(svc)["dead_workers"] == ["w0"], step=0.25)
    finally:
        svc.stop()
        vacant.release()
        if pub is not None:
            pub.close()


class FreezingProxy:
    """A TCP relay on loopback to ``target`` (``tcp://host:port``) that :meth:`freeze` stops dead: its connections
    stay open and nothing more passes either way, as when a publisher's host vanishes (power lost, a partition)
    without closing them. Threads: one accepting, two per connection."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._frozen = threading.Event()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._frozen.is_set():
                self._socks.append(client)  # (held open, never answered)
                continue
            try:
                server = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                data = src.recv(65536)
            except OSError:
                return
            if self._frozen.is_set():
                self._closed.wait()  # (the bytes are swallowed; the connection stays open)
                return
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def freeze(self) -> None:
        self._frozen.set()

    def close(self) -> None:
        self._closed.set()
        for sock in self._socks:
            sock.close()


def test_the_live_socket_keeps_tcp_alive_to_find_a_vanished_host() -> None:
    """A stream given up with nothing to probe counts as up while its live socket holds a connection. A publisher
    host that vanishes without closing it (power lost, a partition) kept it for as long as TCP did, hours without
    keepalive. The live socket asks TCP keepalive, whose unanswered probes drop it within TCP_KEEPALIVE_S seconds
    (not ZMTP heartbeats, which libzmq 4.3 lets abort the process when the socket's queue is full). A vanished host
    cannot be made on loopback, so the socket's settings are what is checked."""
    import zmq

    from kvtier.wire.transport.subscriber import TCP_KEEPALIVE_S, EndpointConfig, Subscriber

    with Subscriber([EndpointConfig("w0", "tcp://127.0.0.1:1")]) as sub:
        live = sub._conns[StreamId(WorkerId("w0"), 0)].sub
        assert live.getsockopt(zmq.TCP_KEEPALIVE) == 1
        idle, every, probes = (live.getsockopt(o) for o in (zmq.TCP_KEEPALIVE_IDLE, zmq.TCP_KEEPALIVE_INTVL,
                                                             zmq.TCP_KEEPALIVE_CNT))
        assert idle + every * probes == TCP_KEEPALIVE_S <= 5
        assert live.getsockopt(zmq.HEARTBEAT_IVL) == 0  # (no ZMTP heartbeats)


def test_liveness_timeout_is_a_setting_checked_like_the_others(tmp_path: Any) -> None:
    cfg = tmp_path / "indexer.toml"
    cfg.write_text('liveness_timeout_s = 2.5\n[[endpoints]]\nworker = "a"\nendpoint = "tcp://127.0.0.1:5557"\n')
    assert load_config(cfg).liveness_timeout_s == 2.5
    assert ServiceConfig(endpoints=[]).liveness_timeout_s == 5.0
    for bad in (0, -1, float("nan"), "5"):
        with pytest.raises(ConfigError, match="liveness_timeout_s"):
            ServiceConfig(endpoints=[], liveness_timeout_s=bad)  # type: ignore[arg-type]
    assert cli_main(["indexer", "--endpoint", "w=tcp://127.0.0.1:1", "--liveness-timeout", "0"]) == 2
    with pytest.raises(SystemExit) as exit_:  # (argparse's own one-line error)
        cli_main(["indexer", "--endpoint", "w=tcp://127.0.0.1:1", "--liveness-timeout", "soon"])
    assert exit_.value.code == 2


def test_a_long_snapshot_takes_no_worker_for_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The event loop copies the index for its snapshots on its own thread (long, for a large index) and polls
    nothing meanwhile: that time is no silence. Every live worker was listed dead for most of each long snapshot, alerts
    flapping and quiet workers routed around. Each snapshot here takes 60 s of the streams' clock; /health, asked
    from inside them, lists no worker dead, nor after them."""
    from kvtier.indexer.service import persist

    p0 = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    eps = [parse_endpoint(f"w0={p0.endpoint},replay={p0.replay_endpoint}")]
    clock = Clock()
    svc = IndexerService(ServiceConfig(endpoints=eps, block_size=BS, listen="127.0.0.1:0", replay_timeout_s=1.0,
                                       liveness_timeout_s=5.0, snapshot_path=str(tmp_path / "snap"),
                                       snapshot_interval_s=0.1), clock=clock)
    seen: list[list[str]] = []
    armed = [False]
    capture = persist.capture  # (the part of a snapshot made on the loop's thread; the write is another thread's)

    def slow_capture(*args: Any) -> persist.Pending:
        if armed[0]:
            clock.t += 60.0
            seen.append(health(svc)["dead_workers"])
        return capture(*args)

    monkeypatch.setattr(persist, "capture", slow_capture)
    svc.start()
    try:
        p0.publish(batch(stored([1, 2, 3], None, 0)))
        run_clock(clock, lambda: query(svc)["workers"]["w0"]["device"] == 3 and not health(svc)["recovering_workers"],
                  step=0.1)
        assert health(svc)["dead_workers"] == []
        armed[0] = True
        deadline = time.monotonic() + 30
        while len(seen) < 3:
            assert time.monotonic() < deadline, "no snapshot written"
            time.sleep(0.01)
        armed[0] = False
        assert seen[:3] == [[], [], []]
        assert health(svc)["dead_workers"] == [] and health(svc)["status"] == "ok"
    finally:
        svc.stop()
        p0.close()


def test_a_snapshot_taken_while_an_idle_probe_is_unanswered_keeps_the_stream(tmp_path: Path) -> None:
    """A quiet stream is probed every second. A snapshot taken between a probe and its answer (a stop's, or a
    periodic one) saved no position for the stream, so the restarted service cleared its worker and started it
    afresh: an SGLang or vLLM worker whose replay buffer no longer reaches seq 0 came back partial, its blocks lost.
    Here the probe's answer is held (the replay connection frozen) while the service stops; the restart resumes the
    stream after its last batch, whole."""
    W0 = StreamId(WorkerId("w0"), 0)
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=1)
    proxy = FreezingProxy(pub.replay_endpoint)
    snap = tmp_path / "index.snap"

    def service(replay: str, clock: Clock) -> IndexerService:
        return IndexerService(ServiceConfig(endpoints=[parse_endpoint(f"w0={pub.endpoint},replay={replay}")],
                                            block_size=BS, listen="127.0.0.1:0", replay_timeout_s=1.0,
                                            liveness_timeout_s=5.0, snapshot_path=str(snap)), clock=clock)

    clock = Clock()
    svc = service(proxy.endpoint, clock)
    svc.start()
    try:
        assert svc._loop._sub is not None
        tracker = svc._loop._sub._conns[W0].tracker
        run_clock(clock, lambda: health(svc)["status"] == "ok" and tracker._connected, step=0.1)
        pub.publish(batch(stored([1, 2, 3], None, 0)))
        run_clock(clock, lambda: query(svc)["workers"]["w0"]["device"] == 3, step=0.1)
        pub.publish(batch(stored([4], 3, 3)))  # the publisher's buffer holds this batch (seq 1) alone
        run_clock(clock, lambda: query(svc)["workers"]["w0"]["device"] == 4, step=0.1)
        assert health(svc)["status"] == "ok"
        proxy.freeze()
        recovery = tracker._recovery
        run_clock(clock, lambda: recovery.active and recovery.replay.probe, step=0.25)
    finally:
        svc.stop()
        proxy.close()
    clock = Clock()
    svc = service(pub.replay_endpoint, clock)
    svc.start()
    try:
        run_clock(clock, lambda: not svc._loop._sub or not svc._loop._sub.recovering(W0), step=0.1)
        assert health(svc)["partial_workers"] == [] and query(svc)["workers"]["w0"]["device"] == 4
    finally:
        svc.stop()
        pub.close()


def test_a_handshake_with_a_publisher_already_up_is_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The subscriber learns that its live socket is connected from the socket's monitor. Attached after the socket
    connected, the monitor missed a handshake that completed first (a publisher already up, a thread slow to get
    to it), and the stream never counted as connected. Here attaching a monitor takes a while."""
    import zmq

    from kvtier.wire.transport.subscriber import EndpointConfig, Subscriber

    attach = zmq.Socket.get_monitor_socket

    def slow_attach(self: zmq.Socket[bytes], *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return attach(self, *args, **kwargs)

    monkeypatch.setattr(zmq.Socket, "get_monitor_socket", slow_attach)
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as pub, \
            Subscriber([EndpointConfig("w0", pub.endpoint, pub.replay_endpoint)]) as sub:
        tracker = sub._conns[StreamId(WorkerId("w0"), 0)].tracker
        deadline = time.monotonic() + 10.0
        while not tracker._connected:
            assert time.monotonic() < deadline, "the handshake was never seen"
            sub.poll(50)


def test_a_publisher_never_reached_is_named_by_its_address_once(caplog: pytest.LogCaptureFixture) -> None:
    """An endpoint with a wrong address or port, or an engine not up: the stream's replay times out and it is given
    up, and the log said so naming the worker alone. It names the addresses too, once."""
    from kvtier.wire import ResyncNeeded
    from kvtier.wire.transport.subscriber import EndpointConfig, Subscriber

    given_up = 0
    with VacantPorts() as vacant, caplog.at_level(logging.WARNING), \
            Subscriber([EndpointConfig("w0", vacant.live, vacant.replay)], replay_timeout_s=0.2, probe_s=0.1) as sub:
        deadline = time.monotonic() + 15.0
        while given_up < 2:
            assert time.monotonic() < deadline, "the stream was not given up twice"
            given_up += sum(isinstance(d, ResyncNeeded) for d in sub.poll(20))
            if given_up == 1:
                sub.request_resync(StreamId(WorkerId("w0"), 0), "asked again")  # (given up again: no second line)
    named = [r.getMessage() for r in caplog.records if "no connection to its publisher" in r.getMessage()]
    assert named == [f"stream w0: no connection to its publisher at {vacant.live} (replay {vacant.replay}) yet: "
                     "check that address, and that the engine runs with its KV events on"]
