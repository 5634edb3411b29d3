"""Randomized problems (hypothesis) against the float64 reference: shapes, GQA ratios, head dims,
layouts, causal or not, float64/float32, NumPy tile sizes and thread counts, 1-4 ranks (the real
engine on the loopback transport: ranks as threads, so each example costs milliseconds), every
rank's out, lse and gradients, and its bytes. Then 320 problems drawn across every strategy and
every kind of mask at once (windows, documents with and without a window, block masks, uneven
shards, each layout), against a dense mask spelled out in the tests; and 12 of them, in float16
and bfloat16, on the CUDA kernels under the CPU emulator (sm_80's and sm_90a's tables)."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import burstcu  # noqa: E402
from burstcu.engine import burst  # noqa: E402
from burstcu.ops.base import as_dtype, finfo  # noqa: E402
from burstcu.testing.world import run_ranks  # noqa: E402
from burstcu.testing.reference import (attention_backward_ref, attention_ref, max_err,  # noqa: E402
                                       within_fa_rule)



@st.composite
def problems(draw):
    ranks = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(["contiguous", "zigzag"]))
    per_rank = draw(st.integers(1, 12)) * (2 if layout == "zigzag" else 1)
    hkv = draw(st.integers(1, 3))
    return {"ranks": ranks, "layout": layout, "n": per_rank * ranks, "hkv": hkv,
            "h": hkv * draw(st.sampled_from([1, 2, 4])), "d": draw(st.sampled_from([1, 8, 13, 32])),
            "b": draw(st.integers(1, 2)), "causal": draw(st.booleans()),
            "scale": draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
            "dtype": draw(st.sampled_from(["float64", "float32"])),
            # small tiles reach the multi-tile, diagonal-split and multi-item paths at these sizes
            "tiles": draw(st.sampled_from([(4, 4), (8, 16), (16, 8), (512, 512)])),
            "threads": draw(st.integers(1, 3)),
            "seed": draw(st.integers(0, 2**31 - 1))}


@settings(max_examples=200, deadline=None, derandomize=True)
@given(problems())
def test_random_problems_match_the_reference(p):
    rng = np.random.default_rng(p["seed"])
    dt = np.dtype(p["dtype"])
    q, dout = (rng.standard_normal((p["b"], p["n"], p["h"], p["d"])).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((p["b"], p["n"], p["hkv"], p["d"])).astype(dt) for _ in range(2))
    kw = dict(causal=p["causal"], layout=p["layout"], softmax_scale=p["scale"])

    def body(group):
        local = [burstcu.shard(x, group, p["layout"]) for x in (q, k, v, dout)]
        group.stats.reset()
        out, lse = burstcu.attention(*local[:3], group, return_lse=True, **kw)
        sent = group.stats.bytes_sent
        grads = burstcu.attention_backward(local[3], *local[:3], out, lse, group, **kw)
        mask = dict(rank=group.rank, layout=p["layout"], causal=p["causal"])
        assert sent == burst.forward_bytes(group.size, *local[:3], **mask)
        assert group.stats.bytes_sent - sent == burst.backward_bytes(group.size, *local[:3], **mask)
        return [burstcu.unshard(x, group, p["layout"]) for x in (out, *grads)], \
            burstcu.unshard(lse, group, p["layout"], axis=2)

    results = run_ranks(p["ranks"], body, tile_q=p["tiles"][0], tile_k=p["tiles"][1],
                        threads=p["threads"])
    exact = np.longdouble if dt == np.float64 else np.float64
    eps = float(np.finfo(dt).eps)
    truth = [*attention_ref(q, k, v, p["causal"], p["scale"], dtype=exact),
             *attention_backward_ref(dout, q, k, v, p["causal"], p["scale"], dtype=exact)]
    naive = [*attention_ref(q, k, v, p["causal"], p["scale"], dtype=dt.type),
             *attention_backward_ref(dout, q, k, v, p["causal"], p["scale"], dtype=dt.type)]
    # FlashAttention's rule. Its rounding term is eps * max|ref|; for gradients it is taken at
    # the magnitude of the terms they sum instead (|dS| <= |dP| + |delta| <= 2 d max|dout| max|v|,
    # times max|q or k| and the scale): tiny problems make gradients that cancel to ~0 (a row
    # that sees one key has dS = dP - delta = 0), and the backward computes dP and delta in
    # different orders. Logic errors are orders of magnitude above either term.
    scale = p["scale"] if p["scale"] is not None else 1 / np.sqrt(p["d"])
    terms = 2 * p["d"] * float(np.abs(dout).max() * np.abs(v).max() * max(np.abs(q).max(), np.abs(k).max())) * scale
    for rank, ((out, dq, dk, dv), lse) in enumerate(results):
        for name, got, want, plain in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                                          truth, naive):
            ok, err, bound = within_fa_rule(got, want, plain, eps)
            if name in ("dq", "dk", "dv"):
                bound = 3.0 * max_err(plain, want) + 8 * eps * terms
                ok = err <= bound
            assert ok, f"rank {rank} {name} {p}: {err:.3e} > {bound:.3e}"


# ------------------------------------------------------------------------------------------------
# every strategy under every kind of mask

MASKS = ("none", "causal", "window", "documents", "documents and window", "block mask")
KINDS = ("full", "causal", "inverse_causal", "bidir_causal")


def masked_problem(seed: int, kernels: bool = False) -> dict:
    """A problem drawn uniformly from `seed`: a strategy (ulysses and usp with heads their degree
    divides), a mask (causal, a window, documents of random lengths with or without a window, or
    a block mask of disjoint rectangles of random kinds over random cuts of both axes), a layout
    (contiguous, zigzag, documents; or contiguous shards of random positive lengths), GQA, 1-4
    ranks. (hypothesis's draws lean to the smallest choices: one rank, the first mask.) kernels:
    the CUDA kernels' dtypes and head dims (float16, bfloat16; 32, and 64, which the Hopper
    kernels take natively), else NumPy's (float64, float32; 3 and 8)."""
    rng = np.random.default_rng([7 + kernels, seed])
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    ranks = int(rng.integers(1, 5))
    strategy = pick(["burst", "ring", "allgather", "ulysses", "usp", "auto"])
    degree = pick([u for u in range(1, ranks + 1) if ranks % u == 0])
    split = {"ulysses": ranks, "usp": degree}.get(strategy, 1)     # ranks the heads are split over
    hkv = pick([x for x in (1, 2, 3, 4, 6, 8) if x % split == 0 or split % x == 0])
    h = hkv * pick([g for g in (1, 2, 4) if (hkv * g) % split == 0] or [split])
    n = int(rng.integers(2 * ranks, 12 * ranks + 1))
    mask = pick(MASKS)
    p = {"ranks": ranks, "strategy": strategy, "degree": degree, "h": h, "hkv": hkv, "n": n,
         "d": pick([32, 64] if kernels else [3, 8]), "b": int(rng.integers(1, 3)), "mask": mask,
         "dtype": pick(["float16", "bfloat16"] if kernels else ["float64", "float32"]),
         "causal": False, "window": (-1, -1), "docs": None, "rects": None, "layout": "contiguous",
         "lengths": None, "seed": seed}
    if mask in ("causal", "window", "documents", "documents and window"):
        p["causal"] = mask == "causal" or bool(rng.integers(2))
    if "window" in mask:
        left = pick([-1, 0, 1, 2, 5, 11])
        right = 0 if p["causal"] else pick([-1, 0, 1, 3, 9])
        p["window"] = (3 if left == right == -1 else left, right)
    if "documents" in mask:
        bounds = [0]
        while bounds[-1] < n:
            bounds.append(min(n, bounds[-1] + int(rng.integers(1, max(1, n // 2) + 1))))
        p["docs"] = bounds
        p["layout"] = pick(["contiguous", "zigzag", "documents"])
    elif mask == "block mask":
        cuts = [sorted({0, n, *(int(c) for c in rng.integers(1, n, size=rng.integers(0, 4)))})
                for _ in "qk"]
        cells = [(a, b, c, e) for a, b in zip(cuts[0], cuts[0][1:]) for c, e in zip(cuts[1], cuts[1][1:])]
        chosen = [cell for cell in cells if rng.random() < 0.5] or [pick(cells)]
        p["rects"] = [(*cell, pick(KINDS)) for cell in chosen]
        p["layout"] = pick(["contiguous", "zigzag"])
    elif rng.random() < 0.4:
        p["layout"] = "zigzag"
    elif ranks > 1 and rng.random() < 0.5:
        cuts = sorted(int(c) for c in rng.choice(np.arange(1, n), size=ranks - 1, replace=False))
        p["lengths"] = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    return p


@pytest.mark.parametrize("chunk", range(8))
def test_every_strategy_under_random_masks_matches_the_reference(chunk):
    """40 problems a chunk (`masked_problem`, seeds 40 chunk ...): each rank's out, lse, dq, dk,
    dv against float64 (long double for float64) over a dense mask spelled out in
    tests/mpi/bodies.py (`dense_keep`), as `check_masked_problem` asks; the ranks' rows (found by
    sharding the positions) cover the sequence once."""
    for seed in range(40 * chunk, 40 * chunk + 40):
        check_masked_problem(masked_problem(seed))


@pytest.mark.emulated
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_kernels_under_random_masks_match_the_reference(arch):
    """12 problems (`masked_problem(seed, kernels=True)`) on the CUDA kernels run by the CPU
    emulator, each tile table's (sm_90a: the Hopper kernels where the head dim is 64)."""
    for seed in range(12):
        check_masked_problem(masked_problem(seed, kernels=True), backend="emulated", arch=arch)


def check_masked_problem(p: dict, **world) -> None:
    """`p` on `run_ranks(p["ranks"], ..., **world)` against the float64 reference (long double
    for float64): out and lse within FlashAttention's rule, gradients within the MPI tests' (3 x
    the naive error)."""
    from tests.mpi.bodies import block_mask_of, dense_keep

    rng = np.random.default_rng(p["seed"])
    dt = np.dtype(as_dtype(p["dtype"]))
    b, n, h, hkv, d = p["b"], p["n"], p["h"], p["hkv"], p["d"]
    q, dout = (rng.standard_normal((b, n, h, d)).astype(dt) for _ in range(2))
    k, v = (rng.standard_normal((b, n, hkv, d)).astype(dt) for _ in range(2))
    kw = {"strategy": p["strategy"], **({"ulysses_degree": p["degree"]} if p["strategy"] == "usp" else {})}
    if p["rects"] is None:
        kw.update(causal=p["causal"], window_size=p["window"])
    else:
        kw["block_mask"] = block_mask_of(p["rects"])
    positions = np.arange(n, dtype=np.float64)[None, :, None, None]

    def body(group):
        sh = burstcu.Sharding(group, layout=p["layout"], cu_seqlens=p["docs"], lengths=p["lengths"])
        ql, kl, vl, dl = (sh.shard(x) for x in (q, k, v, dout))
        out, lse = burstcu.attention(ql, kl, vl, sh, return_lse=True, **kw)
        grads = burstcu.attention_backward(dl, ql, kl, vl, out, lse, sh, **kw)
        return sh.shard(positions)[0, :, 0, 0].astype(int), out, lse, grads

    results = run_ranks(p["ranks"], body, **world)
    every = np.sort(np.concatenate([rows for rows, *_ in results]))
    assert np.array_equal(every, np.arange(n)), every
    keep = dense_keep(np.arange(n), np.arange(n), p["causal"], p["window"], p["docs"], p["rects"])
    exact = np.longdouble if dt == np.float64 else np.float64
    truth = [*attention_ref(q, k, v, keep=keep, dtype=exact),
             *attention_backward_ref(dout, q, k, v, keep=keep, dtype=exact)]
    # the naive same-dtype implementation: float16/bfloat16 computed in float32 with P and dS
    # rounded to the input dtype, as the kernels round them
    naive_kw = {"dtype": np.float32, "round_to": dt.type} if dt.itemsize == 2 else {"dtype": dt.type}
    naive = [*attention_ref(q, k, v, keep=keep, **naive_kw),
             *attention_backward_ref(dout, q, k, v, keep=keep, **naive_kw)]
    eps = float(finfo(dt).eps)
    # gradients: the rounding term at the magnitude of the terms they sum (the test above says why)
    terms = 2 * d * float(np.abs(dout).max() * np.abs(v).max() * max(np.abs(q).max(), np.abs(k).max()))
    for rank, (rows, out, lse, grads) in enumerate(results):
        for name, got, want, plain in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                                          truth, naive):
            pick = (slice(None), slice(None), rows) if name == "lse" else (slice(None), rows)
            want, plain = want[pick], plain[pick]
            if name == "lse":   # -inf exactly where a row sees no key (block masks leave some)
                seen = np.isfinite(want.astype(np.float64))
                assert np.array_equal(np.isfinite(got), seen), f"rank {rank} lse's -inf rows {p}"
                got, want, plain = got[seen], want[seen], plain[seen]
            got = got.astype(np.float64)
            if name in ("out", "lse"):   # FlashAttention's rule: twice the naive error + rounding
                ok, err, bound = within_fa_rule(got, want, plain, eps)
            else:
                # gradients: 3 x the naive error, as the MPI tests' bodies ask of a backward
                # (tests/mpi/strategy_bodies.py), plus rounding: float16/bfloat16 at the
                # gradient's magnitude (8 eps max|ref|, that rule's; where the reference is 0, as
                # a row seeing itself alone makes it, within float32 rounding, the kernels'
                # arithmetic, of the terms that cancel at the softmax scale); float32/float64 at
                # the magnitude of the terms that cancel in them (the test above says why)
                if dt.itemsize == 2 and not np.any(want):
                    err = float(np.abs(got).max(initial=0.0))
                    bound = 8 * float(np.finfo(np.float32).eps) * terms / np.sqrt(d)
                    ok = err <= bound
                elif dt.itemsize == 2:
                    ok, err, bound = within_fa_rule(got, want, plain, eps, factor=3.0)
                else:
                    err, bound = max_err(got, want), 3.0 * max_err(plain, want) + 8 * eps * terms / np.sqrt(d)
                    ok = err <= bound
            assert ok, f"rank {rank} {name} {p}: {err:.3e} > {bound:.3e}"
