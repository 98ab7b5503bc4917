"""Compiled open-addressing tables for the index (numba): key -> mask id, mask -> id, engine hash -> key, links.

A Python dict of millions of int keys costs two or three cache misses and a boxed int per operation, and an
event of 64 blocks needs five such operations per block: about 750,000 blocks a second at best on the dev
machine, half of what the index must apply. Here a table is one ``uint64`` array of rows probed linearly from a
mixed hash (:func:`_home`), a row holding its key, a used flag and its values side by side (one cache miss per
probe), and every operation an event or a query needs runs as one compiled call over all its blocks.

The helpers called once per block that allocate nothing (``find``, ``delete_at``, the mask pool's) are compiled
without numba's reference counting (``_nrt=False``): a compiled function otherwise takes a reference to each array
argument on entry and drops it on exit, an atomic add each, and numba's pruning leaves those in place around
calls inside the kernels' loops, a visible share of every event applied (``bench/MEASUREMENTS.md``).

Tables (see :mod:`kvtier.indexer.index.keytable` for the Python side that owns the arrays):

* ``r`` (``uint64[cap, 2 + V]``): per row the key (column ``KEY``), 1 if the row is used (``USED``), then ``V``
  values from column ``VAL``; ``cap`` is a power of two and ``m[0]`` the number of used rows. Callers reserve
  room before an insertion (the load stays under 3/4, so a probe always ends).
* Deletion shifts later rows of the probe run back (no tombstones), so a lookup stops at the first free row.
* The masks' table: a block key's mask id in the mask pool (below), whose masks are words of
  :mod:`kvtier.indexer.index.masklayout` (16 worker slots per word). An engine-hash table: one value, the key the hash
  names (the hash is stored as its 64 bits). The masks' table keeps each block's links in its row too: its one
  child in column ``CHILD``, and in ``USED`` whether it has none, that one, or a set kept in Python
  (``LINKS_NONE``, ``LINKS_ONE``, ``LINKS_SET``; a lookup only asks whether ``USED`` is zero).

Imported only through :class:`kvtier.kernels.jit.LazyKernels`, as :mod:`kvtier.kernels.keykernel` is. Every
integer is a ``uint64`` or an index, never a plain int mixed with a ``uint64`` (numba would make a float).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from numba import njit

from kvtier.indexer.index.keys import SEED
from kvtier.indexer.index.keytable import (
    _PFREE,
    _PH,
    _PREF,
    _PTOP,
    CHILD,
    KEY,
    LINKS_NONE,
    LINKS_ONE,
    LINKS_SET,
    ROOT,
    UNDER,
    USED,
    VAL,
)
from kvtier.indexer.index.masklayout import DEV, EXT, SLOTS_PER_WORD, TIERS
from kvtier.kernels.keykernel import chain_into

_GOLD = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xD6E8FEB86659FD93)  # an odd constant of a well-tested xor-shift-multiply mixer
_S29 = np.uint64(29)
_HIGH = np.uint64(1 << 63)
_S32 = np.uint64(32)
_SEED = np.uint64(SEED)

Arr = Any  # numpy arrays, as numba sees them
_F = TypeVar("_F", bound=Callable[..., Any])
_NO_NRT: dict[str, Any] = {"_nrt": False}  # (numba's option, which its type stubs do not list)


def _unrefcounted(fn: _F) -> _F:
    """``njit(cache=True)`` without reference counting, for helpers that allocate nothing (module docstring)."""
    return cast(_F, njit(cache=True, **_NO_NRT)(fn))


@njit(cache=True, inline="always")
def _home(k: np.uint64, mask: int) -> int:
    # Engine hashes may be structured ints (sequential, or fields side by side): a multiply alone leaves such
    # keys on a lattice, whose homes cluster (8.7 probes per hit at 57% load on the indexer bench's engine hashes,
    # against 1.7 for random keys), so they go through a full 64-bit mixer (xor-shift-multiply, twice; keys that
    # are hashes already only pay two multiplies). Then the mix's high half is scaled to the table: homes keep
    # their order when the table doubles (row h goes to 2h or 2h + 1), so that a rehash writes the new table
    # front to back instead of at random.
    x = (k ^ (k >> _S32)) * _MIX
    x = (x ^ (x >> _S29)) * _MIX
    return int(((x >> _S32) * np.uint64(mask + 1)) >> _S32) & mask  # (& keeps numba's type an int)


@njit(cache=True, inline="always")
def _probe(r: Arr, k: np.uint64) -> int:
    """The row of ``k``, or ``-1 - row`` for the free row where it would go. O(1) expected."""
    mask = r.shape[0] - 1
    i = _home(k, mask)
    while r[i, USED]:
        if r[i, KEY] == k:
            return i
        i = (i + 1) & mask
    return -1 - i


@njit(cache=True, inline="always")
def _copy_row(dst: Arr, i: int, src: Arr, j: int) -> None:
    """``dst[i, :cols] = src[j, :]`` as a loop: a slice assignment builds two array views, which costs more than
    the few words of a row."""
    for c in range(src.shape[1]):
        dst[i, c] = src[j, c]


@njit(cache=True, inline="always")
def _zero_row(r: Arr, i: int, start: int) -> None:
    """``r[i, start:] = 0`` as a loop (see :func:`_copy_row`)."""
    for c in range(start, r.shape[1]):
        r[i, c] = 0


@_unrefcounted
def find(r: Arr, k: np.uint64) -> int:
    """The row of ``k``, or -1. O(1) expected."""
    i = _probe(r, k)
    return i if i >= 0 else -1


@njit(cache=True)
def claim(r: Arr, m: Arr, k: np.uint64) -> int:
    """The row of ``k``, claimed with zero values if absent (as ``-1 - row``, so callers see it was new).
    The caller has reserved room. O(1) expected."""
    i = _probe(r, k)
    if i < 0:
        f = -1 - i
        r[f, KEY] = k
        r[f, USED] = 1
        _zero_row(r, f, VAL)
        m[0] += 1
    return i


@_unrefcounted
def delete_at(r: Arr, m: Arr, i: int) -> None:
    """Frees row ``i`` and moves later rows of its probe run back, so that no lookup stops early. O(run)."""
    mask = r.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if not r[j, USED]:
            break
        h = _home(r[j, KEY], mask)
        # The row at j may move to i unless its home lies cyclically in (i, j].
        if (i <= j and i < h <= j) or (i > j and (h > i or h <= j)):
            continue
        _copy_row(r, i, r, j)
        i = j
    _zero_row(r, i, 0)
    m[0] -= 1


@njit(cache=True)
def rehash(r: Arr, n: Arr) -> None:
    """Moves every row into the empty table ``n`` (more rows, or more value columns: new ones are zero). O(cap)."""
    mask = n.shape[0] - 1
    for s in range(r.shape[0]):
        if r[s, USED]:
            i = _home(r[s, KEY], mask)
            while n[i, USED]:
                i = (i + 1) & mask
            _copy_row(n, i, r, s)


@njit(cache=True)
def used_rows(r: Arr) -> Arr:
    """The used rows, in table order. O(cap)."""
    return np.flatnonzero(r[:, USED])


@njit(cache=True, inline="always")
def _touch(r: Arr, keys: Arr) -> np.uint64:
    """Reads each key's home row, and rows 2 and 4 past it, with no branch between the reads, so that their cache
    misses overlap instead of coming one after the other inside the probes that follow; the sum keeps the reads
    from being dropped. Rows of 24 or 32 bytes: the two later reads bring in the one or two cache lines after the
    home's, where a probe that does not stop at the home goes on (3 rows read on average for a key not there, at
    57% load). On the indexer bench this cut the apply by 15% against reading the home row alone; reading row 1,
    or rows 6 or 3 too, did less."""
    mask = r.shape[0] - 1
    acc = np.uint64(0)
    for k in keys:
        h = _home(k, mask)
        acc += r[h, KEY] + r[(h + 2) & mask, USED] + r[(h + 4) & mask, USED]
    return acc


@njit(cache=True)
def _distinct(a: Arr) -> bool:
    """Whether the values of ``a`` are pairwise distinct, through a small open-addressing set at most half full.
    O(n) expected, where a sort is O(n log n) and allocates (called once or twice per store)."""
    n = a.shape[0]
    size = 16
    while size < 2 * n:
        size *= 2
    seen = np.empty(size, np.uint64)
    used = np.zeros(size, np.bool_)
    mask = size - 1
    for x in a:
        h = _home(x, mask)
        while used[h]:
            if seen[h] == x:
                return False
            h = (h + 1) & mask
        used[h] = True
        seen[h] = x
    return True


# --- the mask pool -------------------------------------------------------------------------------------------
#
# A block's row holds the id of its mask; the pool keeps each distinct mask once (``pm[id]``, its words), with a
# reference count, and finds a mask's id by content through a table ``ph`` (rows: content hash, used, id). Most
# blocks share a handful of masks (one worker, one tier), so rows stay three words however many workers there are.
# ``pa``: [entries of ph, free ids, ids handed out, refcounts (one per id), free ids' stack]; id 0 is the empty
# mask, never counted or freed.

_MIX1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


@_unrefcounted
def _mhash(words: Arr) -> np.uint64:
    """A hash of a mask's words in which zero words count for nothing (so widening keeps every hash)."""
    h = np.uint64(0)
    for w in range(words.shape[0]):
        x = words[w]
        if x:
            x = (x + np.uint64(w) * _GOLD) * _MIX1
            x ^= x >> _S33
            x *= _MIX2
            h ^= x ^ (x >> _S33)
    return h


