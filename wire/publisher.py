"""ZMQ event publisher: live PUB stream, bounded replay buffer, ROUTER replay socket.

Wire-compatible with SGLang's and vLLM's ``ZmqEventPublisher`` (see :mod:`indexer.frames`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from kvtier.wire.codec import WireFormat, encode_payload
from kvtier.wire.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq
from kvtier.wire.protocol import EventBatch

log = logging.getLogger(__name__)

#: Returns ``(last_seq, batches)``: the publisher's whole current state, consistent with every
#: live batch up to and including ``last_seq`` (-1 if none was published yet).
DumpProvider = Callable[[], tuple[int, list[EventBatch]]]


class Publisher:
    """Publishes event batches with sequence numbers and answers replay requests.

    Sequence numbers start at 0 and grow by one per batch. The replay buffer keeps
    the last ``buffer_size`` payloads; a replay request for an older seq gets what is
    left, so the subscriber sees the hole and resynchronises.

    Thread model: :meth:`publish` may be called from one thread at a time; replay
    requests are served by a background thread (``threaded=True``) or by calling
    :meth:`serve_requests` from the owner's loop.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: bytes = b"kv",
        buffer_size: int = 10_000,
        wire_format: WireFormat = WireFormat.SGLANG,
        replay_with_topic: bool = True,
        dump_provider: DumpProvider | None = None,
        threaded: bool = True,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self._ctx = context or zmq.Context.instance()
        self._topic = topic
        self._format = wire_format
        self._replay_with_topic = replay_with_topic  # False mimics SGLang 0.5.17
        self._dump_provider = dump_provider
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)  # (seq, payload)
        self._lock = threading.Lock()  # guards _buffer and _next_seq against the replay thread
        self._next_seq = 0
        #: Test hook: return False to skip the live send of a seq (it stays in the replay buffer).
        self.live_filter: Callable[[int], bool] | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.endpoint = self._bind(self._pub, endpoint)
        self._router: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._router, replay_endpoint)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if threaded and self._router is not None:
            self._thread = threading.Thread(target=self._serve_forever, name="kv-replay", daemon=True)
            self._thread.start()

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], endpoint: str) -> str:
        if endpoint.endswith(":0") or endpoint.endswith(":*"):
            port = sock.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            return f"{endpoint.rsplit(':', 1)[0]}:{port}"
        # A socket closed a moment ago (a restarting engine) frees its port asynchronously.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                sock.bind(endpoint)
                return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def last_seq(self) -> int:
        """Seq of the last published batch, -1 before the first."""
        return self._next_seq - 1

    def publish(self, batch: EventBatch) -> int:
        """Encode and publish ``batch``; returns its seq. O(batch size)."""
        return self.publish_payload(encode_payload(batch, self._format))

    def publish_payload(self, payload: bytes) -> int:
        """Publish an already-encoded payload (also used to send malformed bytes in tests)."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append((seq, payload))
        if self.live_filter is None or self.live_filter(seq):
            self._pub.send_multipart([self._topic, pack_seq(seq), payload], copy=False)
        return seq

    def serve_requests(self, timeout_ms: int = 0) -> int:
        """Answer pending replay/dump requests, waiting up to ``timeout_ms`` for the first."""
        if self._router is None:
            return 0
        served = 0
        while self._router.poll(timeout_ms if served == 0 else 0, zmq.POLLIN):
            self._answer(self._router.recv_multipart())
            served += 1
        return served

    def _serve_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_requests(timeout_ms=50)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.error("replay socket error: %s", exc)

    def _reply(self, ident: bytes, seq: bytes, payload: bytes) -> None:
        assert self._router is not None
        if self._replay_with_topic:
            self._router.send_multipart([ident, b"", self._topic, seq, payload])
        else:
            self._router.send_multipart([ident, b"", seq, payload])

    def _end(self, ident: bytes) -> None:
        assert self._router is not None
        if self._replay_with_topic:
            self._router.send_multipart([ident, b"", b"", END_SEQ, b""])
        else:
            self._router.send_multipart([ident, b"", END_SEQ, b""])

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"":
            log.warning("ignoring malformed replay request with %d frames", len(frames))
            return
        ident, request = frames[0], frames[2]
        if request == DUMP_REQUEST:
            self._answer_dump(ident)
            return
        try:
            start = unpack_seq(request)
        except ValueError as exc:
            log.warning("ignoring replay request: %s", exc)
            self._end(ident)
            return
        with self._lock:
            pending = [(s, p) for s, p in self._buffer if s >= start]
        for seq, payload in pending:
            self._reply(ident, pack_seq(seq), payload)
        self._end(ident)

    def _answer_dump(self, ident: bytes) -> None:
        if self._dump_provider is None:
            log.warning("dump requested but this publisher has no dump provider")
            self._end(ident)
            return
        last_seq, batches = self._dump_provider()
        seq = pack_seq(last_seq)
        if not batches:  # the subscriber learns last_seq from the first batch, so send one
            batches = [EventBatch(ts=0.0, events=[])]
        for batch in batches:
            self._reply(ident, seq, encode_payload(batch, self._format))
        self._end(ident)

    def close(self) -> None:
        """Stop the replay thread and close both sockets. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
