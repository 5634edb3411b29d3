"""Randomized problems (hypothesis) against the float64 reference: shapes, GQA ratios, head dims,
layouts, causal or not, float64/float32, NumPy tile sizes and thread counts, 1-4 ranks (the real
engine on the loopback transport: ranks as threads, so each example costs milliseconds), every
rank's out, lse and gradients, and its bytes."""

from __future__ import annotations

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

import burstcu  # noqa: E402
from burstcu.engine import burst  # noqa: E402
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
            ok, err, bound = within_fa_rule(got, want, plain, eps, factor=3.0)
            if name in ("dq", "dk", "dv"):
                bound = 3.0 * max_err(plain, want) + 8 * eps * terms
                ok = err <= bound
            assert ok, f"rank {rank} {name} {p}: {err:.3e} > {bound:.3e}"
