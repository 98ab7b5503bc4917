"""The index's compiled storage, seen from Python: the block-key table and the per-worker engine-hash tables.

:class:`KeyTable` (key -> mask) and :class:`EngineHashes` (engine hash -> key) own the arrays of
:mod:`kvtier.indexer.index.tablekernel` and read as mutable mappings (``get``, ``[]``, ``in``, ``del``,
iteration), one compiled call per operation, for the index's rare paths (snapshots, ``_check``, window KV,
block-by-block stores); the paths every event takes call the kernels on whole arrays
(:class:`kvtier.indexer.index.blockmasks.BlockMasks`).

A block's row holds the id of its mask in a :class:`MaskPool`, which keeps each distinct mask once (most blocks
share a few: one worker, one tier), so a row is three words however many workers there are; a mask wider than
the pool's words (a 17th worker slot) widens the pool. Engine hashes are kept as their 64 bits while a worker's
are all ``int64`` (SGLang) or all ``uint64`` (vLLM); one that is neither, or ``bytes``, moves that worker's
engine hashes into a Python dict for good (:meth:`EngineHashes.int64s`), since the table could not give the same
object back.

A block's links (parent -> child, for :mod:`kvtier.indexer.index.closure`) live in its row of the
:class:`KeyTable`: links die with their parent (no worker holds it), so a table of their own only cost a
third probe per block and a third table to grow.
"""

from __future__ import annotations

import array
import os
from collections.abc import Collection, Iterator, MutableMapping
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.masklayout import SLOT_MASK, SLOTS_PER_WORD, TIERS
from kvtier.kernels.jit import LazyKernels
from kvtier.util.helperthread import HelperThread
from kvtier.wire.protocol import EngineHash

#: The columns every row of a table starts with (:mod:`kvtier.indexer.index.tablekernel`): its key, non-zero if it is
#: used, then its values.
KEY, USED, VAL = 0, 1, 2
#: The masks' table (:class:`KeyTable`) keeps a block's links in its row: its one child in the column after the
#: mask's id, and in ``USED`` whether it has children: ``LINKS_NONE``, ``LINKS_ONE`` (that child) or ``LINKS_SET``
#: (a set kept in Python: :class:`kvtier.indexer.index.closure.PrefixClosure`). Any of them reads as used.
CHILD = VAL + 1
LINKS_NONE, LINKS_ONE, LINKS_SET = 1, 2, 3
#: The mask pool's counters (:class:`MaskPool`): entries of its content table, free ids, ids handed out, then
#: one count per id and the stack of free ids.
_PH, _PFREE, _PTOP, _PREF = 0, 1, 2, 3
#: The store kernel's (``tablekernel.store_tokens``) modes: a chain under the root, under the root of a LoRA / salt
#: key space (its id is the base), or under the block an engine hash names in the worker's table.
ROOT, ROOT_NS, UNDER = 0, 1, 2
_M64 = (1 << 64) - 1
_SIGN = 1 << 63
_MIN_CAP = 1024

#: The table kernels. Each is compiled (or loaded from numba's cache) on its first call: a batch run pays
#: for those it uses, about half of them; a service loads them all before it serves (:func:`warm_tables`).
KERNELS = LazyKernels("kvtier.indexer.index.tablekernel", lambda k: None, required=True)


def warm_tables(only: Collection[str] | None = None) -> str:
    """Loads every table kernel now, or those named in ``only`` (seconds when numba's cache is cold), so that no
    event or query pays for one; ``"numba"`` (:class:`kvtier.kernels.jit.KernelsUnavailable` where it cannot load).
    Under a millisecond once they are loaded."""
    k = KERNELS.require()
    k.warm(k if only is None else _Only(k, frozenset(only)))
    return str(KERNELS.backend)


class _Only:
    """The kernel module with each kernel not in ``names`` read as a no-op answering 0, so that its ``warm`` loads
    only those; a name that is no kernel raises."""

    __slots__ = ("_k", "_names")

    def __init__(self, k: Any, names: frozenset[str]) -> None:
        unknown = sorted(n for n in names if not callable(getattr(k, n, None)))
        assert not unknown, f"no table kernels named {unknown}"
        self._k = k  # the kernel module
        self._names = names  # the kernels to load

    def __getattr__(self, name: str) -> Any:
        return getattr(self._k, name) if name in self._names else _skip


def _skip(*args: object) -> int:
    return 0


U64 = npt.NDArray[np.uint64]


