"""The router's own bookkeeping of in-flight work per worker.

What a worker holds for its in-flight requests is what its engine holds: the prompt's full blocks,
each shared prefix once (a radix cache stores one copy however many requests use it), plus each
request's private blocks (the partial prompt tail and the tokens it has generated so far). So the
tracker keeps, per worker, a reference count per prompt block key, and per request the private
blocks, which grow as the router sees tokens stream back (:meth:`LoadTracker.progress`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Container, Hashable, Sequence
from dataclasses import dataclass, field, fields
from itertools import compress, repeat
from typing import Protocol, cast

from kvtier.indexer.index.keyrefs import U64, KeyRefs, compiled, key_array
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import DEFAULT_BLOCK_SIZE


@dataclass(slots=True)
class WorkerLoad:
    """Work the router has sent a worker and not yet seen finish."""

    running: int = 0  # requests routed and not finished
    active_blocks: int = 0  # KV blocks they hold: distinct prompt blocks (shared prefixes once) + private blocks
    pending_prefill_tokens: int = 0  # prompt tokens still to compute (cleared at first token)
    prefilling: int = 0  # of ``running``, requests that have not produced their first token
    generated_blocks: int = 0  # of ``active_blocks``, those added by tokens generated so far
    # Prompt + generated tokens of the in-flight requests, each counted in full: what a decode step
    # attends over (a shared prefix is stored once but read by every request that uses it).
    context_tokens: int = 0
    # Output tokens the engines are expected to reserve and not yet written: sum over in-flight requests
    # of max(0, expected output at routing - generated). Engines reserve room for the output at admission.
    unwritten_tokens: int = 0
    # Uncached prompt tokens the in-flight requests brought, kept until each finishes (``pending_prefill_tokens``
    # drops them at first token): with ``running``, the prefill passes a stream on this worker shares its decode
    # steps with, as arrivals replace the requests in flight (the goodput policy's TPOT estimate).
    routed_prefill_tokens: int = 0

    def plus(self, other: WorkerLoad) -> WorkerLoad:
        """Both loads' figures added (a worker's bookings kept in two trackers). O(1)."""
        return WorkerLoad(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def held_prefix(held: Container[Hashable], keys: Sequence[Hashable]) -> int:
    """How many leading ``keys`` are in ``held``, by binary search: ``held`` must be prefix-closed over chained keys
    (a key held means every key of its prefix is), as router block keys are. O(log blocks)."""
    if not len(keys) or keys[0] not in held:  # (len: numpy arrays of keys too)
        return 0
    lo, hi = 1, len(keys)  # keys[:lo] are held; keys[hi:] are not (hi is an upper bound)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


_IDLE = WorkerLoad()  # what load_and_shared returns for a worker never routed to; never mutated
# Reference-count steps as C callables, so add and finish move a prompt's counts without a Python loop.
_PLUS_ONE, _MINUS_ONE, _IS_ONE, _OVER_ONE = (1).__add__, (-1).__add__, (1).__eq__, (1).__lt__


@dataclass(slots=True)
class _InFlight:
    worker: StreamId  # where it went
    blocks: int  # its prompt's full blocks
    prompt_tokens: int  # prompt length
    prefill_tokens: int  # uncached prompt tokens it brought
    private: int = 0  # blocks only it holds: partial prompt tail + generated tokens
    generated: int = 0  # output tokens seen so far
    reserve: int = 0  # output tokens expected when it was routed (LoadTracker.expected_output)
    # In a dict of counts: no key repeats (chained keys never do), so its counts move in bulk, in C.
    distinct: bool = True
    # Its prompt's router block keys: as an array where the worker's counts are a KeyRefs (moved in one call), else
    # as a tuple (one of the two is set, the other empty). The array alone holds no Python int per block.
    arr: U64 | None = None
    keys: tuple[Hashable, ...] = ()

    def key_list(self) -> Sequence[Hashable]:
        """Its prompt's block keys, whichever way they are held."""
        return self.arr.tolist() if self.arr is not None else self.keys


@dataclass(slots=True)
class _Worker:
    load: WorkerLoad = field(default_factory=WorkerLoad)  # the totals
    # Prompt block key -> in-flight requests using it: compiled while every key is an int
    # (kvtier.indexer.index.keyrefs).
    refs: dict[Hashable, int] | KeyRefs = field(default_factory=dict)


