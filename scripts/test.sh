#!/usr/bin/env bash
# Set up (if needed, with the dev extra) and run the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m sweep` for the full OpInfo sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
exec .venv/bin/python -m pytest -q "$@"
