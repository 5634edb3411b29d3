"""CPU checks of fixes found bringing the GPU path up: device properties read without switching
devices, group=None routed by the inputs' DLPack device, per-device agreement, the demo's
warm-up, and the node-local kernel cache."""

import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import burstcu
from burstcu import api
from burstcu.group import Group
from burstcu.ops.numpy.tiled import NumpyOps
from burstcu.testing.reference import attention_ref
from burstcu.validate import InputError

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------------------
# a fake cupy that records every device query and every device switch


class _FakeCupy:
    """Just enough of cupy for the bootstrap, KernelOps' device queries and `_device_problem`.

    `calls` records ("attr", attribute, device), ("Device", id), ("use", id), ("enter", id),
    ("switch", id) (a Device property that switches in real CuPy) and ("NcclCommunicator",).
    """

    def __init__(self, cc=(9, 0), n_devices=4, current=0):
        self.calls: list = []
        calls, values = self.calls, {75: cc[0], 76: cc[1], 97: 232448}

        class Device:
            def __init__(self, device_id=None):
                self.id = current if device_id is None else device_id
                calls.append(("Device", self.id))

            def use(self):
                calls.append(("use", self.id))

            def __enter__(self):
                calls.append(("enter", self.id))
                return self

            def __exit__(self, *exc):
                return False

            @property
            def compute_capability(self):
                calls.append(("switch", self.id))
                return f"{cc[0]}{cc[1]}"

            @property
            def attributes(self):
                calls.append(("switch", self.id))
                return {"MaxSharedMemoryPerBlockOptin": values[97]}

        def device_attribute(attr, device_id):
            calls.append(("attr", attr, device_id))
            return values[attr]

        class Communicator:
            def __init__(self, size, uid, rank):
                calls.append(("NcclCommunicator",))

            def destroy(self):
                pass

        self.module = types.ModuleType("cupy")
        cuda = self.module.cuda = types.ModuleType("cupy.cuda")
        cuda.Device = Device
        cuda.runtime = types.SimpleNamespace(deviceGetAttribute=device_attribute,
                                             getDevice=lambda: current,
                                             getDeviceCount=lambda: n_devices)
        cuda.Stream = lambda **kwargs: object()
        cuda.Event = lambda **kwargs: object()
        cuda.get_current_stream = lambda: object()
        cuda.nccl = types.ModuleType("cupy.cuda.nccl")
        cuda.nccl.get_unique_id = lambda: b"\0" * 128
        cuda.nccl.NcclCommunicator = Communicator

    def install(self, monkeypatch):
        for name, module in (("cupy", self.module), ("cupy.cuda", self.module.cuda),
                             ("cupy.cuda.nccl", self.module.cuda.nccl)):
            monkeypatch.setitem(sys.modules, name, module)
        return self

    def switches(self):
        return [c for c in self.calls if c[0] in ("use", "enter", "switch")]


def test_arch_check_reads_the_given_device_without_switching(monkeypatch):
    from burstcu.transport import bootstrap as nccl

    fake = _FakeCupy(cc=(7, 5)).install(monkeypatch)
    assert "compute capability 7.5" in nccl._arch_problem(3)
    assert fake.calls == [("attr", 75, 3), ("attr", 76, 3)]


def test_compile_and_kernel_ops_read_properties_without_switching(monkeypatch):
    from burstcu.build import compile as kc
    from burstcu.ops.cuda import kernel_ops

    fake = _FakeCupy(cc=(12, 0), current=2).install(monkeypatch)
    assert kc.device_arch(5) == "sm_120"
    assert kc.device_arch() == "sm_120"
    assert kernel_ops._device_table_arch() == "sm_86"
    assert kernel_ops._device_smem_limit() == 232448
    reads = [c for c in fake.calls if c[0] == "attr"]
    assert [c[2] for c in reads] == [5, 5, 2, 2, 2, 2, 2]
    assert fake.switches() == [] and not [c for c in fake.calls if c[0] == "Device"]


