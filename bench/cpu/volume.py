"""Communication volume per rank, per pass and strategy: measured (`group.stats`) beside the exact
byte formula of the implementation and beside the paper's formula, with the differences explained.

    mpiexec -n G python bench/cpu/volume.py [--seqlen N] [--heads H] [--kv-heads Hkv] [--headdim D]
        [--dtype float16] [--json FILE]

The paper (BurstAttention, Table "communication overhead") counts ELEMENTS moved "across the
ring" in one Transformer block, with B batch, Z heads, N global tokens, d head dim, G devices:

    forward (BurstAttention and Ring Attention)   2 B Z N d
    backward, BurstAttention                      3 B Z N d + 2 B N Z / G
    backward, Ring Attention                      6 B Z N d

Converting to bytes SENT BY ONE RANK in one pass (S = N/G local tokens):
  * forward: each of the G-1 steps a rank sends its current K and V, 2 B Z S d elements, so
    2 B Z S d (G-1) = 2 B Z N d (G-1)/G: the paper's total times (G-1)/G. With GQA the K/V heads
    are Hkv, not Z.
  * BurstAttention backward: each of the G-1 steps a rank sends Q, dO, dQ (3 B Z S d) and lse,
    delta (2 B Z S) of one visiting block: 3 B Z N d (G-1)/G + 2 B Z N (G-1)/G. The paper's
    lse/delta term 2 B N Z / G is ONE step's worth; over the pass it is (G-1) times that.
  * Ring Attention backward: the paper's 6 B Z N d is not what the ring baseline here moves.
    Following the seeds (Liu et al., ring-flash-attention) K, V and dK, dV travel:
    4 B Z N d (G-1)/G + one more dK, dV hop. We print the paper's figure times (G-1)/G beside it.
  * all-gather (Megatron-CP / LASP-2H; not in the paper's table): all-gather K, V sends
    2 B Hkv S d (G-1) per rank per pass; the backward adds a reduce-scatter of dK, dV:
    2 B Hkv S d (G-1) more.
  * USP (Ulysses in groups of u ranks, the burst ring across the G/u groups): listed with its
    terms; no published count to compare with.
  * Ulysses (DeepSpeed-Ulysses; not in the paper's table): an all-to-all of a rank's M elements
    sends M (G-1)/G of them. Forward: q, k, v out and the attention output back, (2 H + 2 Hkv)
    B S d (G-1)/G; backward: q, dO, k, v out and dq, dk, dv back, (3 H + 4 Hkv) B S d (G-1)/G.
    Where G > Hkv a kv head goes to each of the G/Hkv ranks that use it: the k, v terms are then
    Hk = 1 head to each of the G-1 peers instead of Hkv (G-1)/G.
The paper assumes one element size. The implementation sends Q, dO, K, V in the input dtype but
dQ, dK, dV, lse and delta in the accumulation dtype (fp32; fp64 for fp64 input), and its dQ (burst)
or dK, dV (ring) make one extra hop to return to their owner; both are listed per row.

Masks (--docs and/or --window LEFT RIGHT, with --causal and --layout as given): burst only.
    mpiexec -n G python bench/cpu/volume.py --docs [--window L R] [--causal] [--layout zigzag]
--docs packs a seeded mix of documents (`bench/_common.py`'s `document_mix`: log-normal lengths,
--doc-seed, --doc-median) into the N tokens and passes it as cu_seqlens; zigzag shards are each
document's 2G pieces. Per rank it prints the bytes burst sent (group.stats, measured) beside
  * burst's own formula for the mask (`burst.forward_bytes` / `backward_bytes`),
  * the MINIMUM for the mask, counted here from the partition and a dense test of every
    (query, key) pair (same document, key <= query under causal, inside the window), without
    burstcu.engine: a K/V block (forward) goes exactly to the ranks whose queries see one of its
    keys; a query bundle (q, dout in the input dtype, lse and delta in fp32; backward) goes
    exactly to the ranks whose keys its queries see, and each of those returns one dQ (fp32).
    "min blocks" sends whole blocks, "min rows" only the rows some query there needs. The
    minimum is charged to the block's owner (direct sends); a ring relays blocks, so one rank
    may send less than its own minimum while another sends more: compare the totals;
  * the full ring: every block G-1 hops, every dQ home (what the ring sends without skipping).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu import engine  # noqa: E402
from burstcu.engine import burst  # noqa: E402
from burstcu.engine.burst import backward_counts  # noqa: E402
from burstcu.layout import partition  # noqa: E402
from burstcu.ops.base import accum_dtype  # noqa: E402


def burst_counts(size: int, seqlen_local: int, *, rank: int, layout: str, causal: bool):
    return backward_counts(rank, size, seqlen_local, layout, causal)


def paper_bytes(strategy: str, pass_: str, *, G, B, S, H, Hkv, D, it) -> int:
    """The paper's element count, converted to bytes one rank sends (all at input itemsize `it`).
    See the module docstring; H plays Z for query-side tensors, Hkv for K/V-side ones."""
    if G == 1 or strategy == "usp":    # usp: no published table to compare with
        return 0
    hops = G - 1
    if strategy == "ulysses":  # q-side tensors: (G-1)/G of H heads; k, v: Hk heads to each peer
        hk = Hkv // G if Hkv % G == 0 else 1
        q_side, kv_side = (2, 2) if pass_ == "forward" else (3, 4)
        return (q_side * H * B * S * D * hops // G + kv_side * hk * B * S * D * hops) * it
    if pass_ == "forward":
        return 2 * B * Hkv * S * D * hops * it
    if strategy == "burst":
        return (3 * B * H * S * D + 2 * B * H * S) * hops * it
    if strategy == "ring":
        return 6 * B * Hkv * S * D * hops * it
    return 4 * B * Hkv * S * D * hops * it  # allgather: gather K, V + reduce-scatter dK, dV


def explain(strategy: str, pass_: str, *, G, B, S, H, Hkv, D, it, acc, sends=None,
            counts=None) -> tuple[dict, str]:
    """Decomposition of the implementation's bytes into named terms, and why it differs from
    the paper's count. sends: the forward ring hops this rank sends K, V on (burst; usp: its
    ring of groups), fewer than G-1 where a mask ends a block's trip early. counts: the
    backward's (bundles, dqs, messages) this rank sends (burst; usp: its ring), fewer than
    (G-1, G, G+1) where a mask ends a bundle's trip early."""
    if G == 1:
        return {}, "one rank: nothing moves"
    hops = G - 1
    kv, kv_acc = B * S * Hkv * D * it, B * S * Hkv * D * acc
    qd, qd_acc, rows_acc = B * S * H * D * it, B * S * H * D * acc, B * H * S * acc
    if strategy == "usp":
        u = engine.get("usp").degree(G, H, Hkv)
        r, hg, hk = G // u, H // u, (Hkv // u if Hkv % u == 0 else 1)
        q_c, kv_c, rows_c = B * S * hg * D, B * S * hk * D, B * hg * S
        if pass_ == "forward":
            return ({f"q, k, v all-to-all in groups of {u}": (q_c + 2 * kv_c) * it * (u - 1),
                     "out + lse fp32 back": (q_c * it + rows_c * acc) * (u - 1),
                     f"ring of {r} groups: k, v": 2 * u * kv_c * it * (r - 1 if sends is None else sends)},
                    "Ulysses inside groups, the burst ring across them (no published count)")
        bundles, dqs = (r - 1, r) if counts is None else counts[:2]
        ring_bwd = (bundles * (2 * u * q_c * it + 2 * u * rows_c * acc) + dqs * u * q_c * acc) if r > 1 else 0
        return ({f"q, dout, k, v + lse, delta all-to-all in groups of {u}":
                 ((2 * q_c + 2 * kv_c) * it + 2 * rows_c * acc) * (u - 1),
                 f"ring of {r} groups: q, dout, lse, delta, dq": ring_bwd,
                 "dq, dk, dv fp32 back": (q_c + 2 * kv_c) * acc * (u - 1)},
                "Ulysses inside groups, the burst ring across them (no published count)")
    if strategy == "ulysses":
        hg, hk = H // G, (Hkv // G if Hkv % G == 0 else 1)   # heads per peer chunk
        q_c, kv_c, rows_c = B * S * hg * D, B * S * hk * D, B * hg * S
        if pass_ == "forward":
            return ({"q, k, v all-to-all": (q_c + 2 * kv_c) * it * hops,
                     "out + lse fp32 all-to-all back": (q_c * it + rows_c * acc) * hops},
                    "the all-to-all volume, plus lse (fp32) with out")
        return ({"q, dout, k, v all-to-all": (2 * q_c + 2 * kv_c) * it * hops,
                 "lse, delta fp32 with them": 2 * rows_c * acc * hops,
                 "dq, dk, dv fp32 all-to-all back": (q_c + 2 * kv_c) * acc * hops},
                "delta is formed before the all-to-all, so out does not travel; gradients in fp32")
    if pass_ == "forward":
        if strategy == "burst" and sends is not None and sends != hops:
            return ({f"k, v ({sends} of G-1 hops)": 2 * kv * sends},
                    "a block stops once no rank it would reach needs it (causal, windows)")
        return {"k, v (G-1 hops)": 2 * kv * hops}, "matches the paper (x (G-1)/G per rank)"
    if strategy == "burst" and counts is not None and counts[:2] != (hops, G):
        bundles, dqs = counts[:2]
        return ({f"q, dout ({bundles} of G-1 bundle hops)": 2 * qd * bundles,
                 "lse, delta fp32 with them": 2 * rows_acc * bundles,
                 f"dq fp32 ({dqs} sends: riding behind, or straight home)": qd_acc * dqs},
                "a bundle goes only as far as the last rank that needs it (backwards under causal), "
                "its dq then straight home")
    if strategy == "burst":
        terms = {"q, dout (G-1 hops)": 2 * qd * hops, "lse, delta fp32 (G-1 hops)": 2 * rows_acc * hops,
                 "dq fp32 (G-1 hops)": qd_acc * hops, "dq return hop to owner": qd_acc}
        why = ("dq, lse, delta travel in the accumulation dtype (not the input dtype); dq makes one "
               "extra hop home; the paper's 2BNZ/G term is one step of lse+delta, summed here over G-1 steps")
        return terms, why
    if strategy == "ring":
        terms = {"k, v (G-1 hops)": 2 * kv * hops, "dk, dv fp32 (G-1 hops)": 2 * kv_acc * hops,
                 "dk, dv return hop to owner": 2 * kv_acc}
        why = ("the paper counts 6BZNd for Ring Attention; this baseline moves K, V, dK, dV "
               "(4 tensors per step, as the seeds describe), dK/dV in fp32, plus one hop home")
        return terms, why
    terms = {"all-gather k, v": 2 * kv * hops, "reduce-scatter dk, dv fp32": 2 * kv_acc * hops}
    return terms, "standard all-gather/reduce-scatter volume; dk, dv reduced in fp32"


