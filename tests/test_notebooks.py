"""Every notebook runs top to bottom at its small size; a failing cell fails the suite. A run says its size first,
and the committed notebooks hold no small run's outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


SMALL_MARK = "KVTIER_NB_SIZE=small:"


def _text_outputs(nb: nbformat.NotebookNode) -> list[str]:
    return ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in nb.cells if c.cell_type == "code"]


def _parameters(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    (cell,) = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    return cell


def test_notebooks_exist() -> None:
    assert {p.stem for p in NOTEBOOKS} >= {"hit_rates", "event_lag", "shared_storage"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path, shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_NB_SIZE", "small")
    monkeypatch.setenv("KVTIER_SHARED", str(shared_dir))
    nb = nbformat.read(path, as_version=4)
    assert _parameters(nb).source, f"{path.name} has no cell tagged 'parameters'"
    # The kernel inherits this process's environment (monkeypatched above).
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    for c in nb.cells:
        if c.cell_type == "code" and "plt.subplots" in c.source:
            pngs = [o for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
            assert pngs, f"{path.name}: a plotting cell drew nothing:\n{c.source[:200]}"
    outputs = [t for t in _text_outputs(nb) if t]
    assert outputs[0].startswith(SMALL_MARK), f"{path.name}: its first output does not say its size: {outputs[0][:200]}"
    headline = next(t for t in outputs if "Headline numbers" in t)
    assert "Headline numbers (KVTIER_NB_SIZE=small;" in headline, headline[:200]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_are_not_a_small_run(path: Path) -> None:
    """Re-running a notebook at the small size and committing it would replace the full-size outputs the README
    quotes with figures that contradict it; the run says its size first, and this refuses such a commit."""
    nb = nbformat.read(path, as_version=4)
    small = [t[:120] for t in _text_outputs(nb) if SMALL_MARK in t]
    assert not small, f"{path.name} holds the outputs of a KVTIER_NB_SIZE=small run: {small}"


@pytest.mark.parametrize("size", ["Full", "tiny", ""])
def test_an_unknown_size_is_refused(size: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt size is refused, naming the sizes there are, rather than running the small one in silence."""
    monkeypatch.setenv("KVTIER_NB_SIZE", size)
    for path in NOTEBOOKS:
        with pytest.raises(ValueError, match="expected 'small' or 'full'"):
            exec(_parameters(nbformat.read(path, as_version=4)).source, {})
