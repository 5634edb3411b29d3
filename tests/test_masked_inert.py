"""The NumPy backend under causal masking: values at positions a row cannot see (NaN, Inf,
garbage) never reach that row's out, lse or gradients, nor a key's dk/dv through rows that cannot
see it — in one process and on a real MPI ring; and its results are bitwise the same for any
thread count."""

import threading

import numpy as np
import pytest

import burstcu
from burstcu.layout import Block
from burstcu.ops.numpy import tiles as numpy_tiles
from burstcu.ops.numpy import NumpyOps
from burstcu.testing.reference import attention_backward_ref, attention_ref, within_fa_rule
from tests.mpi.bodies import EPS, garbage, garbage_padding_is_inert, make_inputs, masked_positions_are_inert
from tests.mpi_run import run_mpi

LAYOUTS = ["contiguous", "zigzag"]
# 8 score rows x 8 keys: with 2 query heads per kv head, tiles of 4 positions x 8 keys, so the
# poisoned sites fall inside tiles that straddle the diagonal at these small sizes
SMALL_TILES = {"tile_q": 8, "tile_k": 8}


def _mpi4py():
    pytest.importorskip("mpi4py")


# -- NaN / +Inf planted in K and V ---------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_poison_one_process_default_tiles(layout):
    """group=None: the whole 24-row sequence is one tile straddling the diagonal."""
    result = masked_positions_are_inert(layout=layout, one_process=True)
    assert result["blind_rows"] > 0 and result["seeing_rows"] > 0 and result["nonfinite_out"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_poison_one_process_small_tiles(layout):
    _mpi4py()
    result = masked_positions_are_inert(layout=layout, seqlen_local=40, options=SMALL_TILES)
    assert result["blind_rows"] > 0 and result["nonfinite_out"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3])
def test_poison_on_the_ring(world, layout):
    results = run_mpi(world, "masked_positions_are_inert", layout=layout, options=SMALL_TILES)
    assert sum(r["blind_rows"] for r in results) > 0
    assert sum(r["seeing_rows"] for r in results) > 0
    assert sum(r["nonfinite_out"] for r in results) > 0


@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world,dtype", [(2, "float16"), (3, "bfloat16")])
def test_poison_on_the_ring_emulated_kernels(world, dtype, layout):
    """The CUDA kernels (on the CPU emulator) on a real MPI ring: their tiles (64-128 rows) are
    larger than a rank's chunk, so every poisoned site shares a tile with rows before it."""
    results = run_mpi(world, "masked_positions_are_inert", layout=layout, backend="emulated",
                      dtype=dtype, timeout=600)
    assert sum(r["blind_rows"] for r in results) > 0
    assert sum(r["nonfinite_out"] for r in results) > 0


# -- garbage where no row looks ------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_garbage_padding_one_process(layout):
    assert garbage_padding_is_inert(layout=layout, one_process=True)["real_rows"] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_garbage_padding_one_process_small_tiles(layout):
    _mpi4py()
    assert garbage_padding_is_inert(layout=layout, options=SMALL_TILES)["real_rows"] > 0


@pytest.mark.mpi
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3])
def test_garbage_padding_on_the_ring(world, layout):
    results = run_mpi(world, "garbage_padding_is_inert", layout=layout, options=SMALL_TILES)
    assert sum(r["real_rows"] for r in results) > 0


def _local_pass(ops, q, k, v, dout, blocks, scale):
    """One forward and one backward step of the local op over `blocks`."""
    state = ops.forward_init(q, scale)
    ops.forward_step(state, k, v, blocks)
    out, lse = ops.forward_finalize(state, q.dtype)
    ctx = ops.backward_init(k, v, scale)
    dq = np.zeros(q.shape, np.float32)
    ops.backward_step(ctx, q, dout, lse, ops.backward_delta(dout, out), dq, blocks)
    return (out, lse, dq) + ops.backward_finalize(ctx, q.dtype)


def _fill(kind, rng, shape):
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "garbage":
        return garbage(rng, shape)
    # finite, but dO . v overflows float32: dS = P * (dP - delta) is 0 * inf at masked pairs
    return rng.choice(np.array([-3e38, 3e38], np.float32), size=shape)


