"""Communication volume per rank, per pass and strategy: the bytes and messages each rank sends
(`group.stats`), against the implementation's exact formula and the paper's element counts
converted to per-rank bytes, with the difference explained term by term (bench/README.md has
the derivation). (Its --docs / --window mode, burst's bytes against the mask's minimum, was
retired at this commit; bench/results/volume_docs_4ranks_* keeps its tables.)

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


def measure(group, inputs, **how) -> dict:
    """{pass: bytes and messages this rank sends} of one forward and one backward pass."""
    q, k, v, dout = inputs
    group.stats.reset()
    saved = burstcu.attention(q, k, v, group, return_lse=True, **how)
    fwd = group.stats.as_dict()
    group.stats.reset()
    burstcu.attention_backward(dout, q, k, v, *saved, group, **how)
    return {"forward": fwd, "backward": group.stats.as_dict()}


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
            counts = backward_counts(rank, size, S, "contiguous", causal)
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
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    group = burstcu.init(backend="numpy")
    inputs = C.local_inputs(group, args)
    rows = []
    for strategy in args.strategies:
        problem = getattr(engine.get(strategy), "input_problem", lambda *a: None)(
            inputs[0].shape, inputs[1].shape, group.size)
        if problem:
            C.progress(f"volume: {strategy} skipped: {problem}", group.rank)
            continue
        C.progress(f"volume: {strategy}", group.rank)
        rows += rows_for(strategy, measure(group, inputs, causal=args.causal, strategy=strategy,
                                 **_options(strategy, group.size, inputs)), group.size, inputs,
                         group.rank, args.causal)
    per_rank = C.gather(group, rows)
    env = C.environment_on_rank0(group, print_header=True)
    if env is None:
        return None
    print(f"# bytes SENT per rank per pass; G={group.size} N={args.seqlen} B={args.batch} "
          f"H={args.heads} Hkv={args.kv_heads or args.heads} D={args.headdim} dtype={args.dtype}")
    show = [dict(r, measured=C.fmt_bytes(r["measured_bytes"]), formula=C.fmt_bytes(r["formula_bytes"]),
                 paper=C.fmt_bytes(r["paper_bytes"]),
                 msgs=f"{r['measured_messages']}/{r['formula_messages']}")
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
    return C.emit(None, result, args)


if __name__ == "__main__":
    main()
