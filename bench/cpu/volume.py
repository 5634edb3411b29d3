"""Bytes and messages each rank sends per pass and strategy (`group.stats`) against the exact
formulas and the paper's counts, the difference explained term by term (bench/README.md).

    mpiexec -n G python bench/cpu/volume.py [--seqlen N] [--heads H] [--kv-heads Hkv] [--dtype float16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu import engine  # noqa: E402
from burstcu.engine.burst import backward_counts  # noqa: E402
from burstcu.ops.base import accum_dtype  # noqa: E402


def explain(strategy: str, pass_: str, *, G, B, S, H, Hkv, D, it, acc, sends=None,
            counts=None) -> tuple[dict, str, int]:
    """(terms, why, paper): the bytes this rank sends as named terms, why they differ from the
    paper's count, and that count as one rank's bytes (None without one: usp), at input itemsize `it`,
    H heads query-side and Hkv K/V-side. sends: the forward hops this rank sends K, V on (burst;
    usp: its ring of groups); counts: the backward's (bundles, dqs, messages) it sends (the same);
    fewer than G-1 and (G-1, G, G+1) where a mask ends a block's or a bundle's trip early."""
    a = "fp32" if acc == 4 else "fp64"   # the accumulation dtype, what dq, dk, dv, lse travel in
    if G == 1:
        return {}, "one rank: nothing moves", 0
    hops = G - 1
    kv, kv_acc = B * S * Hkv * D * it, B * S * Hkv * D * acc
    qd, qd_acc, rows_acc = B * S * H * D * it, B * S * H * D * acc, B * H * S * acc
    if strategy in ("usp", "ulysses"):   # per-peer chunks of the all-to-alls, in groups of u
        u = engine.get("usp").degree(G, H, Hkv) if strategy == "usp" else G
        r, hg, hk = G // u, H // u, (Hkv // u if Hkv % u == 0 else 1)
        q_c, kv_c, rows_c = B * S * hg * D, B * S * hk * D, B * hg * S
    if strategy == "usp":
        why = "Ulysses inside groups, the burst ring across them (no published count)"
        if pass_ == "forward":
            return ({f"q, k, v all-to-all in groups of {u}": (q_c + 2 * kv_c) * it * (u - 1),
                     f"out + lse {a} back": (q_c * it + rows_c * acc) * (u - 1),
                     f"ring of {r} groups: k, v": 2 * u * kv_c * it * (r - 1 if sends is None else sends)},
                    why, None)
        bundles, dqs = (r - 1, r) if counts is None else counts[:2]
        ring_bwd = (bundles * (2 * u * q_c * it + 2 * u * rows_c * acc) + dqs * u * q_c * acc) if r > 1 else 0
        return ({f"q, dout, k, v + lse, delta all-to-all in groups of {u}":
                 ((2 * q_c + 2 * kv_c) * it + 2 * rows_c * acc) * (u - 1),
                 f"ring of {r} groups: q, dout, lse, delta, dq": ring_bwd,
                 f"dq, dk, dv {a} back": (q_c + 2 * kv_c) * acc * (u - 1)}, why, None)
    # the paper's ulysses: query-side tensors (G-1)/G of H heads, K/V-side ones Hk heads to each peer
    if strategy == "ulysses" and pass_ == "forward":
        return ({"q, k, v all-to-all": (q_c + 2 * kv_c) * it * hops,
                 f"out + lse {a} all-to-all back": (q_c * it + rows_c * acc) * hops},
                f"the all-to-all volume, plus lse ({a}) with out", (2 * q_c + 2 * kv_c) * it * hops)
    if strategy == "ulysses":
        return ({"q, dout, k, v all-to-all": (2 * q_c + 2 * kv_c) * it * hops,
                 f"lse, delta {a} with them": 2 * rows_c * acc * hops,
                 f"dq, dk, dv {a} all-to-all back": (q_c + 2 * kv_c) * acc * hops},
                f"delta is formed before the all-to-all, so out does not travel; gradients in {a}",
                (3 * q_c + 4 * kv_c) * it * hops)
    if pass_ == "forward" and strategy == "burst" and sends is not None and sends != hops:
        return ({f"k, v ({sends} of G-1 hops)": 2 * kv * sends},
                "a block stops once no rank it would reach needs it (causal, windows)", 2 * kv * hops)
    if pass_ == "forward":
        return {"k, v (G-1 hops)": 2 * kv * hops}, "matches the paper (x (G-1)/G per rank)", 2 * kv * hops
    burst_paper = (3 * qd + 2 * B * H * S * it) * hops
    if strategy == "burst" and counts is not None and counts[:2] != (hops, G):
        bundles, dqs = counts[:2]
        return ({f"q, dout ({bundles} of G-1 bundle hops)": 2 * qd * bundles,
                 f"lse, delta {a} with them": 2 * rows_acc * bundles,
                 f"dq {a} ({dqs} sends: riding behind, or straight home)": qd_acc * dqs},
                "a bundle goes only as far as the last rank that needs it (backwards under causal), "
                "its dq then straight home", burst_paper)
    if strategy == "burst":
        return ({"q, dout (G-1 hops)": 2 * qd * hops, f"lse, delta {a} (G-1 hops)": 2 * rows_acc * hops,
                 f"dq {a} (G-1 hops)": qd_acc * hops, "dq return hop to owner": qd_acc},
                "dq, lse, delta travel in the accumulation dtype (not the input dtype); dq makes one "
                "extra hop home; the paper's 2BNZ/G term is one step of lse+delta, summed here over G-1 "
                "steps", burst_paper)
    if strategy == "ring":
        return ({"k, v (G-1 hops)": 2 * kv * hops, f"dk, dv {a} (G-1 hops)": 2 * kv_acc * hops,
                 "dk, dv return hop to owner": 2 * kv_acc},
                "the paper counts 6BZNd for Ring Attention; this baseline moves K, V, dK, dV "
                f"(4 tensors per step, as the seeds describe), dK/dV in {a}, plus one hop home",
                6 * kv * hops)
    return ({"all-gather k, v": 2 * kv * hops, f"reduce-scatter dk, dv {a}": 2 * kv_acc * hops},
            f"standard all-gather/reduce-scatter volume; dk, dv reduced in {a}", 4 * kv * hops)


def rows_for(group, strategy: str, inputs, causal: bool) -> list:
    """One forward and one backward pass of `strategy` on this rank's (q, k, v, dout): a row a
    pass of the bytes and messages it sent (`group.stats`) beside the formulas and the terms."""
    q, k, v, dout = inputs
    B, S, H, D = q.shape
    G, rank, Hkv = group.size, group.rank, k.shape[2]
    # usp: its default degree for these heads, made explicit (its formulas depend on it)
    options = {"ulysses_degree": engine.get("usp").degree(G, H, Hkv)} if strategy == "usp" else {}
    how, impl = dict(causal=causal, strategy=strategy, **options), engine.get(strategy, **options)
    group.stats.reset()
    saved = burstcu.attention(q, k, v, group, return_lse=True, **how)
    measured = {"forward": group.stats.as_dict()}
    group.stats.reset()
    burstcu.attention_backward(dout, q, k, v, *saved, group, **how)
    measured["backward"] = group.stats.as_dict()
    mask = dict(rank=rank, layout="contiguous", causal=causal)   # the passes above ran contiguous
    formula = {p: (getattr(impl, f"{p}_bytes")(G, q, k, v, **mask),
                   getattr(impl, f"{p}_messages")(G, q, k, v, **mask)) for p in ("forward", "backward")}
    sends = counts = None
    if strategy == "burst":
        sends, counts = formula["forward"][1], backward_counts(rank, G, S, "contiguous", causal)
    elif strategy == "usp":
        sends = formula["forward"][1] - 2 * (impl.ulysses_degree - 1)
        if G // impl.ulysses_degree > 1:     # the burst ring across the groups, for my group's super-rank
            _, groups, i = impl.ring_of_groups(G, q, k, rank=rank, layout="contiguous")
            counts = backward_counts(i, G // impl.ulysses_degree, 0, groups, causal)
    dims = dict(G=G, B=B, S=S, H=H, Hkv=Hkv, D=D, it=q.dtype.itemsize, acc=accum_dtype(q.dtype).itemsize)
    rows = []
    for pass_, (bytes_, messages) in formula.items():
        terms, why, paper = explain(strategy, pass_, sends=sends, counts=counts, **dims)
        sent = measured[pass_]["bytes_sent"]
        rows.append({"strategy": strategy, "pass": pass_, "measured_bytes": sent, "formula_bytes": bytes_,
                     "match": sent == bytes_ and sum(terms.values()) == bytes_,
                     "measured_messages": measured[pass_]["messages"], "formula_messages": messages,
                     "paper_bytes": paper, "measured_over_paper": sent / paper if paper else None,
                     "terms": terms, "why_different": why})
    return rows


def over_ranks(per_rank: list) -> list:
    """Per (strategy, pass), from every rank's rows (`rows_for`, in rank order): the bytes each
    rank sent, their mean, the paper's per-rank count and mean / paper (None without a count)."""
    out = []
    for i, first in enumerate(per_rank[0]):
        sent = [rows_[i]["measured_bytes"] for rows_ in per_rank]
        mean, paper = sum(sent) / len(sent), first["paper_bytes"]
        out.append({"strategy": first["strategy"], "pass": first["pass"],
                    "measured_bytes_per_rank": sent, "measured_bytes_mean": mean, "paper_bytes": paper,
                    "mean_over_paper": mean / paper if paper else None})
    return out


