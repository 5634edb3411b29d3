"""Linear attention across ranks: LASP-2 (one all-gather of the D x D states a pass) against the
LASP-1 chain and softmax attention's BurstAttention ring, time and bytes per rank against the
global sequence length, measured in one run; plus a PREDICTION for many GPUs beside the LASP-2
paper's figures.

    mpiexec -n G python bench/cpu/linear.py [--seqlens 4096 16384 65536] [--heads 8] [--kv-heads 8]
        [--headdim 64] [--dtype float32] [--no-causal] [--strategies lasp2 lasp1 burst]
        [--repeats 3] [--backend auto] [--json F] [--table F] [--plot F]
    python bench/cpu/linear.py --predict [--preset h100] [--ranks 64] [--seqlens 2097152] ...

Measured rows (rank 0 prints them; progress on stderr): per (seqlen, strategy) the forward and
the backward time (the slowest rank's median over --repeats, after one warm-up), tokens per
second of forward + backward, and the bytes and messages one rank sends per pass (the largest
over ranks, from group.stats). burst is softmax attention (causal like the others): the point of
LASP is that its messages do not grow with the sequence while the ring's K/V do.

--predict (no MPI, no measurement; every figure labelled PREDICTION): the library's cost model
(`burstcu.plan.predict_linear`) on a preset of
`burstcu.plan.MACHINES` for one layer, forward + backward, per rank:
    lasp2   compute + for each pass max(0, all-gather - intra-chunk work): one collective of
            latency * ceil(log2 G) + (G-1) * its bytes / bandwidth (forward: one state of
            B*Hkv*D*D fp32 a rank; backward: two, M and dM), hidden behind that pass's intra work
    lasp1   compute + the chains, nothing hidden: (G-1) hops of latency + state / bandwidth in
            the forward, 2 (G-1) in the causal backward (the prefix chain again, then dM's)
    ring    the LASP paper's "Ring Attention" baseline for a linear layer: G-1 steps of a K/V
            chunk, each step max(its share of compute, transfer)
with compute = the chunkwise flops (tiles of 128 rows) at the preset's flop/s. The LASP-2 paper
reports, at 2048K tokens on 64 A100s (Linear-Llama3-1B), LASP-2 36.6% faster than Ring Attention
and 15.2% faster than LASP-1; those are whole-model training throughputs (projections and MLPs
included, on A100s), while this model prices the attention layer alone on the preset, so its
ratios show which way and why, not the paper's magnitudes: a K/V ring moves C*D per step where
LASP moves D*D; LASP-1's 3 (G-1) sequential hops pay a latency each and hide nothing, where
LASP-2's two collectives pay log2 G latencies and hide behind the intra-chunk work.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu.plan import MACHINES, predict_linear  # noqa: E402

LINEAR = ("lasp2", "lasp1")


def measure(group, args, seqlen: int, strategy: str) -> dict:
    """Times and bytes of one (seqlen, strategy) on this rank; the caller reduces over ranks."""
    q, k, v, dout = C.make_local_inputs(group.rank, group.size, batch=args.batch, seqlen=seqlen,
                                        heads=args.heads, kv_heads=args.kv_heads or args.heads,
                                        headdim=args.headdim, dtype=args.dtype)
    if group.backend == "cupy":
        import cupy
        q, k, v, dout = (cupy.asarray(x) for x in (q, k, v, dout))
    causal = not args.no_causal

    def fwd():
        if strategy in LINEAR:
            return burstcu.linear_attention(q, k, v, group, causal=causal, strategy=strategy)
        return burstcu.attention(q, k, v, group, causal=causal, return_lse=True, strategy=strategy)

    def bwd(saved):
        if strategy in LINEAR:
            return burstcu.linear_attention_backward(dout, q, k, v, group, causal=causal,
                                                     strategy=strategy)
        out, lse = saved
        return burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal,
                                          strategy=strategy)

    def once(fn) -> float:
        """Seconds of one fn() started together on every rank (stats counted from its start)."""
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


def run(args) -> list[dict]:
    group = burstcu.init(backend=args.backend)
    rows = []
    for seqlen in args.seqlens:
        for strategy in args.strategies:
            C.progress(f"seqlen {seqlen}, {strategy}", group.rank)
            mine = measure(group, args, seqlen, strategy)
            every = group.transport.allgather_object(mine, "bench linear")
            row = {"seqlen": seqlen, "strategy": strategy, "ranks": group.size}
            for key in mine:
                row[key] = max(r[key] for r in every)
            row["tokens_per_s"] = seqlen / (row["forward_s"] + row["backward_s"])
            rows.append(row)
            if group.rank == 0:
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    env = C.environment(group, synchronized=True)
    group.close()
    return rows, env


COLUMNS = ["ranks", "seqlen", "strategy", "forward_s", "backward_s", "tokens_per_s",
           "forward_bytes", "forward_messages", "backward_bytes", "backward_messages"]


# -- the model: the library's (burstcu.plan.predict_linear) ----------------------------------

def predict(preset: str, ranks: int, seqlen: int, b: int, h: int, hkv: int, d: int,
            itemsize: int) -> dict:
    """PREDICTED seconds of one causal layer's forward + backward per rank on `preset`
    (`burstcu.plan.predict_linear`), with the ratios the table prints."""
    seconds = predict_linear(MACHINES[preset], ranks, seqlen, b, h, hkv, d, itemsize)
    return {"preset": preset, "ranks": ranks, "seqlen": seqlen, **seconds,
            "lasp2_over_ring": seconds["ring_s"] / seconds["lasp2_s"] - 1,
            "lasp2_over_lasp1": seconds["lasp1_s"] / seconds["lasp2_s"] - 1}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384, 65536])
    C.add_shape_args(p, heads=8, dtypes=("float16", "float32", "float64"))
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--strategies", nargs="+", default=["lasp2", "lasp1", "burst"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="auto")
    p.add_argument("--predict", action="store_true", help="the cost model only (PREDICTION)")
    p.add_argument("--preset", default="h100", choices=sorted(MACHINES))
    p.add_argument("--ranks", type=int, default=64, help="--predict: ranks")
    p.add_argument("--json")
    p.add_argument("--table")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    if args.predict:
        hkv = args.kv_heads or args.heads
        rows = [predict(args.preset, args.ranks, s, args.batch, args.heads, hkv, args.headdim,
                        2 if args.dtype == "float16" else 4) for s in args.seqlens]
        cols = ["preset", "ranks", "seqlen", "lasp2_s", "lasp1_s", "ring_s", "lasp2_over_ring",
                "lasp2_over_lasp1"]
        text = ("# PREDICTION (burstcu.plan.predict_linear, preset "
                f"{args.preset}: {MACHINES[args.preset].source}); LASP-2 paper, 64 A100s, 2048K: "
                "+36.6% over Ring Attention, +15.2% over LASP-1 (whole-model throughput; this "
                "prices the attention layer alone: compare directions, not magnitudes)\n"
                + C.table(rows, cols))
        print(text)
        if args.table:
            Path(args.table).write_text(text + "\n")
        if args.json:
            C.write_json(args.json, {"prediction": True, "rows": rows, "args": C.clean(vars(args))})
        return 0
    rows, env = run(args)
    comm, rank, _ = C.world()
    if rank != 0:
        return 0
    C.print_and_write(env, rows, COLUMNS, args)
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for strategy in sorted({r["strategy"] for r in rows}):
        pts = sorted((r["seqlen"], r["forward_s"] + r["backward_s"], r["forward_bytes"]
                      + r["backward_bytes"]) for r in rows if r["strategy"] == strategy)
        xs = [x[0] for x in pts]
        axes[0].plot(xs, [x[1] for x in pts], marker="o", label=strategy)
        axes[1].plot(xs, [max(x[2], 1) for x in pts], marker="o", label=strategy)
    for ax, title in zip(axes, ("forward + backward s (slowest rank)", "bytes sent a rank, fwd + bwd")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global seqlen")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
