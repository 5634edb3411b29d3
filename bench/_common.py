"""Helpers every benchmark in bench/ shares, each once (bench/README.md), imported as `bench._common`;
a bench script given an output path it cannot write, or --plot where matplotlib is missing, ends
here on every rank, before measuring anything (`refuse_at_start`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from burstcu import engine
from burstcu.demo import positive_int as positive   # the scripts' options of an int >= 1
from burstcu.ops.base import DelegatingOps

ROOT = Path(__file__).resolve().parents[1]


def world():
    """(comm, rank, size): MPI.COMM_WORLD when mpi4py loads an MPI library, else (None, 0, 1)."""
    from burstcu.transport.bootstrap import world_comm
    comm = world_comm()
    return (None, 0, 1) if comm is None else (comm, comm.Get_rank(), comm.Get_size())


def environment(group=None, synchronized: bool = False, **extra) -> dict:
    """What the figures were measured on; a GPU only where the backend ran on one (synchronized:
    the script syncs the device inside its timings; a `timing` among `extra` names how instead)."""
    from threadpoolctl import threadpool_info    # a core dependency
    keep = ("internal_api", "version", "num_threads", "architecture")
    blas = [{k: info.get(k) for k in keep} for info in threadpool_info()]
    try:
        from mpi4py import MPI
        mpi = MPI.Get_library_version().splitlines()[0].replace("\x00", "").strip()
    except Exception:
        mpi = None
    on_gpu = getattr(getattr(group, "ops", None), "device", "cpu") == "cuda"
    transport = getattr(group, "transport", None)
    gpu = ("GPU (wall time around each call, device synchronized)" if synchronized
           else "GPU (host-side enqueue timings)")
    if "timing" in extra:
        gpu = f"GPU ({extra['timing']})"
    threads = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    return {"device": gpu if on_gpu else "CPU", "backend": getattr(group, "backend", "numpy"),
            "host": socket.gethostname(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__, "blas": blas,
            "thread_env": {v: os.environ.get(v) for v in threads}, "mpi": mpi,
            "transport": getattr(transport, "name", None),
            "progress": getattr(transport, "progress", None), "ranks": getattr(group, "size", 1),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}


def gather(group, obj) -> list | None:
    """Every rank's `obj` in rank order on rank 0 (None elsewhere)."""
    return group.comm.gather(obj, root=0) if group.comm is not None and group.size > 1 else [obj]


def environment_on_rank0(group, print_header: bool = False, **extra) -> dict | None:
    """`environment`, then `group` closed: the environment on rank 0, None elsewhere."""
    env = environment(group, **extra)
    group.close()
    if group.rank == 0 and print_header:
        print(measured_on(env).splitlines()[0])
    return env if group.rank == 0 else None


def measured_on(env: dict) -> str:
    """One human line: what ran, and a reminder that CPU numbers are not GPU numbers."""
    threads = env["thread_env"].get("OMP_NUM_THREADS") or "default"
    line = (f"# measured on {env['device']}: backend={env['backend']}, {env['ranks']} rank(s) on "
            f"{env['cpus']} cores, BLAS threads={threads}, transport={env['transport']}"
            f" (progress={env['progress']}), MPI={env['mpi']}")
    cpu = "\n# these are CPU + MPI figures of the schedule, NOT GPU figures"
    return line + cpu if env["device"] == "CPU" else line


def gpu_versions(backend: str = "cupy") -> dict:
    """Package versions and the device a GPU script ran on."""
    from burstcu.testing.checks import device_name, versions
    device = device_name(backend) if backend == "cupy" else "CPU (kernel emulator): NOT GPU figures"
    return {**versions(), "backend": backend, "device": device}


def array_dtype(name: str):
    """The NumPy scalar type named "float16", "bfloat16" (ml_dtypes'), "float32" or "float64"."""
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name).type


