"""Helpers shared by the benchmarks in bench/: environment description, inputs, tables, JSON,
progress lines, and the MPI world.

API (for other bench scripts):
    world()                       -> (comm or None, rank, size)    mpi4py COMM_WORLD if importable
    environment(group, **extra)   -> dict: what was measured on (CPU/GPU, BLAS, MPI, progress)
    measured_on(env)              -> one line saying so ("CPU ... not a GPU figure")
    make_local_inputs(...)        -> this rank's q, k, v, dout shards (random, seeded)
    median(xs), fmt_s(sec), fmt_bytes(n)
    table(rows, columns)          -> str: an aligned text table (rows: list of dicts)
    progress(msg, rank=0)         -> one line on stderr from rank 0, flushed
    write_json(path, obj)         -> strict JSON (numpy values converted, NaN -> null)
    clean(obj)                    -> the JSON-ready copy write_json writes
    blas_threads_env()            -> os.environ copy with one BLAS/OpenMP thread
    add_problem_args(parser, ...) -> the shared --seqlen/--batch/--heads/.../--json options
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python bench/x.py` from anywhere
    sys.path.insert(0, str(ROOT))

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def world():
    """(comm, rank, size): MPI.COMM_WORLD when mpi4py loads an MPI library, else (None, 0, 1)."""
    from burstcu.transport.bootstrap import world_comm
    comm = world_comm()
    if comm is None:
        return None, 0, 1
    return comm, comm.Get_rank(), comm.Get_size()


def blas_threads_env(threads: int = 1) -> dict:
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
    transport = getattr(group, "transport", None)
    gpu = ("GPU (wall time around each call, device synchronized)" if synchronized
           else "GPU (host-side enqueue timings)")
    env = {
        "device": gpu if backend == "cupy" else "CPU",
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


def measured_on(env: dict) -> str:
    """One human line: what ran, and a reminder that CPU numbers are not GPU numbers."""
    threads = env["thread_env"].get("OMP_NUM_THREADS") or "default"
    line = (f"# measured on {env['device']}: backend={env['backend']}, {env['ranks']} rank(s) on "
            f"{env['cpus']} cores, BLAS threads={threads}, transport={env['transport']}"
            f" (progress={env['progress']}), MPI={env['mpi']}")
    if env["device"] == "CPU":
        line += "\n# these are CPU + MPI figures of the schedule, NOT GPU figures"
    return line


def make_local_inputs(rank: int, size: int, *, batch: int, seqlen: int, heads: int, kv_heads: int,
                      headdim: int, dtype: str, layout: str = "contiguous", seed: int = 0):
    """This rank's (q, k, v, dout) for a global sequence of `seqlen` tokens.

    q, dout: (batch, seqlen/size, heads, headdim); k, v: (batch, seqlen/size, kv_heads, headdim).
    Each rank draws only its own shard (seeded by rank), so no rank builds the whole sequence;
    values are N(0, 1), which keeps softmax well conditioned for timing.
    """
    from burstcu.layout import shard_slices

    shard_slices(layout, rank, size, seqlen)  # raises a clear error when seqlen does not divide
    dt = _dtype(dtype)
    rng = np.random.default_rng([seed, rank])
    s = seqlen // size
    shapes = [(batch, s, heads, headdim), (batch, s, kv_heads, headdim),
              (batch, s, kv_heads, headdim), (batch, s, heads, headdim)]
    return [rng.standard_normal(shape, dtype=np.float32).astype(dt) for shape in shapes]


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name).type


def median(xs) -> float:
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else float("nan")


def cuda_event_times_ms(fn, warmup: int, repeats: int, sync_inside: bool = False) -> list[float]:
    """Milliseconds of each of `repeats` calls of fn() between CUDA events on CuPy's current
    stream, after `warmup` calls. sync_inside: synchronize the whole device before the start and
    before the stop event, for work other libraries issue on their own streams (a few
    microseconds of host latency then enter every figure)."""
    import cupy

    for _ in range(warmup):
        fn()
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
        times.append(float(cupy.cuda.get_elapsed_time(start, stop)))
    return times


def fmt_s(seconds) -> str:
    if seconds is None or seconds != seconds:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds * 1e6:.0f}us"


def fmt_bytes(n) -> str:
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


def write_json(path, obj) -> None:
    """Write `obj` as strict JSON (see `clean`), creating the folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean(obj), f, indent=1, allow_nan=False)
        f.write("\n")


def add_problem_args(p, *, seqlen: int, dtype: str) -> None:
    """The problem-shape options every per-strategy benchmark takes."""
    p.add_argument("--seqlen", type=int, default=seqlen, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dtype", default=dtype, choices=["float16", "bfloat16", "float32", "float64"])
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
