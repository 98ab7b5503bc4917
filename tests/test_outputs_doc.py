"""docs/outputs.md has an entry for every column and field a run writes, so that none is undocumented."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from kvtier.sim.metrics import RunSummary
from kvtier.sim.report import _COLUMNS, _WIRE_COLUMNS, CSV_FIELDS

DOC = (Path(__file__).resolve().parent.parent / "docs" / "outputs.md").read_text()


def _section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n## ", start + 1)
    return DOC[start:end if end > 0 else None]


def _documented(section: str) -> set[str]:
    """Every backquoted name in the first cell of the section's table rows."""
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            names.update(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return names


def test_every_csv_column_is_documented() -> None:
    assert set(CSV_FIELDS) - _documented(_section("## `requests.csv`")) == set()


def test_every_summary_field_is_documented() -> None:
    fields = {f.name for f in dataclasses.fields(RunSummary)}
    assert fields - _documented(_section("## `summary.json`")) == set()


def test_every_table_column_is_documented() -> None:
    headings = {h for h, _, _, _ in _COLUMNS} | {h for h, _ in _WIRE_COLUMNS}
    assert headings - _documented(_section("## The table on stdout")) == set()
