"""G ranks of the real engine sharing ONE GPU (loopback transport: a message is a device-to-device
copy on the receiver's communication stream, ordered by events as NCCL's send/recv), timed with
CUDA events: compute-only (copies skipped), comm-only (steps get no blocks) and overlapped pass
times, efficiency (t_compute + t_comm - t_overlapped) / min(t_compute, t_comm), and `hidden`: the
fraction of a rank's incoming-copy time its own step kernels ran through, per pass and ring step.
Schedule behaviour, not multi-GPU figures (the ranks share one GPU's SMs and HBM); the comm-only
run keeps all work but the step kernels: its efficiency is near 1 by construction; read `hidden`, `copy_ms`.

    python bench/gpu/overlap_gpu.py [--ranks 2 4] [--seqlen 8192 32768] [--causal] [--layout zigzag]
        [--window L R] [--docs SEED] [--strategies burst ring] [--repeats 5] [--json F] [--plot F]
    python bench/gpu/overlap_gpu.py --dry-run ...   # the plan, anywhere
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from bench.cpu.overlap import MODES, PASSES, TimedOps, forward_backward, overlap_figure  # noqa: E402

from burstcu.layout import partition  # noqa: E402
from burstcu.transport.loopback import CupyCopyDevice  # noqa: E402

COLUMNS = ["ranks", "seqlen", "strategy", "forward_compute_ms", "forward_comm_ms",
           "forward_overlapped_ms", "forward_efficiency", "backward_compute_ms", "backward_comm_ms",
           "backward_overlapped_ms", "backward_efficiency", "hidden", "copy_ms"]


class EventCopyDevice(CupyCopyDevice):
    """The loopback device with events around every copy, labelled with `labels.where` at the
    time ("fwd 0 send/recv kv"); with move=False it copies nothing."""

    def __init__(self, move: bool, labels: TimedOps):
        super().__init__()
        self.move, self.intervals, self.labels = move, [], labels

    def copy(self, dst, src, stream):
        start, stop = self._cupy.cuda.Event(), self._cupy.cuda.Event()
        start.record(stream)
        if self.move:
            super().copy(dst, src, stream)
        stop.record(stream)
        self.intervals.append(("comm", self.labels.where, start, stop))


def _hidden(compute, comm) -> float | None:
    """Fraction of the comm intervals' total length covered by the union of compute intervals."""
    total = sum(b - a for a, b in comm)
    covered = sum(sum(max(0.0, min(b, d) - max(a, c)) for c, d in compute) for a, b in comm)
    return min(1.0, covered / total) if total > 0 else None


def _step_key(label: str) -> str:
    """The step an annotation names: its words up to the step number ("fwd 2 send/recv kv" -> "fwd 2",
    "ring bwd 1 compute" -> "ring bwd 1"), else its first two words ("bwd return dq" -> "bwd return")."""
    words = label.split()
    return " ".join(next((words[:i + 1] for i, w in enumerate(words) if w.isdigit()), words[:2]))


def _spans(timeline: list, kind: str, step: str | None = None) -> list:
    """The (start, stop) ms of a rank's `timeline` [(kind, label, start, stop)] of one kind (and step)."""
    return [(a, b) for k, label, a, b in timeline if k == kind and step in (None, _step_key(label))]


def per_step(timelines: list) -> list[dict]:
    """Per ring step of the overlapped run, from every rank's timeline: compute and copy ms and
    the hidden fraction of the copies, each the median over ranks (a step a rank skips counts 0)."""
    rows = []
    for key in dict.fromkeys(_step_key(label) for tl in timelines for _, label, _, _ in tl):
        compute, copy, hidden = zip(*((sum(b - a for a, b in _spans(tl, "compute", key)),
                                       sum(b - a for a, b in _spans(tl, "comm", key)),
                                       _hidden(_spans(tl, "compute"), _spans(tl, "comm", key)))
                                      for tl in timelines))
        rows.append({"step": key, "compute_ms": C.median(compute), "copy_ms": C.median(copy),
                     "hidden": None if hidden.count(None) == len(hidden) else C.median(hidden)})
    return rows


