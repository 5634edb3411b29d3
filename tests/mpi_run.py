"""Start a test body under a real `mpiexec -n N` and collect every rank's result."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "mpi" / "runner.py"


def _tool(name: str, extra: str) -> str:
    """The venv's `name` (beside this Python), else one on PATH; skip the test without one."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"no {name}: install the '{extra}' extra")
    return found


# whether the running test carries the `mpi` marker (tests/conftest.py sets it; None outside a test)
MARKED: bool | None = None


def _marked(launcher: str) -> None:
    """Fail the running test where it starts `launcher` without the `mpi` marker."""
    if MARKED is False:
        pytest.fail(f"this test starts {launcher} but carries no `mpi` marker (pyproject's "
                    f"markers): mark it @pytest.mark.mpi, so that -m 'not mpi' leaves it out")


def mpiexec() -> str:
    """$BURSTCU_TEST_MPIEXEC where set (another MPI's launcher: docs/testing.md), else the venv's
    mpiexec (the mpich wheel's), else one on PATH. Only a test marked `mpi` may ask."""
    _marked("mpiexec")
    return os.environ.get("BURSTCU_TEST_MPIEXEC") or _tool("mpiexec", "mpi")


def burstcu_run_mpiexec() -> list[str]:
    """`--mpiexec $BURSTCU_TEST_MPIEXEC` for launch/burstcu-run where that is set (it would take
    the venv's mpiexec), else nothing. Only a test marked `mpi` may ask (burstcu-run starts
    mpiexec)."""
    _marked("launch/burstcu-run")
    other = os.environ.get("BURSTCU_TEST_MPIEXEC")
    return ["--mpiexec", other] if other else []


def run_mpi(nprocs: int, body: str, timeout: float = 240, expect_fail: bool = False, **kwargs):
    """Run `body` (a function of tests/mpi/bodies.py, or "module:function" for another module of
    tests/mpi/) on `nprocs` ranks with `kwargs`; return the list of per-rank results.

    Fails the test if the run times out, exits non-zero, or a rank reports nothing.
    With expect_fail, returns the combined output of a run that must exit non-zero.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [mpiexec(), "-n", str(nprocs), sys.executable, str(RUNNER), body, json.dumps(kwargs)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpiexec -n {nprocs} {body} hung for {timeout}s:\n{exc.stdout}\n{exc.stderr}")
    return _results(proc, nprocs, f"mpiexec -n {nprocs} {body}", expect_fail)


def torchrun() -> str:
    """The venv's torchrun (the torch extra's), else one on PATH. Only a test marked `mpi` may
    ask (it starts processes of several ranks, as mpiexec does)."""
    _marked("torchrun")
    return _tool("torchrun", "torch")


def run_torchrun(nprocs: int, body: str, timeout: float = 240, expect_fail: bool = False,
                 **kwargs):
    """Run `body` ("module:function" of tests/mpi/) on `nprocs` processes started by
    `torchrun --standalone --nproc_per_node nprocs`, each joined to torch.distributed over gloo
    (tests/mpi/torchrun_runner.py); the per-rank results, or with expect_fail the combined
    output of a run that must exit non-zero (as `run_mpi`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [torchrun(), "--standalone", "--nproc_per_node", str(nprocs),
           str(ROOT / "tests" / "mpi" / "torchrun_runner.py"), body, json.dumps(kwargs)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun --nproc_per_node {nprocs} {body} hung for {timeout}s:\n"
                    f"{exc.stdout}\n{exc.stderr}")
    return _results(proc, nprocs, f"torchrun --nproc_per_node {nprocs} {body}", expect_fail)


def _results(proc, nprocs: int, what: str, expect_fail: bool):
    """Every rank's BURSTCU-RESULT from a finished run (or its output, with expect_fail)."""
    output = proc.stdout + proc.stderr
    if expect_fail:
        assert proc.returncode != 0, f"{what} should have failed:\n{output}"
        return output
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{output}"
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("BURSTCU-RESULT "):
            _, rank, payload = line.split(" ", 2)
            results[int(rank)] = json.loads(payload)
    assert sorted(results) == list(range(nprocs)), f"missing ranks in {sorted(results)}:\n{output}"
    return [results[r] for r in range(nprocs)]