def report(per_rank: list) -> str:
    """The text rank 0 prints: a row per rank, strategy and pass (its bytes over the paper's
    per-rank count: `measured_over_paper`, this rank's); the mean over ranks against the paper; the
    terms of each row, ranks whose terms are alike together."""
    order = {(r["strategy"], r["pass"]): i for i, r in enumerate(per_rank[0])}   # as they ran
    rows = sorted((dict(r, rank=rank) for rank, rows_ in enumerate(per_rank) for r in rows_),
                  key=lambda r: (order[r["strategy"], r["pass"]], r["rank"]))
    show = [dict(r, measured=C.fmt_bytes(r["measured_bytes"]), formula=C.fmt_bytes(r["formula_bytes"]),
                 paper="-" if r["paper_bytes"] is None else C.fmt_bytes(r["paper_bytes"]),  # usp: none
                 msgs=f"{r['measured_messages']}/{r['formula_messages']}",
                 **{"this rank/paper": r["measured_over_paper"]}) for r in rows]
    lines = [C.table(show, ["strategy", "pass", "rank", "measured", "formula", "match", "msgs", "paper",
                            "this rank/paper"]),
             "# over ranks: the mean of every rank's bytes against the paper's per-rank count"]
    means = [dict(m, mean=C.fmt_bytes(m["measured_bytes_mean"]),
                  paper="-" if m["paper_bytes"] is None else C.fmt_bytes(m["paper_bytes"]),
                  per_rank=" ".join(C.fmt_bytes(b) for b in m["measured_bytes_per_rank"]),
                  **{"mean/paper": m["mean_over_paper"]}) for m in over_ranks(per_rank)]
    lines.append(C.table(means, ["strategy", "pass", "mean", "paper", "mean/paper", "per_rank"]))
    alike: dict = {}
    for r in rows:
        key = (r["strategy"], r["pass"], tuple(r["terms"].items()), r["why_different"])
        alike.setdefault(key, []).append(r)
    for (strategy, pass_, terms, why), same in alike.items():
        text = ", ".join(f"{k} {C.fmt_bytes(v)}" for k, v in terms) or "0"
        ranks = "every rank" if len(same) == len(per_rank) else f"rank(s) {[r['rank'] for r in same]}"
        lines.append(f"  {strategy:9s} {pass_:8s} {ranks}: {text}\n{'':22s}vs paper: {why}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_problem_args(p, seqlen=1024, dtype="float16")
    p.set_defaults(strategies=list(engine.NAMES))   # all five
    args = p.parse_args(argv)
    group = burstcu.init(backend="numpy")
    inputs = C.local_inputs(group, args)
    rows = []
    for strategy in args.strategies:
        problem = getattr(engine.get(strategy), "input_problem", lambda *a: None)(
            inputs[0].shape, inputs[1].shape, group.size)
        C.progress(f"volume: {strategy}" + (f" skipped: {problem}" if problem else ""), group.rank)
        rows += [] if problem else rows_for(group, strategy, inputs, args.causal)
    per_rank = C.gather(group, rows)
    env = C.environment_on_rank0(group, print_header=True)
    if env is None:
        return None
    print(f"# bytes SENT by each rank per pass (every rank's row: under a causal contiguous layout ranks "
          f"send different amounts); G={group.size} N={args.seqlen} B={args.batch} H={args.heads} "
          f"Hkv={args.kv_heads or args.heads} D={args.headdim} dtype={args.dtype}")
    print(report(per_rank))
    all_match = all(r["match"] and r["measured_messages"] == r["formula_messages"]
                    for rows_ in per_rank for r in rows_)
    print(f"# every rank's measured bytes and messages equal the formulas: {all_match}")
    return C.emit(None, {"benchmark": "volume", "environment": env, "args": vars(args),
                         "all_match": all_match,
                         "ranks": [{"rank": i, "rows": rows_} for i, rows_ in enumerate(per_rank)],
                         "over_ranks": over_ranks(per_rank)}, args)


if __name__ == "__main__":
    main()
