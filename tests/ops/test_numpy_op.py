"""The NumPy local op's fast paths: lazy folding rescales rows or falls back to the exact fold
where it must,
buffers kept between calls never leak one call's data into the next, and its scratch stays
tile-sized."""

import threading
import time

import numpy as np
import pytest

import burstcu
from burstcu.layout import Block
from burstcu.ops.numpy import op as numpy_op
from burstcu.ops.numpy import threads as numpy_threads
from burstcu.ops.numpy import tiles as numpy_tiles
from burstcu.ops.numpy import NumpyOps
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
@pytest.mark.parametrize("inputs", [_stepping, _jumping])
def test_rows_whose_scores_climb(dtype, causal, inputs, count_calls):
    """Rows whose P sums past LAZY_LIMIT, each P within RESCALE_LIMIT, are rescaled alone; rows
    with a larger P are folded again exactly: here e^100, past float32's range (P @ V overflows:
    the tile's exact fold), finite in float64 but far more than a rescale may take, the scores
    jumping to about 0 (each row alone). Either way out, lse and the gradients stay within the
    FA rule of a float64 reference."""
    q, k, v, dout = inputs(dtype)
    paths = ("_rescale_rows", "_fold_exactly", "_fold_rows_exactly")
    calls = {name: count_calls(numpy_tiles, name) for name in paths}
    group = _group(tile_q=8, tile_k=8, threads=1)
    out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal, check=True)
    taken = {name for name in paths if calls[name]}
    if inputs is _stepping:   # rows are seeded from a sample of each row's first tile
        assert taken == {"_rescale_rows"}, taken
    else:
        assert taken == {"_fold_exactly" if dtype == "float32" else "_fold_rows_exactly"}, taken
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
    """Calls of other shapes, dtypes and masks in between (whose scratch and message buffers the
    op keeps), then release_buffers: every call gives the bits a fresh op gives."""
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


def test_training_steps_at_seqlen_8192_repeat_their_bits():
    """Two forward+backward steps on one process at (1, 8192, 8, 64) float32 (arrays of 16 MiB;
    the work arrays of a call add up to over 64 MiB): the second step runs, and gives the first
    one's bits."""
    q, k, v, dout = make_inputs(17, 1, 8192, 8, 8, 64, "float32")
    group = _group(threads=2)
    first, second = (_one_pass(group, q, k, v, dout, True) for _ in range(2))
    group.close()
    assert first == second


def test_scratch_is_tile_sized():
    """NumpyOps.scratch_bytes — per-thread tiles and the backward's dq partials (O(S * D)) —
    does not grow like the score matrix: 4x the sequence, under 2x the scratch. Its tiles
    (tile_scratch_bytes) are fixed by the tile sizes: one thread holds one forward score tile
    (which the backward's P and dS share), its P @ [V | 1] rows and the backward's key rows —
    on two threads at most twice that, under 1/16 of one float32 score matrix of seqlen 4096."""
    one_thread = 4 * (numpy_tiles.TILE_Q * numpy_tiles.TILE_K + numpy_tiles.TILE_Q * 65 + numpy_tiles.TILE_K * 64)
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


def test_scratch_of_threads_that_ended_is_not_counted():
    """A server running each request on a fresh thread: the tiles a thread held leave with it,
    so scratch_bytes (the most held at once) stays one request's, not the sum of every thread's
    that ever ran."""
    import threading

    q, k, v, _ = make_inputs(3, 1, 512, 2, 2, 32, "float32")
    group = _group(threads=1)
    held = []

    def request():
        burstcu.attention(q, k, v, group, causal=True)
        held.append(group.ops.scratch_bytes)
    for _ in range(5):
        thread = threading.Thread(target=request)
        thread.start()
        thread.join()
    group.close()
    assert held[0] > 0 and held == [held[0]] * 5