def _options(strategy: str, size: int, inputs) -> dict:
    """usp: its default degree for these heads, made explicit (its formulas depend on it)."""
    if strategy != "usp":
        return {}
    q, k = inputs[0], inputs[1]
    return {"ulysses_degree": engine.get("usp").degree(size, q.shape[2], k.shape[2])}


def measure(group, strategy: str, inputs, causal: bool) -> dict:
    """Bytes and messages this rank sends in one forward and one backward pass."""
    q, k, v, dout = inputs
    how = dict(strategy=strategy, **_options(strategy, group.size, inputs))
    group.stats.reset()
    out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True, **how)
    fwd = group.stats.as_dict()
    group.stats.reset()
    burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal, **how)
    bwd = group.stats.as_dict()
    return {"forward": fwd, "backward": bwd}


def rows_for(strategy: str, measured: dict, size: int, inputs, rank: int = 0,
             causal: bool = False) -> list:
    q, k, v, _ = inputs
    B, S, H, D = q.shape
    Hkv = k.shape[2]
    it, acc = q.dtype.itemsize, accum_dtype(q.dtype).itemsize
    impl = engine.get(strategy, **_options(strategy, size, inputs))
    mask = dict(rank=rank, layout="contiguous", causal=causal)   # measure() runs contiguous
    formula = {"forward": (impl.forward_bytes(size, q, k, v, **mask),
                           impl.forward_messages(size, q, k, v, **mask)),
               "backward": (impl.backward_bytes(size, q, k, v, **mask),
                            impl.backward_messages(size, q, k, v, **mask))}
    rows = []
    for pass_ in ("forward", "backward"):
        dims = dict(G=size, B=B, S=S, H=H, Hkv=Hkv, D=D, it=it)
        msgs, sends, counts = formula["forward"][1], None, None
        if strategy == "burst":
            sends = msgs
            counts = burst_counts(size, S, **mask)
        elif strategy == "usp":
            u = impl.ulysses_degree
            sends = msgs - 2 * (u - 1)
            if size // u > 1:     # the burst ring across the groups, for my group's super-rank
                _, groups, i = impl.ring_of_groups(size, q, k, rank=rank, layout="contiguous")
                counts = backward_counts(i, size // u, 0, groups, causal)
        terms, why = explain(strategy, pass_, acc=acc, sends=sends, counts=counts, **dims)
        paper = paper_bytes(strategy, pass_, **dims)
        got = measured[pass_]
        rows.append({
            "strategy": strategy, "pass": pass_,
            "measured_bytes": got["bytes_sent"], "formula_bytes": formula[pass_][0],
            "match": got["bytes_sent"] == formula[pass_][0] and sum(terms.values()) == formula[pass_][0],
            "measured_messages": got["messages"], "formula_messages": formula[pass_][1],
            "paper_bytes": paper,
            "measured_over_paper": (got["bytes_sent"] / paper) if paper else None,
            "terms": terms, "why_different": why,
        })
    return rows


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_problem_args(p, seqlen=1024, dtype="float16")
    p.add_argument("--docs", action="store_true",
                   help="burst under a seeded document mix (cu_seqlens) against the mask's minimum")
    p.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                   help="burst under a sliding window against the mask's minimum (-1: unbounded)")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"],
                   help="with --docs / --window (the formulas above are for contiguous)")
    p.add_argument("--doc-seed", type=int, default=0)
    p.add_argument("--doc-median", type=float, default=64, help="median document length")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# masks: burst's bytes against the minimum the mask allows


