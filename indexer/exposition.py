"""Prometheus text exposition (format 0.0.4): families grouped, each with ``# HELP`` and ``# TYPE``,
label values and help text escaped as the format requires."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Labels = Mapping[str, str]


@dataclass(slots=True)
class Family:
    """One metric family and its samples."""

    name: str  # metric name; a counter's ends in ``_total``
    kind: str  # "counter" or "gauge"
    help: str  # one line of help text
    samples: list[tuple[Labels, float]] = field(default_factory=list)  # (labels, value) per series

    def add(self, value: float, **labels: str) -> None:
        self.samples.append((labels, value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(int(v)) if float(v).is_integer() and abs(v) < 2**53 else repr(float(v))


def render(families: Iterable[Family]) -> str:
    """The exposition text. O(samples)."""
    lines: list[str] = []
    for f in families:
        assert f.kind in ("counter", "gauge"), f"{f.name}: unsupported metric type {f.kind!r}"
        lines.append(f"# HELP {f.name} {_escape_help(f.help)}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        for labels, value in f.samples:
            body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            lines.append(f"{f.name}{{{body}}} {_number(value)}" if body else f"{f.name} {_number(value)}")
    return "\n".join(lines) + "\n"