@_unrefcounted
def _same(pm: Arr, i: int, words: Arr) -> bool:
    for w in range(words.shape[0]):  # noqa: SIM110 (numba compiles no generator)
        if pm[i, w] != words[w]:
            return False
    return True


@_unrefcounted
def _intern(pm: Arr, ph: Arr, pa: Arr, words: Arr) -> int:
    """The id of the mask ``words``, its count up by one (added if new: the caller reserved room). O(words)."""
    h = _mhash(words)
    mask = ph.shape[0] - 1
    i = _home(h, mask)
    while ph[i, USED]:
        if ph[i, KEY] == h and _same(pm, int(ph[i, VAL]), words):
            m = int(ph[i, VAL])
            pa[_PREF + m] += 1
            return m
        i = (i + 1) & mask
    cap = pm.shape[0]
    if pa[_PFREE]:
        pa[_PFREE] -= 1
        m = int(pa[_PREF + cap + pa[_PFREE]])
    else:
        m = int(pa[_PTOP])
        pa[_PTOP] += 1
    for w in range(words.shape[0]):  # (a loop: see _copy_row)
        pm[m, w] = words[w]
    pa[_PREF + m] = 1
    ph[i, KEY] = h
    ph[i, USED] = 1
    ph[i, VAL] = m
    pa[_PH] += 1
    return m


@_unrefcounted
def _release(pm: Arr, ph: Arr, pa: Arr, m: int) -> None:
    """One reference to mask ``m`` fewer; the mask goes when none is left. O(words)."""
    if m == 0:
        return
    pa[_PREF + m] -= 1
    if pa[_PREF + m]:
        return
    h = _mhash(pm[m])
    mask = ph.shape[0] - 1
    i = _home(h, mask)
    while ph[i, KEY] != h or int(ph[i, VAL]) != m:
        i = (i + 1) & mask
    delete_at(ph, pa, i)  # (pa[_PH] is ph's entry count)
    cap = pm.shape[0]
    pa[_PREF + cap + pa[_PFREE]] = m
    pa[_PFREE] += 1


