"""Lazy re-exports for a package facade: ``from kvtier.indexer import Router`` without importing every module of
the package when only one is needed (importing the index must not load the service's aiohttp, nor the wire's
facade pyzmq).

A facade names each export's module once; :func:`lazy_exports` returns the module-level ``__getattr__`` (PEP 562)
and ``__dir__`` that import it on first use. Static checkers see the same names through an ``if TYPE_CHECKING``
block of ordinary imports beside it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose attribute ``name`` is ``exports[name]``'s attribute of
    the same name (a module's full path, e.g. ``"kvtier.indexer.index.tiered"``). O(1) per lookup after the
    first import of a module."""

    def __getattr__(name: str) -> Any:
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
