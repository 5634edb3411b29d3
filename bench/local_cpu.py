"""One-rank CPU attention, forward and backward: burstcu's NumPy backend against PyTorch's CPU
`scaled_dot_product_attention` (and a naive NumPy forward) — same shapes, threads and run.

    python bench/local_cpu.py [--seqlen 1024 4096] [--threads 1 2] [--masks full causal]
                              [--heads 8] [--headdim 64] [--batch 1] [--repeats 5]
                              [--no-backward] [--naive-max 1024] [--score-std 1] [--matmul-size 2048]
                              [--no-mkl] [--json FILE] [--plot FILE]

For each (threads, seqlen, mask) burstcu and torch run interleaved — one repetition of each in
turn, --repeats times, after one warm-up each — so a slow spell of the machine hits them alike;
times are medians. The naive forward runs after them: OpenBLAS's threads spin on for a while
after it and would slow whatever came next. BLAS and torch are held to the same thread count
(threadpoolctl, torch.set_num_threads) and burstcu runs a group of one process, as `group=None`
gives, with its NumPy op on that many threads. Inputs are float32, converted to each library's
layout outside the timed region. Backward: burstcu.attention_backward against SDPA's backward
alone (torch.autograd.grad of the SDPA output for the same dout, graph kept between repetitions).
Inputs are standard normal, so the scores (softmax_scale * q.k) have std 1; --score-std X scales
q to make it X: a trained model's attention is more peaked than that, and an online softmax that
folds lazily (burstcu's) meets new row maxima more often there.

Memory, on a fresh op (nothing kept from earlier calls): tracemalloc's peak over one burstcu
forward and one backward call — every NumPy allocation inside them: the op's (B, H, S, D)-sized
copies and state, the ring's message buffers, the scratch, the outputs — and
`NumpyOps.scratch_bytes` (per-thread tiles and the backward's O(S*D) dq partials) and
`tile_scratch_bytes` (the tiles alone), each against one S x S float32 score matrix, which the
op never forms.

Matmuls are most of the burstcu time, and their speed is the BLAS kernels': the header line
names the kernels NumPy's OpenBLAS picked (OPENBLAS_CORETYPE, set in the environment, overrides
the choice; `burstcu.ops.numpy.tiled.blas_advice` says when AVX-512 ones would run and are not).
So each thread count starts with the matmul peaks: a float32 n^3 matmul (--matmul-size, 2048)
on one thread through NumPy's BLAS and through torch (which brings its own BLAS, MKL in its
x86-64 CPU wheels), times the thread count (`matmul_peaks`); every row's `of_matmul_peak` is its
GFLOP/s over that peak of its own library's matmuls: how
close each implementation comes to the ceiling its kernels set, which differs between the two
(a square matmul runs faster than attention's thin ones, 512 x 65 x 512: no implementation
reaches 1).

The kernels also set a floor, and it can rule a target out: `TileKernels` times each library's
float32 matmuls at the NumPy op's forward tile shape (512 x headdim scores against 512 keys,
then P against V) and its exp over such a tile (np.exp, torch.exp), one-thread kernels on all
the threads at once, interleaved with each configuration's attention runs. A row's `floor_s` is
its pass at those rates (medians) with nothing else: its matmul FLOPs at the tile GEMM rate
plus one exp a score. `of_floor` is that over the row's time (1: no time beside those kernels),
and a burstcu row's `floor_vs_torch` its floor over torch's time: about the least ratio to torch
that NumPy's BLAS and exp allow on this CPU, an estimate within the runs' noise (a run's
of_floor can read a little above 1). The forward's tiles are those shapes; the backward's are
256-row tiles with transposed products, priced at the forward tile's rates. The exp run writes
a second tile where the op's exp works in place. torch's SDPA blocks its work its own way and
can beat the floor measured with torch.mm at these shapes: its `of_floor` may read above 1.
Where Intel MKL's runtime library loads (`pip install mkl` into the environment; --no-mkl leaves
it out), the tile kernels run a third set, MKL's sgemm and VML's exp, through ctypes, and each
burstcu row gets `mkl_floor_vs_torch`: its floor if the op ran on those kernels — what a
switch of kernels could win, measured before making it. burstcu never calls MKL itself.

Speed targets (`SPEED_TARGETS`): at the default shape, burstcu's forward at most 1.0x torch's
time at seqlen 4096 and 1.2x at 1024, its backward at most 1.0x, on any thread count and mask.
Each such burstcu row carries `target` and `meets_target`, and a table lists them beside the
floors: a target below a row's floor_vs_torch is out of reach of those kernels on this CPU.

Prints a progress line per configuration on stderr, then the tables; writes JSON and, with
--plot, a PNG of each time against torch's. FLOPs: 4*B*H*S^2*D forward, 2.5 times that backward
(five matmuls to two), halved when causal.
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

# torch's OpenMP threads (libgomp) otherwise spin for a while after each call and take a core
# from whatever runs next — here the other implementation, interleaved. Passive waiting leaves
# torch's own times as they are (within 2%, each configuration measured both ways) and must be
# set before libgomp loads. An explicit setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np

from _common import environment, fmt_bytes, median, progress, table, write_json  # noqa: I001 - sets sys.path

import burstcu
from burstcu.ops.numpy.tiled import TILE_K, TILE_Q, NumpyOps, blas_advice
from burstcu.transport.base import SelfTransport


def naive_numpy(q, k, v, causal):
    """Full score matrix, explicit softmax: (B,S,H,D) in, (B,S,H,D) out, O(S^2) memory."""
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = np.where(np.tri(n, dtype=bool), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", s, v)


def torch_runs(q, k, v, dout, causal, backward):
    """{(pass, "torch sdpa"): callable} on (B,H,S,D) copies of the inputs; {} without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}
    tq, tk, tv, tdo = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))
                       for x in (q, k, v, dout))

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
    runs = {("forward", "torch sdpa"): forward}
    if backward:
        leaves = [x.clone().requires_grad_() for x in (tq, tk, tv)]
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        runs[("backward", "torch sdpa")] = lambda: torch.autograd.grad(out, leaves, tdo, retain_graph=True)
    return runs


