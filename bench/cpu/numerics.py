"""Forward error against the ring size: burstcu's float32 running state, kept across every hop,
beside two simulated ring schedules that round partial outputs to the input dtype, and the floor.

    python bench/cpu/numerics.py [--seqlen 16384] [--batch 1] [--heads 2] [--headdim 64]
        [--ranks 1 2 4 8 16 32 64] [--dtypes bfloat16 float16] [--masks full causal]
        [--score-std 1] [--no-zigzag] [--json F] [--table F] [--plot F]

One process, no mpiexec: for each G the ranks run as G threads on burstcu's loopback transport
(`burstcu.testing.world.run_ranks`), each rank's NumPy op on one thread, BLAS on one thread.
The same global problem — q, k, v drawn N(0, 1) in float32 (q times --score-std, so the scores
q k^T / sqrt(D) have about that standard deviation), seeded, then rounded to each input dtype
(bfloat16 through `ml_dtypes`) — is split over G = 1, 2, 4, ... ranks, and every method's `out`
(B, S, H, D) is compared with one float64 reference of the rounded inputs:

  reference     full softmax in float64 (score rows, max, exp, sum, P @ V, divide), --rows query
                rows at a time; it calls nothing of burstcu
  floor         the reference rounded once to the input dtype, to nearest (`rounded`: not
                through float32, as ml_dtypes' own cast of float64 to bfloat16 is): "exact,
                then rounded", the least error, element by element, that any method returning
                the input dtype can have
  burstcu       burstcu.attention(strategy="burst", layout="contiguous") on G loopback ranks
                (backend "numpy"): every visiting K/V block folded into a float32 running state
                (acc, row sums, shift) that stays on its rank; out rounded once, at the end
  burstcu-zz    the same with layout="zigzag" (causal only, where the layout matters; not with
                --no-zigzag)
  rfa           ring-flash-attention's forward, simulated for the same G-way contiguous split:
                at each ring step (rank i visits K/V block i, i-1, ..., as its ring delivers
                them; causal: blocks after i skipped, block i causal) a flash-attn forward
                returns the block's partial, out_j ROUNDED TO THE INPUT DTYPE and lse_j in
                float32, and it is merged into a running (out, lse) KEPT IN FLOAT32 with
                ring-flash-attention's formula (`_update_out_and_lse` in its utils.py):
                    out = out - sigmoid(lse_j - lse) * (out - float32(out_j))
                    lse = lse - logsigmoid(lse - lse_j)
                computed in float32; out is rounded to the input dtype after the last step
  dtype-merge   the same blocks and formula, but the running out is KEPT IN THE INPUT DTYPE:
                each merge computes in float32 and rounds out to the input dtype again — a ring
                that merges in the input dtype after every step (G roundings of the output
                instead of one)

What the two simulations leave out: a flash-attn kernel also rounds P to the input dtype
before P @ V; here each block's partial is computed in float64 and rounded once (out_j to the
input dtype, lse_j to float32) — the best partial a kernel could return — so that the columns
isolate how the blocks are merged. At G = 1 both simulations are the floor exactly.
ring-flash-attention as published keeps the running out in float32 ("rfa"); the per-step
input-dtype merge ("dtype-merge") is the schedule that rounds at every hop.

Per row (dtype, mask, G): max and mean |out - reference| over every element for each method,
each method's ratio to its own G = 1 error (max and mean), and the share of burstcu's elements
that differ from the floor's (the correctly rounded value). Under a causal mask the max is the
first rows' — they see a handful of keys, so |out| is largest there — and those rows see one
block on every method: read the mean there. Figures are of the NumPy backend on the CPU
(float32 state); the CUDA kernels keep the same float32 state, but their errors are not
measured here. Progress lines go to stderr; stdout gets the table and a verdict per (dtype,
mask): whether burstcu stays within 1.2x of its G = 1 error at the largest G, and how much each
simulated schedule grew. --json: environment, arguments, every row, run time and peak memory
(resident set, and the ranks' NumPy op scratch together at each G). --plot: error against G
(log2 axis), one line per method (mean solid, max dashed), a panel per dtype and mask.
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
SIMULATED = ("rfa", "dtype-merge")
FLAT = 1.2   # the goal: burstcu's error at the largest G within this factor of its G = 1 error
LABELS = {"burstcu": "burstcu: float32 state across hops (measured)",
          "burstcu-zz": "burstcu, zigzag layout (measured)",
          "rfa": "rfa: ring-flash-attention's merge, block outs in the input dtype,\n"
                 "float32 running out (simulated)",
          "dtype-merge": "dtype-merge: running out kept in the input dtype,\n"
                         "rounded at every merge (simulated)",
          "floor": "floor: float64, rounded once"}


# ----------------------------------------------------------------------------------------------
# the problem and its reference


def problem(seqlen: int, batch: int, heads: int, headdim: int, dtype: str, seed: int = 0,
            score_std: float = 1.0):
    """q, k, v (batch, seqlen, heads, headdim) in `dtype`: N(0, 1) float32 draws (q times
    score_std), seeded, rounded to `dtype` — the same draws for every dtype."""
    rng = np.random.default_rng(seed)
    shape = (batch, seqlen, heads, headdim)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    dt = C.array_dtype(dtype)
    return (q * np.float32(score_std)).astype(dt), k.astype(dt), v.astype(dt)


def reference(q, k, v, causal: bool, rows: int = 256) -> np.ndarray:
    """out (B, S, H, D) in float64: full softmax of q k^T / sqrt(D) over every key (causal: key
    position <= query position), `rows` query rows at a time (a (B, H, rows, S) score block)."""
    b, s, h, d = q.shape
    k64 = k.astype(np.float64).transpose(0, 2, 3, 1)        # (B, H, D, S)
    v64 = v.astype(np.float64).transpose(0, 2, 1, 3)        # (B, H, S, D)
    out = np.empty(q.shape, np.float64)
    for lo in range(0, s, rows):
        hi = min(lo + rows, s)
        keys = hi if causal else s                          # later keys are all masked
        rows64 = q[:, lo:hi].astype(np.float64).transpose(0, 2, 1, 3)      # (B, H, rows, D)
        scores = (rows64 @ k64[..., :keys]) / math.sqrt(d)
        if causal:
            scores[..., np.arange(lo, hi)[:, None] < np.arange(keys)[None, :]] = -np.inf
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        o = (p @ v64[:, :, :keys]) / p.sum(axis=-1, keepdims=True)
        out[:, lo:hi] = o.transpose(0, 2, 1, 3)
    return out


def rounded(x, dtype) -> np.ndarray:
    """float64 `x` rounded once to `dtype`, to nearest (ties to even). NumPy rounds float64 to
    float16 so; ml_dtypes rounds float64 to bfloat16 through float32, twice, which misses the
    nearest value where x lies within 2^-24 (relative) of a midpoint. For bfloat16, x is
    therefore cut to float32 toward zero with the lowest bit set where that dropped anything
    (round to odd: the 16 spare bits keep every midpoint apart), then rounded once."""
    if np.dtype(dtype) != np.dtype(C.array_dtype("bfloat16")):
        return x.astype(dtype)
    x = np.asarray(x, np.float64)
    f = x.astype(np.float32)
    f = np.where(np.abs(f.astype(np.float64)) > np.abs(x), np.nextafter(f, np.float32(0)), f)
    sticky = (f.astype(np.float64) != x).astype(np.uint32)
    return (f.view(np.uint32) | sticky).view(np.float32).astype(dtype)


def errors(got, ref) -> tuple[float, float]:
    """(max, mean) of |got - ref| over every element, in float64."""
    diff = np.abs(got.astype(np.float64) - ref)
    return float(diff.max()), float(diff.mean())


# ----------------------------------------------------------------------------------------------
# burstcu on G loopback ranks


def burstcu_out(q, k, v, ranks: int, causal: bool, layout: str = "contiguous"):
    """(out (B, S, H, D) in q's dtype, the ranks' NumPy op scratch bytes together): burstcu's
    burst strategy on `ranks` threads of this process, each rank's op on one thread."""
    def body(group):
        local = [burstcu.shard(x, group, layout) for x in (q, k, v)]
        out = burstcu.attention(*local, group, causal=causal, layout=layout, strategy="burst")
        return out, group.ops.scratch_bytes

    results = run_ranks(ranks, body, threads=1, timeout=600.0)
    out = np.empty_like(q)
    for rank, (local, _) in enumerate(results):
        assert local.dtype == q.dtype, (local.dtype, q.dtype)
        at = 0
        for piece in shard_slices(layout, rank, ranks, q.shape[1]):
            n = piece.stop - piece.start
            out[:, piece] = local[:, at:at + n]
            at += n
    return out, sum(scratch for _, scratch in results)


