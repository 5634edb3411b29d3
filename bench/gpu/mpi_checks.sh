#!/usr/bin/env bash
# The MPI launch path on a machine with one GPU and no system MPI, from the carried mpich wheel
# (.whl/mpich-*.whl, unpacked into /tmp/mpich: `pip install --target` places no data files):
# `mpiexec -n 1` demo over NCCL must pass; `mpiexec -n 2` on one GPU must fail on both ranks with
# the bootstrap's message, within the time limit (no hang).
# --dry-run: print the two checks, run nothing.
set -u
PY=${PY:-python3}
if [ "${1:-}" = "--dry-run" ]; then
  echo "timeout 180 mpiexec -n 1 $PY -m burstcu.demo --causal   # must pass over NCCL"
  echo "timeout 60 mpiexec -n 2 $PY -m burstcu.demo --backend cupy   # one GPU: must fail on both ranks"
  exit 0
fi
wheel=$(ls "$PWD"/.whl/mpich-*.whl 2>/dev/null | head -1)
if [ -z "$wheel" ]; then echo "mpi_checks.sh: no .whl/mpich-*.whl here (the carried mpich wheel)"; exit 1; fi
rm -rf /tmp/mpich && mkdir -p /tmp/mpich || exit 1
(cd /tmp/mpich && $PY -m zipfile -e "$wheel" .) || exit 1
bin=$(dirname "$(find /tmp/mpich -name mpiexec.hydra | head -1)")  # the wheel's data/bin
lib=$(dirname "$(find /tmp/mpich -name 'libmpi.so.12' | head -1)")
chmod +x "$bin"/*
export PATH=$bin:$PATH LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MPI4PY_LIBMPI=$lib/libmpi.so.12 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "mpiexec: $(command -v mpiexec)"
$PY -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
status=0
echo "--- mpiexec -n 1 demo (auto backend): must run the kernels over NCCL and pass its checks"
out=$(timeout 180 mpiexec -n 1 $PY -m burstcu.demo --causal 2>&1); rc=$?; echo "$out"
if [ $rc -ne 0 ] || ! grep -q "backend cupy" <<<"$out"; then echo "FAIL: exit $rc"; status=1; fi
echo "--- mpiexec -n 2 demo, cupy backend, one GPU: must fail on both ranks, with the reason"
out=$(timeout 60 mpiexec -n 2 $PY -m burstcu.demo --backend cupy 2>&1); rc=$?; echo "$out"
reasons=$(grep -c "only 1 GPU(s)" <<<"$out")
if [ $rc -eq 0 ] || [ $rc -eq 124 ] || [ "$reasons" -lt 2 ]; then
  echo "FAIL: exit $rc (124 = hung), reason printed by $reasons rank(s)"; status=1
fi
exit $status
