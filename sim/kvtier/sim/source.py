"""Where a run's requests come from: a list in memory, or a Mooncake file streamed from disk.

The simulator needs two things of a trace (:class:`TraceSource`): the requests that arrive on their own
(every one open loop; closed loop, the first turn of each session and requests without a session), in
arrival order, and, when a turn finishes, the next turn of its session. :class:`MooncakeFile` answers
both from an index of line offsets built in one validating pass, so a replay of a million-request trace
holds the requests in flight, not the trace: 17 bytes of index per request, and no token ids at all.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

from kvtier.sim.trace import (
    Request,
    TraceError,
    check_scaled,
    decode_record,
    read_line,
    read_mooncake,
    request_from,
)


@runtime_checkable
class TraceSource(Protocol):
    """A trace as the simulator reads it. Request ids are unique within it."""

    def __len__(self) -> int:
        """Requests in the trace."""
        ...

    def arrivals(self, closed_loop: bool) -> Iterator[tuple[int, Request]]:
        """``(rank, request)`` of the requests released at their own arrival time, sorted by arrival
        (ties in trace order); ``rank`` is the request's position among them in trace order, unique and
        below ``len(self)``. With ``closed_loop``, a session's later turns are left out: each comes from
        :meth:`successor` when its predecessor finishes."""
        ...

    def successor(self, request_id: str) -> Request | None:
        """The next turn of the session of ``request_id`` (a request this source produced), or None.
        Called at most once per request."""
        ...


class ListTrace:
    """Requests held in a list (generated traces, Azure CSV, tests). O(requests) memory."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.requests = tuple(requests)  # in trace order
        self._next: dict[str, Request] | None = None  # request id -> next turn of its session

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def _successors(self) -> dict[str, Request]:
        if self._next is None:
            reqs = self.requests
            self._next = {reqs[i].request_id: reqs[j] for i, j in next_turns(r.session for r in reqs)}
        return self._next

    def arrivals(self, closed_loop: bool) -> Iterator[tuple[int, Request]]:
        """O(requests log requests) to sort, then O(1) per request."""
        later = {r.request_id for r in self._successors().values()} if closed_loop else set()
        first = [r for r in self.requests if r.request_id not in later]
        for rank in sorted(range(len(first)), key=lambda i: first[i].arrival):  # stable: trace order among ties
            yield rank, first[rank]

    def successor(self, request_id: str) -> Request | None:
        """O(1)."""
        return self._successors().get(request_id)