# ----------------------------------------------------------------------------------------------
# the simulated ring schedules


def _fine_partials(q64, k64, v64, lo: int, hi: int, causal: bool, blocks: int):
    """For query rows [lo, hi), per key block of S / blocks keys, in float64: the block's shift
    m (its row max, -inf where it sees no key), row sums l and unnormalized P @ V o.
    q64 (B, H, S, D); k64 (B, H, blocks, D, S/blocks); v64 (B, H, blocks, S/blocks, D).
    Returns m, l (B, H, blocks, rows) and o (B, H, blocks, rows, D)."""
    b, h, _, d = q64.shape
    width = k64.shape[-1]
    seen = -(-hi // width) if causal else blocks             # blocks with a key <= hi - 1
    scores = (q64[:, :, None, lo:hi] @ k64[:, :, :seen]) / math.sqrt(d)   # (B, H, seen, R, W)
    if causal:
        key = np.arange(seen * width).reshape(seen, 1, width)
        scores[..., np.arange(lo, hi)[:, None] < key] = -np.inf
    m = np.full((b, h, blocks, hi - lo), -np.inf)
    l = np.zeros((b, h, blocks, hi - lo))
    o = np.zeros((b, h, blocks, hi - lo, d))
    m[:, :, :seen] = scores.max(axis=-1)
    shift = np.where(np.isfinite(m[:, :, :seen]), m[:, :, :seen], 0.0)
    p = np.exp(scores - shift[..., None])                    # masked keys: exp(-inf) = 0
    l[:, :, :seen] = p.sum(axis=-1)
    o[:, :, :seen] = p @ v64[:, :, :seen]
    return m, l, o


def _block_partials(m, l, o, ranks: int, dtype):
    """The fine partials joined, in float64, into the `ranks` blocks of a G-way split and
    returned as a flash-attn forward returns a block's partial: out_j (B, H, G, rows, D)
    rounded to `dtype`, lse_j (B, H, G, rows) in float32 (-inf: a block the rows do not see)."""
    b, h, blocks, r = m.shape
    group = blocks // ranks
    m = m.reshape(b, h, ranks, group, r)
    top = m.max(axis=3)
    top_safe = np.where(np.isfinite(top), top, 0.0)
    w = np.exp(m - top_safe[:, :, :, None])                  # 0 for fine blocks seeing no key
    l_j = (w * l.reshape(m.shape)).sum(axis=3)
    o_j = (w[..., None] * o.reshape(*m.shape, -1)).sum(axis=3)
    seen = l_j > 0
    out_j = rounded(o_j / np.where(seen, l_j, 1.0)[..., None], dtype)
    lse_j = np.where(seen, top_safe + np.log(np.where(seen, l_j, 1.0)), -np.inf).astype(np.float32)
    return out_j, lse_j


def _sigmoid(x):
    return np.float32(1) / (np.float32(1) + np.exp(-x))


def _logsigmoid(x):
    return -np.logaddexp(np.float32(0), -x)


def merge(out, lse, block_out, block_lse, dtype=None):
    """One step of ring-flash-attention's merge, in float32: (out, lse) with the block's
    (block_out in the input dtype, block_lse float32) folded in. out: float32, or with `dtype`
    the running out in that dtype, rounded to it again after the merge."""
    f32 = out.astype(np.float32)
    new = f32 - _sigmoid(block_lse - lse)[..., None] * (f32 - block_out.astype(np.float32))
    lse = lse - _logsigmoid(lse - block_lse)
    return (new if dtype is None else new.astype(dtype)), lse


def ring_order(rank: int, ranks: int, causal: bool) -> list[int]:
    """The K/V blocks rank `rank` computes, in the order its ring delivers them: its own, then
    rank - 1, rank - 2, ... (mod G); causal: only blocks <= rank (the others are all future)."""
    order = [(rank - step) % ranks for step in range(ranks)]
    return [j for j in order if not causal or j <= rank]


def simulated_outs(q, k, v, causal: bool, ranks_list, rows: int = 256) -> dict:
    """{G: {"rfa": out, "dtype-merge": out}}, each (B, S, H, D) in q's dtype: the two simulated
    ring schedules of the module docstring over a contiguous G-way split, for every G of
    ranks_list at once (the blocks of each split are joined from partials over the finest one)."""
    b, s, h, d = q.shape
    blocks = math.lcm(*ranks_list)
    width = s // blocks
    rows = math.gcd(rows, width)                              # a row chunk never spans two shards
    q64 = q.astype(np.float64).transpose(0, 2, 1, 3)
    k64 = k.astype(np.float64).transpose(0, 2, 3, 1).reshape(b, h, d, blocks, width).transpose(0, 1, 3, 2, 4)
    v64 = v.astype(np.float64).transpose(0, 2, 1, 3).reshape(b, h, blocks, width, d)
    outs = {g: {name: np.empty_like(q) for name in SIMULATED} for g in ranks_list}
    for lo in range(0, s, rows):
        hi = lo + rows
        m, l, o = _fine_partials(q64, k64, v64, lo, hi, causal, blocks)
        for g in ranks_list:
            out_j, lse_j = _block_partials(m, l, o, g, q.dtype)
            order = ring_order(lo // (s // g), g, causal)
            for name, dtype in (("rfa", None), ("dtype-merge", q.dtype)):
                first = order[0]
                run = out_j[:, :, first].astype(np.float32) if dtype is None else out_j[:, :, first]
                lse = lse_j[:, :, first]
                for j in order[1:]:
                    run, lse = merge(run, lse, out_j[:, :, j], lse_j[:, :, j], dtype)
                outs[g][name][:, lo:hi] = run.astype(q.dtype).transpose(0, 2, 1, 3)
    return outs


# ----------------------------------------------------------------------------------------------
# the sweep


def measure(q, k, v, causal: bool, ranks_list, zigzag: bool, rows: int, log=C.progress) -> list:
    """One row per G for this (dtype, mask): every method's max / mean error (module docstring)."""
    t0 = time.perf_counter()
    ref = reference(q, k, v, causal, rows)
    nearest = rounded(ref, q.dtype)
    floor = errors(nearest, ref)
    log(f"  reference {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    simulated = simulated_outs(q, k, v, causal, ranks_list, rows)
    log(f"  simulated schedules {time.perf_counter() - t0:.1f} s")
    rows_out = []
    for g in ranks_list:
        t0 = time.perf_counter()
        row = {"ranks": g}
        out, scratch = burstcu_out(q, k, v, g, causal)
        row["burstcu_max"], row["burstcu_mean"] = errors(out, ref)
        row["burstcu_off_floor"] = float(np.mean(out != nearest))
        row["burstcu_s"], row["ranks_scratch_bytes"] = time.perf_counter() - t0, scratch
        if zigzag and causal:
            out, _ = burstcu_out(q, k, v, g, causal, "zigzag")
            row["burstcu-zz_max"], row["burstcu-zz_mean"] = errors(out, ref)
            row["burstcu-zz_off_floor"] = float(np.mean(out != nearest))
        for name in SIMULATED:
            row[f"{name}_max"], row[f"{name}_mean"] = errors(simulated[g][name], ref)
            row[f"{name}_off_floor"] = float(np.mean(simulated[g][name] != nearest))
        row["floor_max"], row["floor_mean"] = floor
        rows_out.append(row)
        log(f"  G={g}: burstcu max {row['burstcu_max']:.3g} mean {row['burstcu_mean']:.3g}, "
            f"rfa mean {row['rfa_mean']:.3g}, dtype-merge mean {row['dtype-merge_mean']:.3g} "
            f"({time.perf_counter() - t0:.1f} s)")
    for row in rows_out:   # each method's growth: the ratio to its own G = 1 error
        for name in METHODS:
            for stat in ("max", "mean"):
                base, val = rows_out[0].get(f"{name}_{stat}"), row.get(f"{name}_{stat}")
                row[f"{name}_{stat}_x1"] = None if base is None or val is None else val / base
    return rows_out


def verdicts(rows: list) -> list[dict]:
    """Per (dtype, mask): burstcu's ratio to G = 1 at the largest G (flat: within FLAT, max and
    mean) and each simulated schedule's."""
    out = []
    for key in dict.fromkeys((r["dtype"], r["mask"]) for r in rows):   # in table order
        sel = [r for r in rows if (r["dtype"], r["mask"]) == key]
        last = max(sel, key=lambda r: r["ranks"])
        v = {"dtype": key[0], "mask": key[1], "ranks": last["ranks"]}
        for name in METHODS:
            if last.get(f"{name}_max_x1") is not None:
                v[name] = {"max_x1": last[f"{name}_max_x1"], "mean_x1": last[f"{name}_mean_x1"],
                           "mean_over_floor": last[f"{name}_mean"] / last["floor_mean"]}
        v["burstcu_flat"] = all(v[n][s] <= FLAT for n in ("burstcu", "burstcu-zz") if n in v
                                for s in ("max_x1", "mean_x1"))
        out.append(v)
    return out


def verdict_lines(found: list) -> list[str]:
    lines = []
    for v in found:
        b = v["burstcu"]
        zz = (f"; zigzag {v['burstcu-zz']['max_x1']:.2f}x / {v['burstcu-zz']['mean_x1']:.2f}x"
              if "burstcu-zz" in v else "")
        lines.append(
            f"# {v['dtype']} {v['mask']}: burstcu at G={v['ranks']} is {b['max_x1']:.2f}x (max) / "
            f"{b['mean_x1']:.2f}x (mean) its G=1 error{zz}: "
            f"{'flat (within ' + str(FLAT) + 'x)' if v['burstcu_flat'] else 'NOT flat'}; "
            f"rfa {v['rfa']['max_x1']:.2f}x / {v['rfa']['mean_x1']:.2f}x, dtype-merge "
            f"{v['dtype-merge']['max_x1']:.2f}x / {v['dtype-merge']['mean_x1']:.2f}x; mean error "
            f"over the floor: burstcu {b['mean_over_floor']:.2f}, rfa {v['rfa']['mean_over_floor']:.2f}, "
            f"dtype-merge {v['dtype-merge']['mean_over_floor']:.2f}")
    return lines


# the printed table: (header, row key or a pair of keys shown as "max/mean" ratios)
SHOWN = [("dtype", "dtype"), ("mask", "mask"), ("G", "ranks"),
         ("floor max", "floor_max"), ("floor mean", "floor_mean"),
         ("burstcu max", "burstcu_max"), ("burstcu mean", "burstcu_mean"),
         ("burstcu xG1", ("burstcu_max_x1", "burstcu_mean_x1")), ("!= floor", "burstcu_off_floor"),
         ("zigzag max", "burstcu-zz_max"), ("zigzag mean", "burstcu-zz_mean"),
         ("rfa max", "rfa_max"), ("rfa mean", "rfa_mean"), ("rfa xG1", ("rfa_max_x1", "rfa_mean_x1")),
         ("dtype-merge max", "dtype-merge_max"), ("dtype-merge mean", "dtype-merge_mean"),
         ("dtype-merge xG1", ("dtype-merge_max_x1", "dtype-merge_mean_x1"))]


def shown(rows: list) -> str:
    """The table as printed: errors to 3 digits, ratios to G = 1 as "max/mean", the share of
    burstcu's elements that differ from the floor's (the correctly rounded result) in percent."""
    out = []
    for r in rows:
        cells = {}
        for head, key in SHOWN:
            if isinstance(key, tuple):
                a, b = r.get(key[0]), r.get(key[1])
                cells[head] = None if a is None else f"{a:.2f}/{b:.2f}"
            elif key.endswith("off_floor"):
                cells[head] = f"{100 * r[key]:.2f}%"
            else:
                cells[head] = r.get(key)
        out.append(cells)
    return C.table(out, [head for head, _ in SHOWN])


# burstcu wide and underneath; the floor and zigzag thin and on top, so that both stay visible
# where they coincide with it
STYLE = {"burstcu": dict(color="C0", lw=3.2, zorder=2, marker="o"),
         "burstcu-zz": dict(color="C1", lw=1.2, zorder=4, marker="x", markersize=6),
         "rfa": dict(color="C2", lw=1.5, zorder=3, marker="o"),
         "dtype-merge": dict(color="C3", lw=1.5, zorder=3, marker="o"),
         "floor": dict(color="k", lw=1.2, zorder=5, dashes=(1, 1.5))}


def _panel(ax, sel: list) -> None:
    """One (dtype, mask): each method's mean error (solid, labelled) and max error (dashed; the
    floor dotted in both) against G, both axes logarithmic."""
    xs = [r["ranks"] for r in sel]
    for name in METHODS:
        if sel[0].get(f"{name}_mean") is None:
            continue
        for stat in ("mean", "max"):
            kw = dict(STYLE[name], markersize=STYLE[name].get("markersize", 3.5))
            if stat == "mean":
                kw["label"] = LABELS[name]
            else:
                kw.update(marker=None, alpha=0.75)
                if "dashes" not in kw:   # the floor stays dotted
                    kw["ls"] = "--"
            ax.plot(xs, [r[f"{name}_{stat}"] for r in sel], **kw)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.grid(True, which="major", alpha=0.3)
    if sel[0]["mask"] == "causal":
        ax.text(0.02, 0.9, "max: the first rows' (one block for every method)", fontsize=7,
                transform=ax.transAxes, va="top", color="0.3")


def plot(rows: list, path: str, title: str) -> None:
    """A panel per dtype (rows) and mask (columns), one shared legend below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    fig, axes = plt.subplots(len(dtypes), len(masks), squeeze=False, sharex=True,
                             figsize=(5.2 * len(masks), 3.7 * len(dtypes) + 1.3))
    for i, dtype in enumerate(dtypes):
        for j, mask in enumerate(masks):
            ax = axes[i][j]
            _panel(ax, sorted((r for r in rows if (r["dtype"], r["mask"]) == (dtype, mask)),
                              key=lambda r: r["ranks"]))
            ax.set_title(f"{dtype}, {mask}", fontsize=10)
            if j == 0:
                ax.set_ylabel("|out - float64 reference|")
            if i == len(dtypes) - 1:
                ax.set_xlabel("ranks G (the same global problem)")
    legend = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    legend["mean |error| (solid)"] = Line2D([], [], color="k", ls="-")
    legend["max |error| (dashed; the floor's dotted)"] = Line2D([], [], color="k", ls="--")
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=3, fontsize=8,
               frameon=False)
    fig.suptitle(title, fontsize=10)
    height = fig.get_size_inches()[1]
    fig.tight_layout(rect=(0, 1.05 / height, 1, 1 - 0.25 / height))   # an inch for the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlen", type=int, default=16384, help="global sequence length S")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"],
                   choices=["bfloat16", "float16"])
    p.add_argument("--masks", nargs="+", default=["full", "causal"], choices=["full", "causal"])
    p.add_argument("--score-std", type=float, default=1.0,
                   help="q is scaled by this: the scores' standard deviation (peakier above 1)")
    p.add_argument("--no-zigzag", action="store_true", help="skip burstcu's zigzag rows (causal)")
    p.add_argument("--rows", type=int, default=256, help="query rows per reference block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None, help="write the printed table here too")
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    args.ranks = sorted(set(args.ranks))
    if args.ranks[0] != 1:
        p.error("--ranks must include 1: every ratio is to the G = 1 error")
    step = 2 * math.lcm(*args.ranks)
    if args.seqlen % step:
        p.error(f"--seqlen {args.seqlen} must be a multiple of {step} (2 x the lcm of --ranks: "
                f"equal shards, zigzag chunks included)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    with threadpool_limits(limits=1):   # also where NumPy was loaded before (one BLAS thread)
        return run(args)


def run(args) -> dict:
    """The sweep of main(): every (dtype, mask) in turn, then the table, JSON and plot."""
    start = time.perf_counter()
    rows, scratch = [], {}
    configs = [(dt, mask) for dt in args.dtypes for mask in args.masks]
    for n, (dtype, mask) in enumerate(configs, 1):
        C.progress(f"[{n}/{len(configs)}] {dtype} {mask}: S={args.seqlen} B={args.batch} "
                   f"H={args.heads} D={args.headdim}, G in {args.ranks} "
                   f"({time.perf_counter() - start:.0f} s so far)")
        q, k, v = problem(args.seqlen, args.batch, args.heads, args.headdim, dtype, args.seed,
                          args.score_std)
        for row in measure(q, k, v, mask == "causal", args.ranks, not args.no_zigzag, args.rows):
            scratch[row["ranks"]] = max(scratch.get(row["ranks"], 0), row["ranks_scratch_bytes"])
            rows.append({"dtype": dtype, "mask": mask, **row})
    elapsed = time.perf_counter() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    env = C.environment(None, transport="loopback", progress="threads: one per rank",
                        ranks=args.ranks, peak_rss_bytes=peak_rss, elapsed_s=elapsed)
    found = verdicts(rows)
    text = "\n".join([*header(args, env, scratch), shown(rows), *verdict_lines(found)])
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    result = {"environment": env, "args": C.clean(vars(args)), "methods": LABELS,
              "goal": f"burstcu's error at the largest G within {FLAT}x of its G=1 error (max and mean)",
              "verdicts": found, "rows": rows, "elapsed_s": elapsed, "peak_rss_bytes": peak_rss,
              "ranks_scratch_bytes": scratch}
    if args.json:
        C.write_json(args.json, result)
    if args.plot:
        plot(rows, args.plot, f"forward |error| vs ring size: S={args.seqlen}, H={args.heads}, "
                              f"D={args.headdim}, q k v ~ N(0,1) (CPU, NumPy backend)")
    return C.clean(result)


def header(args, env: dict, scratch: dict) -> list[str]:
    """The lines above the table: the problem, what each column is, what it ran on."""
    return [
        f"# forward error vs ring size G: S={args.seqlen}, B={args.batch}, H={args.heads}, "
        f"D={args.headdim}, q k v ~ N(0,1) (q x {args.score_std:g}) rounded to the dtype, "
        f"seed {args.seed}; |out - float64 reference|, max and mean over every element",
        "# burstcu: measured (NumPy backend, strategy burst, G ranks as threads on the loopback "
        "transport); simulated (bench/cpu/numerics.py's docstring): rfa = ring-flash-attention's "
        "forward (block outs rounded to the dtype, running out float32), dtype-merge = a running "
        "out kept in the dtype (rounded at every merge); floor: the reference rounded once; "
        "xG1: max/mean error over the same method's at G=1; != floor: the share of burstcu's "
        "elements not equal to the correctly rounded result",
        f"# measured on {env['device']} ({env['cpus']} cores, numpy {env['numpy']}), "
        f"{env['elapsed_s']:.0f} s in all, peak RSS {C.fmt_bytes(env['peak_rss_bytes'])}; the "
        f"ranks' op scratch at G={args.ranks[-1]}: {C.fmt_bytes(scratch[args.ranks[-1]])} together"]


if __name__ == "__main__":
    main()
