"""The "cupy" backend through NCCL on a real GPU: a world of one against the float64 reference,
the transport's own collective, and no CuPy pool growth over repeated calls.

Skipped unless `cupy.cuda.is_available()`. NCCL refuses two ranks on one GPU, so the ring itself
(world > 1) is covered on the CPU: its schedule by tests/test_schedule.py, its numerics over MPI
by tests/test_attention_mpi.py.
"""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

from burstcu.transport.bootstrap import gpu_usable
from burstcu.testing.reference import attention_backward_ref, attention_ref, within_fa_rule
from tests.mpi.bodies import dense_keep


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU")]

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# the naive implementation already carries the half-precision roundings (P, dS, the outputs), so
# the rule's absolute term is float32 noise, not 8 ulps of the half dtype
EPS32 = 2.0**-23


@pytest.fixture(scope="module")
def group():
    import burstcu
    g = burstcu.init(backend="cupy")
    assert g.transport.name == "nccl" and g.size == 1
    yield g
    g.close()


def _inputs(seed, b=2, n=128, h=4, hkv=2, d=64, dtype="float16"):
    """(q, k, v, dout) in the kernels' dtype (the cupy backend takes float16/bfloat16 only)."""
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((b, n, h, d)).astype(DTYPES[dtype]) for _ in range(2))
    k, v = (rng.standard_normal((b, n, hkv, d)).astype(DTYPES[dtype]) for _ in range(2))
    return q, k, v, dout


# (causal, window): none, a causal band (key tiles before it skipped), a two-sided band that
# cuts through tiles on both sides, a one-sided band to the right
MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (40, 0)), (False, (19, 70)), (False, (-1, 5))]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal,window", MASKS)
def test_world_of_one_matches_reference(group, causal, window, dtype):
    """FlashAttention's rule against float64 over the mask spelled out: at most 2x (forward) /
    3x (gradients) the error of a naive same-dtype implementation (float32 math, P and dS
    rounded to the dtype)."""
    import cupy
    import burstcu
    n = 200                                                   # ragged against every tile size
    q, k, v, dout = _inputs(3, n=n, dtype=dtype)
    dq_, dk_, dv_, dd_ = (cupy.asarray(x) for x in (q, k, v, dout))
    how = {"causal": causal, "window_size": window}
    out, lse = burstcu.attention(dq_, dk_, dv_, group, return_lse=True, **how)
    grads = burstcu.attention_backward(dd_, dq_, dk_, dv_, out, lse, group, **how)
    assert out.dtype == DTYPES[dtype] and lse.dtype == np.float32
    keep = dense_keep(np.arange(n), np.arange(n), causal, window)
    ref_out, ref_lse = attention_ref(q, k, v, keep=keep)
    naive_out, naive_lse = attention_ref(q, k, v, keep=keep, dtype=np.float32,
                                         round_to=DTYPES[dtype])
    for name, got, ref, naive in [("out", out, ref_out, naive_out), ("lse", lse, ref_lse, naive_lse)]:
        ok, err, bound = within_fa_rule(cupy.asnumpy(got).astype(np.float64), ref, naive, EPS32)
        assert ok, f"{name}: {err:.3e} > {bound:.3e}"
    refs = attention_backward_ref(dout, q, k, v, keep=keep)
    naives = attention_backward_ref(dout, q, k, v, keep=keep, dtype=np.float32,
                                    round_to=DTYPES[dtype], out_dtype=DTYPES[dtype])
    for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
        ok, err, bound = within_fa_rule(cupy.asnumpy(got).astype(np.float64), ref, naive,
                                        EPS32, factor=3.0)
        assert ok, f"{name}: {err:.3e} > {bound:.3e}"
    # check=True (deterministic dQ, row sums of P agreed) gives gradients within the same rule
    checked = burstcu.attention_backward(dd_, dq_, dk_, dv_, out, lse, group, check=True, **how)
    for name, got, ref, naive in zip(("dq", "dk", "dv"), checked, refs, naives):
        ok, err, bound = within_fa_rule(cupy.asnumpy(got).astype(np.float64), ref, naive,
                                        EPS32, factor=3.0)
        assert ok, f"check=True {name}: {err:.3e} > {bound:.3e}"


