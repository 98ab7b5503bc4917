"""Publisher and subscriber over real ZMQ sockets on loopback."""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

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
    encode_payload,
    pack_seq,
)
from kvtier.wire.transport.addresses import bind_address_error, connect_address_error
from kvtier.wire.transport.frames import END_SEQ, unpack_seq
from kvtier.wire.transport.recovery import Mode
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
    """Batches the live socket never carries are replayed as gaps. The drops start once the live socket has carried
    a batch and the join's catch-up is over: before that, a catch-up answer (or an idle probe) could carry every
    batch, and no gap be seen."""
    w0 = StreamId(WorkerId("w0"))
    with Subscriber([EndpointConfig("w0", pub.endpoint, pub.replay_endpoint)], probe_s=3600.0) as sub:
        out: list[Delivery] = []
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and (sub.recovering(w0) or not any(
                isinstance(d, Received) and d.source == "live" for d in out)):
            pub.publish(batch(pub.last_seq + 1))
            out += sub.poll(20)
        first = pub.last_seq + 1
        dropped = {first + k for k in (3, 4, 10, 17, 18, 19)}
        pub.live_filter = lambda s: s not in dropped
        for i in range(first, first + 30):
            pub.publish(batch(i))
        # A replay can deliver every batch before its answer's end marker arrives, and a gap counts as
        # filled at that marker: wait for the last one too (stopping at 30 batches made this test flaky).
        def settled(out: list[Delivery]) -> bool:
            st = sub.stats(w0)
            return has_seqs(first + 30)(out) and st.gaps_filled == st.gaps

        out += drain(sub, lambda more: settled(out + more))
        assert received(out) == list(range(first + 30))
        st = sub.stats(w0)
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


def oversized(i: int, n: int = 1 << 17) -> EventBatch:
    """A batch whose frame is about 0.6 MiB: past a 64 KiB ``max_frame_bytes``."""
    return EventBatch(ts=float(i), events=[BlockStored(
        block_hashes=list(range(1 << 40, (1 << 40) + n // 2)), parent_block_hash=None, token_ids=list(range(n)),
        block_size=2, medium="GPU")], dp_rank=0)


@pytest.mark.parametrize("dump", [False, True])
def test_a_frame_past_the_cap_is_never_taken_and_its_stream_recovers_or_is_marked_partial(dump: bool) -> None:
    """A frame past ``max_frame_bytes`` drops its connection unread; its batch is lost as a dropped one is. Replays of
    it fail the same way, so the recovery ends in a state dump (its batches small) where the engine has one, else in
    the stream marked partial; another publisher's stream is untouched. The streams' clock stands still until both
    have caught up at the start: a catch-up slower than the 0.3 s timeout (a loaded machine) would be given up, and
    the untouched stream counted a resync."""
    started: list[float] = []  # when the clock started

    def clock() -> float:
        return time.monotonic() - started[0] if started else 0.0

    state = EventBatch(ts=-1.0, events=[batch(99).events[0]])
    holder: dict[str, Publisher] = {}
    p = Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=100,
                  dump_provider=(lambda: (holder["p"].last_seq, [state])) if dump else None)
    holder["p"] = p
    w0, w1 = StreamId(WorkerId("w0")), StreamId(WorkerId("w1"))
    with p, Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0") as other, Subscriber(
            [EndpointConfig("w0", p.endpoint, p.replay_endpoint, supports_dump=dump),
             EndpointConfig("w1", other.endpoint, other.replay_endpoint)],
            replay_timeout_s=0.3, max_frame_bytes=1 << 16, clock=clock) as sub:
        time.sleep(0.1)
        p.publish(batch(0))
        other.publish(batch(0))
        drain(sub, lambda o: len(received(o)) == 2 and not sub.recovering(w0) and not sub.recovering(w1))
        started.append(time.monotonic())
        p.publish(oversized(1))
        for i in range(2, 5):
            p.publish(batch(i))
            other.publish(batch(i - 1))
        out = drain(sub, lambda o: any(isinstance(d, ResyncDone if dump else ResyncNeeded) for d in o)
                    and len(received(o, w1)) == 3)
        assert 1 not in received(out, w0)  # never delivered
        assert received(out, w1) == [1, 2, 3] and sub.stats(w1).resyncs == 0
        assert sub.stats(w0).disconnects >= 1 and sub.stats(w1).disconnects == 0  # (the drop is counted)
        if dump:
            dumped = [e for d in out if isinstance(d, Received) and d.source == "dump" for e in d.batch.events]
            assert [e.block_hashes for e in dumped if isinstance(e, BlockStored)] == [[99]]
        else:
            assert any(isinstance(d, ResyncNeeded) and d.stream == w0 for d in out)
        # libzmq never connects a socket again after a frame past its cap (a protocol error): later batches come
        # live only once the subscriber has connected it anew. One a while, until one does (the new connection's
        # subscription may miss the first: ZMQ's slow joiner); replays would fill in without a live socket.
        later: list[Delivery] = []
        i, deadline = 5, time.monotonic() + 30
        while not live(later, w0) and time.monotonic() < deadline:
            p.publish(batch(i))
            i += 1
            later.extend(drain(sub, lambda o: bool(live(o, w0)), timeout=0.5))
        assert live(later, w0), "no live batch of w0 after its connection was dropped for a frame past the cap"


