"""The indexer service's snapshot file: the index plus each stream's last applied position.

A restarted service restores the index and resumes every stream right after the batch it had
applied last (the publisher is first checked to still hold that batch, else it is a new process and
the stream starts over). Only what the publishers' replay buffers no longer hold falls back to a
dump or a partial mark. The file is written atomically (a temporary file in the same directory,
fsynced, then renamed over the old one), so a crash mid-write leaves the previous snapshot intact; a failed write
removes its temporary file, and a start removes those crashed writers left (:func:`remove_stale`). A running
service holds its path (:func:`claim`): a second one is refused. A checksum
over what it holds refuses a file damaged since (a flipped bit in a block key would restore a wrong index).

A snapshot is taken in two parts: :func:`capture` copies the index and the positions on the thread that applies
events (a few compiled passes over its tables), and :func:`write` encodes and writes that copy, on another thread if
the caller likes, while events go on being applied.
"""

from __future__ import annotations

import fcntl
import glob
import os
import re
import secrets
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from kvtier.indexer.index.snapshot import Capture, encode
from kvtier.indexer.index.tiered import TieredIndex
from kvtier.util.infile import read_input
from kvtier.util.outpath import unwritable
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import WorkerId
from kvtier.wire.transport.frames import MAX_SEQ

#: This format: version 2 always carries a checksum. Version 1 files (written before checksums) are still read.
VERSION = 2

#: stream -> (next seq, digest of the last applied batch); see StreamTracker.position.
Positions = dict[StreamId, tuple[int, int | None]]


def check_path(path: Path) -> None:
    """``ValueError`` naming what keeps :func:`save` from writing ``path``: a directory that is missing or not
    writable, a directory where the file would be, or another service holding the path (:func:`claim`); checked
    when the service starts, not 30 s later. Removes the temporary files of writers that are gone
    (:func:`remove_stale`). O(1), plus the directory's entries."""
    problem = unwritable(path)
    if problem is not None:
        raise ValueError(f"snapshot {path}: {problem}")
    claim(path).release()


def _real(path: Path) -> Path:
    """The file ``path`` names, links followed: the rename replaces that file, and a symbolic link at ``path`` stays
    one; its temporary files and lock file live beside it."""
    return Path(os.path.realpath(path))


