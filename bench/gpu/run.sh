#!/usr/bin/env bash
# Every GPU step of bench/README.md and docs/gpu.md, each under its own time limit (seconds, after
# the step's name); run from the repository root:
#
#     bash bench/gpu/run.sh [steps...]            # default: the list below, in order
#     bash bench/gpu/run.sh --dry-run [steps...]  # print each step's command, run nothing (any machine)
#     bash bench/gpu/run.sh hopper-session        # env warm isa hopper hopper_bench tiles_sm90 hopper_profile
#     bash bench/gpu/run.sh hopper-bwd-session    # env warm and the four hopper_bwd* steps
#
# Beyond the default steps: basic, bwd, lists and steplists_mma (the sm_90 table on a Hopper GPU),
# steplists_mmalist (the sm_90a table's mma.sync list kernel), the Hopper kernels' hopper* steps
# (hopper_profile: Nsight Compute at S = $PROFILE_SEQLEN; hopper_bwd_profile: the same over the
# Hopper dK/dV kernel; hopper_ring: the 4-rank ring on the Hopper kernels), small_parts and
# bwd_small_parts (every kernel's duration in a short forward / fwd+bwd call), host_profile
# (cProfile of kernel_speed's calls), head_groups (--sm90-head-group), whole_pass (the Hopper
# forward's pass of one fold against the ring step's zeroed, read, written and finalized state),
# dq_adds (the Hopper backward's dQ: two floats an atomic add, one, or bulk tensor reductions),
# decode_tests, packed (the lists' kernel tests on the GPU).
# Reports go to $OUT (default bench/out/gpu), each step's log to $OUT/logs.tgz, rewritten after
# every step (and $LOGS, where the logs are kept, emptied first); no step stops the others; exit 1
# if any failed or was skipped. Wheels in .whl/ go to /tmp/site first.
#   DEADLINE=S     every step ends within S seconds of the start: a step's limit is cut to the time
#                  left less 25 s (10 s for `timeout -k` to kill a step that ignores SIGTERM, 15 s
#                  to pack its log), and a step with under 45 s left is skipped (said in
#                  summary.txt), so a call under a hard limit still returns every log
#   CACHE_FROM=D   the kernel cache to start from (a carried copy of `python -m burstcu.build warm`'s
#                  folder): copied to $BURSTCU_CACHE_DIR, made this user's, mode 0700
set -u
DRY_RUN=0
[ "${1:-}" = --dry-run ] && { DRY_RUN=1; shift; }
OUT=${OUT:-bench/out/gpu}
LOGS=${LOGS:-/tmp/burstcu-gpu-logs}
DEADLINE=${DEADLINE:-0}
case $(realpath -m "$LOGS") in
  "$(realpath -m "$OUT")"|"$(realpath -m .)"|/)
    echo "LOGS=$LOGS is emptied at the start: name a folder of its own"; exit 2 ;;
esac
[ $DRY_RUN = 1 ] || { rm -rf "$LOGS"; mkdir -p "$OUT" "$LOGS"; }
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export BURSTCU_CACHE_DIR=${BURSTCU_CACHE_DIR:-/tmp/burstcu-cache}
if [ $DRY_RUN = 0 ] && [ -n "${CACHE_FROM:-}" ]; then
  rm -rf "$BURSTCU_CACHE_DIR" && mkdir -p "$(dirname "$BURSTCU_CACHE_DIR")" \
    && cp -r "$CACHE_FROM" "$BURSTCU_CACHE_DIR" && chmod -R go-w "$BURSTCU_CACHE_DIR" \
    && chmod 700 "$BURSTCU_CACHE_DIR" \
    || echo "CACHE_FROM=$CACHE_FROM: not copied; kernels compile on first use"
