"""Decode against a KV cache (`burstcu.KVCache`) sharded over the ranks it runs on, a row per cache
length; its columns, --tokens, --paged, the numpy backend's prefill rows and --predict (per-token
latency on bench/model/predict.py's presets, labelled PREDICTION): bench/README.md.

    mpiexec -n G python bench/decode.py [--cache 4096 65536 262144] [--prefill 4096] [--plot P]
    python bench/decode.py --backend cupy [--cache 4096 262144 1048576] [--paged 16] [--json F]
    python bench/decode.py --backend cupy --tokens 8       # 4 x 8 = 32 rows a kv head: the twin
    python bench/decode.py --backend cupy --mma-min-rows 16  # the CUDA-core kernel on 4 rows
    python bench/decode.py --predict [--ranks 1 2 4 8] [--cache ...] [--json F]
    python bench/decode.py --backend emulated --host-only [--cache 4096] [--dtype float16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from bench.model.predict import PRESETS  # noqa: E402

import burstcu  # noqa: E402
from burstcu.engine.decode import decode_bytes  # noqa: E402
from burstcu.ops.cuda.decode import PINNED_SLOTS, split_kernel  # noqa: E402
from burstcu.plan import predict_decode  # noqa: E402

DECODE_COLUMNS = ["ranks", "cache_rows", "ms_per_token", "gb_per_s", "hbm_fraction", "l2", "host_ms",
                  "host_bound", "torch_ms", "bytes_per_rank", "cache_rows_per_rank", "split_kernel"]
PREFILL_COLUMNS = ["prompt", "strategy", "first_token_ms"]
# defaults where an option is not given: a GPU's sizes, or what CPU ranks finish in minutes
DEFAULTS = {"cupy": {"cache": [4096, 262144, 1048576], "dtype": "float16", "repeats": 20},
            "cpu": {"cache": [4096, 65536, 262144], "dtype": "float32", "repeats": 5}}


def torch_ms(q, cache, n: int, repeats: int, flush=None) -> float | None:
    """SDPA over the first n rows of a contiguous cache, or None without torch (optional); flush()
    untimed ahead of each call; timed as decode is (events on CuPy's stream, a wait after each
    call) where torch launches on that stream, else with the device synced around each call."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None
    tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, cache.k[:, :n], cache.v[:, :n]))
    gqa = {"enable_gqa": True}
    try:
        F.scaled_dot_product_attention(tq, tk, tv, **gqa)
    except TypeError:                      # torch < 2.5: replicated kv heads, outside the timing
        g, gqa = tq.shape[1] // tk.shape[1], {}
        tk, tv = tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1)
    seconds = C.call_seconds(lambda: F.scaled_dot_product_attention(tq, tk, tv, **gqa), repeats, cuda=True,
                             sync_inside=not C.torch_shares_cupy_stream(), before=flush)
    return C.median(seconds) * 1e3


