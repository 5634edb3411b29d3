"""The README's main job (burstcu.demo) runs under mpiexec and reports small errors and the
formula's byte counts on every rank; the times it reports are of a warmed-up pass."""

import os
import subprocess
import sys

import pytest

import burstcu
from burstcu import demo
from tests.mpi_run import ROOT, mpiexec


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 3])
def test_demo_reports_every_rank(world):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", str(world), sys.executable, "-m", "burstcu.demo", "--seqlen", "384",
           "--heads", "4", "--kv-heads", "2", "--headdim", "32", "--causal", "--backend", "numpy"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[:1] == ["rank"])
    rows = [l.split() for l in lines[header + 1:header + 1 + world]]
    assert [int(r[0]) for r in rows] == list(range(world))
    formula = [l for l in lines if l.startswith("formula per rank")][0]
    fwd_formula = [int(x.replace(",", "")) for x in formula.split("= ")[1].split(" bytes")[0].split(" / ")]
    assert len(fwd_formula) == world
    bwd_formula = [int(x.replace(",", "")) for x in
                   formula.split("dqs*|dQ fp32| = ")[1].split(" bytes")[0].split(" / ")]
    for r in rows:
        errors = [float(x) for x in r[1:5]]
        assert max(errors) < 1e-4, r           # float32 against float64
        assert int(r[7].replace(",", "")) == fwd_formula[int(r[0])]
        assert int(r[9].replace(",", "")) == bwd_formula[int(r[0])]
    assert "checking against a float64 reference" in proc.stderr   # not silent meanwhile


@pytest.mark.mpi
@pytest.mark.emulated
def test_demo_on_the_kernel_backend():
    """The same job on the CUDA kernels (CPU emulator): float16 by default, errors of fp16."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "burstcu.demo", "--seqlen", "128",
           "--heads", "2", "--headdim", "32", "--causal", "--backend", "emulated"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "float16" in proc.stdout
    lines = proc.stdout.splitlines()
    header = next(i for i, l in enumerate(lines) if l.split()[:1] == ["rank"])
    for row in (l.split() for l in lines[header + 1:header + 3]):
        assert max(float(x) for x in row[1:5]) < 1e-2, row


def test_demo_warms_up_before_timing(monkeypatch, capsys, count_calls):
    """One untimed pass (forward and backward) before the timed one, said so in the output."""
    monkeypatch.setattr(burstcu.group, "world_comm", lambda comm=None: None)  # one process, no MPI
    forward = count_calls(demo.burstcu, "attention")
    backward = count_calls(demo.burstcu, "attention_backward")
    assert demo.main(["--seqlen", "32", "--heads", "2", "--headdim", "8", "--backend", "numpy"]) == 0
    assert (len(forward), len(backward)) == (2, 2)
    out = capsys.readouterr().out
    assert "untimed warm-up" in out
    header = out.splitlines().index(next(l for l in out.splitlines() if l.split()[:1] == ["rank"]))
    row = out.splitlines()[header + 1].split()
    assert max(float(x) for x in row[1:5]) < 1e-4
