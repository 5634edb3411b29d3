"""Bodies of tests/test_frictions.py that need several ranks: `burstcu.init`'s options under
`mpiexec -n N` (any N).

Run through tests/mpi/runner.py as `friction_bodies:<function>`.
"""

from __future__ import annotations

from mpi4py import MPI

import burstcu


def unknown_option_on_one_rank_fails_on_every_rank(backend: str = "numpy"):
    """The last rank passes an option its op does not take, the others deterministic=True:
    init raises the same TypeError on every rank, naming the option, the options the op takes
    and (elsewhere) the rank; then the world is still usable (a collective completes)."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    options = {"determinstic": True} if comm.Get_rank() == last else {"deterministic": True}
    try:
        burstcu.init(backend=backend, **options)
    except TypeError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"init accepted {options}")
    assert "unknown option 'determinstic'" in message and "deterministic" in message, message
    if comm.Get_rank() != last:
        assert f"rank {last}" in message, message
    everyone = comm.allgather(message)
    return {"message": message, "ranks_failed": len(everyone)}


def bad_option_value_on_one_rank_fails_on_every_rank():
    """The last rank passes threads=1.5 to the NumPy op, the others threads=1: init raises the
    same TypeError on every rank (not the first call, on that rank alone)."""
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1
    try:
        burstcu.init(backend="numpy", threads=1.5 if comm.Get_rank() == last else 1)
    except TypeError as exc:
        message = str(exc)
    else:
        raise AssertionError("init accepted threads=1.5")
    assert "threads must be an int, got 1.5" in message, message
    return {"ranks_failed": len(comm.allgather(message))}
