"""Bodies for the baseline strategies ("ring", "allgather") and "burst", run on every rank under
`mpiexec -n N` (any N) through tests/mpi/runner.py as `strategy_bodies:<function>`.

Each body checks its own rank's results against the independent float64 reference of
tests/reference.py (the FlashAttention tolerance rule) and its own payload counters against the
byte/message formulas, written out here again rather than taken from burstcu.
"""

from __future__ import annotations

import numpy as np

import burstcu
from tests.mpi.bodies import DTYPES, NAIVE, TRUTH, _check, make_inputs, my_rows
from tests.reference import attention_backward_ref, attention_ref


def expected_traffic(strategy: str, size: int, b: int, s: int, h: int, hkv: int, d: int,
                     itemsize: int, acc: int) -> dict:
    """Bytes and messages one rank sends per pass (see burstcu.strategies / burstcu.ring)."""
    g1 = size - 1
    kv = b * s * hkv * d * itemsize          # one of K, V in the input dtype
    kv_acc = b * s * hkv * d * acc           # one of dK, dV in the accumulation dtype
    qd = b * s * h * d
    rows = b * h * s
    if size == 1:
        return {"fwd": (0, 0), "bwd": (0, 0)}
    if strategy == "burst":
        bundle = 2 * qd * itemsize + 2 * rows * acc            # q, dout, delta, lse
        return {"fwd": (g1 * 2 * kv, g1), "bwd": (g1 * bundle + size * qd * acc, size + 1)}
    if strategy == "ring":
        return {"fwd": (g1 * 2 * kv, 2 * g1),
                "bwd": (g1 * 2 * kv + size * 2 * kv_acc, 2 * g1 + 2 * size)}
    if strategy == "allgather":
        return {"fwd": (g1 * 2 * kv, 0), "bwd": (g1 * 2 * kv + g1 * 2 * kv_acc, g1)}
    raise ValueError(strategy)


def strategy_matches_reference(strategy="ring", dtype="float32", cases=(), seqlen_local=24):
    """Forward (out, lse) and backward (dq, dk, dv) of `strategy` against float64, plus exact
    bytes and message counts per pass."""
    group = burstcu.init(backend="numpy")
    size, rank = group.size, group.rank
    summary = []
    for i, case in enumerate(cases):
        b, h, hkv, d = case["b"], case["h"], case["hkv"], case["d"]
        causal, layout = case["causal"], case["layout"]
        n = seqlen_local * size
        q, k, v, dout = make_inputs(2000 + i, b, n, h, hkv, d, dtype)
        rows = my_rows(layout, rank, size, n)
        ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))

        group.stats.reset()
        out, lse = burstcu.attention(ql, kl, vl, group, causal=causal, layout=layout,
                                     return_lse=True, strategy=strategy)
        fwd = group.stats.as_dict()
        assert out.dtype == ql.dtype and out.shape == ql.shape
        ref_out, ref_lse = attention_ref(q, k, v, causal, dtype=TRUTH[dtype])
        naive_out, naive_lse = attention_ref(q, k, v, causal, dtype=NAIVE[dtype])
        errs = {"out": _check("out", out, ref_out[:, rows], naive_out[:, rows], dtype),
                "lse": _check("lse", lse, ref_lse[:, :, rows], naive_lse[:, :, rows], dtype)}

        group.stats.reset()
        grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=causal,
                                           layout=layout, strategy=strategy)
        bwd = group.stats.as_dict()
        refs = attention_backward_ref(dout, q, k, v, causal, dtype=TRUTH[dtype])
        naives = attention_backward_ref(dout, q, k, v, causal, dtype=NAIVE[dtype])
        for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
            assert got.dtype == ql.dtype and got.shape == (ql if name == "dq" else kl).shape
            errs[name] = _check(name, got, ref[:, rows], naive[:, rows], dtype)

        itemsize = np.dtype(DTYPES[dtype]).itemsize
        acc = 8 if dtype == "float64" else 4
        want = expected_traffic(strategy, size, b, seqlen_local, h, hkv, d, itemsize, acc)
        for name, got in (("fwd", fwd), ("bwd", bwd)):
            assert (got["bytes_sent"], got["messages"]) == want[name], (strategy, name, got, want[name])
            assert got["bytes_received"] == got["bytes_sent"], (name, got)
        summary.append({"case": case, "errors": errs, "fwd_bytes": fwd["bytes_sent"],
                        "bwd_bytes": bwd["bytes_sent"]})
    group.close()
    return summary


def strategies_agree(seqlen_local=16, causal=True, layout="zigzag"):
    """All three strategies give the same out, lse and gradients to float32 rounding noise on
    one set of inputs (a cross-check independent of the reference's tolerance rule)."""
    group = burstcu.init(backend="numpy")
    size, rank = group.size, group.rank
    n = seqlen_local * size
    q, k, v, dout = make_inputs(77, 1, n, 4, 2, 16, "float64")
    rows = my_rows(layout, rank, size, n)
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
    results = {}
    for strategy in ("burst", "ring", "allgather"):
        out, lse = burstcu.attention(ql, kl, vl, group, causal=causal, layout=layout,
                                     return_lse=True, strategy=strategy)
        grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=causal,
                                           layout=layout, strategy=strategy)
        results[strategy] = (out, lse) + tuple(grads)
    worst = 0.0
    for strategy in ("ring", "allgather"):
        for a, b in zip(results["burst"], results[strategy]):
            finite = np.isfinite(a)
            assert np.array_equal(finite, np.isfinite(b)), strategy
            worst = max(worst, float(np.abs(a[finite] - b[finite]).max(initial=0.0)))
    assert worst < 1e-12, worst  # float64 inputs: only summation order differs
    group.close()
    return {"max_diff": worst}
