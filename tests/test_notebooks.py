"""Every notebook runs top to bottom at its small size; a failing cell fails the suite."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_notebooks_exist() -> None:
    assert {p.stem for p in NOTEBOOKS} >= {"hit_rates", "event_lag", "shared_storage"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path, shared_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_NB_SIZE", "small")
    monkeypatch.setenv("KVTIER_SHARED", str(shared_dir))
    nb = nbformat.read(path, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert params, f"{path.name} has no cell tagged 'parameters'"
    # The kernel inherits this process's environment (monkeypatched above).
    client = NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    for c in nb.cells:
        if c.cell_type == "code" and "plt.subplots" in c.source:
            pngs = [o for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
            assert pngs, f"{path.name}: a plotting cell drew nothing:\n{c.source[:200]}"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "Headline numbers" in text