class MooncakeFile:
    """A Mooncake JSONL trace streamed from its file (see :func:`kvtier.sim.trace.read_mooncake` for the
    format and its checks, all made by the first pass, so a malformed line fails before a run starts).

    Memory: per request, its line's offset (8 bytes), the index of its session's next turn (8 bytes)
    and whether a predecessor releases it (1 byte), plus the requests in flight.
    ``time_scale`` multiplies arrival times, as :func:`kvtier.sim.experiment.resolve_trace` does for lists.
    Picklable: process pools and Ray tasks rebuild nothing but an open file (which must be readable
    under the same path there).
    """

    def __init__(self, path: Path | str, *, limit: int | None = None, time_scale: float = 1.0) -> None:
        self.path = Path(path)  # as given, for messages
        self._file = self.path.resolve()  # what runs open: a pool or Ray worker may start elsewhere
        self.limit = limit
        self.time_scale = time_scale
        self._offsets = array("q")  # request index -> byte offset of its line
        self._next = array("q")  # request index -> index of its session's next turn, -1 if none
        self._follows = bytearray()  # request index -> 1 if an earlier turn of its session exists
        self._indexed = False
        # request id -> index, of requests handed out closed loop whose next turn is still to come
        self._live: dict[str, int] = {}
        self._turns: BinaryIO | None = None  # the file, open while next turns are still to come (successor)

    def __getstate__(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in ("path", "_file", "limit", "time_scale", "_offsets", "_next",
                                                "_follows", "_indexed")}
        state["_live"] = {}
        state["_turns"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)

    def index(self) -> MooncakeFile:
        """Reads and checks the whole file once (up to ``limit`` requests). Raises :class:`TraceError`
        naming the first malformed line. O(requests); later calls are free."""
        if self._indexed:
            return self
        last: list[Request] = []  # the latest arrival (timestamps never go back)

        def sessions() -> Iterator[str | None]:
            for _, offset, req in read_mooncake(self.path, self.limit):  # messages name the path as given
                self._offsets.append(offset)
                self._next.append(-1)
                self._follows.append(0)
                last[:] = [req]
                yield req.session

        for i, j in next_turns(sessions()):
            self._next[i] = j
            self._follows[j] = 1
        if last and self.time_scale != 1.0:
            check_scaled(last[0].arrival, self.time_scale, f"request {last[0].request_id!r} of {self.path}")
        self._indexed = True
        return self

    def __len__(self) -> int:
        return len(self.index()._offsets)

    def _read(self, f: Any, i: int, *, followed: bool) -> Request:
        """Request ``i``; ``followed``: :meth:`successor` will be asked for its next turn (remembered until
        then, so only requests in flight are)."""
        at = self._offsets[i]
        f.seek(at)
        try:  # (the same caps as the first pass: the file may have changed since)
            req = request_from(decode_record(read_line(f), f"byte {at}"), f"byte {at}")
        except ValueError as exc:  # the file changed since it was indexed (TraceError is one)
            raise TraceError(f"{self.path}: request {i} changed after the trace was read: {exc}") from None
        if not req.request_id:
            req.request_id = f"r{i}"
        if self.time_scale != 1.0:
            req = dataclasses.replace(req, arrival=req.arrival * self.time_scale)
        if followed and self._next[i] >= 0:
            self._live[req.request_id] = i
        return req

    def __iter__(self) -> Iterator[Request]:
        """Every request in trace order, streamed. O(1) memory."""
        self.index()
        with open(self._file, "rb") as f:
            for i in range(len(self._offsets)):
                yield self._read(f, i, followed=False)

    def arrivals(self, closed_loop: bool) -> Iterator[tuple[int, Request]]:
        """The file's order is arrival order (the first pass checks it). O(1) memory per request."""
        self.index()
        rank = 0
        with open(self._file, "rb") as f:
            for i in range(len(self._offsets)):
                if closed_loop and self._follows[i]:
                    continue
                yield rank, self._read(f, i, followed=closed_loop)
                rank += 1

    def successor(self, request_id: str) -> Request | None:
        """One seek and one line read (the file stays open while sessions are in flight, rather than opened
        again for each turn). O(line)."""
        i = self._live.pop(request_id, None)
        if i is None:
            return None  # the last turn of its session (or no session)
        if self._turns is None:
            self._turns = open(self._file, "rb")  # noqa: SIM115 (closed below, once no session is in flight)
        try:
            return self._read(self._turns, self._next[i], followed=True)
        finally:
            if not self._live:
                self._turns.close()
                self._turns = None


def next_turns(sessions: Iterable[str | None]) -> Iterator[tuple[int, int]]:
    """``(i, j)`` for each request ``j`` that is the next turn of request ``i``'s session, given each
    request's session (None: none) in trace order; yielded as ``j`` is read. O(1) per request, memory
    one entry per session."""
    last: dict[str, int] = {}  # session -> index of its latest turn so far
    for j, session in enumerate(sessions):
        if session is None:
            continue
        i = last.get(session)
        if i is not None:
            yield i, j
        last[session] = j


def as_source(trace: Sequence[Request] | TraceSource) -> TraceSource:
    """``trace`` itself if it is a :class:`TraceSource`, else a :class:`ListTrace` of it."""
    return trace if isinstance(trace, TraceSource) else ListTrace(trace)


__all__ = ["ListTrace", "MooncakeFile", "TraceSource", "as_source", "next_turns"]
