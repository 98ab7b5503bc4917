"""Signal handlers installed for the length of a block. The CLI's commands, the live engine and the indexer service
each turn a stop signal (SIGTERM from a supervisor, SIGHUP from a closing terminal) into their own clean stop, and
give the process its handlers back afterwards: a run inside a process that goes on (a test's, a notebook's) leaves
none behind that would swallow a signal.

Three rules hold for every caller: a signal ignored when the block starts stays ignored (``nohup`` ignores SIGHUP so
that its command outlives the terminal); a signal whose handler was set from C (a program embedding Python) keeps
it, as Python could not put it back; and only the main thread changes handlers (Python lets no other), so off it the
block runs with the handlers as they are.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

__all__ = ["STOP_SIGNALS", "handling"]

#: Signals that ask a process to stop as Ctrl-C does: a supervisor's (SIGTERM), the terminal's closing (SIGHUP).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

Handler = Callable[[int, FrameType | None], object]


@contextlib.contextmanager
def handling(signals: Iterable[int], handler: Handler) -> Iterator[bool]:
    """Handles ``signals`` with ``handler`` while the block runs, those ignored before or handled from C excepted;
    yields whether it did (False off the main thread, where nothing changes). The handlers before are back after.
    O(signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    before = {sig: old for sig in signals if (old := signal.getsignal(sig)) not in (signal.SIG_IGN, None)}
    for sig in before:
        signal.signal(sig, handler)
    try:
        yield True
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)
