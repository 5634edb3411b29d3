"""Helpers shared by every benchmark in bench/: the MPI world, what a run measured on, inputs,
one timing helper, tables, JSON and progress lines.

    world()                        -> (comm or None, rank, size): mpi4py's COMM_WORLD if it loads
    environment(group, **extra)    -> dict: what was measured on (CPU/GPU, BLAS, MPI, progress)
    measured_on(env)               -> one line saying so ("CPU ... NOT GPU figures")
    array_dtype(name)              -> the NumPy scalar type of "float16" ... "bfloat16" (ml_dtypes)
    make_local_inputs(...)         -> this rank's q, k, v, dout shards (random, seeded)
    document_mix(total, seed, ...) -> cu_seqlens of a seeded long-tailed mix of documents
    call_seconds(fn, repeats, ...) -> seconds of each call (host clock, or CUDA events)
    slowest_rank_seconds(group, fn, repeats) -> median over calls of the slowest rank's seconds
    overlap_efficiency(tc, tm, to) -> the fraction of an exchange hidden behind compute
    median(xs), fmt_s(seconds), fmt_bytes(n), table(rows, columns), progress(msg)
    clean(obj), write_json(path, obj), print_and_write(env, rows, columns, args)
    blas_threads_env(threads)      -> os.environ copy with that many BLAS/OpenMP threads
    add_problem_args(parser, ...)  -> the shared --seqlen/--batch/--heads/.../--json options
    plotting_problem()             -> why --plot cannot draw here (no matplotlib), or None
    refuse_plot_without_matplotlib(argv) -> exit at once, saying what to install, if it is so

Scripts run as files (`python bench/cpu/overlap.py`) put the repository root on sys.path before
importing this module as `bench._common`. Imported by a script of bench/ run with --plot where
matplotlib is missing, it ends the run at once with the line that says what to install
(`refuse_plot_without_matplotlib`), before anything is measured.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from burstcu.ops.base import DelegatingOps

ROOT = Path(__file__).resolve().parents[1]
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
# where mpiexec tells a process its rank before MPI starts (MPICH's Hydra, Open MPI, PMIx)
LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
BENCH_EXTRA_INSTALL = "pip install 'burstcu[bench]'"   # matplotlib, mpi4py and the mpich wheel


# ----------------------------------------------------------------------------------------------
# the world and what it is


def world():
    """(comm, rank, size): MPI.COMM_WORLD when mpi4py loads an MPI library, else (None, 0, 1)."""
    from burstcu.transport.bootstrap import world_comm
    comm = world_comm()
    if comm is None:
        return None, 0, 1
    return comm, comm.Get_rank(), comm.Get_size()


def blas_threads_env(threads: int = 1) -> dict:
    """A copy of os.environ with every BLAS / OpenMP thread count set to `threads`."""
    env = dict(os.environ)
    for var in THREAD_VARS:
        env[var] = str(threads)
    return env


def _blas_info() -> list:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keep = ("internal_api", "version", "num_threads", "architecture")
    return [{k: info.get(k) for k in keep} for info in threadpool_info()]


def _mpi_info() -> str | None:
    try:
        from mpi4py import MPI
        return MPI.Get_library_version().splitlines()[0].strip()
    except Exception:
        return None


def environment(group=None, synchronized: bool = False, **extra) -> dict:
    """What the figures were measured on. Never claims a GPU unless the backend ran on one.
    synchronized: the script syncs the device inside its timings (device times, not enqueue)."""
    backend = getattr(group, "backend", "numpy")
    on_gpu = getattr(getattr(group, "ops", None), "device", "cpu") == "cuda"
    transport = getattr(group, "transport", None)
    gpu = ("GPU (wall time around each call, device synchronized)" if synchronized
           else "GPU (host-side enqueue timings)")
    env = {
        "device": gpu if on_gpu else "CPU",
        "backend": backend,
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": _blas_info(),
        "thread_env": {v: os.environ.get(v) for v in THREAD_VARS},
        "mpi": _mpi_info(),
        "transport": getattr(transport, "name", None),
        "progress": getattr(transport, "progress", None),
        "ranks": getattr(group, "size", 1),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    env.update(extra)
    return env


def environment_on_rank0(group, print_header: bool = False) -> dict | None:
    """The run's `environment`, then `group` closed: the environment on rank 0 (which reports;
    with print_header, after printing the first line of `measured_on`), None on every other
    rank."""
    env = environment(group)
    group.close()
    if group.rank != 0:
        return None
    if print_header:
        print(measured_on(env).splitlines()[0])
    return env


def measured_on(env: dict) -> str:
    """One human line: what ran, and a reminder that CPU numbers are not GPU numbers."""
    threads = env["thread_env"].get("OMP_NUM_THREADS") or "default"
    line = (f"# measured on {env['device']}: backend={env['backend']}, {env['ranks']} rank(s) on "
            f"{env['cpus']} cores, BLAS threads={threads}, transport={env['transport']}"
            f" (progress={env['progress']}), MPI={env['mpi']}")
    if env["device"] == "CPU":
        line += "\n# these are CPU + MPI figures of the schedule, NOT GPU figures"
    return line


# ----------------------------------------------------------------------------------------------
# inputs


def array_dtype(name: str):
    """The NumPy scalar type named "float16", "bfloat16" (ml_dtypes'), "float32" or "float64"."""
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name).type


