"""Numba's on-disk cache of a kernel module, dropped when a source it was compiled from has changed.

Numba checks a cached kernel only against its own file. A kernel that inlines a function of another module
(:func:`kvtier.kernels.keykernel.chain_into` in the table kernels) or reads its constants (the table layout of
:mod:`kvtier.indexer.index.keytable`) is compiled with them frozen in, so after an edit of that other module alone the
cache keeps serving the old code: wrong results, silently, until the kernel's own file changes. So before a kernel
module is imported (:func:`kvtier.kernels.jit.load`), the digest of every source it is compiled from is compared with
the one stamped beside its cache, and the cache files are deleted (numba then compiles afresh) when they differ.

Covered: wherever numba keeps the cache. It takes the first directory it can write of a named one
(``NUMBA_CACHE_DIR``, or the private one :mod:`kvtier.kernels.jit` names where nothing else is writable),
``__pycache__`` beside the sources and the user's cache (``~/.cache/numba``); the stamp is checked in the same one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
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
    """Deletes the numba cache files of ``module`` (``__pycache__/<name>.*.nbi`` and ``.nbc``), and of each
    kernel module it imports (importing it loads their caches too), whose :func:`sources` changed since the
    stamp beside those files was written, and stamps the current digests; True if files were deleted. Nothing
    happens where a cache directory is read-only. O(source bytes)."""
    dropped = False
    try:
        for name, kernel in _closure(module).values():
            if kernel:
                dropped |= _refresh_one(sources(name))
    except (OSError, ValueError):
        pass  # sources that cannot be read (an install of compiled files only): numba's own check stands
    return dropped


def _cache_dirs(kernel: Path) -> list[Path]:
    """Where numba may keep the cache of the kernel module in file ``kernel``, in the order it tries them (it
    takes the first it can write): a named cache directory (``NUMBA_CACHE_DIR``, or the one
    :mod:`kvtier.kernels.jit` names where nothing else is writable), ``__pycache__`` beside the file, the user's
    cache. In the first and the last, numba keeps it under the module directory's name and the SHA-1 of its
    path."""
    parent = os.path.dirname(os.path.abspath(kernel))
    sub = f"{os.path.basename(parent)}_{hashlib.sha1(parent.encode()).hexdigest()}"
    try:
        from numba.core import config
        from numba.misc.appdirs import AppDirs
    except ImportError:  # (no numba: no cache to check)
        return [kernel.parent / "__pycache__"]
    named: str = getattr(config, "CACHE_DIR", "")  # (numba's settings are set from the environment at import)
    user = Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)  # type: ignore[no-untyped-call]
    return [*([Path(named) / sub] if named else []), kernel.parent / "__pycache__", user / sub]


def _refresh_one(files: list[Path]) -> bool:
    """Checks the stamp in the cache directory numba will use for ``files[0]``'s kernels: the first of
    :func:`_cache_dirs` that takes the stamp (a directory it cannot write, numba skips too)."""
    digest = xxhash.xxh3_64()
    for path in sorted(files):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    stamp_text = digest.hexdigest()
    for cache in _cache_dirs(files[0]):
        stamp = cache / f"{files[0].stem}.kernels.stamp"
        try:
            if stamp.read_text() == stamp_text:
                return False
        except OSError:
            pass  # no stamp yet: whatever cache there is predates the check
        stale = [*cache.glob(f"{files[0].stem}.*.nbi"), *cache.glob(f"{files[0].stem}.*.nbc")]
        try:
            cache.mkdir(parents=True, exist_ok=True)
            stamp.write_text(stamp_text)
            for path in stale:
                path.unlink(missing_ok=True)
        except OSError:
            continue  # not writable: numba does not cache there either
        return bool(stale)
    return False