def sees(qpos, kpos, docs, causal: bool, window) -> np.ndarray:
    """Dense (len(qpos), len(kpos)) test: does the query at qpos[i] attend to the key at kpos[j]?
    Same document (docs: boundaries, or None), key <= query under causal, key in
    [query - left, query + right] (-1: unbounded; under causal the right bound is the diagonal)."""
    qp, kp = np.asarray(qpos, np.int64)[:, None], np.asarray(kpos, np.int64)[None, :]
    ok = np.ones((qp.shape[0], kp.shape[1]), bool)
    if docs is not None:
        bounds = np.asarray(docs, np.int64)
        ok &= (np.searchsorted(bounds, qp, side="right") == np.searchsorted(bounds, kp, side="right"))
    left, right = window
    if causal:
        ok &= kp <= qp
    elif right >= 0:
        ok &= kp <= qp + right
    if left >= 0:
        ok &= kp >= qp - left
    return ok


def row_bytes(args) -> dict:
    """Bytes of one sequence row of each payload (B rows of every head)."""
    it = np.dtype(args.dtype if args.dtype != "bfloat16" else "float16").itemsize
    acc = 8 if args.dtype == "float64" else 4
    b, h, hkv, d = args.batch, args.heads, args.kv_heads or args.heads, args.headdim
    return {"kv": 2 * b * hkv * d * it, "bundle": b * h * (2 * d * it + 2 * acc), "dq": b * h * d * acc}


