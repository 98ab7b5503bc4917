"""A file a command reads whole (a configuration, a latency fit, measured points, a snapshot): read in bounded memory,
and never waited on.

A path named on a command line or in a configuration may be anything: a FIFO (opening it waits for a writer, for
ever), a device (``/dev/zero`` never ends), a file far larger than what it should hold. :func:`read_input` refuses
what is not a regular file before reading, and a file past its cap after reading one byte more than the cap, so the
memory a bad path costs is bounded by the cap.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: Caps for files that hold settings: far past any real one, far below what would hurt.
SETTINGS_BYTES = 1 << 20


def read_input(path: str | Path, limit: int | None) -> bytes:
    """The bytes of the regular file ``path``. ``ValueError`` saying why not, without the path (the caller names it
    and its role): it is not a regular file, or it holds more than ``limit`` bytes (None: no cap, for files whose
    size is the data's, such as snapshots), or the OS's reason it cannot be read. O(min(size, limit))."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO opens at once, to be refused below)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ValueError("is a directory, not a file")
        if not stat.S_ISREG(mode):
            raise ValueError("is not a regular file (a FIFO, socket or device is not read)")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read() if limit is None else f.read(limit + 1)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    finally:
        os.close(fd)
    if limit is not None and len(data) > limit:
        raise ValueError(f"larger than {limit:,} bytes")
    return data


def read_text(path: str | Path, limit: int | None, expected: str) -> str:
    """:func:`read_input`, decoded as UTF-8 (what JSON, TOML and these files' CSV are, whatever the locale says).
    ``ValueError`` says why not, without the path: :func:`read_input`'s reasons, or the first byte that is not
    UTF-8 and what the file should hold (``expected``, e.g. ``"a fit JSON"``). O(min(size, limit))."""
    data = read_input(path, limit)
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start}): expected {expected}") from None


__all__ = ["SETTINGS_BYTES", "read_input", "read_text"]
