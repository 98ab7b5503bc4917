"""A directory of L3 page files that several processes can share without deleting each other's pages.

::

    ROOT/<layout tag>/
        pages/<key>          one file per page (kvtier.engine.l3.pagefile format)
        refs/<owner>/<key>   hard links: the pages an owner holds
        refs/.<owner>.lock   flock held by the one process acting as that owner (so no owner name starts with '.')
        .lock                flock: linking and unlinking decisions are made under it
        .tmp-h<where>-<pid>-s<store>-*  writes in flight (<where>: the writer's host name, boot and pid namespace;
                                        <store>: a token of the writing PageDir)

Ownership is the link count: an owner holds a page by a hard link under ``refs/<owner>``; releasing
a page removes that link, and the page file goes only when no owner links it any more (``st_nlink``
back to 1), decided under the lock. So a process evicting, resetting or restarting never deletes a
page another process holds, and two owners writing the same page share one file. A restarted owner
finds its holdings under ``refs/<owner>`` (:meth:`PageDir.scan`); ``.tmp`` files of dead writers and pages nobody
holds are removed then. A writer's process id means something only where it ran, so a temporary file written
elsewhere (another host, or a container with a pid namespace of its own sharing the pool) is judged by its age alone
(:data:`STALE_TMP_S`); one written here goes when its writer is provably gone (:func:`_dead_tmp`).

Writes go to a temporary file, are made durable per the :class:`SyncPolicy`, then linked into
``pages/`` (never replacing a file another owner may hold). A batch that fails part-way removes
everything it wrote.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import secrets
import socket
import time
import weakref
from collections.abc import Iterator, Sequence
from enum import StrEnum
from pathlib import Path

from kvtier.engine.l3.pagefile import DRAFT_PREFIX, Layout, PageFileError, PageHeader, decode, encode, read_header
from kvtier.util.pids import alive
from kvtier.util.ratelog import suffix, worth_logging

log = logging.getLogger(__name__)

# (files without the h<where> part are this host's; those without the s<store> part were never this process's)
_TMP = re.compile(r"^\.tmp-(?:h([0-9a-f]{8})-)?(\d+)-(?:s([0-9a-f]{16})-)?")
#: A temporary file older than this is a dead writer's, wherever it ran: a write holds one for the time it takes to
#: write a batch of pages, seconds on a slow disk.
STALE_TMP_S = 3600.0


def _where() -> str:
    """Where this process's ids mean what they say, as 8 hex digits: its host name, boot (Linux: a reboot reuses
    process ids) and pid namespace (containers sharing a host name and boot, e.g. with host networking, number their
    processes apart: each may run the engine as pid 1). A restarted container has a new pid namespace: what it left
    goes by its age."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


_WHERE = _where()
#: Token -> the PageDir of this process that names its temporary files with it (while it exists).
_STORES: weakref.WeakValueDictionary[str, PageDir] = weakref.WeakValueDictionary()


def tmp_prefix(pid: int | None = None, host: str = _WHERE, token: str = "") -> str:
    """The name prefix of a temporary page file written by process ``pid`` (this one's by default) at ``host``, by the
    PageDir whose :attr:`PageDir.token` is ``token`` (none: a name without the store's part)."""
    return f".tmp-h{host}-{os.getpid() if pid is None else pid}-" + (f"s{token}-" if token else "")


def _dead_tmp(name: str, mtime: float) -> bool:
    """Whether ``name`` is a temporary file no writer will finish: past :data:`STALE_TMP_S` wherever it was written;
    before that, only one written here (:func:`_where`) by a writer provably gone: a process that no longer exists, or
    one with this process's id but not written by a PageDir of this process (an earlier process with this id). A file
    of a live store of this process stays; so does one written elsewhere, whose process id means nothing here."""
    m = _TMP.match(name)
    if m is None:
        return False
    if time.time() - mtime > STALE_TMP_S:
        return True
    if m.group(1) not in (None, _WHERE):
        return False
    pid = int(m.group(2))
    if pid == os.getpid():
        return m.group(3) is None or m.group(3) not in _STORES
    return not alive(pid)


