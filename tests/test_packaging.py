"""kvtier installs as one namespace, imports lean, and documents every CLI default."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
import zipfile
from pathlib import Path

import pytest

from kvtier.sim.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_only_the_kvtier_namespace(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    outside = [n for n in names if not n.startswith(("kvtier/", "kvtier-"))]
    assert not outside, f"the wheel installs files outside kvtier/: {outside}"
    for part in ("util", "kernels", "hardware", "wire", "wire/transport", "engine", "engine/l3", "indexer",
                 "indexer/index", "indexer/routing", "indexer/service", "sim"):
        assert f"kvtier/{part}/__init__.py" in names, f"kvtier.{part} missing from the wheel"
    assert "kvtier/__main__.py" in names and "kvtier/__init__.py" not in names  # a namespace package
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
        "print(json.dumps({m: m in sys.modules for m in ('torch', 'aiohttp', 'kvtier.indexer.service.app', "
        "'matplotlib')}))")
    assert loaded == {"torch": False, "aiohttp": False, "kvtier.indexer.service.app": False,
                      "matplotlib": False}, f"import {module} pulled in {[m for m, v in loaded.items() if v]}"


def test_lazy_service_exports_resolve() -> None:
    import kvtier.indexer as indexer
    from kvtier.indexer.service.app import IndexerService, ServiceConfig

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


def _wheel(tmp_path: Path) -> Path:
    """kvtier's wheel, built from a copy of the sources (setuptools writes next to what it builds)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("util", "kernels", "hardware", "wire", "engine", "indexer", "sim"):
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp_path / "dist").glob("kvtier-*.whl")
    return wheel


@pytest.mark.slow
def test_the_light_install_replays_and_serves_without_torch(tmp_path: Path) -> None:
    """``pip install kvtier`` brings no torch: the wheel asks for it only under the ``engine`` extra, and in a fresh
    virtualenv that has every other dependency but no torch at all, a replay runs, the indexer service answers, and
    the one command that needs torch (``engine --l3-dir``) says how to get it."""
    wheel = _wheel(tmp_path)
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith("METADATA"))
    requires = [ln for ln in zipfile.ZipFile(wheel).read(meta).decode().splitlines() if ln.startswith("Requires-Dist")]
    torch = [ln for ln in requires if ln.split()[1].startswith("torch")]
    assert torch and all("extra ==" in ln for ln in torch), torch
    assert any('extra == "engine"' in ln for ln in torch)
    # A fresh virtualenv with kvtier alone, and the test environment's packages minus torch beside it.
    venv = tmp_path / "light"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = tmp_path / "deps-without-torch"
    deps.mkdir()
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        if not entry.name.lower().startswith(("torch", "kvtier", "__editable__", "_kvtier", "nvidia", "triton")):
            (deps / entry.name).symlink_to(entry)
    (site / "deps.pth").write_text(f"{deps}\n")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = subprocess.run([py, "-c", "import importlib.util, kvtier.sim; print(importlib.util.find_spec('torch'), "
                                      "kvtier.sim.__file__)"], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=60)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.startswith("None ") and str(site) in probe.stdout
    out = subprocess.run([py, "-m", "kvtier", "replay", "--trace", "builtin:chat:30", "--workers", "2",
                          "--no-plots", "--out", str(tmp_path / "run")], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["runs"][0]["requests"] == 30
    svc = subprocess.Popen([py, "-m", "kvtier", "indexer", "--endpoint", "w0=tcp://127.0.0.1:1",
                            "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path)
    try:
        assert svc.stdout is not None
        line = svc.stdout.readline()
        assert "HTTP on http://" in line, svc.stderr.read() if svc.stderr else line
        with urllib.request.urlopen(line.split("HTTP on ")[1].split()[0] + "/health", timeout=10) as r:
            assert json.loads(r.read())["workers"] == 1
    finally:
        svc.terminate()
        svc.wait(timeout=30)
    engine = subprocess.run([py, "-m", "kvtier", "engine", "--endpoint", "tcp://127.0.0.1:0", "--replay",
                             "tcp://127.0.0.1:0", "--trace", "builtin:chat:2", "--hold", "0", "--l3", "disk",
                             "--l3-dir", str(tmp_path / "l3")], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=120)
    assert engine.returncode == 2 and "pip install 'kvtier[engine]'" in engine.stderr, engine.stderr

