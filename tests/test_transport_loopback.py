"""Publisher and subscriber over real ZMQ sockets on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvtier.wire import (
    AllBlocksCleared,
    BlockStored,
    Delivery,
    EndpointConfig,
    EventBatch,
    MalformedFrame,
    Publisher,
    PublisherRestarted,
    Received,
    ResyncDone,
    ResyncNeeded,
    ResyncStarted,
    StreamId,
    Subscriber,
    WorkerId,
    decode_payload,
    pack_seq,
)
from kvtier.wire.frames import END_SEQ, unpack_seq
from tests.wire_vectors import load


def batch(i: int) -> EventBatch:
    return EventBatch(ts=float(i), events=[BlockStored(
        block_hashes=[i], parent_block_hash=None, token_ids=[i, i + 1], block_size=2, medium="GPU")],
        dp_rank=0)


def drain(sub: Subscriber, done: Callable[[list[Delivery]], bool], timeout: float = 5.0) -> list[Delivery]:
    out: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not done(out):
        out.extend(sub.poll(20))
    return out


def received(out: list[Delivery], stream: StreamId | None = None) -> list[int]:
    return [int(d.batch.ts) for d in out if isinstance(d, Received) and d.source != "dump"
            and (stream is None or d.stream == stream)]


def has_seqs(n: int, stream: StreamId | None = None) -> Callable[[list[Delivery]], bool]:
    return lambda out: len(received(out, stream)) >= n


@pytest.fixture
def pub() -> Iterator[Publisher]:
    p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=1000)
    yield p
    p.close()


def test_gaps_are_filled_by_replay(pub: Publisher) -> None:
    dropped = {3, 4, 10, 17, 18, 19}
    pub.live_filter = lambda s: s not in dropped
    with Subscriber([EndpointConfig("w0", pub.endpoint, pub.replay_endpoint)]) as sub:
        time.sleep(0.1)
        for i in range(30):
            pub.publish(batch(i))
        out = drain(sub, has_seqs(30))
        assert received(out) == list(range(30))
        st = sub.stats(StreamId(WorkerId("w0")))
        assert st.gaps >= 1 and st.gaps_filled == st.gaps and st.resyncs == 0


def test_slow_joiner_catches_up_from_zero(pub: Publisher) -> None:
    for i in range(5):  # published before anybody listens
        pub.publish(batch(i))
    with Subscriber([EndpointConfig("w0", pub.endpoint, pub.replay_endpoint)]) as sub:
        time.sleep(0.2)
        pub.publish(batch(5))
        assert received(drain(sub, has_seqs(6))) == list(range(6))


def test_replay_buffer_overrun_marks_stream_stale() -> None:
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=3) as p, \
            Subscriber([EndpointConfig("w0", p.endpoint, p.replay_endpoint)]) as sub:
        time.sleep(0.1)
        p.publish(batch(0))
        drain(sub, has_seqs(1))
        p.live_filter = lambda s: s >= 8  # seqs 1..7 lost live; the buffer holds 3
        for i in range(1, 10):
            p.publish(batch(i))
        out = drain(sub, lambda o: 9 in received(o))
        assert any(isinstance(d, ResyncNeeded) for d in out)
        assert received(out)[-1] == 9


def test_state_dump_resynchronises() -> None:
    state = EventBatch(ts=-1.0, events=[AllBlocksCleared()])
    holder: dict[str, Publisher] = {}
    p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=2,
                  dump_provider=lambda: (holder["p"].last_seq, [state]))
    holder["p"] = p
    cfg = EndpointConfig("w0", p.endpoint, p.replay_endpoint, supports_dump=True)
    with p, Subscriber([cfg]) as sub:
        time.sleep(0.1)
        p.publish(batch(0))
        drain(sub, has_seqs(1))
        p.live_filter = lambda s: s >= 6
        for i in range(1, 8):
            p.publish(batch(i))
        out = drain(sub, lambda o: 7 in received(o))
        kinds = [type(d).__name__ for d in out]
        assert kinds.index("ResyncStarted") < kinds.index("ResyncDone")
        dumps = [d for d in out if isinstance(d, Received) and d.source == "dump"]
        assert len(dumps) == 1 and dumps[0].batch == state
        done = next(d for d in out if isinstance(d, ResyncDone))
        assert all(s > done.seq for s in received(out)[1:] if s > 0)
        assert any(isinstance(d, ResyncStarted) for d in out)


def test_publisher_restart_is_reported() -> None:
    p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    ep, rep = p.endpoint, p.replay_endpoint
    with Subscriber([EndpointConfig("w0", ep, rep)]) as sub:
        time.sleep(0.1)
        for i in range(3):
            p.publish(batch(i))
        drain(sub, has_seqs(3))
        p.close()
        p2 = Publisher(ep, rep)
        try:
            out: list[Delivery] = []
            for i in range(100, 130):  # keep publishing: the SUB reconnects in the background
                p2.publish(batch(i))
                out += sub.poll(50)
                if 105 in received(out):
                    break
            assert any(isinstance(d, PublisherRestarted) for d in out), out
            got = received(out)
            assert got == list(range(100, got[-1] + 1))  # the new stream from its seq 0, nothing stale
        finally:
            p2.close()


def test_legacy_replay_frames_without_topic() -> None:
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", replay_with_topic=False) as p, \
            Subscriber([EndpointConfig("old", p.endpoint, p.replay_endpoint)]) as sub:
        time.sleep(0.1)
        p.live_filter = lambda s: s % 2 == 0
        for i in range(10):
            p.publish(batch(i))
        assert received(drain(sub, has_seqs(10))) == list(range(10))


def test_streams_are_independent() -> None:
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as a, \
            Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as b:
        sa, sb = StreamId(WorkerId("a")), StreamId(WorkerId("b"), 1)
        with Subscriber([EndpointConfig("a", a.endpoint, a.replay_endpoint),
                         EndpointConfig("b", b.endpoint, b.replay_endpoint, dp_rank=1)]) as sub:
            time.sleep(0.1)
            a.live_filter = lambda s: s != 2
            for i in range(6):
                a.publish(batch(i))
                b.publish(batch(10 + i))
            out = drain(sub, lambda o: len(received(o, sa)) == 6 and len(received(o, sb)) == 6)
            assert received(out, sa) == list(range(6))
            assert received(out, sb) == list(range(10, 16))


def test_malformed_frames_never_stop_the_subscriber() -> None:
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    good = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]], 0])
    bad_payloads = [
        b"\x93\xff\xff random",  # random bytes
        msgspec.msgpack.encode([1.0, [{"type": "Frobnicated"}], 0]),  # unknown tag
        good[:-2],  # truncated msgpack
    ]
    try:
        with Subscriber([EndpointConfig("w", f"tcp://127.0.0.1:{port}")]) as sub:
            time.sleep(0.3)
            seq = 0
            for p in bad_payloads:
                raw.send_multipart([b"kv", pack_seq(seq), p])
                seq += 1
            raw.send_multipart([b"kv", pack_seq(seq)])  # wrong frame count
            raw.send_multipart([b"kv", b"\x01\x02", good])  # 2-byte seq
            raw.send_multipart([b"kv", pack_seq(seq), good])
            out = drain(sub, lambda o: any(isinstance(d, Received) for d in o))
            bad = [d for d in out if isinstance(d, MalformedFrame)]
            assert len(bad) == 5, bad
            assert sub.stats(StreamId(WorkerId("w"))).malformed == 5
            assert any("frames" in d.reason for d in bad)
            assert [d.seq for d in out if isinstance(d, Received)] == [3]
    finally:
        raw.close(linger=0)


def test_captured_sglang_0517_stream_and_replay(shared_dir: Path) -> None:
    """Replays the captured 0.5.17 frames verbatim from raw sockets, replay answers included."""
    cap = load(shared_dir, "sglang-0.5.17")
    ctx = zmq.Context.instance()
    pubsock, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port = pubsock.bind_to_random_port("tcp://127.0.0.1")
    rport = router.bind_to_random_port("tcp://127.0.0.1")
    import base64
    answer = [[base64.b64decode(f) for f in fr] for fr in cap.data["replay_response"]]
    try:
        with Subscriber([EndpointConfig("w", f"tcp://127.0.0.1:{port}",
                                        f"tcp://127.0.0.1:{rport}", dp_rank=3)]) as sub:
            time.sleep(0.3)
            frames = [cap.frames(b) for b in cap.data["batches"]]
            ident, _, start = router.recv_multipart()  # the catch-up request sent on joining
            assert unpack_seq(start) == 0
            router.send_multipart([ident, b"", END_SEQ, b""])  # nothing published yet
            for fr in frames[:5]:
                pubsock.send_multipart(fr)
            pubsock.send_multipart(frames[6])  # seq 5 lost: the subscriber asks for replay from 5
            out = drain(sub, lambda o: any(isinstance(d, Received) for d in o) and router.poll(0))
            ident, empty, start = router.recv_multipart()
            assert empty == b"" and unpack_seq(start) == 5
            for fr in answer:
                router.send_multipart([ident, *fr])
            out += drain(sub, lambda o: sum(isinstance(d, Received) for d in o) >= 7)
            got = [(d.seq, d.batch) for d in out if isinstance(d, Received)]
            assert [s for s, _ in got] == list(range(7))
            assert got[5][1] == decode_payload(frames[5][2])
            assert answer[-1][-2] == END_SEQ
    finally:
        pubsock.close(linger=0)
        router.close(linger=0)