def test_bootstrap_selects_the_device_once_after_reading_it(monkeypatch):
    """A rank whose GPU is 2 reads GPU 2's properties, then makes GPU 2 current (once) right
    before the NCCL init: no context is ever created on another GPU."""
    from burstcu.transport import bootstrap as nccl

    fake = _FakeCupy(cc=(9, 0), n_devices=4).install(monkeypatch)
    monkeypatch.delenv(nccl.BOUND_ENV, raising=False)
    monkeypatch.setattr(nccl, "_local_rank", lambda comm: (2, 4))
    transport, device_id = nccl.bootstrap(None)
    assert device_id == 2 and transport.size == 1
    first_switch = fake.calls.index(("use", 2))
    assert ("attr", 75, 2) in fake.calls[:first_switch]
    assert fake.switches() == [("use", 2)]
    assert fake.calls[first_switch + 1] == ("NcclCommunicator",)
    assert {c[1] for c in fake.calls if c[0] == "Device"} == {2}


# ------------------------------------------------------------------------------------------------
# group=None routed by the DLPack device; device agreement on the cupy backend


class _DLTensor:
    """A framework array on the CPU that may claim to live on another device."""

    def __init__(self, data, device=None):
        self._data = np.asarray(data)
        self._device = device

    def __dlpack__(self, **kwargs):
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device or self._data.__dlpack_device__()


_DLTensor.__module__ = "standinfw"


def _qkv(seed=0, shape=(1, 16, 2, 8)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]


def test_cpu_dlpack_arrays_take_the_numpy_path():
    q, k, v = _qkv()
    assert api._group_for(None, _DLTensor(q)).backend == "numpy"
    assert api._group_for(None, _DLTensor(q, device=(1, 0))).backend == "numpy"
    out = burstcu.attention(_DLTensor(q), _DLTensor(k), _DLTensor(v), causal=True)
    assert np.abs(np.from_dlpack(out) - attention_ref(q, k, v, causal=True)[0]).max() < 1e-5


def test_cuda_dlpack_arrays_on_a_cpu_only_machine_get_a_clear_error():
    if burstcu.group.gpu_usable():
        pytest.skip("a GPU is usable here: CUDA arrays run on it")
    q, k, v = (_DLTensor(x, device=(2, 0)) for x in _qkv())
    with pytest.raises(ValueError, match=r"q is on CUDA device 0.*'cupy' backend cannot start"):
        burstcu.attention(q, k, v)


