"""The planner's pick (`burstcu.plan`, what strategy="auto" runs) against the measured best on CPU
ranks over a grid of shapes, the machine measured first; regret: the pick's time over the best's.

    mpiexec -n G python bench/model/plan_check.py [--seqlen 512 1024] [--heads 8] [--kv-heads 8 2]
        [--headdim 32] [--causal] [--layout zigzag] [--repeats 3] [--json F]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu.plan import Machine, plan  # noqa: E402

def fwd_bwd_seconds(group, inputs, repeats: int, on=None, **how) -> float:
    """Median over repeats of the slowest rank's forward + backward seconds, across the ranks of
    `on` (None: each rank alone)."""
    q, k, v, dout = inputs

    def run():
        out, lse = burstcu.attention(q, k, v, on, return_lse=True, **how)
        burstcu.attention_backward(dout, q, k, v, out, lse, on, **how)
    return C.slowest_rank_seconds(group, run, repeats, warmup=1)


def measure_machine(group, headdim: int, repeats: int) -> Machine:
    """flop/s of the local op (14 B H S^2 D a forward + backward) and the ring's bandwidth and
    latency (exchanges of 4 MiB and of 8 bytes), every rank busy at once."""
    b, s, h, d = 1, 512, 4, headdim
    full = C.normal(np, [(b, s, h, d)] * 4, "float32", group.rank)
    tiny = [a[:, :8, :1, :8].copy() for a in full]          # the fixed cost of a call
    step_overhead = fwd_bwd_seconds(group, tiny, repeats) / 2
    flops = 14 * b * h * s * s * d / max(fwd_bwd_seconds(group, full, repeats) - 2 * step_overhead, 1e-9)
    t = group.transport

    def exchange(nbytes: int, rounds: int) -> float:
        send, recv = np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        group.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            t.send_recv(send, recv, t.next_rank, t.prev_rank)
            t.commit()
            t.wait()
        return max(t.allgather_object((time.perf_counter() - t0) / rounds, "bench timing"))

    latency, bandwidth = 1e-6, 1e12   # one rank: nothing to measure, nothing moves
    link = "no exchange (one rank)"
    if group.size > 1:
        latency = exchange(8, 20)
        bandwidth = (4 << 20) / max(exchange(4 << 20, 5) - latency, 1e-9)
        link = f"{bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us an exchange"
    return Machine("measured", flops, bandwidth, bandwidth, latency, group.size,
                   f"MEASURED here: {flops / 1e9:.1f} GFLOP/s a rank, {link}, "
                   f"{step_overhead * 1e3:.2f} ms a step", step_overhead)


def time_candidates(candidates, seconds) -> dict:
    """{label: seconds(strategy, options)} of every candidate, each run as `burstcu.attention`
    takes the plan's choice (`strategy=c.strategy, **c.options`)."""
    return {c.label: seconds(c.strategy, c.options) for c in candidates}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, nargs="+", default=[512, 1024], help="global lengths")
    p.add_argument("--heads", type=int, nargs="+", default=[8])
    p.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    p.add_argument("--headdim", type=int, default=32)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    p.add_argument("--repeats", type=C.positive, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    group = burstcu.init(backend="numpy")
    machine = measure_machine(group, args.headdim, args.repeats)
    grid = [(n, h, hkv) for n, h, hkv in itertools.product(args.seqlen, args.heads, args.kv_heads)
            if h % hkv == 0]
    rows, how = [], dict(causal=args.causal, layout=args.layout)
    for index, (n, h, hkv) in enumerate(grid):
        C.progress(f"plan_check [{index + 1}/{len(grid)}] N={n} H={h}/{hkv}", group.rank)
        inputs = C.local_inputs(group, batch=1, seqlen=n, heads=h, kv_heads=hkv, headdim=args.headdim,
                                dtype="float32", layout=args.layout)
        q, k = inputs[0], inputs[1]
        chosen = plan(q.shape, k.shape, group, dtype=q.dtype, machine=machine, **how)
        measured = time_candidates(chosen.candidates, lambda strategy, options: fwd_bwd_seconds(
            group, inputs, args.repeats, group, strategy=strategy, **how, **options))
        best, pick = min(measured, key=measured.get), chosen.choice.label
        rows.append({"seqlen": n, "heads": h, "kv_heads": hkv, "pick": pick, "measured_best": best,
                     "regret": measured[pick] / measured[best], "measured_s": measured,
                     "predicted_s": {c.label: c.forward_s + c.backward_s for c in chosen.candidates}})
    env = C.environment_on_rank0(group, print_header=True)
    if env is None:
        return None
    print(f"# CPU, not GPU figures. G={group.size} D={args.headdim} causal={args.causal} "
          f"layout={args.layout}; model machine: {machine.source}")
    show = [{"N": r["seqlen"], "H": f"{r['heads']}/{r['kv_heads']}", "pick": r["pick"],
             "measured best": r["measured_best"],
             "regret": f"{r['regret']:.2f}", "pick measured": C.fmt_s(r["measured_s"][r["pick"]]),
             "best measured": C.fmt_s(r["measured_s"][r["measured_best"]])} for r in rows]
    return C.emit(C.table(show, list(show[0])) if show else "(no shape in the grid)",
                  {"benchmark": "plan_check", "environment": env, "args": vars(args),
                   "machine": machine.__dict__, "rows": rows}, args)


if __name__ == "__main__":
    main()
