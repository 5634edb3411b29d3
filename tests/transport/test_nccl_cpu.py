"""NCCLTransport pieces that need no GPU: dtype table, device selection, NVTX helper, error
paths, and (under mpiexec) the unique-id broadcast and the every-rank failure without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from burstcu.transport import bootstrap as boot
from burstcu.transport import nccl as bn
from burstcu.transport.streams import nvtx_range
from tests.mpi_run import run_mpi

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None


def _has_nccl() -> bool:
    try:
        from cupy.cuda import nccl  # noqa: F401
        return True
    except Exception:
        return False


# ---- dtype table (values from nccl.h; CuPy's constants must agree) ---------------------------
NCCL_H = {"int8": (0, 1), "uint8": (1, 1), "int32": (2, 1), "uint32": (3, 1), "int64": (4, 1),
          "uint64": (5, 1), "float16": (6, 1), "float32": (7, 1), "float64": (8, 1),
          "complex64": (7, 2), "complex128": (8, 2), "bool": (1, 1), "int16": (1, 2), "uint16": (1, 2)}


@pytest.mark.parametrize("name", sorted(NCCL_H))
def test_numpy_dtype_to_nccl(name):
    assert bn.nccl_dtype(np.dtype(name)) == NCCL_H[name]


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
def test_ml_dtypes_to_nccl():
    assert bn.nccl_dtype(ml_dtypes.bfloat16) == (9, 1)
    assert bn.nccl_dtype(ml_dtypes.float8_e4m3fn) == (10, 1)
    assert bn.nccl_dtype(ml_dtypes.float8_e5m2) == (11, 1)


@pytest.mark.skipif(not _has_nccl(), reason="cupy.cuda.nccl not installed")
def test_table_agrees_with_cupy_constants():
    from cupy.cuda import nccl
    assert bn.nccl_dtype(np.uint8)[0] == nccl.NCCL_UINT8
    assert bn.nccl_dtype(np.float16)[0] == nccl.NCCL_FLOAT16
    assert bn.nccl_dtype(np.float64)[0] == nccl.NCCL_FLOAT64


@pytest.mark.parametrize("dtype", [object, "U4", [("a", "f4"), ("b", "i4")]])
def test_unsupported_dtypes_are_a_clear_error(dtype):
    with pytest.raises(TypeError, match="NCCL has no data type"):
        bn.nccl_dtype(dtype)


def test_count_of_a_byte_view_and_of_complex():
    assert bn.nccl_count(np.zeros(10, np.float32).view(np.uint8)) == (40, 1)
    assert bn.nccl_count(np.zeros((3, 2), np.complex64)) == (12, 7)


# ---- device selection -------------------------------------------------------------------------
@pytest.mark.parametrize("local_rank,local_size,n,expected",
                         [(0, 1, 1, 0), (3, 4, 4, 3), (1, 2, 8, 1), (2, 3, 1, None)])
def test_select_device(local_rank, local_size, n, expected):
    if expected is None:
        with pytest.raises(ValueError, match="3 ranks on this node but only 1 GPU"):
            boot.select_device(local_rank, local_size, n)
    else:
        assert boot.select_device(local_rank, local_size, n) == expected


def test_select_device_errors_and_binding():
    with pytest.raises(ValueError, match="no usable CUDA GPU"):
        boot.select_device(0, 1, 0)
    with pytest.raises(ValueError, match="outside"):
        boot.select_device(2, 2, 4)
    # the launcher gave each rank its own CUDA_VISIBLE_DEVICES: device 0 is ours
    assert boot.select_device(5, 8, 1, bound=True) == 0


# ---- helpers and error paths in one process -------------------------------------------------
def test_nvtx_range_is_a_no_op_without_a_gpu():
    with nvtx_range("burstcu test"):
        x = 1
    assert x == 1


def test_bootstrap_without_gpu_raises_fast(monkeypatch):
    monkeypatch.delenv(boot.BOUND_ENV, raising=False)
    if boot.device_count()[0] > 0:
        pytest.skip("a GPU is present")
    with pytest.raises(boot.BackendUnavailable, match="no usable CUDA GPU|cupy is not importable"):
        boot.bootstrap(None)


def test_transport_checks_buffers():
    from burstcu.testing.schedule import RecordingDevice
    t = bn.NCCLTransport(0, 2, RecordingDevice())
    with pytest.raises(ValueError, match="C-contiguous"):
        t.send_recv(np.zeros((4, 4))[:, ::2], None, 1, 1)
        t.commit()
    with pytest.raises(ValueError, match="needs 2 x"):
        t.allgather(np.zeros(4, np.uint8), np.zeros(4, np.uint8))
    with pytest.raises(RuntimeError, match="without an MPI communicator"):
        t.allgather_object(1)
    assert bn.NCCLTransport(0, 1, RecordingDevice()).allgather_object("x") == ["x"]


def test_allgather_is_event_ordered():
    from burstcu.testing.schedule import RecordingDevice, RecordingOps
    dev = RecordingDevice()
    ops = RecordingOps(dev)
    send, recv = ops.new("send", (4,), np.uint8), ops.new("recv", (2, 4), np.uint8)
    dev.actions.clear()
    t = bn.NCCLTransport(1, 2, dev)
    t.allgather(send, recv)
    assert [(a.stream, a.kind) for a in dev.actions] == [
        ("compute", "record"), ("comm", "wait"), ("comm", "allgather"), ("comm", "record"),
        ("compute", "wait")]
    assert t.stats.bytes_sent == 4 and t.stats.bytes_received == 4
    assert t.stats.messages == 1   # its piece to the one other rank


# ---- under mpiexec ------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.skipif(not _has_nccl(), reason="cupy.cuda.nccl not installed")
@pytest.mark.parametrize("world", [2, 3])
def test_unique_id_broadcast(world):
    results = run_mpi(world, "nccl_bodies:unique_id_broadcast", timeout=60)
    assert all(r["len"] == 128 for r in results)
    assert len({r["sha"] for r in results}) == 1, results


@pytest.mark.mpi
def test_node_local_rank():
    results = run_mpi(3, "nccl_bodies:node_local_rank", timeout=60)
    assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 3), (1, 3), (2, 3)]


@pytest.mark.mpi
def test_cupy_backend_without_gpu_fails_on_every_rank():
    if boot.device_count()[0] > 0:
        pytest.skip("a GPU is present")
    results = run_mpi(2, "nccl_bodies:cupy_backend_fails_everywhere", timeout=60)
    assert all(r["same_everywhere"] for r in results)
    assert all("rank(s) 0, 1" in r["message"] for r in results), results
    assert all(r["seconds"] < 20 for r in results), results


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_one_rank_problem_raises_on_every_rank(world):
    results = run_mpi(world, "nccl_bodies:one_rank_problem_raises_everywhere", timeout=60)
    assert len({r["message"] for r in results}) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_more_ranks_than_gpus_fails_on_every_rank(world):
    results = run_mpi(world, "nccl_bodies:too_many_ranks_per_gpu", timeout=60)
    assert len({r["message"] for r in results}) == 1


@pytest.mark.mpi
def test_one_rank_without_gpu_stops_every_rank():
    results = run_mpi(3, "nccl_bodies:last_rank_without_gpu", timeout=60)
    assert len({r["message"] for r in results}) == 1


@pytest.mark.parametrize("cc, problem", [("75", "compute capability 7.5"), ("80", None), ("90", None)])
def test_gpus_older_than_sm80_are_a_problem_reported_before_agreement(monkeypatch, cc, problem):
    """A T4/V100 stops the cupy backend on every rank (and 'auto' falls back), not mid-init."""
    cupy = pytest.importorskip("cupy")

    monkeypatch.setattr(cupy.cuda.runtime, "deviceGetAttribute",
                        lambda attr, device_id: {75: int(cc[0]), 76: int(cc[1])}[attr])
    got = boot._arch_problem(0)
    assert (got is None) if problem is None else (problem in got), got
