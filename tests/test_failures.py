"""Nothing hangs: failures on one rank end the whole job quickly, with a message naming the
failing or missing rank, under a real `mpiexec -n 3` (each run under a time limit). The programs
are tests/mpi/faults.py, started as users start them: through launch/rank-guard and
`python -m mpi4py` (which aborts the world on an uncaught exception). Also: waiting does not
spin, ranks inside different calls fail together, resident memory stays flat over 1000 calls,
and 10,000 init/close cycles leak no communicator."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpi_run import mpiexec, run_mpi

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 4  # burstcu.init(timeout=...) in the programs: seconds a rank waits for a peer


def run_faulty(scenario: str, ranks: int = 3, limit: float = 60) -> tuple[int, str, float]:
    """(exit status, combined output, seconds) of tests/mpi/faults.py SCENARIO on `ranks`."""
    cmd = [mpiexec(), "-n", str(ranks), str(ROOT / "launch" / "rank-guard"), sys.executable, "-m",
           "mpi4py", str(ROOT / "tests" / "mpi" / "faults.py"), scenario, str(TIMEOUT)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{scenario} hung for {limit} s:\n{exc.stdout}\n{exc.stderr}")
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


@pytest.mark.parametrize("scenario,names", [
    # an exception in user code before the call: mpi4py aborts the world; the traceback names
    # the rank (MPICH's own abort line, "... - process 1", is not always flushed before the
    # launcher tears the job down on a loaded machine, so it is not required)
    ("raise_before_call", ["RuntimeError: user code failed on rank 1"]),
    # an exception inside a ring step: burstcu names the rank, call, step and cause, then aborts
    ("raise_in_step", ["burstcu: rank 1 failed in attention forward at 'fwd 1 compute': "
                       "MemoryError: simulated: out of memory"]),
    # a rank that exits early, or sleeps past the timeout: rank 0 names the missing rank
    ("exit_early", [f"rank 0 waited {TIMEOUT} s for rank(s) [1] to reach the agreement round"]),
    ("sleep_past_timeout", [f"rank 0 waited {TIMEOUT} s for rank(s) [1]", "CommTimeoutError"]),
    # Ctrl-C (any exception) while the inputs are agreed on: the others are in the agreement
    ("interrupt_in_agreement", ["burstcu: rank 1 failed in attention forward at 'agreement on the "
                                "inputs': KeyboardInterrupt"]),
    # a late rank at a barrier, and a rank that never calls init
    ("barrier_late", [f"rank 0 failed in barrier at 'agreement on the inputs': CommTimeoutError: "
                      f"rank 0 waited {TIMEOUT} s for rank(s) [1]"]),
    ("exit_before_init", [f"waited {TIMEOUT} s for every rank of the communicator to call "
                          f"burstcu.init"]),
    # a rank killed mid-ring: rank-guard names it before mpiexec ends the others
    ("sigkill_mid_ring", ["burstcu: rank 1 on ", "died of signal 9"]),
])
def test_a_failure_on_one_rank_ends_the_job(scenario, names):
    status, out, seconds = run_faulty(scenario)
    assert status != 0, out
    assert seconds < 30, f"{scenario} took {seconds:.0f} s to end:\n{out}"
    for text in names:
        assert text in out, f"{text!r} missing from:\n{out}"
    assert "finished" not in out  # no rank went on as if nothing happened


def test_ranks_inside_different_calls_fail_together():
    status, out, _ = run_faulty("mismatched_calls")
    assert status == 0, out
    for rank in range(3):
        assert f"rank {rank} caught: ranks are inside different burstcu calls (rank 0: attention, " \
               f"rank 1: barrier, rank 2: attention)" in out


def test_waiting_for_a_late_peer_does_not_spin():
    """Rank 1 arrives 3 s late: the others wait those 3 s using well under 1 s of CPU (the
    progress thread included: process CPU time)."""
    status, out, _ = run_faulty("slow_peer_cpu")
    assert status == 0, out
    for rank in (0, 2):
        found = re.search(rf"rank {rank} waited ([\d.]+) s using ([\d.]+) s of CPU", out)
        assert found, out
        wall, cpu = float(found.group(1)), float(found.group(2))
        assert wall > 2.5 and cpu < 1.0, found.group(0)


def test_timeout_is_validated_and_reported():
    import burstcu
    with pytest.raises(ValueError, match="positive number of seconds"):
        burstcu.init(backend="numpy", timeout=0)
    with burstcu.init(backend="numpy", timeout=7.5) as group:
        assert group.timeout == 7.5
    os.environ["BURSTCU_TIMEOUT"] = "12"
    try:
        assert burstcu.init(backend="numpy").timeout == 12.0
    finally:
        del os.environ["BURSTCU_TIMEOUT"]


@pytest.mark.parametrize("nprocs", [2])
def test_resident_memory_is_flat_over_1000_calls(nprocs):
    results = run_mpi(nprocs, "resource_bodies:soak", timeout=240)
    assert len(results) == nprocs


@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_training_loop_runs_and_repeats_its_bits(nprocs):
    """Forward+backward steps with 16 MiB arrays a rank, then a mix of shapes, on every rank
    (tests/mpi/resource_bodies.py: training_loop)."""
    results = run_mpi(nprocs, "resource_bodies:training_loop", timeout=240)
    assert [r["calls"] for r in results] == [13] * nprocs


def test_10000_init_close_cycles_leak_no_communicator():
    results = run_mpi(2, "resource_bodies:init_close_cycles", timeout=240)
    assert [r["cycles"] for r in results] == [10000, 10000]


def test_close_stops_worker_threads_and_a_closed_group_says_so():
    import threading

    import numpy as np

    import burstcu
    before = threading.active_count()
    for _ in range(20):
        with burstcu.init(backend="numpy", threads=4) as group:
            q = np.ones((2, 8, 4, 8))
            burstcu.attention(q, q, q, group)
    assert threading.active_count() <= before + 1
    with pytest.raises(ValueError, match="this group is closed"):
        burstcu.attention(q, q, q, group)
    with pytest.raises(ValueError, match="this group is closed"):
        group.barrier()
    group.close()  # again: nothing happens
