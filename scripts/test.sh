#!/usr/bin/env bash
# Sets up (if needed) and runs the whole test suite: lint, types, tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
