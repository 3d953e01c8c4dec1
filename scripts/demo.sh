#!/usr/bin/env bash
# The main job: install, then run the flexsparse benchmark/demo on the best available device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m flexsparse "$@"