def test_released_scratch_is_freed():
    """release_buffers frees the tiles, the calling thread's and the workers' (nothing else
    holds them)."""
    import gc
    import weakref

    from burstcu.ops.numpy import tiles

    q, k, v, _ = make_inputs(4, 1, 512, 2, 2, 32, "float32")
    group = _group(threads=2)
    burstcu.attention(q, k, v, group, causal=True)
    scratch = [weakref.ref(x) for x in group.ops._scratch.values()]
    assert scratch and all(isinstance(x(), tiles._Scratch) for x in scratch)
    group.ops.release_buffers()
    gc.collect()
    assert all(x() is None for x in scratch)
    group.close()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rescaled_rows_keep_masked_garbage_out(dtype, count_calls):
    """Peaked causal scores (q x 6: rows rescaled alone) with NaN and Inf in K and V at late
    positions: every row before them has out, lse and dq bitwise as without the garbage (a
    row's bits depend on its own inputs alone); the rows that see them are not finite."""
    rescaled = count_calls(numpy_tiles, "_rescale_rows")
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


def _assert_forward_within_fa_rule(q, k, v, causal, dtype, out, lse) -> None:
    """out and lse within the FA rule of a float64 (long double for float64 inputs) reference,
    against a naive implementation in the inputs' dtype."""
    truth = np.longdouble if dtype == "float64" else np.float64
    naive = np.float64 if dtype == "float64" else np.float32
    for got, ref, nv in zip((out, lse), attention_ref(q, k, v, causal, dtype=truth),
                            attention_ref(q, k, v, causal, dtype=naive)):
        ok, err, bound = within_fa_rule(got, ref, nv, EPS[dtype])
        assert ok, (err, bound)


def _rows_refolded(monkeypatch, where=None) -> dict:
    """{"alone": [...], "tile": [...]}: the rows (of the tile) each call of `_fold_rows_exactly`
    and of `_fold_exactly` updates, one list per call (the calls still run). where: a list that
    gets each such row's address in memory (which tile rows share, one row of q each)."""
    calls = {"alone": [], "tile": []}
    alone, tile = numpy_tiles._fold_rows_exactly, numpy_tiles._fold_exactly

    def note(path, q, rows):
        calls[path].append([int(r) for r in rows])
        if where is not None:
            where.extend(q.ctypes.data + int(r) * q.strides[0] for r in rows)

    monkeypatch.setattr(numpy_tiles, "_fold_rows_exactly",
                        lambda q, k, v, acc, future, rows, v_max: note("alone", q, rows) or
                        alone(q, k, v, acc, future, rows, v_max))
    monkeypatch.setattr(numpy_tiles, "_fold_exactly",
                        lambda q, k, v, acc, future, s, pv, v_max, rows: note("tile", q, np.flatnonzero(rows)) or
                        tile(q, k, v, acc, future, s, pv, v_max, rows))
    return calls


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, jump, path", [("float32", 40, "alone"), ("float64", 40, "alone"),
                                               ("float32", 100, "tile"), ("float64", 100, "alone")])
def test_one_jumping_row_is_refolded_alone(dtype, jump, path, causal, monkeypatch):
    """Row 40's scores jump from about -jump to about 0 at key 32, the first of the second key
    tile; the other rows' scores do not. P = e^jump is far more than a rescale may take for
    scores near 0: the row is folded again exactly — alone while P is finite (e^40; e^100 in
    float64), by the tile's exact fold where P @ V overflows (e^100 in float32), updating that
    row only. The other rows of its tile are folded lazily: their out and lse are bitwise those
    of a run where row 40 does not jump, and everything is within the FA rule of the reference."""
    q, k, v, _ = make_inputs(21, 1, 64, 1, 1, 16, dtype)
    q[..., 0] = 0
    k[0, :32, 0, 0] = -jump / 16 ** -0.5
    tame = q.copy()
    q[0, 40, 0, 0] = 1
    refolded = _rows_refolded(monkeypatch)
    runs = []
    for qq in (q, tame):
        out, lse = burstcu.attention(qq, k, v, _group(tile_q=64, tile_k=32, threads=1), causal=causal,
                                     return_lse=True)
        runs.append((out, lse))
    assert refolded == {"alone": [], "tile": [], path: [[40]]}, refolded
    (out, lse), (out_tame, lse_tame) = runs
    others = np.arange(64) != 40
    assert out[:, others].tobytes() == out_tame[:, others].tobytes()
    assert lse[..., others].tobytes() == lse_tame[..., others].tobytes()
    _assert_forward_within_fa_rule(q, k, v, causal, dtype, out, lse)


