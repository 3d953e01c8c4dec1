#!/usr/bin/env bash
# On a GPU machine (e.g. through the device tool): the GPU tests of the given test files, then each
# benchmark command, with logs and a device line under $OUT. The project runs from this checkout (PYTHONPATH,
# no pip install: the machine has torch and triton but no package index); torchao is installed from a carried .whl/.
# The device tool returns at most 8 files: with more under $OUT, all of them go into $OUT/all.tgz and only
# that archive and the three logs stay.
#   OUT=/tmp/out bash scripts/gpu_check.sh "tests/test_a.py tests/test_b.py" 'python benchmarks/x.py --out $OUT/x.json'
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
if ! python3 -c "import torchao" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/device.txt"
tests=$1
shift
# Workers by GPU memory: 16 fit 141 GB (H200); on an 80 GB H100 16 workers run out of memory, 8 do not.
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
workers=${GPU_TEST_WORKERS:-$(( mib >= 120 * 1024 ? 16 : 8 ))}
if [ -n "$tests" ]; then
  # shellcheck disable=SC2086
  python3 -m pytest $tests -m gpu -q -n "$workers" --maxschedchunk=1 -p no:cacheprovider \
    -p no:logging 2>&1 | grep -v DEBUG > "$OUT/gpu_tests.log"
  grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
  sed -n '/largest recorded errors/,/ in [0-9.]*s/p' "$OUT/gpu_tests.log" | head -40
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
fi
for cmd in "$@"; do
  echo "== $cmd"
  eval "$cmd" 2>&1 | grep -v DEBUG | tail -30
done | tee "$OUT/bench.log"
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar -czf /tmp/all.tgz -C "$OUT" .
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name device.txt ! -name gpu_tests.log ! -name bench.log -exec rm -rf {} +
  mv /tmp/all.tgz "$OUT/all.tgz"
fi
