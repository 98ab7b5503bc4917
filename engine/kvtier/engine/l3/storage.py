"""L3 page stores: one file per page, keyed by the page's hash.

:class:`PageStore` keeps the metadata every store needs (which pages are committed, their parents and
LRU order in a :class:`~kvtier.engine.l3.pagetree.PageTree`; who announced them) and, when given a directory, the
page bytes as self-checking files (:mod:`kvtier.engine.l3.pagefile`) in a directory several
processes may share (:mod:`kvtier.engine.l3.pagedir`). A page that fails its check, or whose file
is gone, is never served: the read fails, the caller drops the page (:meth:`PageStore.drop`) and
its announcers publish ``BlockRemoved``. On start a directory store adopts the sound pages its
owner held before (prefix-closed, within capacity), so a restarted engine is warm.

Three invariants make the store safe for event consumers and for the disk under it:

* **prefix closure**: a page is committed only after its parent (``begin_write``
  counts pending children too), and only pages with no committed or pending
  children are evicted (leaf-first LRU). So every announced page's parent is
  announced too, and a state dump never names an unknown parent;
* **capacity**: committed pages and writes in flight together never outnumber it. A write takes its room when it
  is reserved (``begin_write`` evicts then, or refuses), so the files on disk stay within it too;
* pages being read (``pin``) are never evicted. A pin belongs to the entry it was taken on: a reader's
  ``unpin`` of a page dropped meanwhile (:meth:`PageStore.drop`) never touches the entry of the page written
  again since, so pins never go negative.

A store is *shared* when several engines use it (an external pool): each engine
announces the pages it wrote or found present, and on eviction every announcer
is told, so each can publish its own ``BlockRemoved``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.engine.l3.pagedir import PageDir, SyncPolicy
from kvtier.engine.l3.pagefile import DRAFT_PREFIX, Layout, PageFileError, PageHeader
from kvtier.engine.l3.pagetree import EngineTag, PageEntry, PageMeta, PageTree
from kvtier.util.ratelog import suffix, worth_logging
from kvtier.wire.protocol import StorageTier

log = logging.getLogger(__name__)

#: Called with the keys an announcer loses to eviction.
EvictListener = Callable[[list[str]], None]


@dataclass(slots=True)
class StoreStats:
    """What a directory store found wrong, and what it adopted (``kvtier engine`` prints them)."""

    damaged_reads: int = 0  # reads that failed their check (checksum, size, key, layout): never served
    missing_reads: int = 0  # reads of a page whose file was gone
    adopted: int = 0  # pages adopted on start
    dropped_at_start: int = 0  # held pages found damaged, orphaned, or over capacity on start
    refused_writes: int = 0  # writes refused for want of room (every other page pinned or under a write in flight)
    tmp_removed: int = 0  # temporary files of dead writers removed on start
    unheld_removed: int = 0  # page files no owner held, removed on start
    release_failures: int = 0  # holds or page files that could not be removed (PageDir.release)
    probe_failures: int = 0  # pages another owner wrote that could not be held (PageDir.probe)


class StoreError(RuntimeError):
    """A page file is missing or damaged; ``key`` is the page (without a ``d:`` prefix)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"page {key}: {reason}")
        self.key = key