def test_window_rows_seed_from_a_key_they_see(monkeypatch):
    """A sliding window of 8 keys inside 64-key tiles: most rows see none of the tile's first
    2 * SEED_KEYS keys. Each row still takes a seed, from the last key it sees, so no row is
    folded exactly; out and lse are within the FA rule of the reference."""
    q, k, v, _ = make_inputs(22, 1, 256, 2, 1, 16, "float32")
    refolded = _rows_refolded(monkeypatch)
    out, lse = burstcu.attention(q, k, v, _group(tile_q=64, tile_k=64, threads=1), causal=True,
                                 window_size=(8, 0), return_lse=True)
    assert refolded == {"alone": [], "tile": []}, refolded
    rows, keys = np.arange(256)[:, None], np.arange(256)[None, :]
    keep = (keys <= rows) & (keys >= rows - 8)
    for got, ref, nv in zip((out, lse), attention_ref(q, k, v, keep=keep),
                            attention_ref(q, k, v, keep=keep, dtype=np.float32)):
        ok, err, bound = within_fa_rule(got, ref, nv, EPS["float32"])
        assert ok, (err, bound)


def test_rescale_paths_give_the_same_bits(count_calls):
    """Peaked scores (q x 6: rows rescaled alone), once clean and once with NaN in one query
    row: that row is dead from its first tile, so every tile holding it takes the masked path,
    the others the whole-tile one. Each other row's out and lse are bitwise the same in both
    runs: the two paths rescale a row with the same arithmetic."""
    rescaled = count_calls(numpy_tiles, "_rescale_rows")
    q, k, v, _ = make_inputs(5, 1, 128, 2, 1, 16, "float32")
    q *= 6
    bad = q.copy()
    bad[0, 3, 0, 0] = np.nan
    runs = [burstcu.attention(x, k, v, _group(tile_q=64, tile_k=64, threads=1), return_lse=True) for x in (q, bad)]
    assert len(rescaled) >= 2, "too few tiles rescaled rows: the test lost its point"
    (out, lse), (out_bad, lse_bad) = runs
    keep = np.ones((128, 2), bool)
    keep[3, 0] = False
    assert out[0][keep].tobytes() == out_bad[0][keep].tobytes()
    assert lse[0].T[keep].tobytes() == lse_bad[0].T[keep].tobytes()
    assert np.isnan(out_bad[0, 3, 0]).all() and np.isnan(lse_bad[0, 0, 3])


@pytest.mark.parametrize("tile_k", [16, 64])
def test_window_garbage_at_keys_a_row_cannot_see(tile_k):
    """A sliding window of 8 keys, NaN in one key at a time: rows that do not see it keep the
    bits of the clean run (a row's seed is a score against keys it sees: the sampled keys are
    masked for it, its own last key is one it sees), rows that see it are NaN."""
    q, k, v, _ = make_inputs(22, 1, 128, 2, 1, 16, "float32")

    def run(kk):
        group = _group(tile_q=64, tile_k=tile_k, threads=1)
        return burstcu.attention(q, kk, v, group, causal=True, window_size=(8, 0), return_lse=True)
    out, lse = run(k)
    for p in (0, 24, 56, 88, 100, 127):
        bad = k.copy()
        bad[0, p, 0, :] = np.nan
        out_bad, lse_bad = run(bad)
        sees = (np.arange(128) >= p) & (np.arange(128) <= p + 8)
        assert out[0, ~sees].tobytes() == out_bad[0, ~sees].tobytes(), p
        assert lse[0][:, ~sees].tobytes() == lse_bad[0][:, ~sees].tobytes(), p
        assert np.isnan(out_bad[0, sees]).all(), p


