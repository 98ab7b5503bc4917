#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: routing policies compared on a built-in, deterministic
# multi-turn chat trace (1,000 requests) over 4 workers with small device caches, a 4x host tier
# and local disk. Prints the table; writes out/main/{summary.json,requests.csv,*.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvtier compare \
    --trace builtin:chat:1000 --time-scale 6 \
    --workers 4 --device-tokens 32768 --host-ratio 4 --l3 disk --l3-tokens 1048576 \
    --out out/main "$@"