class LoadTracker:
    """Tracks in-flight requests per worker, and the mean output length of those that finished.

    ``add`` and ``finish`` are O(prompt blocks); everything else is O(1).
    Invariant (see :meth:`_check`): each worker's totals equal the sums over its in-flight requests,
    with prompt blocks counted once per distinct key.
    """

    _OUTPUT_WEIGHT = 1 / 32  # weight of each finished request in expected_output

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._workers: dict[StreamId, _Worker] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._prefilling: set[str] = set()
        # Mean output length of finished requests (exponentially weighted, 0 until one finishes with a
        # known length): the output room engines reserve that the router cannot see yet.
        self.expected_output = 0.0

    def load(self, worker: StreamId) -> WorkerLoad:
        """What ``worker`` has in flight (a fresh zero load for a worker never routed to). O(1)."""
        w = self._workers.get(worker)
        return w.load if w is not None else WorkerLoad()

    def shared_blocks(self, worker: StreamId, keys: Sequence[Hashable]) -> int:
        """Leading blocks of ``keys`` that in-flight requests on ``worker`` already hold. ``keys`` must be
        chained block keys, each naming its whole prefix (:func:`kvtier.indexer.index.keys.block_keys`), as the
        keys given to :meth:`add` are: the count is found by binary search. O(log blocks)."""
        return self.load_and_shared(worker, keys)[1]

    def load_and_shared(self, worker: StreamId, keys: Sequence[Hashable]) -> tuple[WorkerLoad, int]:
        """:meth:`load` and :meth:`shared_blocks` in one lookup (routing asks both of every worker).

        Block keys are chained (each names its whole prefix), and every in-flight request holds all of
        its prompt's leading blocks, so the held keys of a request form a prefix of it: a binary search
        finds its end. O(log blocks)."""
        loads, shared = self.loads_and_shared((worker,), keys)
        return loads[0], shared[0]

    def loads_and_shared(self, workers: Sequence[StreamId],
                         keys: Sequence[Hashable]) -> tuple[list[WorkerLoad], list[int]]:
        """:meth:`load_and_shared` of each of ``workers``, the keys converted once for all of them (routing asks
        every candidate on every request). Keys the compiled counts cannot hold are never counted there.
        O(workers * log blocks)."""
        found = list(map(self._workers.get, workers))
        loads = [_IDLE if w is None else w.load for w in found]
        if not len(keys):
            return loads, [0] * len(found)
        first = keys[0]
        held = [None if w is None else w.refs for w in found]
        if all(type(r) is KeyRefs or r is None for r in held):  # every worker's counts compiled: one loop
            arr = key_array(keys)
            if arr is None:
                return loads, [0] * len(found)
            compiled_refs = cast(list[KeyRefs | None], held)
            return loads, KeyRefs.held_prefixes(compiled_refs, arr, int(first))  # type: ignore[call-overload]
        arr = None
        converted = False  # keys -> arr on first need (None: keys the compiled counts cannot hold)
        shared = []
        for w in found:
            if w is None:
                shared.append(0)
                continue
            refs = w.refs
            if isinstance(refs, KeyRefs):
                if not converted:
                    converted, arr = True, key_array(keys)
                    if arr is not None:
                        first = int(first)  # type: ignore[call-overload]
                shared.append(0 if arr is None else refs.held_prefix(arr, first))  # type: ignore[arg-type]
            else:
                shared.append(self._held_in_dict(refs, keys))
        return loads, shared

    @staticmethod
    def _held_in_dict(refs: dict[Hashable, int], keys: Sequence[Hashable]) -> int:
        """Leading ``keys`` counted in ``refs`` (:func:`held_prefix`). O(log blocks)."""
        return held_prefix(refs, keys)

    def add(self, request_id: str, worker: StreamId, keys: Sequence[Hashable], prompt_tokens: int,
            prefill_tokens: int) -> None:
        """A request was routed: ``keys`` are its prompt's full blocks. Raises ``ValueError`` if
        ``request_id`` is already in flight."""
        if request_id in self._inflight:
            raise ValueError(f"request {request_id!r} is already in flight")
        f = _InFlight(worker, len(keys), prompt_tokens, prefill_tokens, reserve=round(self.expected_output))
        f.private = self._private_blocks(f, 0)
        self._inflight[request_id] = f
        self._prefilling.add(request_id)
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker(refs=KeyRefs() if compiled() else {})
        ld = w.load
        ld.active_blocks += self._count_in(w, f, keys)
        ld.running += 1
        ld.active_blocks += f.private
        ld.pending_prefill_tokens += prefill_tokens
        ld.prefilling += 1
        ld.context_tokens += prompt_tokens
        ld.unwritten_tokens += f.reserve
        ld.routed_prefill_tokens += prefill_tokens

    def _count_in(self, w: _Worker, f: _InFlight, keys: Sequence[Hashable]) -> int:
        """Counts request ``f``'s prompt ``keys`` on its worker ``w``; returns how many were not counted there
        yet."""
        refs = w.refs
        if isinstance(refs, KeyRefs):
            f.arr = key_array(keys)  # (the array block_keys made them from, where it is attached to the list)
            if f.arr is not None:
                return refs.add(f.arr)
            refs = w.refs = self._to_dict(f.worker, refs)  # a key the table cannot hold
        assert isinstance(refs, dict)
        f.keys = tuple(keys)
        f.distinct = len(set(f.keys)) == len(f.keys)
        if f.distinct:  # every count up by one in one pass (the router does this for every request)
            counts = list(map(refs.get, f.keys, repeat(0)))
            refs.update(zip(f.keys, map(_PLUS_ONE, counts), strict=True))
            return counts.count(0)
        new = 0
        for k in f.keys:
            n = refs.get(k, 0)
            refs[k] = n + 1
            new += n == 0
        return new

    def _to_dict(self, worker: StreamId, refs: KeyRefs) -> dict[Hashable, int]:
        """``worker``'s counts moved into a dict for good, its in-flight requests with them. O(keys + in flight)."""
        for g in self._inflight.values():
            if g.worker == worker and g.arr is not None:
                g.keys, g.arr = tuple(g.arr.tolist()), None
                g.distinct = len(set(g.keys)) == len(g.keys)
        return refs.to_dict()

    def _private_blocks(self, f: _InFlight, generated: int) -> int:
        return -(-(f.prompt_tokens + generated) // self.block_size) - f.blocks

    def prefill_done(self, request_id: str) -> None:
        """The request produced its first token; idempotent."""
        if request_id in self._prefilling:
            self._prefilling.discard(request_id)
            f = self._inflight[request_id]
            ld = self._workers[f.worker].load
            ld.pending_prefill_tokens -= f.prefill_tokens
            ld.prefilling -= 1

    def progress(self, request_id: str, generated: int) -> None:
        """The request has generated ``generated`` tokens so far: its private blocks grow. Unknown ids
        are ignored."""
        f = self._inflight.get(request_id)
        if f is None:
            return
        private = self._private_blocks(f, generated)
        ld = self._workers[f.worker].load
        ld.active_blocks += private - f.private
        ld.generated_blocks += private - f.private
        ld.context_tokens += generated - f.generated
        ld.unwritten_tokens += max(0, f.reserve - generated) - max(0, f.reserve - f.generated)
        f.private = private
        f.generated = generated

    def finish(self, request_id: str, generated: int | None = None) -> None:
        """The request completed (or failed). ``generated``: its output length, if known; it updates
        :attr:`expected_output` (None leaves the estimate alone). Unknown ids are ignored."""
        self.prefill_done(request_id)
        f = self._inflight.get(request_id)
        if f is None:
            return
        if generated is not None:
            self.progress(request_id, generated)
            e = self.expected_output
            self.expected_output = float(generated) if e == 0.0 else e + (generated - e) * self._OUTPUT_WEIGHT
        del self._inflight[request_id]
        w = self._workers[f.worker]
        ld = w.load
        refs = w.refs
        if f.arr is not None:
            assert isinstance(refs, KeyRefs)
            ld.active_blocks -= refs.drop(f.arr)
        elif f.distinct:  # in bulk: keys only this request held go, the others count one less
            assert isinstance(refs, dict)
            counts = list(map(refs.__getitem__, f.keys))
            gone = counts.count(1)
            if gone == len(counts):
                deque(map(refs.__delitem__, f.keys), maxlen=0)
            else:
                deque(map(refs.__delitem__, compress(f.keys, map(_IS_ONE, counts))), maxlen=0)
                kept = compress(f.keys, map(_OVER_ONE, counts))
                refs.update(zip(kept, map(_MINUS_ONE, filter(_OVER_ONE, counts)), strict=True))
            ld.active_blocks -= gone
        else:
            assert isinstance(refs, dict)
            for k in f.keys:
                n = refs[k] - 1
                if n:
                    refs[k] = n
                else:
                    del refs[k]
                    ld.active_blocks -= 1
        ld.running -= 1
        ld.active_blocks -= f.private
        ld.generated_blocks -= f.private - self._private_blocks(f, 0)
        ld.context_tokens -= f.prompt_tokens + f.generated
        ld.unwritten_tokens -= max(0, f.reserve - f.generated)
        ld.routed_prefill_tokens -= f.prefill_tokens

    def _check(self) -> None:
        totals: dict[StreamId, WorkerLoad] = {}
        refs: dict[StreamId, dict[Hashable, int]] = {}
        for rid, f in self._inflight.items():
            t = totals.setdefault(f.worker, WorkerLoad())
            r = refs.setdefault(f.worker, {})
            t.running += 1
            t.active_blocks += f.private
            t.generated_blocks += f.private - self._private_blocks(f, 0)
            t.context_tokens += f.prompt_tokens + f.generated
            t.unwritten_tokens += max(0, f.reserve - f.generated)
            t.routed_prefill_tokens += f.prefill_tokens
            for k in f.key_list():
                r[k] = r.get(k, 0) + 1
            if rid in self._prefilling:
                t.pending_prefill_tokens += f.prefill_tokens
                t.prefilling += 1
        for w, r in refs.items():
            totals[w].active_blocks += len(r)
        for w, state in self._workers.items():
            held = state.refs.to_dict() if isinstance(state.refs, KeyRefs) else state.refs
            assert held == refs.get(w, {}), f"prompt block references of {w} out of sync"
            assert state.load == totals.get(w, WorkerLoad()), \
                f"load of {w} out of sync: {state.load} != {totals.get(w)}"


class LoadView(Protocol):
    """What routing reads of the in-flight loads: a :class:`LoadTracker`, or a :class:`PoolLoads` over two."""

    @property
    def block_size(self) -> int: ...

    @property
    def expected_output(self) -> float: ...

    def load(self, worker: StreamId) -> WorkerLoad: ...

    def shared_blocks(self, worker: StreamId, keys: Sequence[Hashable]) -> int: ...

    def load_and_shared(self, worker: StreamId, keys: Sequence[Hashable]) -> tuple[WorkerLoad, int]: ...

    def loads_and_shared(self, workers: Sequence[StreamId],
                         keys: Sequence[Hashable]) -> tuple[list[WorkerLoad], list[int]]: ...


class PoolLoads:
    """One pool's view of a disaggregated pool's loads where some workers serve both roles (``both``): each side
    books in its own tracker (a prefill until the first token, a decode until the finish), but such a worker's engine
    runs what both booked, so its load is the two added, and the prefix its in-flight requests hold the longer
    side's; any other worker's is ``own``'s alone. Read only. A prompt block booked on both sides counts twice in
    ``active_blocks`` (an upper bound: the two may share it). O(1) more than a tracker per worker of ``both``."""

    def __init__(self, own: LoadTracker, other: LoadTracker, both: Collection[StreamId]) -> None:
        self.own, self.other, self.both = own, other, frozenset(both)

    @property
    def block_size(self) -> int:
        return self.own.block_size

    @property
    def expected_output(self) -> float:
        return self.own.expected_output

    def load(self, worker: StreamId) -> WorkerLoad:
        ld = self.own.load(worker)
        return ld.plus(self.other.load(worker)) if worker in self.both else ld

    def shared_blocks(self, worker: StreamId, keys: Sequence[Hashable]) -> int:
        return self.load_and_shared(worker, keys)[1]

    def load_and_shared(self, worker: StreamId, keys: Sequence[Hashable]) -> tuple[WorkerLoad, int]:
        loads, shared = self.loads_and_shared((worker,), keys)
        return loads[0], shared[0]

    def loads_and_shared(self, workers: Sequence[StreamId],
                         keys: Sequence[Hashable]) -> tuple[list[WorkerLoad], list[int]]:
        loads, shared = self.own.loads_and_shared(workers, keys)
        at = [i for i, w in enumerate(workers) if w in self.both]
        if not at:
            return loads, shared
        loads, shared = list(loads), list(shared)
        more, held = self.other.loads_and_shared([workers[i] for i in at], keys)
        for i, ld, n in zip(at, more, held, strict=True):
            loads[i], shared[i] = loads[i].plus(ld), max(shared[i], n)
        return loads, shared
