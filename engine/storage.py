"""L3 page stores: one file per page, keyed by the page's hash.

:class:`PageStore` keeps the metadata every store needs (which pages are committed,
their parents, LRU order, who announced them) and, when given a directory, the
page bytes as files written atomically (temporary file + ``os.replace``).

Two invariants make the store safe for event consumers:

* **prefix closure**: a page is committed only after its parent (``begin_write``
  counts pending children too), and only pages with no committed or pending
  children are evicted (leaf-first LRU). So every announced page's parent is
  announced too, and a state dump never names an unknown parent;
* pages being read (``pin``) are never evicted.

A store is *shared* when several engines use it (an external pool): each engine
announces the pages it wrote or found present, and on eviction every announcer
is told, so each can publish its own ``BlockRemoved``.
"""

from __future__ import annotations

import os
import tempfile
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.wire.protocol import StorageTier

#: L3 key prefix of a page's draft-model KV (speculative decoding), stored beside the target page.
DRAFT_PREFIX = "d:"
#: An engine's identity inside a shared store.
EngineTag = str
#: Called with the keys an announcer loses to eviction.
EvictListener = Callable[[list[str]], None]


@dataclass(slots=True)
class PageMeta:
    """What an engine needs to announce a stored page."""

    event_hash: int  # the hash published in events
    parent_key: str | None  # L3 key of the parent page; None under the root
    parent_hash: int | None  # event hash of the parent page
    tokens: bytes  # the page's token ids as uint32 little-endian (a quarter of a list's memory)
    depth: int  # pages from the root (for parent-first dumps)

    def token_list(self) -> list[int]:
        return array("I", self.tokens).tolist()


@dataclass(slots=True)
class _Entry:
    meta: PageMeta  # page metadata
    children: int = 0  # committed or pending children
    pins: int = 0  # readers in flight
    announcers: set[EngineTag] = field(default_factory=set)  # engines that published it


class StoreError(RuntimeError):
    """A page file is missing or damaged."""


