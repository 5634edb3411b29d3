"""MPI transport (mpi4py), the CPU analogue of a dedicated communication stream.

MPICH progresses a large non-blocking transfer only while some thread is inside an MPI call, so
`Isend`/`Irecv` posted from the compute thread would mostly move while the host sits in
`Waitall`: no overlap. With ``progress="thread"`` (the default) one worker thread posts each
step's exchange and waits on it, while the main thread computes in NumPy/BLAS (which release the
GIL). That thread plays the role the NCCL stream plays on a GPU. ``progress="inline"`` posts and
waits on the caller's thread, for comparison in benchmarks.

The transport duplicates the user's communicator, so its messages can never match the user's.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from .base import Transport, nbytes

_TAG = 7


def _byte_view(buf: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 array (works for ml_dtypes too)."""
    if not buf.flags.c_contiguous:
        raise ValueError("MPI transport needs C-contiguous buffers")
    return buf.reshape(-1).view(np.uint8)


class MPITransport(Transport):
    name = "mpi"

    def __init__(self, comm: Any, progress: str = "thread"):
        if progress not in ("thread", "inline"):
            raise ValueError(f"progress must be 'thread' or 'inline', not {progress!r}")
        self.comm = comm.Dup()
        super().__init__(self.comm.Get_rank(), self.comm.Get_size())
        self.progress = progress
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="burstcu-comm") if progress == "thread" else None
        self._pending: list[Future] = []
        self._requests: list = []

    def _start(self, exchanges):
        from mpi4py import MPI

        reqs = []
        for send_buf, recv_buf, dst, src in exchanges:
            if recv_buf is not None:
                reqs.append(self.comm.Irecv([_byte_view(recv_buf), MPI.BYTE], source=src, tag=_TAG))
            if send_buf is not None:
                reqs.append(self.comm.Isend([_byte_view(send_buf), MPI.BYTE], dest=dst, tag=_TAG))
        return reqs

    def _post(self, exchanges):
        if self._pool is None:
            self._requests.extend(self._start(exchanges))
            return

        def run():
            from mpi4py import MPI

            MPI.Request.Waitall(self._start(exchanges))

        self._pending.append(self._pool.submit(run))

    def _wait(self):
        from mpi4py import MPI

        if self._requests:
            reqs, self._requests = self._requests, []
            MPI.Request.Waitall(reqs)
        pending, self._pending = self._pending, []
        for fut in pending:
            fut.result()

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def allgather(self, send_buf, recv_buf):
        from mpi4py import MPI

        self.comm.Allgather([_byte_view(send_buf), MPI.BYTE], [_byte_view(recv_buf), MPI.BYTE])
        self.stats.bytes_sent += nbytes(send_buf) * (self.size - 1)
        self.stats.bytes_received += nbytes(send_buf) * (self.size - 1)

    def barrier(self):
        self.comm.Barrier()

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        try:
            self.comm.Free()
        except Exception:  # MPI already finalized at interpreter exit
            pass
