#!/usr/bin/env bash
# The wheels `make gpu-check` needs beside a GPU machine's own torch, for the Python of that
# machine (default 3.12, x86_64 Linux), into var/gpu-wheels/ (ignored by git): pydantic for
# the engine's specs, numpy, and pytest for the CUDA tests. A GPU machine lent to a session has
# no network; carry var/gpu-wheels there and `make gpu-check` installs them into a venv that
# sees the system's torch (scripts/gpu_check.sh).
#
#   scripts/gpu_wheels.sh [PYTHON_VERSION]      e.g. scripts/gpu_wheels.sh 3.12
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
out=var/gpu-wheels
pip=.venv/bin/pip
[ -x "$pip" ] || pip="python3 -m pip"
rm -rf "$out" && mkdir -p "$out"
$pip download -q --only-binary :all: --python-version "$version" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --implementation cp -d "$out" \
  "pydantic>=2.7" "numpy>=1.26" "pytest>=8" "pytest-timeout" "typing-extensions"
echo "$(ls "$out" | wc -l) wheels for Python $version in $out ($(du -sh "$out" | cut -f1))"
