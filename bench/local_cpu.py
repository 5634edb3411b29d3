"""One-rank CPU forward: burstcu's NumPy backend against a naive NumPy implementation and, when
installed, PyTorch's CPU `scaled_dot_product_attention` — same shapes, same run, same threads.

    python bench/local_cpu.py [--seqlen 1024 4096] [--heads 8] [--headdim 64] [--batch 1]
                              [--causal] [--threads N] [--repeats 3] [--json FILE]

Prints one line per (seqlen, implementation) and writes JSON with every timing. Times are the
median of --repeats runs after one warm-up; inputs are converted to each library's layout
outside the timed region. FLOPs counted as 4*B*H*S^2*D (halved when causal).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from _common import environment, median, progress, table, write_json  # noqa: I001 - sets sys.path

import burstcu


def naive_numpy(q, k, v, causal):
    """Full score matrix, explicit softmax: (B,S,H,D) in, (B,S,H,D) out, O(S^2) memory."""
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = np.where(np.tri(n, dtype=bool), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return np.einsum("bhij,bjhd->bihd", s, v)


def torch_sdpa():
    """A callable running PyTorch's CPU SDPA on (B,H,S,D) tensors, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    import torch.nn.functional as F

    def run(q, k, v, causal):
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def timed(fn, repeats):
    fn()  # warm-up: first-touch allocations, BLAS thread start-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times), times


def bench_one(seqlen, args, sdpa):
    rng = np.random.default_rng(0)
    shape = (args.batch, seqlen, args.heads, args.headdim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    flops = 4 * args.batch * args.heads * seqlen * seqlen * args.headdim * (0.5 if args.causal else 1)
    runs = {"burstcu": lambda: burstcu.attention(q, k, v, causal=args.causal)}
    if seqlen <= args.naive_max:
        runs["naive numpy"] = lambda: naive_numpy(q, k, v, args.causal)
    if sdpa is not None:
        import torch
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v))
        runs["torch sdpa"] = lambda: sdpa(tq, tk, tv, args.causal)
    rows = []
    for name, fn in runs.items():
        progress(f"seqlen {seqlen}: {name}")
        t, all_t = timed(fn, args.repeats)
        rows.append({"seqlen": seqlen, "impl": name, "seconds": t, "all_seconds": all_t,
                     "gflops": flops / t / 1e9})
    ref = next((r["seconds"] for r in rows if r["impl"] == "torch sdpa"), None)
    for r in rows:
        r["time_vs_torch"] = r["seconds"] / ref if ref else None
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description="one-rank CPU attention forward: burstcu vs naive vs torch")
    p.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="BLAS and torch threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--naive-max", type=int, default=8192, help="skip the O(S^2)-memory naive run above this")
    p.add_argument("--json", default="bench/out/local_cpu.json")
    args = p.parse_args(argv)

    import os
    threads = args.threads or os.cpu_count()
    from threadpoolctl import threadpool_limits
    sdpa = torch_sdpa()
    if sdpa is not None:
        import torch
        torch.set_num_threads(threads)
    rows = []
    with threadpool_limits(limits=threads):
        env = environment(None, threads=threads,
                          torch=None if sdpa is None else __import__("torch").__version__)
        for seqlen in args.seqlen:
            rows += bench_one(seqlen, args, sdpa)
    print(f"one-rank forward, float32, batch {args.batch}, heads {args.heads}, headdim {args.headdim}, "
          f"causal={args.causal}, {threads} threads, measured on the CPU")
    print(table(rows, ["seqlen", "impl", "seconds", "gflops", "time_vs_torch"]))
    write_json(args.json, {"config": vars(args), "environment": env, "results": rows})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
