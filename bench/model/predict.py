"""PREDICTED pass times of the ring strategies on GPUs, from the library's one cost model
(`burstcu.plan`): compute, communication and overlapped time of a forward and a backward pass,
the overlap efficiency, and the sequence length above which compute outlasts communication.
Every figure it prints is a PREDICTION, never a measurement.

    python bench/model/predict.py [--preset h100] [--ranks 8] [--heads 32] [--kv-heads H]
        [--headdim 128] [--dtype bfloat16] [--seqlen N ...] [--causal] [--strategy burst|ring]
        [--tflops X] [--link-gbs X] [--latency-us X] [--all-presets] [--json FILE]
    python bench/model/predict.py --strategies ...   every strategy's predicted pass times
        (burst, ring, allgather, ulysses, usp) and the one strategy="auto" picks

The model is `burstcu.plan.predict` (its module docstring has it): per ring step the busiest
rank's max(compute, transfer), summed over the steps; compute counted exactly from the mask's
(query, key) pairs at the machine's sustained flop/s plus a fixed cost a call; transfers are
latency + bytes / bandwidth with the strategies' exact byte counts (`burstcu.engine`). This
script splits each pass into
    t_compute     the pass on the preset with free communication (infinite bandwidth, no latency)
    t_comm        the pass on the preset with free compute (infinite flop/s, no cost a call)
    t_overlapped  the pass on the preset itself
    efficiency    (t_compute + t_comm - t_overlapped) / t_comm, as bench/cpu/overlap.py measures
                  it: the fraction of the exchanges' time hidden behind compute
    hidden        t_compute >= t_comm; `hidden_above_seqlen` is the least global seqlen (a
                  multiple of 2G) where that holds, searched by bisection
Causal attention runs on the zigzag layout (balanced ranks), full attention on contiguous shards.

Presets: "h100", the library's `MACHINES["h100"]` (H100 SXM5, NVLink 4 and NDR InfiniBand
datasheet figures times ASSUMED efficiencies; see burstcu/plan.py: NVLink within a node of 8
ranks, InfiniBand across nodes), and "h100-ib", the same with every rank across InfiniBand.

`overlap_prediction` is bench/cpu/overlap.py's prediction over an emulated link
(`burstcu.Link`): the same max(compute, transfer) per step, from measured compute.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

from burstcu.plan import MACHINES, Machine, plan, predict  # noqa: E402

INF = float("inf")
PASSES = ("forward", "backward")
H100 = MACHINES["h100"]
PRESETS = {
    "h100": H100,
    "h100-ib": dataclasses.replace(H100, name="h100-ib", ranks_per_node=1,
                                   source=H100.source + "; every rank across InfiniBand"),
}
MAX_SEQLEN = 1 << 23   # hidden_above_seqlen searches up to this global length


# ----------------------------------------------------------------------------------------------
# the library's model, split into compute, communication and both


def pass_times(machine: Machine, strategy: str, q_shape, k_shape, size: int, *, causal: bool,
               layout="contiguous", dtype="bfloat16", rank: int = 0, cu_seqlens=None) -> dict:
    """PREDICTED {pass: {"t_compute", "t_comm", "t_overlapped", "bytes"}} (seconds; bytes that
    `rank` sends) of `strategy` for this rank's q (B, S, H, D) and k (B, S, Hkv, D) on `size`
    ranks: `burstcu.plan.predict` on `machine`, on it with free communication, and on it with
    free compute. layout: a name or a `burstcu.layout.Partition`; cu_seqlens: document
    boundaries (0, ..., N) or None."""
    free_comm = dataclasses.replace(machine, intra_bw=INF, inter_bw=INF, latency=0.0)
    free_compute = dataclasses.replace(machine, flops=INF, step_overhead=0.0)
    got = {name: predict(strategy, {}, q_shape, k_shape, size, causal=causal, layout=layout,
                         dtype=dtype, machine=m, rank=rank, cu_seqlens=cu_seqlens)
           for name, m in (("t_compute", free_comm), ("t_comm", free_compute),
                           ("t_overlapped", machine))}
    return {p: {**{name: getattr(c, f"{p}_s") for name, c in got.items()},
                "bytes": getattr(got["t_overlapped"], f"{p}_bytes")} for p in PASSES}


def pass_row(pass_: str, times: dict) -> dict:
    """One pass's PREDICTION row: its times, the efficiency, exposed communication, hidden."""
    tc, tm, to = times["t_compute"], times["t_comm"], times["t_overlapped"]
    return {"kind": "PREDICTION", "pass": pass_, "t_compute": tc, "t_comm": tm, "t_overlapped": to,
            "efficiency": C.overlap_efficiency(tc, tm, to), "exposed_comm": to - tc,
            "hidden": tc >= tm, "bytes": times["bytes"]}