def test_dead_rows_are_never_computed_again(monkeypatch):
    """Rows that score +inf (K holds +inf at a key they see, q . k = +inf) or NaN (a NaN query)
    are NaN whatever else they see: each is folded exactly at most once, then skipped. Rows
    before the bad key keep the bits of the clean run."""
    q, k, v, _ = make_inputs(23, 1, 256, 1, 1, 16, "float32")
    q[0, :, 0, 0] = np.abs(q[0, :, 0, 0]) + 0.1      # every q . k[100] = +inf
    q[0, 200, 0, 1] = np.nan
    bad = k.copy()
    bad[0, 100, 0, 0] = np.inf
    rows = []
    _rows_refolded(monkeypatch, rows)
    out, lse = burstcu.attention(q, bad, v, _group(tile_q=32, tile_k=32, threads=1), causal=True,
                                 return_lse=True)
    assert rows and len(rows) == len(set(rows)), len(rows) - len(set(rows))
    assert np.isnan(out[0, 100:]).all() and np.isnan(lse[0, 0, 100:]).all()
    clean, clean_lse = burstcu.attention(q, k, v, _group(tile_q=32, tile_k=32, threads=1), causal=True,
                                         return_lse=True)
    assert out[0, :100].tobytes() == clean[0, :100].tobytes()
    assert lse[0, 0, :100].tobytes() == clean_lse[0, 0, :100].tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_very_peaked_scores_are_rescaled(dtype, count_calls):
    """Scores of std 20: a row's largest score lies e^13 to e^30 above its seed (the max of a
    sample of 16 keys), often past RESCALE_LIMIT, but within the size of the scores themselves,
    so the stale shift adds an error no larger than their rounding: such rows are rescaled
    alone, none folded again exactly; out and lse within the FA rule of the reference."""
    q, k, v, _ = make_inputs(24, 1, 256, 2, 1, 16, dtype)
    q *= 20
    calls = {name: count_calls(numpy_tiles, name) for name in ("_rescale_rows", "_fold_exactly", "_fold_rows_exactly")}
    out, lse = burstcu.attention(q, k, v, _group(tile_q=64, tile_k=64, threads=1), causal=True, return_lse=True)
    assert calls["_rescale_rows"] and not calls["_fold_exactly"] and not calls["_fold_rows_exactly"], \
        {name: len(c) for name, c in calls.items()}
    _assert_forward_within_fa_rule(q, k, v, True, dtype, out, lse)


def test_row_sums_beside_p_times_v():
    """_times_v: P @ [V | 1] as P @ V and the row sums apart, against float64 products."""
    rng = np.random.default_rng(4)
    p = rng.random((96, 80), dtype=np.float32)
    v = np.ones((80, 17), np.float32)
    v[:, :16] = rng.standard_normal((80, 16))
    out = np.full((96, 17), np.nan, np.float32)
    numpy_tiles._times_v(p, v, out)
    want = p.astype(np.float64) @ v.astype(np.float64)
    scale = np.abs(p).astype(np.float64) @ np.abs(v).astype(np.float64)
    assert (np.abs(out - want) <= 80 * EPS["float32"] * scale).all()
    np.testing.assert_allclose(out[:, 16], p.astype(np.float64).sum(axis=1), rtol=80 * EPS["float32"])


@pytest.mark.parametrize("src, dst_t", [(np.float32, np.float32), (np.float16, np.float32),
                                        (np.float64, np.float64), (np.float32, np.float64)])