@pytest.mark.parametrize("fill", ["garbage", "huge"])
@pytest.mark.parametrize("tiles", [SMALL_TILES, {"tile_q": 16, "tile_k": 32}, {}])
def test_keys_no_row_sees_are_inert(tiles, fill):
    """Queries at positions 0..26 against keys 0..39 (as in a ring step): keys 27..39 are in
    every query's future. Garbage (random bits, or huge finite values) there and in the query
    rows no block covers leaves every output equal to zero padding — dk, dv of those keys
    exactly 0 — and correct."""
    s, real, scale = 40, 27, 0.3
    q, k, v, dout = make_inputs(5, 1, s, 4, 2, 16, "float32")
    blocks = [Block(0, real, 0, s, q_pos=0, k_pos=0, causal=True)]
    rng = np.random.default_rng(6)
    results = {}
    for kind in ("zeros", fill):
        padded = []
        for x in (q, k, v, dout):
            x = x.copy()
            x[:, real:] = _fill(kind, rng, x[:, real:].shape)
            padded.append(x)
        with np.errstate(all="ignore"):
            results[kind] = _local_pass(NumpyOps(**tiles), *padded, blocks, scale)
    names = ("out", "lse", "dq", "dk", "dv")
    garbage_out = dict(zip(names, results[fill]))
    for name, zero, junk in zip(names, results["zeros"], results[fill]):
        rows = slice(None) if name in ("dk", "dv") else slice(0, real)
        at = (slice(None), slice(None), rows) if name == "lse" else (slice(None), rows)
        assert np.isfinite(junk[at]).all(), name
        assert np.array_equal(zero[at], junk[at]), f"{name} differs from zero padding with {fill}"
    assert not garbage_out["dk"][:, real:].any() and not garbage_out["dv"][:, real:].any()
    # and zero padding itself is right: the reference over the same pairs
    keep = np.tril(np.ones((real, s), bool))
    ref_out, ref_lse = attention_ref(q[:, :real], k, v, softmax_scale=scale, keep=keep)
    nv_out, nv_lse = attention_ref(q[:, :real], k, v, softmax_scale=scale, keep=keep, dtype=np.float32)
    grads = attention_backward_ref(dout[:, :real], q[:, :real], k, v, softmax_scale=scale, keep=keep)
    naive = attention_backward_ref(dout[:, :real], q[:, :real], k, v, softmax_scale=scale, keep=keep,
                                   dtype=np.float32)
    checks = [("out", ref_out, nv_out, 2.0), ("lse", ref_lse, nv_lse, 2.0)] + [
        (name, ref, nv, 3.0) for name, ref, nv in zip(("dq", "dk", "dv"), grads, naive)]
    for name, ref, nv, factor in checks:
        got = garbage_out[name]
        got = got[:, :, :real] if name == "lse" else got if name in ("dk", "dv") else got[:, :real]
        ok, err, bound = within_fa_rule(got, ref, nv, EPS["float32"], factor)
        assert ok, (name, err, bound)


@pytest.mark.parametrize("tiles", [None, SMALL_TILES])
def test_nan_query_and_inf_dout_rows_stay_out_of_keys_they_cannot_see(tiles):
    """A NaN in q at position 5 (head 1) and an Inf in dout at position 9 (head 0), one kv head
    per head: every other row's out, lse and dq, and dk, dv of every key after the poisoned row
    of its head (keys that row cannot see) stay finite and match the reference on the clean
    inputs."""
    if tiles is not None:
        _mpi4py()
    group = None if tiles is None else burstcu.init(backend="numpy", **tiles)
    n, sites = 32, {1: 5, 0: 9}                   # head: position of its poisoned row
    q, k, v, dout = make_inputs(12, 1, n, 2, 2, 16, "float32")
    qp, dp = q.copy(), dout.copy()
    qp[0, sites[1], 1, 4], dp[0, sites[0], 0, 2] = np.nan, np.inf
    with np.errstate(all="ignore"):
        out, lse = burstcu.attention(qp, k, v, group, causal=True, return_lse=True)
        dq, dk, dv = burstcu.attention_backward(dp, qp, k, v, out, lse, group, causal=True)
    (ref_out, ref_lse), (nv_out, nv_lse) = (attention_ref(q, k, v, True, dtype=dt)
                                            for dt in (np.float64, np.float32))
    grads, naive = (attention_backward_ref(dout, q, k, v, True, dtype=dt) for dt in (np.float64, np.float32))
    other_rows = np.ones((1, n, 2), bool)          # (batch, position, head)
    later_keys = np.zeros((1, n, 2), bool)
    for head, pos in sites.items():
        other_rows[0, pos, head] = False
        later_keys[0, pos + 1:, head] = True
    checks = [("out", out, ref_out, nv_out, other_rows, 2.0),
              ("lse", lse, ref_lse, nv_lse, other_rows.transpose(0, 2, 1), 2.0),
              ("dq", dq, grads[0], naive[0], other_rows, 3.0),
              ("dk", dk, grads[1], naive[1], later_keys, 3.0),
              ("dv", dv, grads[2], naive[2], later_keys, 3.0)]
    for name, got, ref, nv, sel, factor in checks:
        assert np.isfinite(got[sel]).all(), name
        ok, err, bound = within_fa_rule(got[sel], ref[sel], nv[sel], EPS["float32"], factor)
        assert ok, (name, err, bound)
    assert np.isnan(out[0, sites[1], 1]).all() and not np.isfinite(dv[0, :sites[0] + 1, 0]).all()
    if group is not None:
        group.close()