fi
PY=${PY:-python3}
ARCH="$PY -c 'from burstcu.build.compile import device_arch; print(device_arch())'"   # this GPU's sm_XY
PKGS='cupy|nvrtc|nccl|cuda|mpi|torch|ml.dtypes|numpy|filelock|pytest'   # the env step's packages
PROFILE=/tmp/burstcu-sm90_profile   # hopper_profile's Nsight Compute report (19 MB: left in /tmp)
DETAILS="ncu -i $PROFILE.ncu-rep --page details --csv"   # its details page as CSV
# the steps' common words (--report-api-errors no: cuda-bindings' driver probes are no memory errors)
KTEST="env BURSTCU_KERNEL_TEST_BACKEND=cupy"
PYTEST="$PY -m pytest -q -p no:cacheprovider"
PYTEST120="$PY -m pytest -q --timeout 120 -p no:cacheprovider"
MEMCHECK="compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 20"
RACECHECK="compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20"
KSPEED="$PY bench/gpu/kernel_speed.py"
STEPLISTS="$PY bench/gpu/step_lists.py"
OVERLAP="$PY bench/gpu/overlap_gpu.py"
DECODE="$PY bench/decode.py --backend cupy --dtype float16 --repeats 20"
# Nsight Compute over the timed calls only (kernel_speed --profile-timed starts and stops the
# profiler around them): not the first-use checks, nor the warm-up, nor host_ms's calls
NCU="ncu --clock-control none --profile-from-start off"
PROFILED="--profile-timed --rounds 1 --warmup 1 --repeats 1"
SM90_FWD=tests/kernels/test_flash_fwd_sm90_emulated.py
FWD=tests/kernels/test_flash_fwd_emulated.py
BWD=tests/kernels/test_flash_bwd_emulated.py
SM90_BWD_LISTS=tests/kernels/test_flash_bwd_sm90_lists_emulated.py
INERT=tests/kernels/test_masked_inert_kernels.py   # the sanitizer, tests and lists steps
INERT_ONCE=$INERT   # hopper and hopper_bwd: the first of them to run takes it (a call runs it once)
if [ $DRY_RUN = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
steps=("$@")
[ "${steps[0]:-}" = hopper-session ] && steps=(env warm isa hopper hopper_bench tiles_sm90 hopper_profile)
[ "${steps[0]:-}" = hopper-bwd-session ] \
  && steps=(env warm hopper_bwd hopper_bwd_memcheck hopper_bwd_racecheck hopper_bwd_bench)
[ ${#steps[@]} -eq 0 ] && steps=(env isa gate full tests gputests kbench overlap overlap_causal tiles
                                 memcheck racecheck demo mpi linear linearbench varlen steplists uneven
                                 decode)
failed=()
skipped=()

plot() {  # plot FILE: "--plot FILE" where matplotlib imports, else nothing (never waits on a picture)
  if [ $DRY_RUN = 1 ] || $PY -c 'import matplotlib' 2>/dev/null; then echo --plot "$1"; fi
}

pack() {  # $OUT/logs.tgz from $LOGS, replaced whole (a call killed while packing keeps the last one)
  tar czf "$OUT/logs.tgz.part" -C "$LOGS" . && mv -f "$OUT/logs.tgz.part" "$OUT/logs.tgz"
}

step() {  # step NAME SECONDS COMMAND...; ran: 1 if it ran (or would, with --dry-run), 0 if skipped
  local name=$1 limit=$2; shift 2
  ran=1
  if [ $DRY_RUN = 1 ]; then echo "=== $name (limit ${limit}s): $*"; return; fi
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 45 ]; then
      echo "=== $name: skipped, ${left}s left of DEADLINE=${DEADLINE}s" | tee -a "$LOGS/summary.txt"
      skipped+=("$name")
      ran=0
      pack
      return
    fi
    [ "$limit" -gt $((left - 25)) ] && limit=$((left - 25))
  fi
  echo "=== $name ($(date +%T), limit ${limit}s): $*" | tee -a "$LOGS/summary.txt"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-25}" "$LOGS/$name.log"
  echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$LOGS/summary.txt"
  [ "$rc" -eq 0 ] || failed+=("$name")
  pack
}

