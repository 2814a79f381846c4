#!/usr/bin/env bash
# A shorter GPU check than tools/gpu_check.sh, for re-checking fixes inside a device
# call's budget: builds memlord, runs the test files given as arguments together
# (pytest-xdist, 8 workers), each CUDA test file alone, and the GPU benchmarks.
#
#     bash tools/gpu_focus.sh tests/unit/platform tests/unit/python/test_post_mortem.py
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_focus}
mkdir -p "$LOGS"
"$PY" -m pip install -q --no-build-isolation --no-deps -e . >"$LOGS/build.log" 2>&1 ||
    { tail -n 30 "$LOGS/build.log"; exit 1; }
echo "== the given tests"
timeout -k 5 170 "$PY" -m pytest -q -p no:cacheprovider -n 8 -m "not network" "$@" \
    >"$LOGS/focus.log" 2>&1
echo "rc=$? $(tail -n 1 "$LOGS/focus.log")"
grep -E "^(FAILED|ERROR)" "$LOGS/focus.log"
echo "== each CUDA test file alone"
for f in tests/unit/platform/test_*cuda*.py tests/unit/sinks/test_auto_gc.py \
    tests/unit/api/test_device_memory.py; do
    case $f in *fakecuda*) continue ;; esac
    echo "$(basename "$f"): $(timeout -k 5 60 "$PY" -m pytest -q -p no:cacheprovider "$f" 2>&1 |
        tee "$LOGS/alone_$(basename "$f" .py).log" | tail -n 1)"
done
echo "== bench_gpu"
timeout -k 5 100 "$PY" bench/bench_gpu.py --samples 9 --json "$LOGS/bench_gpu.json" \
    >"$LOGS/bench_gpu.log" 2>&1
grep -E "^\||  (offload|auto-GC|train)" "$LOGS/bench_gpu.log" || tail -n 20 "$LOGS/bench_gpu.log"
echo "== failures"
sed -n '/^=* FAILURES/,/^=* short test summary/p' "$LOGS/focus.log" | grep -E "^(E |_{5,}|tests/)" |
    head -n 80
for f in "$LOGS"/alone_*.log; do grep -qE "^E " "$f" && grep -E "^(E |_{5,})" "$f" | head -n 20; done
exit 0