@njit(cache=True, inline="always")
def _has(t: Arr, i: int, pm: Arr, word: int, bits: np.uint64) -> bool:
    return bool(pm[int(t[i, VAL]), word] & bits)


@_unrefcounted
def _change(t: Arr, i: int, pm: Arr, ph: Arr, pa: Arr, tmp: Arr, word: int, set_bits: np.uint64,
            keep: np.uint64, memo: Arr) -> bool:
    """Row ``i``'s mask with ``set_bits`` set and only ``keep`` kept in ``word``; True if it is empty now (the row
    then holds the empty mask: the caller deletes it). O(words).

    ``memo`` (from :func:`_memo`, one per kernel call, whose bits stay the same) is the last change made, [old id,
    new id]: the blocks of a chain mostly share one mask, and interning one hashes and compares its words, so a
    run of them looks it up once. A freed id cannot make the memo stale: no row holds it, so no change starts from
    it, until an intern hands it out again, in a change that writes the memo anew."""
    old = int(t[i, VAL])
    if old == memo[0]:
        new = int(memo[1])
        if new:
            pa[_PREF + new] += 1
    else:
        for w in range(tmp.shape[0]):  # (a loop: see _copy_row)
            tmp[w] = pm[old, w]
        tmp[word] = (tmp[word] | set_bits) & keep
        new = 0
        for w in range(tmp.shape[0]):
            if tmp[w]:
                new = _intern(pm, ph, pa, tmp)
                break
        memo[1] = new
    _release(pm, ph, pa, old)
    memo[0] = old
    t[i, VAL] = new
    return new == 0


@njit(cache=True, inline="always")
def _memo() -> Arr:
    """A fresh memo for :func:`_change`."""
    return np.full(2, -1, np.int64)


_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


# --- stores -------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _room(r: Arr, m: Arr, n: int) -> bool:
    """Whether ``n`` more entries keep the table at most 3/4 full (``RowTable.reserve``'s test). O(1)."""
    return bool((m[0] + n) * 4 <= r.shape[0] * 3)


@njit(cache=True, inline="always")
def _filling(r: Arr, m: Arr, n: int) -> bool:
    """Whether ``n`` more entries take the table past 5/8 full, where ``RowTable.prepare`` gets its next size
    ready before the growth at 3/4. O(1)."""
    return bool((m[0] + n) * 8 > r.shape[0] * 5)


@njit(cache=True, inline="always")
def _pool_room(pm: Arr, ph: Arr, pa: Arr, n: int, word: int) -> bool:
    """Whether the pool has room for ``n`` new masks (``MaskPool.reserve``'s tests) with word ``word``. O(1)."""
    return bool(pa[_PTOP] + n <= pm.shape[0] and (pa[_PH] + n) * 4 <= ph.shape[0] * 3 and word < pm.shape[1])



@njit(cache=True)
def bit_state(t: Arr, pm: Arr, k: np.uint64, word: int, bit: np.uint64) -> int:
    """-1 if nobody holds ``k``, else 1 if its mask has ``bit`` in ``word``, else 0. O(1)."""
    i = find(t, k)
    if i < 0:
        return -1
    return 1 if _has(t, i, pm, word, bit) else 0


@njit(cache=True)
def store_new(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, keys: Arr, word: int, bit: np.uint64) -> bool:
    """A chain of blocks nobody holds (the caller checked that the worker's engine hashes are new): each key
    gets the mask ``bit``. False, with nothing changed, if somebody holds one. O(blocks)."""
    for k in keys:
        if find(t, k) >= 0:
            return False
    tmp = np.empty(pm.shape[1], np.uint64)
    memo = _memo()
    for j in range(keys.shape[0]):
        i = claim(t, tm, keys[j])
        _change(t, -1 - i if i < 0 else i, pm, ph, pa, tmp, word, bit, _ALL, memo)
    return True


@njit(cache=True)
def store_held_elsewhere(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, keys: Arr, word: int, bit: np.uint64,
                         slot_bits: np.uint64, fresh: bool) -> int:
    """The store of distinct blocks the worker names already under the same engine hashes (a backup, load-back
    or prefetch), or, when ``fresh``, of blocks new to it under engine hashes new to it (no key may carry any
    of the worker's bits ``slot_bits``, in ``word``), some of which others hold: sets ``bit`` on every key
    and returns how many lacked it; -1, with nothing changed, for repeated keys or a key the worker holds
    under another name. The caller checked the engine hashes. O(blocks)."""
    if not _distinct(keys):
        return -1
    if fresh:
        for k in keys:
            i = find(t, k)
            if i >= 0 and _has(t, i, pm, word, slot_bits):
                return -1
    tmp = np.empty(pm.shape[1], np.uint64)
    memo = _memo()
    added = 0
    for j in range(keys.shape[0]):
        i = claim(t, tm, keys[j])
        if i < 0:
            i = -1 - i
        if not _has(t, i, pm, word, bit):
            _change(t, i, pm, ph, pa, tmp, word, bit, _ALL, memo)
            added += 1
    return added


@njit(cache=True, inline="always")
def _link1(t: Arr, pi: int, child: np.uint64, how: Arr, cur: Arr, j: int) -> bool:
    """Links ``child`` under the block of row ``pi``: a new link, one made already, or a dead child replaced, here;
    True if the caller has work (``how[j]`` = 1: add the child to the parent's set; 2: make the set of ``cur[j]``
    and the child, the state set here)."""
    state = t[pi, USED]
    if state == LINKS_NONE:
        t[pi, CHILD] = child
        t[pi, USED] = LINKS_ONE
        return False
    if state == LINKS_SET:
        how[j] = 1
        return True
    old = t[pi, CHILD]
    if old != child:
        if find(t, old) >= 0:
            cur[j] = old
            t[pi, USED] = LINKS_SET
            how[j] = 2
            return True
        t[pi, CHILD] = child
    return False


