"""PREDICTED pass times of burst or ring on GPUs from `burstcu.plan`'s cost model, never measured:
t_compute, t_comm, t_overlapped (bench/README.md), the efficiency and the global seqlen above which
compute outlasts communication. Causal runs zigzag, full contiguous.

    python bench/model/predict.py [--preset h100|h100-ib] [--ranks 8] [--seqlen N ...] [--causal]
        [--strategy burst|ring] [--tflops X] [--link-gbs X] [--latency-us X] [--all-presets]
    python bench/model/predict.py --strategies ...   every strategy and the one "auto" picks
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
PRESETS = {"h100": H100,
           "h100-ib": dataclasses.replace(H100, name="h100-ib", ranks_per_node=1,
                                          source=H100.source + "; every rank across InfiniBand")}
MAX_SEQLEN = 1 << 23   # hidden_above_seqlen searches up to this global length


def pass_times(args, machine: Machine, strategy: str, seqlen: int) -> dict:
    """PREDICTED {pass: {t_compute, t_comm, t_overlapped, bytes rank 0 sends}} of `strategy` at global
    `seqlen`, shape `args`: `burstcu.plan.predict` with free communication, free compute, and as is."""
    s, hkv = seqlen // args.ranks, args.kv_heads or args.heads
    machines = {"t_compute": dataclasses.replace(machine, intra_bw=INF, inter_bw=INF, latency=0.0),
                "t_comm": dataclasses.replace(machine, flops=INF, step_overhead=0.0),
                "t_overlapped": machine}
    got = {name: predict(strategy, {}, (args.batch, s, args.heads, args.headdim),
                         (args.batch, s, hkv, args.headdim), args.ranks, causal=args.causal,
                         layout="zigzag" if args.causal else "contiguous", dtype=args.dtype, machine=m)
           for name, m in machines.items()}
    return {p: {**{name: getattr(c, f"{p}_s") for name, c in got.items()},
                "bytes": getattr(got["t_overlapped"], f"{p}_bytes")} for p in PASSES}


def hidden_seqlen(args, machine: Machine, strategy: str, pass_: str) -> int | None:
    """PREDICTED global seqlen (a multiple of 2G) above which t_compute >= t_comm, up to
    MAX_SEQLEN (None: not even there; 2G: at every length). The difference can dip below 0 between
    two roots: walk down by halves from MAX_SEQLEN to the first exposed length, bisect above it."""
    hidden, hi = _hidden_at(args, machine, strategy, pass_), MAX_SEQLEN // (2 * args.ranks)
    if not hidden(hi):
        return None
    return _boundary(hidden, hi) * 2 * args.ranks


def exposed_from_seqlen(args, machine: Machine, strategy: str, pass_: str, above: int | None) -> int | None:
    """PREDICTED shortest global seqlen (a multiple of 2G) at which t_comm > t_compute, below
    `above` (`hidden_seqlen`): 2G where the shortest is exposed; None where none is. A per-call
    cost above the latency hides short passes too: the exposed lengths lie between two roots."""
    unit = 2 * args.ranks
    hidden = _hidden_at(args, machine, strategy, pass_)
    last = MAX_SEQLEN // unit if above is None else above // unit - 1   # exposed, unless above is 2G
    return None if last < 1 else _boundary(lambda u: not hidden(u), last) * unit


def _hidden_at(args, machine: Machine, strategy: str, pass_: str):
    def hidden(units: int) -> bool:   # at global seqlen units * 2G
        t = pass_times(args, machine, strategy, units * 2 * args.ranks)[pass_]
        return t["t_compute"] >= t["t_comm"]
    return hidden


def _boundary(holds, hi: int) -> int:
    """From `hi`, where holds(hi): halve down to where it fails, then bisect; the smallest units
    at or below `hi` from which holds() runs up to `hi` (1 where it holds down to 1)."""
    lo = hi // 2
    while lo >= 1 and holds(lo):
        lo, hi = lo // 2, lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def report(args, machine: Machine) -> dict:
    rows = []
    for n in args.seqlen:
        for p, t in pass_times(args, machine, args.strategy, n).items():
            tc, tm, to = t["t_compute"], t["t_comm"], t["t_overlapped"]
            rows.append({"kind": "PREDICTION", "pass": p, "t_compute": tc, "t_comm": tm,
                         "t_overlapped": to, "efficiency": C.overlap_efficiency(tc, tm, to),
                         "exposed_comm": to - tc, "hidden": tc >= tm, "bytes": t["bytes"], "seqlen": n})
    keys = ("ranks", "batch", "heads", "kv_heads", "headdim", "dtype", "causal")
    above = {p: hidden_seqlen(args, machine, args.strategy, p) for p in PASSES}
    return {"kind": "PREDICTION", "machine": dataclasses.asdict(machine), "strategy": args.strategy,
            "shape": {k: getattr(args, k) for k in keys}, "rows": rows,
            "hidden_above_seqlen": above,
            "exposed_from_seqlen": {p: exposed_from_seqlen(args, machine, args.strategy, p, above[p])
                                    for p in PASSES}}


def overlap_prediction(steps, link, blocking: bool = False) -> dict:
    """PREDICTED pass over an emulated `link` (`burstcu.Link`) from `steps`, dicts of the measured
    t_compute and sent/received messages and bytes (bench/README.md, "cpu/overlap.py --link-gbps");
    blocking: t_overlapped is their sum, not the max. hidden: the pass takes only its compute."""
    latency = link.seconds(0)
    tc = tm = to = hidden = 0.0
    for st in steps:
        c = st["t_compute"]
        m = max(st[f"{way}_messages"] * latency + link.seconds(st[f"{way}_bytes"]) - latency
                for way in ("sent", "received"))
        o = c + m if blocking else max(c, m)
        tc, tm, to, hidden = tc + c, tm + m, to + o, hidden + (c + m - o)
    return {"kind": "PREDICTION", "t_compute": tc, "t_comm": tm, "t_overlapped": to,
            "t_hidden": hidden, "efficiency": hidden / tm if tm > 0 else None,
            "hidden": tm > 0 and to <= tc}


def _hidden_text(rep: dict, pass_: str) -> str:
    ranks, above = rep["shape"]["ranks"], rep["hidden_above_seqlen"][pass_]
    start = rep["exposed_from_seqlen"][pass_]
    if start is None:
        return "compute outlasts communication at every seqlen (the per-call cost exceeds the latency)"
    shorter = ("" if start == 2 * ranks else f"; below ~{start:,} compute outlasts it again (the per-call "
                                              f"cost exceeds the latency)")
    if above is None:
        return (f"communication longer than compute from global seqlen ~{start:,} up to {MAX_SEQLEN:,}"
                + shorter)
    return (f"compute outlasts communication above global seqlen ~{above:,} (local {above // ranks:,} a "
            f"rank); exposed from ~{start:,} up to it" + shorter)


def print_report(rep: dict) -> None:
    m, sh = rep["machine"], rep["shape"]
    print(f"PREDICTION (burstcu.plan's model, not a measurement): {m['name']} — {m['source']}")
    print(f"PREDICTION strategy={rep['strategy']} G={sh['ranks']} B={sh['batch']} H={sh['heads']}/"
          f"{sh['kv_heads'] or sh['heads']} D={sh['headdim']} {sh['dtype']} "
          f"{'causal (zigzag)' if sh['causal'] else 'full'}")
    show = [{"": "PREDICTION", "pass": r["pass"], "seqlen": r["seqlen"],
             **{k: C.fmt_s(r[k]) for k in ("t_compute", "t_comm", "t_overlapped")},
             "efficiency": "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}",
             "exposed": C.fmt_s(r["exposed_comm"]),
             "compute >= comm": r["hidden"]} for r in rep["rows"]]
    print(C.table(show, list(show[0])))
    for pass_ in PASSES:
        print(f"PREDICTION {m['name']} {rep['strategy']} {pass_}: {_hidden_text(rep, pass_)}")


def machine(args, name: str) -> Machine:
    """The preset, with the command line's overrides, which its `source` then names (its text
    states the preset's own assumptions)."""
    bw = None if args.link_gbs is None else args.link_gbs * 1e9
    over = {"flops": None if args.tflops is None else args.tflops * 1e12, "intra_bw": bw, "inter_bw": bw,
            "latency": None if args.latency_us is None else args.latency_us * 1e-6}
    said = [f"{value:g} {unit}" for value, unit in ((args.tflops, "TFLOP/s"), (args.link_gbs, "GB/s links"),
                                                   (args.latency_us, "us a message")) if value is not None]
    preset = PRESETS[name]
    source = preset.source + (f"; OVERRIDDEN here: {', '.join(said)}" if said else "")
    return dataclasses.replace(preset, source=source, **{k: v for k, v in over.items() if v is not None})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h100", choices=sorted(PRESETS))
    p.add_argument("--all-presets", action="store_true", help="only the hidden-above seqlen of every preset")
    p.add_argument("--tflops", type=C.at_least(0, strict=True),
                   help="override the sustained attention TFLOP/s")
    p.add_argument("--link-gbs", type=C.at_least(0, strict=True),
                   help="override both links' one-way bandwidth (GB/s)")
    p.add_argument("--latency-us", type=C.at_least(0), help="override the per-exchange latency")
    p.add_argument("--ranks", type=C.positive, default=8)
    C.add_shape_args(p, heads=32, headdim=128, dtype="bfloat16", dtypes=("float16", "bfloat16", "float32"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--strategy", default="burst", choices=["burst", "ring"])
    p.add_argument("--strategies", action="store_true",
                   help="every strategy's predicted pass times (burstcu.plan) instead of one strategy's")
    p.add_argument("--seqlen", type=C.positive, nargs="+",
                   help="global lengths, multiples of --ranks (2 x with --causal or --strategies); "
                        "default: 4K, 16K, ... 1M, each rounded down to one")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    unit = 2 * args.ranks if args.causal or args.strategies else args.ranks   # zigzag: 2G chunks
    if args.seqlen is None:
        args.seqlen = [max(unit, n - n % unit) for n in (2**k for k in range(12, 21, 2))]
    odd = [n for n in args.seqlen if n % unit]
    if odd:
        p.error(f"--seqlen {odd[0]}: a multiple of {unit} ({'2 x ' if unit > args.ranks else ''}"
                f"--ranks {args.ranks}), so that every rank holds the same rows")
    names = sorted(PRESETS) if args.all_presets else [args.preset]
    if args.strategies:   # every strategy (burstcu.plan.plan) and the one strategy="auto" picks
        tables, group = [], SimpleNamespace(size=args.ranks, rank=0, ops=None)
        for name in names:
            for n in args.seqlen:
                s = n // args.ranks
                p = plan((args.batch, s, args.heads, args.headdim),
                         (args.batch, s, args.kv_heads or args.heads, args.headdim), group,
                         causal=args.causal, layout="zigzag", dtype=args.dtype, machine=machine(args, name))
                print(p)
                tables.append({"kind": "PREDICTION", "preset": name, "seqlen": n, "choice": p.choice.label,
                               "candidates": [c.__dict__ for c in p.candidates]})
        return C.emit(None, {"benchmark": "model", "kind": "PREDICTION", "strategies": tables}, args)
    reports = [report(args, machine(args, n)) for n in names]
    if not args.all_presets:
        print_report(reports[0])
    for rep in reports if args.all_presets else []:
        for pass_ in PASSES:
            print(f"PREDICTION {rep['machine']['name']:12s} {args.strategy} {pass_:8s}: "
                  f"{_hidden_text(rep, pass_)} (G={args.ranks})")
    return C.emit(None, {"benchmark": "model", "kind": "PREDICTION", "reports": reports}, args)


if __name__ == "__main__":
    main()
