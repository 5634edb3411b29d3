"""Edge cases of the CPU backend in one process: NaN containment, fully masked rows, huge
logits, GQA, softmax_scale, memory that never grows with seqlen^2, the running state's dtype."""

import tracemalloc
import warnings

import ml_dtypes
import numpy as np
import pytest

import burstcu
from burstcu.layout import Block
from burstcu.ops.numpy import NumpyOps
from tests.mpi.bodies import EPS, make_inputs
from burstcu.testing.reference import (attention_backward_ref, attention_ref, step_backward_ref,
                                       within_fa_rule)


def test_nan_in_one_query_row_stays_in_that_row():
    q, k, v, _ = make_inputs(1, 1, 64, 2, 2, 16, "float32")
    q[0, 10, 1, 3] = np.nan
    out, lse = burstcu.attention(q, k, v, return_lse=True)
    assert np.isnan(out[0, 10, 1]).all()
    finite = np.ones(out.shape[:3], bool)
    finite[0, 10, 1] = False
    assert np.isfinite(out[finite]).all()
    # its lse is NaN as well: -inf is reserved for rows that saw no key
    assert np.isnan(lse[0, 1, 10])
    lse_finite = np.ones(lse.shape, bool)
    lse_finite[0, 1, 10] = False
    assert np.isfinite(lse[lse_finite]).all()


@pytest.mark.parametrize("causal", [False, True])
def test_garbage_inputs_raise_no_floating_point_warnings(causal):
    """NaN and Inf in the inputs give NaN/Inf results where the math says so, quietly: neither
    the forward nor the backward warns (numpy's "invalid value" / "overflow" RuntimeWarnings)."""
    q, k, v, dout = make_inputs(3, 1, 64, 2, 2, 16, "float32")
    q[0, 5, 1, 2], v[0, 40, 0, 3], dout[0, 50, 0, 1] = np.nan, np.inf, np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = burstcu.attention(q, k, v, causal=causal, return_lse=True)
        grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=causal)
    assert np.isnan(out[0, 5, 1]).all() and not np.isfinite(grads[0]).all()


def test_fully_masked_rows_give_zero_not_nan():
    """Rows whose every key is in the future (possible inside a ring step) end as 0, lse -inf."""
    ops = NumpyOps(tile_q=4, tile_k=4)
    q, k, v, _ = make_inputs(2, 1, 8, 2, 1, 8, "float32")
    state = ops.forward_init(q, 0.3)
    # queries at positions 0..7, keys at positions 4..11: rows 0..3 see no key
    ops.forward_step(state, k, v, [Block(0, 8, 0, 8, q_pos=0, k_pos=4, causal=True)])
    out, lse = ops.forward_finalize(state, np.float32)
    assert np.array_equal(out[:, :4], np.zeros_like(out[:, :4]))
    assert np.isneginf(lse[:, :, :4]).all()
    assert np.isfinite(out[:, 4:]).all() and np.isfinite(lse[:, :, 4:]).all()
    ref_out, ref_lse = attention_ref(q[:, 4:], k[:, :4], v[:, :4], causal=True, softmax_scale=0.3)
    assert np.allclose(out[:, 4:], ref_out, atol=1e-6) and np.allclose(lse[:, :, 4:], ref_lse, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_logits_of_magnitude_1e3_stay_exact(dtype):
    q, k, v, dout = make_inputs(3, 1, 96, 2, 1, 32, dtype, logit_scale=400.0)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), np.repeat(k, 2, axis=2)) / np.sqrt(32)
    assert np.abs(s).max() > 1e3
    truth = np.longdouble if dtype == "float64" else np.float64
    naive = np.float64 if dtype == "float64" else np.float32
    # Rounding a logit of this size once (half an ulp of |s|, which any implementation does in
    # its own order) moves lse by as much and out by at most twice that times max|v|.
    logit_rounding = 0.5 * EPS[dtype] * float(np.abs(s).max())
    sensitivity = {"out": 2 * float(np.abs(v.astype(np.float64)).max()), "lse": 1.0}
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    for name, got, ref, nv in zip(("out", "lse"), (out, lse), attention_ref(q, k, v, True, dtype=truth),
                                  attention_ref(q, k, v, True, dtype=naive)):
        ok, err, bound = within_fa_rule(got, ref, nv, EPS[dtype])
        bound += logit_rounding * sensitivity[name]
        assert err <= bound, (name, err, bound)
    # The backward recomputes P = exp(score - lse) from the lse the API hands back, with the
    # scores computed again in another BLAS call: at |score| ~ 1e3 a few float32 ulps of the score
    # or of lse move P relatively by ~1e-4. The naive implementation of that algorithm in the
    # same dtype shows the size of it: scores recomputed by einsum in the dtype, P from the exact
    # (float64) lse and delta rounded once to the dtype - independent of the code under test.
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    keep = np.tril(np.ones((q.shape[1], q.shape[1]), bool))
    exact_out, exact_lse = attention_ref(q, k, v, True, dtype=truth)
    exact_delta = np.einsum("bshd,bshd->bhs", dout.astype(truth), exact_out)
    naive_grads = step_backward_ref(q, k, v, dout, exact_lse.astype(naive), exact_delta.astype(naive),
                                    keep, dtype=naive)
    for name, got, ref, nv in zip(("dq", "dk", "dv"), grads,
                                  attention_backward_ref(dout, q, k, v, True, dtype=truth), naive_grads):
        assert np.isfinite(got).all()
        ok, err, bound = within_fa_rule(got, ref, nv, EPS[dtype], factor=3.0)
        assert ok, (name, err, bound)


