"""ZMQ event subscriber: one SUB socket and one DEALER replay client per publisher.

Frames are parsed here and handed to a :class:`indexer.stream.StreamTracker` per
stream, which orders them, asks for replay or a state dump when something was
lost, and turns them into :data:`indexer.stream.Delivery` items for the consumer.

A frame larger than ``max_frame_bytes`` is never taken into memory: ZMQ drops the connection that carries it
(``ZMQ_MAXMSGSIZE``). libzmq takes that for a protocol error and, unlike a connection lost, never connects that
socket again (4.3): a live socket dropped with no reconnect under way within :data:`RECONNECT_GRACE_S` is connected
again here, and a replay socket found with no connection to send on is replaced. What the frame carried is then lost
like any dropped batch: the gap is replayed, and a replay that keeps failing (the same frame, too large again) ends
in a state dump (a kvtier engine cuts its dumps into batches far smaller), or, from an engine without dumps, in the
worker marked partial.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.notices import Delivery, StreamId, StreamStats
from kvtier.wire.protocol import ROLES, WorkerId
from kvtier.wire.transport.addresses import connect_address_error
from kvtier.wire.transport.frames import unpack_seq
from kvtier.wire.transport.stream import StreamTracker

log = logging.getLogger(__name__)

_REPLAY_HWM = 200_000  # replay frames queued on the subscriber side before ZMQ pushes back
MAX_FRAME_BYTES = 64 << 20  # the default cap on one frame (a publisher's batch of events)
#: Seconds of silence after which TCP keepalive drops a live socket's connection whose peer host no longer answers
#: (a second idle, then a probe a second, the last unanswered).
TCP_KEEPALIVE_S = 5
#: Seconds after a live socket's connection dropped by which libzmq has said it reconnects (it says so at once, as it
#: arms its reconnect timer); past them with no word the socket is connected again here (see the module's text).
RECONNECT_GRACE_S = 2.0


#: The live socket's connection events watched: a handshake, a connection lost, libzmq arming its reconnect.
_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED

#: The engines an endpoint may name (EndpointConfig.engine).
ENGINES = ("sglang", "vllm", "kvtier")


#: Data-parallel ranks an endpoint may carry: far past any deployment's.
MAX_DP_RANK = 65_535


@dataclass(slots=True, frozen=True)
class EndpointConfig:
    """Where one engine stream publishes."""

    worker: str  # worker id used by the index and the router
    endpoint: str  # PUB endpoint, e.g. "tcp://10.0.0.5:5557"
    replay_endpoint: str | None = None  # ROUTER replay endpoint; None disables gap filling
    dp_rank: int = 0  # data-parallel rank this endpoint carries
    supports_dump: bool = False  # answers state-dump requests (kvtier engines only)
    topic: bytes = b""  # SUB prefix filter; b"" takes every topic
    # The engine publishing here: sglang, vllm or kvtier (what its cache promises, kvtier.indexer.service.config
    # .ENGINE_CLOSED_TIERS); None: kvtier where it answers dumps, else nothing promised
    engine: str | None = None
    # What it serves in a disaggregated pool: "prefill", "decode" or "both" (aggregated; kvtier.indexer.routing.disagg)
    role: str = "both"

    def __post_init__(self) -> None:
        if not self.worker:
            raise ValueError("the worker id is empty")
        if isinstance(self.dp_rank, bool) or not isinstance(self.dp_rank, int) or not 0 <= self.dp_rank <= MAX_DP_RANK:
            raise ValueError(f"dp_rank {self.dp_rank!r}: expected an integer in [0, {MAX_DP_RANK}]")
        for address in (self.endpoint, self.replay_endpoint):
            if address is not None and (wrong := connect_address_error(address)):
                raise ValueError(f"{address!r}: {wrong}")
        if self.replay_endpoint == self.endpoint:
            # One address cannot be both a PUB and a ROUTER socket: replay requests would never be answered.
            raise ValueError(f"the replay endpoint is the live one ({self.endpoint!r}): the publisher binds two")
        if self.engine not in (None, *ENGINES):
            raise ValueError(f"engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r}: expected one of {', '.join(ROLES)}")
        if self.supports_dump and self.replay_endpoint is None:
            # (no endpoint named here: the callers' messages name the one they were given)
            raise ValueError("a state dump is asked on the replay socket: no dump without a replay endpoint")

    @property
    def stream(self) -> StreamId:
        return StreamId(WorkerId(self.worker), self.dp_rank)


@dataclass(slots=True)
class _Conn:
    config: EndpointConfig  # what it connects to
    tracker: StreamTracker  # ordering state
    sub: zmq.Socket[bytes]  # live socket
    dealer: zmq.Socket[bytes] | None  # replay client
    monitor: zmq.Socket[bytes]  # connection events of `sub`: a publisher's handshake, a lost connection
    reached: bool = False  # `sub` completed a handshake with the publisher once
    told_unreached: bool = False  # the log said the publisher was never reached (once)
    dropped_at: float | None = None  # when `sub` lost its connection, while libzmq has not said it reconnects
    renewed: list[int] = field(default_factory=lambda: [0, 0])  # connections made again here: live, replay


class Subscriber:
    """Receives from many publishers; :meth:`poll` returns deliveries in per-stream order.

    Not thread-safe: call it from one thread (the indexer's event loop).
    """

    def __init__(
        self,
        endpoints: list[EndpointConfig] | None = None,
        *,
        replay_timeout_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        resume: dict[StreamId, tuple[int, int | None]] | None = None,
        probe_s: float = 1.0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        """``probe_s``: a stream quiet this long is probed (:class:`StreamTracker`), which also tells a quiet
        publisher from a gone one (:meth:`silent`). ``max_frame_bytes``: the largest frame taken (see the
        module's text)."""
        self._ctx = context or zmq.Context.instance()
        self._max_frame = max_frame_bytes
        self._timeout = replay_timeout_s
        self._probe_s = probe_s
        self._clock = clock
        # The streams' clock is ``clock`` less the part of each absence from polling past ``probe_s`` (:meth:`away`):
        # those parts summed, and when the owner left (None while it is not away). Written by the owner's thread, read
        # by others (:meth:`silent`): ``_away`` grows before ``_left`` is cleared, and :meth:`_now` reads ``_left``
        # first, so a reader never counts an absence as silence.
        self._away = 0.0
        self._left: float | None = None
        self._conns: dict[StreamId, _Conn] = {}
        self._by_socket: dict[zmq.Socket[bytes], _Conn] = {}
        self._poller = zmq.Poller()
        for cfg in endpoints or []:
            self.add_endpoint(cfg, resume=(resume or {}).get(cfg.stream))

    @property
    def streams(self) -> list[StreamId]:
        return list(self._conns)

    def stats(self, stream: StreamId) -> StreamStats:
        return self._conns[stream].tracker.stats

    def recovering(self, stream: StreamId) -> bool:
        """A catch-up, full replay or dump of ``stream`` is under way. O(1)."""
        return self._conns[stream].tracker.recovering

    def _now(self) -> float:
        """The streams' clock: ``clock`` less the part of each absence from polling past ``probe_s``; it stands
        still from ``probe_s`` into an absence until the owner is back. O(1)."""
        left, now = self._left, self._clock()
        if left is not None:
            now = min(now, left + self._probe_s)
        return now - self._away

    @contextlib.contextmanager
    def away(self) -> Iterator[None]:
        """The owner stops polling for a while (applying what a poll returned, writing a snapshot). A quiet
        publisher is heard only by answering the idle probes, which go out from :meth:`poll` alone: an absence longer
        than the probes' interval kept it from being asked, so the part past ``probe_s`` counts as no silence
        (:meth:`silent`), no wait for a replay's answer and no idle time. Shorter absences count in full, so a
        loop that is never long away (busy, polling between batches) still finds a gone publisher in time. O(1)."""
        assert self._left is None, "away() does not nest (the inner absence would be excused twice)"
        left = self._left = self._clock()
        try:
            yield
        finally:
            self._away += max(0.0, self._clock() - left - self._probe_s)
            self._left = None

    def silent(self, timeout_s: float) -> set[StreamId]:
        """Streams whose publisher sent nothing, no batch and no answer, for ``timeout_s`` of the streams' clock (the
        owner's long absences from polling count up to ``probe_s``: :meth:`away`; :meth:`StreamTracker.silent`).
        O(streams)."""
        now = self._now()
        # (read from the service's HTTP thread: a copy of the items, taken at once, while the loop's thread may close)
        return {s for s, conn in list(self._conns.items()) if conn.tracker.silent(now, timeout_s)}

    def positions(self) -> dict[StreamId, tuple[int, int | None]]:
        """Each in-sync stream's :meth:`StreamTracker.position` (for a snapshot of the consumer). O(streams)."""
        out = {}
        for s, conn in self._conns.items():
            pos = conn.tracker.position()
            if pos is not None:
                out[s] = pos
        return out

    def add_endpoint(self, cfg: EndpointConfig, resume: tuple[int, int | None] | None = None) -> None:
        """Connect to a publisher; with ``resume`` (a saved position) continue after it instead of
        catching up from seq 0. Raises ``ValueError`` if its stream is already connected."""
        if cfg.stream in self._conns:
            raise ValueError(f"stream {cfg.stream} is already subscribed")
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        sub.setsockopt(zmq.SUBSCRIBE, cfg.topic)
        # TCP keepalive: a publisher whose host vanishes without closing the connection (power lost, a partition)
        # stops answering the kernel's probes, and the connection is dropped within some TCP_KEEPALIVE_S seconds of
        # silence; StreamTracker.silent takes a connected stream for up, and without keepalive TCP may keep such a
        # connection for hours. Not ZMTP heartbeats: a SUB socket whose receive queue is full stops reading, misses
        # the answers to its heartbeats, drops a live publisher, and libzmq 4.3 aborts the process on the reconnect
        # (zeromq/libzmq#3937). A hung process on a live host keeps its connection either way.
        sub.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sub.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 1)
        sub.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 1)
        sub.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_S - 1)
        # (monitored before it connects: a publisher already up may complete its handshake at once, unseen)
        monitor = sub.get_monitor_socket(_WATCHED)
        sub.connect(cfg.endpoint)
        tracker = StreamTracker(cfg.stream, can_replay=cfg.replay_endpoint is not None,
                                can_dump=cfg.supports_dump, timeout_s=self._timeout, probe_s=self._probe_s)
        conn = _Conn(cfg, tracker, sub, self._new_dealer(cfg), monitor)
        self._conns[cfg.stream] = conn
        self._register(conn)
        if resume is not None:
            tracker.resume(resume, self._now())
        else:
            tracker.start(self._now())
        self._flush(conn)

    def remove_endpoint(self, stream: StreamId) -> None:
        """Disconnect a stream; its pending messages are discarded."""
        conn = self._conns.pop(stream)
        conn.sub.disable_monitor()
        for sock in (conn.sub, conn.dealer, conn.monitor):
            if sock is not None:
                self._poller.unregister(sock)
                self._by_socket.pop(sock, None)
                sock.close(linger=0)

    def request_resync(self, stream: StreamId, reason: str) -> list[Delivery]:
        """Asks for ``stream``'s full state again (see :meth:`StreamTracker.request_resync`)."""
        conn = self._conns[stream]
        out = conn.tracker.request_resync(reason, self._now())
        self._flush(conn)
        return out

    def _new_dealer(self, cfg: EndpointConfig) -> zmq.Socket[bytes] | None:
        if cfg.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # A replay answer is as long as the publisher's buffer (SGLang and kvtier keep 10,000
        # batches); the default limit of 1,000 would make the publisher block or drop frames.
        dealer.setsockopt(zmq.RCVHWM, _REPLAY_HWM)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        dealer.connect(cfg.replay_endpoint)
        return dealer

    def _register(self, conn: _Conn) -> None:
        for sock in (conn.sub, conn.dealer, conn.monitor):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
                self._by_socket[sock] = conn

    def poll(self, timeout_ms: int = 100, max_messages: int = 10_000) -> list[Delivery]:
        """Waits up to ``timeout_ms`` for traffic, then drains what is ready.

        Returns deliveries in order per stream. Never raises for bad input: a
        broken frame becomes a :class:`MalformedFrame` delivery.
        """
        out: list[Delivery] = []
        ready = dict(self._poller.poll(timeout_ms))
        handled = 0
        while ready and handled < max_messages:
            for sock in list(ready):
                conn = self._by_socket.get(sock)
                if conn is None:
                    ready.pop(sock)
                    continue
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    ready.pop(sock)
                    continue
                handled += 1
                now = self._now()
                if sock is conn.sub:
                    self._events(conn, now)
                    self._on_live(conn, frames, now, out)
                elif sock is conn.monitor:
                    self._on_event(conn, frames, now)
                else:
                    self._on_reply(conn, frames, now, out)
        now = self._now()
        for conn in list(self._conns.values()):
            if conn.dropped_at is not None and now - conn.dropped_at >= RECONNECT_GRACE_S:
                self._connect_again(conn)
            out.extend(conn.tracker.on_tick(now))
            self._flush(conn)
            if not conn.reached and not conn.told_unreached and conn.tracker.stats.resyncs:
                self._unreached(conn)
        return out

    def _events(self, conn: _Conn, now: float) -> None:
        """Takes the connection events waiting on ``conn``'s monitor, before a live message is taken: a restarted
        publisher's first batch taken before the disconnect that came first could pass for the old process's next
        one (its seq may be the one expected), unchecked. libzmq queues a disconnect's event before it reconnects,
        and a reconnected SUB sends its subscription again (without which a publisher sends it nothing) only on a
        later call on the socket: a new connection's message is taken only once its disconnect's event waits here,
        which a check once per poll would not see. The old connection's messages still unread then follow the
        disconnect: they go through the check of the publisher it asks for. O(events waiting), O(1) with none."""
        while cast(int, conn.monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            self._on_event(conn, conn.monitor.recv_multipart(zmq.NOBLOCK), now)

    @staticmethod
    def _on_event(conn: _Conn, frames: list[bytes], now: float) -> None:
        """A monitor event: the live socket's handshake with the publisher (reached, up), its connection lost, or
        libzmq's word that it will connect again (after a connection lost, not after a frame past the cap)."""
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            conn.reached = True
            conn.dropped_at = None
            conn.tracker.on_connect(now)
        elif event == zmq.EVENT_DISCONNECTED:
            conn.dropped_at = now
            conn.tracker.on_disconnect()
        else:
            conn.dropped_at = None

    def _connect_again(self, conn: _Conn) -> None:
        """Connects ``conn``'s live socket again: libzmq dropped its connection and will not reconnect (a frame past
        ``max_frame_bytes``, or a failed handshake). Messages of the old connection still queued are discarded: a gap
        the tracker replays. O(1)."""
        conn.dropped_at = None
        endpoint = conn.config.endpoint
        self._renewed(conn, 0, endpoint)
        with contextlib.suppress(zmq.ZMQError):  # (the endpoint may be gone with its session)
            conn.sub.disconnect(endpoint)
        conn.sub.connect(endpoint)

    def _unreached(self, conn: _Conn) -> None:
        """A stream given up (or asked for a dump) whose publisher was never reached: the tracker's line names the
        stream alone, so this one names the addresses (a wrong address or port, or an engine not up), once. O(1)."""
        conn.told_unreached = True
        cfg = conn.config
        log.warning("stream %s: no connection to its publisher at %s%s yet: check that address, and that the engine "
                    "runs with its KV events on", cfg.stream, cfg.endpoint,
                    f" (replay {cfg.replay_endpoint})" if cfg.replay_endpoint else "")

    def _on_live(self, conn: _Conn, frames: list[bytes], now: float, out: list[Delivery]) -> None:
        if len(frames) != 3:
            self._malformed(conn, f"live message has {len(frames)} frames, expected 3", out)
            return
        try:
            seq = unpack_seq(frames[1])
        except ValueError as exc:
            self._malformed(conn, f"live message: {exc}", out)
            return
        out.extend(conn.tracker.on_live(seq, frames[2], now))
        self._flush(conn)

    def _on_reply(self, conn: _Conn, frames: list[bytes], now: float, out: list[Delivery]) -> None:
        # [b"", topic, seq, payload] (SGLang >= 0.5.18, vLLM) or [b"", seq, payload] (SGLang 0.5.17)
        if len(frames) not in (3, 4) or frames[0] != b"":
            self._malformed(conn, f"replay answer has {len(frames)} frames, expected 3 or 4", out)
            return
        seq_frame, payload = frames[-2], frames[-1]
        out.extend(conn.tracker.on_reply(seq_frame, payload, now))
        self._flush(conn)

    def _malformed(self, conn: _Conn, reason: str, out: list[Delivery]) -> None:
        out.extend(conn.tracker.on_malformed(reason))

    def _flush(self, conn: _Conn) -> None:
        """Sends the tracker's requests on the replay socket, recreated first where the tracker asks. A socket with
        no connection to send on (ZMQ dropped it for good: an answer's frame past ``max_frame_bytes``) would block
        the sender, and so the owner's loop, forever: it is recreated, and the request sent on the new one (a new
        socket queues at once). O(requests)."""
        tracker = conn.tracker
        if tracker.reset_replay_socket and conn.dealer is not None:
            self._renew_dealer(conn)
        tracker.reset_replay_socket = False
        if conn.dealer is None:
            tracker.outbox.clear()
            return
        for request in tracker.outbox:
            try:
                conn.dealer.send_multipart([b"", request], zmq.NOBLOCK)
            except zmq.Again:
                self._renewed(conn, 1, conn.config.replay_endpoint)
                self._renew_dealer(conn)
                with contextlib.suppress(zmq.Again):  # (a request lost: the tracker's deadline asks again)
                    conn.dealer.send_multipart([b"", request], zmq.NOBLOCK)
        tracker.outbox.clear()

    def _renewed(self, conn: _Conn, replay: int, endpoint: str | None) -> None:
        """Logs a connection made again here (``replay``: 1 for the replay socket's, 0 for the live one's): the first
        few, then one in a thousand (a peer that is no ZMQ publisher of that kind, a swapped port, fails every
        handshake, and libzmq gives up on each). O(1)."""
        conn.renewed[replay] += 1
        n = conn.renewed[replay]
        if worth_logging(n):
            log.warning("stream %s: ZMQ dropped the %sconnection to %s and will not make it again (a frame past "
                        "max_frame_bytes, %d bytes, or a peer that is no ZMQ publisher of that kind: check the "
                        "address); connecting again%s", conn.config.stream, "replay " if replay else "", endpoint,
                        self._max_frame, suffix(n, None if replay else "the disconnects metric"))

    def _renew_dealer(self, conn: _Conn) -> None:
        """Replaces ``conn``'s replay socket with a new one: answers in flight on the old one are dropped. O(1)."""
        assert conn.dealer is not None
        self._poller.unregister(conn.dealer)
        self._by_socket.pop(conn.dealer, None)
        conn.dealer.close(linger=0)
        conn.dealer = self._new_dealer(conn.config)
        assert conn.dealer is not None
        self._poller.register(conn.dealer, zmq.POLLIN)
        self._by_socket[conn.dealer] = conn

    def close(self) -> None:
        """Close every socket. Idempotent."""
        for stream in list(self._conns):
            self.remove_endpoint(stream)

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
