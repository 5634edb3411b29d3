"""Varlen (packed documents) causal attention on the CPU: time, waiting and bytes per rank for
the balanced layout, the unbalanced one and a no-skipping baseline, measured in the same run;
plus a PREDICTION of the same three on the GPU presets of bench/model/predict.py.

    mpiexec -n G python bench/cpu/varlen.py [--seqlen 16384] [--heads 4] [--headdim 64]
        [--repeats 3] [--quick] [--json F] [--table F] [--plot F]
    python bench/cpu/varlen.py --predict [--ranks 8] [--seqlen 131072] [--heads 32] [--headdim 128]
    python bench/cpu/varlen.py --schedule [--ranks 8] [--docs 1000] [--repeats 20] [--json F]

--schedule times the host side alone (one process, no MPI): building the per-document zigzag
partition of --docs documents over --ranks ranks (and, once a partition, its segment arrays and
hash), each ring step's rectangle array (`burstcu.layout.rectangles`, uncached) for causal
attention: per step (median and worst over every rank and step), one rank's G steps, all G x G
arrays (what the schedule reads), and one step's array turned into `Block`s (what the engines
take today, one local-op call a Block).

The documents: lengths drawn from a log-normal (median --doc-median, shape --doc-sigma, clipped to
[8, N/2]; seeded by --seed) until they fill N tokens, the last one cut to fit: many short
documents and a few long ones. The same cu_seqlens and the same global q, k, v, dout (seeded)
feed every configuration:

  zigzag      layout="zigzag" with cu_seqlens: every document cut into 2G pieces, rank r holding
              pieces r and 2G-1-r of each (`burstcu.shard`): causal work balanced by construction
  contiguous  layout="contiguous" with cu_seqlens: rank r holds one run of N/G positions; steps and
              tiles outside a document are skipped, but a long document puts its heavy (late)
              queries on one rank
  no-skip     layout="contiguous", causal over the WHOLE packed sequence, no cu_seqlens: what a
              library without varlen support computes. Its tiles are the causal triangle, which is
              also exactly what a dense document mask applied per element inside causal tiles
              costs (the library has no switch to keep a document mask but stop skipping, so the
              baseline drops the mask; its output attends across documents and is therefore not
              the varlen result: it prices the work, not the answer)

Per rank and pass (medians over --repeats, after --warmup runs): compute = the sum of the
engine trace's compute_s over the pass's steps, wait = the sum of its wait_s, wall = the pass's
time on that rank (a barrier before each pass), bytes and messages sent (group.stats). Counted
work, from the partition alone: the (query, key) pairs in one document with key <= query; the
forward computes them on the rank holding the query, burst's backward on the rank holding the
key (query bundles travel to the keys), so both are listed. "computed" pairs for no-skip are the
causal pairs of the whole sequence; "needed" pairs are the same-document ones in every row.
Element pairs are the ideal: the tiles on a diagonal or a document edge compute some masked
elements too. Imbalance = max over ranks / mean over ranks.

Rank 0 prints the per-rank table and one summary line per configuration (progress on stderr),
checks that zigzag and contiguous give the same output, and writes --json, --table, --plot
(per-rank stacked compute / wait / other bars per configuration and pass). These are CPU + MPI
figures (NumPy tiles, MPICH), never GPU ones.

--predict (no MPI, no measurement; every figure labelled PREDICTION): each configuration on the
presets of bench/model/predict.py, through the library's cost model (`burstcu.plan.predict`: per
step the busiest rank's max(compute, transfer), compute from the pairs each rank keeps, bytes from
burst's formulas for the partition and mask), inputs of --itemsize bytes (dQ, lse, delta fp32):
the pass time, the part of it communication adds over compute alone, and the most bytes a rank
sends. The model ignores per-step skew (a rank waiting for a late neighbour): a lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from bench.model.predict import PRESETS, pass_times  # noqa: E402

import burstcu  # noqa: E402
from burstcu.engine import Trace  # noqa: E402
from burstcu.layout import Partition, partition  # noqa: E402

# (name, layout, with documents)
CONFIGS = (("zigzag", "zigzag", True), ("contiguous", "contiguous", True),
           ("no-skip", "contiguous", False))
PASSES = ("forward", "backward")
SHORT = {"forward": "fwd", "backward": "bwd"}
BASELINE = ("no-skip = layout contiguous, causal over the whole packed sequence, no cu_seqlens "
            "(what a library without varlen support computes; the same tiles as a dense "
            "document mask inside causal tiles; its output attends across documents)")


# ----------------------------------------------------------------------------------------------
# the documents and the work they make


def describe_mix(cu: tuple[int, ...]) -> dict:
    lengths = np.diff(cu)
    total = int(cu[-1])
    return {"documents": len(lengths), "tokens": total, "shortest": int(lengths.min()),
            "median": float(np.median(lengths)), "longest": int(lengths.max()),
            "tokens_in_docs_ge_1024": float(lengths[lengths >= 1024].sum() / total)}


def counted_pairs(part: Partition, rank: int, docs: tuple[int, ...] | None) -> tuple[int, int]:
    """(pairs whose query `rank` holds, pairs whose key it holds): (query, key) in one document
    (docs None: the whole sequence is one) with key <= query."""
    pos = np.asarray(part.positions(rank), np.int64)
    bounds = np.asarray(docs if docs is not None else (0, part.total), np.int64)
    doc = np.searchsorted(bounds, pos, side="right") - 1
    by_query = pos - bounds[doc] + 1          # keys from the document's start up to the query
    by_key = bounds[doc + 1] - pos            # queries from the key to the document's end
    return int(by_query.sum()), int(by_key.sum())


def imbalance(xs) -> float | None:
    """max / mean (1 = balanced); None when the mean is 0."""
    xs = list(xs)
    mean = sum(xs) / len(xs) if xs else 0
    return max(xs) / mean if mean > 0 else None


def config_work(size: int, n: int, cu: tuple[int, ...], name: str, layout: str, docs: bool) -> dict:
    """The partition of a configuration and its counted pairs per rank (computed and needed)."""
    part = partition(layout, size, n, cu if (docs and layout == "zigzag") else None)
    needed = [counted_pairs(part, r, cu) for r in range(size)]
    computed = needed if docs else [counted_pairs(part, r, None) for r in range(size)]
    return {"name": name, "layout": layout, "documents": docs, "part": part,
            "computed": computed, "needed": needed}


# ----------------------------------------------------------------------------------------------
# measurement


def global_inputs(args):
    """The global (1, N, H, D) q, k, v, dout every rank draws alike (seeded)."""
    rng = np.random.default_rng([args.seed, 1])
    dt = np.dtype(args.dtype)
    shape = (args.batch, args.seqlen, args.heads, args.headdim)
    return [rng.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(4)]


def one_run(group, local, how: dict) -> tuple[dict, object]:
    """One forward and one backward pass on this rank: trace sums, wall times, bytes; out."""
    q, k, v, dout = local
    group.trace = trace = Trace()
    rec = {}
    group.barrier()
    group.stats.reset()
    t0 = time.perf_counter()
    out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True, **how)
    rec["forward_wall_s"] = time.perf_counter() - t0
    rec["forward_bytes"], rec["forward_messages"] = group.stats.bytes_sent, group.stats.messages
    group.barrier()
    group.stats.reset()
    t0 = time.perf_counter()
    burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True, **how)
    rec["backward_wall_s"] = time.perf_counter() - t0
    rec["backward_bytes"], rec["backward_messages"] = group.stats.bytes_sent, group.stats.messages
    group.trace = None
    for pass_ in PASSES:
        steps = [st for st in trace.steps if st.pass_ == pass_]
        rec[f"{pass_}_compute_s"] = sum(st.compute_s for st in steps)
        rec[f"{pass_}_wait_s"] = sum(st.wait_s for st in steps)
        rec[f"{pass_}_blocks"] = sum(st.blocks for st in steps)
    return rec, out


def measure(group, args, inputs, cu, work: dict, label: str) -> tuple[dict, object]:
    """This rank's medians over the repeats of one configuration, and its last output."""
    how = {"layout": work["layout"], "cu_seqlens": np.asarray(cu) if work["documents"] else None}
    local = [burstcu.shard(x, group, work["layout"], cu_seqlens=how["cu_seqlens"]) for x in inputs]
    runs = []
    for i in range(args.warmup + args.repeats):
        C.progress(f"{label} {work['name']}: {'warmup' if i < args.warmup else 'repeat'} "
                   f"{i + 1}/{args.warmup + args.repeats}", group.rank)
        rec, out = one_run(group, local, how)
        if i >= args.warmup:
            runs.append(rec)
    mine = {key: C.median([r[key] for r in runs]) for key in runs[0]}
    for key in ("forward_bytes", "forward_messages", "backward_bytes", "backward_messages",
                "forward_blocks", "backward_blocks"):
        mine[key] = int(runs[-1][key])
    fwd, bwd = work["computed"][group.rank]
    mine.update(rank=group.rank, rows=work["part"].lengths[group.rank], forward_pairs=fwd,
                backward_pairs=bwd, needed_pairs=work["needed"][group.rank][0])
    return mine, out


