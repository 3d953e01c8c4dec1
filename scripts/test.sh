#!/usr/bin/env bash
# The test command: install what is needed, check the import contracts (pyproject.toml), then run the tests in two
# worker processes (pytest-xdist; FLEXSPARSE_TEST_WORKERS sets how many; --maxschedchunk=1 hands each worker two
# tests to begin with and one at a time after, so that the long tests, which conftest orders first, start on
# different workers): the default tier; pass -m exhaustive for the exhaustive tier, -m gpu on a GPU machine (GPU
# tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
"$PY" -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
exec "$PY" -m pytest -q -n "${FLEXSPARSE_TEST_WORKERS:-2}" --maxschedchunk=1 "$@"
