"""Compiled open-addressing tables for the index (numba): key -> mask words, and engine hash -> key.

A Python dict of millions of int keys costs two or three cache misses and a boxed int per operation, and an
event of 64 blocks needs five such operations per block: about 750,000 blocks a second at best on the dev
machine, half of what the index must apply. Here a table is three arrays (keys, a used flag, rows of
``uint64`` values) probed linearly from a multiplicative hash, and every operation an event or a query needs
runs as one compiled call over all its blocks.

Tables (see :mod:`kvtier.indexer.keytable` for the Python side that owns the arrays):

* ``tk`` (``uint64[cap]``) keys, ``tu`` (``uint8[cap]``) 1 where a slot is used, ``tv`` (``uint64[cap, V]``)
  values; ``cap`` is a power of two and ``meta[0]`` the number of used slots. Callers reserve room before
  an insertion (the load stays under 3/4, so a probe always ends).
* Deletion shifts later entries of the probe run back (no tombstones), so a lookup stops at the first free
  slot.
* The block-key table's rows are a block's mask words (:mod:`kvtier.indexer.masklayout`, 16 slots per word);
  an engine-hash table's rows hold one word, the key (engine hashes are stored as the ``uint64`` of their
  ``int64`` value).

Imported only through :class:`kvtier.wire.jit.LazyKernels`, as :mod:`kvtier.indexer.keykernel` is. Every
integer is a ``uint64`` or an index, never a plain int mixed with a ``uint64`` (numba would make a float).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

_GOLD = np.uint64(0x9E3779B97F4A7C15)
_ONE = np.uint64(1)

Arr = Any  # numpy arrays, as numba sees them


@njit(cache=True, inline="always")
def _home(k: np.uint64, mask: int) -> int:
    # Engine hashes may be small sequential ints: multiply so that they spread (keys are hashes already).
    return int((k * _GOLD) >> np.uint64(32)) & mask  # the product's high half mixes every bit of k


@njit(cache=True)
def find(tk: Arr, tu: Arr, k: np.uint64) -> int:
    """The slot of ``k``, or -1. O(1) expected."""
    mask = tk.shape[0] - 1
    i = _home(k, mask)
    while tu[i]:
        if tk[i] == k:
            return i
        i = (i + 1) & mask
    return -1


@njit(cache=True)
def claim(tk: Arr, tu: Arr, tv: Arr, meta: Arr, k: np.uint64) -> int:
    """The slot of ``k``, claimed with a zero row if absent (as ``-1 - slot``, so callers see it was new).
    The caller has reserved room. O(1) expected."""
    mask = tk.shape[0] - 1
    i = _home(k, mask)
    while tu[i]:
        if tk[i] == k:
            return i
        i = (i + 1) & mask
    tu[i] = 1
    tk[i] = k
    tv[i, :] = 0
    meta[0] += 1
    return -1 - i


@njit(cache=True)
def delete_at(tk: Arr, tu: Arr, tv: Arr, meta: Arr, i: int) -> None:
    """Frees slot ``i`` and moves later entries of its probe run back, so that no lookup stops early. O(run)."""
    mask = tk.shape[0] - 1
    j = i
    while True:
        j = (j + 1) & mask
        if not tu[j]:
            break
        h = _home(tk[j], mask)
        # The entry at j may move to i unless its home lies cyclically in (i, j].
        if (i <= j and i < h <= j) or (i > j and (h > i or h <= j)):
            continue
        tk[i] = tk[j]
        tv[i, :] = tv[j, :]
        i = j
    tu[i] = 0
    meta[0] -= 1


@njit(cache=True)
def rehash(tk: Arr, tu: Arr, tv: Arr, nk: Arr, nu: Arr, nv: Arr) -> None:
    """Moves every entry into the empty (larger, or wider) table ``nk, nu, nv``. O(cap)."""
    mask = nk.shape[0] - 1
    width = tv.shape[1]
    for s in range(tk.shape[0]):
        if tu[s]:
            i = _home(tk[s], mask)
            while nu[i]:
                i = (i + 1) & mask
            nu[i] = 1
            nk[i] = tk[s]
            nv[i, :width] = tv[s, :]


@njit(cache=True)
def used_slots(tu: Arr) -> Arr:
    """The used slots, in table order. O(cap)."""
    return np.flatnonzero(tu)


@njit(cache=True)
def _distinct(a: Arr) -> bool:
    s = np.sort(a)
    for i in range(1, s.shape[0]):  # noqa: SIM110 (numba compiles no generator)
        if s[i] == s[i - 1]:
            return False
    return True


@njit(cache=True)
def bit_state(tk: Arr, tu: Arr, tm: Arr, k: np.uint64, word: int, bit: np.uint64) -> int:
    """-1 if nobody holds ``k``, else 1 if its mask has ``bit`` in ``word``, else 0. O(1)."""
    i = find(tk, tu, k)
    if i < 0:
        return -1
    return 1 if tm[i, word] & bit else 0


@njit(cache=True)
def store_new(tk: Arr, tu: Arr, tm: Arr, tmeta: Arr, keys: Arr, word: int, bit: np.uint64,
              ek: Arr, eu: Arr, ev: Arr, emeta: Arr, ehs: Arr, use_e: bool) -> bool:
    """A chain of blocks nobody holds, under engine hashes new to the worker and distinct (checked when
    ``use_e``: the worker's engine hashes are in the table ``ek, eu, ev``): each key gets the mask ``bit`` and
    each engine hash its key. False, with nothing changed, if any check fails. O(blocks)."""
    for k in keys:
        if find(tk, tu, k) >= 0:
            return False
    if use_e:
        if not _distinct(ehs):
            return False
        for e in ehs:
            if find(ek, eu, e) >= 0:
                return False
    for j in range(keys.shape[0]):
        i = claim(tk, tu, tm, tmeta, keys[j])
        tm[-1 - i if i < 0 else i, word] = bit
    if use_e:
        for j in range(ehs.shape[0]):
            i = claim(ek, eu, ev, emeta, ehs[j])
            ev[-1 - i, 0] = keys[j]
    return True


@njit(cache=True)
def store_held_elsewhere(tk: Arr, tu: Arr, tm: Arr, tmeta: Arr, keys: Arr, word: int, bit: np.uint64,
                         slot_word: int, slot_bits: np.uint64, ek: Arr, eu: Arr, ev: Arr, emeta: Arr, ehs: Arr,
                         use_e: bool, slot_free: bool) -> int:
    """The store of blocks the worker's engine hashes name already (a backup, load-back or prefetch: the same
    engine hashes name the same keys) or of blocks new to the worker under engine hashes new to it, some of
    which others hold. With ``use_e`` the engine-hash table decides which; without, the caller did and
    ``slot_free`` asks to check that no key carries any of the worker's bits (``slot_bits`` in
    ``slot_word``). Sets ``bit`` on every key and returns how many lacked it; -1, with nothing changed, for
    anything else (repeats, an engine hash naming another block, a block held under another name).
    O(blocks)."""
    n = keys.shape[0]
    if not _distinct(keys):
        return -1
    insert_e = False
    if use_e:
        if not _distinct(ehs):
            return -1
        found = 0
        same = 0
        for j in range(n):
            i = find(ek, eu, ehs[j])
            if i >= 0:
                found += 1
                if ev[i, 0] == keys[j]:
                    same += 1
        if same != n:
            if found:
                return -1
            slot_free = True
            insert_e = True
    if slot_free:
        for k in keys:
            i = find(tk, tu, k)
            if i >= 0 and tm[i, slot_word] & slot_bits:
                return -1
    if insert_e:
        for j in range(n):
            i = claim(ek, eu, ev, emeta, ehs[j])
            ev[-1 - i, 0] = keys[j]
    added = 0
    for j in range(n):
        i = claim(tk, tu, tm, tmeta, keys[j])
        if i < 0:
            i = -1 - i
        if not tm[i, word] & bit:
            tm[i, word] |= bit
            added += 1
    return added


@njit(cache=True)
def store_each(tk: Arr, tu: Arr, tm: Arr, tmeta: Arr, keys: Arr, word: int, bit: np.uint64, slot_word: int,
               slot_bits: np.uint64, ek: Arr, eu: Arr, ev: Arr, emeta: Arr, ehs: Arr, newly: Arr,
               counts: Arr) -> bool:
    """Any other store whose engine hashes are distinct and name no other block, block by block: an engine
    hash new to the worker names its block unless the worker holds that block under another name already (an
    alias, left out so that names stay injective); each block gains ``bit``. ``newly[j]`` = 1 where block
    ``j`` gained it; ``counts`` = [blocks that gained it, aliases]. False, with nothing changed, for a repeated
    engine hash or one naming another block. O(blocks)."""
    n = keys.shape[0]
    if not _distinct(ehs):
        return False
    for j in range(n):
        e = find(ek, eu, ehs[j])
        if e >= 0 and ev[e, 0] != keys[j]:
            return False
    added = 0
    aliases = 0
    for j in range(n):
        e = find(ek, eu, ehs[j])
        i = claim(tk, tu, tm, tmeta, keys[j])
        if i < 0:
            i = -1 - i
        if e < 0:
            if tm[i, slot_word] & slot_bits:
                aliases += 1
            else:
                c = claim(ek, eu, ev, emeta, ehs[j])
                ev[-1 - c, 0] = keys[j]
        if tm[i, word] & bit:
            newly[j] = 0
        else:
            tm[i, word] |= bit
            newly[j] = 1
            added += 1
    counts[0] = added
    counts[1] = aliases
    return True


@njit(cache=True)
def _drop_if_empty(tk: Arr, tu: Arr, tm: Arr, tmeta: Arr, i: int) -> bool:
    """Frees slot ``i`` if its mask is empty now (nobody holds the key): a key nobody holds is absent."""
    for w in range(tm.shape[1]):
        if tm[i, w]:
            return False
    delete_at(tk, tu, tm, tmeta, i)
    return True


@njit(cache=True)
def remove(tk: Arr, tu: Arr, tm: Arr, tmeta: Arr, keys: Arr, word: int, bit: np.uint64, slot_word: int,
           slot_bits: np.uint64, ek: Arr, eu: Arr, ev: Arr, emeta: Arr, ehs: Arr, use_e: bool, out: Arr) -> Arr:
    """A ``BlockRemoved`` of the worker's ``bit``: per block, in order, ``out[j]`` is 0 if the block is not
    held there (an unknown engine hash, or a block not on that tier: the caller looks at its orphans), 1 if
    the bit went and the worker still holds the block on another tier, 2 if the worker holds it nowhere now
    (its engine hash goes: the caller drops it unless ``use_e``, where it went here), 3 if nobody holds it
    now (gone from the table). With ``use_e`` engine hashes resolve through the table and ``keys`` is filled
    in; without, the caller resolved them (``out[j]`` = 1 on entry where the engine hash names a block, 0
    otherwise). Returns ``keys``. O(blocks)."""
    n = out.shape[0]
    for j in range(n):
        if use_e:
            e = find(ek, eu, ehs[j])
            if e < 0:
                out[j] = 0
                continue
            keys[j] = ev[e, 0]
        elif not out[j]:
            continue
        i = find(tk, tu, keys[j])
        if i < 0 or not tm[i, word] & bit:
            out[j] = 0
            continue
        tm[i, word] &= ~bit
        if tm[i, slot_word] & slot_bits:
            out[j] = 1
            continue
        out[j] = 3 if _drop_if_empty(tk, tu, tm, tmeta, i) else 2
        if use_e:
            delete_at(ek, eu, ev, emeta, find(ek, eu, ehs[j]))
    return keys


@njit(cache=True)
def has_bit(tk: Arr, tu: Arr, tm: Arr, keys: Arr, word: int, bit: np.uint64) -> Arr:
    """Per key, 1 if its mask has ``bit`` in ``word``. O(keys)."""
    out = np.zeros(keys.shape[0], np.uint8)
    for j in range(keys.shape[0]):
        i = find(tk, tu, keys[j])
        if i >= 0 and tm[i, word] & bit:
            out[j] = 1
    return out


@njit(cache=True)
def clear_slot(tk: Arr, tu: Arr, tm: Arr, tmeta: Arr, keys: Arr, slot_word: int, slot_bits: np.uint64) -> Arr:
    """Takes the slot's bits off each of ``keys``; returns 1 per key nobody holds now (gone from the table).
    O(keys)."""
    dead = np.zeros(keys.shape[0], np.uint8)
    for j in range(keys.shape[0]):
        i = find(tk, tu, keys[j])
        if i < 0:
            continue
        tm[i, slot_word] &= ~slot_bits
        if _drop_if_empty(tk, tu, tm, tmeta, i):
            dead[j] = 1
    return dead


@njit(cache=True)
def _same_row(tm: Arr, a: int, b: int) -> bool:
    for w in range(tm.shape[1]):  # noqa: SIM110 (numba compiles no generator)
        if tm[a, w] != tm[b, w]:
            return False
    return True


@njit(cache=True)
def runs_by_search(tk: Arr, tu: Arr, tm: Arr, keys: Arr, max_runs: int, starts: Arr, rows: Arr) -> int:
    """The runs of equal masks over the leading blocks anybody holds, found by binary search (sound only while
    every tier of every worker is prefix-closed): run ``r`` starts at ``starts[r]`` with the mask of table slot
    ``rows[r]``, and ``starts[runs]`` is where the held prefix ends. Returns the number of runs, or -1 past
    ``max_runs`` (``starts`` and ``rows`` have room for ``max_runs + 1``). O(runs * log(blocks))."""
    total = keys.shape[0]
    pos = 0
    runs = 0
    cur = find(tk, tu, keys[0]) if total else -1
    while cur >= 0:
        if runs == max_runs:
            return -1
        lo, hi = pos + 1, total
        while lo < hi:
            mid = (lo + hi) >> 1
            i = find(tk, tu, keys[mid])
            if i >= 0 and _same_row(tm, i, cur):
                lo = mid + 1
            else:
                hi = mid
        starts[runs] = pos
        rows[runs] = cur
        runs += 1
        pos = lo
        cur = find(tk, tu, keys[pos]) if pos < total else -1
    starts[runs] = pos
    return runs


@njit(cache=True)
def leading_rows(tk: Arr, tu: Arr, keys: Arr) -> Arr:
    """The table slots of the leading blocks anybody holds (a lookup per block). O(leading blocks)."""
    out = np.empty(keys.shape[0], np.int64)
    n = 0
    for k in keys:
        i = find(tk, tu, k)
        if i < 0:
            break
        out[n] = i
        n += 1
    return out[:n]


@njit(cache=True)
def link_chain(kt: Arr, ku: Arr, kv: Arr, kmeta: Arr, tk: Arr, tu: Arr, parents: Arr, children: Arr,
               cur_out: Arr) -> Arr:
    """Links each ``children[j]`` under ``parents[j]`` in the link table (``kv[i]`` = [kid, 1 if the parent's
    kids are a set kept in Python]; ``tk, tu`` are the masks' table, to see whether a kid is alive). Per pair:
    0 done here (new, or linked already, or a dead kid replaced), 1 the caller adds the child to the parent's
    set, 2 the caller makes the set {``cur_out[j]``, child} (the flag is set here). O(pairs)."""
    n = parents.shape[0]
    out = np.zeros(n, np.uint8)
    for j in range(n):
        i = claim(kt, ku, kv, kmeta, parents[j])
        if i < 0:
            kv[-1 - i, 0] = children[j]
            continue
        if kv[i, 1]:
            out[j] = 1
        elif kv[i, 0] != children[j]:
            if find(tk, tu, kv[i, 0]) >= 0:
                cur_out[j] = kv[i, 0]
                kv[i, 1] = 1
                out[j] = 2
            else:
                kv[i, 0] = children[j]
    return out


@njit(cache=True)
def held_kids(kt: Arr, ku: Arr, kv: Arr, tk: Arr, tu: Arr, tm: Arr, keys: Arr, word: int, bit: np.uint64,
              out: Arr, branched: Arr) -> Arr:
    """The single kids of ``keys`` that hold ``bit`` in ``word`` (in ``out``), and the keys whose kids are a set
    kept in Python (in ``branched``): returns [kids found, such keys]. O(keys)."""
    n = 0
    b = 0
    for k in keys:
        i = find(kt, ku, k)
        if i < 0:
            continue
        if kv[i, 1]:
            branched[b] = k
            b += 1
            continue
        c = find(tk, tu, kv[i, 0])
        if c >= 0 and tm[c, word] & bit:
            out[n] = kv[i, 0]
            n += 1
    res = np.empty(2, np.int64)
    res[0] = n
    res[1] = b
    return res


@njit(cache=True)
def drop_links(kt: Arr, ku: Arr, kv: Arr, kmeta: Arr, keys: Arr) -> int:
    """Drops the links of ``keys`` (nobody holds them); returns how many had a set of kids. O(keys)."""
    sets = 0
    for k in keys:
        i = find(kt, ku, k)
        if i >= 0:
            sets += int(kv[i, 1])
            delete_at(kt, ku, kv, kmeta, i)
    return sets


def warm(k: Any) -> None:
    """Compiles (or loads from numba's cache) every kernel with the argument types the index passes."""
    tk = np.zeros(8, np.uint64)
    tu = np.zeros(8, np.uint8)
    tm = np.zeros((8, 1), np.uint64)
    meta = np.zeros(1, np.int64)
    ek, eu, ev, em = np.zeros(8, np.uint64), np.zeros(8, np.uint8), np.zeros((8, 1), np.uint64), np.zeros(1, np.int64)
    one = np.ones(1, np.uint64)
    b = np.uint64(1)
    k.find(tk, tu, b)
    i = k.claim(tk, tu, tm, meta, b)
    k.delete_at(tk, tu, tm, meta, -1 - i)
    k.rehash(tk, tu, tm, np.zeros(16, np.uint64), np.zeros(16, np.uint8), np.zeros((16, 2), np.uint64))
    k.used_slots(tu)
    k.bit_state(tk, tu, tm, b, 0, b)
    k.store_new(tk, tu, tm, meta, one, 0, b, ek, eu, ev, em, one, True)
    k.store_held_elsewhere(tk, tu, tm, meta, one, 0, b, 0, b, ek, eu, ev, em, one, True, False)
    k.store_each(tk, tu, tm, meta, one, 0, b, 0, b, ek, eu, ev, em, one, np.zeros(1, np.uint8), np.zeros(2, np.int64))
    k.remove(tk, tu, tm, meta, one.copy(), 0, b, 0, b, ek, eu, ev, em, one, True, np.zeros(1, np.uint8))
    k.has_bit(tk, tu, tm, one, 0, b)
    k.clear_slot(tk, tu, tm, meta, one, 0, b)
    k.runs_by_search(tk, tu, tm, one, 4, np.zeros(5, np.int64), np.zeros(5, np.int64))
    k.leading_rows(tk, tu, one)
    kv = np.zeros((8, 2), np.uint64)
    k.link_chain(tk, tu, kv, meta, ek, eu, one, one, np.zeros(1, np.uint64))
    k.held_kids(tk, tu, kv, ek, eu, tm, one, 0, b, np.zeros(1, np.uint64), np.zeros(1, np.uint64))
    k.drop_links(tk, tu, kv, meta, one)
