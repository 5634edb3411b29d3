"""Bodies for tests/transport/test_mpi.py, run on every rank under mpiexec (any world size)."""

from __future__ import annotations

import time

import numpy as np

import burstcu


def _exchange(t, send, recv) -> None:
    t.send_recv(send, recv, t.next_rank, t.prev_rank)
    t.commit()
    t.wait()


def waiting_for_a_late_peer(late_s: float = 0.015, rounds: int = 20, nbytes: int = 1 << 16) -> dict:
    """Ring exchanges in which rank 0 posts `late_s` late, `rounds` times: every other rank's
    progress thread waits for it. Process CPU time (both threads) over wall time, per rank."""
    with burstcu.init(backend="numpy") as group:
        t = group.transport
        send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        if group.size == 1:
            return {"cpu_s": 0.0, "wall_s": 0.0}
        _exchange(t, send, recv)
        group.barrier()
        c0, w0 = time.process_time(), time.monotonic()
        for _ in range(rounds):
            if group.rank == 0:
                time.sleep(late_s)
            _exchange(t, send, recv)
        cpu, wall = time.process_time() - c0, time.monotonic() - w0
    assert wall >= 0.9 * rounds * late_s, (wall, rounds * late_s)
    return {"cpu_s": cpu, "wall_s": wall}