def run_config(size: int, seqlen: int, strategy: str, args) -> dict:
    """One configuration on `size` ranks: per pass and mode the median over repeats of the slowest
    rank's ms and the efficiency; per rank the copies' ms and `hidden`, their medians; `per_step`."""
    import cupy
    from burstcu.testing.world import run_ranks

    docs, ref = args.docs_by_seqlen.get(seqlen), cupy.cuda.Event()
    kw = dict(causal=args.causal, layout=args.layout, strategy=strategy, window_size=tuple(args.window),
              **({} if docs is None else {"cu_seqlens": list(docs)}))
    lengths = partition(args.layout, size, seqlen, docs if args.layout == "zigzag" else None).lengths
    ref.record()

    def ms(start, stop) -> float:
        return float(cupy.cuda.get_elapsed_time(start, stop))

    def event():   # the clock: an event recorded on the current (compute) stream
        recorded = cupy.cuda.Event()
        recorded.record()
        return recorded

    def body(group):
        hkv = args.kv_heads or args.heads
        inputs = C.normal(cupy, [(args.batch, lengths[group.rank], h, args.headdim)
                                 for h in (args.heads, hkv, hkv, args.heads)], args.dtype, group.rank)
        times, timeline = {m: [] for m in MODES}, None
        for rep in range(args.repeats + 1):  # the first repeat warms up (compiles, pools)
            for mode in MODES:
                ops = TimedOps(group.ops, mode != "comm", clock=event)
                device = group.transport.device = EventCopyDevice(mode != "compute", ops)
                group.barrier()
                marks = forward_backward(dataclasses.replace(group, ops=ops), inputs, event, **kw)
                cupy.cuda.get_current_stream().synchronize()
                group.transport.stream.synchronize()
                if rep > 0:
                    times[mode].append({p: ms(marks[i], marks[i + 1]) for i, p in enumerate(PASSES)})
                if rep > 0 and mode == "overlapped":
                    timeline = [(kind, label, ms(ref, a), ms(ref, b))
                                for kind, label, a, b in ops.intervals + device.intervals]
        return times, timeline

    results = run_ranks(size, body, backend="cupy")
    row = {"ranks": size, "seqlen": seqlen, "strategy": strategy}
    for p in PASSES:
        t = {m: C.median([max(x) for x in zip(*([r[p] for r in times[m]] for times, _ in results))])
             for m in MODES}
        shorter, saved = min(t["compute"], t["comm"]), t["compute"] + t["comm"] - t["overlapped"]
        row.update({f"{p}_{m}_ms": t[m] for m in MODES})
        row[f"{p}_efficiency"] = saved / shorter if shorter > 0 else None
    timelines = [timeline for _, timeline in results]
    hidden = [_hidden(_spans(tl, "compute"), _spans(tl, "comm")) for tl in timelines]
    row["copy_ms"] = C.median([sum(b - a for a, b in _spans(tl, "comm")) for tl in timelines])  # both passes
    row["hidden"] = None if hidden.count(None) == len(hidden) else C.median(hidden)
    row.update(steps=per_step(timelines), hidden_per_rank=hidden, timeline=timelines)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    p.add_argument("--seqlen", nargs="+", type=int, default=[8192, 32768])
    C.add_shape_args(p, heads=16, headdim=128, dtype="float16", dtypes=("float16", "bfloat16"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    p.add_argument("--window", nargs=2, type=int, default=[-1, -1], metavar=("LEFT", "RIGHT"),
                   help="sliding window (flash-attn's window_size; -1 unbounded)")
    p.add_argument("--docs", type=int, default=None, metavar="SEED",
                   help="documents (cu_seqlens): bench/_common.py's document_mix of this seed "
                        "(with --layout zigzag each document is cut into 2G pieces)")
    p.add_argument("--strategies", nargs="+", default=["burst", "ring"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--plot")
    p.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = p.parse_args(argv)
    plan = [(g, s, st) for g in args.ranks for s in args.seqlen for st in args.strategies]
    args.docs_by_seqlen = {} if args.docs is None else {s: C.document_mix(s, args.docs) for s in args.seqlen}
    for g, s, _ in plan:
        partition(args.layout, g, s)   # a clear error when s cannot split over g ranks
    if args.dry_run:
        for g, s, st in plan:
            docs = args.docs_by_seqlen.get(s)
            print(f"{g} ranks on one GPU, global seqlen {s} ({s // g} a rank), {st}, "
                  f"{'causal ' + args.layout if args.causal else 'full'}, window {tuple(args.window)}, "
                  f"{'no documents' if docs is None else f'{len(docs) - 1} documents'}, "
                  f"{args.repeats} repeats x 3 modes")
        return 0
    if (status := C.no_gpu("overlap_gpu.py")) is not None:
        return status
    rows = []
    for i, (g, s, st) in enumerate(plan):
        C.progress(f"[{i + 1}/{len(plan)}] {g} ranks, seqlen {s}, {st}")
        rows.append(run_config(g, s, st, args))
        print(C.table([rows[-1]], COLUMNS).splitlines()[-1] + "\n  per step: " + "; ".join(
            f"{r['step']} compute {r['compute_ms']:.2f} copy {r['copy_ms']:.2f} hidden "
            f"{'-' if r['hidden'] is None else format(r['hidden'], '.2f')}" for r in rows[-1]["steps"]),
            flush=True)
    print("# one GPU shared by every rank (loopback transport): see the docstring before reading "
          "these as multi-GPU figures\n" + C.table(rows, COLUMNS), flush=True)
    if args.json:
        from burstcu.testing.checks import device_name, versions
        C.write_json(args.json, {"device": device_name("cupy"), "versions": versions(),
                                 "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    if args.plot:   # the largest configuration's timeline; the hidden fraction against seqlen
        big = max(rows, key=lambda r: (r["ranks"], r["seqlen"]))
        t0 = min(a for tl in big["timeline"] for _, _, a, _ in tl)
        curves = [(f"{strategy}, {ranks} ranks", dict(marker="o"),
                   [(n, h, None) for n, h in sorted((r["seqlen"], r["hidden"]) for r in rows
                                                     if (r["strategy"], r["ranks"]) == (strategy, ranks)
                                                     and r["hidden"] is not None)])
                  for strategy, ranks in sorted({(r["strategy"], r["ranks"]) for r in rows})]
        fig, _, ax2 = overlap_figure(
            [[(kind, a - t0, b - t0) for kind, _, a, b in tl] for tl in big["timeline"]],
            f"{big['ranks']} ranks on one GPU, S={big['seqlen']}, {big['strategy']}", "ms (CUDA events)",
            curves, "hidden fraction of copy time")
        ax2.set_ylim(0, 1.05)
        C.save(fig, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
