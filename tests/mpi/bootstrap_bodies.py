"""Bodies of tests/transport/test_bootstrap.py: the NCCL bootstrap (`burstcu.transport.bootstrap`)
under `mpiexec -n N` on CPU-only machines (any N).

Run through tests/mpi/runner.py as `bootstrap_bodies:<function>`. They exercise what needs no GPU:
the unique-id broadcast, the node-local split, and the agreed, every-rank failure of
backend="cupy" when no GPU is usable.
"""

from __future__ import annotations

import hashlib
import os
import time

from mpi4py import MPI

import burstcu
from burstcu.transport import bootstrap


def unique_id_broadcast():
    """Rank 0's NCCL unique id reaches every rank unchanged: 128 bytes, the same everywhere."""
    uid = bootstrap.unique_id(MPI.COMM_WORLD)
    assert isinstance(uid, bytes) and len(uid) == 128, (type(uid), len(uid))
    return {"len": len(uid), "sha": hashlib.sha256(uid).hexdigest()}


def node_local_rank():
    """On one node the shared-memory split gives local rank == rank, local size == size."""
    local_rank, local_size = bootstrap._local_rank(MPI.COMM_WORLD)
    comm = MPI.COMM_WORLD
    assert (local_rank, local_size) == (comm.Get_rank(), comm.Get_size())
    return {"local_rank": local_rank, "local_size": local_size}


def cupy_backend_fails_everywhere():
    """Without a GPU, init(backend="cupy") raises BackendUnavailable on every rank, quickly; then
    the world is still usable (a collective afterwards completes)."""
    t0 = time.perf_counter()
    try:
        burstcu.init(backend="cupy")
    except bootstrap.BackendUnavailable as exc:
        message = str(exc)
    else:
        raise AssertionError("backend='cupy' started without a GPU")
    elapsed = time.perf_counter() - t0
    assert "no usable CUDA GPU" in message or "cupy is not importable" in message, message
    everyone = MPI.COMM_WORLD.allgather(message)  # nobody is stuck inside a collective
    return {"message": message, "seconds": elapsed, "same_everywhere": len(set(everyone)) == 1}


def one_rank_problem_raises_everywhere():
    """A problem found only on the last rank is raised on every rank, naming that rank."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    problem = "2 ranks on this node but only 1 GPU(s)" if comm.Get_rank() == last else None
    try:
        bootstrap.agree_or_raise(comm, problem)
    except bootstrap.BackendUnavailable as exc:
        message = str(exc)
    else:
        raise AssertionError("agree_or_raise let a rank through")
    assert f"rank(s) {last}" in message and "only 1 GPU" in message, message
    comm.Barrier()
    return {"message": message}


def _pretend_devices(count: int, why: str | None = None) -> None:
    """Make this rank's bootstrap see `count` GPUs of compute capability 9.0 (the checks run
    before any GPU call)."""
    bootstrap.device_count = lambda: (count, why)
    bootstrap._arch_problem = lambda device_id: None


def _refusal(comm, started: str) -> str:
    """The BackendUnavailable message `bootstrap` raises on this rank (AssertionError(started) if
    it starts)."""
    try:
        bootstrap.bootstrap(comm)
    except bootstrap.BackendUnavailable as exc:
        return str(exc)
    raise AssertionError(started)


def too_many_ranks_per_gpu():
    """N ranks on a node with one GPU: every rank raises, naming the count, before NCCL starts."""
    _pretend_devices(1)
    message = _refusal(MPI.COMM_WORLD, "bootstrap accepted two ranks on one GPU")
    size = MPI.COMM_WORLD.Get_size()
    assert f"{size} ranks on this node but only 1 GPU(s)" in message, message
    return {"message": message}


def two_ranks_bound_to_one_gpu():
    """Every rank sees one GPU, bound by its launcher, but the first and the last rank were
    given the same one (a launcher's binding gone wrong): every rank raises, naming both,
    before any rank enters the NCCL init (where NCCL would refuse the duplicate on some ranks)."""
    comm = MPI.COMM_WORLD
    rank, last = comm.Get_rank(), comm.Get_size() - 1
    _pretend_devices(1)
    os.environ[bootstrap.BOUND_ENV] = "1"
    bus = "0000:1b:00.0" if rank in (0, last) else f"0000:{0x30 + rank:02x}:00.0"
    bootstrap.gpu_place = lambda device_id: f"node, PCI bus {bus}"
    started = []
    bootstrap.create_communicator = lambda *args: started.append(args)
    message = _refusal(comm, "bootstrap accepted two ranks on one GPU")
    assert f"ranks 0, {last} would share one GPU (node, PCI bus 0000:1b:00.0)" in message, message
    return {"message": message, "nccl_started": bool(started)}


def last_rank_without_gpu():
    """Only the last rank lacks a GPU: the others must raise too, not enter the NCCL init."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    if comm.Get_rank() == last:
        _pretend_devices(0, "cudaErrorNoDevice: no CUDA-capable device is detected")
    else:
        _pretend_devices(64)
    message = _refusal(comm, "bootstrap went on with a rank that has no GPU")
    assert f"(rank(s) {last}):" in message and "cudaErrorNoDevice" in message, message
    return {"message": message}
