"""Unaligned word reads and writes on ``uint8`` arrays inside numba kernels (LLVM intrinsics).

Numba has neither, and combining byte reads dominated XXH3 (:mod:`kvtier.kernels.keykernel`) and msgpack
writes (:mod:`kvtier.kernels.tokenkernel`); figures in ``bench/MEASUREMENTS.md``. A word is in the machine's
byte order, so importing this module fails on a big-endian machine (the kernels' callers then take their Python
paths). No bounds checks: callers keep ``i + bits / 8 <= len``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

if sys.byteorder != "little":
    raise ImportError("kvtier's kernels read little-endian words; this machine is big-endian")


def load(bits: int) -> Callable[[npt.NDArray[np.uint8], int], np.uint64]:
    """An intrinsic: the unsigned ``bits``-bit integer at byte ``i`` of a ``uint8`` array, as a ``uint64``, read
    in one unaligned load."""

    @intrinsic
    def _load(typingctx: Any, arr: Any, i: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(bits).as_pointer())
            value = builder.load(ptr, align=1)
            return value if bits == 64 else builder.zext(value, ir.IntType(64))
        return types.uint64(arr, types.intp), codegen

    return cast(Callable[[npt.NDArray[np.uint8], int], np.uint64], _load)


@intrinsic
def _store64(typingctx: Any, arr: Any, i: Any, value: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()
    return types.none(arr, types.intp, types.uint64), codegen


#: ``store64(arr, i, value)``: the ``uint64`` ``value`` written at byte ``i`` of a ``uint8`` array (8 bytes).
store64 = cast(Callable[[npt.NDArray[np.uint8], int, np.uint64], None], _store64)

__all__ = ["load", "store64"]
