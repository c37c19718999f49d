#!/usr/bin/env bash
# Type-check the public API: mypy --strict on the modules listed in pyproject.toml's [tool.mypy]
# (the public modules and tests/typing/usage.py; internal modules are followed for their types
# but their own errors are not reported).  Sets up .venv with the docs extra (it installs mypy)
# first.  TYPECHECK_PYTHON=/path/to/python uses that interpreter instead and skips the setup.
# Extra arguments go to mypy.  The cache (.mypy_cache) makes a second run fast.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${TYPECHECK_PYTHON:-}" ]; then
  VPY=$TYPECHECK_PYTHON
else
  bash scripts/setup.sh docs
  VPY=.venv/bin/python
fi
exec "$VPY" -m mypy "$@"
