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


def _run(root: Path, how: str, cache_dir: Path | None = None) -> int:
    """``kernel(1)`` in a fresh process, its module imported plainly or through ``kvtier.kernels.jit.load``; numba's
    cache beside the sources, or in ``cache_dir`` (``NUMBA_CACHE_DIR``; ``XDG_CACHE_HOME`` if it is named xdg)."""
    load = ("import importlib; m = importlib.import_module('kpkg.kernel')" if how == "plain" else
            "from kvtier.kernels.jit import load; m, backend = load('kpkg.kernel'); assert backend == 'numba', backend")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path]), "KVTIER_JIT": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    if cache_dir is not None and cache_dir.name == "xdg":
        env["XDG_CACHE_HOME"] = str(cache_dir)
    elif cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    out = subprocess.run([sys.executable, "-c", f"{load}; print(m.kernel(1))"], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip())


@pytest.mark.parametrize("where", ["beside the sources", "NUMBA_CACHE_DIR", "the user's cache"])
def test_a_kernel_is_compiled_again_when_a_module_it_inlines_changes(where: str, tmp_path: Path) -> None:
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(_CALLEE.format(step=1))
    (pkg / "kernel.py").write_text(_KERNEL)
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


# A read-only install with an unwritable home (a container with a read-only root file system): numba finds no
# directory it may write beside the sources or in the user's cache. Forced by refusing every directory but TMPDIR,
# as a read-only mount would (the tests may run as root, whom permissions do not stop).
_READ_ONLY = '''
import os, sys
from numba.core import caching
writable = os.environ.get("WRITABLE")
real = caching._CacheLocator.ensure_cache_path
def ensure(self):
    if not writable or not os.path.abspath(self.get_cache_path()).startswith(writable):
        raise PermissionError(30, "Read-only file system", self.get_cache_path())
    real(self)
caching._CacheLocator.ensure_cache_path = ensure
from kvtier.kernels.jit import KernelsUnavailable, LazyKernels, load
'''


def _read_only(root: Path, code: str, writable: Path | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path]), "KVTIER_JIT": "1",
           "WRITABLE": str(writable or ""), "TMPDIR": str(writable or root / "nowhere")}
    env.pop("NUMBA_CACHE_DIR", None)
    return subprocess.run([sys.executable, "-c", _READ_ONLY + code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_kernels_cache_in_a_private_temporary_directory_where_nothing_else_is_writable(tmp_path: Path) -> None:
    """Numba refused to import any kernel (a traceback: no locator available) where neither the install nor the
    home directory is writable; the kernels are cached in a directory of the user's own under TMPDIR instead."""
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(_CALLEE.format(step=1))
    (pkg / "kernel.py").write_text(_KERNEL)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = _read_only(tmp_path, "m, backend = load('kpkg.kernel'); print(backend, m.kernel(1))", tmp)
    assert out.returncode == 0 and out.stdout.split() == ["numba", "20"], out.stderr
    private = tmp / f"kvtier-numba-{os.getuid()}"
    assert list(private.rglob("kernel.*.nbi")) and private.stat().st_mode & 0o777 == 0o700
    assert not (pkg / "__pycache__").exists() or not list((pkg / "__pycache__").glob("*.nbi"))


def test_a_cache_directory_another_user_could_write_is_not_used(tmp_path: Path) -> None:
    """Numba's cache files are pickles, loaded and run: a directory under TMPDIR that others may write (or that
    another user made first) would let them run code as this user. Refused, with what to do."""
    (tmp_path / "kpkg").mkdir()
    (tmp_path / "kpkg" / "__init__.py").write_text("")
    (tmp_path / "kpkg" / "kernel.py").write_text(_KERNEL.replace("from kpkg.callee import bump\n", "").replace(
        "bump(x)", "x"))
    tmp = tmp_path / "tmp"
    (tmp / f"kvtier-numba-{os.getuid()}").mkdir(parents=True, mode=0o777)
    os.chmod(tmp / f"kvtier-numba-{os.getuid()}", 0o777)
    code = ("m, backend = load('kpkg.kernel'); print(backend)\n"
            "try:\n    LazyKernels('kpkg.kernel', lambda m: None, required=True).require()\n"
            "except KernelsUnavailable as exc:\n    print(exc)")
    out = _read_only(tmp_path, code, tmp)
    assert out.returncode == 0, out.stderr
    backend, required = out.stdout.splitlines()
    assert backend.startswith("python (numba cannot cache its kernels")
    assert "set NUMBA_CACHE_DIR to a directory only you can write" in required
    assert "others may write" in required


def test_the_table_kernels_sources_are_what_they_compile_in() -> None:
    names = [p.name for p in sources("kvtier.indexer.index.tablekernel")]
    assert names[0] == "tablekernel.py"
    # the key chain it inlines (and the loads that one inlines), and the constants it reads
    assert {"keykernel.py", "unaligned.py", "keytable.py", "keys.py", "masklayout.py"} <= set(names)
    assert "codec.py" not in names and "stream.py" not in names  # what those modules import is not compiled in
