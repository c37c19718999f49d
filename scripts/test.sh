#!/usr/bin/env bash
# Set up (if needed, with the dev extra) and run the default test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m sweep` for the full OpInfo sweep.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# pytest-xdist: one worker per core (TEST_WORKERS=0 runs in this one process).
exec .venv/bin/python -m pytest -q -n "${TEST_WORKERS:-auto}" "$@"