def summarize(ranks: list) -> dict:
    """Across ranks: imbalance of counted work and of measured compute, slowest-rank wall."""
    out = {}
    for pass_ in PASSES:
        out[f"{pass_}_work_imbalance"] = imbalance(r[f"{pass_}_pairs"] for r in ranks)
        out[f"{pass_}_compute_imbalance"] = imbalance(r[f"{pass_}_compute_s"] for r in ranks)
        out[f"{pass_}_compute_max_s"] = max(r[f"{pass_}_compute_s"] for r in ranks)
        out[f"{pass_}_wall_s"] = max(r[f"{pass_}_wall_s"] for r in ranks)
        out[f"{pass_}_bytes_max"] = max(r[f"{pass_}_bytes"] for r in ranks)
    out["pairs_computed"] = sum(r["forward_pairs"] for r in ranks)
    out["pairs_needed"] = sum(r["needed_pairs"] for r in ranks)
    return out


def run(args) -> dict | None:
    group = burstcu.init(backend="numpy")
    cu = C.document_mix(args.seqlen, args.seed, args.doc_median, args.doc_sigma)
    inputs = global_inputs(args)
    configs, outs = [], {}
    for i, (name, layout, docs) in enumerate(CONFIGS):
        work = config_work(group.size, args.seqlen, cu, name, layout, docs)
        mine, out = measure(group, args, inputs, cu, work, f"[{i + 1}/{len(CONFIGS)}]")
        ranks = group.transport.allgather_object(mine, "bench varlen")
        configs.append({"name": name, "layout": layout, "documents": docs, "ranks": ranks,
                        "summary": summarize(ranks)})
        if docs:
            outs[name] = burstcu.unshard(out, group, layout, cu_seqlens=np.asarray(cu))
    diff = float(np.max(np.abs(outs["zigzag"].astype(np.float64) - outs["contiguous"])))
    env = C.environment_on_rank0(group)
    if env is None:
        return None
    return {"benchmark": "varlen", "kind": "MEASURED", "environment": env,
            "args": C.clean(vars(args)), "mix": describe_mix(cu), "cu_seqlens": list(cu),
            "baseline": BASELINE, "configs": configs,
            "check": {"max_abs_diff_zigzag_vs_contiguous": diff, "same_output": diff < 1e-4}}