def live(out: list[Delivery], stream: StreamId) -> list[int]:
    """The batches of ``stream`` in ``out`` that came over the live socket."""
    return [int(d.batch.ts) for d in out if isinstance(d, Received) and d.source == "live" and d.stream == stream]


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
            i, deadline = 100, time.monotonic() + 10.0
            while 105 not in received(out) and time.monotonic() < deadline:  # the SUB reconnects in the background
                p2.publish(batch(i))
                i += 1
                out += sub.poll(50)
            assert any(isinstance(d, PublisherRestarted) for d in out), out
            got = received(out)
            assert got == list(range(100, got[-1] + 1))  # the new stream from its seq 0, nothing stale
        finally:
            p2.close()


class _Process:
    """A publisher process by hand: an XPUB socket (it sees each subscription arrive) and a ROUTER answering replay
    requests from ``payloads`` (seq -> payload), at given ports or free ones."""

    def __init__(self, payloads: dict[int, bytes], port: int = 0, rport: int = 0) -> None:
        ctx = zmq.Context.instance()
        self.payloads = payloads
        self.pub, self.router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
        self.port, self.rport = self._bind(self.pub, port), self._bind(self.router, rport)

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], port: int) -> int:
        if not port:
            return sock.bind_to_random_port("tcp://127.0.0.1")
        deadline = time.monotonic() + 10.0
        while True:  # (the port of a process just closed: ZMQ lets go of it on a thread of its own)
            try:
                sock.bind(f"tcp://127.0.0.1:{port}")
                return port
            except zmq.ZMQError as exc:
                assert exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline, exc
                time.sleep(0.05)

    def subscribed(self) -> None:
        """Waits until a subscriber's subscription arrived: what it sends from now on is not dropped."""
        assert self.pub.poll(10_000), "no subscriber connected"
        assert self.pub.recv().startswith(b"\x01")

    def send(self, seq: int) -> None:
        self.pub.send_multipart([b"kv", pack_seq(seq), self.payloads[seq]])

    def answer(self) -> None:
        """Answers the replay requests waiting: each seq held from the one asked, then the end marker."""
        while self.router.poll(0):
            ident, _, request = self.router.recv_multipart()
            for seq in sorted(q for q in self.payloads if q >= unpack_seq(request)):
                self.router.send_multipart([ident, b"", b"kv", pack_seq(seq), self.payloads[seq]])
            self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


