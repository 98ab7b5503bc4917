"""The prefix-closure links in a compiled table, beside the compiled masks (:mod:`kvtier.indexer.tablemasks`).

:class:`TableClosure` is :class:`kvtier.indexer.closure.PrefixClosure` with its links (parent -> children) in a
table of :mod:`kvtier.indexer.tablekernel`: a parent's row holds its one child, or says that its children are a
set, kept in the Python dict ``branches`` (a branch is rare: a prompt that diverges where others went on).
Loose blocks stay Python sets. Linking a chain, finding the held children of removed blocks and dropping the
links of dead blocks are one kernel call each; ``kids`` reads the links as a mapping for everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from kvtier.indexer.closure import Kids, MaskMap, PrefixClosure
from kvtier.indexer.keys import BlockKey
from kvtier.indexer.keytable import KeyTable, _Table


class KidTable(_Table):
    """Parent key -> [its one child, 1 if its children are a set kept in Python instead]."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(2)


class KidMap(Mapping[BlockKey, Kids]):
    """The links of a :class:`TableClosure`, read as the dict :class:`PrefixClosure` keeps (one compiled lookup
    per read)."""

    __slots__ = ("_c",)

    def __init__(self, closure: TableClosure) -> None:
        self._c = closure

    def __getitem__(self, key: BlockKey) -> Kids:
        kt = self._c.kt
        i = kt.slot(key)
        if i < 0:
            raise KeyError(key)
        if kt.tv[i, 1]:
            return self._c.branches[key]
        return BlockKey(int(kt.tv[i, 0]))

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._c.kt.tk[self._c.kt.used()].tolist())

    def __len__(self) -> int:
        return len(self._c.kt)


class TableClosure(PrefixClosure):
    """:class:`PrefixClosure` with compiled links (module docstring). Every method keeps its complexity."""

    __slots__ = ("_t", "branches", "kt")

    def __init__(self, table: KeyTable) -> None:
        super().__init__()
        self._t = table  # the masks: whether a child is alive, whether it holds a bit
        self.kt = KidTable()  # parent -> its child, or a flag: its children are in branches
        self.branches: dict[BlockKey, set[BlockKey]] = {}  # parent -> its children, where it has several
        self.kids = KidMap(self)  # type: ignore[assignment]

    def link(self, parent: BlockKey, child: BlockKey, alive: MaskMap) -> None:
        """:meth:`PrefixClosure.link` (``alive`` is the compiled masks, read directly). O(1)."""
        self.link_all([parent], [child])

    def link_all(self, parents: Sequence[BlockKey], children: Sequence[BlockKey]) -> None:
        """Links each child under the parent at its position. O(pairs), in one kernel call."""
        self._link(parents, children, np.array(parents, np.uint64), np.array(children, np.uint64))

    def link_chain(self, keys: Sequence[BlockKey], karr: Any) -> None:
        """Links each key of a chain under the one before it (``karr``: the keys as an array). O(keys)."""
        if len(keys) > 1:
            self._link(keys[:-1], keys[1:], karr[:-1], karr[1:])

    def _link(self, parents: Sequence[BlockKey], children: Sequence[BlockKey], parr: Any, carr: Any) -> None:
        n = len(parents)
        if not n:
            return
        kt, t = self.kt, self._t
        kt.reserve(n)
        cur = np.zeros(n, np.uint64)
        how = kt.k.link_chain(kt.tk, kt.tu, kt.tv, kt.meta, t.tk, t.tu, parr, carr, cur)
        if how.any():  # branches: their sets are Python's
            for j in np.flatnonzero(how).tolist():
                if how[j] == 1:
                    self.branches[parents[j]].add(children[j])
                else:
                    self.branches[parents[j]] = {BlockKey(int(cur[j])), children[j]}

    def removed_bulk(self, slot: int, tier: int, gone: list[BlockKey], karr: Any, word: int, bit: Any,
                     holds: Callable[[list[BlockKey]], Sequence[int]]) -> None:
        """:meth:`PrefixClosure.removed_all` for keys whose bit ``bit`` (in mask word ``word``) was just cleared
        (``karr``: them as an array). O(keys + their children)."""
        loose = self.loose.get((slot, tier))
        if loose is not None:
            loose.difference_update(gone)
        n = len(gone)
        kids = np.empty(n, np.uint64)
        branched = np.empty(n, np.uint64)
        t, kt = self._t, self.kt
        found, nb = kt.k.held_kids(kt.tk, kt.tu, kt.tv, t.tk, t.tu, t.tv, karr, word, bit, kids, branched).tolist()
        now: list[BlockKey] = kids[:found].tolist()
        if nb:
            linked = [c for p in branched[:nb].tolist() for c in self.branches[p]]
            now += [c for c, h in zip(linked, holds(linked), strict=True) if h]
        self.settle(slot, tier, now)

    def died(self, key: BlockKey) -> None:
        self.died_all([key])

    def died_all(self, keys: list[BlockKey]) -> None:
        """:meth:`PrefixClosure.died_all`, in one kernel call. O(keys)."""
        if keys:
            kt = self.kt
            if kt.k.drop_links(kt.tk, kt.tu, kt.tv, kt.meta, np.array(keys, np.uint64)):
                pop = self.branches.pop
                for _ in map(pop, keys, repeat(None)):
                    pass

    def links(self) -> list[tuple[BlockKey, list[BlockKey]]]:
        return [(p, sorted(c) if isinstance(c, set) else [c]) for p, c in self.kids.items()]