def test_cuda_dlpack_arrays_route_to_the_cupy_group(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(api, "local_group", lambda backend: (backend, sentinel))
    assert api._group_for(None, _DLTensor(np.zeros(1), device=(2, 1))) == ("cupy", sentinel)
    assert api._group_for(None, _DLTensor(np.zeros(1))) == ("numpy", sentinel)


class _TwoRankTransport:
    """Rank 0 of two; the other rank's agreement message is `peer`."""

    size, rank = 2, 0

    def __init__(self, peer):
        self.peer, self.sent = peer, []

    def allgather_object(self, obj, what="metadata"):
        self.sent.append(obj)
        return [obj, self.peer]


def _cupy_group(monkeypatch, peer, current=0):
    _FakeCupy(current=current).install(monkeypatch)
    return Group(0, 2, "cupy", _TwoRankTransport(peer), NumpyOps())


def test_inputs_on_another_gpu_fail_through_the_agreement(monkeypatch):
    group = _cupy_group(monkeypatch, peer=(None, None, None))
    q, k, v = (_DLTensor(x, device=(2, 1)) for x in _qkv())
    with pytest.raises(ValueError, match=r"q is on CUDA device 1 but the current CuPy device is 0"
                                         r".*cupy\.cuda\.Device\(1\)\.use\(\)"):
        burstcu.attention(q, k, v, group)
    (err, meta, length), = group.transport.sent  # raised only after the agreement round
    assert err[0] == "ValueError" and meta is None and length is None
    assert InputError.from_plain(err).kind is ValueError


def test_a_peer_on_another_gpu_stops_this_rank_too(monkeypatch):
    message = "k is on CUDA device 1 but the current CuPy device is 0: call cupy.cuda.Device(1).use()"
    group = _cupy_group(monkeypatch, peer=(InputError(ValueError, message).plain(), None, None))
    with pytest.raises(ValueError, match=r"rank 1: k is on CUDA device 1"):
        burstcu.attention(*_qkv(), group)  # this rank's inputs (host arrays here) are fine
    assert len(group.transport.sent) == 1


def test_inputs_on_the_current_gpu_pass_the_device_check(monkeypatch):
    group = _cupy_group(monkeypatch, peer=(None, None, None), current=1)
    arrays = tuple(_DLTensor(x, device=(2, 1)) for x in _qkv())
    assert api._device_problem(group, ("q", "k", "v"), arrays) is None


# ------------------------------------------------------------------------------------------------
# the demo times a warmed-up pass


def test_demo_warms_up_before_timing(monkeypatch, capsys):
    from burstcu import demo

    counts = {"fwd": 0, "bwd": 0}
    real_fwd, real_bwd = burstcu.attention, burstcu.attention_backward

    def fwd(*args, **kwargs):
        counts["fwd"] += 1
        return real_fwd(*args, **kwargs)

    def bwd(*args, **kwargs):
        counts["bwd"] += 1
        return real_bwd(*args, **kwargs)

    monkeypatch.setattr(burstcu.group, "world_comm", lambda comm=None: None)  # one process, no MPI
    monkeypatch.setattr(demo.burstcu, "attention", fwd)
    monkeypatch.setattr(demo.burstcu, "attention_backward", bwd)
    assert demo.main(["--seqlen", "32", "--heads", "2", "--headdim", "8", "--backend", "numpy"]) == 0
    assert counts == {"fwd": 2, "bwd": 2}
    out = capsys.readouterr().out
    assert "untimed warm-up" in out
    header = out.splitlines().index(next(l for l in out.splitlines() if l.split()[:1] == ["rank"]))
    row = out.splitlines()[header + 1].split()
    assert max(float(x) for x in row[1:5]) < 1e-4


# ------------------------------------------------------------------------------------------------
# the kernel cache is node-local and per user


def test_cache_dir_defaults_to_a_private_folder_under_tmpdir(monkeypatch, tmp_path):
    from burstcu.build import compile as kc
    from burstcu.build import emulate

    monkeypatch.delenv("BURSTCU_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    path = kc.cache_dir()
    assert path == tmp_path / f"burstcu-{os.getuid()}" and path.is_dir()
    assert path.stat().st_mode & 0o777 == 0o700
    assert emulate.cache_dir() == path / "emu"


def test_cache_dir_override_and_foreign_folder(monkeypatch, tmp_path):
    from burstcu.build import compile as kc

    monkeypatch.setenv("BURSTCU_CACHE_DIR", str(tmp_path / "shared"))
    assert kc.cache_dir() == tmp_path / "shared" and (tmp_path / "shared").is_dir()
    monkeypatch.delenv("BURSTCU_CACHE_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)  # the folder is not "ours"
    with pytest.raises(RuntimeError, match="BURSTCU_CACHE_DIR"):
        kc.cache_dir()


@pytest.mark.parametrize("launched,ok", [({"PMI_SIZE": "2"}, False), ({"PMI_SIZE": "1"}, True),
                                         ({}, True),
                                         ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2"}, False),
                                         ({"SLURM_STEP_ID": "4294967294",  # the batch step
                                           "SLURM_STEP_NUM_TASKS": "2"}, True)])
def test_no_mpi_library_under_a_launcher_of_several_ranks_is_an_error(launched, ok):
    """mpi4py without an MPI library: one process runs alone with a warning, but a rank that a
    launcher started as one of several refuses (it would otherwise compute the whole problem
    alone, silently duplicated on every rank)."""
    import os
    import subprocess
    import sys

    drop = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_ID",
            "SLURM_STEP_NUM_TASKS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
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


def test_auto_on_a_machine_without_a_gpu_says_nothing(monkeypatch):
    """backend='auto' picks NumPy quietly when no rank has a GPU (the usual CPU machine), and
    warns only when some rank has one that cannot be used everywhere."""
    import warnings
    import burstcu
    from burstcu import group as G
    monkeypatch.setattr(G, "gpu_usable", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with burstcu.init() as g:
            assert g.backend == "numpy"
    assert not [w for w in caught if "burstcu" in str(w.message)], [str(w.message) for w in caught]
    assert G._resolve_backend("auto", [G._settings("auto", None, "thread", None)]) == ("numpy", False)


def test_auto_with_a_gpu_on_some_ranks_only_is_told(monkeypatch):
    from burstcu import group as G

    class TwoRanks:   # rank 0 of two
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

    monkeypatch.setattr(G, "gpu_usable", lambda: True)
    mine = G._settings("auto", None, "thread", None)
    assert mine["gpu"] is True
    assert G._resolve_backend("auto", [mine, dict(mine, gpu=False)]) == ("numpy", True)
    assert G._resolve_backend("auto", [mine, mine]) == ("cupy", True)
    with pytest.warns(UserWarning, match="runs the NumPy CPU backend"):
        G._warn_cpu_fallback(TwoRanks(), "some ranks have a usable GPU, not every rank")


def test_torchrun_processes_are_refused_on_every_process(tmp_path):
    """torchrun --standalone --nproc_per_node 2: MPI does not join its processes (each is a
    world of one), so init raises on both, saying how to launch, instead of two one-rank jobs."""
    import shutil
    import subprocess

    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists() and not shutil.which("torchrun"):
        pytest.skip("no torchrun (the torch extra)")
    program = tmp_path / "job.py"
    program.write_text("import burstcu\nwith burstcu.init(backend='numpy') as g:\n"
                       "    print('ran as rank', g.rank, 'of', g.size, flush=True)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([str(torchrun if torchrun.exists() else "torchrun"), "--standalone",
                           "--nproc_per_node", "2", str(program)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ran as rank" not in out, out
    said = "this process is one of 2 ranks (WORLD_SIZE=2) but MPI's world has 1 rank(s): torchrun"
    assert out.count(said) >= 2 and "mpiexec -n N python -m mpi4py" in out, out


def test_a_launcher_of_another_mpi_is_refused(tmp_path):
    """Open MPI's mpirun starting processes whose mpi4py loaded MPICH: each is a world of one.
    Simulated by Open MPI's size variable over this MPICH: init says so and what to do."""
    import subprocess

    env = dict(os.environ, OMPI_COMM_WORLD_SIZE="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", "import burstcu; burstcu.init(backend='numpy')"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert proc.returncode != 0
    assert "one of 2 ranks (OMPI_COMM_WORLD_SIZE=2) but MPI's world has 1 rank(s): the " \
           "launcher's MPI is not the one mpi4py loaded" in proc.stderr, proc.stderr
    assert "MPI4PY_LIBMPI" in proc.stderr


@pytest.mark.parametrize("launched,ok", [({"PMI_SIZE": "3"}, False), ({}, True)])
def test_no_mpi4py_under_a_launcher_of_several_ranks_is_an_error(launched, ok, tmp_path):
    """Without mpi4py at all, a rank started as one of several says so (and names the 'mpi'
    extra) instead of running the whole problem alone; one process just runs."""
    import os
    import subprocess
    import sys

    blocker = tmp_path / "mpi4py"            # a package that fails to import, first on the path
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('No module named mpi4py')\n")
    drop = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_ID",
            "SLURM_STEP_NUM_TASKS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(launched, PYTHONPATH=f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", "import burstcu; print(burstcu.init().size)"],
                          capture_output=True, text=True, timeout=60, env=env)
    if ok:
        assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr
    else:
        assert proc.returncode != 0
        assert "one of 3 ranks (PMI_SIZE=3)" in proc.stderr and "mpi4py is not installed" in proc.stderr
        assert "burstcu[mpi]" in proc.stderr
