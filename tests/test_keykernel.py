"""The compiled key chain (kvtier.kernels.keykernel) against the xxhash library and the Python fallback."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from contextlib import AbstractContextManager

import numpy as np
import pytest
import xxhash
from hypothesis import example, given
from hypothesis import strategies as st

from kvtier.indexer.index import keys
from kvtier.indexer.index.keys import BlockKey, chain_keys, namespace
from tests.jit_paths import python_path

keykernel = pytest.importorskip("kvtier.kernels.keykernel", reason="numba is not installed")

#: Lengths at which XXH3 changes path (0, 1-3, 4-8, 9-16, 17-128, 129-240, over 240) or, over 240 bytes,
#: where the stripe and block loops of the long path end.
EDGES = sorted({*range(0, 260), 319, 320, 321, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 4099})
SEEDS = (0, 1337, 2**63, 2**64 - 1, 0x0123456789ABCDEF)


def reference_chain(tokens: list[int], block_size: int, base: int | None) -> list[int]:
    """The keys of SPEC section 2, from xxhash alone (not kvtier.indexer.index.keys)."""
    out: list[int] = []
    prev = base
    for i in range(len(tokens) // block_size):
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *tokens[i * block_size:(i + 1) * block_size]),
                                         1337)
        prev = local if prev is None else xxhash.xxh3_64_intdigest(struct.pack("<QQ", prev, local), 1337)
        out.append(prev)
    return out


def compiled_xxh3(data: bytes, off: int, n: int, seed: int) -> int:
    s = np.uint64(seed)
    return int(keykernel.xxh3(np.frombuffer(data, np.uint8), off, n, s, keykernel._custom_secret(s)))


@pytest.mark.parametrize("seed", SEEDS)
def test_xxh3_equals_the_xxhash_library_at_every_path_edge(seed: int) -> None:
    data = bytes((i * 131 + 7) % 256 for i in range(4200))
    wrong = [n for n in EDGES if compiled_xxh3(data, 3, n, seed) != xxhash.xxh3_64_intdigest(data[3:3 + n], seed)]
    assert not wrong, f"compiled XXH3 differs from xxhash for lengths {wrong} (seed {seed:#x})"


@given(st.binary(max_size=3000), st.integers(0, 2**64 - 1), st.integers(0, 7))
def test_xxh3_equals_the_xxhash_library_on_random_input(data: bytes, seed: int, lead: int) -> None:
    padded = bytes(lead) + data
    assert compiled_xxh3(padded, lead, len(data), seed) == xxhash.xxh3_64_intdigest(data, seed)


def python_keys() -> AbstractContextManager[None]:
    return python_path(keys._KERNELS)


def test_the_compiled_chain_is_what_chain_keys_runs() -> None:
    # scripts/test.sh runs this module a second time with KVTIER_JIT=0, for the fallback
    off = os.environ.get("KVTIER_JIT", "1") == "0"
    assert keys.key_backend() == ("python (KVTIER_JIT=0)" if off else "numba")


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=700),
       block_size=st.sampled_from([1, 2, 3, 4, 16, 32, 59, 60, 61, 64, 128, 256]),
       base=st.none() | st.integers(0, 2**64 - 1))
@example(tokens=list(range(8192)), block_size=16, base=None)
@example(tokens=list(range(8192)), block_size=64, base=2**64 - 1)
def test_compiled_chain_equals_xxhash_reference(tokens: list[int], block_size: int, base: int | None) -> None:
    parent = None if base is None else BlockKey(base)
    assert chain_keys(tokens, block_size, parent) == reference_chain(tokens, block_size, base)


@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=4, max_size=300),
       block_size=st.sampled_from([1, 4, 16, 64]), lora=st.none() | st.text(max_size=8))
def test_namespaced_chain_is_the_same_either_way(tokens: list[int], block_size: int, lora: str | None) -> None:
    ns = namespace(lora, None)
    compiled = chain_keys(tokens, block_size, None, ns)
    with python_keys():
        assert chain_keys(tokens, block_size, None, ns) == compiled


def test_python_path_equals_reference() -> None:
    tokens = list(range(1000, 1000 + 64 * 40))
    with python_keys():
        assert keys.key_backend(load=False).startswith("python")
        assert chain_keys(tokens, 64, BlockKey(7)) == reference_chain(tokens, 64, 7)


def _backend_in_subprocess(env: dict[str, str], prelude: str = "") -> dict[str, object]:
    code = (prelude + "import json; from kvtier.indexer.index import keys\n"
            "ks = keys.chain_keys(list(range(640)), 16)\n"
            "print(json.dumps({'backend': keys.key_backend(), 'keys': ks}))\n")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_kvtier_jit_0_selects_the_python_path_with_the_same_keys() -> None:
    got = _backend_in_subprocess({"KVTIER_JIT": "0"})
    assert got == {"backend": "python (KVTIER_JIT=0)", "keys": reference_chain(list(range(640)), 16, None)}


def test_without_numba_the_python_path_runs_and_says_why() -> None:
    got = _backend_in_subprocess({"KVTIER_JIT": "1"}, prelude="import sys; sys.modules['numba'] = None\n")
    assert str(got["backend"]).startswith("python (numba unavailable:"), got["backend"]
    assert got["keys"] == reference_chain(list(range(640)), 16, None)


def test_importing_the_keys_does_not_import_numba() -> None:
    code = "import sys, kvtier.indexer; print('numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
