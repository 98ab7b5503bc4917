"""kvtier.util.signals: the one way the CLI, the live engine and the indexer service hold signal handlers."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest

from kvtier.util.signals import STOP_SIGNALS, handling


def test_handlers_are_held_for_the_block_and_given_back() -> None:
    """Inside the block a stop signal reaches the handler; after it, even one left by an exception, the handlers
    before are back. A signal ignored before (nohup's SIGHUP) stays ignored inside."""
    got: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    term_before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(RuntimeError), handling(STOP_SIGNALS, note) as held:
            assert held
            assert signal.getsignal(signal.SIGTERM) is note
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            signal.raise_signal(signal.SIGTERM)  # (to this thread; its handler has run when the call returns)
            signal.raise_signal(signal.SIGHUP)  # ignored: never reaches the handler
            raise RuntimeError
        assert got == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is term_before
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def test_off_the_main_thread_nothing_changes() -> None:
    """Python sets handlers from the main thread only: elsewhere the block runs with the handlers as they are."""
    seen: list[object] = []

    def body() -> None:
        with handling(STOP_SIGNALS, lambda signum, frame: None) as held:
            seen.extend([held, signal.getsignal(signal.SIGTERM)])

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [False, signal.getsignal(signal.SIGTERM)]


def test_a_handler_set_from_c_is_left_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler Python did not install (``getsignal`` None: set by a program embedding Python) cannot be put back
    once replaced: the block leaves it alone. (The CLI's held interrupt did; one helper for all then set SIG_DFL in
    its place after the block, and a Ctrl-C killed the embedding program outright. From review BB.)"""
    real_get, real_set = signal.getsignal, signal.signal
    set_int: list[object] = []

    def getsignal(sig: int) -> object:
        return None if sig == signal.SIGINT else real_get(sig)

    def set_signal(sig: int, handler: object) -> object:
        if sig == signal.SIGINT:
            set_int.append(handler)
            return None
        return real_set(sig, handler)  # type: ignore[arg-type]

    monkeypatch.setattr(signal, "getsignal", getsignal)
    monkeypatch.setattr(signal, "signal", set_signal)
    with handling((signal.SIGINT, *STOP_SIGNALS), lambda signum, frame: None) as held:
        assert held
    assert set_int == []
