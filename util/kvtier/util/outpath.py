"""A file a command writes later (a snapshot, a series, a residency dump): what keeps it from being written, said
when the command starts, not after the work it was to hold."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def unwritable(path: str | Path) -> str | None:
    """Why ``path`` cannot be written as a file, or None: it is a directory, a socket or a loop of links, or its
    directory is missing, no directory or not writable (a device or a FIFO: it is not writable itself). A symbolic
    link is judged by where it leads, as the writers write there (a file is made beside the one a link names and
    renamed over it). O(1)."""
    path = Path(os.path.realpath(path))  # (realpath, not Path.resolve: a loop comes back as it is, not raised)
    where = path.parent
    try:
        mode: int | None = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a loop of symbolic links; name a file"
        mode = None  # nothing there yet
    if mode is not None and stat.S_ISDIR(mode):
        return "is a directory; name a file in it"
    if mode is not None and stat.S_ISSOCK(mode):
        return "is a socket; name a file"
    if mode is not None and not stat.S_ISREG(mode):  # a device or a FIFO: written through, nothing made beside it
        return None if os.access(path, os.W_OK) else "is not writable"
    if where.exists() and not where.is_dir():
        return f"{where} is not a directory"
    if not where.is_dir():
        return f"directory {where} does not exist"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"directory {where} is not writable"
    return None


__all__ = ["unwritable"]