@njit(cache=True)
def link_chain(t: Arr, parents: Arr, children: Arr, cur: Arr) -> Arr:
    """Links each ``children[j]`` under ``parents[j]`` in the parents' rows; a parent nobody holds gets no link (it
    would outlive the parent: the child is loose anyway). Per pair what :func:`_link1` leaves to the caller (0:
    nothing). O(pairs)."""
    n = parents.shape[0]
    how = np.zeros(n, np.uint8)
    for j in range(n):
        pi = find(t, parents[j])
        if pi >= 0:
            _link1(t, pi, children[j], how, cur, j)
    return how


@njit(cache=True)
def _store_path(t: Arr, pm: Arr, keys: Arr, e: Arr, ehs: Arr, at: Arr, fe: Arr, word: int, slot_bits: np.uint64,
                bulk: bool) -> int:
    """Which case a store is, changing nothing: 1 new blocks under new engine hashes; 2 blocks the worker names
    already under the same engine hashes (a backup, load-back, prefetch); 3 blocks new to the worker under engine
    hashes new to it, some held by others (2 and 3 only when ``bulk``: the parent is held and every tier is
    prefix-closed); 4 any other store whose engine hashes are distinct and name no other block; 0 the rest.
    ``at[j]`` and ``fe[j]`` are block ``j``'s probes (:func:`_probe`) of the masks' and engine hashes' tables."""
    if not _distinct(ehs):
        return 0
    n = keys.shape[0]
    found = 0
    same = 0
    absent = True
    for j in range(n):
        i = fe[j]
        if i >= 0:
            found += 1
            if e[i, VAL] == keys[j]:
                same += 1
        if at[j] >= 0:
            absent = False
    if found != same:
        return 0  # an engine hash names another block
    if absent and not found:
        return 1
    if bulk and _distinct(keys):
        if same == n:
            return 2
        if not found:
            for j in range(n):
                i = at[j]
                if i >= 0 and _has(t, i, pm, word, slot_bits):
                    return 4
            return 3
    return 4


@njit(cache=True, inline="always")
def _claim_at(r: Arr, m: Arr, k: np.uint64, probe: int) -> int:
    """:func:`claim` of ``k`` whose :func:`_probe` was ``probe``, with only claims since (they move no row, and
    the rows the probe passed stay used): a row found is still ``k``'s, and a free row found is where the search
    goes on from. O(1) expected."""
    if probe >= 0:
        return probe
    mask = r.shape[0] - 1
    i = -1 - probe
    while r[i, USED]:
        if r[i, KEY] == k:  # (claimed since, for a key repeated in the chain)
            return i
        i = (i + 1) & mask
    r[i, KEY] = k
    r[i, USED] = 1
    _zero_row(r, i, VAL)
    m[0] += 1
    return -1 - i


@njit(cache=True)
def store(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, e: Arr, em: Arr, keys: Arr, ehs: Arr,
          parent: np.uint64, has_parent: bool, word: int, bit: np.uint64, slot_bits: np.uint64, closed: bool,
          newly: Arr, how: Arr, cur: Arr, res: Arr) -> int:
    """A whole ``BlockStored`` of a worker whose engine hashes are in a table (``e``): the parent's link, the case
    (:func:`_store_path`), the bits and names, the chain's links. Returns the case (0: none of them, nothing
    changed: the caller goes block by block). ``res`` = [parent held (0/1), blocks that gained the bit, aliases,
    1 if some link needs the caller (``how``/``cur``: index 0 the parent's link, ``j + 1`` the link under block
    ``j``), 1 if an engine hash has its top bit set, (:func:`store_tokens`'s), tables past 5/8 full (1: the
    masks', 2: the engine hashes'; :func:`_filling`)]; ``newly[j]`` = 1 where block ``j`` gained the bit (case 4).
    The output arrays may be longer than the store (their first ``len(keys)`` entries are written). Returns -1,
    with nothing changed, while a table or the pool lacks room for the store (the caller grows them and calls
    again: checking here keeps that out of every store's Python side). O(blocks)."""
    n = keys.shape[0]
    # (numba checks no bounds: a short output would be written past its end, corrupting the heap)
    assert res.shape[0] >= 7 and newly.shape[0] >= n and how.shape[0] >= n and cur.shape[0] >= n, "short outputs"
    if not (_room(t, tm, n) and _room(e, em, n) and _pool_room(pm, ph, pa, n, word)):
        return -1
    res[6] = (1 if _filling(t, tm, n) else 0) | (2 if _filling(e, em, n) else 0)
    how[:n] = 0
    # Each block's rows, probed once, after reads that overlap their cache misses (_touch). Only claims change the
    # tables below, so a row found stays its key's and a free one is where a claim's search goes on (_claim_at).
    acc = _touch(t, keys) + _touch(e, ehs)
    at = np.empty(n, np.int64)
    fe = np.empty(n, np.int64)
    for j in range(n):
        at[j] = _probe(t, keys[j])
        fe[j] = _probe(e, ehs[j])
    res[4] = acc  # (kept from dead-code removal; set again below)
    parent_held = True
    pi = -1
    if has_parent:
        pi = find(t, parent)
        parent_held = pi >= 0 and _has(t, pi, pm, word, bit)
    res[0] = 1 if parent_held else 0
    path = _store_path(t, pm, keys, e, ehs, at, fe, word, slot_bits, parent_held and closed)
    if path == 0:
        return 0
    linking = False
    if pi >= 0:  # a link under a block nobody holds would outlive it (the child is loose anyway)
        linking = _link1(t, pi, keys[0], how, cur, 0)
    added = 0
    aliases = 0
    high = False
    if path == 1 or path == 3:
        for j in range(n):
            c = _claim_at(e, em, ehs[j], fe[j])
            e[-1 - c, VAL] = keys[j]
            high |= (ehs[j] & _HIGH) != 0
    tmp = np.empty(pm.shape[1], np.uint64)
    memo = _memo()
    # ``at`` becomes each block's row, for the links below (a claim never moves another row).
    if path == 1:  # every row is new: they all get the one mask of ``bit`` alone, interned once
        tmp[:] = 0
        tmp[word] = bit
        mid = _intern(pm, ph, pa, tmp)
        new_rows = 0
        for j in range(n):
            i = _claim_at(t, tm, keys[j], at[j])
            if i < 0:  # (a key repeated in the chain finds the row its first time claimed)
                i = -1 - i
                t[i, VAL] = mid
                new_rows += 1
            at[j] = i
        pa[_PREF + int(mid)] += new_rows - 1
        added = n
    else:
        for j in range(n):
            f = fe[j] if path == 4 else 0  # (2: every engine hash was found; 3: each claimed above)
            i = _claim_at(t, tm, keys[j], at[j])
            if i < 0:
                i = -1 - i
            at[j] = i
            if f < 0:
                if _has(t, i, pm, word, slot_bits):
                    aliases += 1
                else:
                    c = _claim_at(e, em, ehs[j], f)
                    e[-1 - c, VAL] = keys[j]
                    high |= (ehs[j] & _HIGH) != 0
            if _has(t, i, pm, word, bit):
                newly[j] = 0
            else:
                _change(t, i, pm, ph, pa, tmp, word, bit, _ALL, memo)
                newly[j] = 1
                added += 1
    for j in range(n - 1):
        if _link1(t, at[j], keys[j + 1], how, cur, j + 1):
            linking = True
    res[1] = added
    res[2] = aliases
    res[3] = 1 if linking else 0
    res[4] = 1 if high else 0
    return path


