"""The indexer service's snapshot file: the index plus each stream's last applied position.

A restarted service restores the index and resumes every stream right after the batch it had
applied last (the publisher is first checked to still hold that batch, else it is a new process and
the stream starts over). Only what the publishers' replay buffers no longer hold falls back to a
dump or a partial mark. The file is written atomically (a temporary file in the same directory,
fsynced, then renamed over the old one), so a crash mid-write leaves the previous snapshot intact.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from kvtier.indexer.index.tiered import TieredIndex
from kvtier.util.infile import read_input
from kvtier.util.outpath import unwritable
from kvtier.wire.notices import StreamId
from kvtier.wire.protocol import WorkerId

VERSION = 1

#: stream -> (next seq, digest of the last applied batch); see StreamTracker.position.
Positions = dict[StreamId, tuple[int, int | None]]


def check_path(path: Path) -> None:
    """``ValueError`` naming what keeps :func:`save` from writing ``path``: a directory that is missing or not
    writable, or a directory where the file would be (checked when the service starts, not 30 s later). O(1)."""
    problem = unwritable(path)
    if problem is not None:
        raise ValueError(f"snapshot {path}: {problem}")


def save(path: Path, index: TieredIndex, positions: Positions) -> int:
    """Writes the snapshot atomically; returns its size in bytes. O(index entries)."""
    data = msgspec.msgpack.encode({
        "version": VERSION,
        "index": index.snapshot(),
        "positions": [[s.worker, s.dp_rank, seq, digest] for s, (seq, digest) in positions.items()],
    })
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself is durable
    finally:
        os.close(dir_fd)
    return len(data)


def load(path: Path, block_size: int) -> tuple[TieredIndex, Positions]:
    """Reads a snapshot; ``ValueError`` naming the file and what is wrong with it. O(file)."""
    try:
        obj = msgspec.msgpack.decode(read_input(path, None))  # (not a FIFO or a device: a file, of any size)
        if not isinstance(obj, dict) or obj.get("version") != VERSION:
            raise ValueError(f"unsupported snapshot version {obj.get('version') if isinstance(obj, dict) else None!r}")
        index = TieredIndex.restore(obj["index"])
        positions: Positions = {StreamId(WorkerId(str(w)), int(dp)): (int(seq), None if digest is None else int(digest))
                                for w, dp, seq, digest in obj["positions"]}
    except (OSError, msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"snapshot {path}: {exc}") from None
    if index.block_size != block_size:
        raise ValueError(f"snapshot {path}: block size {index.block_size}, the service's is {block_size}")
    return index, positions
