"""G ranks of the real engine sharing ONE GPU (the loopback transport: a message is a
device-to-device copy on the receiver's communication stream, ordered by events as NCCL's
send/recv), timed with CUDA events: compute-only (copies skipped), comm-only (steps get no
blocks) and overlapped pass times, the efficiency (t_compute + t_comm - t_overlapped) /
min(t_compute, t_comm), and `hidden`: the fraction of each rank's incoming-copy time during which
one of its own step kernels ran, per pass and per ring step. The ranks share one GPU's SMs and
HBM: schedule behaviour, not multi-GPU figures; the comm-only run keeps all work but the step
kernels, so the efficiency sits near 1 by construction here: read `hidden` and `copy_ms`.

    python bench/gpu/overlap_gpu.py [--ranks 2 4] [--seqlen 8192 32768] [--causal] [--layout zigzag]
        [--window L R] [--docs SEED] [--strategies burst ring] [--repeats 5] [--json F] [--plot F]
    python bench/gpu/overlap_gpu.py --dry-run ...   # the plan, anywhere
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu.transport.loopback import CupyCopyDevice  # noqa: E402

MODES = ("compute", "comm", "overlapped")


class EventOps(C.StepTimingOps):
    """`StepTimingOps` on CUDA events around every step kernel on the current (compute) stream,
    labelled with the engine's annotation of the step ("fwd 2 compute"). `where` is the
    engine's latest annotation (the copy device reads it too)."""

    def __init__(self, inner, compute: bool):
        super().__init__(inner, compute)
        self.where = "start"

    def annotate(self, label: str):
        self.where = label
        return self.inner.annotate(label)

    def timed(self, fn, *args):
        import cupy
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        label = self.where
        start.record()
        fn(*args)
        stop.record()
        self.intervals.append(("compute", label, start, stop))


class EventCopyDevice(CupyCopyDevice):
    """The loopback device with events around every copy, labelled with the engine's annotation
    at the time (`labels.where`: "fwd 0 send/recv kv"); with move=False it copies nothing."""

    def __init__(self, move: bool):
        super().__init__()
        self.move, self.intervals, self.labels = move, [], None

    def copy(self, dst, src, stream):
        start, stop = self._cupy.cuda.Event(), self._cupy.cuda.Event()
        start.record(stream)
        if self.move:
            super().copy(dst, src, stream)
        stop.record(stream)
        self.intervals.append(("comm", getattr(self.labels, "where", "?"), start, stop))


def _instrument(group, mode: str):
    """The group with EventOps and an EventCopyDevice for `mode` (the transport keeps its hub)."""
    import dataclasses
    device = EventCopyDevice(move=(mode != "compute"))
    group.transport.device = device
    ops = EventOps(group.ops, compute=(mode != "comm"))
    device.labels = ops
    return dataclasses.replace(group, ops=ops), device


def _one_call(group, inputs, args, strategy, seqlen: int):
    """Forward then backward on this rank; ({pass: (start, stop) events}, ops intervals).
    seqlen: the global length (picks the documents, with --docs)."""
    import cupy
    q, k, v, dout = inputs
    marks = [cupy.cuda.Event() for _ in range(3)]
    kw = dict(causal=args.causal, layout=args.layout, strategy=strategy,
              window_size=tuple(args.window))
    docs = args.docs_by_seqlen.get(seqlen)
    if docs is not None:
        kw["cu_seqlens"] = list(docs)
    group.barrier()
    marks[0].record()
    out, lse = burstcu.attention(q, k, v, group, return_lse=True, **kw)
    marks[1].record()
    burstcu.attention_backward(dout, q, k, v, out, lse, group, **kw)
    marks[2].record()
    return {"forward": (marks[0], marks[1]), "backward": (marks[1], marks[2])}


def _ms(ref, event) -> float:
    import cupy
    return float(cupy.cuda.get_elapsed_time(ref, event))


def _hidden(compute, comm) -> float | None:
    """Fraction of the comm intervals' total length covered by the union of compute intervals."""
    total = sum(b - a for a, b in comm)
    if total <= 0:
        return None
    covered = 0.0
    for a, b in comm:
        covered += sum(max(0.0, min(b, d) - max(a, c)) for c, d in compute)
    return min(1.0, covered / total)


def _step_key(label: str) -> str:
    """The step an annotation names: its words up to the step number ("fwd 2 compute" and
    "fwd 2 send/recv kv" -> "fwd 2"; "ring bwd 1 compute" -> "ring bwd 1"), else its first two
    words ("bwd return dq" -> "bwd return")."""
    words = label.split()
    for i, word in enumerate(words):
        if word.isdigit():
            return " ".join(words[:i + 1])
    return " ".join(words[:2])


def per_step(timelines: list) -> list[dict]:
    """Per ring step of the overlapped run: compute and copy milliseconds and the hidden fraction
    of the copies, each the median over ranks (a step a rank skips counts 0 for it)."""
    keys = []
    for tl in timelines:
        for _, label, _, _ in tl:
            if _step_key(label) not in keys:
                keys.append(_step_key(label))
    rows = []
    for key in keys:
        per_rank = []
        for tl in timelines:
            compute = [(a, b) for kind, label, a, b in tl if kind == "compute"]
            mine = [(kind, a, b) for kind, label, a, b in tl if _step_key(label) == key]
            comm = [(a, b) for kind, a, b in mine if kind == "comm"]
            per_rank.append((sum(b - a for kind, a, b in mine if kind == "compute"),
                             sum(b - a for a, b in comm), _hidden(compute, comm)))
        hidden = [h for _, _, h in per_rank if h is not None]
        rows.append({"step": key, "compute_ms": C.median([c for c, _, _ in per_rank]),
                     "copy_ms": C.median([m for _, m, _ in per_rank]),
                     "hidden": C.median(hidden) if hidden else None})
    return rows