class Elapsed(float):
    """Seconds a run measured itself and returns to `interleaved` as its time (a plain float or
    NumPy scalar a run returns is not one)."""


def interleaved(runs: dict, repeats: int) -> dict:
    """{key: [seconds, ...]}: one warm-up of each, then `repeats` rounds running each once (a run
    returning `Elapsed` has timed itself: that is its time)."""
    for fn in runs.values():
        fn()   # first-touch allocations, thread pools, BLAS buffers
    times = {key: [] for key in runs}
    for _ in range(repeats):
        for key, fn in runs.items():
            t0 = time.perf_counter()
            got = fn()
            elapsed = time.perf_counter() - t0
            times[key].append(float(got) if isinstance(got, Elapsed) else elapsed)
    return times


def matmul_peaks(torch, threads: int, n: int = 2048, repeats: int = 3) -> dict:
    """{"numpy": GFLOP/s, "torch": GFLOP/s or None, ...}: `threads` times the rate of one float32
    n x n x n matmul on one thread (median of `repeats`, after a warm-up) through NumPy's BLAS
    and through torch — the ceiling of an attention that runs one-thread matmuls on each of
    `threads` threads, as both do (burstcu's work items; torch's SDPA, parallel over heads and
    blocks). One thread, not `threads`: a threaded square matmul measures how the BLAS splits
    one product (torch's gained 1.4x from a second thread here), not that ceiling."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    c = np.empty_like(a)
    runs = {"numpy": lambda: np.matmul(a, b, out=c)}   # into one output: no page faults timed
    if torch is not None:
        ta, tb, tc = torch.from_numpy(a), torch.from_numpy(b), torch.empty(n, n)
        runs["torch"] = lambda: torch.mm(ta, tb, out=tc)
        torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            one = {name: 2 * n ** 3 / median(ts) / 1e9 for name, ts in interleaved(runs, repeats).items()}
    finally:
        if torch is not None:
            torch.set_num_threads(threads)
    return {"threads": threads, "n": n, "numpy": threads * one["numpy"],
            "torch": threads * one["torch"] if "torch" in one else None,
            "numpy_one_thread": one["numpy"], "torch_one_thread": one.get("torch")}


MKL_ROW_MAJOR, MKL_NO_TRANS, MKL_TRANS = 101, 111, 112    # CBLAS enums
MKL_SEQUENTIAL, MKL_LP64 = 1, 0   # MKL_Set_Threading_Layer's sequential layer; 32-bit integer arguments
VML_HA = 2   # VML's high-accuracy mode: within 1 ulp (np.exp: ~2); as fast as its low-accuracy one here


def mkl_runtime():
    """Intel MKL's runtime library, libmkl_rt (`pip install mkl` puts it in the environment's
    lib/), through ctypes on its sequential layer — one thread a call, as every tile kernel runs
    — and its LP64 interface, with cblas_sgemm's and vmsExp's signatures set; None where none
    loads or MKL, already started in this process, keeps other layers (`mkl_paths()`: the files
    it tries). Loading it has effects for the process's life: threadpoolctl then
    sees a second BLAS, one thread. Only the benchmark uses it: the third kernel set of
    `TileKernels`, what burstcu's floor would be on MKL's kernels."""
    import ctypes
    for path in mkl_paths():
        try:
            lib = ctypes.CDLL(path)
            # before any other call into MKL; each returns the layer now in force
            if (lib.MKL_Set_Threading_Layer(MKL_SEQUENTIAL), lib.MKL_Set_Interface_Layer(MKL_LP64)) != (
                    MKL_SEQUENTIAL, MKL_LP64):
                continue
            i, f, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
            lib.cblas_sgemm.argtypes = [i, i, i, i, i, i, f, ptr, i, ptr, i, f, ptr, i]
            lib.cblas_sgemm.restype = None
            lib.vmsExp.argtypes = [i, ptr, ptr, ctypes.c_longlong]
            lib.vmsExp.restype = None
        except (OSError, AttributeError):   # not loadable, or not MKL's runtime
            continue
        return lib
    return None


def mkl_paths() -> list:
    """The libmkl_rt files `mkl_runtime` tries, none loaded: the system's, then the environment's."""
    import ctypes.util
    import glob
    import sys
    found = ctypes.util.find_library("mkl_rt")
    return ([found] if found else []) + sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))


class TileKernels:
    """The work one attention tile holds, per kernel set, as runs for `interleaved`: the float32
    matmuls of the NumPy op's forward tile (TILE_Q x headdim scores against TILE_K keys as a
    transposed view, then the TILE_Q x TILE_K P against TILE_K x headdim V) and exp over such a
    tile on scores shifted as an online softmax shifts them. Kernel sets ("libs"): "numpy" (its
    BLAS's matmul, np.exp), "torch" (torch.mm, torch.exp) when torch is given, and "mkl" when
    `mkl` (`mkl_runtime()`) is (cblas_sgemm, and vmsExp in VML's high-accuracy mode). Each run
    makes `calls` calls on each of `threads` threads at once, every thread on its own one-thread
    kernels and arrays (as burstcu's work items and torch's SDPA run them), and returns the
    seconds from the common start to the last thread's end (the thread limits are set outside
    that time). Interleaved with the attention runs of a configuration, the rates
    see the machine as those runs do; concurrent, what threads lose to each other counts."""

    def __init__(self, torch, threads: int, headdim: int, calls: int = 30, mkl=None):
        from threadpoolctl import ThreadpoolController
        self.torch, self.mkl, self.threads, self.calls = torch, mkl, threads, calls
        self.shape = (TILE_Q, TILE_K, headdim)
        self.libs = ["numpy"] + ([] if torch is None else ["torch"]) + ([] if mkl is None else ["mkl"])
        rng = np.random.default_rng(2)
        made = {lib: [self._kernels(lib, rng) for _ in range(threads)] for lib in self.libs}
        self.kernels = {lib: [kernels for kernels, _ in per_thread] for lib, per_thread in made.items()}
        self.arrays = {lib: [arrays for _, arrays in per_thread] for lib, per_thread in made.items()}
        self.thread_limits = ThreadpoolController()   # every BLAS and OpenMP library loaded
        self.pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def _kernels(self, lib, rng):
        """((matmuls, exp), arrays) for one thread: its two kernels of `lib` and the arrays they
        read and write — inputs q, k, v (rows or keys x d), p (rows x keys) and scores, outputs
        s = q k^T, o = p v and e = exp(scores)."""
        rows, keys, d = self.shape
        q, k, v = (rng.standard_normal((n, d), dtype=np.float32) for n in (rows, keys, keys))
        scores = rng.standard_normal((rows, keys), dtype=np.float32) - np.float32(3)
        s, o, e = np.empty((rows, keys), np.float32), np.empty((rows, d), np.float32), np.empty_like(scores)
        p = np.exp(scores)
        arrays = {"q": q, "k": k, "v": v, "p": p, "scores": scores, "s": s, "o": o, "e": e}
        if lib == "numpy":
            return (lambda: (np.matmul(q, k.T, out=s), np.matmul(p, v, out=o)),
                    lambda: np.exp(scores, out=e)), arrays
        if lib == "mkl":   # by address: `arrays`, returned with the kernels, keeps them alive
            gemm, exp = self.mkl.cblas_sgemm, self.mkl.vmsExp
            a = {name: x.ctypes.data for name, x in arrays.items()}

            def matmuls():   # row-major: s = q k^T (rows x keys, inner d), o = p v (rows x d, inner keys)
                gemm(MKL_ROW_MAJOR, MKL_NO_TRANS, MKL_TRANS, rows, keys, d,
                     1.0, a["q"], d, a["k"], d, 0.0, a["s"], keys)
                gemm(MKL_ROW_MAJOR, MKL_NO_TRANS, MKL_NO_TRANS, rows, d, keys,
                     1.0, a["p"], keys, a["v"], d, 0.0, a["o"], d)
            return (matmuls, lambda: exp(rows * keys, a["scores"], a["e"], VML_HA)), arrays
        mm, exp = self.torch.mm, self.torch.exp
        tq, tk, tv, ts, to, tp, tsc, te = map(self.torch.from_numpy, (q, k, v, s, o, p, scores, e))
        return (lambda: (mm(tq, tk.T, out=ts), mm(tp, tv, out=to)), lambda: exp(tsc, out=te)), arrays

    def runs(self) -> dict:
        """{("tile matmuls" | "tile exp", lib): run returning its seconds}."""
        return {(kind, lib): self._run(lib, kernel) for lib in self.libs
                for kernel, kind in enumerate(("tile matmuls", "tile exp"))}

    def _run(self, lib, kernel: int):
        def one_thread(t):
            if lib == "torch":   # a pool thread's own OpenMP count: MKL's would be every core
                self.torch.set_num_threads(1)
            fn = self.kernels[lib][t][kernel]
            for _ in range(self.calls):
                fn()

        def run() -> Elapsed:
            restore = self.torch.get_num_threads() if lib == "torch" else None
            with self.thread_limits.limit(limits=1):
                try:
                    t0 = time.perf_counter()
                    if self.pool is None:
                        one_thread(0)
                    else:
                        list(self.pool.map(one_thread, range(self.threads)))
                    return Elapsed(time.perf_counter() - t0)
                finally:   # torch's intra-op count is the process's: one_thread set it to 1
                    if restore is not None:
                        self.torch.set_num_threads(restore)
        return run

    def rates(self, times: dict) -> dict:
        """{lib: {"gemm_gflops", "exp_ns", "matmuls_us", "exp_us"}} from `interleaved`'s times of
        `runs()`: the matmuls' float32 rate and exp's time per value (ns), all threads together
        (medians); *_us: one call on every thread."""
        rows, keys, d = self.shape
        rates = {}
        for lib in self.libs:
            mm, ex = (median(times[(kind, lib)]) / self.calls for kind in ("tile matmuls", "tile exp"))
            rates[lib] = {"gemm_gflops": self.threads * 4 * rows * keys * d / mm / 1e9,
                          "exp_ns": ex / (rows * keys) / self.threads * 1e9,
                          "matmuls_us": mm * 1e6, "exp_us": ex * 1e6}
        return rates

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()


def floor_seconds(rates: dict | None, flops: float, exps: float) -> float | None:
    """The time `flops` of matmuls and `exps` exps take at a library's `TileKernels.rates`: what an
    attention pass costs with nothing but its tiles' matmuls and exps, each at the rate it reaches
    on tiles of its own between the attention runs. None without rates."""
    if rates is None:
        return None
    return flops / (rates["gemm_gflops"] * 1e9) + exps * rates["exp_ns"] * 1e-9


# burstcu's time over torch SDPA's, at most, by (pass, seqlen): one rank, float32, at
# TARGET_SHAPE (batch, heads, headdim: the defaults), on any thread count, causal or not
SPEED_TARGETS = {("forward", 4096): 1.0, ("forward", 1024): 1.2, ("backward", 4096): 1.0, ("backward", 1024): 1.0}
TARGET_SHAPE = (1, 8, 64)


def mkl_version(mkl) -> str | None:
    """MKL's version string (`mkl_runtime()`'s library), or None without one."""
    if mkl is None:
        return None
    import ctypes
    buf = ctypes.create_string_buffer(256)
    mkl.MKL_Get_Version_String(buf, len(buf))
    return buf.value.decode(errors="replace").strip()


def speed_target(pass_: str, seqlen: int, shape: tuple) -> float | None:
    """The `SPEED_TARGETS` bound of a burstcu row of this (batch, heads, headdim) shape, or None
    where none is set."""
    return SPEED_TARGETS.get((pass_, seqlen)) if tuple(shape) == TARGET_SHAPE else None


def traced_peak(fn) -> int:
    """Peak bytes tracemalloc sees allocated during fn() (numpy reports its buffers to it)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def bench_config(args, threads: int, seqlen: int, causal: bool, peaks: dict, torch, mkl=None):
    """Timing rows, the memory row and the tile rates of one (threads, seqlen, mask); peaks:
    `matmul_peaks` on these threads (each row's `of_matmul_peak` is its GFLOP/s over its
    library's). The `TileKernels` run interleaved with the attention runs; from their rates each
    burstcu and torch row gets `floor_s`, `of_floor` = floor_s / seconds, and burstcu's
    `floor_vs_torch` = its floor_s / torch's seconds, `mkl_floor_vs_torch` the same with MKL's
    kernel rates (None without `mkl`), and `target` / `meets_target` (`speed_target`)."""
    rng = np.random.default_rng(0)
    shape = (args.batch, seqlen, args.heads, args.headdim)
    q, k, v, dout = (rng.standard_normal(shape, dtype=np.float32) for _ in range(4))
    q *= np.float32(args.score_std)
    ops = NumpyOps(threads=threads)
    group = burstcu.Group(0, 1, "numpy", SelfTransport(), ops)
    out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True)
    runs = {("forward", "burstcu"): lambda: burstcu.attention(q, k, v, group, causal=causal)}
    if not args.no_backward:
        runs[("backward", "burstcu")] = lambda: burstcu.attention_backward(
            dout, q, k, v, out, lse, group, causal=causal)
    runs.update(torch_runs(q, k, v, dout, causal, not args.no_backward))
    tile_kernels = TileKernels(torch, threads, args.headdim, mkl=mkl)
    try:
        times = interleaved({**runs, **tile_kernels.runs()}, args.repeats)
    finally:
        tile_kernels.close()
    rates = tile_kernels.rates(times)
    times = {key: ts for key, ts in times.items() if key in runs}
    if seqlen <= args.naive_max:   # after, not among them: its BLAS threads spin on after it
        times.update(interleaved({("forward", "naive numpy"): lambda: naive_numpy(q, k, v, causal)},
                                 args.repeats))
    scores = args.batch * args.heads * seqlen * seqlen * (0.5 if causal else 1)
    flops = 4 * scores * args.headdim
    mask = "causal" if causal else "full"
    rows = []
    for (pass_, impl), ts in times.items():
        t = median(ts)
        ref = times.get((pass_, "torch sdpa"))
        pass_flops = flops * (2.5 if pass_ == "backward" else 1)   # 5 matmuls to 2; one exp a score either way
        rows.append({"threads": threads, "seqlen": seqlen, "mask": mask, "score_std": args.score_std,
                     "pass": pass_, "impl": impl,
                     "seconds": t, "all_seconds": ts, "time_vs_torch": t / median(ref) if ref else None,
                     "gflops": pass_flops / t / 1e9})
        lib = "torch" if impl.startswith("torch") else "numpy"
        peak = peaks.get(lib)
        rows[-1]["of_matmul_peak"] = rows[-1]["gflops"] / peak if peak else None
        floor = floor_seconds(rates.get(lib), pass_flops, scores) if impl != "naive numpy" else None
        rows[-1]["floor_s"] = floor
        rows[-1]["of_floor"] = floor / t if floor else None
        rows[-1]["floor_vs_torch"] = floor / median(ref) if floor and ref and impl == "burstcu" else None
        if impl == "burstcu":
            mkl_floor = floor_seconds(rates.get("mkl"), pass_flops, scores)
            rows[-1]["mkl_floor_vs_torch"] = mkl_floor / median(ref) if mkl_floor and ref else None
            target = speed_target(pass_, seqlen, (args.batch, args.heads, args.headdim))
            rows[-1]["target"] = target
            rows[-1]["meets_target"] = rows[-1]["time_vs_torch"] <= target if target and ref else None
    group.close()
    config_rates = {"threads": threads, "seqlen": seqlen, "mask": mask, "tile": list(tile_kernels.shape), **rates}
    return rows, measure_memory(args, threads, seqlen, causal, (q, k, v, dout, out, lse)), config_rates


