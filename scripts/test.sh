#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite: lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
# Again with the leaf kernels (router keys, token arrays, trace tokens, page digests) on their short pure-Python
# paths: the same results. The index has no such path (its compiled tables are the one implementation).
KVTIER_JIT=0 .venv/bin/python -m pytest -q tests/test_keykernel.py tests/test_tokenarray.py tests/test_codec.py \
    tests/test_wire_vectors.py tests/test_key_scopes.py tests/test_trace.py tests/test_hashing.py \
    tests/test_engine_transitions.py tests/test_pinned_results.py tests/test_lookahead.py
