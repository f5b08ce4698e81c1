#!/usr/bin/env bash
# `make gpu-check`: the engine's GPU path, one JSON line (scripts/gpu_check.py); exit 2
# without a GPU. Uses the project's .venv where there is one; on a bare GPU machine, the
# system's python3 with its own CUDA torch, and, when pydantic or pytest is missing there,
# a venv (var/gpu-venv, with the system's site-packages, so it sees that torch) filled from
# the wheels scripts/gpu_wheels.sh prepared into var/gpu-wheels (no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
if ! "$python" -c "import torch" 2>/dev/null; then
  echo '{"gpu_check": "skipped", "why": "no torch for '"$python"'"}'
  exit 2
fi
if ! "$python" -c "import pydantic, numpy, pytest" 2>/dev/null; then
  if [ ! -d var/gpu-wheels ]; then
    echo '{"gpu_check": "failed", "why": "pydantic, numpy or pytest missing and no var/gpu-wheels (run scripts/gpu_wheels.sh where there is a network, then carry var/gpu-wheels)"}'
    exit 1
  fi
  [ -x var/gpu-venv/bin/python ] || "$python" -m venv --system-site-packages var/gpu-venv
  var/gpu-venv/bin/python -m pip install -q --no-index --find-links var/gpu-wheels \
    pydantic numpy pytest pytest-timeout >&2
  python=var/gpu-venv/bin/python
fi
exec "$python" scripts/gpu_check.py
