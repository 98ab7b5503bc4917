#!/usr/bin/env bash
# Creates .venv and installs kvtier with its dev tools. Idempotent; safe to re-run: an install that
# succeeded for this pyproject.toml, this script and this checkout's place is not run again
# (.venv/install.stamp; kvtier is installed editable, from here).
# pip's output goes to .venv/install.log and is shown only if the install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/install.stamp
want=$(.venv/bin/python -c 'import hashlib, os
h = hashlib.sha256(os.getcwd().encode())
for name in ("pyproject.toml", "scripts/setup.sh"):
    with open(name, "rb") as f:
        h.update(f.read())
print(h.hexdigest())')
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0  # (kvtier is installed editable: code changes need no reinstall, dependency changes do)
fi
log=.venv/install.log
echo "kvtier: installing into .venv (log: $log)" >&2
# torch is pinned in pyproject.toml (2.13.0) and taken as its CPU build, never a multi-GB CUDA download:
# from PyTorch's CPU index where it can be reached (2.13.0+cpu ranks above PyPI's 2.13.0), else from the
# wheels pip is configured with.
extra=()
if .venv/bin/python -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/', timeout=5)" \
        >/dev/null 2>&1; then
    extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
if ! { .venv/bin/python -m pip install -q --upgrade pip \
        && .venv/bin/python -m pip install -q ${extra[@]+"${extra[@]}"} -e ".[dev]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "kvtier: install failed (see above)" >&2
    exit 1
fi
echo "$want" > "$stamp"