def test_a_restarted_publishers_batch_is_not_taken_before_its_disconnect() -> None:
    """A publisher restarts while the subscriber drains a backlog: the disconnect's event comes after the poll that
    found the backlog, and the new process's batches 0-2 are lost while the SUB reconnects. Its batch 3 is the seq the
    old stream expects next: taken before the disconnect, it would pass for the old process's next batch (the check
    the disconnect asks for would compare it with itself, and the old process's blocks stay indexed). Forced: the
    poll that finds batch 3 misses the monitor's events. A live message is taken after its connection's events, so
    the check finds the publisher's batch 2 changed: a new process, its stream taken from 0."""
    old = _Process({i: encode_payload(batch(i)) for i in range(3)})
    new: _Process | None = None
    try:
        cfg = EndpointConfig("w0", f"tcp://127.0.0.1:{old.port}", f"tcp://127.0.0.1:{old.rport}")
        with Subscriber([cfg]) as sub:
            old.subscribed()
            for seq in range(3):
                old.send(seq)
            out: list[Delivery] = []
            deadline = time.monotonic() + 10.0
            while received(out) != [0, 1, 2]:
                assert time.monotonic() < deadline, out
                out += sub.poll(20)
                old.answer()
            old.close()
            new = _Process({i: encode_payload(batch(100 + i)) for i in range(4)}, old.port, old.rport)
            conn = sub._conns[cfg.stream]
            # A call on the SUB socket alone (a backlog's messages taken) hands it the reconnected pipe, and its
            # subscription goes out again; the monitor's events stay unread.
            deadline = time.monotonic() + 10.0
            while not new.pub.poll(20):
                assert time.monotonic() < deadline, "the SUB never reconnected"
                conn.sub.get(zmq.EVENTS)
            new.subscribed()
            new.send(3)
            assert zmq.select([conn.sub], [], [], 10.0)[0], "batch 3 never reached the SUB socket"
            assert conn.monitor.poll(0), "the disconnect's event is waiting"
            real_poll = sub._poller.poll
            sub._poller.poll = lambda timeout=None: [(conn.sub, zmq.POLLIN)]  # type: ignore[method-assign]
            out = sub.poll(20)  # the poll that found batch 3 and not (yet) the monitor's events
            sub._poller.poll = real_poll  # type: ignore[method-assign]
            deadline = time.monotonic() + 10.0
            while len(received(out)) < 4:
                assert time.monotonic() < deadline, out
                out += sub.poll(20)
                new.answer()
            assert any(isinstance(d, PublisherRestarted) for d in out), out
            assert received(out) == [100, 101, 102, 103]  # the new process's batches from its seq 0, nothing stale
    finally:
        old.close()
        if new is not None:
            new.close()


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
    raw = ctx.socket(zmq.XPUB)  # (a PUB that hears the subscription: frames sent before it would be dropped)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    good = msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]], 0])
    bad_payloads = [
        b"\x93\xff\xff random",  # random bytes
        msgspec.msgpack.encode([1.0, [{"type": "Frobnicated"}], 0]),  # unknown tag
        good[:-2],  # truncated msgpack
    ]
    try:
        with Subscriber([EndpointConfig("w", f"tcp://127.0.0.1:{port}")]) as sub:
            assert raw.poll(10_000) and raw.recv()[:1] == b"\x01"  # subscribed
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
    pubsock, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)  # (XPUB: it hears the subscription)
    port = pubsock.bind_to_random_port("tcp://127.0.0.1")
    rport = router.bind_to_random_port("tcp://127.0.0.1")
    import base64
    answer = [[base64.b64decode(f) for f in fr] for fr in cap.data["replay_response"]]
    try:
        with Subscriber([EndpointConfig("w", f"tcp://127.0.0.1:{port}",
                                        f"tcp://127.0.0.1:{rport}", dp_rank=3)]) as sub:
            assert pubsock.poll(10_000) and pubsock.recv()[:1] == b"\x01"  # subscribed
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


# --- replay at scale (a late subscriber, lossy replay sockets, dumps beside replays) ------------


def big_batch(i: int, tokens: int = 1024) -> EventBatch:
    """A batch the size of a real one (blocks of 64 tokens), so socket buffers cannot hide drops."""
    n = tokens // 64
    return EventBatch(ts=float(i), events=[BlockStored(
        block_hashes=list(range(i * n, i * n + n)), parent_block_hash=None,
        token_ids=list(range(100_000, 100_000 + tokens)), block_size=64, medium="GPU")], dp_rank=0)