def test_put_scales_as_one_multiply_in_the_layouts_dtype(src, dst_t):
    """`_put` lays a head out as x cast to dst's dtype times the scale there, one rounding (the
    bits of np.multiply in that dtype), then its extra columns — and stale values in dst (huge,
    inf, NaN), which its flat scaling pass runs over, raise no floating-point error."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 2, 8)).astype(src)         # (S, g, D): 2 query heads of a group
    column = rng.standard_normal(10)
    for stale in (np.finfo(dst_t).max, np.inf, np.nan):
        dst = np.full((10, 10), stale, dst_t)
        with np.errstate(all="raise"):
            numpy_tiles._put(dst, x, 4.0, column, np.inf)
        expected = np.multiply(x.astype(dst_t), dst_t(4.0)).reshape(10, 8)
        assert np.array_equal(dst[:, :8], expected)
        assert np.array_equal(dst[:, 8], column.astype(dst_t)) and (dst[:, 9] == np.inf).all()
    dst = np.full((10, 9), np.nan, dst_t)
    numpy_tiles._put(dst, x, None, 1)
    assert np.array_equal(dst[:, :8], x.astype(dst_t).reshape(10, 8)) and (dst[:, 8] == 1).all()


def test_forward_queues_layouts_then_the_largest_folds(monkeypatch):
    """One thread runs a forward step's items in queue order: each head's K/V layout first,
    then the folds largest first — causal spans grow down the sequence, so the last span's
    rows come first and the first span's last; out and lse as the reference's."""
    q, k, v, _ = make_inputs(5, 1, 256, 2, 2, 16, "float32")
    events = []
    max_abs, forward_block = numpy_op._max_abs, NumpyOps._forward_block
    monkeypatch.setattr(numpy_op, "_max_abs", lambda x: events.append("layout") or max_abs(x))

    def block(self, q, k, v, acc, part, *rest):
        events.append(part.q_start)
        return forward_block(self, q, k, v, acc, part, *rest)
    monkeypatch.setattr(NumpyOps, "_forward_block", block)
    out, lse = burstcu.attention(q, k, v, _group(tile_q=64, tile_k=64, threads=1), causal=True,
                                 return_lse=True)
    assert events == ["layout"] * 2 + [192, 192, 128, 128, 64, 64, 0, 0], events
    _assert_forward_within_fa_rule(q, k, v, True, "float32", out, lse)


@pytest.mark.timeout(120)
def test_a_failing_forward_layout_neither_hangs_nor_breaks_the_op(monkeypatch):
    """The forward's folds wait for their head's K/V layout. A layout on the pool thread fails,
    slowly: meanwhile the calling thread lays out the other head (once the pool thread is in
    its layout) and reaches a fold of the failing one, and waits. The call raises the layout's error — not the waiter's — no pool
    thread is left waiting, and the same op computes the next call exactly."""
    tiles = {"tile_q": 64, "tile_k": 64, "threads": 2}
    q, k, v, _ = make_inputs(3, 1, 512, 2, 2, 16, "float32")
    group, fresh = _group(**tiles), _group(**tiles)
    max_abs, failed, abandoned = numpy_op._max_abs, [], []
    wait = numpy_threads.InOrder.wait

    helper_in_layout = threading.Event()

    def failing(x):
        if threading.current_thread() is threading.main_thread():
            helper_in_layout.wait(timeout=20)   # the pool thread takes the other layout
        elif not failed:
            failed.append(1)
            helper_in_layout.set()
            time.sleep(0.5)
            raise MemoryError("simulated failure in a layout")
        return max_abs(x)

    def waiting(self, *args):
        try:
            wait(self, *args)
        except numpy_threads.Abandoned:
            abandoned.append(threading.current_thread() is threading.main_thread())
            raise
    monkeypatch.setattr(numpy_op, "_max_abs", failing)
    monkeypatch.setattr(numpy_threads.InOrder, "wait", waiting)
    with pytest.raises(MemoryError, match="simulated"):
        burstcu.attention(q, k, v, group, causal=True)
    monkeypatch.undo()
    assert failed and abandoned == [True]   # the calling thread was the waiter released
    barrier = threading.Barrier(tiles["threads"], timeout=20)
    list(group.ops._workers._pool.map(lambda _: barrier.wait(), range(tiles["threads"])))
    again = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
    want = burstcu.attention(q, k, v, fresh, causal=True, return_lse=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(again, want))
    group.close()
    fresh.close()


def test_blas_advice():
    """blas_advice speaks only when OpenBLAS runs AVX2 kernels on a CPU that has every AVX-512
    extension its SkylakeX kernels use, and says whether the environment pinned them."""
    advice = numpy_threads.blas_advice
    avx512 = ["fma", "avx2", "avx512f", "avx512bw", "avx512dq", "avx512vl"]
    haswell = [{"internal_api": "openblas", "architecture": "Haswell"}]
    said = advice(haswell, avx512, environ={})
    assert said and "picked its Haswell" in said and "OPENBLAS_CORETYPE=SkylakeX" in said
    pinned = advice([{"internal_api": "openblas", "architecture": "Zen"}], avx512,
                    environ={"OPENBLAS_CORETYPE": "Zen"})
    assert pinned and "OPENBLAS_CORETYPE=Zen in the environment" in pinned and "=SkylakeX" in pinned
    # another library's OpenBLAS beside NumPy's: NumPy's decides
    both = [{"internal_api": "openblas", "architecture": "Haswell", "filepath": "/x/scipy.libs/libopenblas.so"},
            {"internal_api": "openblas", "architecture": "SkylakeX", "filepath": "/x/numpy.libs/libopenblas.so"}]
    assert advice(both, avx512, environ={}) is None
    assert advice(both[:1], avx512, environ={})
    assert advice([{"internal_api": "openblas", "architecture": "SkylakeX"}], avx512, environ={}) is None
    assert advice(haswell, ["fma", "avx2", "avx512f"], environ={}) is None      # no avx512bw/dq/vl
    assert advice([{"internal_api": "mkl", "architecture": None}], avx512, environ={}) is None
    assert advice([], avx512, environ={}) is None
