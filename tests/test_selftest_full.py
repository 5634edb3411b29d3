"""`python -m burstcu.selftest --full` on a machine without a GPU: every check runs through the
kernel emulator at toy sizes (what a GPU run does at full size), the JSON report carries device,
versions and one record per check, and nothing fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from burstcu.transport.bootstrap import gpu_usable

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.emulated,
              pytest.mark.skipif(gpu_usable(), reason="on a GPU --full runs at full size")]


def test_full_selftest_on_the_emulator(tmp_path):
    report = tmp_path / "full.json"
    proc = subprocess.run([sys.executable, "-m", "burstcu.selftest", "--full", "--json", str(report)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["device"].startswith("CPU") and data["backend"] == "emulated" and data["quick"]
    assert {"cupy", "nccl", "nvrtc", "driver", "numpy"} <= set(data["versions"])
    names = {c["name"].split("/")[0] for c in data["checks"]}
    assert names == {"variants", "kernels", "ring_steps", "nccl", "determinism", "memory", "loopback"}
    assert all(set(c) >= {"name", "passed", "detail"} for c in data["checks"])
    assert not [c for c in data["checks"] if c["passed"] is False]
    skipped = {c["name"] for c in data["checks"] if c["passed"] is None}
    assert skipped == {"nccl", "memory/pool_growth"}  # a GPU is needed for those alone
    assert {"ring_steps/G3/contiguous/full", "loopback/G3/contiguous/full",
            "kernels/float16/d80/causal/deterministic"} <= {c["name"] for c in data["checks"]}
    assert "PASSED" in proc.stdout


def test_a_full_run_where_every_check_was_skipped_checked_nothing():
    """`--full --only nccl` without a GPU said "0 passed, 0 failed, 1 skipped ... PASSED" and
    exited 0: it says NOTHING CHECKED and exits 2, as burstcu.build does with nothing to check."""
    proc = subprocess.run([sys.executable, "-m", "burstcu.selftest", "--full", "--only", "nccl"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "0 passed, 0 failed, 1 skipped" in proc.stdout and "NOTHING CHECKED" in proc.stdout
    assert "PASSED" not in proc.stdout


@pytest.mark.mpi
def test_full_selftest_refuses_several_mpi_ranks():
    from tests.mpi_run import mpiexec
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "burstcu.selftest", "--full"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "without mpiexec" in proc.stdout


def test_a_failing_check_is_reported_not_raised(monkeypatch):
    from burstcu.testing import checks

    def broken(backend, quick):
        raise RuntimeError("kernel launch failed")

    monkeypatch.setitem(checks.CHECKS, "kernels", broken)
    records = checks.run_all("emulated", True, only=["kernels", "nccl"])
    assert records[0] == {**records[0], "name": "kernels", "passed": False,
                          "detail": "RuntimeError: kernel launch failed"}
    assert records[1]["passed"] is None


@pytest.mark.mpi
def test_ranks_agree_on_the_gpu_backend():
    """The plain selftest under mpiexec -n 2, where only rank 1 believes it has a GPU: both
    ranks run the CPU checks only (none enters the GPU path alone), and the job ends."""
    from tests.mpi_run import mpiexec
    script = ("from mpi4py import MPI; import burstcu.selftest as s; "
              "s.gpu_usable = lambda: MPI.COMM_WORLD.Get_rank() == 1; "
              "raise SystemExit(s.main(['--quick']))")
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", script], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ran the CPU checks only" in proc.stdout and "cupy" not in proc.stdout


@pytest.mark.parametrize("cc,failing", [(80, {"sm_80"}), (86, {"sm_86"}), (89, set()),
                                        (90, {"sm_90", "sm_90a"}), (100, set()), (120, set())])
def test_local_memory_fails_the_devices_own_tables_only(monkeypatch, cc, failing):
    """`check_variants` on a GPU of compute capability `cc` (mocked: no kernel is built): a kernel
    with local memory fails the tables sized on the device's arch (sm_XY for its cc; sm_90a too
    on 9.0) and is only listed in the others, which compile for an arch they were not sized on,
    the one a cc 8.9, 10.0 or 12.0 device runs by default among them (sm_86's, sm_90's); careful
    twins may use local memory anywhere."""
    import burstcu.build as build
    import burstcu.build.compile as compile_module
    import burstcu.ops.cuda as cuda_ops
    from burstcu.build.variants import CAREFUL_SUFFIX, LaunchConfig
    from burstcu.testing import checks

    class Variant:
        def __init__(self, name, family):
            self.name, self.family, self.headdim = name, family, 64
            self.launch = LaunchConfig(threads=128, block_m=64, block_n=64, smem_bytes=0, stages=2)

    class Ops:
        smem_limit = None

        def __init__(self, backend, arch):
            pass

        def function(self, name):
            return type("Fn", (), {"num_regs": 128, "local_size_bytes": 8 if "spills" in name else 0,
                                   "shared_size_bytes": 0})()

    monkeypatch.setattr(checks, "on_gpu", lambda backend: True)
    monkeypatch.setattr(compile_module, "compute_capability", lambda: cc)
    monkeypatch.setattr(cuda_ops, "KernelOps", Ops)
    monkeypatch.setattr(checks, "_compile_in_parallel", lambda variants: None)
    monkeypatch.setattr(build, "all_variants", lambda arch: [
        Variant(f"plain_{arch}", "forward"), Variant(f"spills_{arch}", "forward_list"),
        Variant(f"spills_careful_{arch}", "forward" + CAREFUL_SUFFIX)])
    records = {r["name"].split("/")[1]: r for r in checks.check_variants("cupy", quick=False)}
    assert ("sm_90a" in records) == (cc == 90)       # sm_90a code runs on cc 9.0 only
    for arch, r in records.items():
        assert r["detail"]["local_memory"] == [f"spills_{arch}"], r["detail"]
        assert bool(r["passed"]) is (arch not in failing), (arch, r["passed"])
        assert r["detail"]["own_arch"] is (arch in failing)