def measure_decode(group, args, n: int, copy_gb_per_s: float | None) -> dict:
    """The row of n cache rows in all: ceil(n / G) on each rank, one fewer past the first n % G.
    On a GPU each timed call (and torch's) follows a flush of L2 (`C.l2_flush`) unless
    --warm-l2: the cache is read from HBM, as between one layer's tokens."""
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    ops, per_rank, extra = group.ops, -(-n // group.size), n % group.size
    mine = per_rank if group.rank < extra or extra == 0 else per_rank - 1
    cache = burstcu.KVCache(group, b, per_rank, hkv, d, C.array_dtype(args.dtype), page_size=args.paged)
    kv = C.normal(ops.xp, [(2, b, mine, hkv, d)], args.dtype, 1 + group.rank)[0]   # drawn on the device
    cache.from_prefill(kv[0], kv[1])
    del kv
    q = ops.xp.asarray(C.normal(np, [(b, args.tokens, h, d)], args.dtype, 2)[0])
    events = group.backend == "cupy" and group.size == 1     # one GPU: CUDA events, no barrier
    flush = None if args.warm_l2 else C.l2_flush(ops.xp)

    def step():
        cache.decode(q)
        ops.sync()

    step()                                                   # warm-up (compiles on a GPU)
    group.stats.reset()
    if events:
        seconds = C.median(C.call_seconds(lambda: cache.decode(q), args.repeats, 0, cuda=True,
                                          before=flush))
    else:
        seconds = C.slowest_rank_seconds(group, step, args.repeats, before=flush)
    sent = group.stats.bytes_sent // args.repeats
    assert sent == decode_bytes(group.size, q), (sent, decode_bytes(group.size, q))
    # host ms: the median call of runs of PINNED_SLOTS calls back to back, each run after a synced
    # call. A call reuses the pinned slot of the call PINNED_SLOTS before it once that one has run
    # on the GPU, so a longer run would time the GPU, not the host, where a token takes longer.
    host = []
    for _ in range(max(1, args.host_calls // PINNED_SLOTS)):
        step()
        host += C.call_seconds(lambda: cache.decode(q), PINNED_SLOTS, 0)
    ops.sync()
    gb_per_s = 2 * b * n * hkv * d * q.dtype.itemsize / seconds / 1e9
    host_ms = C.median(host) * 1e3
    kernel = split_kernel(ops)         # the split kernel the last decode ran (None: array operations)
    return {"kind": "measured", "ranks": group.size, "cache_rows": n, "ms_per_token": seconds * 1e3,
            "gb_per_s": gb_per_s,
            "hbm_fraction": gb_per_s / (group.size * copy_gb_per_s) if copy_gb_per_s else None,
            "l2": ("warm" if args.warm_l2 else "flushed") if group.backend == "cupy" else None,
            "host_ms": host_ms,   # host_bound: a GPU call is mostly host time, its gb_per_s not memory's
            "host_bound": host_ms >= 0.8 * seconds * 1e3 if group.backend == "cupy" else None,
            "torch_ms": torch_ms(q, cache, n, args.repeats, flush) if events and not args.paged else None,
            "bytes_per_rank": sent, "cache_rows_per_rank": int(cache.counts[:, 0].max()),
            "split_kernel": kernel.split("<")[0] if kernel else None}


def measure_host(group, args, n: int) -> dict:
    """host_ms of n cache rows with every kernel launch a no-op (emulated backend, nothing to wait
    for): the Python host path of a call alone, best of 9 x host_calls calls. A NumPy array's
    address costs ~2 µs more to read than a CuPy array's, ~16 of them a call."""
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    group.ops.function = lambda name: (lambda *launch, **options: None)
    cache = burstcu.KVCache(group, b, -(-n // group.size), hkv, d, C.array_dtype(args.dtype),
                            page_size=args.paged)
    q = C.normal(np, [(b, args.tokens, h, d)], args.dtype, 2)[0]
    rows = np.zeros((b, cache.capacity, hkv, d), q.dtype)
    cache.from_prefill(rows, rows)
    best = min(sum(C.call_seconds(lambda: cache.decode(q), args.host_calls, 1)) for _ in range(9))
    return {"kind": "measured", "ranks": group.size, "cache_rows": n,
            "host_ms": best / args.host_calls * 1e3}


def measure_prefill(group, args, n: int) -> list[dict]:
    """The first token of an n-token prompt: burst, allgather (zigzag, causal) and rank 0 alone."""
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    q, k, v = C.normal(np, [(b, n, x, d) for x in (h, hkv, hkv)], args.dtype, 3)
    local = [burstcu.shard(x, group, "zigzag") for x in (q, k, v)]
    rows = []
    for strategy in ("burst", "allgather"):
        def run():
            burstcu.attention(*local, group, causal=True, layout="zigzag", strategy=strategy)
        run()
        rows.append({"kind": "measured", "ranks": group.size, "prompt": n, "strategy": strategy,
                     "first_token_ms": C.slowest_rank_seconds(group, run, args.repeats) * 1e3})
    one = None
    if group.rank == 0:
        one = C.median(C.call_seconds(lambda: burstcu.attention(q, k, v, causal=True), args.repeats))
    one = group.transport.allgather_object(one, "one rank")[0]
    return rows + [{"kind": "measured", "ranks": 1, "prompt": n, "strategy": "one rank",
                    "first_token_ms": one * 1e3}]


def predict(args) -> dict:
    """PREDICTIONS of the per-token latency for every preset (`burstcu.plan.predict_decode`)."""
    hkv, itemsize = args.kv_heads or args.heads, np.dtype(C.array_dtype(args.dtype)).itemsize
    rows = []
    for name, machine in sorted(PRESETS.items()):
        for g in args.ranks:
            for n in args.cache:
                t = predict_decode(machine, g, n, args.batch, args.heads, hkv, args.headdim, itemsize)
                rows.append({"kind": "PREDICTION", "preset": name, "ranks": g, "cache_rows": n,
                             "ms_per_token": t["token_s"] * 1e3, "read_ms": t["read_s"] * 1e3,
                             "gather_ms": t["gather_s"] * 1e3, "bytes_per_rank": t["bytes"]})
    return {"benchmark": "decode", "kind": "PREDICTION", "args": C.clean(vars(args)), "rows": rows}


def plot(rows: list, path: str) -> None:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [r for r in rows if r.get("ms_per_token") is not None]
    for key, label in (("ms_per_token", f"burstcu, {tokens[0]['ranks']} rank(s)"),
                       ("torch_ms", "torch SDPA")):
        points = [(r["cache_rows"], r[key]) for r in tokens if r[key] is not None]
        if points:
            ax.plot(*zip(*points), "o-", label=label)
    ax.set(xscale="log", yscale="log", xlabel="cache rows (all ranks)", ylabel="ms per token",
           title="decode against a sharded KV cache")
    ax.legend()
    C.save(fig, path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", nargs="+", type=C.positive, help="cache rows, all ranks together")
    p.add_argument("--prefill", nargs="*", type=C.positive, help="prompt lengths (numpy; 4096)")
    C.add_shape_args(p, heads=32, headdim=128, dtype=None,
                     kv_heads_help="default: a quarter of --heads (32 / 8: GQA 4), or --heads where 4 "
                                   "does not divide it")
    p.add_argument("--paged", type=C.positive, default=None, metavar="PAGE", help="rows a page")
    p.add_argument("--tokens", type=C.positive, default=1, metavar="T", help="new tokens a call (q's T)")
    p.add_argument("--mma-min-rows", type=int, default=None, metavar="R",
                   help="kernels: the tensor-core twin from R query rows a kv head (KernelOps."
                        "decode_mma_min_rows; 16: the CUDA-core kernel under 16)")
    p.add_argument("--repeats", type=C.positive)
    p.add_argument("--warm-l2", action="store_true",
                   help="GPU: no flush between timed calls, the cache left in L2 where it fits "
                        "(default: L2 flushed before each timed call)")
    p.add_argument("--host-calls", type=C.positive, help="calls timed (20; --host-only 1000)")
    p.add_argument("--host-only", action="store_true",
                   help="emulated backend: host_ms alone, every kernel launch a no-op")
    p.add_argument("--backend", default="numpy", choices=["numpy", "emulated", "cupy"])
    p.add_argument("--predict", action="store_true", help="the GPU presets' model only (PREDICTION)")
    p.add_argument("--ranks", nargs="+", type=C.positive, default=[1, 2, 4, 8], help="--predict: world sizes")
    C.add_output_args(p)
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads // 4 if args.heads % 4 == 0 else args.heads
    if args.host_only:
        args.cache = args.cache or [4096]
    measuring = (("--tokens", args.tokens != 1), ("--paged", args.paged), ("--host-only", args.host_only),
                 ("--plot", args.plot), ("--repeats", args.repeats), ("--warm-l2", args.warm_l2),
                 ("--host-calls", args.host_calls), ("--mma-min-rows", args.mma_min_rows is not None),
                 ("--backend", args.backend != "numpy"), ("--prefill", args.prefill is not None))
    ignored = [name for name, given in measuring if given]
    if args.predict and ignored:
        p.error(f"--predict models one token a call on a contiguous cache, measuring nothing: "
                f"leave out {', '.join(ignored)}")
    if args.host_calls is None:
        args.host_calls = 1000 if args.host_only else 20
    if args.prefill is None:
        args.prefill = [4096]
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads} (GQA)")
    gpu = args.backend == "cupy" or args.predict   # the model's presets are GPUs: their defaults
    for key, value in DEFAULTS["cupy" if gpu else "cpu"].items():
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    if args.predict:
        result = predict(args)
        C.emit(f"# PREDICTION (bench/model/predict.py presets; HBM-bound read of the cache shard + "
               f"the all-gather; B={args.batch} H={args.heads}/{args.kv_heads} D={args.headdim} "
               f"{args.dtype}); not a measurement\n" + C.table(result["rows"], list(result["rows"][0])),
               result, args)
        return 0
    if args.backend == "cupy" and (status := C.no_gpu("decode.py", dry_run=False)) is not None:
        return status
    group = burstcu.init(backend=args.backend)
    if args.mma_min_rows is not None:
        group.ops.decode_mma_min_rows = args.mma_min_rows
    copy_gb_per_s = None
    if group.backend == "cupy":     # the device's copy bandwidth: read + write bytes of a 1 GiB copy / time
        a, b = group.ops.xp.empty(1 << 30, np.uint8), group.ops.xp.empty(1 << 30, np.uint8)
        copy_gb_per_s = 2 * (1 << 30) / C.median(C.call_seconds(lambda: b.__setitem__(slice(None), a), 5,
                                                            cuda=True)) / 1e9
        del a, b
    if args.host_only and group.backend != "emulated":
        p.error("--host-only needs --backend emulated")
    rows = []
    for n in args.cache:
        C.progress(f"decode, cache {n}", group.rank)
        rows.append(measure_host(group, args, n) if args.host_only else
                    measure_decode(group, args, n, copy_gb_per_s))
    for n in args.prefill if group.backend == "numpy" else []:
        C.progress(f"prefill, prompt {n}", group.rank)
        rows += measure_prefill(group, args, n)
    if group.rank == 0:
        timing = "CUDA events" if group.backend == "cupy" and group.size == 1 else "slowest rank, synced"
        columns = (["ranks", "cache_rows", "host_ms"] if args.host_only else
                   DECODE_COLUMNS + (PREFILL_COLUMNS if len(rows) > len(args.cache) else []))
        if args.tokens > 1:
            print(f"# --tokens {args.tokens}: ms_per_token is the milliseconds of a call of {args.tokens} "
                  f"new tokens")
        C.print_and_write(C.environment(group, synchronized=True, timing=timing, copy_gb_per_s=copy_gb_per_s,
                                        new_tokens_a_call=args.tokens), rows, columns, args)
        if args.plot:
            plot(rows, args.plot)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
