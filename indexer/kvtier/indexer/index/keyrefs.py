"""Reference counts of prompt block keys in a compiled table: the router's in-flight bookkeeping per worker.

:class:`kvtier.indexer.routing.load.LoadTracker` counts, per worker, the in-flight requests using each prompt block
key: it moves a whole prompt's counts when a request is routed and when it finishes, and binary-searches the held
prefix of every candidate worker on every routing decision. In a dict that is a boxed int per count and an
interpreter round trip per key and request; here it is one compiled call over the prompt's keys as a ``uint64``
array (:func:`kvtier.indexer.index.tablekernel.ref_add`, ``ref_drop``, ``held_prefix``).

Only ``int`` keys in ``[0, 2**64)`` fit (router block keys are): :func:`key_array` says None for anything else, and
the tracker keeps that worker's counts in a dict from then on (:meth:`KeyRefs.to_dict`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.keytable import KERNELS, KEY, VAL, RowTable

U64 = npt.NDArray[np.uint64]


def compiled() -> bool:
    """Whether the table kernels load (numba), so that counts can live in a :class:`KeyRefs`. O(1) once loaded."""
    return KERNELS.get() is not None


def key_array(keys: Sequence[Hashable]) -> U64 | None:
    """``keys`` as the ``uint64`` array the kernels take (the one :func:`kvtier.indexer.index.keys.block_keys` made them
    from, when attached), or None if one is not an ``int`` in ``[0, 2**64)``. O(keys)."""
    if isinstance(keys, np.ndarray):  # (an array of ints: the keys its elements are equal to)
        if keys.dtype == np.uint64:
            return keys
        if keys.dtype.kind not in "iu" or (keys.dtype.kind == "i" and bool((keys < 0).any())):
            return None
        return keys.astype(np.uint64)
    arr: U64 | None = getattr(keys, "arr", None)
    if arr is not None and len(arr) == len(keys):
        return arr
    if not all(type(k) is int for k in keys):  # (a numpy int or a bool would come back as an int)
        return None
    try:
        return np.array(keys, dtype=np.uint64) if keys else np.zeros(0, np.uint64)
    except OverflowError:  # negative, or past 2**64
        return None


class KeyRefs:
    """Key -> count of the in-flight requests using it (absent at zero), for ``int`` keys. Single-threaded."""

    __slots__ = ("_firsts", "_t")

    def __init__(self) -> None:
        self._t = RowTable(1)  # key -> count, in the value column
        # First key of each counted prompt -> prompts it starts. With chained keys a key that starts a prompt can
        # only sit first in another, so most workers are told apart from a query's first key here, without a
        # compiled call (routing asks every worker).
        self._firsts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._t)

    def add(self, keys: U64) -> int:
        """Each key's count up by one; returns how many keys were absent (a key twice in ``keys`` is absent at most
        once). O(keys)."""
        t = self._t
        while (new := int(t.k.ref_add(t.r, t.m, keys))) < 0:
            t.reserve(len(keys))  # then again: nothing moved
        if len(keys):
            first = int(keys[0])
            self._firsts[first] = self._firsts.get(first, 0) + 1
        return new

    def drop(self, keys: U64) -> int:
        """Each key's count down by one; returns how many went (their count was one). Every key must be counted
        (once more for each time it repeats). O(keys)."""
        t = self._t
        gone = int(t.k.ref_drop(t.r, t.m, keys))
        assert gone >= 0, f"reference count of key {int(keys[-1 - gone])} dropped below zero"
        if len(keys):
            first = int(keys[0])
            n = self._firsts[first] - 1
            if n:
                self._firsts[first] = n
            else:
                del self._firsts[first]
        return gone

    def held_prefix(self, keys: U64, first: int) -> int:
        """How many leading ``keys`` (``first``: ``keys[0]`` as an int) are counted, by binary search: ``keys``, and
        those counted, must be chained (a counted key's whole prefix is counted, and sits where it does in the
        query), as router block keys are. O(log keys)."""
        return KeyRefs.held_prefixes((self,), keys, first)[0]

    @staticmethod
    def held_prefixes(refs: Sequence[KeyRefs | None], keys: U64, first: int) -> list[int]:
        """:meth:`held_prefix` of each of ``refs`` (None: nothing counted), in one loop: routing asks it of every
        worker on every request. O(len(refs) * log keys)."""
        out = []
        for r in refs:
            if r is None or first not in r._firsts:
                out.append(0)
            else:
                t = r._t
                out.append(int(t.k.held_prefix(t.r, keys)))
        return out

    def to_dict(self) -> dict[Hashable, int]:
        """The counts, as a dict. O(keys counted)."""
        t = self._t
        rows = t.used()
        out: dict[Hashable, int] = dict(zip(t.r[rows, KEY].tolist(), t.r[rows, VAL].tolist(), strict=True))
        return out
