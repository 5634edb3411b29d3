#!/usr/bin/env bash
# Everything one GPU can show, in one command, each step under its own time limit; logs land in
# $OUT (default bench/out/gpu). Run from the repository root on a machine with one CUDA GPU:
#
#     bash bench/gpu/run.sh [steps...]      # default: every step below, in order
#
# Steps: env, gate, selftest, tests, kbench. Wheels found in .whl/ (e.g. mpich) are installed
# into /tmp/site first. Each step's exit status is printed; the script never stops early, so one
# failure does not hide the next.
set -u
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BURSTCU_CACHE_DIR=${BURSTCU_CACHE_DIR:-/tmp/burstcu-cache}
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(env gate selftest tests kbench)

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$OUT/summary.txt"
}

for s in "${steps[@]}"; do
  case $s in
    env) step env 60 bash -c "nvidia-smi; $PY -c 'import sys; print(sys.version)';
           $PY -m pip list 2>/dev/null | grep -i -E 'cupy|nvrtc|nccl|cuda|mpi|torch|ml.dtypes|numpy|filelock|pytest'" ;;
    gate) step gate 240 $PY -m burstcu.kernels check --arch sm_90 --json "$OUT/gate_sm90.json" ;;
    selftest) step selftest 420 $PY -m burstcu.selftest --full --json "$OUT/selftest.json" ;;
    basic) step basic 300 $PY -m burstcu.selftest --json "$OUT/selftest_basic.json" ;;
    tests) step tests 420 env BURSTCU_KERNEL_TEST_BACKEND=cupy $PY -m pytest -q --timeout 120 \
             -p no:cacheprovider tests/gpu tests/kernels/test_flash_fwd_emulated.py \
             tests/kernels/test_flash_bwd_emulated.py ;;
    kbench) step kbench 420 $PY bench/kernels.py --json "$OUT/kernels.json" --table "$OUT/kernels.txt" \
             --plot "$OUT/kernels.png" ${KBENCH_ARGS:-} ;;
    *) echo "unknown step $s" ;;
  esac
done