def _times(args, machine: Machine, strategy: str, seqlen: int) -> dict:
    s = seqlen // args.ranks
    return pass_times(machine, strategy, (args.batch, s, args.heads, args.headdim),
                      (args.batch, s, args.kv_heads or args.heads, args.headdim), args.ranks,
                      causal=args.causal, layout="zigzag" if args.causal else "contiguous",
                      dtype=args.dtype)


def hidden_seqlen(args, machine: Machine, strategy: str, pass_: str) -> int | None:
    """PREDICTED global seqlen (a multiple of 2G) above which t_compute >= t_comm in `pass_`
    up to MAX_SEQLEN; None when not even there. t_compute - t_comm is about a + c S^2 - b S (a:
    the per-call cost over the latency), which can dip below 0 between two roots: the search
    walks down by halves from MAX_SEQLEN to the first length exposed, then bisects above it."""
    unit = 2 * args.ranks

    def hidden(units: int) -> bool:
        t = _times(args, machine, strategy, units * unit)[pass_]
        return t["t_compute"] >= t["t_comm"]

    hi = MAX_SEQLEN // unit
    if not hidden(hi):
        return None
    lo = hi // 2
    while lo >= 1 and hidden(lo):
        lo, hi = lo // 2, lo
    if lo < 1:
        return unit                    # hidden at every length tried
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hidden(mid) else (mid, hi)
    return hi * unit


def report(args, machine: Machine) -> dict:
    rows = [{**pass_row(p, times), "seqlen": n} for n in args.seqlen
            for p, times in _times(args, machine, args.strategy, n).items()]
    return {"kind": "PREDICTION", "machine": dataclasses.asdict(machine), "strategy": args.strategy,
            "shape": {k: getattr(args, k) for k in ("ranks", "batch", "heads", "kv_heads", "headdim",
                                                     "dtype", "causal")},
            "rows": rows,
            "hidden_above_seqlen": {p: hidden_seqlen(args, machine, args.strategy, p) for p in PASSES}}


# ----------------------------------------------------------------------------------------------
# over an emulated link, from measured compute (bench/cpu/overlap.py --link-gbps)


def link_seconds(link, messages: int, nbytes: int) -> float:
    """One direction of an emulated link (`burstcu.Link`): each message's latency, and the
    bytes at the link's rate (`Link.seconds`)."""
    latency = link.seconds(0)
    return messages * latency + link.seconds(nbytes) - latency


def overlap_prediction(steps, link, blocking: bool = False) -> dict:
    """PREDICTED pass over `link` from measured compute: `steps` are dicts with t_compute
    (seconds, measured) and sent_messages, sent_bytes, received_messages, received_bytes (what
    the step's exchange moves on this rank). Each step: t_comm = the longer direction's
    `link_seconds`; t_overlapped = max(t_compute, t_comm) as in burstcu.plan, or their sum for a
    blocking exchange (allgather's gather and hops). The pass: the sums, and the efficiency of
    the sums. hidden: the pass takes only its compute (every exchange is shorter than the
    compute beside it; a step that only exchanges, as a backward's last hop home, is exposed)."""
    tc = tm = to = hidden = 0.0
    for st in steps:
        c = st["t_compute"]
        m = max(link_seconds(link, st["sent_messages"], st["sent_bytes"]),
                link_seconds(link, st["received_messages"], st["received_bytes"]))
        o = c + m if blocking else max(c, m)
        tc, tm, to, hidden = tc + c, tm + m, to + o, hidden + (c + m - o)   # per step: exact 0s
    return {"kind": "PREDICTION", "t_compute": tc, "t_comm": tm, "t_overlapped": to,
            "t_hidden": hidden, "efficiency": hidden / tm if tm > 0 else None,
            "hidden": tm > 0 and to <= tc}


# ----------------------------------------------------------------------------------------------
# output