class OwnerBusy(OSError):
    """Another process holds this owner's lock on the directory."""


class SyncPolicy(StrEnum):
    """When page files are forced to stable storage (``--l3-sync``)."""

    NONE = "none"  # never: the OS writes back when it likes; a power loss may lose recent pages
    PAGE = "page"  # each page file, and the directory after each link: durable when committed
    BATCH = "batch"  # a copy op's files together, then the directory once: durable when committed


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_name(key: str) -> str:
    return key.replace(":", "_")


def key_of(name: str) -> str:
    draft = file_name(DRAFT_PREFIX)
    return DRAFT_PREFIX + name[len(draft):] if name.startswith(draft) else name


class PageDir:
    """One owner's view of a shared page directory (see the module docstring)."""

    def __init__(self, root: Path, layout: Layout, owner: str, sync: SyncPolicy = SyncPolicy.NONE) -> None:
        # (a name starting with '.' could be another owner's lock file, ".<owner>.lock", or "." / "..")
        if not owner or "/" in owner or owner.startswith("."):
            raise ValueError(f"store owner {owner!r} is not allowed: expected a non-empty name without '/' that does "
                             "not start with '.'")
        self.layout = layout.tag()
        self.owner = owner
        self.sync = sync
        self.base = root / self.layout
        self.pages = self.base / "pages"
        self.refs = self.base / "refs" / owner
        self.token = secrets.token_hex(8)  # in the names of this PageDir's temporary files (see _dead_tmp)
        self.release_failures = 0  # pages whose hold or file could not be removed (see release)
        self.probe_failures = 0  # pages another owner wrote that could not be held (see probe)
        self.pages.mkdir(parents=True, exist_ok=True)
        self.refs.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.base / ".lock"
        # One process per owner: a second one would adopt, and so release, the first one's pages.
        self._owner_fd = os.open(self.base / "refs" / f".{owner}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._owner_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._owner_fd)
            self._owner_fd = -1
            raise OwnerBusy(f"L3 {self.base}: owner {owner!r} is in use by another process") from None
        _STORES[self.token] = self

    def close(self) -> None:
        """Gives up the owner lock (also released when the process exits)."""
        if getattr(self, "_owner_fd", -1) >= 0:
            os.close(self._owner_fd)
            self._owner_fd = -1

    def __del__(self) -> None:
        self.close()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o666)  # (the umask decides, as for pages)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    # --- writes --------------------------------------------------------------------------

    def write(self, items: Sequence[tuple[PageHeader, bytes | memoryview]]) -> None:
        """Writes pages and takes this owner's hold on each; all or nothing. O(bytes)."""
        tmps: list[str] = []
        linked: list[str] = []
        try:
            for header, payload in items:
                fd, tmp = self._new_file()
                tmps.append(tmp)
                with os.fdopen(fd, "wb") as f:
                    f.writelines(encode(header, payload))
                    if self.sync is not SyncPolicy.NONE:
                        f.flush()
                        if self.sync is SyncPolicy.PAGE:
                            os.fsync(f.fileno())
            if self.sync is SyncPolicy.BATCH:
                for tmp in tmps:
                    fd = os.open(tmp, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            # Another owner's file of a page is checked here, outside the pool's lock (a read of the whole page):
            # found damaged, and still the same file under the lock, it is replaced by this one.
            damaged = {name: st for header, _ in items
                       if (st := self._damaged(self.pages / (name := file_name(header.key)), header.key))}
            with self._locked():
                for (header, _), tmp in zip(items, tmps, strict=True):
                    name = file_name(header.key)
                    page = self.pages / name
                    try:
                        os.link(tmp, page)
                    except FileExistsError:  # another owner wrote the same page: its file is shared, never
                        if name in damaged:  # replaced, unless it is damaged: then this one's is
                            self._replace(tmp, page, damaged[name])
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)  # the page's link count now counts owners only
                    linked.append(name)
                    self._hold(page, self.refs / name)
                    if self.sync is SyncPolicy.PAGE:
                        _fsync_dir(self.pages)
                        _fsync_dir(self.refs)
                if self.sync is SyncPolicy.BATCH:
                    _fsync_dir(self.pages)
                    _fsync_dir(self.refs)
        except BaseException:
            for tmp in tmps:
                with contextlib.suppress(OSError):  # (one that cannot go is a dead file once this PageDir is gone)
                    os.unlink(tmp)
            with self._locked():
                self._release_locked(linked)
            raise

    def _new_file(self) -> tuple[int, str]:
        """A new temporary file (descriptor, path) for a page, made here (``O_EXCL``), readable by whom the umask
        lets read it: another user's engine on a shared pool reads and holds the page (mkstemp's files are the
        owner's alone). O(1)."""
        while True:
            tmp = str(self.base / (tmp_prefix(token=self.token) + secrets.token_hex(6)))
            try:
                return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
            except FileExistsError:
                continue

    def _damaged(self, page: Path, key: str) -> os.stat_result | None:
        """The file at ``page`` (its stat) if it is there and fails its checks; None if it is sound, missing or
        cannot be read (not taken for damage). O(size)."""
        try:
            with open(page, "rb") as f:
                st = os.fstat(f.fileno())
                decode(f.read(), key, self.layout)
        except PageFileError:
            return st
        except OSError:
            return None
        return None

    def _replace(self, tmp: str, page: Path, bad: os.stat_result) -> None:
        """Puts the file ``tmp`` at ``page`` in place of the damaged file ``bad``, if that is still the one there,
        and moves every owner's hold on it to the new file: the link count goes on counting owners, and no holder
        keeps a file no read finds. Under the lock. O(owners)."""
        with contextlib.suppress(FileNotFoundError):
            if not os.path.samestat(os.stat(page), bad):
                return  # (replaced, or removed and written again, since it was checked: shared as found)
        holders = []
        for owner in os.scandir(self.base / "refs"):
            ref = Path(owner.path) / page.name
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                if owner.is_dir() and os.path.samestat(os.stat(ref), bad):
                    holders.append(ref)
        os.replace(tmp, page)
        for ref in holders:
            self._hold(page, ref)

    def _hold(self, page: Path, ref: Path) -> None:
        """This owner's link ``ref`` to the file at ``page`` now: a link it held to a file since replaced there (a
        damaged one) is replaced too, through a temporary link (a crash leaves a dead writer's file). Under the
        lock. O(1)."""
        try:
            os.link(page, ref)
        except FileExistsError:
            if not os.path.samefile(page, ref):
                fresh = self.base / (tmp_prefix(token=self.token) + secrets.token_hex(4))
                os.link(page, fresh)
                os.replace(fresh, ref)

    # --- reads ---------------------------------------------------------------------------

    def read(self, key: str) -> tuple[PageHeader, memoryview]:
        """Reads and verifies a page. Raises :class:`PageFileError` (damaged) or ``OSError``. O(size)."""
        data = (self.pages / file_name(key)).read_bytes()
        return decode(data, key, self.layout)

    def probe(self, key: str) -> PageHeader | None:
        """A page another owner wrote, if present and sound: its header, and this owner now holds it. Otherwise None,
        as for a page this owner cannot hold: the file could not be read (EACCES: another user's), or the lock or the
        hard link could not be made (a full or read-only disk: ENOSPC, EDQUOT, EROFS), which is counted in
        :attr:`probe_failures` and logged sparsely."""
        name = file_name(key)
        try:
            with self._locked():
                try:
                    header = read_header(str(self.pages / name), key, self.layout)
                except FileNotFoundError:
                    return None
                except PageFileError:  # (damaged: not to be held; a file that cannot be read is counted below)
                    return None
                with contextlib.suppress(FileExistsError):
                    os.link(self.pages / name, self.refs / name)
        except OSError as exc:
            self.probe_failures += 1
            n = self.probe_failures
            if worth_logging(n):
                log.warning("L3 %s: page %s found but not taken: %s%s", self.base, key, exc.strerror or exc,
                            suffix(n, "PageDir.probe_failures"))
            return None
        return header

    # --- releases ------------------------------------------------------------------------

    def release(self, keys: Sequence[str]) -> None:
        """Drops this owner's hold; files no owner holds are deleted. O(keys).

        Never raises ``OSError``: the caller has let the pages go already (its store no longer has them, and their
        announcers are told), so a hold or file that cannot be removed (EIO, EROFS, ...; or no lock) is counted in
        :attr:`release_failures`, logged sparsely, and left as a crash at that point would leave it: a hold under
        ``refs/<owner>`` nobody counts, or a page file nobody holds. This process never serves it (it is not in the
        store); the page's next release (it is written again, sharing that file, and goes again) retries, and so does
        the next start-up scan (:meth:`scan`), which judges it like any leftover: an unheld file is removed, a hold is
        adopted only if its header is sound and its parent is adopted too, and a page's payload is checked when read.
        """
        if keys:
            try:
                with self._locked():
                    self._release_locked([file_name(k) for k in keys])
            except OSError as exc:  # (the lock: _release_locked raises none)
                self._release_failed(file_name(keys[0]), exc)

    def _release_locked(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.refs / name)
                page = self.pages / name
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(page).st_nlink <= 1:
                        os.unlink(page)
            except OSError as exc:
                self._release_failed(name, exc)

    def _release_failed(self, name: str, exc: OSError) -> None:
        """Counts and logs (sparsely) a hold or page file :meth:`release` could not remove."""
        self.release_failures += 1
        n = self.release_failures
        if worth_logging(n):
            log.warning("L3 %s: page %s released but its file not removed: %s; left for its next release or the next "
                        "start-up scan%s", self.base, key_of(name), exc.strerror or exc,
                        suffix(n, "PageDir.release_failures"))

    # --- start-up ------------------------------------------------------------------------

    def scan(self) -> tuple[list[tuple[PageHeader, float]], dict[str, int]]:
        """This owner's sound holdings (header, mtime), after removing what nobody can use. O(files).

        Removes ``.tmp`` files of dead writers, this owner's holds on damaged or foreign pages (and on pages whose
        file in ``pages/`` is gone or replaced), and pages no owner holds. Draft companions (``d:`` keys) are not
        returned; they stay held beside their pages, and go where their page is not held. The counts say what was
        found and removed.
        """
        found: list[tuple[PageHeader, float]] = []
        counts = {"adoptable": 0, "damaged": 0, "tmp_removed": 0, "orphans_removed": 0}
        with self._locked():
            for entry in os.scandir(self.base):
                # (a writer in another process removes its temporary files outside the lock when its batch fails:
                # one listed here may be gone by now)
                with contextlib.suppress(FileNotFoundError):
                    if entry.name.startswith(".tmp-") and _dead_tmp(entry.name, entry.stat().st_mtime):
                        os.unlink(entry.path)
                        counts["tmp_removed"] += 1
            bad: list[str] = []
            drafts: list[tuple[str, str]] = []  # (file name, its page's key) of sound drafts
            for entry in os.scandir(self.refs):
                key = key_of(entry.name)
                try:
                    header = read_header(entry.path, key, self.layout)
                    try:  # the page's own file, which reads and other owners find it by
                        shared = os.path.samestat(entry.stat(), os.stat(self.pages / entry.name))
                    except FileNotFoundError:
                        shared = False
                    if not shared:
                        raise PageFileError("its file in pages/ is gone or another file")
                except (OSError, PageFileError) as exc:
                    log.warning("L3 %s: dropping page %s: %s", self.base, key, exc)
                    bad.append(entry.name)
                    continue
                if key.startswith(DRAFT_PREFIX):
                    drafts.append((entry.name, key.removeprefix(DRAFT_PREFIX)))
                else:
                    found.append((header, entry.stat().st_mtime))
            # A draft goes with its page: one whose page is dropped or not held would stay held for good (no store
            # ever names it: it is released with its page).
            held = {h.key for h, _ in found}
            bad += [name for name, base in drafts if base not in held]
            counts["damaged"] = len(bad)
            self._release_locked(bad)
            for entry in os.scandir(self.pages):
                if entry.stat().st_nlink <= 1:
                    os.unlink(entry.path)
                    counts["orphans_removed"] += 1
        counts["adoptable"] = len(found)
        return found, counts
