"""Forcing a compiled kernel's callers onto their pure-Python path, for tests that compare the two."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.kernels.jit import LazyKernels


@contextmanager
def python_path(kernels: LazyKernels) -> Iterator[None]:
    """While open, ``kernels`` reads as not loadable, so its callers take the Python path."""
    saved = kernels.module, kernels.backend
    kernels.module, kernels.backend = None, "python (forced by the test)"
    try:
        yield
    finally:
        kernels.module, kernels.backend = saved
