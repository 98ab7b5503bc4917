"""The workers an index knows, and the mask slots they own.

Each worker stream owns one slot: its bits sit at ``TIERS * slot`` in every mask
(:mod:`kvtier.indexer.index.masklayout`). A removed worker's slot is taken by the next worker added, lowest first,
so that masks stay as wide as the most workers held at once rather than as all workers ever seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, ValuesView

from kvtier.indexer.index.workerstate import WorkerState
from kvtier.wire.notices import StreamId
from kvtier.wire.overlap import TierOverlap

__all__ = ["WorkerSlots"]

_ZERO = TierOverlap(0, 0, 0, 0)  # the overlap of every worker that holds none of a query (shared: frozen)


class WorkerSlots:
    """Worker streams to their :class:`WorkerState`, and slots to the workers that own them.

    Invariants (asserted by :meth:`_check`): slots are unique; :attr:`owners` maps exactly the live slots to
    their workers; no slot is both live and free; every slot is below :attr:`end`.
    """

    __slots__ = ("_free", "_new", "_zeros", "end", "owners", "workers")

    def __init__(self, new: Callable[[StreamId, int], WorkerState]) -> None:
        """``new(stream, slot)``: the state of a worker added at ``slot``."""
        self.workers: dict[StreamId, WorkerState] = {}  # in the order they were added
        self.owners: dict[int, StreamId] = {}  # slot -> its worker (the depth finders read this very dict)
        self.end = 0  # one past the highest slot ever owned: no mask has bits of a slot at or past it
        self._free: list[int] = []  # slots of removed workers, taken again lowest first
        self._new = new
        # Every worker with no overlap, in the order of ``workers``: queries copy it (None: build it again, as
        # the workers changed).
        self._zeros: dict[StreamId, TierOverlap] | None = None

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, stream: StreamId) -> bool:
        return stream in self.workers

    def __iter__(self) -> Iterator[StreamId]:
        return iter(self.workers)

    def __getitem__(self, stream: StreamId) -> WorkerState:
        """The worker's state; ``KeyError`` for a worker the index does not know. O(1)."""
        return self.workers[stream]

    def get(self, stream: StreamId) -> WorkerState | None:
        return self.workers.get(stream)

    def values(self) -> ValuesView[WorkerState]:
        return self.workers.values()

    def add(self, stream: StreamId) -> WorkerState:
        """The worker's state, added at the lowest free slot (else at :attr:`end`) if it is new. O(1), O(free
        slots) when one is taken again."""
        w = self.workers.get(stream)
        if w is None:
            if self._free:
                slot = min(self._free)
                self._free.remove(slot)
            else:
                slot = self.end
                self.end += 1
            w = self.workers[stream] = self._new(stream, slot)
            self.owners[slot] = stream
            self._zeros = None
        return w

    def remove(self, stream: StreamId) -> WorkerState | None:
        """Forgets the worker and frees its slot; its state, or None if it was unknown. The caller clears its
        bits first: a freed slot has none left anywhere. O(1)."""
        w = self.workers.pop(stream, None)
        if w is not None:
            del self.owners[w.slot]
            self._free.append(w.slot)
            self._zeros = None
        return w

    def zeros(self) -> dict[StreamId, TierOverlap]:
        """A fresh dict of every worker with no overlap, in the order they were added. O(workers) (a copy,
        cheaper than building it anew for hundreds of workers)."""
        if self._zeros is None:
            self._zeros = dict.fromkeys(self.workers, _ZERO)
        return self._zeros.copy()

    def _check(self) -> None:
        """Asserts the invariants in the class docstring. O(workers)."""
        slots = [w.slot for w in self.workers.values()]
        assert len(set(slots)) == len(slots), f"duplicate slots {slots}"
        assert self.owners == {w.slot: s for s, w in self.workers.items()}, "slot owners out of sync"
        assert all(w.stream == s for s, w in self.workers.items()), "a worker's state filed under another stream"
        assert not set(slots) & set(self._free), "a live slot is also free"
        assert all(s < self.end for s in slots + self._free), "slot beyond end"
        assert self._zeros is None or list(self._zeros) == list(self.workers), "cached zero overlaps out of date"