for s in "${steps[@]}"; do
  case $s in
    env) step env 60 bash -c "nvidia-smi; nproc; $PY -c 'import sys; print(sys.version)';
           $PY -m pip list 2>/dev/null | grep -i -E '$PKGS'" ;;
    isa) step isa 120 $KTEST BURSTCU_ISA_REPORT="$OUT/hopper_isa.json" $PYTEST \
      tests/gpu/test_hopper_isa_gpu.py ;;
    warm) step warm 240 bash -c "$PY -m burstcu.build warm --device \$($ARCH)" ;;
    gate) step gate 240 $PY -m burstcu.build check --arch sm_90,sm_90a --json "$OUT/gate_sm90.json" ;;
    hopper) step hopper 240 $KTEST BURSTCU_KERNEL_TEST_ARCH=sm_90a $PYTEST120 $SM90_FWD \
      tests/kernels/test_flash_fwd_sm90_lists_emulated.py $FWD $INERT_ONCE tests/gpu/test_hopper_ring_gpu.py \
      -k "not seeded"; [ $ran = 0 ] || INERT_ONCE= ;;
    hopper_bench) step hopper_bench 300 $KSPEED --archs sm_90a sm_80 --passes fwd \
      --impls kernels torch-flash torch-cudnn --json "$OUT/kernels_sm90.json" \
      --table "$LOGS/kernels_sm90.txt" $(plot "$OUT/kernels_sm90.png") ${KBENCH_ARGS:-} ;;
    hopper_memcheck) step hopper_memcheck 240 $KTEST BURSTCU_CUPY_NO_POOL=1 BURSTCU_KERNEL_TEST_ARCH=sm_90a \
      $MEMCHECK $PYTEST $SM90_FWD $INERT tests/kernels/test_flash_fwd_sm90_lists_emulated.py \
      -k "ragged or causal_offsets or headdims or poisoned_v or documents or whole_pass or ring_starts" ;;
    hopper_racecheck) step hopper_racecheck 180 $KTEST BURSTCU_KERNEL_TEST_ARCH=sm_90a $RACECHECK $PYTEST \
      $SM90_FWD -k "ragged_and_gqa or (headdims and float16 and not bfloat16 and 128) \
      or (whole_pass and float16 and not bfloat16) or tiles_without_keys" ;;
    hopper_bwd) step hopper_bwd 240 $KTEST BURSTCU_KERNEL_TEST_ARCH=sm_90a $PYTEST120 \
      tests/kernels/test_flash_bwd_sm90_emulated.py $SM90_BWD_LISTS $BWD $INERT_ONCE -k "not sm86"
      [ $ran = 0 ] || INERT_ONCE= ;;   # the masked-inert tests once a call (the sm_90a table, both passes)
    hopper_bwd_memcheck) step hopper_bwd_memcheck 180 $KTEST BURSTCU_CUPY_NO_POOL=1 $MEMCHECK $PYTEST \
      tests/kernels/test_flash_bwd_sm90_emulated.py $SM90_BWD_LISTS \
      -k "step_matches or outside or group_of or nan_in or dq_added or (atomic_list and 300)" ;;
    hopper_bwd_racecheck) step hopper_bwd_racecheck 180 $KTEST $RACECHECK $PYTEST \
      tests/kernels/test_flash_bwd_sm90_emulated.py $SM90_BWD_LISTS \
      -k "causal_offsets or small_ragged or small_causal or group_of or dq_added or (atomic_list and 300)" ;;
    hopper_bwd_bench) step hopper_bwd_bench 300 $KSPEED --archs sm_90a sm_80 --passes fwd+bwd \
      --impls kernels torch-flash torch-cudnn --headdims 64 128 256 --dq-modes atomic deterministic \
      --seqlens 1024 4096 16384 --json "$OUT/kernels_bwd_sm90.json" \
      --table "$LOGS/kernels_bwd_sm90.txt" $(plot "$OUT/kernels_bwd_sm90.png") ${KBENCH_ARGS:-} ;;
    dq_adds) step dq_adds 150 $KSPEED --archs sm_90a --passes fwd+bwd --impls kernels torch-flash \
      --dtypes float16 --headdims 64 128 --seqlens 4096 16384 --dq-adds pairs singles bulk --rounds 2 \
      --json "$LOGS/dq_adds.json" --table "$LOGS/dq_adds.txt" ;;
    full) step full 420 $PY -m burstcu.selftest --full --json "$OUT/selftest_full.json" ;;
    basic) step basic 300 $PY -m burstcu.selftest --json "$OUT/selftest_basic.json" ;;
    tests) step tests 420 $KTEST $PYTEST120 tests/gpu $FWD $BWD $INERT \
      tests/kernels/test_decode_emulated.py ;;
    steplists) step steplists 300 $STEPLISTS --json "$OUT/step_lists.json" \
      --table "$LOGS/step_lists.txt" ${STEPLISTS_ARGS:-} ;;
    lists) step lists 180 $KTEST BURSTCU_KERNEL_TEST_ARCH=${LISTS_ARCH:-sm_90} $PYTEST120 $FWD $INERT ;;
    packed) step packed 180 $KTEST $PYTEST120 tests/kernels/test_packed_lists_emulated.py ;;
    bwd) step bwd 180 $KTEST $PYTEST120 $BWD ;;
    steplists_mmalist) step steplists_mmalist 300 $STEPLISTS --mma-list \
      --json "$OUT/step_lists_mmalist.json" --table "$LOGS/step_lists_mmalist.txt" ${STEPLISTS_ARGS:-} ;;
    steplists_mma) step steplists_mma 300 $STEPLISTS --arch sm_90 \
      --json "$OUT/step_lists_mma.json" --table "$LOGS/step_lists_mma.txt" ${STEPLISTS_ARGS:-} ;;
    hopper_profile) step hopper_profile 240 bash -c "$NCU --set full \
      -k regex:flash_fwd_step_sm90 -c 8 -f -o $PROFILE $KSPEED --archs sm_90a --passes fwd --impls kernels \
      --dtypes float16 --headdims 128 --seqlens ${PROFILE_SEQLEN:-16384} $PROFILED \
      && $DETAILS > $LOGS/sm90_profile_details.csv" ;;
    hopper_ring) step hopper_ring 180 $PYTEST120 tests/gpu/test_hopper_ring_gpu.py ;;
    hopper_bwd_profile) step hopper_bwd_profile 180 bash -c "$NCU --set full \
      -k regex:flash_bwd_dkdv_sm90 -c 3 -f -o $PROFILE-bwd $KSPEED --archs sm_90a \
      --passes fwd+bwd --impls kernels --dtypes float16 --headdims 128 --seqlens ${PROFILE_SEQLEN:-16384} \
      $PROFILED && ncu -i $PROFILE-bwd.ncu-rep --page details --csv > $LOGS/sm90_bwd_profile_details.csv" ;;
    bwd_small_parts) step bwd_small_parts 120 $NCU --metrics gpu__time_duration.sum \
      --csv --print-units base --log-file "$LOGS/bwd_small_parts.csv" $KSPEED --archs sm_90a \
      --passes fwd+bwd --impls kernels torch-flash torch-cudnn --dtypes float16 --headdims 128 \
      --seqlens 4096 16384 $PROFILED --repeats 2 ;;
    small_parts) step small_parts 180 $NCU --metrics gpu__time_duration.sum --csv \
      --print-units base --log-file "$LOGS/small_parts.csv" $KSPEED --archs sm_90a --passes fwd \
      --impls kernels torch-flash torch-cudnn --dtypes float16 --headdims 128 --seqlens 1024 2048 4096 16384 \
      $PROFILED --repeats 2 ;;
    host_profile) step host_profile 120 bash -c "$PY -m cProfile -o /tmp/burstcu-host.prof \
      bench/gpu/kernel_speed.py --archs sm_90a --passes fwd --impls kernels --dtypes float16 \
      --headdims 128 --seqlens 1024 16384 --repeats 100 && $PY -c 'import pstats, sys
