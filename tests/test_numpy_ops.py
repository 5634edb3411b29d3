"""The NumPy local op's fast paths: lazy rescaling falls back to the exact fold where it must,
buffers kept between calls never leak one call's data into the next, and its scratch stays
tile-sized."""

import numpy as np
import pytest

import burstcu
from burstcu.layout import Block
from burstcu.ops import numpy_ops
from burstcu.ops.numpy_ops import NumpyOps
from burstcu.testing.reference import attention_backward_ref, attention_ref, within_fa_rule
from burstcu.transport.base import SelfTransport
from tests.mpi.bodies import EPS, make_inputs


def _group(**options):
    return burstcu.Group(0, 1, "numpy", SelfTransport(), NumpyOps(**options))


def _rising(dtype, n=64, rise=1.5):
    """Scores of query row i against key j: rise * j * (i % 3 - 1) — rows whose scores climb
    12 per 8-key tile (past LAZY_LIMIT at every tile), fall, or stay flat — plus noise."""
    q, k, v, dout = make_inputs(11, 1, n, 2, 1, 4, dtype)
    q[..., 0] = (np.arange(n) % 3 - 1)[None, :, None]
    k[..., 0] = rise * np.arange(n)[None, :, None] / q.shape[-1] ** -0.5
    return q, k, v, dout


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_whose_scores_climb_are_folded_exactly(dtype, causal, monkeypatch):
    q, k, v, dout = _rising(dtype)
    exact = []
    fold = numpy_ops._fold_exactly
    monkeypatch.setattr(numpy_ops, "_fold_exactly", lambda *a: exact.append(1) or fold(*a))
    group = _group(tile_q=8, tile_k=8, threads=1)
    out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal, check=True)
    assert exact, "no tile needed the exact fold: the test lost its point"
    truth = np.longdouble if dtype == "float64" else np.float64
    naive = np.float64 if dtype == "float64" else np.float32
    refs = attention_ref(q, k, v, causal, dtype=truth) + attention_backward_ref(dout, q, k, v, causal, dtype=truth)
    naives = attention_ref(q, k, v, causal, dtype=naive) + attention_backward_ref(dout, q, k, v, causal, dtype=naive)
    for name, got, ref, nv in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), refs, naives):
        ok, err, bound = within_fa_rule(got, ref, nv, EPS[dtype])
        assert ok, (name, err, bound)


def test_rows_with_and_without_a_shift_share_a_tile():
    """One tile holds rows that already have a shift (folded lazily), rows meeting their first
    keys (seeded) and rows that see no key of it and had none before (out 0, lse -inf)."""
    q, k, v, _ = make_inputs(12, 1, 16, 1, 1, 8, "float32")
    k_all, v_all = (np.concatenate([x, x[:, :12] * 0.5], axis=1)[:, :12] for x in (k, v))
    ops = NumpyOps(tile_q=16, tile_k=16, threads=1)
    state = ops.forward_init(q, 0.5)
    # step 1: keys at positions 0..3, seen by rows 8..15; step 2: keys at 4..11, causal
    ops.forward_step(state, k_all[:, :4], v_all[:, :4], [Block(8, 8, 0, 4, q_pos=8, k_pos=0, causal=True)])
    ops.forward_step(state, k_all[:, 4:], v_all[:, 4:], [Block(0, 16, 0, 8, q_pos=0, k_pos=4, causal=True)])
    out, lse = ops.forward_finalize(state, np.float32)
    rows, keys = np.arange(16)[:, None], np.arange(12)[None, :]
    keep = (keys <= rows) & ((keys >= 4) | (rows >= 8))
    ref, ref_lse = attention_ref(q, k_all, v_all, softmax_scale=0.5, keep=keep)
    assert np.array_equal(out[:, :4], np.zeros_like(out[:, :4])) and np.isneginf(lse[:, :, :4]).all()
    assert np.allclose(out, ref, atol=1e-5) and np.allclose(lse[:, :, 4:], ref_lse[:, :, 4:], atol=1e-5)


def _one_pass(group, q, k, v, dout, causal):
    out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True)
    return [x.tobytes() for x in (out, lse, *burstcu.attention_backward(dout, q, k, v, out, lse, group,
                                                                       causal=causal))]


def test_kept_buffers_carry_nothing_between_calls():
    """Calls of other shapes, dtypes and masks in between (whose buffers the op keeps and hands
    out again, outputs included), then release_buffers: every call gives the bits a fresh op
    gives."""
    problems = [(make_inputs(13, 1, 96, 4, 2, 16, "float32"), True),
                (make_inputs(14, 2, 40, 2, 2, 16, "float64"), False),
                (make_inputs(15, 1, 96, 4, 4, 16, "float32"), False),   # the size of the first's q
                (make_inputs(13, 1, 96, 4, 2, 16, "float32"), False)]
    shared = _group(tile_q=32, tile_k=32, threads=2)
    for round_ in range(2):
        for (q, k, v, dout), causal in problems:
            fresh = _group(tile_q=32, tile_k=32, threads=2)
            assert _one_pass(shared, q, k, v, dout, causal) == _one_pass(fresh, q, k, v, dout, causal)
            fresh.close()
        shared.ops.release_buffers()
    shared.close()


def test_scratch_is_tile_sized():
    """NumpyOps.scratch_bytes — per-thread tiles and the backward's dq partials (O(S * D)) —
    does not grow like the score matrix: 4x the sequence, under 2x the scratch."""
    scratch = []
    for n in (1024, 4096):
        q, k, v, dout = make_inputs(16, 1, n, 1, 1, 16, "float32")
        group = _group(threads=2)
        out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
        burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
        scratch.append(group.ops.scratch_bytes)
        group.close()
    assert 0 < scratch[0] <= scratch[1] < 2 * scratch[0]
    assert scratch[1] < 4096 * 4096 * 4 / 16