def minimum_bytes(part, docs, causal: bool, window, rb: dict) -> list:
    """Per owner rank: the minimum and full-ring bytes of its blocks (module docstring)."""
    size, n = part.size, part.total
    pos = [part.positions(r) for r in range(size)]
    rows = part.lengths
    out = []
    for j in range(size):
        fwd_blocks = fwd_rows = bwd_blocks = bwd_rows = 0
        for r in range(size):
            if r == j:
                continue
            kv_needed = sees(pos[r], pos[j], docs, causal, window).any(axis=0)  # j's keys r sees
            fwd_blocks += rows[j] * kv_needed.any()
            fwd_rows += int(kv_needed.sum())
            q_needed = sees(pos[j], pos[r], docs, causal, window).any(axis=1)   # j's queries r serves
            bwd_blocks += rows[j] * q_needed.any()
            bwd_rows += int(q_needed.sum())
        per_q = rb["bundle"] + rb["dq"]
        # the full ring holds every block but one at steps 0 .. G-2: K/V blocks come from the
        # previous rank; bundles from the next one under causal (they go backwards), else the
        # previous; every dQ is sent once (on, or home)
        kv_rows = n - rows[(j + 1) % size]
        bundle_rows = n - rows[(j - 1) % size] if causal else kv_rows
        out.append({"forward": {"min_blocks": int(fwd_blocks) * rb["kv"], "min_rows": fwd_rows * rb["kv"],
                                "full_ring": kv_rows * rb["kv"]},
                    "backward": {"min_blocks": int(bwd_blocks) * per_q, "min_rows": bwd_rows * per_q,
                                 "full_ring": bundle_rows * rb["bundle"] + n * rb["dq"]}})
    return out