def make_local_inputs(rank: int, size: int, *, batch: int, seqlen: int, heads: int, kv_heads: int,
                      headdim: int, dtype: str, layout: str = "contiguous", seed: int = 0):
    """This rank's (q, k, v, dout) for a global sequence of `seqlen` tokens.

    q, dout: (batch, seqlen/size, heads, headdim); k, v: (batch, seqlen/size, kv_heads, headdim).
    Each rank draws only its own shard (seeded by rank), so no rank builds the whole sequence;
    values are N(0, 1), which keeps softmax well conditioned for timing.
    """
    from burstcu.layout import shard_slices

    shard_slices(layout, rank, size, seqlen)  # raises a clear error when seqlen does not divide
    dt = array_dtype(dtype)
    rng = np.random.default_rng([seed, rank])
    s = seqlen // size
    shapes = [(batch, s, heads, headdim), (batch, s, kv_heads, headdim),
              (batch, s, kv_heads, headdim), (batch, s, heads, headdim)]
    return [rng.standard_normal(shape, dtype=np.float32).astype(dt) for shape in shapes]


def document_mix(total: int, seed: int = 0, median: float = 64, sigma: float = 1.75,
                 shortest: int = 8) -> tuple[int, ...]:
    """cu_seqlens (0, b_1, ..., total) of a seeded long-tailed mix: log-normal lengths (median
    `median` tokens, shape `sigma`) clipped to [shortest, total // 2], drawn until they fill
    `total`; the last document is cut to fit."""
    rng = np.random.default_rng(seed)
    bounds = [0]
    longest = max(shortest, total // 2)
    while bounds[-1] < total:
        length = int(np.clip(round(rng.lognormal(np.log(median), sigma)), shortest, longest))
        bounds.append(min(total, bounds[-1] + length))
    return tuple(bounds)


# ----------------------------------------------------------------------------------------------
# timing


def call_seconds(fn, repeats: int, warmup: int = 1, *, cuda: bool = False,
                 sync_inside: bool = False, before=None, after=None) -> list[float]:
    """Seconds of each of `repeats` calls of fn(), after `warmup` untimed calls.

    Host clock (default): time.perf_counter around fn() and after() (a device synchronize, say);
    before() (a barrier, say) runs untimed ahead of each call. cuda=True: CUDA events on CuPy's
    current stream around fn(); sync_inside synchronizes the whole device before the start and
    before the stop event, for work other libraries issue on their own streams (a few
    microseconds of host latency then enter every figure).
    """
    for _ in range(warmup):
        fn()
    if after is not None and warmup:
        after()
    if cuda:
        return _cuda_event_seconds(fn, repeats, sync_inside)
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if after is not None:
            after()
        times.append(time.perf_counter() - t0)
    return times


def slowest_rank_seconds(group, fn, repeats: int, warmup: int = 0, after=None) -> float:
    """The median over `repeats` calls of fn() (after `warmup` untimed ones) of the slowest
    rank's seconds, every call started together (a barrier); `after` as in `call_seconds`."""
    mine = call_seconds(fn, repeats, warmup, before=group.barrier, after=after)
    every = group.transport.allgather_object(mine, "bench timing")
    return median([max(per_rank) for per_rank in zip(*every)])


def _cuda_event_seconds(fn, repeats: int, sync_inside: bool) -> list[float]:
    import cupy

    device = cupy.cuda.Device()
    device.synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        if sync_inside:
            device.synchronize()
        start.record()
        fn()
        if sync_inside:
            device.synchronize()
        stop.record()
        stop.synchronize()
        times.append(float(cupy.cuda.get_elapsed_time(start, stop)) * 1e-3)
    return times


def overlap_efficiency(t_compute: float, t_comm: float, t_overlapped: float) -> float | None:
    """(t_compute + t_comm - t_overlapped) / t_comm: the fraction of the exchange's time hidden
    behind compute (1: all of it, 0: back to back, < 0: together slower than in sequence); None
    without an exchange."""
    return (t_compute + t_comm - t_overlapped) / t_comm if t_comm > 0 else None


def median(xs) -> float:
    """The median of the values that are not None (NaN when none is)."""
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else float("nan")


# ----------------------------------------------------------------------------------------------
# output


def fmt_s(seconds) -> str:
    """Seconds as "1.23s", "4.56ms" or "78us"; "-" for None or NaN."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds * 1e6:.0f}us"


def fmt_bytes(n) -> str:
    """A byte count as "512B", "1.50KiB", "2.00MiB" or "3.00GiB"."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return str(n)


def table(rows: list, columns: list) -> str:
    """Aligned text table of `rows` (dicts) with the given column keys, header first."""
    cells = [[str(c) for c in columns]] + [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def progress(msg: str, rank: int = 0) -> None:
    """A progress line on stderr (rank 0 only), so stdout stays one line per configuration."""
    if rank == 0:
        sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        sys.stderr.flush()


def clean(x):
    """obj with numpy scalars/arrays as Python values and NaN/inf as None (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return clean(x.tolist())
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        x = x.item()
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return None
    return x


def finish(result: dict, json_path) -> dict:
    """`result`, written to `json_path` as strict JSON first when one is given."""
    if json_path:
        write_json(json_path, result)
    return result


def write_json(path, obj) -> None:
    """Write `obj` as strict JSON (see `clean`), creating the folder; atomically (a temporary
    file renamed over `path`), so a run killed while it rewrites its JSON leaves the last whole one."""
    from burstcu.build.compile import atomic_write

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(clean(obj), indent=1, allow_nan=False) + "\n").encode())


def add_shape_args(p, *, heads: int = 4, headdim: int = 64, dtype: str = "float32",
                   dtypes=("float16", "bfloat16", "float32", "float64")) -> None:
    """--batch, --heads, --kv-heads, --headdim, --dtype: the arrays' shape and dtype options."""
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=heads)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--headdim", type=int, default=headdim)
    p.add_argument("--dtype", default=dtype, choices=list(dtypes))


def add_problem_args(p, *, seqlen: int, dtype: str) -> None:
    """The problem-shape options every per-strategy benchmark takes."""
    p.add_argument("--seqlen", type=int, default=seqlen, help="global sequence length")
    add_shape_args(p, dtype=dtype)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--strategies", nargs="+", default=["burst", "ring", "allgather", "ulysses"])
    p.add_argument("--json", default=None)


def print_and_write(env: dict, rows: list, columns: list, args) -> None:
    """Rank 0's output of a measured run: the environment line and the table on stdout, the
    same text to args.table and everything (environment, arguments, rows) to args.json."""
    text = measured_on(env) + "\n" + table(rows, columns)
    print(text)
    if getattr(args, "table", None):
        Path(args.table).write_text(text + "\n")
    if getattr(args, "json", None):
        write_json(args.json, {"environment": env, "args": clean(vars(args)), "rows": rows})


# ----------------------------------------------------------------------------------------------
# plots


def plotting_problem() -> str | None:
    """Why --plot cannot draw here, as one line that names the extra to install, or None."""
    try:
        import matplotlib  # noqa: F401 - optional: only --plot needs it
    except ImportError as exc:
        return f"--plot needs matplotlib ({exc}): {BENCH_EXTRA_INSTALL}"
    return None


def refuse_plot_without_matplotlib(argv) -> None:
    """SystemExit(2) when the command line `argv` asks for --plot and matplotlib is missing, on
    every rank, with `plotting_problem`'s line on stderr (from the first rank only): at the start
    of the run, not after the measurements."""
    if not any(arg == "--plot" or arg.startswith("--plot=") for arg in argv):
        return
    problem = plotting_problem()
    if problem:
        if all(os.environ.get(var, "0") == "0" for var in LAUNCHER_RANK_VARS):
            sys.stderr.write(f"{Path(sys.argv[0]).name}: {problem}\n")
        raise SystemExit(2)


def _running_a_bench_script() -> bool:
    """Whether this process's main program is a file of bench/ (run as a file, with -m, or under
    `python -m mpi4py`), whose command line is sys.argv."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return main_file is not None and Path(main_file).resolve().is_relative_to(ROOT / "bench")


if _running_a_bench_script():
    refuse_plot_without_matplotlib(sys.argv[1:])


# ----------------------------------------------------------------------------------------------
# steps timed inside the engine


class StepTimingOps(DelegatingOps):
    """Delegates to `inner`, running each forward and backward step through `timed(fn, *args)`
    (a subclass's clock: host time, CUDA events), which notes an interval in `intervals`; with
    compute=False a step gets no blocks (what is left is the exchange alone)."""

    def __init__(self, inner, compute: bool):
        super().__init__(inner)
        self.compute, self.intervals = compute, []

    def timed(self, fn, *args) -> None:
        raise NotImplementedError

    def forward_step(self, state, k, v, blocks):
        self.timed(self.inner.forward_step, state, k, v, blocks if self.compute else [])

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum=None):
        self.timed(self.inner.backward_step, ctx, q, dout, lse, delta, dq,
                   blocks if self.compute else [], psum)