@njit(cache=True)
def store_tokens(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, e: Arr, em: Arr, buf: Arr, step: int, ehs: Arr,
                 base: np.uint64, mode: int, word: int, bit: np.uint64, slot_bits: np.uint64, closed: bool,
                 newly: Arr, how: Arr, cur: Arr, res: Arr, keys: Arr) -> int:
    """A ``BlockStored`` from its packed tokens (``buf``, ``step`` bytes per block): the parent's key from the
    worker's engine hashes (``mode``), the chain's keys (into ``keys``, whose first ``len(ehs)`` entries are
    written; :func:`kvtier.kernels.keykernel.chain_into`), then :func:`store`, whose result this is; ``res[5]``
    is the parent's key. -2, with nothing changed, if ``mode`` is ``UNDER`` and the table does not name the
    parent (the caller looks further: ghosts, orphans). One compiled call where the parent's lookup, the keys and
    the store were three. O(blocks)."""
    n = ehs.shape[0]
    assert keys.shape[0] >= n and buf.shape[0] == n * step, "keys shorter than the store, or tokens not its blocks"
    parent = np.uint64(0)
    if mode == UNDER:
        i = find(e, base)
        if i < 0:
            return -2
        parent = e[i, VAL]
    ks = keys[:n]
    chain_into(buf, step, parent if mode == UNDER else base, mode != ROOT, _SEED, ks)
    res[5] = parent
    return store(t, tm, pm, ph, pa, e, em, ks, ehs, parent, mode == UNDER, word, bit, slot_bits, closed, newly,
                 how, cur, res)


# --- removals -----------------------------------------------------------------------------------------------


@njit(cache=True)
def remove(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, keys: Arr, word: int, bit: np.uint64,
           slot_bits: np.uint64, e: Arr, em: Arr, ehs: Arr, use_e: bool, n: int, out: Arr, kids: Arr, branched: Arr,
           res: Arr) -> bool:
    """A ``BlockRemoved`` of the worker's ``bit``, with what it does to the closure. Per block, in order,
    ``out[j]`` is 0 if the block is not held there (an unknown engine hash, or a block not on that tier: the
    caller looks at its orphans), 1 if the bit went and the worker still holds the block on another tier, 2 if
    the worker holds it nowhere now (its engine hash goes: the caller drops it unless ``use_e``, where it went
    here), 3 if nobody holds it now (gone from the table, with its links). With ``use_e`` engine hashes resolve
    through ``e`` and ``keys`` is filled in; without, the caller resolved them (``out[j]`` = 1 on entry where the
    engine hash names a block, 0 otherwise). Once every bit is cleared, the children of the blocks that lost it
    that still hold it are in ``kids`` and the blocks whose children are a Python set in ``branched``; ``res`` =
    [their two counts, blocks whose bit went (``out`` not 0), blocks nobody holds now (``out`` 3), of those the
    ones whose children were a Python set (the caller forgets the sets)]. The arrays may
    be longer than the removal (``n`` blocks: their first ``n`` entries are read and written). Returns False, with
    nothing changed or written, while the pool lacks room for a mask per block (the caller grows it and calls
    again), else True. O(blocks + their children)."""
    if not _pool_room(pm, ph, pa, n, word):
        return False
    tmp = np.empty(pm.shape[1], np.uint64)
    memo = _memo()
    # The blocks' rows in both tables, read first with no branch between the reads (_touch): the engine hashes',
    # then, with the keys they name, the masks' (with the links), which the loops below probe.
    acc = np.uint64(0)
    if use_e:
        acc += _touch(e, ehs)
        for j in range(n):
            f = find(e, ehs[j])
            keys[j] = e[f, VAL] if f >= 0 else np.uint64(0)
    acc += _touch(t, keys[:n])
    res[0] = acc  # (kept from dead-code removal; set again below)
    # The masks' rows, probed once: nothing is deleted from that table before the last loop.
    ti = np.empty(n, np.int64)
    for j in range(n):
        ti[j] = find(t, keys[j])
    f = -1
    for j in range(n):
        if use_e:
            f = find(e, ehs[j])  # (again: a deletion below may move a later block's row)
            if f < 0:
                out[j] = 0
                continue
        elif not out[j]:
            continue
        i = ti[j]
        if i < 0 or not _has(t, i, pm, word, bit):
            out[j] = 0
            continue
        empty = _change(t, i, pm, ph, pa, tmp, word, np.uint64(0), ~bit, memo)
        out[j] = 3 if empty else (1 if _has(t, i, pm, word, slot_bits) else 2)
        if use_e and out[j] >= 2:
            delete_at(e, em, f)  # (only this block changed e since f was found)
    nk = 0
    nb = 0
    for j in range(n):  # children held there, now that every bit of the event is cleared
        if not out[j]:
            continue
        i = ti[j]  # (its row is there still, with an empty mask if nobody holds it now)
        state = t[i, USED]
        if state == LINKS_NONE:
            continue
        if state == LINKS_SET:
            branched[nb] = keys[j]
            nb += 1
            continue
        c = find(t, t[i, CHILD])
        if c >= 0 and _has(t, c, pm, word, bit):
            kids[nk] = t[i, CHILD]
            nk += 1
    sets = 0
    for j in range(n):  # the blocks nobody holds, with their links, after their children were looked at
        if out[j] == 3:
            i = find(t, keys[j])
            if i >= 0:
                sets += t[i, USED] == LINKS_SET
                delete_at(t, tm, i)
    held = 0
    dead = 0
    for j in range(n):
        held += out[j] != 0
        dead += out[j] == 3
    res[0] = nk
    res[1] = nb
    res[2] = held
    res[3] = dead
    res[4] = sets
    return True


