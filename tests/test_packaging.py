"""kvtier installs as one namespace, imports lean, and documents every CLI default."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvtier.sim.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_only_the_kvtier_namespace(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources it builds.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("kvtier", "wire", "engine", "indexer", "sim"):
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp_path / "dist").glob("kvtier-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith(("kvtier/", "kvtier-"))]
    assert not outside, f"the wheel installs files outside kvtier/: {outside}"
    for part in ("wire", "engine", "indexer", "sim"):
        assert f"kvtier/{part}/__init__.py" in names, f"kvtier.{part} missing from the wheel"
    assert "kvtier/__main__.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "kvtier = kvtier.sim.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _fresh_import(code: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("module", ["kvtier.wire", "kvtier.indexer", "kvtier.sim"])
def test_router_side_imports_neither_torch_nor_the_http_service(module: str) -> None:
    loaded = _fresh_import(
        f"import json, sys; import {module}; "
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'aiohttp', 'kvtier.indexer.service', "
        "'matplotlib')}))")
    assert loaded == {"torch": False, "aiohttp": False, "kvtier.indexer.service": False,
                      "matplotlib": False}, f"import {module} pulled in {[m for m, v in loaded.items() if v]}"


def test_lazy_service_exports_resolve() -> None:
    import kvtier.indexer as indexer
    from kvtier.indexer.service import IndexerService, ServiceConfig

    assert indexer.IndexerService is IndexerService
    assert indexer.ServiceConfig is ServiceConfig
    with pytest.raises(AttributeError):
        _ = indexer.NoSuchThing  # type: ignore[attr-defined]


def test_python_dash_m_kvtier_runs_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier", "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "compare" in out.stdout and "indexer" in out.stdout


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_every_cli_option_help_shows_its_default() -> None:
    missing = []
    for name, sub in _subparsers(build_parser()).items():
        text = sub.format_help()
        for action in sub._actions:
            if not action.option_strings or action.required or action.nargs == 0:
                continue  # positionals, required options and flags have no default to show
            if action.help is None or "default" not in sub._get_formatter()._get_help_string(action):
                missing.append(f"{name} {action.option_strings[-1]}")
        assert "default:" in text
    assert not missing, f"options whose help shows no default: {missing}"
