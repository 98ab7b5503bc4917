#!/usr/bin/env bash
# Creates .venv and installs kvtier with its dev tools. Idempotent; safe to re-run: an install that
# succeeded for this pyproject.toml, this script and this checkout's place is not run again
# (.venv/install.stamp; kvtier is installed editable, from here).
# pip's output goes to .venv/install.log, shown if the install fails; meanwhile a line every 15 s says
# what it is at.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
too_old() {  # kvtier needs Python 3.11 or later (tomllib, below and in kvtier): said in one line, not a traceback
    ! "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}
if [ -x .venv/bin/python ] && too_old .venv/bin/python; then
    echo "kvtier: .venv runs $(.venv/bin/python -V 2>&1), older than 3.11: making it again" >&2
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    if too_old "$PY"; then
        found=$(command -v "$PY" >/dev/null && "$PY" -V 2>&1 || echo "not found")
        echo "kvtier: needs Python 3.11 or later; $PY is $found (set PYTHON, e.g. PYTHON=python3.11 bash $0)" >&2
        exit 2
    fi
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
: >"$log"
echo "kvtier: installing into .venv (log: $log)" >&2

stop_step() {  # stop_step PID STATUS: stops a step's command and what it started (pip's build backend), then exits
    if command -v pkill >/dev/null; then pkill -TERM -P "$1" 2>/dev/null || true; fi
    kill -TERM "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    echo "kvtier: install stopped; bash scripts/setup.sh starts it again" >&2
    exit "$2"
}
step() {  # step WHAT CMD...: says WHAT, runs CMD into the log, saying every 15 s what pip is at; on failure
          # shows the log and stops. Ctrl-C (or a stop signal) stops CMD too: run in the background it ignores
          # Ctrl-C, and would go on writing into .venv beside the next run's install.
    echo "kvtier: $1" >&2
    shift
    "$@" >>"$log" 2>&1 &
    local pid=$! waited=0 at
    trap 'stop_step "$pid" 130' INT
    trap 'stop_step "$pid" 143' TERM
    trap 'stop_step "$pid" 129' HUP
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        waited=$((waited + 1))
        if [ $((waited % 15)) = 0 ]; then
            at=$(grep -E '^ *(Collecting|Downloading|Building|Installing collected)' "$log" | tail -n 1 |
                 sed 's/^ *//' | cut -c1-90 || true)
            echo "kvtier:   ... ${waited} s${at:+ ($at)}" >&2
        fi
    done
    trap - INT TERM HUP
    if ! wait "$pid"; then
        cat "$log" >&2
        echo "kvtier: install failed (see above)" >&2
        exit 1
    fi
}
# torch is pinned in pyproject.toml and taken as its CPU build, never a multi-GB CUDA download: first alone
# from PyTorch's CPU index where it can be reached (as PyTorch's install instructions do; --index-url, so that
# no other package can come from there, nor torch from elsewhere), then everything else from the wheels pip is
# configured with, where the pinned torch is then installed already (2.13.0+cpu satisfies ==2.13.0).
torch_pin=$(.venv/bin/python -c 'import tomllib
with open("pyproject.toml", "rb") as f:
    print(next(d for d in tomllib.load(f)["project"]["optional-dependencies"]["engine"] if d.startswith("torch")))')
step "upgrading pip" .venv/bin/python -m pip install -q --upgrade pip
if .venv/bin/python -c "import urllib.request; urllib.request.urlopen('https://download.pytorch.org/whl/cpu/', timeout=5)" \
        >/dev/null 2>&1; then
    step "installing $torch_pin, CPU build (some 200 MB), from PyTorch's index" \
        .venv/bin/python -m pip install --progress-bar off --index-url https://download.pytorch.org/whl/cpu "$torch_pin"
fi
step "installing kvtier and its dependencies (minutes on a first install: 1.3 GB in all)" \
    .venv/bin/python -m pip install --progress-bar off -e ".[dev]"
echo "$want" > "$stamp"
