#!/usr/bin/env bash
# Sets up (if needed) and runs the main job: routing policies compared on a built-in, deterministic
# multi-turn chat trace (1,000 requests) over 4 workers with small device caches, a 4x host tier
# and local disk, with goodput under an SLO near round robin's p90s on this trace (TTFT 160 ms, TPOT
# 34 ms). Prints the table; writes out/main/{summary.json,requests.csv,*.png}. Extra arguments go
# to kvtier compare (a later --sla-ttft-ms overrides this one).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvtier compare \
    --trace builtin:chat:1000 --time-scale 6 \
    --workers 4 --device-tokens 32768 --host-ratio 4 --l3 disk --l3-tokens 1048576 \
    --sla-ttft-ms 160 --sla-tpot-ms 34 \
    --out out/main "$@"
echo "what each column, field and plot means: docs/outputs.md"
