"""Numba's on-disk cache never serves a kernel compiled from an older version of a module it uses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.kernels.kernelcache import sources

pytest.importorskip("numba", reason="numba is not installed")

_CALLEE = '''
from numba import njit
STEP = {step}
@njit(cache=True, inline="always")
def bump(x):
    return x + STEP
'''
_KERNEL = '''
from numba import njit
from kpkg.callee import bump
@njit(cache=True)
def kernel(x):
    return bump(x) * 10
'''


# Read-only directories, forced as numba and kvtier both test a directory (a temporary file made in it): every
# directory but those in WRITABLE refuses one, as a read-only mount would (the tests may run as root, whom
# permissions do not stop); NO_TMP: no temporary directory at all.
_SIMULATE = """
import os, tempfile
_writable = [p for p in os.environ.get("WRITABLE", "").split(os.pathsep) if p]
_real = tempfile.TemporaryFile
def _temporary_file(*args, dir=None, **kw):
    if dir is not None and not any(os.path.abspath(dir).startswith(w) for w in _writable):
        raise PermissionError(30, "Read-only file system", dir)
    return _real(*args, dir=dir, **kw)
tempfile.TemporaryFile = _temporary_file
if os.environ.get("NO_TMP"):
    def _no_tmp():
        raise FileNotFoundError(2, "No usable temporary directory found")
    tempfile.gettempdir = _no_tmp
"""


def _package(root: Path) -> Path:
    pkg = root / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(_CALLEE.format(step=1))
    (pkg / "kernel.py").write_text(_KERNEL)
    return pkg


def _python(root: Path, code: str, writable: list[Path] | None = None, **env_vars: str) -> str:
    """``code`` in a fresh process with ``root`` on its path (and only ``writable`` writable, where given); its
    standard error, then its standard output. Fails on a traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path]), "KVTIER_JIT": "1", **env_vars}
    for name in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "TMPDIR"):
        if name not in env_vars:
            env.pop(name, None)
    if writable is not None:
        code = _SIMULATE + code
        env["WRITABLE"] = os.pathsep.join(map(str, writable))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr + out.stdout


_LOAD = "from kvtier.kernels.jit import load; m, backend = load('kpkg.kernel'); print(backend, m and m.kernel(1))\n"


def _run(root: Path, how: str, cache_dir: Path | None = None, writable: list[Path] | None = None) -> int:
    """``kernel(1)`` in a fresh process, its module imported plainly or through ``kvtier.kernels.jit.load``; numba's
    cache beside the sources, or in ``cache_dir`` (``NUMBA_CACHE_DIR``; ``XDG_CACHE_HOME`` if it is named xdg)."""
    code = "import importlib; m = importlib.import_module('kpkg.kernel'); print('numba', m.kernel(1))" \
        if how == "plain" else _LOAD
    where = {} if cache_dir is None else {"XDG_CACHE_HOME" if cache_dir.name == "xdg" else "NUMBA_CACHE_DIR":
                                          str(cache_dir)}
    backend, value = _python(root, code, writable, **where).split()[-2:]
    assert backend == "numba", backend
    return int(value)


