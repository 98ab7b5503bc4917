#!/usr/bin/env python3
"""Runs the README's quick starts as written: each fenced block whose info string is ``bash quickstart-NAME``.

    python scripts/readme_quickstart.py               # every quick start, in README order
    python scripts/readme_quickstart.py operator      # one of them
    python scripts/readme_quickstart.py --list        # their names

Each block runs in a fresh ``bash`` with ``-e -o pipefail`` from the repository root (where the README's setup
command leaves ``.venv``), echoing its lines as bash reads them (``-v``) with their output, so the transcript is
the block and what it printed. A block that exits non-zero, or runs past ``--timeout`` (its whole process group
is killed then), fails the script: exit status 1, naming the block. Blocks that start background processes stop
them themselves (a ``trap``); the timeout is the backstop, and so is an interrupt (Ctrl-C: exit status 130) or the
transcript's reader going away, which stop the block's whole session.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A fence opening a quick start: ```bash quickstart-NAME; its body runs to the next fence line.
_BLOCK = re.compile(r"^```bash quickstart-([a-z0-9-]+)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def quickstarts(readme: str) -> dict[str, str]:
    """The README's quick-start blocks by name, in order. ``ValueError`` if a name appears twice."""
    blocks: dict[str, str] = {}
    for m in _BLOCK.finditer(readme):
        if m.group(1) in blocks:
            raise ValueError(f"quick start {m.group(1)!r} appears twice in the README")
        blocks[m.group(1)] = m.group(2)
    return blocks


def run_block(name: str, body: str, *, cwd: Path, timeout_s: float) -> int:
    """Runs one block, streaming its transcript to stdout; returns its exit status (124 on timeout)."""
    print(f"=== quickstart-{name}", flush=True)
    proc = subprocess.Popen(["bash", "-v", "-e", "-o", "pipefail", "-c", body], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        with contextlib.suppress(ProcessLookupError):  # (all gone meanwhile)
            os.killpg(proc.pid, signal.SIGKILL)  # the block and everything it started (one session)

    watchdog = threading.Timer(timeout_s, expire)
    watchdog.start()
    try:
        for line in iter(proc.stdout.readline, b""):  # as they come: a block may run a minute
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        rc = proc.wait()
    except BaseException:
        # Ctrl-C (it reaches this process alone: the block has a session of its own), or the transcript's reader
        # gone: what the block started would run on
        stop(proc)
        raise
    finally:
        watchdog.cancel()
        proc.stdout.close()
    if expired.is_set():
        print(f"=== quickstart-{name}: killed after {timeout_s:g} s", flush=True)
        return 124
    print(f"=== quickstart-{name}: exit {rc}", flush=True)
    return rc


def stop(block: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stops every process of ``block``'s session: SIGTERM (the servers stop cleanly), then SIGKILL whatever is left
    after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):  # (all gone already)
        os.killpg(block.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            block.poll()  # (the block's shell reaped: a zombie would still count as one of the session)
            os.killpg(block.pid, 0)  # (raises once none is left)
            time.sleep(0.05)
        os.killpg(block.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="quick starts to run (default: all)")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the README to read (default: %(default)s)")
    p.add_argument("--cwd", type=Path, default=ROOT, help="where the blocks run (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per block (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="print the quick starts' names and exit")
    a = p.parse_args(argv)
    try:
        blocks = quickstarts(a.readme.read_text())
    except (OSError, ValueError) as exc:
        print(f"readme_quickstart: error: {exc}", file=sys.stderr)
        return 2
    if a.list:
        print("\n".join(blocks))
        return 0
    unknown = [n for n in a.names if n not in blocks]
    if not blocks or unknown:
        print(f"readme_quickstart: error: {a.readme} has no quick start {', '.join(unknown) or '(none at all)'}; "
              f"it has: {', '.join(blocks) or 'none'}", file=sys.stderr)
        return 2
    try:
        failed = [n for n in (a.names or list(blocks))
                  if run_block(n, blocks[n], cwd=a.cwd, timeout_s=a.timeout) != 0]
    except KeyboardInterrupt:
        print("readme_quickstart: interrupted; what the block started was stopped", file=sys.stderr)
        return 130
    if failed:
        print(f"readme_quickstart: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