def measure_memory(args, threads: int, seqlen: int, causal: bool, arrays) -> dict:
    """tracemalloc peaks of one forward and one backward call on a fresh op (nothing kept from
    earlier calls, so its kept work arrays count too), and its scratch."""
    q, k, v, dout, out, lse = arrays
    ops = NumpyOps(threads=threads)
    group = burstcu.Group(0, 1, "numpy", SelfTransport(), ops)
    memory = {"threads": threads, "seqlen": seqlen, "mask": "causal" if causal else "full",
              "forward_peak": traced_peak(lambda: burstcu.attention(q, k, v, group, causal=causal)),
              "score_matrix": seqlen * seqlen * 4}
    if not args.no_backward:
        memory["backward_peak"] = traced_peak(
            lambda: burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal))
    for name in ("scratch", "tile_scratch"):
        memory[name] = getattr(ops, f"{name}_bytes", None)   # None: an op that does not count it
        if memory[name] is not None:
            memory[f"{name}_vs_score_matrix"] = memory[name] / memory["score_matrix"]
    group.close()
    return memory


def plot(rows: list, path: str) -> None:
    """Each configuration's time against torch's, forward and backward, with the 1.0 line; a
    black tick on a bar marks its `floor_vs_torch` where measured."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["impl"] == "burstcu" and r["time_vs_torch"] is not None]
    labels = sorted({(r["threads"], r["seqlen"], r["mask"]) for r in mine})
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)) + 2.5, 4))
    width = 0.4
    for i, pass_ in enumerate(("forward", "backward")):
        ratio = {(r["threads"], r["seqlen"], r["mask"]): r["time_vs_torch"] for r in mine if r["pass"] == pass_}
        floor = {(r["threads"], r["seqlen"], r["mask"]): r.get("floor_vs_torch") for r in mine if r["pass"] == pass_}
        shown = [(j + (i - 0.5) * width, key) for j, key in enumerate(labels) if key in ratio]
        ax.bar([x for x, _ in shown], [ratio[key] for _, key in shown], width, label=pass_)
        ticks = [(x, floor[key]) for x, key in shown if floor.get(key)]
        if ticks:
            ax.scatter(*zip(*ticks), marker="_", s=300, color="k", zorder=3,
                       label="floor: its matmuls and exps alone" if i == 0 else None)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(labels)), [f"{s} {m}\n{t} thr" for t, s, m in labels], fontsize=8)
    ax.set_ylabel("burstcu time / torch SDPA time")
    ax.set_title("one rank on the CPU, float32: below 1 is faster than torch")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description="one-rank CPU attention forward and backward: burstcu vs torch SDPA")
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--threads", type=int, nargs="+", default=None,
                   help="BLAS, torch and burstcu threads (default: 1 and all cores)")
    p.add_argument("--masks", nargs="+", choices=["full", "causal"], default=["full", "causal"])
    p.add_argument("--causal", action="store_true", help="the same as --masks causal")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--naive-max", type=int, default=1024, help="skip the O(S^2)-memory naive run above this")
    p.add_argument("--score-std", type=float, default=1.0, help="std of the scores (q is scaled to it)")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n^3 matmul that measures each library's peak")
    p.add_argument("--no-mkl", action="store_true",
                   help="leave MKL's kernel set out of the tile rates even where its runtime loads")
    p.add_argument("--json", default="bench/out/local_cpu.json")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    masks = ["causal"] if args.causal else args.masks
    threads_list = args.threads or sorted({1, os.cpu_count() or 1})

    from threadpoolctl import threadpool_limits
    try:
        import torch
    except ImportError:
        torch = None
    mkl = None if args.no_mkl else mkl_runtime()
    rows, memory, peaks, tile_rates = [], [], [], []
    env = environment(None, threads=threads_list, torch=None if torch is None else torch.__version__,
                      omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), mkl=mkl_version(mkl))
    for threads in threads_list:
        if torch is not None:
            torch.set_num_threads(threads)
        with threadpool_limits(limits=threads):
            progress(f"{threads} thread(s), matmul peaks")
            peaks.append(matmul_peaks(torch, threads, args.matmul_size))
            for seqlen in args.seqlen:
                for mask in masks:
                    progress(f"{threads} thread(s), seqlen {seqlen}, {mask}")
                    got, mem, config_rates = bench_config(args, threads, seqlen, mask == "causal", peaks[-1], torch,
                                                          mkl)
                    rows += got
                    memory.append(mem)
                    tile_rates.append(config_rates)
    cores = sorted({str(b.get("architecture")) for b in env["blas"] if b.get("internal_api") == "openblas"})
    print(f"one rank, float32, batch {args.batch}, heads {args.heads}, headdim {args.headdim}, "
          f"score std {args.score_std:g}, median of {args.repeats} interleaved repetitions, measured on the CPU "
          f"(NumPy's OpenBLAS: {'/'.join(cores) or 'not found'} kernels"
          f"{', OPENBLAS_CORETYPE=' + os.environ['OPENBLAS_CORETYPE'] if os.environ.get('OPENBLAS_CORETYPE') else ''})")
    advice = blas_advice()
    if advice:
        print(f"note: {advice}")
    for peak in peaks:
        torch_rate = "not measured (no torch)" if peak["torch"] is None else f"{peak['torch']:.1f}"
        print(f"matmul peak, float32 {peak['n']}^3 on one thread, times {peak['threads']}: NumPy's BLAS "
              f"{peak['numpy']:.1f} GFLOP/s, torch {torch_rate} GFLOP/s")
    print(table(rows, ["threads", "seqlen", "mask", "pass", "impl", "seconds", "gflops", "time_vs_torch",
                       "of_matmul_peak", "of_floor", "floor_vs_torch"]))
    if tile_rates:
        shape = "{0} x {2} x {1} and {0} x {1} x {2}".format(*tile_rates[0]["tile"])
        print(f"\ntile work, interleaved with each configuration's runs: float32 {shape} matmuls (GFLOP/s) "
              "and exp over the tile (ns a value), one-thread kernels on every thread at once")
        print(table([{"threads": t["threads"], "seqlen": t["seqlen"], "mask": t["mask"], "lib": lib,
                      "gemm_gflops": t[lib]["gemm_gflops"], "exp_ns": t[lib]["exp_ns"]}
                     for t in tile_rates for lib in ("numpy", "torch", "mkl") if lib in t],
                    ["threads", "seqlen", "mask", "lib", "gemm_gflops", "exp_ns"]))
    targeted = [r for r in rows if r.get("target") is not None]
    if targeted:
        print("\nspeed targets: burstcu time / torch SDPA time at most `target`; floor_allows: its floor (its"
              " matmuls and exps alone, NumPy's kernels) is under it;"
              + (f" mkl_floor_vs_torch: the floor on MKL's kernels ({env['mkl']})" if mkl is not None else
                 " (MKL's kernel set: not measured, no libmkl_rt loads)"))
        print(table([{**r, "floor_allows": None if r["floor_vs_torch"] is None else r["floor_vs_torch"] <= r["target"]}
                     for r in targeted],
                    ["threads", "seqlen", "mask", "pass", "target", "time_vs_torch", "meets_target",
                     "floor_vs_torch", "floor_allows", "mkl_floor_vs_torch"]))
    print("\nmemory of the burstcu calls (tracemalloc peak; scratch = NumpyOps.scratch_bytes, tile_scratch ="
          " its tiles alone)")
    sizes = ("forward_peak", "backward_peak", "scratch", "tile_scratch", "score_matrix")
    shown = [{key: fmt_bytes(val) if key in sizes and val is not None else val for key, val in m.items()}
             for m in memory]
    print(table(shown, ["threads", "seqlen", "mask", "forward_peak", "backward_peak", "scratch", "tile_scratch",
                        "score_matrix", "scratch_vs_score_matrix", "tile_scratch_vs_score_matrix"]))
    write_json(args.json, {"config": vars(args), "environment": env, "matmul_peaks": peaks, "tile_rates": tile_rates,
                           "results": rows, "memory": memory})
    print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