@njit(cache=True)
def has_bit(t: Arr, pm: Arr, keys: Arr, word: int, bit: np.uint64) -> Arr:
    """Per key, 1 if its mask has ``bit`` in ``word``. O(keys)."""
    out = np.zeros(keys.shape[0], np.uint8)
    for j in range(keys.shape[0]):
        i = find(t, keys[j])
        if i >= 0 and _has(t, i, pm, word, bit):
            out[j] = 1
    return out


@njit(cache=True)
def clear_slot(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, keys: Arr, word: int, slot_bits: np.uint64) -> Arr:
    """Takes the slot's bits off each of ``keys``; returns 1 per key nobody holds now (gone from the table, with
    its links). O(keys)."""
    dead = np.zeros(keys.shape[0], np.uint8)
    tmp = np.empty(pm.shape[1], np.uint64)
    memo = _memo()
    for j in range(keys.shape[0]):
        i = find(t, keys[j])
        if i < 0:
            continue
        if _change(t, i, pm, ph, pa, tmp, word, np.uint64(0), ~slot_bits, memo):
            delete_at(t, tm, i)
            dead[j] = 1
    return dead


# --- reference counts (kvtier.indexer.index.keyrefs) --------------------------------------------------------------

_U1 = np.uint64(1)


@njit(cache=True)
def ref_add(r: Arr, m: Arr, keys: Arr) -> int:
    """Each key's count up by one (a key absent gets 1), in order; returns how many were absent, or -1, with
    nothing changed, while the table lacks room for them all. O(keys)."""
    if not _room(r, m, keys.shape[0]):
        return -1
    m[1] = np.int64(_touch(r, keys))  # the keys' rows are mostly not cached: their misses overlap here
    new = 0
    for k in keys:
        i = claim(r, m, k)
        if i < 0:
            r[-1 - i, VAL] = _U1
            new += 1
        else:
            r[i, VAL] += _U1
    return new


@njit(cache=True)
def ref_drop(r: Arr, m: Arr, keys: Arr) -> int:
    """Each key's count down by one, in order (a key at one goes); returns how many went, or ``-1 - j`` where
    ``keys[j]`` is absent (the counts of the keys before it moved). O(keys)."""
    m[1] = np.int64(_touch(r, keys))  # as in ref_add
    gone = 0
    for j in range(keys.shape[0]):
        i = find(r, keys[j])
        if i < 0:
            return -1 - j
        if r[i, VAL] == _U1:
            delete_at(r, m, i)
            gone += 1
        else:
            r[i, VAL] -= _U1
    return gone


@njit(cache=True)
def held_prefix(r: Arr, keys: Arr) -> int:
    """How many leading ``keys`` the table holds, by binary search: sound where a held key's whole prefix is held
    (chained keys). O(log keys)."""
    n = keys.shape[0]
    if n == 0 or find(r, keys[0]) < 0:
        return 0
    lo, hi = 1, n  # keys[:lo] are held; keys[hi:] are not
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if find(r, keys[mid - 1]) >= 0:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- queries ------------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _same_run(t: Arr, k: np.uint64, mask_id: np.uint64) -> bool:
    i = find(t, k)
    return i >= 0 and t[i, VAL] == mask_id  # one id per distinct mask (equal ids: equal masks)


