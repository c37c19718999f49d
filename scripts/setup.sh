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
# The optional packages the tests, the examples and the docs use, installed --no-deps (pinned)
# so pip never resolves torch: Opacus (DP-SGD equivalence, accounting, benchmark rows; scipy and
# opt_einsum need only numpy, already here) and torchdata (the torchdata.nodes -> DDP example;
# requests and urllib3 are its only other needs).
no_deps_extras() {
  "$VPY" -m pip install -q --no-deps opacus==1.6.0 "scipy>=1.2" "opt_einsum>=3.3" \
      torchdata==0.11.0 requests urllib3 charset_normalizer idna certifi
}
case "$extra" in
  "") "$VPY" -m pip install -q -e . ;;
  dev|bench)   # bench is dev: the benchmark's Opacus rows need only the extras above
    "$VPY" -m pip install -q -e ".[dev]"; no_deps_extras ;;
  docs)        # dev plus Sphinx, MyST-NB, the theme and mypy (scripts/docs.sh, scripts/typecheck.sh)
    "$VPY" -m pip install -q -e ".[dev,docs]"; no_deps_extras ;;
  *) "$VPY" -m pip install -q -e ".[$extra]" ;;
esac