def local_inputs(group, args=None, **shape) -> list:
    """This rank's q, k, v, dout (batch, seqlen/G, heads or kv_heads, headdim), N(0, 1), in the
    group's array library: the shape options of `args` (`add_shape_args`, --seqlen), `shape`
    (batch=, seqlen=, heads=, kv_heads=, headdim=, dtype=, layout=) over them."""
    keys = ("batch", "seqlen", "heads", "kv_heads", "headdim", "dtype")
    s = {"layout": "contiguous", **{k: getattr(args, k) for k in keys if hasattr(args, k)}, **shape}
    if s["seqlen"] % group.size:   # the figures are labelled with the seqlen: it must be what ran
        raise SystemExit(f"seqlen {s['seqlen']} over {group.size} ranks: pass a multiple of "
                         f"{group.size} (every rank takes seqlen / {group.size} rows)")
    kv, n = s["kv_heads"] or s["heads"], s["seqlen"] // group.size
    shapes = [(s["batch"], n, h, s["headdim"]) for h in (s["heads"], kv, kv, s["heads"])]
    return [getattr(group.ops, "xp", np).asarray(x) for x in normal(np, shapes, s["dtype"], [0, group.rank])]


def normal(xp, shapes, dtype: str, seed) -> list:
    """N(0, 1) arrays of `shapes` (NumPy or CuPy `xp`), float32 draws cast to `dtype`, seeded."""
    rng = xp.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=xp.float32).astype(array_dtype(dtype)) for shape in shapes]


