"""Whether kvtier's compiled kernels run: numba, where it imports and ``KVTIER_JIT`` is not ``0``.

Each kernel module (:mod:`kvtier.kernels.keykernel`, :mod:`kvtier.kernels.tokenkernel`, ...) is held by a
:class:`LazyKernels` and imported the first time it is needed, so that importing kvtier never imports
numba (about 0.3 s and 140 MB of RSS). A leaf kernel's caller keeps a short pure-Python path with the same
results for when it is not there (``KVTIER_JIT=0`` forces it); a *required* module has none (the index's tables:
one implementation of a stateful structure), and where it cannot load, using it raises :class:`KernelsUnavailable`
naming the platform. Before a kernel module is imported, numba's cache of it is checked against every module
compiled into it (:mod:`kvtier.kernels.kernelcache`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import platform
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kvtier.kernels.kernelcache import refresh

_OFF = ("0", "false", "off", "no")


_NO_LOCATOR = "no locator available"  # numba's words when no cache directory it tried is writable
_NO_CACHE = "numba cannot cache its kernels"


def _cache_privately() -> str | None:
    """Points numba's cache at ``kvtier-numba-<uid>`` in the temporary directory, made for this user alone; None
    when it is there, or why not. Called where numba found nothing writable (``NUMBA_CACHE_DIR`` if named, beside
    the sources, the user's cache: a read-only install and home, as in a container with a read-only root file
    system). Numba's cache files are pickles it loads and runs, so where that directory is not this user's alone
    (others may write it, it is a link, another user made it), a fresh private one is made instead: safe, but
    compiled afresh each start. Set in the environment as well, which numba re-reads and child processes
    inherit. O(1)."""
    from numba.core import config  # (imported already: the kernel module that failed imported numba)

    named: str = getattr(config, "CACHE_DIR", "")  # (a NUMBA_CACHE_DIR numba could not write)
    hint = f"NUMBA_CACHE_DIR {named} is not writable" if named else "set NUMBA_CACHE_DIR to keep them elsewhere"
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        shared = Path(tempfile.gettempdir()) / f"kvtier-numba-{uid if uid is not None else 'user'}"
        with contextlib.suppress(FileExistsError):  # (whatever is there is judged below)
            shared.mkdir(mode=0o700)
        st = shared.lstat()  # (a link planted there is not followed)
        if stat.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid) and not st.st_mode & 0o022:
            path, note = shared, ""
        else:
            path = Path(tempfile.mkdtemp(prefix="kvtier-numba-"))
            atexit.register(shutil.rmtree, path, ignore_errors=True)
            note = f" ({shared} is not this user's alone: this one lasts one run)"
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        return (f"no directory it may write, the temporary directory included ({exc.strerror or exc}); "
                f"{hint if named else 'set NUMBA_CACHE_DIR to a directory only you can write'}")
    os.environ["NUMBA_CACHE_DIR"] = str(path)
    setattr(config, "CACHE_DIR", str(path))  # noqa: B010 (numba's settings are set from the environment at import)
    logging.getLogger(__name__).warning("numba caches its compiled kernels in %s%s: nothing else is writable; %s",
                                        path, note, hint)
    return None


class KernelsUnavailable(RuntimeError):
    """A required kernel module cannot load on this platform (numba has no wheel for it, or is not installed)."""


def load(module: str, required: bool = False) -> tuple[ModuleType | None, str]:
    """``(the kernel module, "numba")``, or ``(None, "python (why)")`` when ``KVTIER_JIT=0`` is set (ignored for a
    ``required`` module), numba cannot be imported (no wheel for this platform) or the module cannot load here.
    O(import)."""
    if not required and os.environ.get("KVTIER_JIT", "1").strip().lower() in _OFF:
        return None, "python (KVTIER_JIT=0)"
    try:
        refresh(module)  # (numba would serve kernels compiled from an older version of a module they use)
        try:
            return importlib.import_module(module), "numba"
        except RuntimeError as exc:
            if _NO_LOCATOR not in str(exc):
                raise
            why = _cache_privately()
            if why is None:
                refresh(module)  # (the cache there is checked as well)
                return importlib.import_module(module), "numba"
            return None, f"python ({_NO_CACHE}: {why})"
    except ImportError as exc:
        # numba (or llvmlite) missing, or the kernel module's own requirement (a library it loads, byte order).
        what = "numba" if (exc.name or "").split(".")[0] in ("numba", "llvmlite") else "kernels"
        return None, f"python ({what} unavailable: {exc})"


class LazyKernels:
    """A kernel module, imported on first use and then warmed: ``warm`` calls its functions once with the
    argument types their callers pass, so that numba compiles them (or loads them from its cache) then,
    not inside the first timed call."""

    __slots__ = ("backend", "module", "name", "required", "warm")

    def __init__(self, name: str, warm: Callable[[Any], object], *, required: bool = False) -> None:
        self.name = name  # the module's import name
        self.warm = warm  # called with the module once it is imported
        self.required = required  # no Python path: KVTIER_JIT=0 does not apply, and require() raises without it
        self.module: Any = None  # the module; None until loaded, and on the Python path
        self.backend: str | None = None  # None until loaded; then "numba" or "python (why)"

    def get(self) -> Any:
        """The kernel module, or ``None``: use the Python path. Imports and warms it the first time. O(1) after
        the first call."""
        if self.backend is None:
            module, backend = load(self.name, self.required)
            if module is not None:
                self.warm(module)
            self.module, self.backend = module, backend
        return self.module

    def require(self) -> Any:
        """The kernel module, imported and warmed the first time; raises :class:`KernelsUnavailable` naming the
        platform where it cannot load. O(1) after the first call."""
        module = self.get()
        if module is None and self.backend and _NO_CACHE in self.backend:
            raise KernelsUnavailable(f"{self.name}: {self.backend.removeprefix('python (').removesuffix(')')}")
        if module is None:
            raise KernelsUnavailable(
                f"{self.name} needs numba, which cannot load on this platform ({platform.system()} "
                f"{platform.machine()}, Python {platform.python_version()}): {self.backend}. numba publishes wheels "
                "for x86_64 and aarch64/arm64 (Linux, macOS, Windows); kvtier's index has no pure-Python path.")
        return module


__all__ = ["KernelsUnavailable", "LazyKernels", "load"]
