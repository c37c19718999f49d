#!/usr/bin/env bash
# Create (or reuse) the project environment .venv and install functrans into it.
# Installs the pinned CPU build torch==2.13.0 only when no torch is present, so pip never
# resolves an unpinned torch (which would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "setup: no torch in .venv; installing the pinned CPU build torch==2.13.0"
  "$VPY" -m pip install -q torch==2.13.0
fi
extra=${1:-}
if [ "$extra" = "bench" ]; then
  # The benchmark extra: dev, plus Opacus for the benchmark's Opacus rows.  Everything --no-deps
  # (opacus pinned) so pip never resolves torch; scipy and opt_einsum need only numpy, already here.
  "$VPY" -m pip install -q -e ".[dev]"
  "$VPY" -m pip install -q --no-deps opacus==1.6.0 "scipy>=1.2" "opt_einsum>=3.3"
elif [ -n "$extra" ]; then
  "$VPY" -m pip install -q -e ".[$extra]"
else
  "$VPY" -m pip install -q -e .
fi
