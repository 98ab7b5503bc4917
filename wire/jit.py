"""Whether kvtier's compiled kernels run: numba, where it imports and ``KVTIER_JIT`` is not ``0``.

Each kernel module (:mod:`kvtier.indexer.keykernel`, :mod:`kvtier.wire.tokenkernel`) is imported through
:func:`load` the first time it is needed, so that importing kvtier never imports numba (about 0.3 s and
140 MB of RSS); every caller keeps a pure-Python path with the same results for when it returns ``None``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

_OFF = ("0", "false", "off", "no")


def load(module: str) -> tuple[ModuleType | None, str]:
    """``(the kernel module, "numba")``, or ``(None, "python (why)")`` when ``KVTIER_JIT=0`` is set or
    numba cannot be imported (no wheel for this platform). O(import)."""
    if os.environ.get("KVTIER_JIT", "1").strip().lower() in _OFF:
        return None, "python (KVTIER_JIT=0)"
    try:
        return importlib.import_module(module), "numba"
    except ImportError as exc:
        return None, f"python (numba unavailable: {exc})"


__all__ = ["load"]