def run_config(size: int, seqlen: int, strategy: str, args) -> dict:
    import cupy
    from burstcu.testing.world import run_ranks

    ref = cupy.cuda.Event()
    ref.record()

    def body(group):
        inputs = _inputs(group, seqlen, args)
        rows = {m: [] for m in MODES}
        timeline = None
        for rep in range(args.repeats + 1):  # the first repeat warms up (compiles, pools)
            for mode in MODES:
                g, device = _instrument(group, mode)
                marks = _one_call(g, inputs, args, strategy, seqlen)
                cupy.cuda.get_current_stream().synchronize()
                group.transport.stream.synchronize()
                if rep == 0:
                    continue
                rows[mode].append({p: _ms(a, b) for p, (a, b) in marks.items()})
                if mode == "overlapped":
                    timeline = [(kind, label, _ms(ref, a), _ms(ref, b))
                                for kind, label, a, b in g.ops.intervals + device.intervals]
        return rows, timeline

    results = run_ranks(size, body, backend="cupy")
    return _summarize(size, seqlen, strategy, results)


def _inputs(group, seqlen: int, args):
    import cupy
    from burstcu.layout import partition
    docs = args.docs_by_seqlen.get(seqlen)
    s = partition(args.layout, group.size, seqlen, docs if args.layout == "zigzag" else None
                  ).lengths[group.rank]
    hkv = args.kv_heads or args.heads
    return C.normal(cupy, [(args.batch, s, h, args.headdim) for h in (args.heads, hkv, hkv, args.heads)],
                    args.dtype, group.rank)


def _summarize(size, seqlen, strategy, results) -> dict:
    row = {"ranks": size, "seqlen": seqlen, "strategy": strategy}
    for p in ("forward", "backward"):
        t = {m: C.median([max(r[0][m][i][p] for r in results) for i in range(len(results[0][0][m]))])
             for m in MODES}
        row.update({f"{p}_{m}_ms": t[m] for m in MODES})
        shorter = min(t["compute"], t["comm"])
        row[f"{p}_efficiency"] = ((t["compute"] + t["comm"] - t["overlapped"]) / shorter
                                  if shorter > 0 else None)
    hidden, copy_ms = [], []
    for _, timeline in results:
        compute = [(a, b) for kind, _, a, b in timeline if kind == "compute"]
        comm = [(a, b) for kind, _, a, b in timeline if kind == "comm"]
        hidden.append(_hidden(compute, comm))
        copy_ms.append(sum(b - a for a, b in comm))
    row["copy_ms"] = C.median(copy_ms)  # device time of one rank's incoming copies, both passes
    known = [h for h in hidden if h is not None]
    row["hidden"] = C.median(known) if known else None
    row["steps"] = per_step([timeline for _, timeline in results])
    row["hidden_per_rank"] = hidden
    row["timeline"] = [timeline for _, timeline in results]
    return row


COLUMNS = ["ranks", "seqlen", "strategy", "forward_compute_ms", "forward_comm_ms",
           "forward_overlapped_ms", "forward_efficiency", "backward_compute_ms", "backward_comm_ms",
           "backward_overlapped_ms", "backward_efficiency", "hidden", "copy_ms"]


def plot(rows, path) -> None:
    """The largest configuration's timeline (compute blue, incoming copies orange), and the
    hidden fraction against seqlen."""
    plt = C.pyplot()
    big = max(rows, key=lambda r: (r["ranks"], r["seqlen"]))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.6))
    t0 = min(a for tl in big["timeline"] for _, _, a, _ in tl)
    for rank, tl in enumerate(big["timeline"]):
        for kind, _, a, b in tl:
            ax.barh(rank + (0.2 if kind == "compute" else -0.2), b - a, left=a - t0, height=0.35,
                    color="tab:blue" if kind == "compute" else "tab:orange")
    ax.set_xlabel("ms (CUDA events)")
    ax.set_ylabel("rank")
    ax.set_title(f"{big['ranks']} ranks on one GPU, S={big['seqlen']}, {big['strategy']}", fontsize=8)
    for key in sorted({(r["strategy"], r["ranks"]) for r in rows}):
        pts = sorted((r["seqlen"], r["hidden"]) for r in rows
                     if (r["strategy"], r["ranks"]) == key and r["hidden"] is not None)
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=f"{key[0]}, {key[1]} ranks")
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("global seqlen")
    ax2.set_ylabel("hidden fraction of copy time")
    ax2.legend(fontsize=7)
    C.save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    from burstcu.layout import partition
    args.docs_by_seqlen = {}
    if args.docs is not None:
        args.docs_by_seqlen = {s: tuple(int(b) for b in C.document_mix(s, seed=args.docs))
                               for s in args.seqlen}
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
    rows = []
    for i, (g, s, st) in enumerate(plan):
        C.progress(f"[{i + 1}/{len(plan)}] {g} ranks, seqlen {s}, {st}")
        rows.append(run_config(g, s, st, args))
        print(C.table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
        print("  per step: " + "; ".join(
            f"{r['step']} compute {r['compute_ms']:.2f} copy {r['copy_ms']:.2f} hidden "
            f"{'-' if r['hidden'] is None else format(r['hidden'], '.2f')}" for r in rows[-1]["steps"]),
            flush=True)
    print("# one GPU shared by every rank (loopback transport): see the docstring before reading "
          "these as multi-GPU figures\n" + C.table(rows, COLUMNS), flush=True)
    if args.json:
        from burstcu.testing.checks import device_name, versions
        C.write_json(args.json, {"device": device_name("cupy"), "versions": versions(),
                                 "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
