#!/usr/bin/env bash
# Install flexsparse and what its tests/demo need, reusing an installed torch.
# A machine without torch gets torch 2.13.0 (+ triton 3.7.1 for the Triton interpreter on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_install "torch==2.13.0"
fi
if ! "$PY" -c "import triton" 2>/dev/null; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13') else 1)"; then
    pip_install "triton==3.7.1"
  fi
fi
pip_install -e ".[test,plot,quant,examples]"