s = pstats.Stats(\"/tmp/burstcu-host.prof\", stream=sys.stdout)
s.sort_stats(\"tottime\").print_stats(40)
s.sort_stats(\"cumulative\").print_stats(\"burstcu|cupy\", 60)' > $LOGS/host_profile.txt" ;;
    whole_pass) step whole_pass 150 $KSPEED --archs sm_90a sm_90 --passes fwd \
      --impls kernels step torch-flash \
      torch-cudnn --headdims 64 128 --seqlens 1024 2048 4096 16384 --rounds 2 --json "$LOGS/whole_pass.json" \
      --table "$LOGS/whole_pass.txt" ;;
    head_groups) step head_groups 240 $KSPEED --archs sm_90a --passes fwd --impls kernels torch-flash \
      --headdims 128 --seqlens 2048 4096 8192 16384 --sm90-head-group 0 2 8 16 --rounds 2 \
      --json "$LOGS/head_groups.json" --table "$LOGS/head_groups.txt" ;;
    kbench) step kbench 420 $KSPEED --json "$OUT/kernels.json" --table "$LOGS/kernels.txt" \
      $(plot "$OUT/kernels.png") ${KBENCH_ARGS:-} ;;
    overlap) step overlap 300 $OVERLAP --json "$OUT/overlap_gpu.json" $(plot "$OUT/overlap_gpu.png") \
      ${OVERLAP_ARGS:-} ;;
    tiles) step tiles 240 $PY bench/gpu/tiles.py --candidates bench/results/h100/tile_candidates.json \
      --json "$OUT/tiles.json" --table "$LOGS/tiles.txt" ;;
    tiles_sm90) step tiles_sm90 300 $PY bench/gpu/tiles.py --tile-table sm_90a --dtypes float16 bfloat16 \
      --candidates bench/results/h200/tile_candidates_sm90a.json --json "$OUT/tiles_sm90.json" \
      --table "$LOGS/tiles_sm90.txt" ;;
    overlap_causal) step overlap_causal 300 $OVERLAP --causal --layout zigzag \
      --json "$OUT/overlap_gpu_causal.json" $(plot "$LOGS/overlap_gpu_causal.png") ${OVERLAP_ARGS:-} ;;
    memcheck) step memcheck 300 $KTEST BURSTCU_CUPY_NO_POOL=1 $MEMCHECK $PYTEST $FWD $BWD $INERT \
      -k "ragged or causal_offsets or gqa or masked_rows or small_ or window or poisoned or flag" ;;
    racecheck) step racecheck 240 $KTEST $RACECHECK $PYTEST $FWD $BWD \
      -k "test_ragged or (full_ragged and float16 and 64)" ;;
    demo) step demo 120 $PY -m burstcu.demo --causal ;;
    mpi) step mpi 240 bash bench/gpu/mpi_checks.sh ;;
    linear) step linear 240 env XLA_PYTHON_CLIENT_PREALLOCATE=false $PYTEST120 tests/gpu/test_linear_gpu.py ;;
    linearbench) step linearbench 300 bash -c "$PY bench/cpu/linear.py --backend cupy --dtype float16 \
      --strategies lasp2 lasp1 --seqlens 16384 65536 262144 1048576 --json $OUT/linear_gpu.json \
      --table $LOGS/linear_gpu.txt && $PY bench/cpu/linear.py --backend cupy --dtype float16 \
      --strategies burst --seqlens 16384 65536 --json $OUT/linear_gpu_burst.json \
      --table $LOGS/linear_gpu_burst.txt" ;;
    varlen) step varlen 420 bash -c "for layout in zigzag contiguous; do $OVERLAP --ranks 4 --seqlen 65536 \
      --causal --docs 0 --layout \$layout --strategies burst ring --repeats 3 \
      --json $LOGS/varlen_\${layout}_gpu.json || exit 1; done" ;;
    uneven) step uneven 300 $OVERLAP --ranks 3 --seqlen 98305 --causal --layout contiguous \
      --strategies burst ring --repeats 3 --json "$LOGS/uneven_gpu.json" ;;
    decode) step decode 240 bash -c "rc=0   # every run, whatever an earlier one did
      $DECODE --cache 4096 65536 262144 1048576 --json $LOGS/decode_gpu.json \
        --table $LOGS/decode_gpu.txt || rc=1
      $DECODE --batch 16 --cache 4096 65536 --json $LOGS/decode_gpu_b16.json \
        --table $LOGS/decode_gpu_b16.txt || rc=1
      $DECODE --paged 16 --cache 65536 1048576 --json $LOGS/decode_gpu_paged.json \
        --table $LOGS/decode_gpu_paged.txt || rc=1
      $DECODE --tokens 8 --cache 65536 1048576 --json $LOGS/decode_gpu_t8.json \
        --table $LOGS/decode_gpu_t8.txt || rc=1
      $DECODE --mma-min-rows 16 --cache 4096 65536 1048576 --json $LOGS/decode_gpu_cudacore.json \
        --table $LOGS/decode_gpu_cudacore.txt || rc=1
      $DECODE --warm-l2 --cache 4096 65536 --json $LOGS/decode_gpu_warm_l2.json \
        --table $LOGS/decode_gpu_warm_l2.txt || rc=1
      exit \$rc" ;;
    decode_tests) step decode_tests 180 $KTEST $PYTEST120 tests/kernels/test_decode_emulated.py ;;
    gputests) step gputests 180 env XLA_PYTHON_CLIENT_PREALLOCATE=false $PYTEST120 tests/gpu \
      tests/test_interop.py tests/transport/test_bootstrap.py tests/kernels/test_device_properties.py \
      tests/test_device_routing.py tests/test_group.py tests/kernels/test_kernel_cache.py ;;
    *) echo "unknown step $s"; failed+=("$s") ;;
  esac
done

[ $DRY_RUN = 1 ] && { [ ${#failed[@]} -eq 0 ]; exit; }
[ ${#skipped[@]} -gt 0 ] && echo "SKIPPED steps (DEADLINE): ${skipped[*]}" | tee -a "$LOGS/summary.txt"
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED steps: ${failed[*]}" | tee -a "$LOGS/summary.txt"
fi
[ ${#failed[@]} -eq 0 ] && [ ${#skipped[@]} -eq 0 ] && echo "every step passed" | tee -a "$LOGS/summary.txt"
pack
[ ${#failed[@]} -eq 0 ] && [ ${#skipped[@]} -eq 0 ]
