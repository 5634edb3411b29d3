"""Decode against a sequence-sharded KV cache (`burstcu.KVCache`) at the world size it runs in:
ms per token against the cache length (one `KVCache.decode`: each rank's partial attention, one
all-gather of the partials, the merge; the slowest rank, median over repeats; the bytes a rank
sends asserted equal to `decode_bytes`), and the first token's causal prefill time for burst,
allgather and the whole prompt on one rank. --backend cupy: decode on one GPU, torch's SDPA
beside it. --predict: per-token latency on bench/model/predict.py's presets from
`burstcu.plan.predict_decode` (HBM read of the shard + the all-gather), labelled PREDICTION.

    mpiexec -n G python bench/cpu/decode.py [--cache 4096 65536 262144] [--prefill 4096] [--json F]
    python bench/cpu/decode.py --predict [--ranks 1 2 4 8] [--cache ...] [--json F]
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


def measure_decode(group, args, cache_len: int) -> list[dict]:
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    dt, xp = C.array_dtype(args.dtype), group.ops.xp
    per_rank = -(-cache_len // group.size)
    rng = np.random.default_rng([1, group.rank])
    cache = burstcu.KVCache(group, b, per_rank + 1, hkv, d, dt)
    extra = cache_len % group.size
    mine = per_rank if group.rank < extra or extra == 0 else per_rank - 1
    kv = xp.asarray(rng.standard_normal((2, b, mine, hkv, d), dtype=np.float32).astype(dt))
    cache.from_prefill(kv[0], kv[1])
    q = xp.asarray(np.random.default_rng(2).standard_normal((b, 1, h, d), dtype=np.float32).astype(dt))

    def step():
        cache.decode(q)
        group.ops.sync()

    step()                                                  # warm-up (compiles on a GPU)
    group.stats.reset()
    seconds = C.slowest_rank_seconds(group, step, args.repeats)
    sent = group.stats.bytes_sent // args.repeats
    assert sent == decode_bytes(group.size, q), (sent, decode_bytes(group.size, q))
    rows = [{"kind": "measured", "impl": "burstcu", "ranks": group.size, "cache": cache_len,
             "token_ms": seconds * 1e3, "tokens_per_s": 1.0 / seconds, "bytes_per_rank": sent,
             "cache_rows_per_rank": int(cache.counts[:, 0].max())}]
    if group.backend == "cupy" and group.size == 1:        # torch's SDPA over the same rows
        try:
            import torch
            import torch.nn.functional as F
        except ImportError:
            return rows
        n, g = int(cache.counts[0, 0]), h // hkv
        tq = torch.from_dlpack(q).transpose(1, 2)
        tk, tv = (torch.from_dlpack(x[:, :n]).transpose(1, 2).repeat_interleave(g, dim=1)
                  for x in (cache.k, cache.v))
        seconds = C.median(C.call_seconds(lambda: F.scaled_dot_product_attention(tq, tk, tv),
                                          args.repeats, after=torch.cuda.synchronize))
        rows.append({"kind": "measured", "impl": "torch sdpa", "ranks": 1, "cache": cache_len,
                     "token_ms": seconds * 1e3, "tokens_per_s": 1.0 / seconds})
    return rows


def measure_prefill(group, args, n: int) -> list[dict]:
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
    one = None   # the whole prompt on rank 0 alone
    if group.rank == 0:
        one = C.median(C.call_seconds(lambda: burstcu.attention(q, k, v, causal=True), args.repeats))
    one = group.transport.allgather_object(one, "one rank")[0]
    return rows + [{"kind": "measured", "ranks": 1, "prompt": n, "strategy": "one rank",
                    "first_token_ms": one * 1e3}]


def predict(args) -> dict:
    """PREDICTIONS of the per-token latency for every preset (`burstcu.plan.predict_decode`)."""
    hkv = args.kv_heads or args.heads
    itemsize = np.dtype(C.array_dtype(args.dtype)).itemsize
    rows = []
    for name, machine in sorted(PRESETS.items()):
        for g in args.ranks:
            for n in args.cache:
                t = predict_decode(machine, g, n, args.batch, args.heads, hkv, args.headdim, itemsize)
                rows.append({"kind": "PREDICTION", "preset": name, "ranks": g, "cache": n,
                             "token_ms": t["token_s"] * 1e3, "read_ms": t["read_s"] * 1e3,
                             "gather_ms": t["gather_s"] * 1e3, "bytes_per_rank": t["bytes"]})
    return {"benchmark": "decode", "kind": "PREDICTION", "args": C.clean(vars(args)), "rows": rows}


def plot(rows: list, path: str) -> None:
    plt = C.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    tokens = [r for r in rows if r.get("impl") == "burstcu"]
    ax.plot([r["cache"] for r in tokens], [r["token_ms"] for r in tokens], "o-",
            label=f"{tokens[0]['ranks']} rank(s), measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("cache length (tokens, all ranks)")
    ax.set_ylabel("ms per token")
    ax.set_title("decode against a sharded KV cache")
    ax.legend()
    C.save(fig, path, dpi=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", nargs="+", type=int, default=[4096, 65536, 262144])
    p.add_argument("--prefill", nargs="+", type=int, default=[4096])
    C.add_shape_args(p, heads=32, headdim=128)
    p.set_defaults(kv_heads=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy"],
                   help="cupy: decode on one GPU, torch's SDPA beside it; prefill not timed")
    p.add_argument("--predict", action="store_true", help="the GPU presets' model only (PREDICTION)")
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4, 8], help="--predict: world sizes")
    C.add_output_args(p)
    args = p.parse_args(argv)
    if args.predict:
        result = predict(args)
        C.emit("# PREDICTION (bench/model/predict.py presets; HBM-bound read of the cache shard + "
               "the all-gather); not a measurement\n" + C.table(result["rows"], list(result["rows"][0])),
               result, args)
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
