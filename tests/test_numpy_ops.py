"""The NumPy local op's fast paths: lazy folding rescales rows or falls back to the exact fold
where it must,
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


def _stepping(dtype, n=64, step=9.5):
    """Scores of query row i against key j: step * (j // 8) * (i % 3 - 1) — rows whose scores
    climb a step at each 8-key tile and are flat within it, fall, or stay flat — plus noise.
    Against the shift from the tile before, a climbing row's P is ~e^9.5 at each of the 8 keys:
    their sum past LAZY_LIMIT (2^16 ~ e^11.1), each within RESCALE_LIMIT (e^22.2)."""
    q, k, v, dout = make_inputs(11, 1, n, 2, 1, 4, dtype)
    q[..., 0] = (np.arange(n) % 3 - 1)[None, :, None]
    k[..., 0] = step * (np.arange(n) // 8)[None, :, None] / q.shape[-1] ** -0.5
    return q, k, v, dout


def _jumping(dtype, n=64):
    """Every row's scores jump from about -100 to about 0 at key n / 2 (plus noise): exp of the
    scores against the shift from the keys before overflows float32 (e^100 > 2^128), not
    float64. (Scores near 0 where the rows' softmax lives: a float32 lse near 100 would carry
    an absolute error of ulp(100) / 2 into every P of the backward.)"""
    q, k, v, dout = make_inputs(11, 1, n, 2, 1, 4, dtype)
    q[..., 0] = 1
    k[..., 0] = np.where(np.arange(n) < n // 2, -100 / q.shape[-1] ** -0.5, 0)[None, :, None]
    return q, k, v, dout


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("inputs, path", [(_stepping, "_rescale_rows"), (_jumping, "_fold_rows_exactly")])
def test_rows_whose_scores_climb(dtype, causal, inputs, path, count_calls):
    """Rows whose P sums past LAZY_LIMIT, each P within RESCALE_LIMIT, are rescaled alone; rows
    with a larger P (here e^100: past float32's range) are folded again exactly. Either way out, lse and
    the gradients stay within the FA rule of a float64 reference."""
    q, k, v, dout = inputs(dtype)
    calls = {name: count_calls(numpy_ops, name) for name in ("_rescale_rows", "_fold_rows_exactly")}
    group = _group(tile_q=8, tile_k=8, threads=1)
    out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal, check=True)
    assert calls[path], f"no tile took {path}: the test lost its point"
    if path == "_rescale_rows":
        # rows are seeded from a sample of each row's first tile: none needs the exact fold
        assert not calls["_fold_rows_exactly"], len(calls["_fold_rows_exactly"])
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
    does not grow like the score matrix: 4x the sequence, under 2x the scratch. Its tiles
    (tile_scratch_bytes) are fixed by the tile sizes: one thread holds one forward score tile
    (which the backward's P and dS share), its P @ [V | 1] rows and the backward's key rows —
    on two threads at most twice that, under 1/16 of one float32 score matrix of seqlen 4096."""
    one_thread = 4 * (numpy_ops.TILE_Q * numpy_ops.TILE_K + numpy_ops.TILE_Q * 65 + numpy_ops.TILE_K * 64)
    for threads in (1, 2):
        scratch, tiles = [], []
        for n in (1024, 4096):
            q, k, v, dout = make_inputs(16, 1, n, 8, 8, 64, "float32")
            group = _group(threads=threads)
            out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
            burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
            scratch.append(group.ops.scratch_bytes)
            tiles.append(group.ops.tile_scratch_bytes)
            group.close()
        assert 0 < scratch[0] <= scratch[1] < 2 * scratch[0]
        if threads == 1:
            assert tiles == [one_thread, one_thread]
        else:    # each thread's buffers grow to the largest tile it happened to run
            assert one_thread <= tiles[0] <= tiles[1] <= 2 * one_thread < 4096 * 4096 * 4 / 16


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rescaled_rows_keep_masked_garbage_out(dtype, count_calls):
    """Peaked causal scores (q x 6: rows rescaled alone) with NaN and Inf in K and V at late
    positions: every row before them has out, lse and dq bitwise as without the garbage (a
    row's bits depend on its own inputs alone); the rows that see them are not finite."""
    rescaled = count_calls(numpy_ops, "_rescale_rows")
    q, k, v, dout = make_inputs(5, 1, 300, 2, 1, 16, dtype)
    q *= 6
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[0, 200, 0, 3], bad_v[0, 250, 0, 5], bad_v[0, 260, 0, 0] = np.nan, np.inf, -np.inf
    runs = []
    for kk, vv in ((k, v), (bad_k, bad_v)):
        group = _group(tile_q=64, tile_k=64, threads=2)
        out, lse = burstcu.attention(q, kk, vv, group, causal=True, return_lse=True)
        runs.append((out, lse, *burstcu.attention_backward(dout, q, kk, vv, out, lse, group, causal=True)))
        group.close()
    assert rescaled, "no row was rescaled: the test lost its point"
    (out, lse, dq, dk, dv), (out2, lse2, dq2, dk2, dv2) = runs
    assert out[:, :200].tobytes() == out2[:, :200].tobytes()
    assert lse[..., :200].tobytes() == lse2[..., :200].tobytes()
    assert dq[:, :200].tobytes() == dq2[:, :200].tobytes()
    assert np.isfinite(out2[:, :200]).all() and not np.isfinite(out2[:, 200:]).all()


def _rows_refolded(monkeypatch) -> list:
    """The rows handed to `_fold_rows_exactly`, one list per call (the call still runs)."""
    calls, fn = [], numpy_ops._fold_rows_exactly
    monkeypatch.setattr(numpy_ops, "_fold_rows_exactly",
                        lambda q, k, v, acc, future, rows, v_max: calls.append(list(rows)) or
                        fn(q, k, v, acc, future, rows, v_max))
    return calls


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_one_jumping_row_is_refolded_alone(dtype, causal, monkeypatch):
    """Row 40's scores jump by 100 at key 32, the first of the second key tile (e^100: past
    float32's range, past RESCALE_LIMIT in float64); the other rows' scores do not. Only that
    row is folded again exactly, alone, the other rows of its tile lazily: their out and lse
    are bitwise those of a run where row 40 does not jump, and everything is within the FA
    rule of the reference."""
    q, k, v, _ = make_inputs(21, 1, 64, 1, 1, 16, dtype)
    q[..., 0] = 0
    k[0, 32:, 0, 0] = 100 / 16 ** -0.5
    tame = q.copy()
    q[0, 40, 0, 0] = 1
    refolded = _rows_refolded(monkeypatch)
    runs = []
    for qq in (q, tame):
        out, lse = burstcu.attention(qq, k, v, _group(tile_q=64, tile_k=32, threads=1), causal=causal,
                                     return_lse=True)
        runs.append((out, lse))
    assert refolded == [[40]], refolded
    (out, lse), (out_tame, lse_tame) = runs
    others = np.arange(64) != 40
    assert out[:, others].tobytes() == out_tame[:, others].tobytes()
    assert lse[..., others].tobytes() == lse_tame[..., others].tobytes()
    truth = np.longdouble if dtype == "float64" else np.float64
    naive = np.float64 if dtype == "float64" else np.float32
    for got, ref, nv in zip((out, lse), attention_ref(q, k, v, causal, dtype=truth),
                            attention_ref(q, k, v, causal, dtype=naive)):
        ok, err, bound = within_fa_rule(got, ref, nv, EPS[dtype])
        assert ok, (err, bound)


def test_window_rows_seed_from_a_key_they_see(monkeypatch):
    """A sliding window of 8 keys inside 64-key tiles: most rows see none of the tile's first
    2 * SEED_KEYS keys. Each row still takes a seed, from the last key it sees, so no row is
    folded exactly; out and lse are within the FA rule of the reference."""
    q, k, v, _ = make_inputs(22, 1, 256, 2, 1, 16, "float32")
    refolded = _rows_refolded(monkeypatch)
    out, lse = burstcu.attention(q, k, v, _group(tile_q=64, tile_k=64, threads=1), causal=True,
                                 window_size=(8, 0), return_lse=True)
    assert refolded == []
    rows, keys = np.arange(256)[:, None], np.arange(256)[None, :]
    keep = (keys <= rows) & (keys >= rows - 8)
    for got, ref, nv in zip((out, lse), attention_ref(q, k, v, keep=keep),
                            attention_ref(q, k, v, keep=keep, dtype=np.float32)):
        ok, err, bound = within_fa_rule(got, ref, nv, EPS["float32"])
        assert ok, (err, bound)