@njit(cache=True)
def runs_by_search(t: Arr, keys: Arr, max_runs: int, starts: Arr, ids: Arr) -> int:
    """The runs of equal masks over the leading blocks anybody holds, found by search (sound only while every tier of
    every worker is prefix-closed): run ``r`` starts at ``starts[r]`` with the mask of id ``ids[r]``, and
    ``starts[runs]`` is where the held prefix ends. Returns the number of runs, or -1 past ``max_runs`` (``starts`` and
    ``ids`` have room for ``max_runs + 1``). O(runs * log(blocks)).

    Each step looks at three blocks, not one: their rows are read together first, so that the three cache misses of a
    large table overlap, and the search takes half as many dependent steps as a binary one."""
    total = keys.shape[0]
    pos = 0
    runs = 0
    sink = np.uint64(0)
    mask = t.shape[0] - 1
    cur = find(t, keys[0]) if total else -1
    while cur >= 0:
        if runs == max_runs:
            return -1
        mid_id = t[cur, VAL]
        lo, hi = pos + 1, total  # keys[pos:lo] are in the run; keys[hi:] are not
        while hi - lo >= 4:
            span = hi - lo
            m1, m2, m3 = lo + span // 4, lo + span // 2, lo + (3 * span) // 4
            sink += t[_home(keys[m1], mask), KEY] + t[_home(keys[m2], mask), KEY] + t[_home(keys[m3], mask), KEY]
            if _same_run(t, keys[m2], mid_id):
                if _same_run(t, keys[m3], mid_id):
                    lo = m3 + 1
                else:
                    lo, hi = m2 + 1, m3
            elif _same_run(t, keys[m1], mid_id):
                lo, hi = m1 + 1, m2
            else:
                hi = m1
        while lo < hi:
            mid = (lo + hi) >> 1
            if _same_run(t, keys[mid], mid_id):
                lo = mid + 1
            else:
                hi = mid
        starts[runs] = pos
        ids[runs] = mid_id
        runs += 1
        pos = lo
        cur = find(t, keys[pos]) if pos < total else -1
    starts[runs] = pos
    ids[max_runs] = sink  # (never read: it keeps the early reads from being dropped as dead code)
    return runs


@njit(cache=True)
def leading_ids(t: Arr, keys: Arr) -> Arr:
    """The mask ids of the leading blocks anybody holds (a lookup per block). O(leading blocks)."""
    out = np.empty(keys.shape[0], np.int64)
    n = 0
    for k in keys:
        i = find(t, k)
        if i < 0:
            break
        out[n] = t[i, VAL]
        n += 1
    return out[:n]


_DEV = np.uint64(DEV)
_EXT = np.uint64(EXT)
_ONE, _TWO, _FOUR = np.uint64(1), np.uint64(2), np.uint64(4)


@njit(cache=True)
def run_levels(pm: Arr, ids: Arr, starts: Arr, runs: int, n: int, slots: int, out: Arr, held_slots: Arr,
               groups: Arr, uniq: Arr) -> tuple[int, int, int]:
    """Cumulative tier levels (:mod:`kvtier.indexer.index.levels`): over runs of equal masks (run ``r``: mask
    id ``ids[r]`` from position ``starts[r]``; ``n`` blocks in all), ``out[slot, tier]`` = the cumulative depth of
    each slot at each level (device; device or host; ... or disk; ... or the shared pool), for the slots of the words
    that hold the first ``slots`` (``out`` has a row for each at least: zeroed here, so that it is kept for the next
    query). Returns the shared pool's leading blocks, how many slots hold some of the prefix, and how many distinct
    rows they have. The holders' slots, in order, are ``held_slots`` (the last level's depth is the largest, so a
    slot holds some iff it is not 0); holder ``i`` has the depths ``uniq[groups[i]]`` (workers that share a system
    prompt share their depths: the caller builds one overlap per distinct row). ``held_slots``, ``groups`` and
    ``uniq`` have as many rows as ``out``. O(runs * words + set bits + rows * distinct rows)."""
    words = (slots + SLOTS_PER_WORD - 1) // SLOTS_PER_WORD
    rows = words * SLOTS_PER_WORD
    out[:rows] = 0
    stored = pm.shape[1]  # masks have as many words as the widest slot that stored: the rest are zero
    pooled = np.zeros(runs, np.bool_)
    pool_run = -1
    for r in range(runs):
        for g in range(min(words, stored)):
            if pm[ids[r], g] & _EXT:
                pooled[r] = True
                break
        if not pooled[r] and pool_run < 0:
            pool_run = starts[r]
    held = np.empty(TIERS, np.uint64)
    alive = np.empty(TIERS, np.uint64)
    for g in range(words):
        # Every slot of the word, also those past ``slots``: they hold nothing, and are nobody's (the caller keeps
        # the slots it owns).
        every = _DEV
        alive[:] = every
        for r in range(runs):
            m = pm[ids[r], g] if g < stored else np.uint64(0)
            a1 = m | (m >> _ONE)
            held[0] = m & every
            held[1] = a1 & every
            held[2] = (a1 | (m >> _TWO)) & every
            held[3] = every if pooled[r] else held[2]
            pos = starts[r]
            for lvl in range(TIERS):
                dropped = alive[lvl] & ~held[lvl]
                if dropped:
                    alive[lvl] &= held[lvl]
                    if pos:
                        _put(out, dropped, g, lvl, pos)
        if n:
            for lvl in range(TIERS):
                _put(out, alive[lvl], g, lvl, n)
    count = 0
    distinct = 0
    for s in range(rows):
        if out[s, TIERS - 1]:
            held_slots[count] = s
            g = 0
            while g < distinct:
                lvl = 0
                while lvl < TIERS and uniq[g, lvl] == out[s, lvl]:
                    lvl += 1
                if lvl == TIERS:
                    break
                g += 1
            if g == distinct:
                uniq[g, :] = out[s, :]
                distinct += 1
            groups[count] = g
            count += 1
    return (n if pool_run < 0 else pool_run), count, distinct


