#!/usr/bin/env bash
# Creates .venv and installs kvtier with its dev tools. Idempotent; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in pyproject.toml (2.13.0, a local CPU build here): never a multi-GB CUDA download.
.venv/bin/python -m pip install -q -e ".[dev]"