class PageStore:
    """A capacity-bounded L3 page store (see the module docstring)."""

    def __init__(self, capacity_pages: int, directory: Path | None = None, *, shared: bool = False,
                 tier: StorageTier | None = None, layout: Layout | None = None, owner: str = "store",
                 sync: SyncPolicy = SyncPolicy.NONE) -> None:
        """``directory``: where page files live (None: metadata only, a modeled data path). ``layout``
        and ``owner`` name this store's pages inside it (see :mod:`kvtier.engine.l3.pagedir`): keep the
        owner stable across restarts to get the pages back. O(files in the directory)."""
        if type(capacity_pages) is not int or capacity_pages < 1:
            raise ValueError(f"store capacity must be >= 1 page, got {capacity_pages!r}")
        self.capacity = capacity_pages
        self.directory = directory
        self.shared = shared
        self.tier = tier or (StorageTier.EXTERNAL if shared else StorageTier.DISK)
        self._stats = StoreStats()
        self._tree = PageTree()  # committed pages and writes in flight, with the leaves in LRU order
        self._entries = self._tree.entries  # (read on every lookup)
        # Announcer set -> its one shared copy (_interned). Never pruned: it holds each distinct set that ever
        # occurred, one for a private store, a few for a pool (engines announce the pages they write or find).
        self._tags: dict[frozenset[EngineTag], frozenset[EngineTag]] = {}
        self._pending = self._tree.pending  # key being written -> its meta
        self._listeners: dict[EngineTag, EvictListener] = {}
        self._dir = PageDir(directory, layout or Layout(), owner, sync) if directory is not None else None
        if self._dir is not None:
            self._adopt()

    @property
    def stats(self) -> StoreStats:
        """What the store found wrong and adopted, with its directory's failures to release and to hold. O(1)."""
        if self._dir is not None:
            self._stats.release_failures = self._dir.release_failures
            self._stats.probe_failures = self._dir.probe_failures
        return self._stats

    def close(self) -> None:
        """Lets another process (a restart) act as this store's owner; the pages stay."""
        if self._dir is not None:
            self._dir.close()

    @property
    def pages_path(self) -> Path | None:
        """The folder of this store's page files (None without a directory)."""
        return None if self._dir is None else self._dir.pages

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
        """A committed page's metadata: the store's own entry, read-only to callers. O(1)."""
        return self._entries[key]

    def is_pending(self, key: str) -> bool:
        return key in self._pending

    def lookup(self, key: str) -> bool:
        """Committed here, or (a shared directory) sound on disk, written by another process: then
        adopted, unannounced, if its parent is committed here and the store has room for it, made as a write makes
        it (:meth:`begin_write`). O(1), plus a header read on a miss, and the pages evicted."""
        if key in self._entries:
            return True
        if self._dir is None or not self.shared or key in self._pending:
            return False
        header = self._dir.probe(key)
        if header is None:
            return False
        meta = _meta_of(header)
        parent = self._entries.get(meta.parent_key) if meta.parent_key is not None else None
        if meta.parent_key is not None and (parent is None or parent.depth + 1 != meta.depth):
            self._dir.release([key])  # (a depth off its parent's is a damaged header)
            return False
        if not self._make_room(protect=meta.parent_key or ""):
            return False  # (a child of it still being written is dropped when it lands: no page without its parent)
        if meta.parent_key is not None:
            self._tree.add_child(meta.parent_key)
        self._insert(key, meta, frozenset())
        return True

    def unannounced(self) -> list[str]:
        """Committed pages no engine announced (adopted on start), parents first. O(pages)."""
        return self._tree.by_depth([k for k, e in self._entries.items() if not e.announcers])

    def announced_by(self, engine: EngineTag) -> list[str]:
        """Keys ``engine`` announced, parents before children. O(pages)."""
        return self._tree.by_depth([k for k, e in self._entries.items() if engine in e.announcers])

    def is_announced(self, key: str) -> bool:
        """Committed and announced by at least one engine."""
        e = self._entries.get(key)
        return e is not None and bool(e.announcers)

    def announce(self, key: str, engine: EngineTag) -> bool:
        """Marks a committed page as announced by ``engine``; True if it was not already."""
        e = self._entries[key]
        self._tree.touch(key)
        if engine in e.announcers:
            return False
        e.announcers = self._interned(e.announcers | {engine})
        return True

    def _interned(self, tags: frozenset[EngineTag]) -> frozenset[EngineTag]:
        """The one shared object equal to ``tags`` (a store has few distinct announcer sets: one engine's,
        or for a pool, sets of its engines). O(len(tags))."""
        return self._tags.setdefault(tags, tags)

    def withdraw(self, engine: EngineTag) -> None:
        """Forgets every announcement of ``engine`` (its reset); unannounced pages stay as data."""
        for e in self._entries.values():
            if engine in e.announcers:
                e.announcers = self._interned(e.announcers - {engine})

    def touch(self, key: str) -> None:
        """Marks a page used now (evicted last among the leaves). O(1)."""
        self._tree.touch(key)

    # --- writes --------------------------------------------------------------------------

    def begin_write(self, key: str, meta: PageMeta) -> bool:
        """Reserves ``key`` before its bytes are written; True if it did. A write in flight takes its room at once:
        least-recently-used leaves are evicted to make it (never its parent), so committed pages and writes in
        flight together stay within capacity, and a disk sized to the capacity holds every file. False, with
        nothing reserved, when no room can be made: every other page is pinned, the parent, or under a write in
        flight (counted: ``stats.refused_writes``). A write that fails or is aborted then has still cost the page it
        evicted. Asserts its parent is present. O(pages evicted, + pinned leaves skipped)."""
        if not self._make_room(protect=meta.parent_key or ""):
            self._stats.refused_writes += 1
            return False
        self._tree.reserve(key, meta)
        return True

    def write_pages(self, pages: Sequence[tuple[str, bytes | memoryview]]) -> None:
        """Writes reserved pages' files, all or nothing (no-op without a directory). Runs on a copy
        thread: it only reads the reservations. A page whose reservation is gone (a reset) is skipped.
        ``d:`` keys are draft-model companions of the page after the prefix. O(bytes)."""
        if self._dir is None:
            return
        items = []
        for key, payload in pages:
            meta = self._pending.get(key.removeprefix(DRAFT_PREFIX))
            if meta is not None:
                items.append((PageHeader(key, self._dir.layout, meta.event_hash, meta.parent_key,
                                         meta.parent_hash, meta.depth, meta.tokens), payload))
        self._dir.write(items)

    def read_page(self, key: str, size: int | None = None) -> memoryview:
        """A page file's verified KV bytes (``size`` of them, where given: a page of the reader's pool). Raises
        :class:`StoreError` if it is gone or damaged, or of another size (counted, logged sparsely); the caller drops
        the page. O(bytes)."""
        if self._dir is None:
            raise StoreError(key, "this store keeps no bytes (modeled data path)")
        base = key.removeprefix(DRAFT_PREFIX)
        try:
            payload = self._dir.read(key)[1]
            if size is not None and len(payload) != size:
                raise PageFileError(f"{len(payload)} bytes, not the {size} of a page here")
            return payload
        except FileNotFoundError:
            self.stats.missing_reads += 1
            n, why = self.stats.missing_reads, "file is gone"
        except (OSError, PageFileError) as exc:
            self.stats.damaged_reads += 1
            n, why = self.stats.damaged_reads, f"damaged ({exc})"
        if worth_logging(n):
            log.warning("L3 %s: page %s not served: %s%s", self._dir.base, key, why, suffix(n, "PageStore.stats"))
        raise StoreError(base, why)

    def commit(self, key: str, engine: EngineTag) -> bool:
        """The page's bytes are durable: it becomes readable, announced by ``engine``. True if so.

        False (the page is dropped) when its parent is not committed: aborted meanwhile, e.g. by
        another engine's reset in a shared pool, or still in flight from another engine: a page
        never lives without its parent. Nothing is evicted: the page took its room when it was reserved.
        """
        meta = self._tree.unreserve(key)
        if meta.parent_key is not None and meta.parent_key not in self._entries:
            self._tree.drop_child(meta.parent_key)  # the parent, if it still comes, must not count this page
            self._unlink(key)
            return False
        self._insert(key, meta, frozenset((engine,)))
        return True

    def _insert(self, key: str, meta: PageMeta, announcers: frozenset[EngineTag]) -> None:
        """Commits ``key`` (its parent counts it already), with the children reserved under it meanwhile."""
        self._tree.insert(key, PageEntry(meta.event_hash, meta.parent_key, meta.parent_hash, meta.buf, meta.depth,
                                         meta.page, meta.stride, announcers=self._interned(announcers)))

    def abort(self, key: str) -> None:
        """Drops a reservation whose write failed or was abandoned (a reset, which waits for the copies in flight: a
        write that finished meanwhile left its files, which go too; a failed write removed its own)."""
        meta = self._tree.unreserve(key)
        if meta.parent_key is not None:
            self._tree.drop_child(meta.parent_key)
        if self._dir is not None:
            self._dir.release(_with_drafts([key]))

    # --- reads ---------------------------------------------------------------------------

    def pin(self, keys: list[str]) -> list[PageEntry]:
        """Marks committed pages as being read (never evicted meanwhile); returns their entries, for :meth:`unpin`.
        O(keys)."""
        pinned = [self._entries[k] for k in keys]
        for k, e in zip(keys, pinned, strict=True):
            e.pins += 1
            self._tree.touch(k)
        return pinned

    def unpin(self, pinned: Sequence[PageEntry]) -> None:
        """The reads of what :meth:`pin` returned are done. Each entry loses its own pin: one dropped meanwhile is no
        longer the store's, and the entry of its page written again since keeps its own readers' pins. O(entries)."""
        for e in pinned:
            e.pins -= 1

    # --- eviction ------------------------------------------------------------------------

    def _room(self) -> int:
        """Pages the store can take before it evicts: committed pages and writes in flight both count. O(1)."""
        return self.capacity - len(self._entries) - len(self._pending)

    def _make_room(self, protect: str) -> bool:
        """Evicts unpinned least-recently-used leaves other than ``protect`` (the parent of the page to come) until
        one more page fits; True if it does. Each announcer is told what it lost. O(pages evicted, + pinned leaves
        skipped)."""
        lost: dict[EngineTag, list[str]] = {}
        while self._room() < 1:
            victim = next((k for k in self._tree.leaves if self._entries[k].pins == 0 and k != protect), None)
            if victim is None:
                break  # every other page is pinned or under a write in flight
            self._remove(victim, lost)
        for engine, keys in lost.items():
            self._listeners[engine](keys)
        return self._room() >= 1

    def delete(self, key: str) -> None:
        """Deletes a page explicitly. Raises ``ValueError`` if it has children or readers."""
        e = self._entries[key]
        if e.children or e.pins:
            raise ValueError(f"page {key} has {e.children} children and {e.pins} readers")
        lost: dict[EngineTag, list[str]] = {}
        self._remove(key, lost)
        for engine, keys in lost.items():
            self._listeners[engine](keys)

    def drop(self, key: str) -> list[str]:
        """Removes a page that cannot be served (damaged, or its file gone) with every committed
        descendant, whatever reads are in flight: their reads fail too (their pins stay with the removed
        entries). Announcers are told. Returns the keys removed, children first. O(pages) (a scan for descendants)."""
        if key not in self._entries:
            return []
        order = self._tree.subtree(key)
        lost: dict[EngineTag, list[str]] = {}
        for k in reversed(order):  # leaves first: a parent's children count reaches 0 as it goes
            self._remove(k, lost)
        for engine, keys in lost.items():
            self._listeners[engine](keys)
        return order[::-1]

    def _remove(self, key: str, lost: dict[EngineTag, list[str]]) -> None:
        e = self._tree.remove(key)  # (only a drop() removes a page with children: those still being written)
        for engine in e.announcers:
            lost.setdefault(engine, []).append(key)
        self._unlink(key)

    def clear(self) -> None:
        """Drops every page (a private store's engine was reset)."""
        if self._dir is not None:
            self._dir.release(_with_drafts(self._entries))
        self._tree.clear_committed()

    def _unlink(self, key: str) -> None:
        """Releases a page's file and its draft-model companion (``d:`` + key), if any."""
        if self._dir is not None:
            self._dir.release(_with_drafts([key]))

    # --- start-up ------------------------------------------------------------------------

    def _adopt(self) -> None:
        """Takes back the sound pages this owner held: prefix-closed, most recently written first
        within capacity; the rest are released. Adopted pages are unannounced until an engine
        announces them (:meth:`unannounced`)."""
        assert self._dir is not None
        found, counts = self._dir.scan()
        self.stats.tmp_removed += counts["tmp_removed"]
        self.stats.unheld_removed += counts["orphans_removed"]
        self.stats.dropped_at_start += counts["damaged"]
        keep, drop = _choose(found, self.capacity)
        self._dir.release(_with_drafts(drop))
        self.stats.dropped_at_start += len(drop)
        for key, (meta, _) in keep.items():  # parents first
            if meta.parent_key is not None:
                self._tree.add_child(meta.parent_key)
            self._insert(key, meta, frozenset())
        for key, _ in sorted(keep.items(), key=lambda kv: kv[1][1]):  # LRU order: oldest written first
            self._tree.touch(key)
        self.stats.adopted = len(self._entries)
        if self._entries or drop or any(counts.values()):
            log.info("L3 %s: adopted %d pages; dropped %d held, removed %d tmp and %d unheld files",
                     self._dir.base, len(self._entries), self.stats.dropped_at_start, counts["tmp_removed"],
                     counts["orphans_removed"])

    def _check(self) -> None:
        """Asserts the tree's invariants (prefix closure, children, leaves) and the store's own. O(pages^2)."""
        self._tree._check()
        assert self._room() >= 0, f"{len(self._entries)} pages and {len(self._pending)} writes over {self.capacity}"
        for k, e in self._entries.items():
            assert e.pins >= 0, f"page {k}: negative pins"
            assert self._tags.get(e.announcers) is e.announcers, f"page {k}: announcer set not interned"


