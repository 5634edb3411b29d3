"""Where one rank's time goes on the CPU: burstcu's NumPy op, forward and backward, against
PyTorch's CPU scaled_dot_product_attention (and a naive NumPy forward), same shapes, BLAS and torch
held to the same thread count, burstcu and torch interleaved a repetition at a time after a warm-up
so a slow spell hits both alike (medians). The header names the BLAS kernels NumPy's OpenBLAS runs
and says when faster ones would run (`blas_advice`).

    python bench/cpu/local_op.py [--seqlen 1024 4096] [--threads 1 2] [--masks full causal]
        [--repeats 5] [--score-std 1] [--naive-max 1024] [--json F] [--plot F]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# before libgomp loads: torch's OpenMP threads would spin after each call, taking a core from the next
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu.ops.numpy import NumpyOps, blas_advice  # noqa: E402
from burstcu.transport.base import SelfTransport  # noqa: E402


def naive_numpy(q, k, v, causal: bool):
    """Full score matrix, explicit softmax: (B, S, H, D) in and out, O(S^2) memory."""
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tri(q.shape[1], dtype=bool), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhij,bjhd->bihd", s / s.sum(axis=-1, keepdims=True), v)


def bench_config(args, torch, threads: int, seqlen: int, causal: bool) -> list[dict]:
    """The rows of one (threads, seqlen, mask): each implementation and pass, median seconds."""
    q, k, v, dout = C.normal(np, [(args.batch, seqlen, args.heads, args.headdim)] * 4, "float32", 0)
    q *= np.float32(args.score_std)
    group = burstcu.Group(0, 1, "numpy", SelfTransport(), NumpyOps(threads=threads))
    out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True)
    runs = {("forward", "burstcu"): lambda: burstcu.attention(q, k, v, group, causal=causal),
            ("backward", "burstcu"): lambda: burstcu.attention_backward(dout, q, k, v, out, lse, group,
                                                                        causal=causal)}
    if torch is not None:   # (B, H, S, D) copies; backward: autograd.grad of the kept graph
        F = torch.nn.functional
        tq, tk, tv, tdo = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))
                           for x in (q, k, v, dout))
        sdpa = torch.no_grad()(F.scaled_dot_product_attention)
        runs[("forward", "torch sdpa")] = lambda: sdpa(tq, tk, tv, is_causal=causal)
        leaves = [x.clone().requires_grad_() for x in (tq, tk, tv)]
        tout = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        runs[("backward", "torch sdpa")] = lambda: torch.autograd.grad(tout, leaves, tdo, retain_graph=True)
    for fn in runs.values():
        fn()   # warm-up: first-touch allocations, thread pools, BLAS buffers
    times = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, fn in runs.items():
            times[key] += C.call_seconds(fn, 1, warmup=0)
    if seqlen <= args.naive_max:   # after the others: its BLAS threads spin on
        times[("forward", "naive numpy")] = C.call_seconds(lambda: naive_numpy(q, k, v, causal), args.repeats)
    group.close()
    flops = 4 * args.batch * args.heads * seqlen * seqlen * args.headdim * (0.5 if causal else 1)
    rows = []
    for (pass_, impl), ts in times.items():
        t, ref = C.median(ts), times.get((pass_, "torch sdpa"))
        rows.append({"threads": threads, "seqlen": seqlen, "mask": "causal" if causal else "full",
                     "score_std": args.score_std, "pass": pass_, "impl": impl, "seconds": t,
                     "all_seconds": ts, "time_vs_torch": t / C.median(ref) if ref else None,
                     "gflops": flops * (2.5 if pass_ == "backward" else 1) / t / 1e9})
    return rows


def plot(rows: list, path: str) -> None:
    """burstcu's time over torch's per configuration, forward and backward, with the 1.0 line."""
    plt = C.pyplot()
    mine = [r for r in rows if r["impl"] == "burstcu" and r["time_vs_torch"] is not None]
    labels = sorted({(r["threads"], r["seqlen"], r["mask"]) for r in mine})
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)) + 1.5, 4))
    for i, pass_ in enumerate(("forward", "backward")):
        ratio = {(r["threads"], r["seqlen"], r["mask"]): r["time_vs_torch"]
                 for r in mine if r["pass"] == pass_}
        shown = [(j + (i - 0.5) * 0.4, key) for j, key in enumerate(labels) if key in ratio]
        ax.bar([x for x, _ in shown], [ratio[key] for _, key in shown], 0.4, label=pass_)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(labels)), [f"{s} {m}\n{t} thr" for t, s, m in labels], fontsize=8)
    ax.set(ylabel="burstcu time / torch SDPA time",
           title="one rank on the CPU, float32: below 1 is faster than torch")
    ax.legend(fontsize=8)
    C.save(fig, path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1 and all cores")
    p.add_argument("--masks", nargs="+", choices=["full", "causal"], default=["full", "causal"])
    for name, default in (("--heads", 8), ("--headdim", 64), ("--batch", 1), ("--repeats", 5)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--naive-max", type=int, default=1024, help="skip the O(S^2)-memory naive run above this")
    p.add_argument("--score-std", type=float, default=1.0, help="std of the scores (q is scaled to it)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    threads_list = args.threads or sorted({1, os.cpu_count() or 1})
    try:
        import torch
    except ImportError:
        torch = None
    env = C.environment(None, threads=threads_list, torch=None if torch is None else torch.__version__,
                        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"))
    rows = []
    for threads in threads_list:
        if torch is not None:
            torch.set_num_threads(threads)
        with threadpool_limits(limits=threads):
            for seqlen in args.seqlen:
                for mask in args.masks:
                    C.progress(f"{threads} thread(s), seqlen {seqlen}, {mask}")
                    rows += bench_config(args, torch, threads, seqlen, mask == "causal")
    cores = sorted({str(b.get("architecture")) for b in env["blas"] if b.get("internal_api") == "openblas"})
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    print(f"one rank, float32, batch {args.batch}, heads {args.heads}, headdim {args.headdim}, "
          f"score std {args.score_std:g}, median of {args.repeats} interleaved repetitions, measured on "
          f"the CPU (NumPy's OpenBLAS: {'/'.join(cores) or 'not found'} kernels"
          f"{', OPENBLAS_CORETYPE=' + coretype if coretype else ''})")
    if blas_advice():
        print(f"note: {blas_advice()}")
    print(C.table(rows, ["threads", "seqlen", "mask", "pass", "impl", "seconds", "gflops", "time_vs_torch"]))
    if args.json:
        C.write_json(args.json, {"config": vars(args), "environment": env, "results": rows})
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
