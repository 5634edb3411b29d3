"""Forward error against the ring size G, one process: burstcu's burst ring, simulated rfa and
dtype-merge rings and the floor against one float64 reference (docs/numerics.md: how each is made).

    python bench/cpu/numerics.py [--seqlen 16384] [--ranks 1 2 4 8 16 32 64] [--dtypes bfloat16 float16]
        [--masks full causal] [--score-std 1] [--no-zigzag] [--json F] [--table F] [--plot F]
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from pathlib import Path

if __name__ == "__main__":   # before NumPy loads its BLAS (main() limits a loaded one too)
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu.layout import shard_slices  # noqa: E402
from burstcu.testing.world import run_ranks  # noqa: E402

METHODS = ("burstcu", "burstcu-zz", "rfa", "dtype-merge", "floor")
FLAT = 1.2   # the goal: burstcu's error at the largest G within this factor of its G = 1 error
ROWS = 256   # query rows per reference block
LABELS = {"burstcu": "burstcu: float32 state across hops (measured)",
          "burstcu-zz": "burstcu, zigzag layout (measured)",
          "rfa": "rfa: ring-flash-attention's merge, block outs in the input dtype,\n"
                 "float32 running out (simulated)",
          "dtype-merge": "dtype-merge: running out kept in the input dtype,\n"
                         "rounded at every merge (simulated)",
          "floor": "floor: float64, rounded once"}
# burstcu wide and underneath; the floor and zigzag thin and on top, visible where they coincide
STYLE = {"burstcu": dict(color="C0", lw=3.2, zorder=2, marker="o", markersize=3.5),
         "burstcu-zz": dict(color="C1", lw=1.2, zorder=4, marker="x", markersize=6),
         "rfa": dict(color="C2", lw=1.5, zorder=3, marker="o", markersize=3.5),
         "dtype-merge": dict(color="C3", lw=1.5, zorder=3, marker="o", markersize=3.5),
         "floor": dict(color="k", lw=1.2, zorder=5, dashes=(1, 1.5))}


def problem(seqlen: int, batch: int, heads: int, headdim: int, dtype: str, seed: int = 0,
            score_std: float = 1.0):
    """q, k, v (batch, seqlen, heads, headdim): N(0, 1) float32 draws (q times score_std), seeded,
    rounded to `dtype`: the same draws for every dtype."""
    q, k, v = C.normal(np, [(batch, seqlen, heads, headdim)] * 3, "float32", seed)
    dt = C.array_dtype(dtype)
    return (q * np.float32(score_std)).astype(dt), k.astype(dt), v.astype(dt)


def reference(q, k, v, causal: bool, rows: int = ROWS) -> np.ndarray:
    """out (B, S, H, D) in float64: full softmax of q k^T / sqrt(D) over every key (causal: key
    position <= query position), `rows` query rows at a time; it calls nothing of burstcu."""
    k64 = k.astype(np.float64).transpose(0, 2, 3, 1)        # (B, H, D, S)
    v64 = v.astype(np.float64).transpose(0, 2, 1, 3)        # (B, H, S, D)
    out = np.empty(q.shape, np.float64)
    for lo in range(0, q.shape[1], rows):
        hi = min(lo + rows, q.shape[1])
        keys = hi if causal else q.shape[1]                  # later keys are all masked
        q64 = q[:, lo:hi].astype(np.float64).transpose(0, 2, 1, 3)
        scores = (q64 @ k64[..., :keys]) / math.sqrt(q.shape[-1])
        if causal:
            scores[..., np.arange(lo, hi)[:, None] < np.arange(keys)[None, :]] = -np.inf
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        out[:, lo:hi] = ((p @ v64[:, :, :keys]) / p.sum(axis=-1, keepdims=True)).transpose(0, 2, 1, 3)
    return out


def rounded(x, dtype) -> np.ndarray:
    """float64 `x` rounded once to `dtype`, to nearest (ties to even). Some ml_dtypes releases
    (not 0.7.0) round float64 to bfloat16 through float32, twice, missing the nearest value
    within 2^-24 of a midpoint; so for bfloat16 x is cut to float32 toward zero with the lowest
    bit set where that dropped anything (round to odd), then rounded once, whatever the release."""
    if np.dtype(dtype) != np.dtype(C.array_dtype("bfloat16")):
        return x.astype(dtype)
    x = np.asarray(x, np.float64)
    f = x.astype(np.float32)
    f = np.where(np.abs(f.astype(np.float64)) > np.abs(x), np.nextafter(f, np.float32(0)), f)
    sticky = (f.astype(np.float64) != x).astype(np.uint32)
    return (f.view(np.uint32) | sticky).view(np.float32).astype(dtype)


def burstcu_out(q, k, v, ranks: int, causal: bool, layout: str = "contiguous"):
    """(out (B, S, H, D) in q's dtype, the ranks' NumPy op scratch bytes together): the burst
    strategy on `ranks` threads of this process, each rank's op on one thread."""
    def body(group):
        local = [burstcu.shard(x, group, layout) for x in (q, k, v)]
        out = burstcu.attention(*local, group, causal=causal, layout=layout, strategy="burst")
        return out, group.ops.scratch_bytes

    results, out = run_ranks(ranks, body, threads=1, timeout=600.0), np.empty_like(q)
    for rank, (local, _) in enumerate(results):
        assert local.dtype == q.dtype, (local.dtype, q.dtype)
        out[:, np.r_[tuple(shard_slices(layout, rank, ranks, q.shape[1]))]] = local
    return out, sum(scratch for _, scratch in results)