#: A table whose next size is at least this many bytes gets that size's memory ready ahead of its growth
#: (:meth:`RowTable.prepare`).
PREFAULT_BYTES = 8 << 20
_HELPER = HelperThread("kvtier-prefault")  # the thread that touches tables' next sizes (_Prefaulted)


class _Prefaulted:
    """Zeros for a table's next size, written by a helper thread while events keep coming: on this kind of machine
    most of a growth is the page faults of touching fresh memory, several times the rehash into it
    (``bench/MEASUREMENTS.md``), and the table must not stall the event loop for them.
    numpy's ``fill`` releases the GIL, so the faults run on another core."""

    __slots__ = ("arr", "done", "pid")

    def __init__(self, shape: tuple[int, int]) -> None:
        self.arr = np.empty(shape, np.uint64)  # untouched until the helper fills it
        self.pid = os.getpid()  # the process whose helper fills it
        self.done = _HELPER.submit(self.arr.fill, 0)

    def take(self, shape: tuple[int, int]) -> U64 | None:
        """The zeros, once written, if they have ``shape``; else None (the table grew otherwise). Waits for the
        helper if it is not done. O(1) when it is."""
        if self.pid != os.getpid() and not self.done.done():  # forked while it was filling: that thread is gone
            self.arr.fill(0)
        else:
            self.done.result()  # (raises what the helper raised: a failure is never swallowed)
        return self.arr if self.arr.shape == shape else None


class RowTable:
    """One open-addressing table (:mod:`kvtier.indexer.index.tablekernel`): ``r`` its rows (key, used flag, ``width``
    values), ``m[0]`` its entries (``m[1]`` a sink). The load stays at most 3/4."""

    __slots__ = ("_next", "k", "m", "r")

    def __init__(self, width: int, cap: int = _MIN_CAP) -> None:
        self.k: Any = KERNELS.require()  # the kernel module
        self.r = np.zeros((cap, VAL + width), np.uint64)  # rows
        # [entries, a sink for reads that only warm the cache (tablekernel._touch): a value stored where the caller
        # can see it keeps the compiler from dropping them; never read]
        self.m = np.zeros(2, np.int64)
        self._next: _Prefaulted | None = None  # the next size's rows, being zeroed ahead (prepare)

    def __len__(self) -> int:
        return int(self.m[0])

    def prepare(self) -> None:
        """Called once the table is past 5/8 full (the store kernel says so): starts zeroing its next size on the
        helper thread, where that is at least ``PREFAULT_BYTES``, so that the growth at 3/4 finds its memory
        touched. O(1) here; the zeroing is O(next size), on the helper."""
        if self._next is None:
            cap, cols = self.r.shape
            if 2 * cap * cols * 8 >= PREFAULT_BYTES:
                self._next = _Prefaulted((2 * cap, cols))

    def reserve(self, n: int) -> None:
        """Room for ``n`` more entries: doubles the table while they would take it past 3/4. O(cap) when it
        grows, else O(1)."""
        cap = self.r.shape[0]
        need = int(self.m[0]) + n
        if need * 4 <= cap * 3:
            return
        while need * 2 > cap:  # grown tables start half full at most, so that growth stays amortised
            cap *= 2
        self._rebuild(cap, self.r.shape[1])

    def _rebuild(self, cap: int, cols: int) -> None:
        ahead, self._next = self._next, None
        n = ahead.take((cap, cols)) if ahead is not None else None
        if n is None:
            n = np.zeros((cap, cols), np.uint64)
        self.k.rehash(self.r, n)
        self.r = n

    def clear(self) -> None:
        """Drops every entry and shrinks back to the first capacity. O(1)."""
        self._next = None
        self.r = np.zeros((_MIN_CAP, self.r.shape[1]), np.uint64)
        self.m[0] = 0

    def slot(self, k: int) -> int:
        """The row of key ``k`` (a ``uint64`` value), or -1. O(1)."""
        return int(self.k.find(self.r, np.uint64(k)))

    def delete(self, k: int) -> None:
        """Removes key ``k``; ``KeyError`` if absent. O(1) expected."""
        i = self.slot(k)
        if i < 0:
            raise KeyError(k)
        self.k.delete_at(self.r, self.m, i)

    def used(self) -> npt.NDArray[np.int64]:
        """The used rows. O(cap)."""
        out: npt.NDArray[np.int64] = self.k.used_rows(self.r)
        return out

    def put_slot(self, k: int) -> int:
        """The row of key ``k``, claimed (with zero values) if absent. O(1) expected."""
        self.reserve(1)
        i = int(self.k.claim(self.r, self.m, np.uint64(k)))
        return -1 - i if i < 0 else i