def measure_masked(group, args, docs, window, part) -> dict:
    """Bytes and messages this rank sends under the mask, beside burst's formula for it."""
    rng = np.random.default_rng([args.doc_seed, group.rank])
    rows, hkv = part.lengths[group.rank], args.kv_heads or args.heads
    dt = C.array_dtype(args.dtype)
    q, dout = (rng.standard_normal((args.batch, rows, args.heads, args.headdim), dtype=np.float32).astype(dt)
               for _ in range(2))
    k, v = (rng.standard_normal((args.batch, rows, hkv, args.headdim), dtype=np.float32).astype(dt)
            for _ in range(2))
    how = dict(causal=args.causal, layout=args.layout, window_size=tuple(window),
               cu_seqlens=None if docs is None else np.asarray(docs))
    group.stats.reset()
    out, lse = burstcu.attention(q, k, v, group, return_lse=True, **how)
    fwd = group.stats.as_dict()
    group.stats.reset()
    burstcu.attention_backward(dout, q, k, v, out, lse, group, **how)
    bwd = group.stats.as_dict()
    mask = dict(rank=group.rank, layout=part, causal=args.causal, window_size=window,
                cu_seqlens=docs)
    return {"rank": group.rank, "rows": rows,
            "forward": {"achieved": fwd["bytes_sent"], "messages": fwd["messages"],
                        "formula": burst.forward_bytes(group.size, q, k, v, **mask)},
            "backward": {"achieved": bwd["bytes_sent"], "messages": bwd["messages"],
                         "formula": burst.backward_bytes(group.size, q, k, v, **mask)}}


def masked_main(args, group):
    """--docs / --window: burst's achieved bytes per rank against the mask's minimum."""
    window = tuple(args.window) if args.window else (-1, -1)
    docs = C.document_mix(args.seqlen, args.doc_seed, args.doc_median) if args.docs else None
    part = partition(args.layout, group.size, args.seqlen, docs if args.layout == "zigzag" else None)
    C.progress(f"volume: burst under the mask ({args.layout}, causal={args.causal}, window={window}, "
               f"{'no documents' if docs is None else f'{len(docs) - 1} documents'})", group.rank)
    mine = measure_masked(group, args, docs, window, part)
    ranks = group.transport.allgather_object(mine, "bench volume masks")
    env = C.environment_on_rank0(group)
    if env is None:
        return None
    for got, least in zip(ranks, minimum_bytes(part, docs, args.causal, window, row_bytes(args))):
        for pass_ in ("forward", "backward"):
            got[pass_].update(least[pass_])
    totals = {p: {k: sum(r[p][k] for r in ranks) for k in ("achieved", "formula", "min_blocks",
                                                           "min_rows", "full_ring")}
              for p in ("forward", "backward")}
    result = {"benchmark": "volume", "mode": "mask", "environment": env, "args": vars(args),
              "mask": {"causal": args.causal, "window": list(window), "layout": args.layout,
                       "cu_seqlens": None if docs is None else list(docs)},
              "ranks": ranks, "totals": totals,
              "formula_matches": all(r[p]["achieved"] == r[p]["formula"] for r in ranks
                                     for p in ("forward", "backward")),
              "at_least_minimum": all(t["achieved"] >= t["min_blocks"] >= t["min_rows"]
                                      for t in totals.values())}
    print_masked(result, args, group.size, docs)
    return C.finish(result, args.json)