@pytest.mark.parametrize("where", ["beside the sources", "NUMBA_CACHE_DIR", "the user's cache"])
def test_a_kernel_is_compiled_again_when_a_module_it_inlines_changes(where: str, tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    cache_dir = {"NUMBA_CACHE_DIR": tmp_path / "numba-cache", "the user's cache": tmp_path / "xdg"}.get(where)
    if where == "the user's cache":
        (pkg / "__pycache__").write_text("")  # a file: no cache beside the sources (even for root)
    assert _run(tmp_path, "load", cache_dir) == 20  # compiled and cached
    (pkg / "callee.py").write_text(_CALLEE.format(step=2))
    # numba alone checks only the kernel's own file: its cache still answers with the old constant
    assert _run(tmp_path, "plain", cache_dir) == 20
    assert _run(tmp_path, "load", cache_dir) == 30  # the stamp no longer matches: compiled afresh
    assert _run(tmp_path, "plain", cache_dir) == 30  # and cached anew
    cached = (pkg / "__pycache__").glob("kernel.*.nbi") if cache_dir is None else cache_dir.rglob("kernel.*.nbi")
    assert list(cached), "the fresh compilation was not cached"


def test_a_current_stamp_where_numba_cannot_write_hides_no_stale_cache(tmp_path: Path) -> None:
    """An image warmed as root stamps ``__pycache__``; a user who cannot write there caches in ~/.cache, which
    outlives the image. The stamp is checked where numba caches, not in the first directory holding one."""
    pkg = _package(tmp_path)
    xdg = tmp_path / "xdg"
    assert _run(tmp_path, "load", xdg, writable=[xdg]) == 20  # the user: cached in ~/.cache
    (pkg / "callee.py").write_text(_CALLEE.format(step=2))
    assert _run(tmp_path, "load", xdg) == 30  # root, with the new image: cached and stamped beside the sources
    assert _run(tmp_path, "load", xdg, writable=[xdg]) == 30  # the user again: ~/.cache's copy is stale


def test_kernels_cache_in_a_private_temporary_directory_where_nothing_else_is_writable(tmp_path: Path) -> None:
    """Numba refused to import any kernel (a traceback: no locator available) where neither the install nor the
    home directory is writable; the kernels are cached in a directory of the user's own under TMPDIR instead."""
    pkg = _package(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = _python(tmp_path, _LOAD, [tmp], TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert out.split()[-2:] == ["numba", "20"], out
    private = tmp / f"kvtier-numba-{os.getuid()}"
    assert f"numba caches its compiled kernels in {private}: nothing else is writable" in out
    assert list(private.rglob("kernel.*.nbi")) and private.stat().st_mode & 0o777 == 0o700
    assert not (pkg / "__pycache__").exists() or not list((pkg / "__pycache__").glob("*.nbi"))
    out = _python(tmp_path, _LOAD, [tmp], TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert out.split()[-2:] == ["numba", "20"], out  # the next start loads what the first compiled


@pytest.mark.parametrize("planted", ["others may write it", "a link"])
def test_a_cache_directory_another_could_plant_is_not_used(planted: str, tmp_path: Path) -> None:
    """Numba's cache files are pickles, loaded and run: a directory under TMPDIR that others may write, or a link
    another user planted there, would let them run code as this user. A fresh private directory is used instead
    (for one run), and the planted one is left untouched."""
    _package(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shared, target = tmp / f"kvtier-numba-{os.getuid()}", tmp / "target"
    if planted == "a link":
        target.mkdir(mode=0o700)
        shared.symlink_to(target)
    else:
        shared.mkdir()
        os.chmod(shared, 0o777)
    out = _python(tmp_path, _LOAD, [tmp], TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    assert out.split()[-2:] == ["numba", "20"], out
    assert f"({shared} is not this user's alone: this one lasts one run)" in out
    assert not list(shared.rglob("*")) and not list(target.rglob("*"))
    assert sorted(p.name for p in tmp.iterdir()) == sorted(["target", shared.name] if planted == "a link" else
                                                           [shared.name])  # the one-run directory is removed


def test_where_nothing_at_all_is_writable_the_kernels_say_so(tmp_path: Path) -> None:
    """No temporary directory either: a leaf kernel takes its Python path, and a required one raises one line
    naming what to set (``tempfile.gettempdir``'s own error was a traceback)."""
    _package(tmp_path)
    code = _LOAD + ("from kvtier.kernels.jit import KernelsUnavailable, LazyKernels\n"
                    "try:\n    LazyKernels('kpkg.kernel', lambda m: None, required=True).require()\n"
                    "except KernelsUnavailable as exc:\n    print(exc)\n")
    out = _python(tmp_path, code, [], NO_TMP="1", XDG_CACHE_HOME=str(tmp_path / "xdg"))
    backend, required = out.strip().splitlines()[-2:]
    assert backend.startswith("python (numba cannot cache its kernels: no directory it may write, the temporary "
                              "directory included (No usable temporary directory found)"), backend
    assert required == ("kpkg.kernel: numba cannot cache its kernels: no directory it may write, the temporary "
                        "directory included (No usable temporary directory found); set NUMBA_CACHE_DIR to a "
                        "directory only you can write"), required


def test_the_table_kernels_sources_are_what_they_compile_in() -> None:
    names = [p.name for p in sources("kvtier.indexer.index.tablekernel")]
    assert names[0] == "tablekernel.py"
    # the key chain it inlines (and the loads that one inlines), and the constants it reads
    assert {"keykernel.py", "unaligned.py", "keytable.py", "keys.py", "masklayout.py"} <= set(names)
    assert "codec.py" not in names and "stream.py" not in names  # what those modules import is not compiled in