class MaskPool:
    """Each distinct mask once, by id, with a reference count and a table from content to id (the kernels'
    ``pm``, ``ph``, ``pa``: :mod:`kvtier.indexer.index.tablekernel`). Id 0 is the empty mask."""

    __slots__ = ("k", "pa", "ph", "pm")

    def __init__(self, k: Any, cap: int = _MIN_CAP) -> None:
        self.k = k  # the kernel module
        self.pm = np.zeros((cap, 1), np.uint64)  # id -> the mask's words
        self.ph = np.zeros((2 * cap, VAL + 1), np.uint64)  # content hash, used, id
        self.pa = np.zeros(_PREF + 2 * cap, np.int64)  # [ph entries, free ids, ids handed out, counts, free ids]
        self.pa[_PTOP] = 1

    def reserve(self, n: int) -> None:
        """Room for ``n`` new masks. O(masks) when it grows, else O(1)."""
        cap = self.pm.shape[0]
        if int(self.pa[_PTOP]) + n > cap:
            new = cap
            while int(self.pa[_PTOP]) + n > new:
                new *= 2
            pm = np.zeros((new, self.pm.shape[1]), np.uint64)
            pm[:cap] = self.pm
            pa = np.zeros(_PREF + 2 * new, np.int64)
            pa[:_PREF + cap] = self.pa[:_PREF + cap]  # the counters and every id's count
            free = int(self.pa[_PFREE])
            pa[_PREF + new:_PREF + new + free] = self.pa[_PREF + cap:_PREF + cap + free]
            self.pm, self.pa = pm, pa
        hcap = self.ph.shape[0]
        if (int(self.pa[_PH]) + n) * 4 > hcap * 3:
            while (int(self.pa[_PH]) + n) * 2 > hcap:
                hcap *= 2
            ph = np.zeros((hcap, VAL + 1), np.uint64)
            self.k.rehash(self.ph, ph)
            self.ph = ph

    def widen(self, words: int) -> None:
        """Masks of ``words`` words (zero words hash to nothing, so the content table stays). O(masks)."""
        if words > self.pm.shape[1]:
            self.pm = np.pad(self.pm, ((0, 0), (0, words - self.pm.shape[1])))

    def masks(self, ids: npt.NDArray[np.int64]) -> list[int]:
        """The masks of ``ids``, as ints. O(ids * words)."""
        if self.pm.shape[1] == 1:
            out: list[int] = self.pm[ids, 0].tolist()
            return out
        return [int.from_bytes(r.tobytes(), "little") for r in self.pm[ids]]