def print_report(rep: dict) -> None:
    m, sh = rep["machine"], rep["shape"]
    print(f"PREDICTION (burstcu.plan's model, not a measurement): {m['name']} — {m['source']}")
    print(f"PREDICTION strategy={rep['strategy']} G={sh['ranks']} B={sh['batch']} H={sh['heads']}/"
          f"{sh['kv_heads'] or sh['heads']} D={sh['headdim']} {sh['dtype']} "
          f"{'causal (zigzag)' if sh['causal'] else 'full'}")
    show = [{"": "PREDICTION", "pass": r["pass"], "seqlen": r["seqlen"],
             "t_compute": C.fmt_s(r["t_compute"]), "t_comm": C.fmt_s(r["t_comm"]),
             "t_overlapped": C.fmt_s(r["t_overlapped"]), "efficiency": f"{r['efficiency']:.2f}",
             "exposed": C.fmt_s(r["exposed_comm"]), "comm hidden": r["hidden"]} for r in rep["rows"]]
    print(C.table(show, list(show[0])))
    for pass_, n in rep["hidden_above_seqlen"].items():
        print(f"PREDICTION {m['name']} {rep['strategy']} {pass_}: {_hidden_text(n, sh['ranks'])}")


def _hidden_text(n: int | None, ranks: int) -> str:
    if n is None:
        return f"communication longer than compute up to global seqlen {MAX_SEQLEN:,}"
    if n == 2 * ranks:
        return "compute outlasts communication at every seqlen (the per-call cost exceeds the latency)"
    return (f"compute outlasts communication above global seqlen ~{n:,} (local {n // ranks:,} a "
            f"rank); exposed below it")


def strategy_tables(args, names) -> list[dict]:
    """PREDICTED forward/backward seconds of every strategy (`burstcu.plan.plan`) on each preset
    and global seqlen, and the one strategy="auto" picks."""
    out = []
    group = SimpleNamespace(size=args.ranks, rank=0, ops=None)
    for name in names:
        for n in args.seqlen:
            s = n // args.ranks
            p = plan((args.batch, s, args.heads, args.headdim),
                     (args.batch, s, args.kv_heads or args.heads, args.headdim), group,
                     causal=args.causal, layout="zigzag", dtype=args.dtype, machine=machine(args, name))
            print(p)
            out.append({"kind": "PREDICTION", "preset": name, "seqlen": n, "choice": p.choice.label,
                        "candidates": [c.__dict__ for c in p.candidates]})
    return out


def machine(args, name: str) -> Machine:
    """The preset, with the command line's overrides."""
    m = PRESETS[name]
    over = {"flops": None if args.tflops is None else args.tflops * 1e12,
            "intra_bw": None if args.link_gbs is None else args.link_gbs * 1e9,
            "inter_bw": None if args.link_gbs is None else args.link_gbs * 1e9,
            "latency": None if args.latency_us is None else args.latency_us * 1e-6}
    return dataclasses.replace(m, **{k: v for k, v in over.items() if v is not None})


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h100", choices=sorted(PRESETS))
    p.add_argument("--all-presets", action="store_true", help="only the hidden-above seqlen of every preset")
    p.add_argument("--tflops", type=float, help="override the sustained attention TFLOP/s")
    p.add_argument("--link-gbs", type=float, help="override both links' one-way bandwidth (GB/s)")
    p.add_argument("--latency-us", type=float, help="override the per-exchange latency")
    p.add_argument("--ranks", type=int, default=8)
    C.add_shape_args(p, heads=32, headdim=128, dtype="bfloat16",
                     dtypes=("float16", "bfloat16", "float32"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--strategy", default="burst", choices=["burst", "ring"])
    p.add_argument("--strategies", action="store_true",
                   help="every strategy's predicted pass times (burstcu.plan) instead of one strategy's")
    p.add_argument("--seqlen", type=int, nargs="+", default=[2**k for k in range(12, 21, 2)])
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    names = sorted(PRESETS) if args.all_presets else [args.preset]
    if args.strategies:
        result = {"benchmark": "model", "kind": "PREDICTION", "strategies": strategy_tables(args, names)}
    else:
        reports = [report(args, machine(args, n)) for n in names]
        for rep in reports if args.all_presets else []:
            for pass_, n in rep["hidden_above_seqlen"].items():
                print(f"PREDICTION {rep['machine']['name']:12s} {args.strategy} {pass_:8s}: "
                      f"{_hidden_text(n, args.ranks)} (G={args.ranks})")
        if not args.all_presets:
            print_report(reports[0])
        result = {"benchmark": "model", "kind": "PREDICTION", "reports": reports}
    return C.finish(result, args.json)


if __name__ == "__main__":
    main()
