"""The prefix-closure links in a compiled table, beside the compiled masks (:mod:`kvtier.indexer.index.tablemasks`).

:class:`TableClosure` is :class:`kvtier.indexer.index.closure.PrefixClosure` with its links (parent -> children) in the
masks' table of :mod:`kvtier.indexer.index.tablekernel`: a parent's row holds its one child, or says that its
children are
a set, kept in the Python dict ``branches`` (a branch is rare: a prompt that diverges where others went on). A
block's links live exactly as long as its row (nobody holds it: both go), so a store finds them where it finds the
mask, with no probe of a table of its own. Loose blocks stay Python sets. The store, removal and clearing kernels
link and look at children themselves; ``kids`` reads the links as a mapping for everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.indexer.index.closure import Kids, MaskMap, PrefixClosure
from kvtier.indexer.index.keys import BlockKey
from kvtier.indexer.index.keytable import CHILD, KEY, LINKS_NONE, LINKS_SET, USED, KeyTable


class KidMap(Mapping[BlockKey, Kids]):
    """The links of a :class:`TableClosure`, read as the dict :class:`PrefixClosure` keeps (one compiled lookup
    per read)."""

    __slots__ = ("_c",)

    def __init__(self, closure: TableClosure) -> None:
        self._c = closure

    def __getitem__(self, key: BlockKey) -> Kids:
        t = self._c.table
        i = t.slot(key)
        if i < 0 or t.r[i, USED] == LINKS_NONE:
            raise KeyError(key)
        if t.r[i, USED] == LINKS_SET:
            return self._c.branches[key]
        return BlockKey(int(t.r[i, CHILD]))

    def _rows(self) -> Any:
        t = self._c.table
        return np.flatnonzero(t.r[:, USED] > LINKS_NONE)

    def __iter__(self) -> Iterator[BlockKey]:
        return iter(self._c.table.r[self._rows(), KEY].tolist())

    def __len__(self) -> int:
        return len(self._rows())


class TableClosure(PrefixClosure):
    """:class:`PrefixClosure` with compiled links (module docstring). Every method keeps its complexity."""

    __slots__ = ("branches", "table")

    def __init__(self, table: KeyTable) -> None:
        super().__init__()
        self.table = table  # the masks, with each block's links in its row
        self.branches: dict[BlockKey, set[BlockKey]] = {}  # parent -> its children, where it has several
        self.kids = KidMap(self)  # type: ignore[assignment]

    def link(self, parent: BlockKey, child: BlockKey, alive: MaskMap) -> None:
        """:meth:`PrefixClosure.link` (``alive`` is the compiled masks, read directly). O(1)."""
        self._link([parent], [child], np.array([parent], np.uint64), np.array([child], np.uint64))

    def link_chain(self, keys: Sequence[BlockKey], karr: Any) -> None:
        """Links each key of a chain under the one before it (``karr``: the keys as an array). O(keys)."""
        if len(keys) > 1:
            self._link(keys[:-1], keys[1:], karr[:-1], karr[1:])

    def _link(self, parents: Sequence[BlockKey], children: Sequence[BlockKey], parr: Any, carr: Any) -> None:
        t = self.table
        cur = np.zeros(len(parents), np.uint64)
        how = t.k.link_chain(t.r, parr, carr, cur)
        if how.any():
            self.branched(parents, children, how, cur)

    def branched(self, parents: Sequence[BlockKey | None], children: Sequence[BlockKey], how: Any, cur: Any) -> None:
        """What the link kernels leave to Python, the sets of a parent's children: where ``how[j]`` is 1,
        ``children[j]`` joins its parent's set; where 2, the parent's set is made of its child ``cur[j]`` and
        ``children[j]``. O(pairs)."""
        for j in np.flatnonzero(how).tolist():
            self._branch(parents[j], children[j], int(how[j]), cur[j])

    def branched_chain(self, first: BlockKey | None, keys: Sequence[BlockKey] | npt.NDArray[np.uint64], how: Any,
                       cur: Any) -> None:
        """:meth:`branched` for a stored chain: link ``j`` is ``keys[j]`` under ``keys[j - 1]``, the first under
        ``first`` (``keys``: a list, or the ``uint64`` array a store kernel wrote, read only where a link has work).
        O(links with work), where a list of the parents, or of the keys, would cost O(chain) per store."""
        for j in how.nonzero()[0].tolist():
            parent = first if j == 0 else BlockKey(int(keys[j - 1]))
            self._branch(parent, BlockKey(int(keys[j])), int(how[j]), cur[j])

    def _branch(self, parent: BlockKey | None, child: BlockKey, how: int, cur: Any) -> None:
        assert parent is not None, "a link under the root"
        if how == 1:
            self.branches[parent].add(child)
        else:
            self.branches[parent] = {BlockKey(int(cur)), child}

    def removed_found(self, slot: int, tier: int, gone: list[BlockKey], kids: list[BlockKey],
                      branched: list[BlockKey], holds: Callable[[list[BlockKey]], Sequence[int]]) -> None:
        """:meth:`PrefixClosure.removed_all` once the removal kernel found, for the blocks that lost the tier
        (``gone``: may be left empty while the slot has no loose blocks on the tier, as only those read it), their
        single children still holding it (``kids``) and those whose children are a set (``branched``; ``holds``
        says which of a list of keys hold it). O(keys + their children)."""
        loose = self.loose.get((slot, tier))
        if loose is not None:
            loose.difference_update(gone)
        if branched:
            linked = [c for p in branched for c in self.branches[p]]
            kids = kids + [c for c, h in zip(linked, holds(linked), strict=True) if h]
        self.settle(slot, tier, kids)

    def died(self, key: BlockKey) -> None:
        self.died_all([key])

    def died_all(self, keys: list[BlockKey]) -> None:
        """:meth:`PrefixClosure.died_all`: their links went with their rows; their children's sets go here.
        O(keys) while any set is kept, else O(1)."""
        self.unbranch(keys)

    def unbranch(self, dead: list[BlockKey]) -> None:
        """Forgets the children's sets of ``dead`` blocks (their rows went with them). O(len(dead)) while any
        set is kept."""
        if self.branches:
            for _ in map(self.branches.pop, dead, repeat(None)):
                pass

    def _check(self) -> None:
        """Asserts that the parents whose children are a set kept in Python are exactly those flagged so in the
        masks' table (a dead parent's set goes with its row). O(table)."""
        r = self.table.r
        flagged = set(r[r[:, USED] == LINKS_SET, KEY].tolist())
        kept = set(self.branches)
        assert flagged == kept, (f"{len(kept - flagged)} children's sets kept for parents not flagged, "
                                 f"{len(flagged - kept)} parents flagged without a set")

    def links(self) -> list[tuple[BlockKey, list[BlockKey]]]:
        return [(p, sorted(c) if isinstance(c, set) else [c]) for p, c in self.kids.items()]