def print_masked(result: dict, args, size: int, docs) -> None:
    print(C.measured_on(result["environment"]).splitlines()[0])
    what = "no documents" if docs is None else f"{len(docs) - 1} documents (seed {args.doc_seed})"
    print(f"# burst, bytes SENT per rank per pass under the mask: G={size} N={args.seqlen} "
          f"B={args.batch} H={args.heads} Hkv={args.kv_heads or args.heads} D={args.headdim} "
          f"dtype={args.dtype} layout={args.layout} causal={args.causal} "
          f"window={tuple(result['mask']['window'])}, {what}")
    show = []
    for r in result["ranks"] + [dict(rank="total", **result["totals"])]:
        for pass_ in ("forward", "backward"):
            x = r[pass_]
            show.append({"rank": r["rank"], "pass": pass_, "achieved": C.fmt_bytes(x["achieved"]),
                         "formula": C.fmt_bytes(x["formula"]), "min_blocks": C.fmt_bytes(x["min_blocks"]),
                         "min_rows": C.fmt_bytes(x["min_rows"]), "full_ring": C.fmt_bytes(x["full_ring"]),
                         "achieved/min_blocks": x["achieved"] / x["min_blocks"] if x["min_blocks"] else None,
                         "achieved/full_ring": x["achieved"] / x["full_ring"] if x["full_ring"] else None})
    print(C.table(show, list(show[0])))
    print("# achieved: group.stats (measured); formula: burst's for this mask; min_*: counted from "
          "the partition and a dense mask test, charged to the block's owner (a ring relays, so "
          "compare totals); full_ring: every block G-1 hops")
    print(f"# achieved == formula on every rank: {result['formula_matches']}; total achieved >= "
          f"min_blocks >= min_rows: {result['at_least_minimum']}")


def main(argv=None):
    args = parse(argv)
    group = burstcu.init(backend="numpy")
    if args.docs or args.window:
        return masked_main(args, group)
    inputs = C.make_local_inputs(group.rank, group.size, batch=args.batch, seqlen=args.seqlen,
                                 heads=args.heads, kv_heads=args.kv_heads or args.heads,
                                 headdim=args.headdim, dtype=args.dtype)
    rows = []
    for strategy in args.strategies:
        problem = getattr(engine.get(strategy), "input_problem", lambda *a: None)(
            inputs[0].shape, inputs[1].shape, group.size)
        if problem:
            C.progress(f"volume: {strategy} skipped: {problem}", group.rank)
            continue
        C.progress(f"volume: {strategy}", group.rank)
        rows += rows_for(strategy, measure(group, strategy, inputs, args.causal), group.size, inputs,
                         group.rank, args.causal)
    per_rank = group.comm.gather(rows, root=0) if group.comm is not None and group.size > 1 else [rows]
    env = C.environment_on_rank0(group, print_header=True)
    if env is None:
        return None
    print(f"# bytes SENT per rank per pass; G={group.size} N={args.seqlen} B={args.batch} "
          f"H={args.heads} Hkv={args.kv_heads or args.heads} D={args.headdim} dtype={args.dtype}")
    show = [dict(r, measured=C.fmt_bytes(r["measured_bytes"]), formula=C.fmt_bytes(r["formula_bytes"]),
                 paper=C.fmt_bytes(r["paper_bytes"]), msgs=f"{r['measured_messages']}/{r['formula_messages']}")
            for r in per_rank[0]]
    print(C.table(show, ["strategy", "pass", "measured", "formula", "match", "msgs", "paper",
                         "measured_over_paper"]))
    for r in per_rank[0]:
        terms = ", ".join(f"{k} {C.fmt_bytes(v)}" for k, v in r["terms"].items())
        print(f"  {r['strategy']:9s} {r['pass']:8s} = {terms or '0'}\n{'':22s}vs paper: {r['why_different']}")
    all_match = all(r["match"] and r["measured_messages"] == r["formula_messages"]
                    for rows_ in per_rank for r in rows_)
    print(f"# every rank's measured bytes and messages equal the formulas: {all_match}")
    result = {"benchmark": "volume", "environment": env, "args": vars(args), "all_match": all_match,
              "ranks": [{"rank": i, "rows": rows_} for i, rows_ in enumerate(per_rank)]}
    return C.finish(result, args.json)


if __name__ == "__main__":
    main()
