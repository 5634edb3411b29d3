"""The baseline strategies ("ring", "allgather") against the float64 reference and their byte
formulas, under a real `mpiexec -n 1, 2, 3`; plus single-process checks of `engine.get`."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from burstcu import engine
from tests.mpi_run import run_mpi

CASES = [
    {"b": 1, "h": 2, "hkv": 2, "d": 16, "causal": False, "layout": "contiguous"},
    {"b": 2, "h": 4, "hkv": 2, "d": 8, "causal": True, "layout": "contiguous"},
    {"b": 1, "h": 3, "hkv": 1, "d": 16, "causal": True, "layout": "zigzag"},
]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "burst"])
def test_strategy_matches_reference(nprocs, strategy):
    results = run_mpi(nprocs, "strategy_bodies:strategy_matches_reference", timeout=120,
                      strategy=strategy, dtype="float32", cases=CASES, seqlen_local=24)
    for rank_summary in results:
        assert len(rank_summary) == len(CASES)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_strategy_dtypes(strategy, dtype):
    run_mpi(2, "strategy_bodies:strategy_matches_reference", timeout=120, strategy=strategy,
            dtype=dtype, cases=CASES[1:], seqlen_local=16)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_strategies_agree(nprocs):
    results = run_mpi(nprocs, "strategy_bodies:strategies_agree", timeout=120)
    assert all(r["max_diff"] < 1e-12 for r in results)


@pytest.mark.mpi
def test_travelling_grads_round_once():
    """ring and allgather send dK, dV on in the accumulation dtype: bfloat16 gradients within
    one ulp of burst's on 3 ranks (a partial rounded each step leaves more)."""
    results = run_mpi(3, "strategy_bodies:travelling_grads_keep_the_accumulator", timeout=120)
    assert len(results) == 3 and all(max(r.values()) <= 1.0 for r in results)


def test_get_unknown_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        engine.get("zigzag-ring")
    with pytest.raises(TypeError, match="takes no options"):
        engine.get("burst", ulysses_degree=2)


COUNTS = ("forward_bytes", "backward_bytes", "forward_messages", "backward_messages")


@pytest.mark.parametrize("name", engine.NAMES + engine.LINEAR_NAMES)
def test_every_strategy_counts_with_one_signature(name):
    """`engine.get` / `get_linear` give forward, backward and the four counts of what a rank
    sends, every count taking (size, q, k, v, *, rank, layout, causal, window_size,
    cu_seqlens, block_mask) (the signature documented in burstcu.engine)."""
    import inspect

    linear = name in engine.LINEAR_NAMES
    made = engine.get_linear(name) if linear else engine.get(name)   # usp: u chosen
    assert callable(made.forward) and callable(made.backward)
    q, k = np.empty((1, 8, 4, 8), np.float32), np.empty((1, 8, 2, 8), np.float32)
    for count in (getattr(made, c) for c in COUNTS):
        params = inspect.signature(count).parameters.values()
        assert [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD] == ["size", "q", "k", "v"]
        assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == \
            ["rank", "layout", "causal", "window_size", "cu_seqlens", "block_mask"]
        assert count(4, q, k, k, rank=1, layout="zigzag", causal=True) > 0
        assert count(1, q, k, k) == 0


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_single_process(strategy):
    """With group=None (one process) every strategy equals the default engine exactly in float64."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 40, 2, 8)) for _ in range(4))
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True, strategy=strategy)
    ref_out, ref_lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-13)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, strategy=strategy)
    ref = burstcu.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    for got, want in zip(grads, ref):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_one_rank_burst_reads_k_v_in_place(monkeypatch):
    """With one rank nothing travels: the burst forward takes no message buffers (it copied K
    and V into one before) and reads strided K, V as they are — out and lse still equal the
    float64 reference."""
    from burstcu.ops.numpy import NumpyOps
    from burstcu.testing.reference import attention_ref
    from burstcu.transport.base import SelfTransport

    ops = NumpyOps(threads=1)
    monkeypatch.setattr(ops, "double_buffer", lambda fields: pytest.fail("a message buffer with one rank"))
    group = burstcu.Group(0, 1, "numpy", SelfTransport(), ops)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 32, 4, 8))
    kv = rng.standard_normal((1, 32, 8, 8))
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]          # views, not contiguous
    out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v, True, dtype=np.longdouble)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-13)


@pytest.mark.parametrize("backend", ["numpy", pytest.param("emulated", marks=pytest.mark.emulated)])
def test_one_rank_burst_backward_reads_inputs_in_place(monkeypatch, backend):
    """With one rank the backward takes no bundle buffers either: its one step reads strided Q
    and dO as they are (head dim 32: the kernels' op pads none, so its kernels read the views)
    and adds into the dQ it returns. With check=True (row sums of P agreed; the kernels'
    deterministic dQ pass) the gradients are those of the same call on contiguous copies, bit
    for bit, and match the float64 reference; the trace holds the one step."""
    from burstcu.engine.steps import Trace
    from burstcu.testing.reference import attention_backward_ref, within_fa_rule
    from burstcu.transport.base import SelfTransport

    if backend == "numpy":
        from burstcu.ops.numpy import NumpyOps
        ops, dtype, atol = NumpyOps(threads=1), np.float64, 1e-12
    else:
        from burstcu.ops.cuda.kernel_ops import KernelOps
        ops, dtype, atol = KernelOps("emulated"), np.float16, None
    monkeypatch.setattr(ops, "double_buffer", lambda fields: pytest.fail("a message buffer with one rank"))
    group = burstcu.Group(0, 1, backend, SelfTransport(), ops)
    rng = np.random.default_rng(2)
    qd = rng.standard_normal((1, 32, 8, 32)).astype(dtype)
    q, dout = qd[:, :, 0::2], qd[:, :, 1::2]                 # views, not contiguous
    k, v = (rng.standard_normal((1, 32, 2, 32)).astype(dtype) for _ in range(2))
    out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
    group.trace = Trace()
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True, check=True)
    assert [(t.pass_, t.step, t.source_rank, t.blocks) for t in group.trace.steps] == [("backward", 0, 0, 1)]
    group.trace = None
    again = burstcu.attention_backward(np.ascontiguousarray(dout), np.ascontiguousarray(q), k, v,
                                       out, lse, group, causal=True, check=True)
    for got, want in zip(grads, again):
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    refs = attention_backward_ref(dout, q, k, v, True, dtype=np.longdouble)
    if atol is None:   # float16: the FA rule against a naive float16 computation's error
        naive = attention_backward_ref(dout, q, k, v, True, dtype=np.float32, round_to=np.float16,
                                       out_dtype=np.float16)
        for got, ref, bad in zip(grads, refs, naive):
            ok, err, bound = within_fa_rule(got, ref, bad, float(np.finfo(np.float16).eps))
            assert ok, (err, bound)
    else:
        for got, ref in zip(grads, refs):
            np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