class PageStore:
    """A capacity-bounded L3 page store (see the module docstring)."""

    def __init__(self, capacity_pages: int, directory: Path | None = None, *, shared: bool = False,
                 tier: StorageTier | None = None) -> None:
        if capacity_pages < 1:
            raise ValueError(f"store capacity must be >= 1 page, got {capacity_pages}")
        self.capacity = capacity_pages
        self.directory = directory
        self.shared = shared
        self.tier = tier or (StorageTier.EXTERNAL if shared else StorageTier.DISK)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # committed pages, LRU first
        self._leaves: OrderedDict[str, None] = OrderedDict()  # committed pages without children, LRU first
        self._pending: dict[str, str | None] = {}  # key being written -> parent key
        self._pending_children: dict[str, int] = {}  # key being written -> children begun under it
        self._listeners: dict[EngineTag, EvictListener] = {}
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    # --- membership ----------------------------------------------------------------------

    def attach(self, engine: EngineTag, on_evict: EvictListener) -> None:
        """Registers an engine; a private store takes one."""
        if not self.shared and self._listeners and engine not in self._listeners:
            raise ValueError("a private store serves one engine; use shared=True for a pool")
        self._listeners[engine] = on_evict

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def meta(self, key: str) -> PageMeta:
        return self._entries[key].meta

    def is_pending(self, key: str) -> bool:
        return key in self._pending

    def announced_by(self, engine: EngineTag) -> list[str]:
        """Keys ``engine`` announced, parents before children. O(pages)."""
        keys = [k for k, e in self._entries.items() if engine in e.announcers]
        return sorted(keys, key=lambda k: self._entries[k].meta.depth)

    def is_announced(self, key: str) -> bool:
        """Committed and announced by at least one engine."""
        e = self._entries.get(key)
        return e is not None and bool(e.announcers)

    def announce(self, key: str, engine: EngineTag) -> bool:
        """Marks a committed page as announced by ``engine``; True if it was not already."""
        e = self._entries[key]
        self.touch(key)
        if engine in e.announcers:
            return False
        e.announcers.add(engine)
        return True

    def withdraw(self, engine: EngineTag) -> None:
        """Forgets every announcement of ``engine`` (its reset); unannounced pages stay as data."""
        for e in self._entries.values():
            e.announcers.discard(engine)

    def touch(self, key: str) -> None:
        self._entries.move_to_end(key)
        if key in self._leaves:
            self._leaves.move_to_end(key)

    def _add_child(self, parent_key: str) -> None:
        if parent_key in self._entries:
            e = self._entries[parent_key]
            e.children += 1
            self._leaves.pop(parent_key, None)
        else:
            self._pending_children[parent_key] = self._pending_children.get(parent_key, 0) + 1

    def _drop_child(self, parent_key: str) -> None:
        e = self._entries.get(parent_key)
        if e is not None:
            e.children -= 1
            if e.children == 0:
                self._leaves[parent_key] = None
        elif parent_key in self._pending_children:
            self._pending_children[parent_key] -= 1

    # --- writes --------------------------------------------------------------------------

    def begin_write(self, key: str, parent_key: str | None) -> None:
        """Reserves ``key`` before its bytes are written. Asserts its parent is present."""
        assert key not in self._entries and key not in self._pending, f"page {key} written twice"
        if parent_key is not None:
            assert parent_key in self._entries or parent_key in self._pending, (
                f"page {key} written before its parent {parent_key}")
            self._add_child(parent_key)
        self._pending[key] = parent_key

    def write_bytes(self, key: str, data: bytes) -> None:
        """Writes a page file atomically (no-op without a directory)."""
        if self.directory is None:
            return
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read_bytes(self, key: str) -> bytes:
        if self.directory is None:
            raise StoreError("this store keeps no bytes (modeled data path)")
        try:
            return self._path(key).read_bytes()
        except OSError as exc:
            raise StoreError(f"page {key}: {exc}") from None

    def commit(self, key: str, meta: PageMeta, engine: EngineTag) -> bool:
        """The page's bytes are durable: it becomes readable, announced by ``engine``. True if so.

        False (the page is dropped) when its parent is not committed: aborted meanwhile, e.g. by
        another engine's reset in a shared pool, or still in flight from another engine: a page
        never lives without its parent. Evicts
        least-recently-used leaves first if the store is over capacity; their announcers are
        told through their listeners.
        """
        parent_key = self._pending.pop(key)
        if parent_key is not None and parent_key not in self._entries:
            self._pending_children.pop(key, None)
            self._drop_child(parent_key)  # the parent, if it still comes, must not count this page
            self._unlink(key)
            return False
        children = self._pending_children.pop(key, 0)  # written after it began
        self._entries[key] = _Entry(meta, children=children, announcers={engine})
        if children == 0:
            self._leaves[key] = None
        self._evict_over_capacity(protect=key)
        return True

    def abort(self, key: str) -> None:
        """Drops a reservation whose write failed."""
        parent_key = self._pending.pop(key)
        self._pending_children.pop(key, None)
        if parent_key is not None:
            self._drop_child(parent_key)

    # --- reads ---------------------------------------------------------------------------

    def pin(self, keys: list[str]) -> None:
        for k in keys:
            self._entries[k].pins += 1
            self.touch(k)

    def unpin(self, keys: list[str]) -> None:
        for k in keys:
            e = self._entries.get(k)
            if e is not None:
                e.pins -= 1

    # --- eviction ------------------------------------------------------------------------

    def _evict_over_capacity(self, protect: str) -> None:
        lost: dict[EngineTag, list[str]] = {}
        while len(self._entries) > self.capacity:
            victim = next((k for k in self._leaves if self._entries[k].pins == 0 and k != protect), None)
            if victim is None:
                break  # everything is pinned or has children: over capacity until reads end
            self._remove(victim, lost)
        for engine, keys in lost.items():
            self._listeners[engine](keys)

    def delete(self, key: str) -> None:
        """Deletes a page explicitly. Raises ``ValueError`` if it has children or readers."""
        e = self._entries[key]
        if e.children or e.pins:
            raise ValueError(f"page {key} has {e.children} children and {e.pins} readers")
        lost: dict[EngineTag, list[str]] = {}
        self._remove(key, lost)
        for engine, keys in lost.items():
            self._listeners[engine](keys)

    def _remove(self, key: str, lost: dict[EngineTag, list[str]]) -> None:
        e = self._entries.pop(key)
        self._leaves.pop(key, None)
        if e.meta.parent_key is not None:
            self._drop_child(e.meta.parent_key)
        for engine in e.announcers:
            lost.setdefault(engine, []).append(key)
        self._unlink(key)

    def clear(self) -> None:
        """Drops every page (a private store's engine was reset)."""
        for key in list(self._entries):
            self._unlink(key)
        self._entries.clear()
        self._leaves.clear()

    def _unlink(self, key: str) -> None:
        """Removes a page's file and its draft-model companion (``d:`` + key), if any."""
        if self.directory is not None:
            self._path(key).unlink(missing_ok=True)
            self._path(DRAFT_PREFIX + key).unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key.replace(":", "_")

    def _check(self) -> None:
        for k, e in self._entries.items():
            p = e.meta.parent_key
            assert p is None or p in self._entries, f"page {k} present without its parent {p}"
            n = sum(1 for c in self._entries.values() if c.meta.parent_key == k)
            n += sum(1 for pp in self._pending.values() if pp == k)
            assert e.children == n, f"page {k}: children {e.children} but {n} found"
            assert (k in self._leaves) == (e.children == 0), f"page {k}: leaf list out of sync"
            assert e.pins >= 0, f"page {k}: negative pins"
