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


def mpiexec() -> str:
    """The venv's mpiexec (the mpich wheel's), else one on PATH."""
    candidate = Path(sys.executable).parent / "mpiexec"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec: install the 'mpi' extra")
    return found


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
    output = proc.stdout + proc.stderr
    if expect_fail:
        assert proc.returncode != 0, f"{body} should have failed:\n{output}"
        return output
    assert proc.returncode == 0, f"mpiexec -n {nprocs} {body} failed ({proc.returncode}):\n{output}"
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("BURSTCU-RESULT "):
            _, rank, payload = line.split(" ", 2)
            results[int(rank)] = json.loads(payload)
    assert sorted(results) == list(range(nprocs)), f"missing ranks in {sorted(results)}:\n{output}"
    return [results[r] for r in range(nprocs)]