# ----------------------------------------------------------------------------------------------
# output


RANK_COLUMNS = ["config", "rank", "rows", "fwd_pairs", "bwd_pairs", "fwd_tiles", "fwd_compute", "fwd_wait",
                "fwd_wall", "bwd_compute", "bwd_wait", "bwd_wall", "fwd_bytes", "bwd_bytes"]
SUMMARY_COLUMNS = ["config", "fwd_work_imb", "fwd_compute_imb", "bwd_work_imb", "bwd_compute_imb",
                   "fwd_wall", "bwd_wall", "useful", "max_fwd_bytes", "max_bwd_bytes"]


def render(result: dict) -> str:
    """The text rank 0 prints (and --table holds)."""
    mix, a = result["mix"], result["args"]
    rows, sums = [], []
    for cfg in result["configs"]:
        for r in cfg["ranks"]:
            rows.append({"config": cfg["name"], "rank": r["rank"], "rows": r["rows"],
                         "fwd_pairs": r["forward_pairs"], "bwd_pairs": r["backward_pairs"],
                         "fwd_tiles": r["forward_blocks"],
                         **{f"{SHORT[p]}_{k}": C.fmt_s(r[f"{p}_{k}_s"]) for p in PASSES
                            for k in ("compute", "wait", "wall")},
                         "fwd_bytes": C.fmt_bytes(r["forward_bytes"]),
                         "bwd_bytes": C.fmt_bytes(r["backward_bytes"])})
        s = cfg["summary"]
        sums.append({"config": cfg["name"],
                     **{f"{SHORT[p]}_{k}_imb": s[f"{p}_{k}_imbalance"] for p in PASSES
                        for k in ("work", "compute")},
                     "fwd_wall": C.fmt_s(s["forward_wall_s"]), "bwd_wall": C.fmt_s(s["backward_wall_s"]),
                     "useful": f"{s['pairs_needed'] / s['pairs_computed']:.0%}",
                     "max_fwd_bytes": C.fmt_bytes(s["forward_bytes_max"]),
                     "max_bwd_bytes": C.fmt_bytes(s["backward_bytes_max"])})
    lines = [C.measured_on(result["environment"]),
             f"# causal, N={a['seqlen']} B={a['batch']} H={a['heads']} D={a['headdim']} "
             f"{a['dtype']}, strategy burst; {mix['documents']} documents (seed {a['seed']}): "
             f"{mix['shortest']}..{mix['longest']} tokens, median {mix['median']:.0f}, "
             f"{mix['tokens_in_docs_ge_1024']:.0%} of tokens in documents >= 1024",
             f"# {BASELINE}",
             f"# pairs: (query, key) pairs computed, forward by query owner, backward by key owner; "
             f"fwd_tiles: rectangles the forward steps computed (layout.blocks); times: medians of "
             f"{a['repeats']} repeats",
             C.table(rows, RANK_COLUMNS), "",
             "# imb = max/mean over ranks (work: counted pairs; compute: measured); wall: slowest "
             "rank; useful = same-document pairs / computed pairs",
             C.table(sums, SUMMARY_COLUMNS),
             f"# zigzag and contiguous outputs agree: {result['check']['same_output']} "
             f"(max |diff| {result['check']['max_abs_diff_zigzag_vs_contiguous']:.2e})"]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Per pass: for each configuration, one stacked bar per rank (compute, wait, other)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configs"]
    size = len(configs[0]["ranks"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    width = 0.8 / size
    for ax, pass_ in zip(axes, PASSES):
        # the y range fits the varlen configurations; taller bars (no-skip) are cut and labelled
        top = 1.3 * max(r[f"{pass_}_wall_s"] for cfg in configs if cfg["documents"] for r in cfg["ranks"])
        for c, cfg in enumerate(configs):
            for r in cfg["ranks"]:
                x = c + (r["rank"] - (size - 1) / 2) * width
                comp, wait = r[f"{pass_}_compute_s"], r[f"{pass_}_wait_s"]
                other = max(r[f"{pass_}_wall_s"] - comp - wait, 0.0)
                first = c + r["rank"] == 0
                ax.bar(x, comp, width, color="tab:blue", label="compute" if first else None)
                ax.bar(x, wait, width, bottom=comp, color="tab:orange", label="wait" if first else None)
                ax.bar(x, other, width, bottom=comp + wait, color="lightgrey",
                       label="other (wall - compute - wait)" if first else None)
                total = comp + wait + other
                text = str(r["rank"]) if total <= top else f"{r['rank']}\n{total:.2g}s\n(cut)"
                ax.text(x, min(total, top), text, ha="center", va="bottom" if total <= top else "top",
                        fontsize=7 if total <= top else 6, color="black" if total <= top else "white")
        ax.set_ylim(0, top)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{cfg['name']}\nwork imb {cfg['summary'][f'{pass_}_work_imbalance']:.2f}"
                            for cfg in configs], fontsize=8)
        ax.set_ylabel("seconds per rank (median)")
        ax.set_title(f"{pass_}: bars = ranks 0..{size - 1}", fontsize=9)
    axes[0].legend(fontsize=7)
    a = result["args"]
    fig.suptitle(f"varlen causal, N={a['seqlen']} H={a['heads']} D={a['headdim']}, {size} ranks, "
                 f"{result['mix']['documents']} documents — {result['environment']['device']} "
                 f"(numpy backend), not GPU figures", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# prediction


def predict(args) -> dict:
    """PREDICTIONS of every configuration on every preset (module docstring)."""
    cu = C.document_mix(args.seqlen, args.seed, args.doc_median, args.doc_sigma)
    works = [config_work(args.ranks, args.seqlen, cu, *c) for c in CONFIGS]
    s, hkv = args.seqlen // args.ranks, args.kv_heads or args.heads
    dtype = "bfloat16" if args.itemsize == 2 else "float32"
    names = args.presets or sorted(PRESETS)
    rows = []
    for name in names:
        for work in works:
            docs = cu if work["documents"] else None
            ranks = [pass_times(PRESETS[name], "burst", (args.batch, s, args.heads, args.headdim),
                                (args.batch, s, hkv, args.headdim), args.ranks, causal=True,
                                layout=work["part"], dtype=dtype, rank=r, cu_seqlens=docs)
                     for r in range(args.ranks)]
            row = {"kind": "PREDICTION", "preset": name, "config": work["name"],
                   "forward_work_imbalance": imbalance(p[0] for p in work["computed"]),
                   "backward_work_imbalance": imbalance(p[1] for p in work["computed"])}
            for pass_ in PASSES:
                t = ranks[0][pass_]          # the model's pass time is the busiest rank's, on every rank
                row[f"{pass_}_s"] = t["t_overlapped"]
                row[f"{pass_}_compute_s"] = t["t_compute"]
                row[f"{pass_}_exposed_comm_s"] = t["t_overlapped"] - t["t_compute"]
                row[f"{pass_}_bytes_max"] = max(r[pass_]["bytes"] for r in ranks)
            rows.append(row)
    return {"benchmark": "varlen", "kind": "PREDICTION", "args": C.clean(vars(args)),
            "mix": describe_mix(cu), "baseline": BASELINE, "rows": rows,
            "presets": {n: dataclasses.asdict(PRESETS[n]) for n in names}}


def schedule(args) -> dict:
    """Host time of the rectangle arrays (module docstring, --schedule): medians over --repeats."""
    from burstcu.layout import Block, Partition, partition, rectangles

    g = args.ranks
    cu = C.document_mix(64 * args.docs * 8, args.seed, args.doc_median, args.doc_sigma)
    cu = cu[:args.docs + 1]
    n = cu[-1]

    def ms(f) -> float:
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            f()
            times.append((time.perf_counter() - t) * 1e3)
        return float(np.median(times))

    part_ms = ms(lambda: partition.__wrapped__("zigzag", g, n, cu))
    part = partition("zigzag", g, n, cu)
    fresh = lambda: Partition(part.layout, part.runs)                   # nothing computed yet
    arrays_ms = ms(lambda: fresh().arrays)              # once a partition: its segments as arrays
    hash_ms = ms(lambda: hash(fresh()))                 # once a partition: its cache key
    build = rectangles.__wrapped__
    as_blocks_ms = ms(lambda: [Block(*row) for row in build(part, 0, g - 1, True, (-1, -1),
                                                             cu).tolist()])
    steps = {(r, s): ms(lambda r=r, s=s: build(part, r, (r - s) % g, True, (-1, -1), cu))
             for r in range(g) for s in range(g)}
    rows = [build(part, r, (r - s) % g, True, (-1, -1), cu).size for r, s in steps]
    return {"benchmark": "varlen schedule", "args": C.clean(vars(args)), "ranks": g,
            "documents": len(cu) - 1, "tokens": n, "partition_ms": part_ms,
            "arrays_ms": arrays_ms, "hash_ms": hash_ms, "step_as_blocks_ms": as_blocks_ms,
            "step_ms_median": float(np.median(list(steps.values()))),
            "step_ms_max": max(steps.values()),
            "rank_steps_ms_max": max(sum(steps[r, s] for s in range(g)) for r in range(g)),
            "all_steps_ms": sum(steps.values()),
            "rectangles_per_step_median": float(np.median(rows)), "rectangles_max": max(rows),
            "environment": C.environment(None)}


def render_schedule(result: dict) -> str:
    r = result
    return "\n".join([
        f"host schedule: {r['documents']} documents, {r['tokens']} tokens, per-document zigzag "
        f"over {r['ranks']} ranks, causal (medians of {r['args']['repeats']} builds; CPU)",
        C.table([{"built": what, "ms": f"{r[key]:.3f}"} for what, key in (
            ("partition (every rank's pieces)", "partition_ms"),
            ("its segments as arrays (once a partition)", "arrays_ms"),
            ("its hash, the cache key (once a partition)", "hash_ms"),
            ("one step's rectangle array, median", "step_ms_median"),
            ("one step's rectangle array, worst", "step_ms_max"),
            (f"one rank's {r['ranks']} steps, worst rank", "rank_steps_ms_max"),
            (f"all {r['ranks']}x{r['ranks']} arrays", "all_steps_ms"),
            ("one step's array as Blocks (what the engines take)", "step_as_blocks_ms"))],
            ["built", "ms"]),
        f"rectangles a step: median {r['rectangles_per_step_median']:.0f}, most "
        f"{r['rectangles_max']}"])


def render_prediction(result: dict) -> str:
    a, mix = result["args"], result["mix"]
    show = [{"": "PREDICTION", "preset": r["preset"], "config": r["config"],
             "fwd_work_imb": r["forward_work_imbalance"], "bwd_work_imb": r["backward_work_imbalance"],
             "fwd": C.fmt_s(r["forward_s"]), "fwd_compute": C.fmt_s(r["forward_compute_s"]),
             "bwd": C.fmt_s(r["backward_s"]), "bwd_compute": C.fmt_s(r["backward_compute_s"]),
             "exposed_comm": C.fmt_s(r["forward_exposed_comm_s"] + r["backward_exposed_comm_s"]),
             "max_fwd_bytes": C.fmt_bytes(r["forward_bytes_max"]),
             "max_bwd_bytes": C.fmt_bytes(r["backward_bytes_max"])} for r in result["rows"]]
    return "\n".join([
        "# PREDICTION (burstcu.plan's model on bench/model/predict.py's presets; not a measurement)",
        f"# PREDICTION causal varlen, G={a['ranks']} N={a['seqlen']} B={a['batch']} H={a['heads']}/"
        f"{a['kv_heads'] or a['heads']} D={a['headdim']} itemsize={a['itemsize']}, strategy burst; "
        f"{mix['documents']} documents (seed {a['seed']}), longest {mix['longest']}",
        f"# PREDICTION {result['baseline']}",
        C.table(show, list(show[0]))])


# ----------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=None,
                   help="global tokens N (default 16384; --quick 2048; --predict 131072)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=None, help="default 4 (--quick 2, --predict 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="--predict only (default: --heads)")
    p.add_argument("--headdim", type=int, default=None, help="default 64 (--quick 32, --predict 128)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0, help="seeds the documents and the inputs")
    p.add_argument("--doc-median", type=float, default=64, help="median document length")
    p.add_argument("--doc-sigma", type=float, default=1.75, help="log-normal shape (tail weight)")
    p.add_argument("--repeats", type=int, default=None, help="default 3 (--quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="default 1 (--quick 0)")
    p.add_argument("--quick", action="store_true", help="a small smoke-test size (well under 30 s)")
    p.add_argument("--predict", action="store_true", help="the GPU model only (PREDICTION, no MPI)")
    p.add_argument("--schedule", action="store_true", help="the host schedule's build time only")
    p.add_argument("--docs", type=int, default=1000, help="--schedule: documents")
    p.add_argument("--ranks", type=int, default=8, help="--predict: ranks")
    p.add_argument("--itemsize", type=int, default=2, choices=[2, 4], help="--predict: input bytes")
    p.add_argument("--presets", nargs="+", default=None, help="--predict: default every preset of bench/model/predict.py")
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    mode = ("schedule" if args.schedule else "predict" if args.predict else
            "quick" if args.quick else "full")
    defaults = {"full": dict(seqlen=16384, heads=4, headdim=64, repeats=3, warmup=1),
                "schedule": dict(seqlen=0, heads=0, headdim=0, repeats=20, warmup=0),
                "quick": dict(seqlen=2048, heads=2, headdim=32, repeats=1, warmup=0),
                "predict": dict(seqlen=131072, heads=32, headdim=128, repeats=0, warmup=0)}[mode]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None):
    args = parse(argv)
    if args.schedule:
        result = schedule(args)
        text = render_schedule(result)
    elif args.predict:
        result = predict(args)
        text = render_prediction(result)
    else:
        result = run(args)
        if result is None:
            return None
        text = render(result)
        if args.plot:
            plot(result, args.plot)
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    return C.finish(result, args.json)


if __name__ == "__main__":
    main()
