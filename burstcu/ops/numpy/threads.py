"""The NumPy op's threads: work items run on the calling thread and a pool, BLAS held to one
thread meanwhile (NumPy and BLAS release the GIL, so the parallelism is across tiles), and the
turns that keep the result independent of the thread count.

`WorkPool.run(work, items)` hands items out in order; `InOrder` makes an item wait for its
head's earlier items (the backward adds dQ partials in key order; the forward's folds wait for
their head's K/V layout). `default_threads` follows the BLAS library's thread count;
`blas_advice` says when NumPy's OpenBLAS runs slower kernels than the CPU allows.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class InOrder:
    """Turns per head: wait(head, turn) returns once done(head) was called `turn` times. The
    backward adds each head's dQ partials in key-range order with it, whichever thread
    finishes first (item (range c, head) adds only after (range c-1, head)); the forward's
    folds wait for their head's K/V layout (turn 1).

    No deadlock: an item waited for is queued before its waiters (key range by key range; the
    layouts before every fold), and `WorkPool.run` hands items out in queue order, so it was
    taken by a thread before the waiter was. `_run` releases every waiter when any thread stops
    on an exception (`fail`, its on_failure), wherever it met it, so a pool thread never waits
    forever.
    """

    def __init__(self, heads: int):
        self.added = [0] * heads   # done() calls so far, per head
        self.failed = False
        self.cond = threading.Condition()

    def wait(self, head: int, turn: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.added[head] >= turn or self.failed)
            if self.failed:
                raise Abandoned("another work item of this step failed")

    def done(self, head: int) -> None:
        with self.cond:
            self.added[head] += 1
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class Abandoned(RuntimeError):
    """A work item gave up because another one failed (`InOrder.fail`): `WorkPool.run` raises
    the failure itself, not this."""


_END = object()   # the end of `WorkPool.run`'s items


class WorkPool:
    """`threads` threads running work items: the caller's and threads - 1 pool threads
    (none for threads = 1). `close()` stops the pool; the items then run serially."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="burstcu-lao") if threads > 1 else None
        self._blas = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def run(self, work, items, on_failure=None) -> None:
        """work(item) for every item, in order of `items`, on this thread and threads - 1 pool
        threads, with BLAS held to one thread: the parallelism is across items (docs/numpy-op.md).
        The calling thread works too rather than sleeping until the
        pool is done: each wake-up of a sleeping thread costs a core a context switch.
        Each thread takes the next item in order, so an item waited for (`InOrder`) was
        taken before its waiter. A thread that meets an exception (in an item or between two)
        calls on_failure() (`InOrder.fail`: waiters give up), and no thread takes another
        item; once every thread has stopped, the failure is raised — the first exception that
        is not a waiter's `Abandoned`, whichever thread met it. Pool threads run under the
        caller's np.errstate, as the calling thread does."""
        if self._blas is None:
            from threadpoolctl import ThreadpoolController
            self._blas = ThreadpoolController()
        with self._blas.limit(limits=1, user_api="blas"):
            if self._pool is None or len(items) == 1:
                for item in items:
                    work(item)
                return
            queue, lock, failed = iter(items), threading.Lock(), []
            errstate = np.geterr()

            def drain():
                try:
                    with np.errstate(**errstate):
                        while not failed:
                            with lock:
                                item = next(queue, _END)
                            if item is _END:
                                return
                            work(item)
                except BaseException as error:
                    failed.append(error)
                    if on_failure is not None:
                        on_failure()
            helpers = [self._pool.submit(drain) for _ in range(min(self.threads, len(items)) - 1)]
            try:
                drain()
            finally:
                for helper in helpers:
                    helper.exception()   # waits; drain itself raises nothing
            if failed:
                raise next((e for e in failed if not isinstance(e, Abandoned)), failed[0])


# the CPU flags OpenBLAS's SkylakeX kernels use
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})


def blas_advice(blas_info=None, cpu_flags=None, environ=None) -> str | None:
    """A sentence when NumPy's OpenBLAS runs AVX2 kernels (its core "Haswell" or "Zen") on a
    CPU with AVX-512, else None. The op's time is mostly its two matmuls a tile, and OpenBLAS's
    AVX-512 (SkylakeX) kernels take ~0.55x the time of its AVX2 ones on their shapes (measured
    on the Zen 5 machine of `bench/results/local_cpu_vs_torch.txt`: 512 x 512 x 65 and 512 x 65
    x 512 float32 at 180 and 160 GFLOP/s a core against 99 and 90). OpenBLAS picks its kernels
    when NumPy loads it, from the CPU, unless OPENBLAS_CORETYPE names them. blas_info:
    threadpoolctl's threadpool_info(); cpu_flags: the CPU's flags (default: /proc/cpuinfo's
    first flags line; none elsewhere); environ: default os.environ."""
    if blas_info is None:
        try:
            from threadpoolctl import threadpool_info
        except ImportError:
            return None
        blas_info = threadpool_info()
    openblas = [i for i in blas_info if i.get("internal_api") == "openblas"]
    numpys = [i for i in openblas if "numpy" in str(i.get("filepath", ""))]   # NumPy's own, if listed
    cores = {str(i.get("architecture")) for i in numpys or openblas}
    slow = sorted(cores & {"Haswell", "Zen"})
    if not slow:
        return None
    if cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as fh:
                line = next((ln for ln in fh if ln.startswith("flags")), "")
        except OSError:
            return None
        cpu_flags = line.partition(":")[2].split()
    if not AVX512_FLAGS <= set(cpu_flags):
        return None
    pinned = (os.environ if environ is None else environ).get("OPENBLAS_CORETYPE")
    why = (f"OPENBLAS_CORETYPE={pinned} in the environment makes NumPy's OpenBLAS run"
           if pinned else "NumPy's OpenBLAS picked")
    return (f"{why} its {'/'.join(slow)} (AVX2) kernels on a CPU with AVX-512: with "
            f"OPENBLAS_CORETYPE=SkylakeX (set before Python starts) the CPU backend's matmuls "
            f"take ~0.55x the time")


def default_threads() -> int:
    """The BLAS library's thread count (1 under OMP_NUM_THREADS=1, as with MPI ranks), else the
    cores this process may run on."""
    try:
        from threadpoolctl import threadpool_info
        blas = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
        if blas:
            return max(1, min(blas))
    except ImportError:
        pass
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