def document_mix(total: int, seed: int = 0, median: float = 64, sigma: float = 1.75,
                 shortest: int = 8) -> tuple[int, ...]:
    """cu_seqlens (0, ..., total) of a seeded mix of log-normal lengths (median `median`, shape
    `sigma`) clipped to [shortest, total // 2]; the last document is cut to fit."""
    rng = np.random.default_rng(seed)
    bounds, longest = [0], max(shortest, total // 2)
    while bounds[-1] < total:
        length = int(np.clip(round(rng.lognormal(np.log(median), sigma)), shortest, longest))
        bounds.append(min(total, bounds[-1] + length))
    return tuple(bounds)


def gpu_shape(tokens: int, width: int, seqlen: int, d: int) -> tuple[int, int, int, int]:
    """(B, S, H, D) with B * S = tokens and H * D = width."""
    return max(1, tokens // seqlen), seqlen, max(1, width // d), d


def warm_up(fn, calls: int = 1, seconds: float = 0.0, wait=None) -> int:
    """Call fn() at least `calls` times and on until `seconds` have passed on the host clock (a
    GPU's clocks rise from idle and its caches fill before a timing means anything), wait() after
    each (a device sync: else the host, faster than the device, would queue seconds of calls in
    those milliseconds); the calls made."""
    made, t0 = 0, time.perf_counter()
    while made < calls or time.perf_counter() - t0 < seconds:
        fn()
        if wait is not None:
            wait()
        made += 1
    return made


def call_seconds(fn, repeats: int, warmup: int = 1, *, cuda: bool = False, sync_inside: bool = False,
                 pipelined: bool = False, warmup_s: float = 0.0, before=None, after=None) -> list[float]:
    """Seconds of each of `repeats` calls of fn() after `warm_up(fn, warmup, warmup_s)` (with cuda,
    the device synced after each warm-up call): the host clock around fn() and after() (a sync),
    before() (a barrier) untimed ahead of each; or (cuda) CUDA events on CuPy's current stream
    around each call, the host waiting for each call before the next (a call's interval then
    holds its host time before its first launch), or (pipelined) every call issued back to back
    and one wait at the end (an interval then holds the device's time of its call where the
    device is the busier, as in a training loop, the host's where the host is: the calls must run
    on CuPy's current stream); sync_inside syncing the device around fn() (work on other
    streams)."""
    if cuda:
        import cupy
        device = cupy.cuda.Device()
    if warm_up(fn, warmup, warmup_s, device.synchronize if cuda else None) and after is not None:
        after()
    if cuda:
        device.synchronize()
        if pipelined:
            assert before is None and not sync_inside, "a pipelined timing waits only at its end"
            marks = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
            for start, stop in marks:
                start.record()
                fn()
                stop.record()
            device.synchronize()
            return [float(cupy.cuda.get_elapsed_time(start, stop)) * 1e-3 for start, stop in marks]
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if cuda:
            if sync_inside:
                device.synchronize()
            start.record()
            fn()
            if sync_inside:
                device.synchronize()
            stop.record()
            stop.synchronize()
            times.append(float(cupy.cuda.get_elapsed_time(start, stop)) * 1e-3)
            continue
        t0 = time.perf_counter()
        fn()
        if after is not None:
            after()
        times.append(time.perf_counter() - t0)
    return times


def rounds_of_calls(fns: list, rounds: int, repeats: int, warmup: int = 1, warmup_s: float = 0.0,
                    around=contextlib.nullcontext, **timing) -> list[tuple[list, list]]:
    """Time each of `fns` (None: skipped) in `rounds` rounds that take them in turn, so that a
    drift of the device's clocks spreads over all of them: in a round each is warmed up
    (`call_seconds(fn, 0, warmup, warmup_s=warmup_s, **timing)`), then `call_seconds(fn,
    repeats, 0, **timing)` runs inside `around()`. Per fn: (every call's seconds, each round's
    median)."""
    out = [([], []) for _ in fns]
    for _ in range(rounds):
        for fn, (every, medians) in zip(fns, out):
            if fn is None:
                continue
            call_seconds(fn, 0, warmup, warmup_s=warmup_s, **timing)
            with around():
                times = call_seconds(fn, repeats, 0, **timing)
            every += times
            medians.append(median(times))
    return out


def torch_shares_cupy_stream() -> bool:
    """Whether torch's current CUDA stream is CuPy's current one (by default both are the legacy
    default stream): then CUDA events on CuPy's stream time torch's work as they time ours."""
    import cupy
    import torch
    return int(torch.cuda.current_stream().cuda_stream) == int(cupy.cuda.get_current_stream().ptr)


def l2_flush(xp):
    """A call that reads a buffer of twice the GPU's L2, then waits for the device, so that a call
    timed after it reads its inputs from HBM, as a decode step does once every other layer has run
    since the last (a 4K-row cache of 8 kv heads is 16 MiB, less than an H100's L2). It only
    reads: lines it wrote would be written back to HBM during the timed call. None where xp is
    not CuPy."""
    if getattr(xp, "__name__", "") != "cupy":
        return None
    device = xp.cuda.Device()
    scratch = xp.ones(2 * int(device.attributes["L2CacheSize"]) // 4, xp.int32)
    return lambda: (xp.sum(scratch), device.synchronize())


def slowest_rank_seconds(group, fn, repeats: int, warmup: int = 0, after=None, before=None) -> float:
    """Median over `repeats` calls of fn(), started together, of the slowest rank's seconds;
    before() runs untimed ahead of each call's barrier."""
    ready = group.barrier if before is None else (lambda: (before(), group.barrier()))
    mine = call_seconds(fn, repeats, warmup, before=ready, after=after)
    every = group.transport.allgather_object(mine, "bench timing")
    return median([max(per_rank) for per_rank in zip(*every)])


def overlap_efficiency(t_compute: float, t_comm: float, t_overlapped: float) -> float | None:
    """(t_compute + t_comm - t_overlapped) / t_comm: the fraction of the exchange hidden behind
    compute; None without an exchange."""
    return (t_compute + t_comm - t_overlapped) / t_comm if t_comm > 0 else None


def median(xs) -> float:
    """The median of the values that are not None (NaN when none is)."""
    xs = [x for x in xs if x is not None]
    return float(statistics.median(xs)) if xs else float("nan")


class StepTimingOps(DelegatingOps):
    """Delegates to `inner`, each step through `timed(fn, *args)` (a subclass's clock noting an
    interval in `intervals`); with compute=False a step gets no blocks."""

    def __init__(self, inner, compute: bool):
        super().__init__(inner)
        self.compute, self.intervals = compute, []

    def timed(self, fn, *args) -> None:
        raise NotImplementedError

    def forward_step(self, state, k, v, blocks, last=False):
        self.timed(self.inner.forward_step, state, k, v, blocks if self.compute else [], last)

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum=None):
        self.timed(self.inner.backward_step, ctx, q, dout, lse, delta, dq,
                   blocks if self.compute else [], psum)


def fmt_s(seconds) -> str:
    """Seconds as "1.23s", "4.56ms" or "78us"; "-" for None or NaN."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f}s"
    return f"{seconds * 1e3:.2f}ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f}us"


def fmt_bytes(n) -> str:
    """A byte count as "512B", "1.50KiB", "2.00MiB" or "3.00GiB"."""
    n = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.2f}{unit}"
        n /= 1024
    return f"{n:.2f}GiB"


def table(rows: list, columns: list) -> str:
    """Aligned text table of `rows` (dicts) with the given column keys, header first."""
    def cell(v) -> str:
        return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[str(c) for c in columns]] + [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells)


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
    return None if isinstance(x, float) and (x != x or abs(x) == float("inf")) else x


def write_json(path, obj) -> None:
    """`obj` as strict JSON (`clean`), atomically: a run killed mid-write leaves the last one;
    readable as the tables and plots beside it are (the umask's mode, not the temp file's 0600)."""
    from burstcu.build.compile import atomic_write

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(path), (json.dumps(clean(obj), indent=1, allow_nan=False) + "\n").encode())
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without setting it (os.umask sets it, for every thread);
    0o022 where the kernel does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def emit(text: str | None, result, args):
    """Rank 0's output: `text` on stdout and to args.table, `result` to args.json; `result`."""
    if text is not None:
        print(text, flush=True)
        if getattr(args, "table", None):
            Path(args.table).parent.mkdir(parents=True, exist_ok=True)
            Path(args.table).write_text(text + "\n")
    if getattr(args, "json", None):
        write_json(args.json, result)
    return result


def print_and_write(env: dict, rows: list, columns: list, args) -> None:
    """`emit` of a measured table: the environment line and the table; with arguments, as JSON."""
    emit(measured_on(env) + "\n" + table(rows, columns),
         {"environment": env, "args": clean(vars(args)), "rows": rows}, args)


def no_gpu(script: str, dry_run: bool = True) -> int | None:
    """Exit status 2, with one line that says so, where no CUDA GPU is usable (a GPU script, or a
    CPU script given --backend cupy, run on a machine without one; `dry_run`: the script's
    --dry-run still works there); None where one is."""
    from burstcu.transport.bootstrap import device_count

    count, why = device_count()
    if count >= 1:
        return None
    print(f"# {script}: no GPU here ({why or 'no CUDA device'})"
          + ("; --dry-run shows what it would run" if dry_run else ""), file=sys.stderr)
    return 2


def at_least(low: float, strict: bool = False):
    """An argparse type: a finite float >= low (> low when strict)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low):
            bound = "above" if strict else "at least"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound} {low:g}, got {text}")
        return value
    return parse


def add_shape_args(p, *, heads: int = 4, headdim: int = 64, dtype: str = "float32",
                   dtypes=("float16", "bfloat16", "float32", "float64"),
                   kv_heads_help: str = "default: --heads (MHA)") -> None:
    """--batch, --heads, --kv-heads, --headdim, --dtype: the arrays' shape and dtype options
    (--kv-heads None unless given: the caller's default, which kv_heads_help says)."""
    p.add_argument("--batch", type=positive, default=1)
    p.add_argument("--heads", type=positive, default=heads)
    p.add_argument("--kv-heads", type=positive, default=None, help=kv_heads_help)
    p.add_argument("--headdim", type=positive, default=headdim)
    p.add_argument("--dtype", default=dtype, choices=list(dtypes))


def add_problem_args(p, *, seqlen: int, dtype: str) -> None:
    """The problem-shape options every per-strategy benchmark takes."""
    p.add_argument("--seqlen", type=positive, default=seqlen, help="global sequence length")
    add_shape_args(p, dtype=dtype)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--strategies", nargs="+", default=["burst", "ring", "allgather", "ulysses"],
                   choices=list(engine.NAMES))
    p.add_argument("--json", default=None)


def add_output_args(p) -> None:
    """--json, --table, --plot."""
    for name in ("--json", "--table", "--plot"):
        p.add_argument(name, default=None)


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: str, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def _output_paths(argv) -> list[tuple[str, str]]:
    """(option, path) for each --json, --table, --plot and --out in argv ("--json F" or
    "--json=F")."""
    found = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--json", "--table", "--plot", "--out"):
            if eq:
                found.append((name, value))
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                found.append((name, argv[i + 1]))
    return found


def unwritable(path: str) -> str | None:
    """Why a file could not be written at `path` (a folder there, or a folder on the way that
    is a file or not writable), or None: the check a script makes before measuring, so a run
    does not end, after its work, on a path it cannot write."""
    target = Path(path)
    if target.is_dir():
        return "is a folder"
    folder = target.parent
    while not folder.exists():       # write_json and the tables make the missing folders
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    if target.exists() and not os.access(target, os.W_OK):
        return "is not writable"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    return None


def start_problems(argv) -> list[str]:
    """What stops this rank's run before it measures anything: an output path (--json,
    --table, --plot, --out) it cannot write, --plot without matplotlib (optional: only --plot
    needs it)."""
    problems = []
    for name, path in _output_paths(argv):
        try:
            why = unwritable(path)
        except OSError as exc:   # a name too long, a folder on the way this user cannot read
            why = f"cannot be checked ({exc.strerror or exc})"
        if why is not None:
            problems.append(f"cannot write {name} {path}: {why}")
    if any(arg == "--plot" or arg.startswith("--plot=") for arg in argv):
        try:
            __import__("matplotlib")
        except ImportError as exc:
            problems.append(f"--plot needs matplotlib ({exc}): pip install 'burstcu[bench]'")
    return problems


def refuse_at_start(argv) -> None:
    """SystemExit(2) on every rank, before any work, where `start_problems` finds one on some
    rank; the first rank says which, and on which ranks where not on all. Under an MPI launcher
    of several ranks the ranks compare them first, in one bounded round after MPI's start, and
    leave together once the first has said it: a rank that ended alone left the others waiting
    in MPI's start (MPICH's mpiexec), or ended the job before the first rank had said why (Open
    MPI's; mpi4py's runner, under launch/burstcu-run, aborts at a non-zero exit)."""
    from burstcu.transport.base import DEFAULT_TIMEOUT, deadline_after, poll_until, resolve_timeout
    from burstcu.transport.bootstrap import launched_as_mpi_ranks, world_comm
    from burstcu.transport.mpi import gather_plain

    mine, comm = start_problems(argv), None
    if not launched_as_mpi_ranks():
        every = [mine]
    else:
        comm = world_comm()
        try:
            timeout = resolve_timeout(None)
        except ValueError:   # $BURSTCU_TIMEOUT unreadable: burstcu.init says so on every rank
            timeout = DEFAULT_TIMEOUT
        every = gather_plain(comm, mine, timeout, "the bench script's start")
    if not any(every):
        return
    if comm is None or comm.Get_rank() == 0:
        said = []
        for problem in dict.fromkeys(p for problems in every for p in problems):
            ranks = [r for r, problems in enumerate(every) if problem in problems]
            said.append(problem if len(ranks) == len(every) else f"{problem} (rank(s) {ranks})")
        sys.stderr.write(f"{Path(sys.argv[0]).name}: " + "; ".join(said) + "\n")
        sys.stderr.flush()
    if comm is not None:   # every rank is here: they agreed to end
        poll_until(comm.Ibarrier().Test, deadline_after(timeout), lambda: SystemExit(2))
    raise SystemExit(2)


_MAIN = getattr(sys.modules.get("__main__"), "__file__", None)
if _MAIN is not None and Path(_MAIN).resolve().is_relative_to(ROOT / "bench"):
    refuse_at_start(sys.argv[1:])
