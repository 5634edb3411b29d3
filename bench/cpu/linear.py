"""Causal linear attention across ranks, lasp2 and lasp1 against softmax attention's burst ring.
Time, tokens/s, bytes and messages a rank sends; --predict: a PREDICTION (bench/README.md).

    mpiexec -n G python bench/cpu/linear.py [--seqlens 4096 16384 65536] [--strategies lasp2 lasp1 burst]
        [--backend auto] [--repeats 3] [--json F] [--table F] [--plot F]
    python bench/cpu/linear.py --predict [--preset h100] [--ranks 64] [--seqlens 2097152] ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu.plan import MACHINES, predict_linear  # noqa: E402

COLUMNS = ["ranks", "seqlen", "strategy", "forward_s", "backward_s", "tokens_per_s",
           "forward_bytes", "forward_messages", "backward_bytes", "backward_messages"]


def measure(group, args, seqlen: int, strategy: str) -> dict:
    """This rank's median forward and backward seconds of one (seqlen, strategy), every rank
    started together, and the bytes and messages it sent in each pass (`group.stats`)."""
    q, k, v, dout = C.local_inputs(group, args, seqlen=seqlen)
    kw = dict(causal=True, strategy=strategy)
    fwd, bwd = ((lambda: burstcu.linear_attention(q, k, v, group, **kw),
                 lambda saved: burstcu.linear_attention_backward(dout, q, k, v, group, **kw))
                if strategy in ("lasp2", "lasp1") else
                (lambda: burstcu.attention(q, k, v, group, return_lse=True, **kw),
                 lambda saved: burstcu.attention_backward(dout, q, k, v, *saved, group, **kw)))

    def once(fn) -> float:   # every rank starts together, stats counted from the start
        return C.call_seconds(fn, 1, warmup=0, before=lambda: (group.stats.reset(), group.barrier()),
                              after=group.ops.sync)[0]

    bwd(fwd())                                           # warm-up: compiles, buffers
    f_times, b_times, saved = [], [], {}
    for _ in range(args.repeats):
        f_times.append(once(lambda: saved.update(forward=fwd())))
        fwd_bytes, fwd_msgs = group.stats.bytes_sent, group.stats.messages
        b_times.append(once(lambda: bwd(saved["forward"])))
    return {"forward_s": C.median(f_times), "backward_s": C.median(b_times),
            "forward_bytes": fwd_bytes, "forward_messages": fwd_msgs,
            "backward_bytes": group.stats.bytes_sent, "backward_messages": group.stats.messages}


def plot(rows, path) -> None:
    """Forward + backward seconds and bytes a rank sends against the seqlen, a line a strategy."""
    plt = C.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for strategy in sorted({r["strategy"] for r in rows}):
        pts = sorted((r["seqlen"], r["forward_s"] + r["backward_s"], r["forward_bytes"]
                      + r["backward_bytes"]) for r in rows if r["strategy"] == strategy)
        axes[0].plot([x[0] for x in pts], [x[1] for x in pts], marker="o", label=strategy)
        axes[1].plot([x[0] for x in pts], [max(x[2], 1) for x in pts], marker="o", label=strategy)
    for ax, title in zip(axes, ("forward + backward s (slowest rank)", "bytes sent a rank, fwd + bwd")):
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="global seqlen")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    C.save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", nargs="+", type=C.positive, default=[4096, 16384, 65536])
    C.add_shape_args(p, heads=8, dtypes=("float16", "float32", "float64"))
    p.add_argument("--strategies", nargs="+", default=["lasp2", "lasp1", "burst"])
    p.add_argument("--repeats", type=C.positive, default=3)
    p.add_argument("--backend", default="auto")
    p.add_argument("--predict", action="store_true", help="the cost model only (PREDICTION)")
    p.add_argument("--preset", default="h100", choices=sorted(MACHINES))
    p.add_argument("--ranks", type=C.positive, default=64, help="--predict: ranks")
    C.add_output_args(p)
    args = p.parse_args(argv)
    if args.predict:
        rows = []
        for s in args.seqlens:
            itemsize = C.array_dtype(args.dtype)(0).itemsize
            t = predict_linear(MACHINES[args.preset], args.ranks, s, args.batch, args.heads,
                               args.kv_heads or args.heads, args.headdim, itemsize)
            rows.append({"preset": args.preset, "ranks": args.ranks, "seqlen": s, **t,
                         "lasp2_over_ring": t["ring_s"] / t["lasp2_s"] - 1,
                         "lasp2_over_lasp1": t["lasp1_s"] / t["lasp2_s"] - 1})
        C.emit(f"# PREDICTION (burstcu.plan.predict_linear, preset {args.preset}: "
               f"{MACHINES[args.preset].source}); LASP-2 paper, 64 A100s, 2048K: +36.6% over Ring "
               f"Attention, +15.2% over LASP-1 (whole-model throughput; this prices the attention "
               f"layer alone: compare directions, not magnitudes)\n"
               + C.table(rows, ["preset", "ranks", "seqlen", "lasp2_s", "lasp1_s", "ring_s",
                                "lasp2_over_ring", "lasp2_over_lasp1"]),
               {"prediction": True, "rows": rows, "args": C.clean(vars(args))}, args)
        return 0
    if args.backend == "cupy" and (status := C.no_gpu("linear.py", dry_run=False)) is not None:
        return status
    group = burstcu.init(backend=args.backend)
    rows = []
    for seqlen in args.seqlens:
        for strategy in args.strategies:
            C.progress(f"seqlen {seqlen}, {strategy}", group.rank)
            every = group.transport.allgather_object(measure(group, args, seqlen, strategy), "bench linear")
            row = {"seqlen": seqlen, "strategy": strategy, "ranks": group.size,
                   **{key: max(r[key] for r in every) for key in every[0]}}
            row["tokens_per_s"] = seqlen / (row["forward_s"] + row["backward_s"])
            rows.append(row)
            if group.rank == 0:
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    env = C.environment_on_rank0(group, synchronized=True)
    if env is not None:
        C.print_and_write(env, rows, COLUMNS, args)
        if args.plot:
            plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
