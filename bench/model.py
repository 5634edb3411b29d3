"""A performance MODEL of one ring step on GPUs: predicted compute time, communication time,
overlapped time and overlap efficiency, and the sequence length at which communication becomes
hidden. Every figure it prints is a PREDICTION from the numbers below, not a measurement.

    python bench/model.py [--preset h100-nvlink] [--ranks 8] [--heads 32] [--headdim 128]
        [--seqlen N ...] [--causal] [--strategy burst|ring] [--all-presets] [--json FILE]
    python bench/model.py --strategies [--all-presets] ...   every strategy's predicted pass times
        (burstcu.plan's model: burst, ring, allgather, ulysses, usp) and the one "auto" picks

Model (per rank, one ring step, S = N/G local tokens, B batch, H heads, Hkv K/V heads, D):
  compute   t_c = flops / (peak * mfu)
            forward  4 B H S^2 D flops (QK^T and PV); backward 10 B H S^2 D (QK^T recomputed,
            dV, dP, dQ, dK); causal with the zigzag layout: half of that on every step.
  comm      t_m = messages * latency + bytes / (link_bw * link_eff)
            burst fwd: K+V in one message;  bwd: Q, dO (input dtype) + lse, delta, dQ (fp32)
            ring  fwd: K, V as 2 messages;  bwd: K, V (input dtype) + dK, dV (fp32), 4 messages
  overlap   t_o = max(t_c + contention * min(t_c, t_m), t_m): the transfer runs beside the kernel
            on its own stream; while both run (min(t_c, t_m)) the NCCL kernels / copy engines slow
            the attention kernel by the fraction `contention` (SMs and HBM bandwidth they take).
            A blocking exchange (the all-gather baseline) hides nothing: t_o = t_c + t_m.
  efficiency = (t_c + t_m - t_o) / t_m, as in bench/overlap.py: the fraction of the exchange's
            time hidden behind compute. 1 - contention while compute outlasts the exchange, and
            t_c / t_m < 1 once the exchange is longer (communication exposed), 0 for a blocking
            exchange. (Over a pass: the same with the sums of the steps' times.)
  hidden    t_c >= t_m: solved for S in a S^2 = m*latency + b S (a, b: time per S^2, per S).
  emulated link (burstcu.Link, `overlap_prediction`): t_m of a step = per direction, its
            messages * latency + bytes * 8 / (Gb/s * 1e9), the longer direction; t_c measured;
            contention 0 (no NCCL kernels; the CPU's own copy cost is part of what is measured).

Sources of the preset numbers (vendor peak specifications; everything else is an assumption and
is labelled so):
  A100 SXM4: 312 TFLOP/s dense FP16/BF16 tensor core; NVLink 3: 600 GB/s total bandwidth per GPU
      (= 300 GB/s each way) — NVIDIA A100 Tensor Core GPU datasheet.
  H100 SXM5: 989 TFLOP/s dense BF16 tensor core (1979 with sparsity); NVLink 4: 900 GB/s total per
      GPU (= 450 GB/s each way) — NVIDIA H100 Tensor Core GPU datasheet.
  InfiniBand: HDR 200 Gb/s per port (A100 systems, ConnectX-6) = 25 GB/s each way; NDR 400 Gb/s
      (H100 systems, ConnectX-7) = 50 GB/s each way, one port per GPU as in DGX A100/H100.
  ASSUMED (not vendor figures): mfu 0.5 forward / 0.4 backward (FlashAttention-2 reports up to
      ~70% / ~60% of A100 peak; a ring step's kernel is shorter), link efficiency 0.8, latency
      10 us per message on NVLink and 20 us over InfiniBand (NCCL send/recv order of magnitude),
      contention 0.05.
A ring step sends to one neighbour and receives from the other at the same time, so the one-way
bandwidth is the one that matters.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: float        # dense 16-bit tensor-core peak (vendor)
    link_gbps: float          # one-way GB/s per GPU on the ring's links (vendor)
    latency_us: float         # per message (assumed)
    source: str
    mfu_fwd: float = 0.5      # assumed
    mfu_bwd: float = 0.4      # assumed
    link_eff: float = 0.8     # assumed
    contention: float = 0.05  # assumed


PRESETS = {
    "a100-nvlink": Hardware("a100-nvlink", 312, 300, 10, "A100 SXM4 datasheet: 312 TF dense BF16; NVLink3 600 GB/s total"),
    "a100-ib": Hardware("a100-ib", 312, 25, 20, "A100 datasheet; InfiniBand HDR 200 Gb/s per GPU"),
    "h100-nvlink": Hardware("h100-nvlink", 989, 450, 10, "H100 SXM5 datasheet: 989 TF dense BF16; NVLink4 900 GB/s total"),
    "h100-ib": Hardware("h100-ib", 989, 50, 20, "H100 datasheet; InfiniBand NDR 400 Gb/s per GPU"),
}


@dataclass(frozen=True)
class Shape:
    ranks: int
    batch: int
    heads: int
    kv_heads: int
    headdim: int
    itemsize: int = 2         # bf16/fp16 inputs
    acc: int = 4              # fp32 accumulators on the wire (dQ, dK, dV, lse, delta)
    causal: bool = False


def step_terms(strategy: str, pass_: str, shape: Shape) -> tuple[float, float, int]:
    """(flops per S^2, bytes per S, messages) of one ring step."""
    B, H, Hkv, D = shape.batch, shape.heads, shape.kv_heads, shape.headdim
    it, acc = shape.itemsize, shape.acc
    work = 0.5 if shape.causal else 1.0
    if pass_ == "forward":
        return 4 * B * H * D * work, 2 * B * Hkv * D * it, (1 if strategy == "burst" else 2)
    if strategy == "burst":
        return 10 * B * H * D * work, 2 * B * H * D * it + 2 * B * H * acc + B * H * D * acc, 1
    return 10 * B * H * D * work, 2 * B * Hkv * D * it + 2 * B * Hkv * D * acc, 4


def overlapped(tc: float, tm: float, contention: float = 0.0, blocking: bool = False) -> float:
    """t_o of one step whose compute takes tc and exchange tm (module docstring)."""
    if blocking:
        return tc + tm
    return max(tc + contention * min(tc, tm), tm)


def efficiency(tc: float, tm: float, to: float) -> float | None:
    """(tc + tm - to) / tm: the fraction of the exchange hidden behind compute; None without
    an exchange."""
    return (tc + tm - to) / tm if tm > 0 else None


def link_seconds(messages: int, nbytes: int, gbps: float, latency_us: float) -> float:
    """One direction of an emulated link (burstcu.Link): messages * latency + bytes / rate.
    gbps in gigabits per second (not the presets' GB/s)."""
    return messages * latency_us * 1e-6 + nbytes * 8 / (gbps * 1e9)


def overlap_prediction(steps, gbps: float, latency_us: float, blocking: bool = False) -> dict:
    """PREDICTED pass over an emulated link from measured compute: `steps` are dicts with
    t_compute (measured) and sent_messages, sent_bytes, received_messages, received_bytes (what
    the step's exchange moves on this rank). Each step: t_m = the longer direction's
    `link_seconds`, t_o = `overlapped(t_c, t_m, 0, blocking)`; the pass: sums, and the
    efficiency of the sums. hidden: the pass takes only its compute (every exchange is shorter
    than the compute beside it; a step that only exchanges, as the last hop home of a backward,
    leaves its exchange exposed)."""
    tc = tm = to = hidden = 0.0
    for st in steps:
        c = st["t_compute"]
        m = max(link_seconds(st["sent_messages"], st["sent_bytes"], gbps, latency_us),
                link_seconds(st["received_messages"], st["received_bytes"], gbps, latency_us))
        o = overlapped(c, m, 0.0, blocking)
        tc, tm, to, hidden = tc + c, tm + m, to + o, hidden + (c + m - o)  # per step: exact 0s
    return {"kind": "PREDICTION", "t_compute": tc, "t_comm": tm, "t_overlapped": to,
            "t_hidden": hidden, "efficiency": hidden / tm if tm > 0 else None,
            "hidden": tm > 0 and to <= tc}


def predict_step(hw: Hardware, shape: Shape, strategy: str, pass_: str, seqlen: int) -> dict:
    """PREDICTED times (seconds) of one ring step at global `seqlen`."""
    flops_s2, bytes_s, msgs = step_terms(strategy, pass_, shape)
    s = seqlen / shape.ranks
    mfu = hw.mfu_fwd if pass_ == "forward" else hw.mfu_bwd
    tc = flops_s2 * s * s / (hw.peak_tflops * 1e12 * mfu)
    tm = msgs * hw.latency_us * 1e-6 + bytes_s * s / (hw.link_gbps * 1e9 * hw.link_eff)
    to = overlapped(tc, tm, hw.contention)
    eff = efficiency(tc, tm, to)
    return {"kind": "PREDICTION", "seqlen": seqlen, "t_compute": tc, "t_comm": tm, "t_overlapped": to,
            "efficiency": eff, "exposed_comm": max(0.0, tm - tc), "hidden": tc >= tm,
            "bytes": bytes_s * s, "flops": flops_s2 * s * s}


def hidden_seqlen(hw: Hardware, shape: Shape, strategy: str, pass_: str) -> float:
    """PREDICTED global seqlen above which t_compute >= t_comm (communication hidden)."""
    flops_s2, bytes_s, msgs = step_terms(strategy, pass_, shape)
    mfu = hw.mfu_fwd if pass_ == "forward" else hw.mfu_bwd
    a = flops_s2 / (hw.peak_tflops * 1e12 * mfu)
    b = bytes_s / (hw.link_gbps * 1e9 * hw.link_eff)
    lat = msgs * hw.latency_us * 1e-6
    s = (b + math.sqrt(b * b + 4 * a * lat)) / (2 * a)
    return s * shape.ranks


def report(hw: Hardware, shape: Shape, strategy: str, seqlens) -> dict:
    rows, hidden = [], {}
    for pass_ in ("forward", "backward"):
        hidden[pass_] = hidden_seqlen(hw, shape, strategy, pass_)
        for n in seqlens:
            rows.append({"pass": pass_, **predict_step(hw, shape, strategy, pass_, n)})
    return {"kind": "PREDICTION", "hardware": asdict(hw), "shape": asdict(shape), "strategy": strategy,
            "steps": rows, "hidden_above_seqlen": hidden}


def print_report(rep: dict) -> None:
    hw, sh = rep["hardware"], rep["shape"]
    print(f"PREDICTION (model, not a measurement): {hw['name']} — {hw['source']}; assumed mfu "
          f"{hw['mfu_fwd']}/{hw['mfu_bwd']}, link eff {hw['link_eff']}, latency {hw['latency_us']}us, "
          f"contention {hw['contention']}")
    print(f"PREDICTION strategy={rep['strategy']} G={sh['ranks']} B={sh['batch']} H={sh['heads']}/"
          f"{sh['kv_heads']} D={sh['headdim']} {'causal(zigzag)' if sh['causal'] else 'full'} "
          f"itemsize={sh['itemsize']}")
    show = [{"": "PREDICTION", "pass": r["pass"], "seqlen": r["seqlen"], "t_compute": C.fmt_s(r["t_compute"]),
             "t_comm": C.fmt_s(r["t_comm"]), "t_overlapped": C.fmt_s(r["t_overlapped"]),
             "efficiency": f"{r['efficiency']:.2f}", "exposed": C.fmt_s(r["exposed_comm"]),
             "comm hidden": r["hidden"]} for r in rep["steps"]]
    print(C.table(show, list(show[0])))
    for pass_, n in rep["hidden_above_seqlen"].items():
        print(f"PREDICTION {hw['name']} {rep['strategy']} {pass_}: communication hidden above global "
              f"seqlen ~{n:,.0f} (local {n / sh['ranks']:,.0f} per rank); exposed below it")


def strategy_tables(args, names) -> list[dict]:
    """PREDICTED forward/backward seconds of every strategy (burstcu.plan) on each preset, for
    each global seqlen: the preset's peak x mfu as flop/s, its link x efficiency as bandwidth,
    all `ranks` on one link class."""
    from burstcu.plan import Machine, plan

    out = []
    for name in names:
        hw = hardware(args, name)
        bw = hw.link_gbps * 1e9 * hw.link_eff
        machine = Machine(hw.name, hw.peak_tflops * 1e12 * hw.mfu_fwd, bw, bw, hw.latency_us * 1e-6,
                          args.ranks, hw.source + " (ASSUMED efficiencies as above)")
        group = type("G", (), {"size": args.ranks, "ops": None})()
        for n in args.seqlen:
            s = n // args.ranks
            p = plan((args.batch, s, args.heads, args.headdim),
                     (args.batch, s, args.kv_heads or args.heads, args.headdim), group,
                     causal=args.causal, layout="zigzag", machine=machine)
            print(p)
            out.append({"kind": "PREDICTION", "preset": name, "seqlen": n, "choice": p.choice.label,
                        "candidates": [c.__dict__ for c in p.candidates]})
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h100-nvlink", choices=sorted(PRESETS))
    p.add_argument("--all-presets", action="store_true", help="only the hidden-above seqlen of every preset")
    p.add_argument("--tflops", type=float, help="override the preset's peak")
    p.add_argument("--link-gbps", type=float, help="override the one-way link bandwidth (GB/s)")
    p.add_argument("--latency-us", type=float, help="override the per-message latency")
    p.add_argument("--mfu", type=float, help="override both mfu figures")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--itemsize", type=int, default=2)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--strategy", default="burst", choices=["burst", "ring"])
    p.add_argument("--strategies", action="store_true",
                   help="every strategy's predicted pass times (burstcu.plan) instead of one ring step")
    p.add_argument("--seqlen", type=int, nargs="+", default=[2**k for k in range(12, 21, 2)])
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def hardware(args, name: str) -> Hardware:
    hw = PRESETS[name]
    over = {"peak_tflops": args.tflops, "link_gbps": args.link_gbps, "latency_us": args.latency_us,
            "mfu_fwd": args.mfu, "mfu_bwd": args.mfu}
    return replace(hw, **{k: v for k, v in over.items() if v is not None})


def main(argv=None) -> dict:
    args = parse(argv)
    shape = Shape(args.ranks, args.batch, args.heads, args.kv_heads or args.heads, args.headdim,
                  itemsize=args.itemsize, causal=args.causal)
    names = sorted(PRESETS) if args.all_presets else [args.preset]
    if args.strategies:
        result = {"benchmark": "model", "kind": "PREDICTION", "strategies": strategy_tables(args, names)}
        if args.json:
            C.write_json(args.json, result)
        return result
    reports = [report(hardware(args, n), shape, args.strategy, args.seqlen) for n in names]
    if args.all_presets:
        for rep in reports:
            h = rep["hidden_above_seqlen"]
            print(f"PREDICTION {rep['hardware']['name']:12s} {args.strategy}: comm hidden above seqlen "
                  f"fwd ~{h['forward']:,.0f}, bwd ~{h['backward']:,.0f} (G={args.ranks})")
    else:
        print_report(reports[0])
    result = {"benchmark": "model", "kind": "PREDICTION", "reports": reports}
    if args.json:
        C.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
