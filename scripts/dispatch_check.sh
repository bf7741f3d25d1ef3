#!/usr/bin/env bash
# On a CUDA host, in one device call: tune the dispatch specs into a database (resuming it if
# it exists), then time tuner.attention against torch SDPA on every row (dispatch_bench.py),
# the host overhead (attention_overhead.py), and the dispatcher's GPU tests.
#
#   bash scripts/dispatch_check.sh DB_FILE "fwd decode train" [sweep seconds per spec] [all|sweep|bench]
#
# One device call lasts at most 10 minutes, and on the H100 the fwd spec alone needs about
# 450 s with its head-to-heads (decode ~150 s, train ~250 s): sweep each spec in a call of its
# own ("sweep", carrying the database between calls), then run "bench" (about 150 s for fwd
# and decode, plus the overhead and the tests). A sweep stopped by its time limit keeps what
# it measured and resumes on the next run, but its head-to-heads come only at its end.
# Logs and JSON go to $OUT (or ./out); the database is copied there too.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
db_file=$1; specs=${2:-"fwd decode train"}; sweep_s=${3:-150}; stage=${4:-all}
case $stage in all|sweep|bench) ;; *) echo "stage must be all, sweep or bench, not '$stage'"; exit 2;; esac
db="sqlite:///$(realpath "$db_file")"
[ "$stage" = bench ] || for s in $specs; do
  timeout "$sweep_s" python3 -m tuner.cli.app sweep "benchmarks/specs/dispatch_$s.toml" \
    --db "$db" >"$OUT/sweep_$s.log" 2>&1
  echo "sweep $s: exit $? (124: stopped at ${sweep_s} s; what it measured is stored)"
done
if [ "$stage" = sweep ]; then cp "$db_file" "$OUT/tuner.db"; exit 0; fi
python3 benchmarks/dispatch_bench.py --db "$db" --specs "$(echo $specs | tr ' ' ,)" \
  --json "$OUT/dispatch.json" >"$OUT/dispatch.log" 2>&1; echo "dispatch_bench: exit $?"
TUNER_DATABASE_URL=sqlite:////nonexistent.db python3 benchmarks/attention_overhead.py \
  --json "$OUT/overhead.json" >"$OUT/overhead.log" 2>&1; echo "overhead: exit $?"
python3 -m pytest -q -p no:cacheprovider tests/tuner/dispatch/test_dispatch.py tests/tuner/test_cuda_graph.py \
  >"$OUT/tests.log" 2>&1; echo "tests: exit $?"
cp "$db_file" "$OUT/tuner.db"
tail -n 4 "$OUT/tests.log"; tail -n 14 "$OUT/overhead.log"; sed -n '/^row /,$p' "$OUT/dispatch.log"
