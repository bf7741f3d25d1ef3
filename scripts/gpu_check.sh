#!/usr/bin/env bash
# On a CUDA host: GPU-marked tests, then the quick benchmarks; a short table last.
#
#   bash scripts/gpu_check.sh [--tests-only|--bench-only]
#
# The lent H100 image has torch and triton but not optuna/sqlalchemy/fastapi/pydantic: those
# travel as wheels in .whl/ (bash ../shared/device/wheels.sh) and are installed to /tmp/site.
# Full logs and JSON rows go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
mode=${1:-all}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$OUT/gpu.txt"

status=0
if [ "$mode" != "--bench-only" ]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider -x --timeout 300 \
    --junitxml="$OUT/gpu-tests.xml" >"$OUT/gpu-tests.log" 2>&1 || status=$?
  tail -n 25 "$OUT/gpu-tests.log"
fi
if [ "$mode" != "--tests-only" ]; then
  for bench in benchmarks/fwd_quick.py benchmarks/decode_bench.py; do
    [ -f "$bench" ] || continue
    name=$(basename "$bench" .py)
    python3 "$bench" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || status=$?
    tail -n 30 "$OUT/$name.log"
  done
fi
echo "gpu_check: pytest -m gpu and benchmarks finished with status $status (logs in $OUT)"
exit "$status"
