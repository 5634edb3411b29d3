"""Decode against a sequence-sharded KV cache: per-token latency against the cache length, and the
first token's (prefill) latency of burst vs allgather vs one rank — measured at the world size
it runs in; `--predict` gives the GPU presets' model (PREDICTION, never a measurement).

    mpiexec -n G python bench/cpu/decode.py [--cache 4096 65536 262144] [--prefill 4096 16384]
        [--batch 1] [--heads 32] [--kv-heads 8] [--headdim 128] [--dtype float32]
        [--repeats 5] [--json F] [--table F] [--plot F]
    python bench/cpu/decode.py --predict [--ranks 1 2 4 8] [--cache ...] [--json F]

Per token (decode): every rank holds cache/G rows per batch row (`burstcu.KVCache`), q is one new
token; the time is the median over repeats of one `KVCache.decode` (the partial attention of a
rank's rows + one all-gather of the partials + the merge), max over ranks; bytes are what a rank
sends (`decode_bytes`: independent of the cache length).
First token (prefill): causal attention over the prompt sharded zigzag over G ranks with
`strategy="burst"` and `"allgather"`, and (rank 0 alone, `group=None`) the whole prompt on one
rank: the time to the first token's attention output.
Model (--predict): per token, a rank reads its K/V shard once (memory-bound: 2*B*S/G*Hkv*D*itemsize
bytes at 80% of the GPU's HBM bandwidth) and the all-gather costs latency*ceil(log2 G) + bytes /
bandwidth, latency and bandwidth those of bench/model/predict.py's presets: the library's model,
`burstcu.plan.predict_decode` on a `burstcu.plan.Machine` (memory_bw).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from bench.model.predict import PRESETS  # noqa: E402

import burstcu  # noqa: E402
from burstcu.engine.decode import decode_bytes  # noqa: E402
from burstcu.plan import predict_decode  # noqa: E402


def _sync(group) -> None:
    group.ops.sync()


def measure_decode(group, args, cache_len: int) -> list[dict]:
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    dt = C.array_dtype(args.dtype)
    xp = group.ops.xp
    per_rank = -(-cache_len // group.size)
    rng = np.random.default_rng([1, group.rank])
    cache = burstcu.KVCache(group, b, per_rank + 1, hkv, d, dt)
    mine = per_rank if group.rank < cache_len % group.size or cache_len % group.size == 0 else per_rank - 1
    kv = xp.asarray(rng.standard_normal((2, b, mine, hkv, d), dtype=np.float32).astype(dt))
    cache.from_prefill(kv[0], kv[1])
    q = xp.asarray(np.random.default_rng(2).standard_normal((b, 1, h, d), dtype=np.float32).astype(dt))

    def step():
        cache.decode(q)
        _sync(group)

    step()                                                  # warm-up (compiles on a GPU)
    group.stats.reset()
    seconds = C.slowest_rank_seconds(group, step, args.repeats)
    sent = group.stats.bytes_sent // args.repeats
    assert sent == decode_bytes(group.size, q), (sent, decode_bytes(group.size, q))
    rows = [{"kind": "measured", "impl": "burstcu", "ranks": group.size, "cache": cache_len,
             "token_ms": seconds * 1e3, "tokens_per_s": 1.0 / seconds, "bytes_per_rank": sent,
             "cache_rows_per_rank": int(cache.counts[:, 0].max())}]
    if group.backend == "cupy" and group.size == 1:        # the same attention in torch, same run
        rows += _torch_baseline(args, cache, q, cache_len)
    return rows


def _torch_baseline(args, cache, q, cache_len: int) -> list[dict]:
    """torch's scaled_dot_product_attention over the same cache rows (one GPU), if torch is there."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return []
    n = int(cache.counts[0, 0])
    tq = torch.from_dlpack(q).transpose(1, 2)                            # (B, H, 1, D)
    g = q.shape[2] // cache.k.shape[2]
    tk = torch.from_dlpack(cache.k[:, :n]).transpose(1, 2).repeat_interleave(g, dim=1)
    tv = torch.from_dlpack(cache.v[:, :n]).transpose(1, 2).repeat_interleave(g, dim=1)
    seconds = C.median(C.call_seconds(lambda: F.scaled_dot_product_attention(tq, tk, tv), args.repeats,
                                      after=torch.cuda.synchronize))
    return [{"kind": "measured", "impl": "torch sdpa", "ranks": 1, "cache": cache_len,
             "token_ms": seconds * 1e3, "tokens_per_s": 1.0 / seconds}]


