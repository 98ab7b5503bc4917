"""Prometheus text exposition (format 0.0.4): families grouped, each with ``# HELP`` and ``# TYPE``,
label values and help text escaped as the format requires."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Labels = Mapping[str, str]
_KINDS = ("counter", "gauge", "histogram")


@dataclass(slots=True)
class Family:
    """One metric family and its samples."""

    name: str  # metric name; a counter's ends in ``_total``
    kind: str  # "counter", "gauge" or "histogram"
    help: str  # one line of help text
    # (name suffix, labels, value) per sample: the suffix is empty but for a histogram's _bucket/_sum/_count
    samples: list[tuple[str, Labels, float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> None:
        """One series' value (a counter or a gauge)."""
        self.samples.append(("", labels, value))

    def add_histogram(self, h: Mapping[str, Any], **labels: str) -> None:
        """One series of a histogram given in the JSON form of
        :meth:`kvtier.indexer.service.histogram.Histogram.as_dict`
        (``buckets`` as cumulative ``[le, count]``, ``le`` null for +Inf; ``sum``; ``count``). O(buckets)."""
        for bound, n in h["buckets"]:
            self.samples.append(("_bucket", {**labels, "le": _number(math.inf if bound is None else bound)}, n))
        self.samples.append(("_sum", labels, h["sum"]))
        self.samples.append(("_count", labels, h["count"]))


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
        assert f.kind in _KINDS, f"{f.name}: unsupported metric type {f.kind!r}"
        assert f.kind == "histogram" or all(not sfx for sfx, _, _ in f.samples), f"{f.name}: suffix outside a histogram"
        lines.append(f"# HELP {f.name} {_escape_help(f.help)}")
        lines.append(f"# TYPE {f.name} {f.kind}")
        for sfx, labels, value in f.samples:
            body = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            name = f.name + sfx
            lines.append(f"{name}{{{body}}} {_number(value)}" if body else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"