# -- the thread count changes nothing ------------------------------------------------------------

@pytest.mark.parametrize("score_std", [1, 6])
@pytest.mark.parametrize("tiles", [{"tile_q": 64, "tile_k": 96}, {}])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bitwise_independent_of_thread_count(dtype, causal, layout, tiles, score_std, count_calls):
    """One batch and one kv head (fewer than the threads): out, lse, dq, dk, dv bitwise equal
    for 1 to 4 threads — also with peaked scores (q x 6), whose rows the forward rescales
    alone (`_rescale_rows`, asserted to run) or folds again exactly."""
    _mpi4py()
    q, k, v, dout = make_inputs(9, 1, 1300, 2, 1, 32, dtype)
    q *= score_std
    rescaled = count_calls(numpy_tiles, "_rescale_rows")
    runs = []
    for threads in (1, 2, 3, 4):
        group = burstcu.init(backend="numpy", threads=threads, **tiles)
        out, lse = burstcu.attention(q, k, v, group, causal=causal, layout=layout, return_lse=True)
        grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal, layout=layout)
        group.close()
        runs.append([x.tobytes() for x in (out, lse, *grads)])
    for threads, run in zip((2, 3, 4), runs[1:]):
        for name, one, many in zip(("out", "lse", "dq", "dk", "dv"), runs[0], run):
            assert one == many, f"{name} with {threads} threads differs from 1 thread"
    assert bool(rescaled) == (score_std > 1), len(rescaled)


@pytest.mark.timeout(120)
def test_a_failing_work_item_neither_hangs_nor_breaks_the_op(monkeypatch):
    """The backward's items add their dq partials in key order, later ones waiting for earlier
    ones: when the first key range fails, the call raises that error, no pool thread is left
    waiting, and the same op computes the next call exactly."""
    _mpi4py()
    tiles = {"tile_q": 64, "tile_k": 64, "threads": 4}
    q, k, v, dout = make_inputs(3, 1, 512, 2, 1, 16, "float32")
    group, fresh = burstcu.init(backend="numpy", **tiles), burstcu.init(backend="numpy", **tiles)
    out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
    original = NumpyOps._backward_block

    def failing(self, *args):
        block = next(a for a in args if isinstance(a, Block))
        if block.k_start == 0:   # the block of key range 0, which every later range waits for
            raise MemoryError("simulated failure in key range 0")
        return original(self, *args)
    monkeypatch.setattr(NumpyOps, "_backward_block", failing)
    with pytest.raises(MemoryError, match="simulated"):
        burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
    monkeypatch.undo()
    # every pool thread is free again: all of them can meet at a barrier
    barrier = threading.Barrier(tiles["threads"], timeout=20)
    list(group.ops._workers._pool.map(lambda _: barrier.wait(), range(tiles["threads"])))
    again = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
    want = burstcu.attention_backward(dout, q, k, v, out, lse, fresh, causal=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(again, want))
    group.close()
    fresh.close()


@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world,dtype", [(2, "float16"), (3, "bfloat16")])
def test_garbage_padding_on_the_ring_emulated_kernels(world, dtype, layout):
    results = run_mpi(world, "garbage_padding_is_inert", layout=layout, backend="emulated",
                      dtype=dtype, timeout=600)
    assert sum(r["real_rows"] for r in results) > 0