def _temporary(path: Path) -> Path:
    """A new temporary file of a writer of ``path``, beside the file it names, made here (``O_EXCL``) and so no other
    writer's: named for the pid and a random part, as two containers' services (each pid 1) may share a volume."""
    real = _real(path)
    while True:
        tmp = real.with_name(f".{real.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
            return tmp
        except FileExistsError:
            continue


class Claim:
    """A service's hold on its snapshot path: an exclusive ``flock`` on the lock file ``.<name>.lock`` beside the
    snapshot, for as long as it runs. A second service on the path (another container on a shared volume) is
    refused rather than writing over the first one's file, and the holder knows every temporary file of the path
    to be a gone writer's. The lock file stays when released: removing it would let two services lock two
    files."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        """Lets go (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def claim(path: Path) -> Claim:
    """Holds ``path`` for this service (:class:`Claim`) and removes what crashed writers left (:func:`remove_stale`);
    ``ValueError`` if another service holds it. O(1), plus the directory's entries."""
    real = _real(path)
    lock = real.with_name(f".{real.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(f"snapshot {path}: in use by another indexer (it holds the lock on {lock})") from None
    except BaseException:
        os.close(fd)
        raise
    held = Claim(fd)
    try:
        remove_stale(path)
    except BaseException:
        held.release()
        raise
    return held


def remove_stale(path: Path) -> list[Path]:
    """Removes the temporary files writers of ``path`` left when they crashed mid-write (each the size of a snapshot;
    a crash-looping service on a full disk would leave one a life). The caller holds the path (:func:`claim`): no
    other writer is at work. Returns what it removed."""
    real = _real(path)
    prefix, removed = f".{real.name}.tmp-", []
    for tmp in real.parent.glob(f"{glob.escape(prefix)}*"):
        if _TEMPORARY.fullmatch(tmp.name[len(prefix):]) is None:
            continue  # (not a name a writer makes)
        try:
            tmp.unlink()
            removed.append(tmp)
        except FileNotFoundError:
            pass
    return removed


_TEMPORARY = re.compile(r"[0-9]+(-[0-9a-f]{8})?")  # what follows ".<name>.tmp-" (a pid alone: an older writer's)


@dataclass(frozen=True, slots=True)
class Pending:
    """A snapshot copied out of the index, to be written (:func:`write`) while the index goes on changing."""

    index: Capture  # TieredIndex.capture
    positions: Positions  # each stream's, when it was taken


def capture(index: TieredIndex, positions: Positions, guard: AbstractContextManager[object] | None = None) -> Pending:
    """A copy of the index and the streams' positions, taken together (the index's writer's thread; ``guard``: the
    service's lock, see ``TieredIndex.capture``). O(index entries), a few compiled passes: the part of a snapshot
    that stops the index's writer."""
    return Pending(index.capture(guard), dict(positions))


def save(path: Path, index: TieredIndex, positions: Positions) -> int:
    """Writes the snapshot atomically; returns its size in bytes. :func:`capture`, then :func:`write`."""
    return write(path, capture(index, positions))


def write(path: Path, pending: Pending) -> int:
    """Writes a captured snapshot atomically (any thread); returns its size in bytes. O(index entries log
    entries) to encode, then the file."""
    index = encode(pending.index)
    positions = [[s.worker, s.dp_rank, seq, digest] for s, (seq, digest) in pending.positions.items()]
    data = msgspec.msgpack.encode({"version": VERSION, "index": index, "positions": positions,
                                   "checksum": _checksum(index, positions)})
    real = _real(path)
    tmp = _temporary(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, real)
    except BaseException:  # a full disk: the part written would hold its space until the next start
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(real.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself is durable
    finally:
        os.close(dir_fd)
    return len(data)


def _checksum(index: bytes, positions: list[Any]) -> int:
    """xxh3-64 of the index's bytes and the positions' (a damaged file is refused whole, never restored wrong).
    O(bytes)."""
    h = xxhash.xxh3_64(index)
    h.update(msgspec.msgpack.encode(positions))
    return h.intdigest()


def load(path: Path, block_size: int) -> tuple[TieredIndex, Positions]:
    """Reads a snapshot; ``ValueError`` naming the file and what is wrong with it. O(file)."""
    try:
        obj = msgspec.msgpack.decode(read_input(path, None))  # (not a FIFO or a device: a file, of any size)
        if not isinstance(obj, dict) or obj.get("version") not in (1, VERSION):
            raise ValueError(f"unsupported snapshot version {obj.get('version') if isinstance(obj, dict) else None!r}")
        if obj["version"] == VERSION and "checksum" not in obj:
            raise ValueError("no checksum, which every file of its version carries (a damaged file); "
                             "remove it to start afresh")
        if "checksum" in obj and obj["checksum"] != _checksum(obj["index"], obj["positions"]):
            raise ValueError("damaged: its checksum does not match what it holds (a torn or corrupted file); "
                             "remove it to start afresh")
        index = TieredIndex.restore(obj["index"])
        positions: Positions = {}
        for w, dp, seq, digest in obj["positions"]:
            if not (isinstance(w, str) and isinstance(dp, int) and dp >= 0 and isinstance(seq, int)
                    and 1 <= seq <= MAX_SEQ + 1 and (digest is None or isinstance(digest, int))):
                # (save writes a stream's next seq, so at least 1, after a batch it applied)
                raise ValueError(f"stream position {[w, dp, seq, digest]!r}; expected [worker, dp rank >= 0, "
                                 f"next seq in 1..{MAX_SEQ + 1}, digest or null]")
            positions[StreamId(WorkerId(w), dp)] = (seq, digest)
    except KeyError as exc:  # (a field the file lacks: str(exc) would be its name alone)
        raise ValueError(f"snapshot {path}: no {exc} field, which a snapshot holds (a damaged file); remove it to "
                         "start afresh") from None
    except (OSError, msgspec.DecodeError, TypeError, ValueError, IndexError, RecursionError) as exc:
        raise ValueError(f"snapshot {path}: {exc}") from None
    if index.block_size != block_size:
        raise ValueError(f"snapshot {path}: block size {index.block_size}, the service's is {block_size}")
    return index, positions