def _with_drafts(keys: Iterable[str]) -> list[str]:
    """Each key and its draft-model companion's (``d:`` + key), which lives and goes with it."""
    return [k for key in keys for k in (key, DRAFT_PREFIX + key)]


def _meta_of(header: PageHeader) -> PageMeta:
    return PageMeta(header.event_hash, header.parent_key, header.parent_hash, header.tokens, header.depth)


_Kept = dict[str, tuple[PageMeta, float]]  # key -> (meta, mtime)


def _choose(found: list[tuple[PageHeader, float]], capacity: int) -> tuple[_Kept, list[str]]:
    """Which found pages to adopt (parents first, the newest first among equals, at most ``capacity``,
    none without its parent, nor one whose depth is not its parent's plus one: a damaged header) and which to drop.
    O(n log n)."""
    found = sorted(found, key=lambda hm: (hm[0].depth, -hm[1]))
    keep: _Kept = {}
    drop: list[str] = []
    for header, mtime in found:
        parent = keep.get(header.parent_key) if header.parent_key is not None else None
        if len(keep) < capacity and (header.parent_key is None
                                     or (parent is not None and parent[0].depth + 1 == header.depth)):
            keep[header.key] = (_meta_of(header), mtime)
        else:
            drop.append(header.key)
    return keep, drop
