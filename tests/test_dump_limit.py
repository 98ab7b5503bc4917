"""State dumps on the replay socket are rate-limited per peer and capped in number at once; replays are not.

Real ZMQ sockets on loopback. The publisher is served from the test's thread (``threaded=False``) and reads an
injected clock, so whether a request falls inside the interval, or finds a dump in progress, is forced, never
timed: the wall clock only bounds how long the test waits for frames.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvtier.engine.events import AllBlocksCleared
from kvtier.sim import live
from kvtier.wire.notices import Delivery, ResyncDone, ResyncNeeded
from kvtier.wire.protocol import BlockStored, EventBatch
from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq
from kvtier.wire.transport.publisher import Publisher
from kvtier.wire.transport.subscriber import EndpointConfig, Subscriber

WAIT_S = 10.0  # most a test waits for frames on loopback (a bound, not a condition)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def batch(i: int) -> EventBatch:
    return EventBatch(ts=float(i), events=[AllBlocksCleared()])


def dealer(pub: Publisher) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pub.replay_endpoint or "")
    return sock


def ask(pub: Publisher, sock: zmq.Socket[bytes], request: bytes) -> list[bytes]:
    """The seq frames of the answer to ``request``, its end marker included, serving ``pub`` meanwhile."""
    sock.send_multipart([b"", request])
    seqs: list[bytes] = []
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        pub.serve_requests(5)
        while sock.poll(0):
            seqs.append(sock.recv_multipart()[2])  # [b"", topic, seq, payload]
            if seqs[-1] == END_SEQ:
                return seqs
    raise AssertionError(f"no end marker after {seqs}")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_peer_asking_for_dumps_too_often_gets_the_end_marker_alone(clock: Clock) -> None:
    calls = [0]

    def provider() -> tuple[int, Iterator[EventBatch]]:
        calls[0] += 1
        return pub.last_seq, iter([batch(0), batch(1), batch(2)])

    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", dump_provider=provider, threaded=False,
                    dump_interval_s=5.0, clock=clock)
    a, b = dealer(pub), dealer(pub)
    try:
        pub.publish(batch(0))
        pub.publish(batch(1))
        dump = [pack_seq(1)] * 3 + [END_SEQ]
        assert ask(pub, a, DUMP_REQUEST) == dump
        assert ask(pub, a, DUMP_REQUEST) == [END_SEQ]  # refused: the provider is not even called
        assert calls[0] == 1 and pub.replay_stats.dumps_refused == 1 and pub.replay_stats.dumps == 2
        assert ask(pub, b, DUMP_REQUEST) == dump  # per peer: another one is answered
        for _ in range(5):  # replays stay unlimited, for the peer refused a dump too
            assert ask(pub, a, pack_seq(0)) == [pack_seq(0), pack_seq(1), END_SEQ]
        clock.now += 4.999
        assert ask(pub, a, DUMP_REQUEST) == [END_SEQ]
        clock.now += 0.001  # the interval since a's last dump (refusals do not restart it)
        assert ask(pub, a, DUMP_REQUEST) == dump
        assert calls[0] == 3 and pub.replay_stats.dumps_refused == 2 and pub.replay_stats.dump_errors == 0
    finally:
        a.close()
        b.close()
        pub.close()


def test_dumps_in_progress_at_once_are_capped(clock: Clock) -> None:
    """Identities cost a peer nothing (one per connection): the cap on dumps at once bounds what many cost."""
    gate = threading.Event()

    def provider() -> tuple[int, Iterator[EventBatch]]:
        gate.wait(WAIT_S)  # the first dump is still being built while the others ask
        return pub.last_seq, iter([batch(0)])

    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", dump_provider=provider, threaded=False,
                    max_dumps=1, clock=clock)
    first, second = dealer(pub), dealer(pub)
    try:
        pub.publish(batch(0))
        first.send_multipart([b"", DUMP_REQUEST])
        deadline = time.monotonic() + WAIT_S
        while pub.replay_stats.dumps == 0 and time.monotonic() < deadline:
            pub.serve_requests(5)
        assert pub.replay_stats.dumps == 1 and not first.poll(0)  # in progress, nothing sent yet
        assert ask(pub, second, DUMP_REQUEST) == [END_SEQ]
        assert ask(pub, second, pack_seq(0)) == [pack_seq(0), END_SEQ]  # a replay beside it is answered
        gate.set()
        got: list[bytes] = []
        while END_SEQ not in got and time.monotonic() < deadline:
            pub.serve_requests(5)
            while first.poll(0):
                got.append(first.recv_multipart()[2])
        assert got == [pack_seq(0), END_SEQ]
        assert ask(pub, second, DUMP_REQUEST) == [pack_seq(0), END_SEQ]  # the first is done: room again
        assert pub.replay_stats.dumps_refused == 1
    finally:
        first.close()
        second.close()
        pub.close()


def test_limits_are_checked() -> None:
    for kwargs, message in (({"dump_interval_s": -1.0}, "dump_interval_s"), ({"dump_interval_s": float("nan")},
                            "dump_interval_s"), ({"max_dumps": 0}, "max_dumps")):
        with pytest.raises(ValueError, match=message):
            Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", threaded=False, **kwargs)  # type: ignore[arg-type]


def test_the_kvtier_subscriber_reads_a_refusal_as_no_dump_and_recovers_once_one_is_allowed(clock: Clock) -> None:
    """The subscriber needs a dump (it joins past the replay buffer) while another peer's dump holds the only
    slot: the refusal reads as "publisher sent no state dump", so the stream is marked partial, never taken for
    an empty state; a dump asked once there is room brings it back in sync."""
    gate = threading.Event()

    def provider() -> tuple[int, Iterator[EventBatch]]:
        gate.wait(WAIT_S)
        return pub.last_seq, iter([batch(0)])

    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=1, dump_provider=provider,
                    threaded=False, max_dumps=1, clock=clock)
    hostile = dealer(pub)
    sub_clock = Clock()
    cfg = EndpointConfig("w0", pub.endpoint, pub.replay_endpoint, supports_dump=True)
    try:
        for i in range(3):  # seqs 0..2; the buffer keeps the last one only
            pub.publish(batch(i))
        hostile.send_multipart([b"", DUMP_REQUEST])
        deadline = time.monotonic() + WAIT_S
        while pub.replay_stats.dumps == 0 and time.monotonic() < deadline:
            pub.serve_requests(5)
        with Subscriber([cfg], clock=sub_clock) as sub:
            out: list[Delivery] = []

            def until(kind: type) -> None:
                while not any(isinstance(d, kind) for d in out) and time.monotonic() < deadline:
                    out.extend(sub.poll(5))
                    pub.serve_requests(0)
                assert any(isinstance(d, kind) for d in out), out

            until(ResyncNeeded)  # catch-up from 0 found seqs 0-1 gone, asked for a dump, was refused
            needed = [d for d in out if isinstance(d, ResyncNeeded)]
            assert [d.reason for d in needed] == ["publisher sent no state dump"], out
            assert not any(isinstance(d, ResyncDone) for d in out) and pub.replay_stats.dumps_refused == 1
            gate.set()
            got: list[bytes] = []
            while END_SEQ not in got and time.monotonic() < deadline:  # the hostile peer's dump ends
                pub.serve_requests(5)
                while hostile.poll(0):
                    got.append(hostile.recv_multipart()[2])
            assert got == [pack_seq(2), END_SEQ]
            sub_clock.now += 60.0  # past any resync backoff
            out.clear()
            out.extend(sub.request_resync(cfg.stream, "the consumer asks again"))
            until(ResyncDone)
            assert not sub.recovering(cfg.stream)
            assert pub.replay_stats.dumps_refused == 1
    finally:
        hostile.close()
        pub.close()


def test_kvtier_engine_passes_the_limits_to_its_publisher(tmp_path: Path) -> None:
    args = live.build_parser().parse_args([
        "--endpoint", "tcp://127.0.0.1:0", "--replay", "tcp://127.0.0.1:0", "--trace", "builtin:chat:2",
        "--dump-interval", "2.5", "--max-dumps", "3"])
    _, node, _, _ = live._open(args)
    try:
        assert node.publisher.dump_interval_s == 2.5 and node.publisher.max_dumps == 3
    finally:
        node.close()


def test_an_abandoned_dump_stops_its_builder(clock: Clock) -> None:
    """A peer that asks for a big dump and stops reading has its answer abandoned; the thread building the dump
    must stop too, not wait forever on its full queue holding encoded batches (else the limits above bound
    nothing: each such peer would leave a thread and its batches behind)."""

    big = EventBatch(ts=0.0, events=[BlockStored(block_hashes=list(range(1, 17)), token_ids=list(range(4096)),
                                                 block_size=256)])  # 12 KB encoded: ZMQ's queues fill soon

    builders: list[threading.Thread] = []

    def provider() -> tuple[int, Iterator[EventBatch]]:
        builders.append(threading.current_thread())  # (the builder's: it may be gone before the test looks for it)
        return pub.last_seq, (big for _ in range(20_000))

    # (the replay socket queues a few hundred messages per peer: 20,000 of 12 KB cannot all fit in it, the peer's
    # queue of 1 and the kernel's buffers, so a send finds the queue full)
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", dump_provider=provider, threaded=False, clock=clock,
                    buffer_size=8)
    pub.stuck_s = 0.0  # the first send that finds the peer's queue full abandons its answer
    reader = dealer(pub)
    reader.setsockopt(zmq.RCVHWM, 1)
    try:
        pub.publish(batch(0))
        reader.send_multipart([b"", DUMP_REQUEST])  # and never reads
        deadline = time.monotonic() + WAIT_S
        while pub.replay_stats.abandoned == 0 and time.monotonic() < deadline:
            pub.serve_requests(5)
        assert pub.replay_stats.abandoned == 1
        assert len(builders) == 1 and builders[0].name == "kv-dump"
        builders[0].join(WAIT_S)
        assert not builders[0].is_alive(), "the builder of an abandoned dump is still running"
    finally:
        reader.close()
        pub.close()


def test_a_peer_that_stops_reading_has_a_bounded_part_of_a_replay_queued() -> None:
    """A replay goes out as its peer reads: one that asks for the whole buffer and never reads has a bounded number
    of messages queued for it (ZMQ copies each), not the whole buffer per such peer (40 such peers grew an engine by
    half a gigabyte)."""
    payload = bytes(64 * 1024)
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", threaded=False, buffer_size=2_000)
    reader = dealer(pub)
    reader.setsockopt(zmq.RCVHWM, 1)
    try:
        for _ in range(2_000):
            pub.publish_payload(payload)
        reader.send_multipart([b"", pack_seq(0)])  # and never reads
        still, last = 0, -1
        deadline = time.monotonic() + WAIT_S
        while pub.replay_stats.messages == 0 and time.monotonic() < deadline:  # the request arrived, first answers
            pub.serve_requests(5)
        while still < 50 and time.monotonic() < deadline:  # until nothing more goes out
            pub.serve_requests(5)
            still, last = (still + 1 if pub.replay_stats.messages == last else 0), pub.replay_stats.messages
        # (what the peer's queue of 1 and the kernel's loopback buffers take, beside the publisher's own queue)
        assert 0 < pub.replay_stats.messages < 1_000
    finally:
        reader.close()
        pub.close()


def test_replay_requests_past_max_answers_wait_their_turn() -> None:
    """Each answer in progress holds memory (a replay, the buffer's payloads it still has to send): past
    ``max_answers`` requests stay in the socket's queue, to be taken as answers end, none lost.

    Three dumps whose provider waits on a gate fill the answers, so none can end while the replay requests
    queue behind them; a replay alone could end before the next request arrived, and the cap never be met."""
    gate = threading.Event()

    def provider() -> tuple[int, Iterator[EventBatch]]:
        gate.wait(WAIT_S)
        return pub.last_seq, iter([batch(0)])

    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", threaded=False, buffer_size=100, max_answers=3,
                    dump_provider=provider, dump_interval_s=0.0)
    reader = dealer(pub)
    try:
        for i in range(100):
            pub.publish(batch(i))
        for _ in range(3):
            reader.send_multipart([b"", DUMP_REQUEST])
        deadline = time.monotonic() + WAIT_S
        while pub.replay_stats.requests < 3 and time.monotonic() < deadline:
            pub.serve_requests(5)
        assert pub.replay_stats.requests == 3 and pub.answers_in_progress == 3
        for _ in range(7):
            reader.send_multipart([b"", pack_seq(0)])
        assert pub._router is not None and pub._router.poll(int(WAIT_S * 1000), zmq.POLLIN)  # one is queued
        for _ in range(20):
            pub.serve_requests(5)
            assert pub.replay_stats.requests == 3 and pub.answers_in_progress == 3
        gate.set()
        ends = 0
        while ends < 10 and time.monotonic() < deadline:
            pub.serve_requests(5)
            assert pub.answers_in_progress <= 3
            while reader.poll(0):
                ends += reader.recv_multipart()[2] == END_SEQ
        assert ends == 10 and pub.replay_stats.requests == 10 and pub.replay_stats.dumps == 3
        assert pub.replay_stats.messages == 3 * 2 + 7 * 101
    finally:
        gate.set()
        reader.close()
        pub.close()


def test_a_flood_of_malformed_replay_requests_is_logged_sparsely(caplog: pytest.LogCaptureFixture) -> None:
    pub = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", threaded=False)
    reader = dealer(pub)
    try:
        for _ in range(200):
            reader.send_multipart([b"", b"not a seq"])
        deadline = time.monotonic() + WAIT_S
        with caplog.at_level("WARNING", logger="kvtier.wire.transport.publisher"):
            while pub.replay_stats.malformed < 200 and time.monotonic() < deadline:
                pub.serve_requests(5)
        assert pub.replay_stats.malformed == 200
        assert len(caplog.records) == 10 and "200" not in caplog.records[-1].getMessage()
    finally:
        reader.close()
        pub.close()
