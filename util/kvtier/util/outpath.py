"""A file a command writes later (a snapshot, a series, a residency dump): what keeps it from being written, said
when the command starts, not after the work it was to hold."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def unwritable(path: Path) -> str | None:
    """Why ``path`` cannot be written as a file, or None: it is a directory, or its directory is missing, no
    directory or not writable (a device or a FIFO: it is not writable itself). O(1)."""
    where = path.parent
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "is a loop of symbolic links; name a file"
    if path.is_dir():
        return "is a directory; name a file in it"
    if path.is_socket():
        return "is a socket; name a file"
    if path.exists() and not path.is_file():  # a device or a FIFO: written through, nothing made beside it
        return None if os.access(path, os.W_OK) else "is not writable"
    if where.exists() and not where.is_dir():
        return f"{where} is not a directory"
    if not where.is_dir():
        return f"directory {where} does not exist"
    if not os.access(where, os.W_OK | os.X_OK):
        return f"directory {where} is not writable"
    return None


__all__ = ["unwritable"]