def test_late_subscriber_gets_10000_batches_by_replay() -> None:
    """The whole default buffer reaches a subscriber that joins late and reads slowly (an event loop
    busy applying): nothing is dropped at a high-water mark."""
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_size=10_000) as p:
        for i in range(10_000):
            p.publish(big_batch(i))
        with Subscriber([EndpointConfig("w0", p.endpoint, p.replay_endpoint)]) as sub:
            time.sleep(1.0)  # the request went out at once; nobody reads the answer for a while
            out = drain(sub, has_seqs(10_000), timeout=60.0)
            assert received(out) == list(range(10_000))
            st = sub.stats(StreamId(WorkerId("w0")))
            assert st.resyncs == 0 and not any(isinstance(d, ResyncNeeded) for d in out)
            assert p.replay_stats.abandoned == 0


class LossyReplayPublisher:
    """A publisher whose replay socket loses the tail of an answer, as SGLang's and vLLM's do: a ROUTER without
    ROUTER_MANDATORY sends a whole answer in one loop, and ZMQ silently drops every frame past its high-water mark
    (the end marker included). Whether a real socket drops depends on how fast the reader drains it, so the loss is
    forced here: answer ``i`` stops after ``cuts[i]`` batches (later answers are whole), on a socket with no
    high-water mark that drops nothing by itself. ``starts``: the seq each request asked from."""

    def __init__(self, n: int, cuts: list[int]) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer = [(s, encode_payload(big_batch(s, tokens=256))) for s in range(n)]
        self.cuts = list(cuts)
        self.starts: list[int] = []
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            if not self.router.poll(20):
                continue
            ident, _, start = self.router.recv_multipart()
            first = unpack_seq(start)
            cut = self.cuts[len(self.starts)] if len(self.starts) < len(self.cuts) else None
            self.starts.append(first)
            answer = [(seq, payload) for seq, payload in self.buffer if seq >= first]
            for seq, payload in answer[:cut]:
                self.router.send_multipart([ident, b"", b"kv", pack_seq(seq), payload])
            if cut is None:
                self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)


def test_subscriber_reasks_a_lossy_replay_socket_until_it_has_everything() -> None:
    """Each answer that lost its tail is asked again from the first seq missing, until one is whole: nothing is
    delivered twice, nothing lost, and no resync (the publisher still holds every batch)."""
    lossy = LossyReplayPublisher(3_000, cuts=[1_200, 0, 900])
    try:
        cfg = EndpointConfig("w0", f"tcp://127.0.0.1:{lossy.port}", f"tcp://127.0.0.1:{lossy.rport}")
        with Subscriber([cfg]) as sub:
            out = drain(sub, has_seqs(3_000), timeout=60.0)
            assert received(out) == list(range(3_000))
            st = sub.stats(StreamId(WorkerId("w0")))
            assert st.resyncs == 0 and not any(isinstance(d, ResyncNeeded) for d in out)
            # The catch-up from 0 lost all past 1,200; the re-ask from 1,200 lost everything (a try without
            # progress, not a re-ask); the next lost all past 2,100; the last was whole.
            assert lossy.starts == [0, 1_200, 1_200, 2_100]
            assert st.reasks == 2
    finally:
        lossy.close()


def test_replays_are_served_while_a_slow_dump_is_built_and_a_failing_dump_leaves_no_end() -> None:
    gate = threading.Event()
    calls = [0]

    def slow_dump() -> tuple[int, Iterator[EventBatch]]:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("provider broke")
        gate.wait(5.0)  # a large engine still building its snapshot
        return 0, iter([EventBatch(ts=-1.0, events=[AllBlocksCleared()])])

    # (one peer asks for two dumps in a row: no interval between them here, tests/test_dump_limit.py has it)
    with Publisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", dump_provider=slow_dump, dump_interval_s=0) as p:
        p.publish(batch(0))
        ctx = zmq.Context.instance()
        dumper, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        try:
            for s in (dumper, other):
                s.connect(p.replay_endpoint or "")
            dumper.send_multipart([b"", b"DUMP"])
            time.sleep(0.1)
            other.send_multipart([b"", pack_seq(0)])  # another indexer's probe, behind the dump
            assert other.poll(2000), "a replay request waited for a dump being built"
            assert [other.recv_multipart()[2] for _ in range(2)] == [pack_seq(0), END_SEQ]
            gate.set()
            assert dumper.poll(2000)
            assert dumper.recv_multipart()[2] == pack_seq(0)
            assert dumper.recv_multipart()[2] == END_SEQ
            dumper.send_multipart([b"", b"DUMP"])  # the provider raises: no end marker, no dead thread
            assert not dumper.poll(500)
            other.send_multipart([b"", pack_seq(0)])
            assert other.poll(2000) and p.replay_stats.dump_errors == 1
        finally:
            dumper.close(0)
            other.close(0)