def measure_prefill(group, args, n: int) -> list[dict]:
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    dt = C.array_dtype(args.dtype)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, n, h, d), dtype=np.float32).astype(dt)
    k, v = (rng.standard_normal((b, n, hkv, d), dtype=np.float32).astype(dt) for _ in range(2))
    local = [burstcu.shard(x, group, "zigzag") for x in (q, k, v)]
    rows = []
    for strategy in ("burst", "allgather"):
        def run():
            burstcu.attention(*local, group, causal=True, layout="zigzag", strategy=strategy)
        run()
        rows.append({"kind": "measured", "ranks": group.size, "prompt": n, "strategy": strategy,
                     "first_token_ms": C.slowest_rank_seconds(group, run, args.repeats) * 1e3})
    if group.rank == 0:                 # the whole prompt on one rank, for comparison
        one = C.median(C.call_seconds(lambda: burstcu.attention(q, k, v, causal=True), args.repeats))
    else:
        one = None
    one = group.transport.allgather_object(one, "one rank")[0]
    rows.append({"kind": "measured", "ranks": 1, "prompt": n, "strategy": "one rank",
                 "first_token_ms": one * 1e3})
    return rows


def predict(args) -> dict:
    """PREDICTIONS of the per-token latency for every preset (`burstcu.plan.predict_decode`)."""
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    itemsize = np.dtype(C.array_dtype(args.dtype)).itemsize
    rows = []
    for name, machine in sorted(PRESETS.items()):
        for g in args.ranks:
            for n in args.cache:
                t = predict_decode(machine, g, n, b, h, hkv, d, itemsize)
                rows.append({"kind": "PREDICTION", "preset": name, "ranks": g, "cache": n,
                             "token_ms": t["token_s"] * 1e3, "read_ms": t["read_s"] * 1e3,
                             "gather_ms": t["gather_s"] * 1e3, "bytes_per_rank": t["bytes"]})
    return {"benchmark": "decode", "kind": "PREDICTION", "args": C.clean(vars(args)), "rows": rows}


def plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [r for r in rows if r.get("impl") == "burstcu"]
    ax.plot([r["cache"] for r in tokens], [r["token_ms"] for r in tokens], "o-",
            label=f"{tokens[0]['ranks']} rank(s), measured" if tokens else "")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cache length (tokens, all ranks)")
    ax.set_ylabel("ms per token")
    ax.set_title("decode against a sharded KV cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", nargs="+", type=int, default=[4096, 65536, 262144])
    p.add_argument("--prefill", nargs="+", type=int, default=[4096])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32", "float64"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy"],
                   help="cupy: decode on the GPU (a world of one; torch's SDPA beside it if torch "
                        "is installed; prefill not timed)")
    p.add_argument("--predict", action="store_true", help="the GPU presets' model only (PREDICTION)")
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4, 8], help="--predict: world sizes")
    p.add_argument("--json")
    p.add_argument("--table")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.predict:
        result = predict(args)
        text = ("# PREDICTION (bench/model/predict.py presets; HBM-bound read of the cache shard + the "
                "all-gather); not a measurement\n"
                + C.table(result["rows"], ["kind", "preset", "ranks", "cache", "token_ms", "read_ms",
                                           "gather_ms", "bytes_per_rank"]))
        print(text)
        if args.table:
            Path(args.table).write_text(text + "\n")
        if args.json:
            C.write_json(args.json, result)
        return 0
    group = burstcu.init(backend=args.backend)
    rows = []
    for n in args.cache:
        C.progress(f"decode, cache {n}", group.rank)
        rows += measure_decode(group, args, n)
    for n in args.prefill if group.backend != "cupy" else []:
        C.progress(f"prefill, prompt {n}", group.rank)
        rows += measure_prefill(group, args, n)
    if group.rank == 0:
        C.print_and_write(C.environment(group, synchronized=True), rows,
                          ["kind", "impl", "ranks", "cache", "token_ms", "tokens_per_s", "bytes_per_rank",
                           "cache_rows_per_rank", "prompt", "strategy", "first_token_ms"], args)
        if args.plot:
            plot(rows, args.plot)
    group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
