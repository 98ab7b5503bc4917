"""ZMQ event publisher: live PUB stream, bounded replay buffer, ROUTER replay socket.

Wire-compatible with SGLang's and vLLM's ``ZmqEventPublisher`` (see :mod:`kvtier.wire.transport.frames`).

Replay answers are never dropped silently, unlike a ROUTER socket left at ZMQ's defaults (a
high-water mark of 1,000 messages, past which frames to a peer are discarded): the socket is
``ROUTER_MANDATORY`` and sends without blocking, and each answer (a replay or a state dump) is a
queue of frames pumped round-robin with the others. A peer that reads slowly holds up only its own
answer; a peer that stops reading for :attr:`Publisher.stuck_s` or disconnects has its answer
abandoned (counted), and the subscriber asks again from its first missing seq.

What one peer costs is bounded: ZMQ queues (copies of) at most a few chunks of messages for a peer that does not read
(the rest of its answer waits, as references to the replay buffer's payloads), and at most
:attr:`Publisher.max_answers` answers are in progress at once; requests past it wait in the socket's queue until one
ends. Malformed requests and abandoned answers are counted and logged sparsely.

State dumps are rationed, replays are not: a dump is the engine's whole residency (megabytes of token ids, an
encoding pass on the engine's CPU), asked for with four bytes by anyone who can reach the socket. A peer (a
ROUTER identity) gets at most one dump per :attr:`Publisher.dump_interval_s`, and at most
:attr:`Publisher.max_dumps` dumps are in progress at once (identities are free: one per connection). A request
past either limit is refused with the end marker alone, the answer of a publisher without dumps, which the
kvtier subscriber reads as "publisher sent no state dump" (:mod:`kvtier.wire.transport.recovery`): the stream is marked
partial, never taken for an empty state, and the next dump asked once the limits allow brings it back in sync.
A subscriber paced by the resync backoff (1 s at first) is never refused by the default interval.
"""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import zmq

from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.codec import WireFormat, encode_payload
from kvtier.wire.protocol import EventBatch
from kvtier.wire.transport.addresses import bind_address_error
from kvtier.wire.transport.frames import DUMP_REQUEST, END_SEQ, pack_seq, unpack_seq

log = logging.getLogger(__name__)

#: Returns ``(last_seq, batches)``: the publisher's whole current state, consistent with every
#: live batch up to and including ``last_seq`` (-1 if none was published yet). ``batches`` may be
#: a lazy iterable: it is consumed on the replay thread, a chunk at a time, while other requests
#: are served, so a provider should snapshot what it needs and build the batches outside its lock.
DumpProvider = Callable[[], tuple[int, Iterable[EventBatch]]]

_CHUNK = 64  # messages sent to one peer before the next answer gets its turn
_PEER_QUEUE = 4 * _CHUNK  # messages ZMQ may hold for one peer (its send high-water mark): past it, EAGAIN
#: Default most answers (replays and dumps) in progress at once.
MAX_ANSWERS = 64

#: Default least time between two dumps answered to one peer (s): under the subscriber's resync backoff (1 s),
#: with room for requests that travel at different speeds.
DUMP_INTERVAL_S = 0.5
#: Default most dumps in progress at once (built or being sent): an engine has a few indexers, not dozens.
MAX_DUMPS = 4
_DUMP_PEERS = 4096  # peers whose last dump is remembered; past it the oldest is forgotten (it may ask again)


@dataclass(slots=True)
class _Answer:
    """One replay or dump answer being sent to one peer."""

    ident: bytes  # the peer's ROUTER identity
    frames: Iterator[list[bytes] | None]  # messages still to send (no identity); None: not built yet
    head: list[bytes] | None = None  # a message taken from `frames` that could not be sent yet
    since: float = field(default_factory=time.monotonic)  # last time a message went out
    dump: bool = False  # a state dump (counted against Publisher.max_dumps while it is sent)


def _close(ans: _Answer) -> None:
    """Ends an answer given up: a dump's builder thread stops (see Publisher._dump_frames)."""
    close = getattr(ans.frames, "close", None)  # (a dump's frames are a generator; a replay's a list iterator)
    if close is not None:
        close()


_CANCEL_POLL_S = 0.1  # how often a dump builder waiting for room checks whether its answer was given up


@dataclass(slots=True)
class ReplayStats:
    """Counters of the replay socket."""

    requests: int = 0  # replay and dump requests received
    dumps: int = 0  # of which dumps
    messages: int = 0  # messages sent, end markers included
    abandoned: int = 0  # answers given up because the peer left or stopped reading
    dump_errors: int = 0  # dumps whose provider raised (answered with an end marker)
    dumps_refused: int = 0  # dump requests answered with the end marker alone (past a limit of Publisher's)
    malformed: int = 0  # requests that were not a seq nor a dump request (answered with the end marker, or ignored)


