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


def _run(root: Path, how: str) -> int:
    """``kernel(1)`` in a fresh process, its module imported plainly or through ``kvtier.kernels.jit.load``."""
    load = ("import importlib; m = importlib.import_module('kpkg.kernel')" if how == "plain" else
            "from kvtier.kernels.jit import load; m, backend = load('kpkg.kernel'); assert backend == 'numba', backend")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path]), "KVTIER_JIT": "1"}
    env.pop("NUMBA_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", f"{load}; print(m.kernel(1))"], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip())


def test_a_kernel_is_compiled_again_when_a_module_it_inlines_changes(tmp_path: Path) -> None:
    pkg = tmp_path / "kpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "callee.py").write_text(_CALLEE.format(step=1))
    (pkg / "kernel.py").write_text(_KERNEL)
    assert _run(tmp_path, "load") == 20  # compiled and cached
    (pkg / "callee.py").write_text(_CALLEE.format(step=2))
    # numba alone checks only the kernel's own file: its cache still answers with the old constant
    assert _run(tmp_path, "plain") == 20
    assert _run(tmp_path, "load") == 30  # the stamp no longer matches: compiled afresh
    assert _run(tmp_path, "plain") == 30  # and cached anew
    assert list((pkg / "__pycache__").glob("kernel.*.nbi")), "the fresh compilation was not cached"


def test_the_table_kernels_sources_are_what_they_compile_in() -> None:
    names = [p.name for p in sources("kvtier.indexer.index.tablekernel")]
    assert names[0] == "tablekernel.py"
    # the key chain it inlines (and the loads that one inlines), and the constants it reads
    assert {"keykernel.py", "unaligned.py", "keytable.py", "keys.py", "masklayout.py"} <= set(names)
    assert "codec.py" not in names and "stream.py" not in names  # what those modules import is not compiled in
