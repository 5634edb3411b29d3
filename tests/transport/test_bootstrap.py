"""Starting a rank (`burstcu.transport.bootstrap`) without a GPU: the GPU a rank picks, device
properties read for the given device without making another one current, the device made
current once right before the NCCL init, GPUs older than sm_80 reported before the agreement;
under mpiexec, the NCCL unique-id broadcast, the node-local split and a problem on any rank
raised on every rank; and processes a launcher started as several ranks that MPI does not join
(no MPI library, no mpi4py, torchrun, another MPI's launcher) refused instead of each running the
whole problem alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from burstcu.transport import bootstrap
from tests.fake_cupy import FakeCupy
from tests.mpi_run import ROOT, run_mpi
from tests.mpi_run import torchrun as torchrun_path

# the world-size variables of the launchers, removed so that a test sets the ones it means
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_ID",
                 "SLURM_STEP_NUM_TASKS")


# ---- the GPU a rank picks ---------------------------------------------------------------------
@pytest.mark.parametrize("local_rank,local_size,n,expected",
                         [(0, 1, 1, 0), (3, 4, 4, 3), (1, 2, 8, 1), (2, 3, 1, None)])
def test_select_device(local_rank, local_size, n, expected):
    if expected is None:
        with pytest.raises(ValueError, match="3 ranks on this node but only 1 GPU"):
            bootstrap.select_device(local_rank, local_size, n)
    else:
        assert bootstrap.select_device(local_rank, local_size, n) == expected


def test_select_device_errors_and_binding():
    with pytest.raises(ValueError, match="no usable CUDA GPU"):
        bootstrap.select_device(0, 1, 0)
    with pytest.raises(ValueError, match="outside"):
        bootstrap.select_device(2, 2, 4)
    # the launcher gave each rank its own CUDA_VISIBLE_DEVICES: device 0 is ours
    assert bootstrap.select_device(5, 8, 1, bound=True) == 0


# ---- device properties and the device switch, in one process -----------------------------------
def test_arch_check_reads_the_given_device_without_switching(monkeypatch):
    fake = FakeCupy(cc=(7, 5)).install(monkeypatch)
    assert "compute capability 7.5" in bootstrap._arch_problem(3)
    assert fake.calls == [("attr", 75, 3), ("attr", 76, 3)]


def test_bootstrap_selects_the_device_once_after_reading_it(monkeypatch):
    """A rank whose GPU is 2 reads GPU 2's properties, then makes GPU 2 current (once) right
    before the NCCL init: no context is ever created on another GPU."""
    fake = FakeCupy(cc=(9, 0), n_devices=4).install(monkeypatch)
    monkeypatch.delenv(bootstrap.BOUND_ENV, raising=False)
    monkeypatch.setattr(bootstrap, "_local_rank", lambda comm: (2, 4))
    transport, device_id = bootstrap.bootstrap(None)
    assert device_id == 2 and transport.size == 1
    first_switch = fake.calls.index(("use", 2))
    assert ("attr", 75, 2) in fake.calls[:first_switch]
    assert fake.switches() == [("use", 2)]
    assert fake.calls[first_switch + 1] == ("NcclCommunicator",)
    assert {c[1] for c in fake.calls if c[0] == "Device"} == {2}


def test_a_gpus_place_is_its_host_and_pci_bus_read_without_switching(monkeypatch):
    fake = FakeCupy(n_devices=4).install(monkeypatch)
    monkeypatch.setattr(bootstrap, "host_identity", lambda: "node7 boot 1a2b3c4d")
    assert bootstrap.gpu_place(2) == "node7 boot 1a2b3c4d, PCI bus 0000:1d:00.0"
    assert fake.calls == [("pci", 2)] and fake.switches() == []


def test_a_host_is_told_apart_as_nccl_does(monkeypatch):
    """Machines sharing a host name (containers given one --hostname, cloned machines) differ by
    their boot id, which NCCL hashes with the name: the shared-GPU check keys on both (it refused
    a job over two such machines); NCCL_HOSTID, where set, replaces them, as for NCCL."""
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    monkeypatch.setattr(bootstrap.socket, "gethostname", lambda: "localhost")
    here = bootstrap.host_identity()
    if os.path.exists("/proc/sys/kernel/random/boot_id"):
        with open("/proc/sys/kernel/random/boot_id") as f:
            assert here == f"localhost boot {f.read().strip()[:8]}"
    monkeypatch.setenv("NCCL_HOSTID", "rack3-node7")
    assert bootstrap.host_identity() == "rack3-node7"


def test_a_gpu_whose_place_cannot_be_read_is_not_checked(monkeypatch):
    fake = FakeCupy().install(monkeypatch)
    del fake.module.cuda.runtime.deviceGetPCIBusId
    assert bootstrap.gpu_place(0) is None


@pytest.mark.parametrize("places, shared", [
    (["a, PCI bus 1", "a, PCI bus 2", "b, PCI bus 1"], None),    # one bus id on two hosts
    (["a, PCI bus 1", None, None], None),                        # unknown places are no match
    (["a, PCI bus 1", "a, PCI bus 2", "a, PCI bus 1"], "ranks 0, 2 would share one GPU (a, PCI bus 1)"),
    (["x", "x", "x", "y"], "ranks 0, 1, 2 would share one GPU (x)")])
def test_ranks_at_one_place_would_share_a_gpu(places, shared):
    got = bootstrap.shared_gpu_problem(places)
    assert got is None if shared is None else got.startswith(shared), got


@pytest.mark.parametrize("cc, problem", [("75", "compute capability 7.5"), ("80", None), ("90", None)])
def test_gpus_older_than_sm80_are_a_problem_reported_before_agreement(monkeypatch, cc, problem):
    """A T4/V100 stops the cupy backend on every rank (and 'auto' falls back), not mid-init."""
    cupy = pytest.importorskip("cupy")

    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetAttribute",
                        lambda attr, device_id: {75: int(cc[0]), 76: int(cc[1])}[attr])
    got = bootstrap._arch_problem(0)
    assert (got is None) if problem is None else (problem in got), got


def test_bootstrap_without_gpu_raises_fast(monkeypatch):
    monkeypatch.delenv(bootstrap.BOUND_ENV, raising=False)
    if bootstrap.device_count()[0] > 0:
        pytest.skip("a GPU is present")
    with pytest.raises(bootstrap.BackendUnavailable, match="no usable CUDA GPU|cupy is not importable"):
        bootstrap.bootstrap(None)


# ---- under mpiexec ------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.skipif(bootstrap._nccl_problem() is not None, reason="cupy.cuda.nccl not installed")
@pytest.mark.parametrize("world", [2, 3])
def test_unique_id_broadcast(world):
    results = run_mpi(world, "bootstrap_bodies:unique_id_broadcast", timeout=60)
    assert all(r["len"] == 128 for r in results)
    assert len({r["sha"] for r in results}) == 1, results


@pytest.mark.mpi
def test_node_local_rank():
    results = run_mpi(3, "bootstrap_bodies:node_local_rank", timeout=60)
    assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.mpi
def test_cupy_backend_without_gpu_fails_on_every_rank():
    if bootstrap.device_count()[0] > 0:
        pytest.skip("a GPU is present")
    results = run_mpi(2, "bootstrap_bodies:cupy_backend_fails_everywhere", timeout=60)
    assert all(r["same_everywhere"] for r in results)
    assert all("rank(s) 0, 1" in r["message"] for r in results), results
    assert all(r["seconds"] < 20 for r in results), results


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_problem_raises_on_every_rank(world):
    results = run_mpi(world, "bootstrap_bodies:one_rank_problem_raises_everywhere", timeout=60)
    assert len({r["message"] for r in results}) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_more_ranks_than_gpus_fails_on_every_rank(world):
    results = run_mpi(world, "bootstrap_bodies:too_many_ranks_per_gpu", timeout=60)
    assert len({r["message"] for r in results}) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_two_ranks_bound_to_one_gpu_fail_on_every_rank(world):
    results = run_mpi(world, "bootstrap_bodies:two_ranks_bound_to_one_gpu", timeout=60)
    assert len({r["message"] for r in results}) == 1, results
    assert all(not r["nccl_started"] for r in results), results


@pytest.mark.mpi
def test_one_rank_without_gpu_stops_every_rank():
    results = run_mpi(3, "bootstrap_bodies:last_rank_without_gpu", timeout=60)
    assert len({r["message"] for r in results}) == 1


# ---- launchers whose ranks MPI does not join ------------------------------------------------------
@pytest.mark.parametrize("launched,ok", [({"PMI_SIZE": "2"}, False), ({"PMI_SIZE": "1"}, True),
                                         ({}, True),
                                         ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}, False),
                                         ({"SLURM_STEP_ID": "4294967294",  # the batch step
                                           "SLURM_STEP_NUM_TASKS": "2"}, True)])
def test_no_mpi_library_under_a_launcher_of_several_ranks_is_an_error(launched, ok):
    """mpi4py without an MPI library: one process runs alone with a warning, but a rank that a
    launcher started as one of several refuses (it would otherwise compute the whole problem
    alone, silently duplicated on every rank)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(launched, MPI4PY_LIBMPI="/nonexistent/libmpi.so")
    proc = subprocess.run([sys.executable, "-c", "import burstcu; print(burstcu.init().size)"],
                          capture_output=True, text=True, timeout=60, env=env)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr
        assert "cannot load an MPI library" in proc.stderr  # the warning
    else:
        assert proc.returncode != 0
        var = "PMI_SIZE" if "PMI_SIZE" in launched else "SLURM_STEP_NUM_TASKS"
        assert f"one of 2 ranks ({var}=2)" in proc.stderr and "MPI4PY_LIBMPI" in proc.stderr