class Publisher:
    """Publishes event batches with sequence numbers and answers replay requests.

    Sequence numbers start at 0 and grow by one per batch. The replay buffer keeps
    the last ``buffer_size`` payloads; a replay request for an older seq gets what is
    left, so the subscriber sees the hole and resynchronises.

    Thread model: :meth:`publish` may be called from one thread at a time; replay
    requests are served by a background thread (``threaded=True``) or by calling
    :meth:`serve_requests` from the owner's loop.

    Dump requests are limited (see the module's docstring): ``dump_interval_s`` between two dumps to one
    peer (0: no limit), ``max_dumps`` in progress at once, both read with ``clock``; answers of either kind,
    ``max_answers`` in progress at once.
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
        dump_interval_s: float = DUMP_INTERVAL_S,
        max_dumps: int = MAX_DUMPS,
        clock: Callable[[], float] = time.monotonic,
        max_answers: int = MAX_ANSWERS,
    ) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        if not dump_interval_s >= 0:  # (NaN too)
            raise ValueError(f"dump_interval_s must be a number >= 0, got {dump_interval_s}")
        if max_dumps < 1:
            raise ValueError(f"max_dumps must be >= 1, got {max_dumps}")
        if max_answers < 1:
            raise ValueError(f"max_answers must be >= 1, got {max_answers}")
        self.max_answers = max_answers
        self.dump_interval_s = dump_interval_s
        self.max_dumps = max_dumps
        self._clock = clock
        # peer identity -> when its last dump was granted, oldest first (entries past the interval are dropped)
        self._dumped_at: OrderedDict[bytes, float] = OrderedDict()
        for address in (endpoint, replay_endpoint):
            if address is not None and (wrong := bind_address_error(address)):
                raise ValueError(f"{address!r}: {wrong}")
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
        self._answers: deque[_Answer] = deque()  # in progress, served round-robin
        #: Seconds a peer may go without reading before its answer is abandoned.
        self.stuck_s = 10.0
        self.replay_stats = ReplayStats()
        if replay_endpoint is not None:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            # Fail loudly (EHOSTUNREACH / EAGAIN) instead of dropping frames for a gone or full peer.
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._router.setsockopt(zmq.SNDHWM, _PEER_QUEUE)
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
    def answers_in_progress(self) -> int:
        """Replay and dump answers being sent (at most :attr:`max_answers`)."""
        return len(self._answers)

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
        """Takes pending replay/dump requests (waiting up to ``timeout_ms`` for the first when no
        answer is in progress) and sends the next chunk of every answer. Returns requests taken."""
        if self._router is None:
            return 0
        served = 0
        wait = 0 if self._answers else timeout_ms
        while len(self._answers) < self.max_answers and self._router.poll(wait if served == 0 else 0, zmq.POLLIN):
            self._answer(self._router.recv_multipart())
            served += 1
        self._pump()
        return served

    def drain(self, timeout_s: float = 10.0) -> None:
        """Serves requests until no answer is in progress (for owners without the thread)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.serve_requests(0)
            if not self._answers or time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _serve_forever(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_requests(timeout_ms=50)
                if self._answers:
                    time.sleep(0.0005)  # peers are reading: let them, without spinning
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.error("replay socket error: %s", exc)
            except Exception:
                log.exception("replay thread: unexpected error; answers in progress abandoned")
                self.replay_stats.abandoned += len(self._answers)
                for ans in self._answers:
                    _close(ans)
                self._answers.clear()

    def _pump(self) -> None:
        """Sends up to a chunk of each answer in turn, never blocking on a slow peer."""
        assert self._router is not None
        for _ in range(len(self._answers)):
            ans = self._answers.popleft()
            if self._send_chunk(ans):
                self._answers.append(ans)

    def _send_chunk(self, ans: _Answer) -> bool:
        """Returns True while the answer has more to send."""
        assert self._router is not None
        for _ in range(_CHUNK):
            if ans.head is None:
                try:
                    ans.head = next(ans.frames)
                except StopIteration:
                    return False
                if ans.head is None:  # a dump still being built: not the peer's fault
                    ans.since = time.monotonic()
                    return True
            try:
                self._router.send_multipart([ans.ident, b"", *ans.head], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EAGAIN and time.monotonic() - ans.since < self.stuck_s:
                    return True  # the peer's queue is full: try again on the next turn
                why = "stopped reading" if exc.errno == zmq.EAGAIN else (
                    "is gone" if exc.errno == errno.EHOSTUNREACH else str(exc))
                self.replay_stats.abandoned += 1
                if worth_logging(self.replay_stats.abandoned):
                    log.warning("replay: abandoning an answer, the peer %s%s", why,
                                suffix(self.replay_stats.abandoned, "replay_stats.abandoned"))
                _close(ans)
                return False
            ans.head = None
            ans.since = time.monotonic()
            self.replay_stats.messages += 1
        return True

    def _frame(self, seq: bytes, payload: bytes) -> list[bytes]:
        return [self._topic, seq, payload] if self._replay_with_topic else [seq, payload]

    def _end_frame(self) -> list[bytes]:
        # (SGLang and vLLM send the end marker's topic frame empty, where they send one)
        return [b"", END_SEQ, b""] if self._replay_with_topic else [END_SEQ, b""]

    def _answer(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or frames[1] != b"":
            self._malformed(f"a request of {len(frames)} frames")
            return
        ident, request = frames[0], frames[2]
        self.replay_stats.requests += 1
        if request == DUMP_REQUEST:
            self.replay_stats.dumps += 1
            refused = self._dump_refusal(ident)
            if refused is not None:
                st = self.replay_stats
                st.dumps_refused += 1
                if worth_logging(st.dumps_refused):
                    log.warning("replay: dump request refused (%s); answered with the end marker alone%s", refused,
                                suffix(st.dumps_refused, "replay_stats.dumps_refused"))
                self._answers.append(_Answer(ident, iter([self._end_frame()])))
                return
            self._answers.append(_Answer(ident, self._dump_frames(), dump=True))
            return
        try:
            start = unpack_seq(request)
        except ValueError as exc:
            self._malformed(str(exc))
            self._answers.append(_Answer(ident, iter([self._end_frame()])))
            return
        with self._lock:  # (references to the payloads: each message is made as it is sent)
            pending = [(s, p) for s, p in self._buffer if s >= start]
        self._answers.append(_Answer(ident, self._replay_frames(pending)))

    def _replay_frames(self, pending: list[tuple[int, bytes]]) -> Iterator[list[bytes]]:
        for s, p in pending:
            yield self._frame(pack_seq(s), p)
        yield self._end_frame()

    def _malformed(self, what: str) -> None:
        st = self.replay_stats
        st.malformed += 1
        if worth_logging(st.malformed):
            log.warning("ignoring malformed replay request: %s%s", what, suffix(st.malformed, "replay_stats.malformed"))

    def _dump_refusal(self, ident: bytes) -> str | None:
        """Why a dump for peer ``ident`` is refused now, or None (and the grant remembered). O(answers in
        progress); memory: at most _DUMP_PEERS peers."""
        now, seen = self._clock(), self._dumped_at
        while seen and now - next(iter(seen.values())) >= self.dump_interval_s:
            seen.popitem(last=False)  # its interval has run: it restricts nobody any more
        last = seen.get(ident)
        if last is not None:  # (every entry left is inside its interval)
            return (f"this peer had one {now - last:.3f} s ago; one per {self.dump_interval_s:g} s "
                    "(dump_interval_s)")
        busy = sum(a.dump for a in self._answers)
        if busy >= self.max_dumps:
            return f"{busy} dumps in progress (max_dumps)"
        if self.dump_interval_s > 0:
            seen[ident] = now
            if len(seen) > _DUMP_PEERS:
                seen.popitem(last=False)
        return None

    def _dump_frames(self) -> Iterator[list[bytes] | None]:
        """A dump answer. The provider runs and encodes on a thread of its own, so replay requests
        and other answers keep being served meanwhile; ``None`` means "nothing ready yet"."""
        if self._dump_provider is None:
            log.warning("dump requested but this publisher has no dump provider")
            yield self._end_frame()
            return
        ready: queue.Queue[list[bytes] | BaseException | None] = queue.Queue(maxsize=4 * _CHUNK)
        cancel = threading.Event()
        threading.Thread(target=self._build_dump, args=(ready, cancel), name="kv-dump", daemon=True).start()
        try:
            while True:
                try:
                    item = ready.get_nowait()
                except queue.Empty:
                    yield None
                    continue
                if item is None:
                    yield self._end_frame()
                    return
                if isinstance(item, BaseException):
                    # No end marker: the subscriber must not take what it got for a whole dump. It times
                    # out and asks again, or marks the stream partial.
                    self.replay_stats.dump_errors += 1
                    log.error("dump provider failed: %s: %s; dump abandoned", type(item).__name__, item)
                    return
                yield item
        finally:
            # Done, or closed because the answer was abandoned: a builder still at work stops at its next batch
            # instead of waiting forever, holding a full queue, for a reader that is gone.
            cancel.set()

    def _build_dump(self, ready: queue.Queue[list[bytes] | BaseException | None], cancel: threading.Event) -> None:
        assert self._dump_provider is not None

        def put(item: list[bytes] | BaseException | None) -> bool:
            """Queues ``item`` once there is room; False if the answer was given up meanwhile."""
            while not cancel.is_set():
                try:
                    ready.put(item, timeout=_CANCEL_POLL_S)
                    return True
                except queue.Full:
                    pass
            return False

        try:
            last_seq, batches = self._dump_provider()
            seq = pack_seq(last_seq)
            sent = False
            for batch in batches:
                sent = True
                if not put(self._frame(seq, encode_payload(batch, self._format))):
                    return
            if not sent:  # the subscriber learns last_seq from the first batch, so send one
                put(self._frame(seq, encode_payload(EventBatch(ts=0.0, events=[]), self._format)))
            put(None)
        except Exception as exc:
            put(exc)

    def close(self) -> None:
        """Stop the replay thread and close both sockets. Idempotent."""
        self._stop.set()
        busy = False
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            busy = self._thread.is_alive()
            self._thread = None
        if not busy:  # (else the replay thread still owns the answers)
            for ans in self._answers:
                _close(ans)
            self._answers.clear()
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