class KeyTable(RowTable, MutableMapping[BlockKey, int]):
    """Block key -> mask (:mod:`kvtier.indexer.index.masklayout`), as the index's ``masks``: a key nobody holds is
    absent. A row holds its mask's id in ``pool`` (``SLOTS_PER_WORD`` worker slots per word of a mask), then the
    block's links (``CHILD``, and their state in ``USED``), which the mapping interface leaves as they are."""

    __slots__ = ("pool",)

    def __init__(self) -> None:
        super().__init__(2)
        self.pool = MaskPool(self.k)  # the distinct masks

    @property
    def words(self) -> int:
        return int(self.pool.pm.shape[1])

    def widen(self, slots: int) -> None:
        """Room for masks of ``slots`` worker slots. O(masks) when it widens, else O(1)."""
        self.pool.widen(-(-slots // SLOTS_PER_WORD))

    def mask_at(self, i: int) -> int:
        """The mask of row ``i``, as one int. O(words)."""
        return self.pool.masks(self.r[i:i + 1, VAL].view(np.int64))[0]

    def masks_at(self, rows: npt.NDArray[np.int64]) -> list[int]:
        """The masks of rows ``rows``, as ints. O(rows * words)."""
        return self.pool.masks(self.r[rows, VAL].view(np.int64))

    def get(self, key: BlockKey, default: Any = None) -> Any:
        i = self.slot(key)
        return default if i < 0 else self.mask_at(i)

    def __getitem__(self, key: BlockKey) -> int:
        i = self.slot(key)
        if i < 0:
            raise KeyError(key)
        return self.mask_at(i)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and 0 <= key <= _M64 and self.slot(key) >= 0

    def __setitem__(self, key: BlockKey, m: int) -> None:
        assert m > 0, f"key {key:#x}: a mask must not be empty (absent keys are nobody's)"
        self.widen(-(-m.bit_length() // 4))
        self.reserve(1)
        p = self.pool
        p.reserve(1)
        words = np.frombuffer(m.to_bytes(8 * self.words, "little"), np.uint64)
        self.k.set_mask(self.r, self.m, p.pm, p.ph, p.pa, np.uint64(key), words)

    def __delitem__(self, key: BlockKey) -> None:
        p = self.pool
        if not self.k.del_mask(self.r, self.m, p.pm, p.ph, p.pa, np.uint64(key)):
            raise KeyError(key)

    def items(self) -> list[tuple[BlockKey, int]]:  # type: ignore[override]
        rows = self.used()
        return list(zip(self.r[rows, KEY].tolist(), self.masks_at(rows), strict=True))

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self.r[self.used(), KEY].tolist())

    def __len__(self) -> int:
        return int(self.m[0])

    def clear(self) -> None:
        super().clear()
        self.pool = MaskPool(self.k)

    def _check(self) -> None:
        """Asserts the pool's invariants against the rows: every row holds a non-empty mask's id, each id's count
        is the rows holding it, the content table names each live mask once, and the free ids are the rest.
        O(cap + masks)."""
        p = self.pool
        cap = p.pm.shape[0]
        ids = self.r[self.used(), VAL].astype(np.intp)
        assert not (ids == 0).any(), "a row holds the empty mask"
        refs = p.pa[_PREF:_PREF + cap]
        held = np.bincount(ids, minlength=cap)
        assert (held == refs).all(), f"mask counts out of sync with the rows at ids {np.flatnonzero(held != refs)}"
        live = np.flatnonzero(refs)
        named = np.sort(p.ph[p.ph[:, USED] == 1, VAL].astype(np.intp))
        assert int(p.pa[_PH]) == len(named) and (named == live).all(), "the content table and the live masks differ"
        assert len({p.pm[i].tobytes() for i in live}) == len(live), "two ids for one mask"
        free = p.pa[_PREF + cap:_PREF + cap + int(p.pa[_PFREE])]
        assert len(set(free.tolist())) == len(free) and not refs[free].any(), "a free id is in use"
        assert len(live) + len(free) + 1 == int(p.pa[_PTOP]), "ids lost (neither live nor free)"

    def slot_bits(self, keys: U64, slot: int) -> npt.NDArray[np.uint8]:
        """Per key, the ``TIERS`` bits of worker slot ``slot`` in its mask (0 for a key nobody holds), for a
        snapshot. O(keys)."""
        word, shift = divmod(slot, SLOTS_PER_WORD)
        if not len(keys) or word >= self.words:
            return np.zeros(len(keys), np.uint8)
        rows = self.k.find_all(self.r, keys)
        ids = np.where(rows >= 0, self.r[rows, VAL], 0).astype(np.intp)  # (id 0: the empty mask)
        out: npt.NDArray[np.uint8] = ((self.pool.pm[ids, word] >> np.uint64(TIERS * shift))
                                      & np.uint64(SLOT_MASK)).astype(np.uint8)
        return out

    def add_slot_bits(self, keys: U64, bits: npt.NDArray[np.uint8], slot: int) -> None:
        """Sets each key's ``bits`` (a slot's ``TIERS`` bits each) at worker slot ``slot``, for a restored snapshot;
        ``ValueError`` naming a key given twice, or one that carries the slot's bits already (the keys before it
        are set). O(keys)."""
        self.widen(slot + 1)
        word, shift = divmod(slot, SLOTS_PER_WORD)
        slot_bits = np.uint64(SLOT_MASK << (TIERS * shift))
        self.reserve(len(keys))
        for b in np.unique(bits).tolist():  # a call per distinct bits, so that a run of blocks shares one lookup
            sel = keys[bits == b]
            done = 0
            while done < len(sel):
                p = self.pool
                at = int(self.k.add_bits(self.r, self.m, p.pm, p.ph, p.pa, sel, done, word,
                                         np.uint64(b << (TIERS * shift)), slot_bits))
                if at < 0:
                    raise ValueError(f"block {int(sel[-1 - at]):#x} given twice")
                if at == done:  # no room: make it (the pool grows by doubling, so this happens O(log masks) times)
                    self.reserve(len(sel) - done)
                    p.reserve(1)
                done = at

    def array(self, keys: list[BlockKey]) -> U64:
        """``keys`` as the ``uint64`` array the kernels take (the array ``block_keys`` made them from, when it
        is attached). O(keys)."""
        arr: U64 | None = getattr(keys, "arr", None)
        return arr if arr is not None and len(arr) == len(keys) else np.array(keys, dtype=np.uint64)


def _packed(ehs: list[EngineHash]) -> tuple[U64, bool | None] | None:
    """``ehs`` as an empty table would hold them (:meth:`EngineHashes.int64s`): their 64 bits and how they read back
    (True: some are negative; False: some are past 2**63; None: neither), or None where no table can (a hash that is
    no int, negative ones beside ones past 2**63). O(len(ehs))."""
    try:
        try:
            arr = np.frombuffer(array.array("q", ehs), np.int64)  # type: ignore[type-var]
        except OverflowError:  # one past 2**63: all unsigned, or none fits
            return np.frombuffer(array.array("Q", ehs), np.uint64), False  # type: ignore[type-var]
    except (OverflowError, TypeError, ValueError):
        return None
    return arr.view(np.uint64), True if (arr < 0).any() else None


class EngineHashes(RowTable, MutableMapping[EngineHash, BlockKey]):
    """One worker's engine hash -> key, as ``WorkerState.hashes``: a compiled table while its engine hashes are all
    ``int64`` (SGLang) or all ``uint64`` (vLLM), each stored as its 64 bits; a Python dict (``py``) from the first
    one that fits neither the table nor the signedness seen so far."""

    __slots__ = ("py", "signed")

    def __init__(self) -> None:
        super().__init__(1, 64)
        self.py: dict[EngineHash, BlockKey] | None = None  # set once a hash the table cannot hold came
        # True once a negative hash came, False once one past 2**63 did; None while every one is in both ranges.
        self.signed: bool | None = None

    def fits(self, eh: object) -> bool:
        """Whether ``eh`` is an int the table can hold beside the hashes it has. O(1)."""
        if type(eh) is not int:
            return False
        if eh < 0:
            return eh >= -_SIGN and self.signed is not False
        return eh < _SIGN or (eh <= _M64 and self.signed is not True)

    def _sign(self, eh: int) -> None:
        if eh < 0:
            self.signed = True
        elif eh >= _SIGN:
            self.signed = False

    def demote(self) -> dict[EngineHash, BlockKey]:
        """Moves every entry into a Python dict, kept from now on. O(entries)."""
        if self.py is None:
            self.py = dict(self._items())
            super().clear()
        return self.py

    def int64s(self, ehs: list[EngineHash]) -> U64 | None:
        """``ehs`` as the ``uint64`` array of their 64 bits for the kernels, or None: this worker's hashes live in a
        dict (now, if ``ehs`` has one the table cannot hold). O(len(ehs))."""
        if self.py is not None:
            return None
        # (array.array takes ints only: numpy would parse a bytes hash of ASCII digits, b"12", as the int 12)
        try:
            if self.signed is False:  # unsigned hashes (vLLM): a negative one raises OverflowError
                return np.frombuffer(array.array("Q", ehs), np.uint64)  # type: ignore[type-var]
            try:
                arr = np.frombuffer(array.array("q", ehs), np.int64)  # type: ignore[type-var]
            except OverflowError:  # one past 2**63: unsigned, unless negative ones came before
                if self.signed:
                    raise
                uarr = np.frombuffer(array.array("Q", ehs), np.uint64)  # type: ignore[type-var]
                self.signed = False
                return uarr
            # Negative ones, if any, are seen where they are stored (BlockMasks.insert sets ``signed``).
            return arr.view(np.uint64)
        except (OverflowError, TypeError, ValueError):
            self.demote()
            return None

    def _items(self) -> list[tuple[EngineHash, BlockKey]]:
        rows = self.used()
        return list(zip(self._names(rows), self.r[rows, VAL].tolist(), strict=True))

    def _names(self, rows: npt.NDArray[np.int64]) -> list[EngineHash]:
        """The engine hashes in slots ``rows``, as the ints they came as. O(rows)."""
        names = self.r[rows, KEY]
        out: list[EngineHash] = (names.view(np.int64) if self.signed else names).tolist()
        return out

    def get(self, eh: EngineHash, default: Any = None) -> Any:
        if self.py is not None:
            return self.py.get(eh, default)
        if not self.fits(eh):
            return default
        i = self.slot(eh & _M64)  # type: ignore[operator]
        return default if i < 0 else BlockKey(int(self.r[i, VAL]))

    def __getitem__(self, eh: EngineHash) -> BlockKey:
        key = self.get(eh)
        if key is None:
            raise KeyError(eh)
        return key  # type: ignore[no-any-return]

    def __contains__(self, eh: object) -> bool:
        if self.py is not None:
            return eh in self.py
        return self.fits(eh) and self.slot(eh & _M64) >= 0  # type: ignore[operator]

    def __setitem__(self, eh: EngineHash, key: BlockKey) -> None:
        if self.py is None and not self.fits(eh):
            self.demote()
        if self.py is not None:
            self.py[eh] = key
            return
        self._sign(eh)  # type: ignore[arg-type]
        i = self.put_slot(eh & _M64)  # type: ignore[operator]
        self.r[i, VAL] = key  # (read after put_slot: a growth replaces ``r``)

    def __delitem__(self, eh: EngineHash) -> None:
        if self.py is not None:
            del self.py[eh]
        elif not self.fits(eh):
            raise KeyError(eh)
        else:
            self.delete(eh & _M64)  # type: ignore[operator]

    def __iter__(self) -> Iterator[EngineHash]:
        if self.py is not None:
            return iter(list(self.py))
        return iter(self._names(self.used()))

    def __len__(self) -> int:
        return len(self.py) if self.py is not None else int(self.m[0])

    def items(self) -> list[tuple[EngineHash, BlockKey]]:  # type: ignore[override]
        return list(self.py.items()) if self.py is not None else self._items()

    def values(self) -> list[BlockKey]:  # type: ignore[override]
        if self.py is not None:
            return list(self.py.values())
        out: list[BlockKey] = self.r[self.used(), VAL].tolist()
        return out

    def export(self) -> tuple[U64 | list[EngineHash], U64, bool | None]:
        """Every entry, for a snapshot: the engine hashes (their 64 bits, or the hashes themselves where no table
        could hold them), the keys they name in the same order, and how 64-bit hashes read back (:attr:`signed`).
        Entries in a dict are written as a table holding them would write them, as :meth:`load` would put them back,
        and the signedness is what the entries held show: the same entries, the same snapshot, whatever their
        history. O(entries)."""
        if self.py is not None:
            ehs, keys = list(self.py), np.array(list(self.py.values()), dtype=np.uint64)
            packed = _packed(ehs)
            return (ehs, keys, self.signed) if packed is None else (packed[0], keys, packed[1])
        rows = self.used()
        names = self.r[rows, KEY]
        # (the signedness of hashes that went: none left has its top bit set, so it changes nothing held; dropped,
        # as _packed drops it)
        return names, self.r[rows, VAL], self.signed if len(names) and int(names.max()) >= _SIGN else None

    def load(self, ehs: U64 | list[EngineHash], keys: U64, signed: bool | None) -> None:
        """Adds :meth:`export`'s entries to an empty table (``signed``: how 64-bit hashes read back); hashes given as
        a list go into the table where they fit it, else into a dict. ``ValueError`` naming an engine hash given
        twice. O(entries)."""
        assert not len(self), "load fills an empty table"
        if isinstance(ehs, list):
            packed = _packed(ehs)
            if packed is None:  # hashes the table cannot hold: a dict
                py = self.demote()
                py.update(zip(ehs, keys.tolist(), strict=True))
                if len(py) != len(ehs):
                    raise ValueError("an engine hash given twice")
                return
            ehs, signed = packed
        elif signed is None and len(ehs) and int(ehs.max()) >= _SIGN:
            raise ValueError("engine hashes past 2**63 without their signedness")
        self.signed = signed
        self.reserve(len(ehs))
        done = int(self.k.put_all(self.r, self.m, ehs, keys))
        if done < 0:
            twice = ehs[-1 - done]
            raise ValueError(f"engine hash {int(twice.view(np.int64)) if signed else int(twice)} given twice")

    def key_array(self) -> U64:
        """Every key named, as an array (table order). O(entries)."""
        if self.py is not None:
            return np.array(list(self.py.values()), dtype=np.uint64)
        out: U64 = self.r[self.used(), VAL]
        return out

    def clear(self) -> None:
        if self.py is not None:
            self.py.clear()
        else:
            super().clear()
            self.signed = None
