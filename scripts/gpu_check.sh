#!/usr/bin/env bash
# On a CUDA host: GPU-marked tests, then the quick benchmarks; a short table last.
#
#   bash scripts/gpu_check.sh [--tests-only|--bench-only] [--group all|fwd|bwd|decode|tuner]
#                             [--workers N] [--budget-s S] [--device-tests]
#
# The tests run through scripts/gpu_tests.py: spread over --workers processes (pytest-xdist,
# default 8), interrupted at --budget-s (default 450) so that a 10-minute device call always
# ends with a summary (counts per group, slowest tests, wall time); --group runs one group.
# The lent H100 image has torch and triton but not optuna/sqlalchemy/fastapi/pydantic: those
# travel as wheels in .whl/ (bash ../shared/device/wheels.sh) and are installed to /tmp/site.
# Full logs, the JUnit XML and JSON rows go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."

mode=all
test_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tests-only|--bench-only) mode=$1 ;;
    --device-tests) test_args+=("$1") ;;
    --group|--workers|--budget-s)
      [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; exit 2; }
      test_args+=("$1" "$2"); shift ;;
    *) echo "error: unknown argument '$1'" >&2
       echo "fix: use --tests-only, --bench-only, --group G, --workers N, --budget-s S or --device-tests" >&2
       exit 2 ;;
  esac
  shift
done

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; export OUT

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$OUT/gpu.txt"

status=0
if [ "$mode" != "--bench-only" ]; then
  python3 scripts/gpu_tests.py --out "$OUT" "${test_args[@]}" || status=$?
fi
if [ "$mode" != "--tests-only" ]; then
  for bench in benchmarks/fwd_quick.py benchmarks/decode_bench.py; do
    [ -f "$bench" ] || continue
    name=$(basename "$bench" .py)
    python3 "$bench" --json "$OUT/$name.json" >"$OUT/$name.log" 2>&1 || status=$?
    tail -n 30 "$OUT/$name.log"
  done
fi
echo "gpu_check: finished with status $status (logs in $OUT)"
exit "$status"
