"""A hybrid stack (LASP-2H): linear-attention layers through LASP-2 and every k-th layer softmax
attention through a softmax strategy, time and bytes per rank of one forward + backward of the
stack's attention, for several layer mixes, measured in one run.

    mpiexec -n G python bench/cpu/hybrid.py [--layers 8] [--seqlen 8192] [--heads 8] [--kv-heads 8]
        [--headdim 64] [--dtype float32] [--repeats 3] [--json F] [--table F]

Mixes (layer i is softmax when the mix says so; all causal, contiguous shards):
    linear            every layer linear attention (lasp2)
    1/4 allgather     every 4th layer softmax through strategy="allgather" (as LASP-2H does)
    1/4 burst         every 4th layer softmax through the burst ring
    softmax burst     every layer softmax (burst)
Per mix: the slowest rank's median seconds of the stack (each layer's forward, then each layer's
backward in reverse order, as training runs them), tokens per second, and the bytes and messages
one rank sends (the largest over ranks). Only the attention runs: no projections or MLPs, the
same q, k, v in every layer, so the figures isolate what the parallel attention costs.

How to run a hybrid model with burstcu: call `burstcu.linear_attention(..., strategy="lasp2")`
in the linear layers and `burstcu.attention(..., strategy="allgather")` (or "burst") in the
softmax ones, on the same group and the same shards (`burstcu.shard`, one layout for both).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402

MIXES = {"linear": (None, 0), "1/4 allgather": ("allgather", 4), "1/4 burst": ("burst", 4),
         "softmax burst": ("burst", 1)}


def layer_kinds(mix: str, layers: int) -> list[str | None]:
    """Per layer: the softmax strategy, or None for a linear (lasp2) layer."""
    softmax, every = MIXES[mix]
    return [softmax if every and (i + 1) % every == 0 else None for i in range(layers)]


def stack(group, kinds, q, k, v, dout):
    """Forward of every layer, then backward in reverse order."""
    saved = []
    for kind in kinds:
        if kind is None:
            saved.append(burstcu.linear_attention(q, k, v, group, causal=True, strategy="lasp2"))
        else:
            saved.append(burstcu.attention(q, k, v, group, causal=True, return_lse=True,
                                           strategy=kind))
    for kind, s in zip(reversed(kinds), reversed(saved)):
        if kind is None:
            burstcu.linear_attention_backward(dout, q, k, v, group, causal=True, strategy="lasp2")
        else:
            burstcu.attention_backward(dout, q, k, v, s[0], s[1], group, causal=True, strategy=kind)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seqlen", type=int, default=8192)
    C.add_shape_args(p, heads=8, dtypes=("float16", "float32", "float64"))
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="auto")
    p.add_argument("--json")
    p.add_argument("--table")
    args = p.parse_args(argv)
    group = burstcu.init(backend=args.backend)
    q, k, v, dout = C.make_local_inputs(group.rank, group.size, batch=args.batch,
                                        seqlen=args.seqlen, heads=args.heads,
                                        kv_heads=args.kv_heads or args.heads,
                                        headdim=args.headdim, dtype=args.dtype)
    rows = []
    for mix in args.mixes:
        kinds = layer_kinds(mix, args.layers)
        C.progress(f"{mix}: {['lasp2' if x is None else x for x in kinds]}", group.rank)
        times = C.call_seconds(lambda: stack(group, kinds, q, k, v, dout), args.repeats, warmup=1,
                               before=lambda: (group.stats.reset(), group.barrier()),
                               after=group.ops.sync)   # the stats: the last call's
        mine = {"s": C.median(times), "bytes": group.stats.bytes_sent,
                "messages": group.stats.messages}
        every = group.transport.allgather_object(mine, "bench hybrid")
        row = {"mix": mix, "layers": args.layers, "softmax_layers": sum(x is not None for x in kinds),
               "ranks": group.size, "seqlen": args.seqlen,
               "stack_s": max(r["s"] for r in every), "bytes_per_rank": max(r["bytes"] for r in every),
               "messages_per_rank": max(r["messages"] for r in every)}
        row["tokens_per_s"] = args.seqlen / row["stack_s"]
        rows.append(row)
        if group.rank == 0:
            print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    env = C.environment(group, synchronized=True)
    group.close()
    if group.rank == 0:
        C.print_and_write(env, rows, COLUMNS, args)
    return 0


COLUMNS = ["mix", "layers", "softmax_layers", "ranks", "seqlen", "stack_s", "tokens_per_s",
           "bytes_per_rank", "messages_per_rank"]


if __name__ == "__main__":
    sys.exit(main())
