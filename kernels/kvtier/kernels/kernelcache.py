"""Numba's on-disk cache of a kernel module, dropped when a source it was compiled from has changed.

Numba checks a cached kernel only against its own file. A kernel that inlines a function of another module
(:func:`kvtier.kernels.keykernel.chain_into` in the table kernels) or reads its constants (the table layout of
:mod:`kvtier.indexer.index.keytable`) is compiled with them frozen in, so after an edit of that other module alone the
cache keeps serving the old code: wrong results, silently, until the kernel's own file changes. So before a kernel
module is imported (:func:`kvtier.kernels.jit.load`), the digest of every source it is compiled from is compared with
the one stamped beside its cache, and the cache files are deleted (numba then compiles afresh) when they differ.

Covered: wherever numba keeps the cache. It takes the first directory it can write of a named one
(``NUMBA_CACHE_DIR``, or the private one :mod:`kvtier.kernels.jit` names where nothing else is writable),
``__pycache__`` beside the sources and the user's cache (``~/.cache/numba``); the stamp is checked in that one,
found by the same test numba makes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import tempfile
from pathlib import Path

import xxhash

__all__ = ["refresh", "sources"]

# Module-level imports only (an import inside a function feeds no compiled code).
_FROM = re.compile(r"^from ([\w.]+) import", re.M)
_NUMBA = re.compile(r"^(?:from numba\b|import numba\b)", re.M)


def _origin(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _closure(module: str) -> dict[Path, tuple[str, bool]]:
    """``module``'s file and those of the same package's modules it imports from, recursively through those
    that are kernel modules too: per file, its module and whether it is a kernel module (imports numba)."""
    top = module.split(".")[0]
    seen: dict[Path, tuple[str, bool]] = {}

    def visit(name: str, root: bool) -> None:
        path = _origin(name)
        if path is None or path in seen:
            return
        text = path.read_text()
        kernel = root or bool(_NUMBA.search(text))
        seen[path] = (name, kernel)
        if kernel:
            for imported in _FROM.findall(text):
                if imported.split(".")[0] == top:
                    visit(imported, False)

    visit(module, True)
    return seen


def sources(module: str) -> list[Path]:
    """The files ``module``'s kernels are compiled from: its own, those of its package's modules it imports
    from (their functions and constants are compiled in), and, through those that are kernel modules too, theirs
    in turn; its own first. O(files)."""
    return list(_closure(module))


def refresh(module: str) -> bool:
    """Deletes the numba cache files of ``module`` (``<name>.*.nbi`` and ``.nbc`` in the directory numba caches it
    in: :func:`_cache_dir`), and of each kernel module it imports (importing it loads their caches too), whose
    :func:`sources` changed since the stamp beside those files was written, and stamps the current digests; True
    if files were deleted. Nothing happens where numba can cache nowhere. O(source bytes)."""
    dropped = False
    try:
        for name, kernel in _closure(module).values():
            if kernel:
                dropped |= _refresh_one(sources(name))
    except (OSError, ValueError):
        pass  # sources that cannot be read (an install of compiled files only): numba's own check stands
    return dropped


def _cache_dir(kernel: Path) -> Path | None:
    """The directory numba caches the kernel module in file ``kernel`` in, or None if none is writable: the first
    it can write of a named cache directory (``NUMBA_CACHE_DIR``, or the one :mod:`kvtier.kernels.jit` names where
    nothing else is writable), ``__pycache__`` beside the file and the user's cache, each tried as numba tries it
    (made if missing, then a temporary file made in it). In the first and the last, numba keeps the cache under
    the module directory's name and the SHA-1 of its path. (Numba's default locators, in their order: a
    deployment that replaces them, ``NUMBA_CACHE_LOCATOR_CLASSES``, is left to numba's own check.)"""
    parent = os.path.dirname(os.path.abspath(kernel))
    sub = f"{os.path.basename(parent)}_{hashlib.sha1(parent.encode()).hexdigest()}"
    try:
        from numba.core import config
        from numba.misc.appdirs import AppDirs
    except ImportError:  # (no numba: no cache to check)
        return None
    named: str = getattr(config, "CACHE_DIR", "")  # (numba's settings are set from the environment at import)
    user = Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)  # type: ignore[no-untyped-call]
    for cache in [*([Path(named) / sub] if named else []), kernel.parent / "__pycache__", user / sub]:
        try:
            os.makedirs(cache, exist_ok=True)
            tempfile.TemporaryFile(dir=cache).close()
        except OSError:
            continue
        return cache
    return None


def _refresh_one(files: list[Path]) -> bool:
    """Checks the stamp of ``files[0]``'s kernels in the directory numba caches them in; a stale cache is deleted
    before the new stamp is written (atomically), so a deletion that fails is tried again next time."""
    cache = _cache_dir(files[0])
    if cache is None:
        return False  # numba caches nowhere: no cache to serve stale code from
    digest = xxhash.xxh3_64()
    for path in sorted(files):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    stamp_text = digest.hexdigest()
    stamp = cache / f"{files[0].stem}.kernels.stamp"
    try:
        if stamp.read_text() == stamp_text:
            return False
    except OSError:
        pass  # no stamp yet: whatever cache there is predates the check
    stale = [*cache.glob(f"{files[0].stem}.*.nbi"), *cache.glob(f"{files[0].stem}.*.nbc")]
    try:
        for path in stale:
            path.unlink(missing_ok=True)
        fresh = cache / f"{stamp.name}.{os.getpid()}"
        fresh.write_text(stamp_text)
        os.replace(fresh, stamp)
    except OSError:
        return False
    return bool(stale)