@pytest.mark.parametrize("scale", [1e7, 1e9, 3e10])
@pytest.mark.parametrize("causal", [False, True])
def test_very_large_logits_give_the_dominant_key(scale, causal):
    """Scores of 1e7-1e11 in float32 (finite, far past what any row's keys can tie within): each
    row's softmax is its largest score's key alone, and lse that score. The lazy fold's shift
    came from another product than its scores, whose rounding (ulps of hundreds) made every P of
    a row underflow: out 0 and lse -inf, as if the row saw no key. 1100 rows: three query tiles,
    several key tiles a row."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 1100, 2, 16)).astype(np.float32) for _ in range(3))
    out, lse = burstcu.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64)) * scale
    if causal:
        s = np.where(np.tril(np.ones((1100, 1100), bool)), s, -np.inf)
    top = np.sort(s, axis=-1)
    assert (top[..., -1] - top[..., -2] > 50).mean() > 0.99   # a dominant key, nearly everywhere
    clear = top[..., -1] - top[..., -2] > 50                  # (B, H, S): rows it holds for
    best = np.take_along_axis(v.transpose(0, 2, 1, 3), s.argmax(-1)[..., None], axis=2)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.abs(out.transpose(0, 2, 1, 3) - best)[clear].max() <= 1e-6
    assert (np.abs(lse - top[..., -1]) <= 1e-6 * np.abs(top[..., -1]) + 1e-3)[clear].all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale", [1e7, 1e9])
def test_very_large_logits_keep_the_backwards_p_a_probability(dtype, scale):
    """The backward's P = exp(score - lse) is at most 1: at |score| 1e7-1e11 the NumPy op's
    recomputed score - lse, rounded otherwise than the forward's, came out positive by many
    units, and dv (P^T dO, exactly within each column's sum of |dO| over the rows) reached 147
    times too large and inf. Now finite and within that sum, per key and per column."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 300, 2, 16)).astype(np.float32) for _ in range(4))
    if dtype == "bfloat16":
        q, k, v, dout = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v, dout))
    out, lse = burstcu.attention(q, k, v, causal=True, softmax_scale=scale, return_lse=True)
    with np.errstate(all="ignore"):
        dq, dk, dv = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True,
                                                softmax_scale=scale)
    assert all(np.isfinite(x.astype(np.float32)).all() for x in (dq, dk, dv))
    # key j is seen by rows j..N-1 (causal): |dv_j| <= sum over those rows of |dO|, per column
    bound = np.cumsum(np.abs(dout.astype(np.float64))[:, ::-1], axis=1)[:, ::-1]
    assert (np.abs(dv.astype(np.float64)) <= bound * (1 + 1e-2) + 1e-6).all()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("scale, value", [(0.5, 1e34), (None, 3e35), (0.5, 3e35)])
