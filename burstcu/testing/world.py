"""Run G ranks of burstcu as threads of this process, on one device (`burstcu.transport.loopback`).

    results = run_ranks(4, body, backend="cupy")     # body(group) on 4 threads, one GPU

Each rank gets its own `Group` (a `LoopbackTransport` and its own local op) and, on "cupy", its
own non-blocking compute stream, made current on its thread before `body` runs, so the ranks'
kernels and copies overlap on the device as separate processes' would. The first rank to raise
aborts the world (its peers stop waiting with PeerFailedError instead of hanging) and
`run_ranks` raises `RankFailed` naming it, chained to its exception.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, Callable

from ..group import Group, loopback_group, on_gpu
from ..transport.loopback import LoopbackHub, PeerFailedError
from ..validate import ordered_by


class RankFailed(RuntimeError):
    """A rank of a loopback world raised; `rank` is the first that failed on its own."""

    def __init__(self, rank: int, exc: BaseException):
        super().__init__(f"rank {rank} failed: {type(exc).__name__}: {exc}")
        self.rank = rank


def run_ranks(size: int, body: Callable[[Group], Any], *, backend: str = "numpy",
              timeout: float = 120.0, join_timeout: float = 3600.0, **options) -> list:
    """[body(group of rank r) for r in range(size)], each on its own thread (see the module
    docstring). timeout: seconds a rank waits for a peer. join_timeout: seconds the whole world
    may take. options: for the local op."""
    hub = LoopbackHub(size, timeout)
    results: list = [None] * size
    errors: list = [None] * size

    def main(rank: int) -> None:
        try:
            # each rank's calls come from its own thread, named for it: the threads are the ranks
            with _own_stream(backend), ordered_by("a loopback world's rank thread"):
                group = loopback_group(hub, rank, backend, **options)
                results[rank] = body(group)
                if on_gpu(backend):
                    group.ops.sync()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the rank
            errors[rank] = exc
            hub.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=main, args=(r,), name=f"burstcu-rank{r}", daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:  # a rank stuck outside the hub (not waiting on a peer) is reported, not awaited
        t.join(join_timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        hub.abort(f"rank(s) {stuck} still running after {join_timeout:.0f} s")
        raise RankFailed(stuck[0], TimeoutError(f"still running after {join_timeout:.0f} s; "
                                                f"its thread is left behind (daemon)"))
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        first = next(((r, e) for r, e in failed if not isinstance(e, PeerFailedError) and
                      not getattr(e, "burstcu_peer_left", False)), failed[0])   # a rank's own
        raise RankFailed(*first) from first[1]
    return results


def _own_stream(backend: str):
    if not on_gpu(backend):
        return nullcontext()
    import cupy
    return cupy.cuda.Stream(non_blocking=True)


__all__ = ["run_ranks", "RankFailed"]
