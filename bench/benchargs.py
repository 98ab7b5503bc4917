"""Command-line readers the benchmarks share: a bad value is argparse's one line (exit 2), never a traceback later.

Numbers are read by :class:`kvtier.util.fields.Domain`, as the ``kvtier`` CLI reads them; comma-separated lists
check every element.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from kvtier.util.fields import Domain


def count(lo: int = 1) -> Callable[[str], int]:
    """An integer >= ``lo``."""
    return Domain(int, lo=lo).parse


def counts(lo: int = 1) -> Callable[[str], list[int]]:
    """Comma-separated integers, each >= ``lo``."""
    one = count(lo)
    return lambda text: [one(x) for x in text.split(",")]


def positive(text: str) -> float:
    """A number > 0."""
    return float(Domain(float, lo=0, lo_open=True).parse(text))


def at_least(lo: float) -> Callable[[str], float]:
    """A number >= ``lo``."""
    return Domain(float, lo=lo).parse


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    return float(Domain(float, lo=0, lo_open=True, hi=1).parse(text))


def rates(text: str) -> list[float]:
    """Comma-separated numbers, each > 0."""
    return [positive(x) for x in text.split(",")]


def directory(text: str) -> Path:
    """An existing directory."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such directory")
    return Path(text)


def existing_file(text: str) -> Path:
    """An existing file."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return Path(text)


def executable(text: str) -> str:
    """An executable, as a path or a name on ``PATH`` (an interpreter to run a peer with)."""
    if shutil.which(text) is None:
        raise argparse.ArgumentTypeError(f"{text}: no such executable")
    return text


def names(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``choices``."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        got = text.split(",")
        unknown = [n for n in got if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown)} unknown; expected some of {', '.join(allowed)}")
        return got
    return parse
