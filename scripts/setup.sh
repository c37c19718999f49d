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
# requests and urllib3 are its only other needs), and the `models` extra: transformers and timm
# for tests/models/real/ (tiny configs, no download) with their pure-Python needs, and
# torchvision 0.28.0 (the release paired with torch 2.13; timm imports it).  A torchvision
# wheel built for CUDA cannot load its C extension beside a CPU torch; tests/models/real/
# says how timm still imports then (timm's models use none of torchvision's ops).
no_deps_extras() {
  "$VPY" -m pip install -q --no-deps opacus==1.6.0 "scipy>=1.2" "opt_einsum>=3.3" \
      torchdata==0.11.0 requests urllib3 charset_normalizer idna certifi
  "$VPY" -m pip install -q --no-deps transformers==5.18.0 huggingface_hub==1.33.0 \
      tokenizers==0.23.2 safetensors==0.8.0 regex==2026.9.29 tqdm==4.70.1 \
      httpx==0.28.1 httpcore==1.0.9 anyio==4.15.1 h11==0.16.0 sniffio==1.3.1 hf-xet==1.6.0 \
      "click>=8.4.2" pyyaml timm==1.0.29 torchvision==0.28.0 pillow
}
case "$extra" in
  "") "$VPY" -m pip install -q -e . ;;
  dev|bench)   # bench is dev: the benchmark's Opacus rows need only the extras above
    "$VPY" -m pip install -q -e ".[dev]"; no_deps_extras ;;
  docs)        # dev plus Sphinx, MyST-NB, the theme and mypy (scripts/docs.sh, scripts/typecheck.sh)
    "$VPY" -m pip install -q -e ".[dev,docs]"; no_deps_extras ;;
  *) "$VPY" -m pip install -q -e ".[$extra]" ;;
esac
