#!/usr/bin/env bash
# Set up (if needed, with the docs extra) and build the documentation site with warnings as
# errors.  The HTML lands in docs/_build/html (open docs/_build/html/index.html).
# The notebooks are rendered from their stored outputs (not executed); the benchmark page is
# made from the README's tables (docs/_ext/bench_page.py).  Extra arguments go to sphinx-build.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh docs
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MPLBACKEND=Agg \
  exec .venv/bin/python -m sphinx -W --keep-going -b html "$@" docs docs/_build/html