def simulated_outs(q, k, v, causal: bool, ranks_list, rows: int = ROWS) -> dict:
    """{G: {"rfa": out, "dtype-merge": out}}, each (B, S, H, D) in q's dtype, over a contiguous
    G-way split for every G at once. Per chunk of query rows: m (row max, -inf where a block sees
    no key), l (row sum) and o (unnormalized P @ V) against each of the finest split's key blocks,
    in float64, (B, H, blocks, R) and (B, H, blocks, R, D); joined into each G's blocks as a
    flash-attn forward returns them (out_j (B, H, G, R, D) in q's dtype, lse_j float32); merged by
    each rank in ring order (its own, then rank - 1, rank - 2, ... mod G; causal: blocks <= rank)."""
    b, s, h, d = q.shape
    blocks = math.lcm(*ranks_list)
    width = s // blocks
    rows = math.gcd(rows, width)                              # a row chunk never spans two shards
    q64 = q.astype(np.float64).transpose(0, 2, 1, 3)
    k64 = k.astype(np.float64).transpose(0, 2, 3, 1).reshape(b, h, d, blocks, width).transpose(0, 1, 3, 2, 4)
    v64 = v.astype(np.float64).transpose(0, 2, 1, 3).reshape(b, h, blocks, width, d)
    outs = {g: {"rfa": np.empty_like(q), "dtype-merge": np.empty_like(q)} for g in ranks_list}
    for lo in range(0, s, rows):
        hi = lo + rows
        seen = -(-hi // width) if causal else blocks             # blocks with a key <= hi - 1
        scores = (q64[:, :, None, lo:hi] @ k64[:, :, :seen]) / math.sqrt(d)   # (B, H, seen, R, W)
        if causal:
            scores[..., np.arange(lo, hi)[:, None] < np.arange(seen * width).reshape(seen, 1, -1)] = -np.inf
        m, l = np.full((b, h, blocks, rows), -np.inf), np.zeros((b, h, blocks, rows))
        o = np.zeros((b, h, blocks, rows, d))
        m[:, :, :seen] = scores.max(axis=-1)
        p = np.exp(scores - np.where(np.isfinite(m[:, :, :seen]), m[:, :, :seen], 0.0)[..., None])
        l[:, :, :seen], o[:, :, :seen] = p.sum(axis=-1), p @ v64[:, :, :seen]
        for g in ranks_list:
            m_g = m.reshape(b, h, g, blocks // g, rows)
            top = m_g.max(axis=3)
            top = np.where(np.isfinite(top), top, 0.0)
            w = np.exp(m_g - top[:, :, :, None])                 # 0 for fine blocks seeing no key
            l_j = (w * l.reshape(m_g.shape)).sum(axis=3)
            o_j = (w[..., None] * o.reshape(*m_g.shape, -1)).sum(axis=3)
            seen_j = l_j > 0
            out_j = rounded(o_j / np.where(seen_j, l_j, 1.0)[..., None], q.dtype)
            lse_j = np.where(seen_j, top + np.log(np.where(seen_j, l_j, 1.0)), -np.inf).astype(np.float32)
            rank = lo // (s // g)
            order = [j for j in ((rank - step) % g for step in range(g)) if not causal or j <= rank]
            for name, dtype in (("rfa", np.float32), ("dtype-merge", q.dtype)):
                run, lse = out_j[:, :, order[0]].astype(dtype), lse_j[:, :, order[0]]
                for j in order[1:]:   # ring-flash-attention's _update_out_and_lse, in float32
                    f32, one = run.astype(np.float32), np.float32(1)
                    weight = (one / (one + np.exp(lse - lse_j[:, :, j])))[..., None]
                    run = (f32 - weight * (f32 - out_j[:, :, j].astype(np.float32))).astype(dtype)
                    lse = lse + np.logaddexp(np.float32(0), lse_j[:, :, j] - lse)
                outs[g][name][:, lo:hi] = run.astype(q.dtype).transpose(0, 2, 1, 3)
    return outs


def measure(q, k, v, causal: bool, ranks_list, zigzag: bool) -> list:
    """One row per G for this (dtype, mask): every method's max / mean error, its share of
    elements off the floor, and its ratio to its own G = 1 error."""
    ref = reference(q, k, v, causal)
    nearest = rounded(ref, q.dtype)
    simulated = simulated_outs(q, k, v, causal, ranks_list)
    rows = []
    for g in ranks_list:
        t0 = time.perf_counter()
        row, outs = {"ranks": g}, dict(simulated[g])
        outs["burstcu"], row["ranks_scratch_bytes"] = burstcu_out(q, k, v, g, causal)
        row["burstcu_s"] = time.perf_counter() - t0
        if zigzag and causal:
            outs["burstcu-zz"] = burstcu_out(q, k, v, g, causal, "zigzag")[0]
        for name, out in {**outs, "floor": nearest}.items():
            diff = np.abs(out.astype(np.float64) - ref)
            row[f"{name}_max"], row[f"{name}_mean"] = float(diff.max()), float(diff.mean())
            if name != "floor":
                row[f"{name}_off_floor"] = float(np.mean(out != nearest))
        rows.append(row)
        C.progress(f"  G={g}: burstcu mean {row['burstcu_mean']:.3g}, rfa {row['rfa_mean']:.3g}, "
                   f"dtype-merge {row['dtype-merge_mean']:.3g} ({time.perf_counter() - t0:.1f} s)")
    for row in rows:
        for key in [f"{n}_{s}" for n in METHODS for s in ("max", "mean") if f"{n}_{s}" in row]:
            row[f"{key}_x1"] = row[key] / rows[0][key]
    return rows


def verdicts(rows: list) -> tuple[list[dict], list[str]]:
    """Per (dtype, mask): each method's ratio to G = 1 at the largest G and its mean error over the
    floor's, burstcu flat where within FLAT; and the line that says so."""
    found, lines = [], []
    for key in dict.fromkeys((r["dtype"], r["mask"]) for r in rows):   # in table order
        last = max((r for r in rows if (r["dtype"], r["mask"]) == key), key=lambda r: r["ranks"])
        v = {"dtype": key[0], "mask": key[1], "ranks": last["ranks"]}
        for name in METHODS:
            if last.get(f"{name}_max_x1") is not None:
                v[name] = {"max_x1": last[f"{name}_max_x1"], "mean_x1": last[f"{name}_mean_x1"],
                           "mean_over_floor": last[f"{name}_mean"] / last["floor_mean"]}
        v["burstcu_flat"] = all(v[n][s] <= FLAT for n in ("burstcu", "burstcu-zz") if n in v
                                for s in ("max_x1", "mean_x1"))
        found.append(v)
        b, r, m, zz = v["burstcu"], v["rfa"], v["dtype-merge"], v.get("burstcu-zz")
        zz = f"; zigzag {zz['max_x1']:.2f}x / {zz['mean_x1']:.2f}x" if zz else ""
        lines.append(f"# {key[0]} {key[1]}: burstcu at G={v['ranks']} is {b['max_x1']:.2f}x (max) / "
                     f"{b['mean_x1']:.2f}x (mean) its G=1 error{zz}: "
                     f"{f'flat (within {FLAT}x)' if v['burstcu_flat'] else 'NOT flat'}; "
                     f"rfa {r['max_x1']:.2f}x / {r['mean_x1']:.2f}x, dtype-merge {m['max_x1']:.2f}x / "
                     f"{m['mean_x1']:.2f}x; mean error over the floor: burstcu {b['mean_over_floor']:.2f}, "
                     f"rfa {r['mean_over_floor']:.2f}, dtype-merge {m['mean_over_floor']:.2f}")
    return found, lines


def shown(rows: list) -> str:
    """The table as printed: errors, ratios to G = 1 as "max/mean", burstcu's share off the floor."""
    cells = []
    for r in rows:
        c = {"dtype": r["dtype"], "mask": r["mask"], "G": r["ranks"]}
        for name, head in (("floor", "floor"), ("burstcu", "burstcu"), ("burstcu-zz", "zigzag"),
                           ("rfa", "rfa"), ("dtype-merge", "dtype-merge")):
            c[f"{head} max"], c[f"{head} mean"] = r.get(f"{name}_max"), r.get(f"{name}_mean")
            if name in ("burstcu", "rfa", "dtype-merge"):
                c[f"{head} xG1"] = f"{r[name + '_max_x1']:.2f}/{r[name + '_mean_x1']:.2f}"
            if name == "burstcu":
                c["!= floor"] = f"{100 * r['burstcu_off_floor']:.2f}%"
        cells.append(c)
    return C.table(cells, list(cells[0]))


def plot(rows: list, path: str, title: str) -> None:
    """A panel per dtype (rows) and mask (columns): each method's mean error (solid) and max
    (dashed; the floor dotted) against G, log axes; one shared legend below."""
    from matplotlib.lines import Line2D
    plt = C.pyplot()
    dtypes, masks = (list(dict.fromkeys(r[k] for r in rows)) for k in ("dtype", "mask"))
    fig, axes = plt.subplots(len(dtypes), len(masks), squeeze=False, sharex=True,
                             figsize=(5.2 * len(masks), 3.7 * len(dtypes) + 1.3))
    for (i, dtype), (j, mask) in ((a, b) for a in enumerate(dtypes) for b in enumerate(masks)):
        ax = axes[i][j]
        sel = sorted((r for r in rows if (r["dtype"], r["mask"]) == (dtype, mask)), key=lambda r: r["ranks"])
        xs = [r["ranks"] for r in sel]
        for name in [n for n in METHODS if sel[0].get(f"{n}_mean") is not None]:
            ax.plot(xs, [r[f"{name}_mean"] for r in sel], label=LABELS[name], **STYLE[name])
            dashed = {} if "dashes" in STYLE[name] else {"ls": "--"}   # the floor stays dotted
            ax.plot(xs, [r[f"{name}_max"] for r in sel], **{**STYLE[name], **dashed, "marker": None,
                                                             "alpha": 0.75})
        ax.set_title(f"{dtype}, {mask}", fontsize=10)
        ax.set(yscale="log", ylabel="|out - float64 reference|" if j == 0 else "",
               xlabel="ranks G (the same global problem)" if i == len(dtypes) - 1 else "")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, which="major", alpha=0.3)
        if mask == "causal":
            ax.text(0.02, 0.9, "max: the first rows' (one block for every method)", fontsize=7,
                    transform=ax.transAxes, va="top", color="0.3")
    legend = {label: h for ax in axes.flat for h, label in zip(*ax.get_legend_handles_labels())}
    legend["mean |error| (solid)"] = Line2D([], [], color="k", ls="-")
    legend["max |error| (dashed; the floor's dotted)"] = Line2D([], [], color="k", ls="--")
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, 1.05 / height, 1, 1 - 0.25 / height))   # an inch for the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    """Every (dtype, mask) in turn, then the table, JSON and plot; the JSON's content."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=16384, help="global sequence length S")
    for name, default in (("--batch", 1), ("--heads", 2), ("--headdim", 64)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    p.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
    p.add_argument("--score-std", type=float, default=1.0, help="q is scaled by this (peakier above 1)")
    p.add_argument("--no-zigzag", action="store_true", help="skip burstcu's zigzag rows (causal)")
    C.add_output_args(p)
    args = p.parse_args(argv)
    args.ranks = sorted(set(args.ranks))
    if args.ranks[0] != 1:
        p.error("--ranks must include 1: every ratio is to the G = 1 error")
    if args.seqlen % (2 * math.lcm(*args.ranks)):
        p.error(f"--seqlen must be a multiple of {2 * math.lcm(*args.ranks)} (2 x the lcm of --ranks)")
    start, rows, scratch = time.perf_counter(), [], {}
    with threadpool_limits(limits=1):   # also where NumPy was loaded before (one BLAS thread)
        for dtype, mask in [(dt, mask) for dt in args.dtypes for mask in args.masks]:
            C.progress(f"{dtype} {mask}: S={args.seqlen}, G in {args.ranks} "
                       f"({time.perf_counter() - start:.0f} s so far)")
            q, k, v = problem(args.seqlen, args.batch, args.heads, args.headdim, dtype, 0, args.score_std)
            for row in measure(q, k, v, mask == "causal", args.ranks, not args.no_zigzag):
                scratch[row["ranks"]] = max(scratch.get(row["ranks"], 0), row["ranks_scratch_bytes"])
                rows.append({"dtype": dtype, "mask": mask, **row})
        elapsed = time.perf_counter() - start   # the environment as measured: one BLAS thread
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        env = C.environment(None, transport="loopback", progress="threads: one per rank",
                            ranks=args.ranks, peak_rss_bytes=peak_rss, elapsed_s=elapsed)
    found, lines = verdicts(rows)
    text = "\n".join([
        f"# forward error vs ring size G: S={args.seqlen}, B={args.batch}, H={args.heads}, "
        f"D={args.headdim}, q k v ~ N(0,1) (q x {args.score_std:g}) rounded to the dtype, seed 0; "
        f"|out - float64 reference|, max and mean over every element",
        "# burstcu: measured (NumPy backend, strategy burst, G ranks as threads on the loopback transport); "
        "simulated (docs/numerics.md): rfa = ring-flash-attention's forward (block outs rounded to the "
        "dtype, running out float32), dtype-merge = a running out kept in the dtype (rounded at every "
        "merge); floor: the reference rounded once; xG1: max/mean error over the same method's at G=1; "
        "!= floor: the share of burstcu's elements not equal to the correctly rounded result",
        f"# measured on {env['device']} ({env['cpus']} cores, numpy {env['numpy']}), {elapsed:.0f} s "
        f"in all, peak RSS {C.fmt_bytes(peak_rss)}; the ranks' op scratch at G={args.ranks[-1]}: "
        f"{C.fmt_bytes(scratch[args.ranks[-1]])} together", shown(rows), *lines])
    goal = f"burstcu's error at the largest G within {FLAT}x of its G=1 error (max and mean)"
    result = C.emit(text, {"environment": env, "args": C.clean(vars(args)), "methods": LABELS, "goal": goal,
                           "verdicts": found, "rows": rows, "elapsed_s": elapsed, "peak_rss_bytes": peak_rss,
                           "ranks_scratch_bytes": scratch}, args)
    if args.plot:
        plot(rows, args.plot, f"forward |error| vs ring size: S={args.seqlen}, H={args.heads}, "
                              f"D={args.headdim}, q k v ~ N(0,1) (CPU, NumPy backend)")
    return C.clean(result)


if __name__ == "__main__":
    main()
