"""The domain of every configuration field, stated once beside the field and checked once.

A configuration dataclass declares each field's domain in its metadata
(``workers: int = field(default=4, metadata=at_least(1))``) and calls :func:`check_fields` in
``__post_init__``; a command-line option that maps to no dataclass states its domain as its
argparse ``type`` (``type=Domain(float, lo=0, lo_open=True).parse``). Either way a bad value
gives one :class:`ConfigError` naming the option, the value and what is allowed, e.g.
``--page-size: 0 is not allowed; expected an integer >= 1``. Booleans are never numbers here,
and floats must be finite unless a domain says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A configuration value outside its domain; the message names the option, value and domain."""


@dataclass(frozen=True, slots=True)
class Domain:
    """What values one field accepts."""

    kind: type  # int, float, str or bool (an int is accepted where a float is; a bool is no number)
    lo: float | None = None  # lower bound
    hi: float | None = None  # upper bound
    lo_open: bool = False  # lo itself excluded
    hi_open: bool = False  # hi itself excluded
    choices: tuple[str, ...] | None = None  # for str: the allowed values
    optional: bool = False  # None is allowed (meaning: the default behaviour)
    option: str | None = None  # the name users know it by, when not --field-name

    def describe(self) -> str:
        """The allowed values in words, e.g. "a number in [0, 1]"."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        if self.kind is bool:
            return "true or false"
        what = "an integer" if self.kind is int else "a number" if self.kind is float else "a string"
        if self.lo is not None and self.hi is not None:
            return f"{what} in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{what} {'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"{what} {'<' if self.hi_open else '<='} {self.hi:g}"
        return what

    def ok(self, value: object) -> bool:
        """True if ``value`` is in the domain. O(1) (O(choices) for strings)."""
        if value is None:
            return self.optional
        if self.kind is bool or isinstance(value, bool):
            return self.kind is bool and isinstance(value, bool)
        if self.kind is str:
            return isinstance(value, str) and (self.choices is None or value in self.choices)
        if self.kind is int and not isinstance(value, int):
            return False
        if not isinstance(value, int | float) or (isinstance(value, float) and not math.isfinite(value)):
            return False
        if self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)):
            return False
        return not (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))

    def check(self, name: str, value: object) -> None:
        """Raises :class:`ConfigError` naming ``name`` unless ``value`` is in the domain."""
        if not self.ok(value):
            shown = value.value if hasattr(value, "value") else value
            raise ConfigError(f"{name}: {shown!r} is not allowed; expected {self.describe()}"
                              f"{' (or unset)' if self.optional else ''}")

    def parse(self, text: str) -> Any:
        """An argparse ``type``: converts and checks a command-line string."""
        try:
            value: Any = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {self.describe()}") from None
        if not self.ok(value):
            raise argparse.ArgumentTypeError(f"{text} is not allowed; expected {self.describe()}")
        return value

    def meta(self) -> Mapping[str, Domain]:
        """As dataclass field metadata."""
        return {"domain": self}


def at_least(lo: float, kind: type = int, **kw: Any) -> Mapping[str, Domain]:
    return Domain(kind, lo=lo, **kw).meta()


def positive(kind: type = float, **kw: Any) -> Mapping[str, Domain]:
    return Domain(kind, lo=0, lo_open=True, **kw).meta()


def within(lo: float, hi: float, kind: type = float, **kw: Any) -> Mapping[str, Domain]:
    return Domain(kind, lo=lo, hi=hi, **kw).meta()


def one_of(*choices: str, **kw: Any) -> Mapping[str, Domain]:
    return Domain(str, choices=tuple(choices), **kw).meta()


def check_fields(obj: Any, style: str = "option") -> None:
    """Checks every field of dataclass ``obj`` that declares a domain, in declaration order.

    ``style``: "option" names fields as command-line options (``--page-size``), "key" as
    configuration-file keys (``page_size``). O(fields).
    """
    for f in dataclasses.fields(obj):
        domain = f.metadata.get("domain")
        if domain is None:
            continue
        name = domain.option or f"--{f.name.replace('_', '-')}" if style == "option" else f.name
        domain.check(name, getattr(obj, f.name))


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (``kvtier replay: error: ...``, exit 2), not usage plus error."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