@pytest.mark.parametrize("poisoned", [False, True])
def test_very_large_values_do_not_overflow(dtype, scale, value, poisoned):
    """V of one finite value c near float32's (and bfloat16's) limit, 3.4e38: out is c in every
    row. A row whose first shift sat far below its largest scores summed P @ V over the key
    tiles to inf, though no tile's P @ V overflowed. poisoned: causal, with an Inf in the last
    key's V, which only the last row sees: the other rows must not feel it."""
    cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    rng = np.random.default_rng(1)
    q, k = (rng.standard_normal((1, 1024, 2, 32)).astype(cast) for _ in range(2))
    v = np.full((1, 1024, 2, 32), value, np.float32).astype(cast)
    given = v.copy()
    if poisoned:
        given[0, 1023, :, 0] = np.inf
    rows = slice(0, 1023 if poisoned else 1024)
    out = burstcu.attention(q, k, given, causal=poisoned, softmax_scale=scale)[:, rows]
    assert np.isfinite(out.astype(np.float32)).all()
    ref, _ = attention_ref(q, k, v, causal=poisoned, softmax_scale=scale)
    naive, _ = attention_ref(q, k, v, causal=poisoned, softmax_scale=scale, dtype=np.float32,
                             round_to=cast if dtype == "bfloat16" else None)
    ok, err, bound = within_fa_rule(out, ref[:, rows], naive[:, rows], EPS[dtype])
    assert ok, (err, bound)


def test_softmax_scale_is_used():
    q, k, v, _ = make_inputs(4, 1, 32, 2, 2, 16, "float64")
    out = burstcu.attention(q, k, v, softmax_scale=0.05)
    ref, _ = attention_ref(q, k, v, softmax_scale=0.05)
    assert np.abs(out - ref).max() < 1e-13
    assert np.abs(burstcu.attention(q, k, v) - ref).max() > 1e-3


def test_state_stays_float32_for_half_inputs():
    """Running state in float32: 64 ring-like folds of float16 data lose nothing to float16."""
    ops = NumpyOps(tile_q=8, tile_k=8)
    q, k, v, _ = make_inputs(5, 1, 512, 1, 1, 16, "float16")
    state = ops.forward_init(q[:, :8], 0.25)
    for j in range(64):  # fold the keys 8 at a time, as 64 ring steps would
        ops.forward_step(state, k[:, 8 * j:8 * j + 8], v[:, 8 * j:8 * j + 8],
                         [Block(0, 8, 0, 8, 0, 0, False)])
    out, lse = ops.forward_finalize(state, np.float16)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref, ref_lse = attention_ref(q[:, :8], k, v, softmax_scale=0.25)
    # the only float16 rounding is of the final output: half an ulp
    assert np.abs(out.astype(np.float64) - ref).max() <= 2.0**-11 * np.abs(ref).max() + 1e-6
    assert np.abs(lse - ref_lse).max() < 1e-5


def _peak_bytes(seqlen: int) -> int:
    q, k, v, dout = make_inputs(6, 1, seqlen, 1, 1, 16, "float32")
    tracemalloc.start()
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_memory_never_quadratic_in_seqlen():
    """Peak allocation (forward + backward) at seqlen 8192 is far below one 8192^2 score matrix,
    and doubling seqlen at most doubles it (a quadratic term would quadruple it)."""
    small, large = _peak_bytes(4096), _peak_bytes(8192)
    score_matrix = 8192 * 8192 * 4
    assert large < score_matrix / 16, f"peak {large} bytes vs one score matrix {score_matrix}"
    assert large / small < 2.2, f"peak grew {large / small:.2f}x when seqlen doubled"
