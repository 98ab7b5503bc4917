"""A node's page digest chain in one compiled loop: OpenSSL's SHA-256 called from numba.

:func:`kvtier.engine.hashing.chain` hashes page by page from Python: a slice, a concatenation, a
``hashlib`` object and its digest per page, several times what SHA-256 of one page costs, and the simulator
hashes every page every worker computes. Here the loop runs compiled and calls the same library ``hashlib``
uses (OpenSSL's ``libcrypto``); figures in ``bench/MEASUREMENTS.md``.

The library's functions reach the kernel as plain integer addresses, called through a small LLVM
intrinsic: numba would embed a ctypes global's address in the compiled code (which then cannot be cached
on disk), and typing a ctypes function passed as an argument costs more than the call.

Imported only by :mod:`kvtier.engine.hashing`, through :class:`kvtier.kernels.jit.LazyKernels`. Importing it
raises ``ImportError`` where no ``libcrypto`` with the ``SHA256_Init`` family loads (OpenSSL built without its
deprecated API, or off Linux); ``hashing`` then keeps its ``hashlib`` loop, and it checks
this one against ``hashlib`` once before trusting it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_CTX_WORDS = 32  # SHA256_CTX is 112 bytes in every OpenSSL release: 256, as 8-byte words (its alignment)
DIGEST_BYTES = 32


def _libcrypto(platform: str = sys.platform) -> tuple[int, int, int]:
    """The addresses of ``SHA256_Init``, ``SHA256_Update`` and ``SHA256_Final`` in the system's ``libcrypto``
    (every one takes pointers and sizes, and returns an ``int``: 1 on success). Raises ``ImportError`` if there
    is none."""
    if not platform.startswith("linux"):
        # macOS aborts a process that loads its unversioned system libcrypto; elsewhere hashlib it is.
        raise ImportError(f"the compiled SHA-256 chain loads libcrypto on Linux only, not {platform}")
    names = [ctypes.util.find_library("crypto"), "libcrypto.so.3", "libcrypto.so.1.1"]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            init, update, final = lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final
        except (OSError, AttributeError):
            continue
        _LIB.append(lib)  # kept loaded for as long as the addresses are used
        return tuple(ctypes.cast(f, ctypes.c_void_p).value or 0 for f in (init, update, final))  # type: ignore[return-value]
    raise ImportError("no libcrypto with SHA256_Init/Update/Final")


_LIB: list[ctypes.CDLL] = []
INIT, UPDATE, FINAL = _libcrypto()


def _codegen(context: Any, builder: Any, signature: Any, llargs: Any) -> Any:
    """Calls the C function at address ``llargs[0]`` with the rest as 64-bit integers (pointers or sizes);
    its ``int`` is the result."""
    i64 = ir.IntType(64)
    fnty = ir.FunctionType(ir.IntType(32), [i64] * (len(llargs) - 1))
    return builder.call(builder.inttoptr(llargs[0], fnty.as_pointer()), list(llargs[1:]))


# One intrinsic per arity (numba intrinsics take no star-args); every argument a 64-bit integer. Cast to what a
# kernel calls them with (mypy sees the typing context as a first argument).
@intrinsic
def _intrinsic1(typingctx: Any, fn: Any, a: Any) -> Any:
    return types.int32(fn, a), _codegen


@intrinsic
def _intrinsic2(typingctx: Any, fn: Any, a: Any, b: Any) -> Any:
    return types.int32(fn, a, b), _codegen


@intrinsic
def _intrinsic3(typingctx: Any, fn: Any, a: Any, b: Any, c: Any) -> Any:
    return types.int32(fn, a, b, c), _codegen


_call1 = cast(Callable[[int, int], int], _intrinsic1)
_call2 = cast(Callable[[int, int, int], int], _intrinsic2)
_call3 = cast(Callable[[int, int, int, int], int], _intrinsic3)


@njit(cache=True)
def chain_pages(init: int, update: int, final: int, parent: npt.NDArray[np.uint8], pages: npt.NDArray[np.uint8],
                out: npt.NDArray[np.uint8]) -> int:
    """Row ``i`` of ``out`` = SHA-256(digest ``i - 1`` || page ``i``), digest ``-1`` being ``parent`` (empty
    under the root); ``pages`` holds one page per row. Returns 1, or 0 if the library reported a failure.
    O(bytes)."""
    ctx = np.empty(_CTX_WORDS, np.uint64)
    c = ctx.ctypes.data
    for i in range(pages.shape[0]):
        ok = _call1(init, c)
        if i == 0:
            if parent.size:
                ok &= _call3(update, c, parent.ctypes.data, parent.size)
        else:
            ok &= _call3(update, c, out[i - 1].ctypes.data, DIGEST_BYTES)
        ok &= _call3(update, c, pages[i].ctypes.data, pages.shape[1])
        ok &= _call2(final, out[i].ctypes.data, c)
        if ok != 1:
            return 0
    return 1


def chain(parent: npt.NDArray[np.uint8], pages: npt.NDArray[np.uint8], out: npt.NDArray[np.uint8]) -> bool:
    """:func:`chain_pages` with the library's functions; ``pages`` and ``out`` C-contiguous, one row per page.
    False if the library failed (the caller then hashes with ``hashlib``). O(bytes)."""
    return bool(chain_pages(INIT, UPDATE, FINAL, parent, pages, out))