def test_unanswered_idle_probe_changes_nothing() -> None:
    """A probe that times out (the publisher busy with another client's dump) clears nothing."""
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)  # a router that never answers
    port, rport = pub.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1")
    try:
        cfg = EndpointConfig("w0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        with Subscriber([cfg], replay_timeout_s=0.2) as sub:
            conn = sub._conns[cfg.stream]
            conn.tracker.probe_s = 0.1
            conn.tracker.expected = 5  # as if seqs 0..4 had been applied
            conn.tracker._recovery.mode = Mode.LIVE  # (the catch-up from seq 0 abandoned)
            conn.tracker._recovery.replay.done()
            out = drain(sub, lambda o: False, timeout=1.5)
            st = sub.stats(cfg.stream)
            assert st.probe_timeouts >= 2 and st.resyncs == 0
            assert not any(isinstance(d, ResyncNeeded | ResyncStarted) for d in out)
    finally:
        pub.close(0)
        router.close(0)


@pytest.mark.parametrize("address,connect,bind", [
    ("tcp://127.0.0.1:5557", True, True),
    ("tcp://[::1]:5557", True, True),
    ("tcp://engine-0.engines.svc.cluster.local:5557", True, True),
    ("tcp://*:5557", False, True),  # every interface: a bind's, nothing to connect to
    ("tcp://127.0.0.1:0", False, True),  # a free port: bind only
    ("tcp://127.0.0.1:*", False, True),
    ("tcp://127.0.0.1:99999", False, False),  # ZMQ takes it as port 34463
    ("tcp://127.0.0.1", False, False),
    ("tcp://[::1:5557", False, False),
    ("tcp://a b:5557", False, False),
    ("ipc:///tmp/kvtier.sock", True, True),
    ("ipc:///" + "x" * 107, False, False),  # past a Unix socket path's 107 bytes
    ("inproc://events", True, True),
    ("inproc://", False, False),
    ("http://127.0.0.1:5557", False, False),
    ("127.0.0.1:5557", False, False),
])
def test_addresses_are_checked_before_zmq_sees_them(address: str, connect: bool, bind: bool) -> None:
    assert (connect_address_error(address) is None) == connect
    assert (bind_address_error(address) is None) == bind


def test_zmq_takes_a_port_past_65535_as_another_one() -> None:
    """Why the checks above exist: ZMQ binds port 70000 as 4464 (70000 - 65536) without a word. Should it ever
    refuse such a port itself, the checks only say so earlier."""
    sock = zmq.Context.instance().socket(zmq.PUB)
    try:
        sock.bind("tcp://127.0.0.1:70000")
        assert sock.getsockopt_string(zmq.LAST_ENDPOINT) == "tcp://127.0.0.1:4464"
    except zmq.ZMQError as exc:  # port 4464 is busy on this machine, or ZMQ refuses now
        pytest.skip(f"ZMQ did not bind port 70000 as 4464: {exc}")
    finally:
        sock.close(linger=0)
    with pytest.raises(ValueError, match=r"port in 0\.\.65535"):
        Publisher("tcp://127.0.0.1:70000")


class _ByHand:
    """A PUB and a ROUTER socket on loopback as a publisher, and a subscriber's clock moved on by hand: each round
    sends a frame (if given), moves the clock ``step`` on, polls once, and answers every replay request or probe with
    the end marker (nothing past what was published live) while ``answering``."""

    def __init__(self, step: float) -> None:
        ctx = zmq.Context.instance()
        self.pub, self.router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        port, rport = self.pub.bind_to_random_port("tcp://127.0.0.1"), self.router.bind_to_random_port("tcp://127.0.0.1")
        self.cfg = EndpointConfig("w0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}")
        self.now, self.step, self.answering = 0.0, step, True

    def clock(self) -> float:
        return self.now

    def rounds(self, sub: Subscriber, n: int, send: list[bytes] | None = None) -> list[Delivery]:
        out: list[Delivery] = []
        for _ in range(n):
            if send is not None:
                self.pub.send_multipart(send)
            self.now += self.step
            out += sub.poll(20)
            while self.answering and self.router.poll(0):
                ident, _, _ = self.router.recv_multipart()
                self.router.send_multipart([ident, b"", b"", END_SEQ, b""])
        return out

    def connect(self, sub: Subscriber) -> None:
        """Batch 0, sent again and again until the SUB socket is connected and delivers it (duplicates after)."""
        out: list[Delivery] = []
        for _ in range(250):
            out += self.rounds(sub, 1, [b"kv", pack_seq(0), encode_payload(batch(0))])
            if received(out):
                break
        assert received(out) == [0]

    def close(self) -> None:
        self.pub.close(0)
        self.router.close(0)


def test_a_seq_no_probe_could_follow_is_refused_and_the_stream_goes_on() -> None:
    """A live batch numbered 2**63 - 1 (or below 0) from a PUB socket the indexer subscribes to: a probe or a replay
    could never ask for the seq after it (8 signed bytes): asking would raise ``struct.error`` in the event loop's
    idle probe. It is a malformed frame: counted, the stream's state untouched, and the batches after it are taken
    as before."""
    hand = _ByHand(step=2.0)  # (every idle probe falls due)
    try:
        with Subscriber([hand.cfg], clock=hand.clock) as sub:
            hand.connect(sub)
            for hostile in (2**63 - 1, -5):
                hand.pub.send_multipart([b"kv", struct.pack(">q", hostile), encode_payload(batch(1))])
            out = hand.rounds(sub, 10)
            bad = [d for d in out if isinstance(d, MalformedFrame)]
            assert len(bad) == 2 and all("seq" in d.reason for d in bad), bad
            assert not any(isinstance(d, ResyncNeeded | ResyncStarted) for d in out)
            hand.pub.send_multipart([b"kv", pack_seq(1), encode_payload(batch(1))])
            out = hand.rounds(sub, 5)
            assert received(out) == [1]
            assert sub.stats(hand.cfg.stream).malformed == 2
    finally:
        hand.close()


def _next_request(hand: _ByHand, sub: Subscriber) -> bytes:
    """Rounds until a request (a probe, or one asked again) reaches the publisher, unanswered: its sender's
    identity."""
    for _ in range(50):
        hand.rounds(sub, 1)
        if hand.router.poll(100):
            ident, _, _ = hand.router.recv_multipart()
            return cast(bytes, ident)
    raise AssertionError("no request reached the publisher")


@pytest.mark.timeout(60)  # (a send on a socket without a connection blocks for ever: the failure is a hang)
def test_a_replay_socket_zmq_dropped_for_good_is_replaced_not_written_to() -> None:
    """A frame past ``max_frame_bytes`` on the replay socket (here an unsolicited one, after an answer has ended)
    makes libzmq drop that connection for good, and a socket with no connection left blocks whoever sends on it: the
    next idle probe held the event loop for ever. It goes out on a new socket."""
    hand = _ByHand(step=2.0)  # (every idle probe falls due)
    try:
        with Subscriber([hand.cfg], clock=hand.clock, max_frame_bytes=1 << 16) as sub:
            hand.connect(sub)
            hand.answering = False
            ident = _next_request(hand, sub)
            hand.router.send_multipart([ident, b"", b"", END_SEQ, b""])  # the probe answered: nothing pending
            conn = sub._conns[hand.cfg.stream]
            deadline = time.monotonic() + 10  # (the answer taken before the frame that drops the connection comes)
            while conn.tracker._recovery.mode is not Mode.LIVE and time.monotonic() < deadline:
                sub.poll(20)
            assert conn.tracker._recovery.mode is Mode.LIVE, "the probe's answer was not taken"
            hand.router.send_multipart([ident, b"", b"", pack_seq(1), b"x" * (1 << 17)])  # a frame past the cap
            dealer = conn.dealer
            assert dealer is not None
            deadline = time.monotonic() + 10  # (forced: the connection gone before the next probe is sent)
            while cast(int, dealer.get(zmq.EVENTS)) & zmq.POLLOUT and time.monotonic() < deadline:
                sub.poll(20)
            assert not cast(int, dealer.get(zmq.EVENTS)) & zmq.POLLOUT, "the replay connection was not dropped"
            assert _next_request(hand, sub) != ident  # the next idle probe, on a new socket
    finally:
        hand.close()


def test_a_live_socket_that_fails_its_handshakes_is_connected_again_with_a_thinned_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """Live and replay addresses swapped: the SUB socket's handshake with a ROUTER fails on socket type, a protocol
    error after which libzmq never connects again, as after a frame past the cap. It is connected again after each
    grace period (the peer may be fixed), and its log line, which names both causes, is thinned as other repeating
    faults' are."""
    from kvtier.util.ratelog import FIRST
    from kvtier.wire.transport.subscriber import RECONNECT_GRACE_S

    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, rport = pub.bind_to_random_port("tcp://127.0.0.1"), router.bind_to_random_port("tcp://127.0.0.1")
    now = [0.0]
    cfg = EndpointConfig("w0", f"tcp://127.0.0.1:{rport}", f"tcp://127.0.0.1:{port}")  # swapped
    try:
        with caplog.at_level(logging.WARNING, "kvtier.wire.transport.subscriber"), \
                Subscriber([cfg], clock=lambda: now[0]) as sub:
            deadline = time.monotonic() + 30
            while sub.stats(cfg.stream).disconnects < FIRST + 5 and time.monotonic() < deadline:
                sub.poll(20)
                now[0] += RECONNECT_GRACE_S / 2
            assert sub.stats(cfg.stream).disconnects >= FIRST + 5, "the live socket was not connected again"
            lines = [r.getMessage() for r in caplog.records if "will not make it again" in r.getMessage()
                     and "replay" not in r.getMessage()]
            assert len(lines) == FIRST and "or a peer that is no ZMQ publisher" in lines[0], lines
    finally:
        pub.close(0)
        router.close(0)


def test_time_the_owner_spends_away_from_polling_is_no_silence() -> None:
    """The indexer's event loop stops polling while it applies what a poll returned or writes a snapshot (seconds,
    for a large index): a quiet publisher cannot be probed then, so the part of an absence past the probes' interval
    is no silence (every worker was listed dead for most of each snapshot) and no wait for a replay's answer. Silence
    while polling still counts, and so do absences shorter than the probes' interval: a loop kept busy by other
    streams still finds a gone publisher."""
    hand = _ByHand(step=0.5)
    try:
        with Subscriber([hand.cfg], clock=hand.clock, probe_s=1.0) as sub:
            hand.connect(sub)
            hand.rounds(sub, 4)
            assert not sub.silent(5.0)
            with sub.away():  # a snapshot of 60 s
                hand.now += 60.0
                assert not sub.silent(5.0)
            assert not sub.silent(5.0)
            out = hand.rounds(sub, 4)
            assert not sub.silent(5.0) and not any(isinstance(d, ResyncNeeded) for d in out)
            hand.answering = False  # the publisher's replay socket goes quiet: silence counts while polling
            hand.rounds(sub, 12)
            assert sub.silent(5.0) == {hand.cfg.stream}
            hand.answering = True
            hand.rounds(sub, 4)
            assert not sub.silent(5.0)
            hand.answering = False  # and while the loop is busy, away for most of each round but never long
            for _ in range(8):
                with sub.away():
                    hand.now += 0.9
                hand.rounds(sub, 1)
            assert sub.silent(5.0) == {hand.cfg.stream}
    finally:
        hand.close()
