"""The engine's page digest chain: the compiled loop (OpenSSL from numba) agrees with ``hashlib`` page by page,
and :class:`PageDigests` reads as the list of digests it replaces."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine import hashing
from kvtier.engine.hashing import ROOT_DIGEST, PageDigests, chain_hashes, event_hash
from kvtier.kernels import jit

from .jit_paths import python_path


def _by_hand(parent: bytes, tokens: bytes, page_size: int) -> list[bytes]:
    """SGLang's rule, spelled out: SHA-256(parent digest || page tokens as uint32 LE), page after page."""
    out, step = [], page_size * 4
    for off in range(0, len(tokens) - step + 1, step):
        parent = hashlib.sha256(parent + tokens[off:off + step]).digest()
        out.append(parent)
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(pages=st.integers(0, 40), page_size=st.sampled_from([1, 4, 16, 64]), tail=st.integers(0, 3),
       parent=st.sampled_from([ROOT_DIGEST, bytes(range(32))]), seed=st.integers(0, 2**32 - 1))
def test_chain_agrees_with_hashlib_on_both_paths(pages: int, page_size: int, tail: int, parent: bytes,
                                                 seed: int) -> None:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 2**32, pages * page_size + min(tail, page_size - 1), dtype=np.uint32).astype("<u4")
    packed = tokens.tobytes()
    want = _by_hand(parent, packed, page_size)
    got, hashes = chain_hashes(parent, packed, page_size)  # the kernel from _MIN_PAGES pages on, where it loads
    assert got == want and hashes == [event_hash(d) for d in want]
    assert hashing.chain(parent, tokens.tolist(), page_size) == want  # token ids as ints too
    with python_path(hashing._KERNELS):
        slow, slow_hashes = chain_hashes(parent, packed, page_size)
    assert slow == want and slow_hashes == hashes


def test_the_kernel_runs_where_numba_and_libcrypto_load() -> None:
    backend = hashing.hash_backend()
    if not backend.startswith("numba"):
        pytest.skip(f"compiled chain not loaded: {backend}")
    tokens = np.arange(64 * 8, dtype="<u4").tobytes()
    out = np.empty((8, 32), np.uint8)
    pages = np.frombuffer(tokens, np.uint8).reshape(8, 256)
    assert hashing._KERNELS.module.chain(np.frombuffer(ROOT_DIGEST, np.uint8), pages, out)
    assert [bytes(r) for r in out] == _by_hand(ROOT_DIGEST, tokens, 64)


def test_page_digests_read_as_a_list() -> None:
    ds = [hashlib.sha256(bytes([i])).digest() for i in range(6)]
    p = PageDigests.of(ds)
    assert len(p) == 6 and list(p) == ds and p == ds and p == tuple(ds) and p != ds[:5]
    assert p[0] == ds[0] and p[-1] == ds[-1] and p[-6] == ds[0]
    for i in (6, -7):
        with pytest.raises(IndexError):
            p[i]
    for sl in (slice(2), slice(2, None), slice(1, 4), slice(4, 1), slice(-2, None), slice(None)):
        part = p[sl]
        assert isinstance(part, PageDigests) and part == ds[sl] and list(part) == ds[sl]
    assert not PageDigests() and PageDigests() == [] and p == PageDigests(b"".join(ds))
    with pytest.raises(TypeError):
        hash(p)  # equal to a list, so unhashable like one
    with pytest.raises(AssertionError, match="step 1"):
        p[::2]


def test_off_linux_the_kernel_does_not_load_and_the_fallback_says_why(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if hashing.hash_backend().startswith("numba"):  # macOS aborts a process that loads its unversioned libcrypto
        with pytest.raises(ImportError, match="on Linux only, not darwin"):
            hashing._KERNELS.module._libcrypto("darwin")
    (tmp_path / "kvtier_unloadable_kernel.py").write_text("raise ImportError('no libcrypto here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVTIER_JIT", "1")
    assert jit.load("kvtier_unloadable_kernel") == (None, "python (kernels unavailable: no libcrypto here)")