def test_world_of_one_backward_reads_strided_q_and_dout(group):
    """One rank: the backward's one step reads Q and dO where they are (no bundle buffers), so
    strided views of them reach the kernels' op as given. Their gradients are those of
    contiguous copies, bit for bit (check=True: the deterministic dQ pass), and within the FA
    rule against float64."""
    import cupy
    import burstcu
    n = 200
    rng = np.random.default_rng(5)
    both = rng.standard_normal((2, n, 8, 64)).astype(np.float16)     # q and dout interleaved
    k, v = (rng.standard_normal((2, n, 2, 64)).astype(np.float16) for _ in range(2))
    g_both, g_k, g_v = (cupy.asarray(x) for x in (both, k, v))
    q, dout = g_both[:, :, 0::2], g_both[:, :, 1::2]
    assert not q.flags.c_contiguous and not dout.flags.c_contiguous
    out, lse = burstcu.attention(q, g_k, g_v, group, causal=True, return_lse=True)
    grads = burstcu.attention_backward(dout, q, g_k, g_v, out, lse, group, causal=True, check=True)
    again = burstcu.attention_backward(cupy.ascontiguousarray(dout), cupy.ascontiguousarray(q),
                                       g_k, g_v, out, lse, group, causal=True, check=True)
    for got, want in zip(grads, again):
        assert got.dtype == np.float16 and bool((got == want).all())
    host_q, host_do = both[:, :, 0::2], both[:, :, 1::2]
    refs = attention_backward_ref(host_do, host_q, k, v, causal=True)
    naives = attention_backward_ref(host_do, host_q, k, v, causal=True, dtype=np.float32,
                                    round_to=np.float16, out_dtype=np.float16)
    for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
        ok, err, bound = within_fa_rule(cupy.asnumpy(got).astype(np.float64), ref, naive,
                                        EPS32, factor=3.0)
        assert ok, f"{name}: {err:.3e} > {bound:.3e}"


def test_nccl_allgather_of_one_copies(group):
    import cupy
    send = cupy.arange(1000, dtype=cupy.float32)
    recv = cupy.zeros((1, 1000), dtype=cupy.float32)
    group.transport.allgather(send, recv)  # stream-ordered: the next kernel sees the result
    assert bool((recv[0] == send).all())


def test_no_pool_growth_over_100_calls(group):
    import cupy
    import burstcu
    q, k, v, dout = (cupy.asarray(x) for x in _inputs(4, n=64))
    pool = cupy.get_default_memory_pool()

    def step():
        out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
        burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)

    for _ in range(3):  # warm-up: kernels compiled, pool blocks cached
        step()
    cupy.cuda.Device().synchronize()
    gc.collect()        # arrays of earlier tests held in cycles must not be freed mid-count
    used, total = pool.used_bytes(), pool.total_bytes()
    for _ in range(100):
        step()
    cupy.cuda.Device().synchronize()
    gc.collect()
    assert pool.used_bytes() == used, (used, pool.used_bytes())
    assert pool.total_bytes() <= total, (total, pool.total_bytes())


@pytest.mark.parametrize("strategy", ["ulysses", "usp", "auto"])
def test_all_to_all_strategies_on_one_gpu(group, strategy):
    """Ulysses and USP on CuPy arrays (their all-to-all bookkeeping is device slicing), USP
    making its sub-groups as NCCL communicators (of one rank here: NCCL refuses two ranks on one
    GPU), "auto" whatever it picks: each bitwise equal to burst in a world of one, under a
    causal window."""
    import cupy
    import burstcu
    q, k, v, dout = (cupy.asarray(x) for x in _inputs(5))
    mask = {"causal": True, "window_size": (40, 0)}
    out, lse = burstcu.attention(q, k, v, group, return_lse=True, strategy="burst", **mask)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, strategy="burst", **mask)
    how = {"strategy": strategy, **({"ulysses_degree": 1} if strategy == "usp" else {}), **mask}
    out2, lse2 = burstcu.attention(q, k, v, group, return_lse=True, **how)
    grads2 = burstcu.attention_backward(dout, q, k, v, out2, lse2, group, **how)
    for a, b in zip((out, lse, *grads), (out2, lse2, *grads2)):
        assert bool(cupy.array_equal(a, b))
    if strategy == "usp":
        assert group.transport._subgroups and all(
            sub.name == "nccl" for sub in group.transport._subgroups.values())


def test_decode_on_the_gpu(group):
    """burstcu.decode on CuPy arrays (world of one over NCCL): float16 against float64 within
    FlashAttention's rule, rows past cache_seqlens (NaN) never read, results stay CuPy."""
    import cupy
    import burstcu
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 1, 8, 64)).astype(np.float16)
    k, v = (rng.standard_normal((2, 300, 2, 64)).astype(np.float16) for _ in range(2))
    n = np.array([300, 129], np.int32)
    k[1, 129:], v[1, 129:] = np.nan, np.nan
    out, lse = burstcu.decode(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), group,
                              cache_seqlens=n, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float16
    for b in range(2):
        ref_out, ref_lse = attention_ref(q[b:b + 1], k[b:b + 1, :n[b]], v[b:b + 1, :n[b]])
        naive, _ = attention_ref(q[b:b + 1], k[b:b + 1, :n[b]], v[b:b + 1, :n[b]], dtype=np.float32,
                                 round_to=np.float16)
        ok, err, bound = within_fa_rule(cupy.asnumpy(out[b:b + 1]).astype(np.float64), ref_out, naive, EPS32)
        assert ok, f"out: {err:.3e} > {bound:.3e}"
        assert np.abs(cupy.asnumpy(lse[b]) - ref_lse[0]).max() < 1e-3
