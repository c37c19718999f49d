#!/usr/bin/env bash
# The GPU check (issue 28), one call on a machine with a CUDA GPU: the environment, the whole
# test suite with the CUDA tests enabled (the OpInfo fast subset and the device-audit programs on
# cuda among them), the notebooks on cuda, and the GPU benchmark table.  Every log and table goes
# under $OUT (default /tmp/gpu_check); each step has its own time limit, so one hang cannot eat
# the call.  It installs nothing over the machine's own torch: functrans runs from this checkout
# (PYTHONPATH), and the test-only packages the machine lacks (expecttest for op_db, opacus,
# torchdata) come from wheels in .whl/ when that folder is there (pip --target, no deps).
#
#   bash scripts/gpu_check.sh                 # every step
#   bash scripts/gpu_check.sh tests bench     # only these steps (env always runs)
#   BENCH_FILTER="per-sample" BENCH_DEADLINE=120 bash scripts/gpu_check.sh bench
#
# Steps, in order, and their limits (seconds): bench ${BENCH_LIMIT:-300} (${BENCH_WORKERS:-6} rows
# at once; no row starts after ${BENCH_DEADLINE:-200} s; ~110 s on the H200), the CUDA tests
# ${CUDA_TESTS_LIMIT:-150} (-m cuda; ~50 s), the whole suite ${TESTS_LIMIT:-420} (pytest -n 14;
# it did not finish in 220 s there), the notebooks ${NOTEBOOKS_LIMIT:-150} (~50 s).  A whole run
# needs about 12 minutes of device time, more than one call gives: pass the steps to run.  $OUT/summary.txt has each
# step's exit code and time.  Dry run of the CPU parts: `DEVICE=cpu bash scripts/gpu_check.sh`
# (smoke-sized benchmark rows).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
steps=${*:-"tests notebooks bench"}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/ft-site .whl/*.whl >"$OUT/env.log" 2>&1 || echo "wheel install failed" >>"$OUT/summary.txt"
  export PYTHONPATH=/tmp/ft-site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg

step() {   # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "step $name: exit $rc$([ $rc = 124 ] && echo ' (TIMED OUT)') in $((SECONDS - t0)) s" \
      | tee -a "$OUT/summary.txt"
  return 0
}
has() { [[ " $steps " == *" $1 "* ]]; }

{
  date -u; uname -a; nvidia-smi 2>&1 | head -15
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda",
      torch.version.cuda, "| available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
import functrans; print("functrans from", functrans.__file__)
for m in ("pytest", "xdist", "expecttest", "opacus", "torchdata", "einops", "matplotlib"):
    try:
        __import__(m); print("has", m)
    except Exception as e:
        print("MISSING", m, e)
EOF
} >>"$OUT/env.log" 2>&1
echo "env: $(grep -m1 '^python' "$OUT/env.log")" | tee -a "$OUT/summary.txt"

# The benchmark first and alone on the GPU (its timings must not share the device with the
# tests); then the tests, with the notebooks beside them.
if has bench; then
  smoke=$([ "$DEVICE" = cpu ] && echo --smoke)
  step bench "${BENCH_LIMIT:-300}" "$PY" -m benchmarks.gpu --device "$DEVICE" $smoke \
      --workers "${BENCH_WORKERS:-6}" --deadline "${BENCH_DEADLINE:-200}" \
      --filter "${BENCH_FILTER:-}" --json "$OUT/gpu_bench.json"
  tail -40 "$OUT/bench.log"
fi
if has tests; then
  # the CUDA tests first (a minute), then the whole suite; the notebooks after, not beside
  # them (beside 14 test workers both ran out of time on the H200 machine, 2026-11-27)
  FUNCTRANS_CUDA_IDS="$OUT/cuda_ids.txt" \
  step tests_cuda "${CUDA_TESTS_LIMIT:-150}" "$PY" -m pytest -q -p no:cacheprovider \
      -n "${TEST_WORKERS:-14}" -m cuda --timeout 120 -rfE --junitxml "$OUT/junit_cuda.xml"
  "$PY" scripts/junit_counts.py "$OUT/junit_cuda.xml" "$OUT/cuda_ids.txt" | tee -a "$OUT/summary.txt"
  step tests "${TESTS_LIMIT:-420}" "$PY" -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-14}" \
      --timeout 300 -rfE --junitxml "$OUT/junit.xml" ${TESTS_ARGS:-}
  [ -f "$OUT/junit.xml" ] && "$PY" scripts/junit_counts.py "$OUT/junit.xml" | tee -a "$OUT/summary.txt"
fi
if has notebooks; then
  step notebooks "${NOTEBOOKS_LIMIT:-150}" "$PY" notebooks/run_as_script.py --device "$DEVICE"
fi
cat "$OUT/summary.txt"
