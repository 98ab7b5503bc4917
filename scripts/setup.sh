#!/usr/bin/env bash
# Creates .venv and installs kvtier with its dev tools. Idempotent; safe to re-run.
# pip's output goes to .venv/install.log and is shown only if the install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
log=.venv/install.log
echo "kvtier: installing into .venv (log: $log)" >&2
# torch is pinned in pyproject.toml (2.13.0, a local CPU build here): never a multi-GB CUDA download.
if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e ".[dev]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "kvtier: install failed (see above)" >&2
    exit 1
fi