@njit(inline="always")
def _put(out: Arr, bits: np.uint64, g: int, lvl: int, depth: int) -> None:
    """``out[slot, lvl] = depth`` for each slot of word ``g`` whose device bit is in ``bits``."""
    while bits:
        low = bits & (~bits + _ONE)  # the lowest set bit
        b = 0
        x = low
        while x > _ONE:  # its position (at most 63 shifts; bits are a slot's device bit, every 4th)
            x >>= _FOUR
            b += TIERS
        out[g * SLOTS_PER_WORD + b // TIERS, lvl] = depth
        bits ^= low



# --- snapshots (kvtier.indexer.index.snapshot) ---------------------------------------------------------------


@njit(cache=True)
def find_all(r: Arr, keys: Arr) -> Arr:
    """Per key its row, or -1. O(keys)."""
    out = np.empty(keys.shape[0], np.int64)
    for j in range(keys.shape[0]):
        out[j] = find(r, keys[j])
    return out


@njit(cache=True)
def put_all(r: Arr, m: Arr, keys: Arr, vals: Arr) -> int:
    """Claims a row per key with its value (one column), the caller having reserved room for them all; returns how
    many, or ``-1 - j`` where ``keys[j]`` was there already (the rows before it are claimed). O(keys)."""
    for j in range(keys.shape[0]):
        i = claim(r, m, keys[j])
        if i >= 0:
            return -1 - j
        r[-1 - i, VAL] = vals[j]
    return int(keys.shape[0])


@njit(cache=True)
def add_bits(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, keys: Arr, start: int, word: int, bits: np.uint64,
             slot_bits: np.uint64) -> int:
    """Sets ``bits`` (in ``word``) on each of ``keys`` from ``start`` on, a key nobody holds claimed; none may carry
    any of ``slot_bits`` yet. Returns how many keys are done: all of them; fewer, where the table or the mask pool
    needs room first (the caller makes it and calls again from there); or ``-1 - j`` where ``keys[j]`` carries
    ``slot_bits`` already. O(keys)."""
    tmp = np.empty(pm.shape[1], np.uint64)
    memo = _memo()
    for j in range(start, keys.shape[0]):
        if not (_room(t, tm, 1) and _pool_room(pm, ph, pa, 1, word)):
            return j
        i = claim(t, tm, keys[j])
        if i < 0:
            i = -1 - i
        elif _has(t, i, pm, word, slot_bits):
            return -1 - j
        _change(t, i, pm, ph, pa, tmp, word, bits, _ALL, memo)
    return int(keys.shape[0])


@njit(cache=True)
def set_mask(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, k: np.uint64, words: Arr) -> None:
    """Key ``k``'s mask is ``words`` (not empty) now. O(words)."""
    i = claim(t, tm, k)
    if i < 0:
        i = -1 - i
    old = int(t[i, VAL])
    t[i, VAL] = _intern(pm, ph, pa, words)
    _release(pm, ph, pa, old)


@njit(cache=True)
def del_mask(t: Arr, tm: Arr, pm: Arr, ph: Arr, pa: Arr, k: np.uint64) -> bool:
    """Drops key ``k`` (nobody holds it now); False if it was absent. O(words)."""
    i = find(t, k)
    if i < 0:
        return False
    _release(pm, ph, pa, int(t[i, VAL]))
    delete_at(t, tm, i)
    return True


def warm(k: Any) -> None:
    """Compiles (or loads from numba's cache) every kernel with the argument types the index passes."""
    t = np.zeros((8, 4), np.uint64)
    e = np.zeros((8, 3), np.uint64)
    m = np.zeros(1, np.int64)
    pm, ph, pa = np.zeros((8, 1), np.uint64), np.zeros((8, 3), np.uint64), np.zeros(3 + 16, np.int64)
    pa[_PTOP] = 1
    one = np.ones(1, np.uint64)
    b = np.uint64(1)
    k.find(t, b)
    i = k.claim(t, m, b)
    k.delete_at(t, m, -1 - i)
    k.rehash(t, np.zeros((16, 4), np.uint64))
    k.used_rows(t)
    k.bit_state(t, pm, b, 0, b)
    k.store_new(t, m, pm, ph, pa, one, 0, b)
    k.store_held_elsewhere(t, m, pm, ph, pa, one, 0, b, b, False)
    k.link_chain(t, one, one, np.zeros(1, np.uint64))
    k.store(t, m, pm, ph, pa, e, m, one, one, b, True, 0, b, b, True, np.zeros(1, np.uint8),
            np.zeros(2, np.uint8), np.zeros(2, np.uint64), np.zeros(7, np.int64))
    k.store_tokens(t, m, pm, ph, pa, e, m, np.frombuffer(bytes(4), np.uint8), 4, one, b, UNDER, 0, b, b, True,
                   np.zeros(1, np.uint8), np.zeros(2, np.uint8), np.zeros(2, np.uint64), np.zeros(7, np.int64),
                   np.zeros(1, np.uint64))
    k.remove(t, m, pm, ph, pa, one.copy(), 0, b, b, e, m, one, True, 1, np.zeros(1, np.uint8),
             np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.zeros(5, np.int64))
    k.has_bit(t, pm, one, 0, b)
    k.ref_add(e, m, one)
    k.held_prefix(e, one)
    k.ref_drop(e, m, one)
    k.clear_slot(t, m, pm, ph, pa, one, 0, b)
    k.runs_by_search(t, one, 4, np.zeros(5, np.int64), np.zeros(5, np.int64))
    k.leading_ids(t, one)
    k.run_levels(pm, np.zeros(1, np.int64), np.zeros(2, np.int64), 1, 1, 1, np.zeros((16, 4), np.int64),
                 np.zeros(16, np.int64), np.zeros(16, np.int64), np.zeros((16, 4), np.int64))
    k.set_mask(t, m, pm, ph, pa, b, one)
    k.find_all(t, one)
    k.put_all(e, m, one, one)
    k.add_bits(t, m, pm, ph, pa, one, 0, 0, b, b)
    k.del_mask(t, m, pm, ph, pa, b)