@pytest.mark.parametrize("launched,ok", [({"PMI_SIZE": "3"}, False), ({}, True)])
def test_no_mpi4py_under_a_launcher_of_several_ranks_is_an_error(launched, ok, tmp_path):
    """Without mpi4py at all, a rank started as one of several says so (and names the 'mpi'
    extra) instead of running the whole problem alone; one process just runs."""
    blocker = tmp_path / "mpi4py"            # a package that fails to import, first on the path
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('No module named mpi4py')\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(launched, PYTHONPATH=f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", "import burstcu; print(burstcu.init().size)"],
                          capture_output=True, text=True, timeout=60, env=env)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr
    else:
        assert proc.returncode != 0
        assert "one of 3 ranks (PMI_SIZE=3)" in proc.stderr and "mpi4py is not installed" in proc.stderr
        assert "burstcu[mpi]" in proc.stderr


@pytest.mark.mpi
def test_torchrun_processes_are_refused_on_every_process(tmp_path):
    """torchrun --standalone --nproc_per_node 2: MPI does not join its processes (each is a
    world of one), so init raises on both, saying how to launch, instead of two one-rank jobs."""
    torchrun = torchrun_path()
    # torchrun stops the other process as soon as one fails, so each process writes what init
    # raised to its own file and waits (up to 60 s) for the other's before it fails in turn.
    program = tmp_path / "job.py"
    program.write_text(
        "import os, pathlib, time\nimport burstcu\n"
        "here = pathlib.Path(__file__).parent\n"
        "try:\n"
        "    with burstcu.init(backend='numpy') as g:\n"
        "        print('ran as rank', g.rank, 'of', g.size, flush=True)\n"
        "except Exception as e:\n"
        "    (here / f\"said{os.environ['RANK']}.tmp\").write_text(str(e))\n"
        "    os.replace(here / f\"said{os.environ['RANK']}.tmp\", here / f\"said{os.environ['RANK']}\")\n"
        "    end = time.monotonic() + 60\n"
        "    while len(list(here.glob('said[0-9]'))) < 2 and time.monotonic() < end:\n"
        "        time.sleep(0.05)\n"
        "    raise\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([torchrun, "--standalone",
                           "--nproc_per_node", "2", str(program)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ran as rank" not in out, out
    said = "this process is one of 2 ranks (WORLD_SIZE=2) but MPI's world has 1 rank(s): torchrun"
    for rank in (0, 1):
        assert said in (tmp_path / f"said{rank}").read_text(), out
    assert said in out and "mpiexec -n N python -m mpi4py" in out, out
    assert "burstcu.init(comm=torch.distributed.group.WORLD)" in out, out   # or join torch


def test_a_launcher_of_another_mpi_is_refused(tmp_path):
    """Open MPI's mpirun starting processes whose mpi4py loaded MPICH: each is a world of one.
    Simulated by Open MPI's size variable over this MPICH: init says so and what to do."""
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", "import burstcu; burstcu.init(backend='numpy')"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "one of 2 ranks (OMPI_COMM_WORLD_SIZE=2) but MPI's world has 1 rank(s): the " \
           "launcher's MPI is not the one mpi4py loaded" in proc.stderr, proc.stderr
    assert "MPI4PY_LIBMPI" in proc.stderr


_START_THAT_HANGS = """
import os, sys, time
from burstcu.transport import bootstrap
bootstrap.MPI_START_MIN_S = 0.5
with bootstrap._watching_mpi_start({timeout}):
    print("started", flush=True)
    time.sleep({sleep})             # MPI's start, waiting for a rank that never comes
print("went on", flush=True)
"""


@pytest.mark.parametrize("launched, ends", [({"PMI_SIZE": "2", "PMI_RANK": "1"}, True),
                                            ({"PMI_SIZE": "1", "PMI_RANK": "0"}, False),
                                            ({}, False)])
def test_a_start_of_mpi_that_waits_past_the_timeout_ends_the_rank(launched, ends):
    """MPI's start waits, holding the interpreter's lock, for every rank of the launch: a rank
    that ended before starting MPI left the others there for good (BURSTCU_TIMEOUT unheard). A
    watcher process now ends such a rank past its timeout, saying why on stderr, when a launcher
    started it as one of several ranks (else nothing is watched); a start in time goes on."""
    launcher = (*bootstrap._LAUNCHER_SIZE_VARS, "PMI_RANK", "SLURM_STEP_ID", "SLURM_STEP_NUM_TASKS",
                "TORCHELASTIC_RUN_ID", "WORLD_SIZE", "BURSTCU_TIMEOUT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env.update(launched, PYTHONPATH=str(ROOT))
    code = _START_THAT_HANGS.format(timeout=1.0, sleep=6 if ends else 2)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.stdout.startswith("started"), proc
    if ends:
        assert proc.returncode == -15 and "went on" not in proc.stdout, proc
        assert proc.stderr.startswith("burstcu: rank 1 waited 1 s for MPI to start, which waits for "
                                      "every rank of the launch (PMI_SIZE=2): a rank may have ended "
                                      "before starting MPI"), proc.stderr
    else:
        assert proc.returncode == 0 and "went on" in proc.stdout and proc.stderr == "", proc
    quick = subprocess.run([sys.executable, "-c", _START_THAT_HANGS.format(timeout=1.0, sleep=0)],
                           env=env, capture_output=True, text=True, timeout=60)
    assert quick.returncode == 0 and quick.stdout.endswith("went on\n") and quick.stderr == "", quick
