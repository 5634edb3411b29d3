"""kernels/flash_fwd.cu under the CPU emulator, through KernelOps(backend="emulated").

Reference: burstcu/testing/reference.py in float64 (full score matrix, explicit softmax, never calling
burstcu) over the union of the Blocks' rectangles (`keep_from_blocks`). Tolerance,
FlashAttention's rule:
    |kernel - ref64| <= 2 * |naive - ref64| + atol
where "naive" is what a plain same-dtype attention computes (inputs in fp16/bf16, scores and
softmax in fp32, the unnormalized P = exp(s - rowmax) rounded to the dtype before P @ V as the
kernel stores it, output rounded to the dtype), and atol is the
dtype's rounding noise at the output's magnitude.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from burstcu.build.fwd_variants import SM90_FAMILY
from burstcu.ops.cuda.kernel_ops import SM90_MAX_RECTS
from burstcu.layout import Block
from tests.kernels.backend import BACKEND, kernel_ops
from burstcu.testing.reference import attention_ref, keep_from_blocks

ml_dtypes = pytest.importorskip("ml_dtypes")
pytest.importorskip("burstcu.build.emulate")

pytestmark = pytest.mark.emulated

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@pytest.fixture(scope="module")
def ops():
    return kernel_ops()


def make(dtype, b, sq, sk, h, hkv, d, seed=0):
    rng = np.random.default_rng(seed)
    cast = DTYPES[dtype]
    q = rng.standard_normal((b, sq, h, d)).astype(cast)
    k = rng.standard_normal((b, sk, hkv, d)).astype(cast)
    v = rng.standard_normal((b, sk, hkv, d)).astype(cast)
    return q, k, v


def run_kernel(ops, q, k, v, steps, scale=None, last=False):
    """steps: list of (k, v, blocks) folded in order, the last one said to be so with `last`.
    Returns (out float64, lse)."""
    state = ops.forward_init(q, scale)
    for i, (kk, vv, blocks) in enumerate(steps):
        ops.forward_step(state, kk, vv, blocks, last and i == len(steps) - 1)
    out, lse = ops.forward_finalize(state, q.dtype)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    return out.astype(np.float64), lse.astype(np.float64)


def check(ops, dtype, q, k, v, blocks, steps=None, scale=None, last=False):
    """Run the kernel (`run_kernel`) and assert the FlashAttention tolerance rule on out and lse.
    Returns the (kernel error, naive error) of out for reporting."""
    d = q.shape[-1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    keep = keep_from_blocks(blocks, q.shape[1], k.shape[1])
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=scale, keep=keep)
    naive, naive_lse = attention_ref(q, k, v, softmax_scale=scale, keep=keep, dtype=np.float32,
                                     round_to=DTYPES[dtype], unnormalized_p=True)
    naive = naive.astype(np.float64)  # already rounded to the dtype
    out, lse = run_kernel(ops, q, k, v, steps or [(k, v, blocks)], scale, last)

    assert np.isfinite(out).all(), "NaN/inf in out"
    empty = ~keep.any(axis=1)  # query rows that saw no key
    assert (out[:, empty] == 0).all()
    assert np.isneginf(lse[:, :, empty]).all()
    assert np.isfinite(lse[:, :, ~empty]).all()

    err = np.abs(out - ref).max()
    naive_err = np.abs(naive - ref).max()
    rounding = np.abs((ref + 0.3).astype(DTYPES[dtype]).astype(np.float64) - 0.3 - ref).max()
    assert err <= 2 * naive_err + 2 * rounding + 1e-6, (err, naive_err, rounding)

    seen = ~empty
    lse_err = np.abs(lse[:, :, seen] - ref_lse[:, :, seen]).max(initial=0)
    naive_lse_err = np.abs(naive_lse[:, :, seen] - ref_lse[:, :, seen]).max(initial=0)
    assert lse_err <= 2 * naive_lse_err + 1e-4, (lse_err, naive_lse_err)
    return err, naive_err


def full(sq, sk):
    return [Block(0, sq, 0, sk, 0, 0, False)]


# ------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", [32, 64, 80, 128])
def test_headdims(ops, dtype, d):
    """Every native head dim, plus 80 (runs the 96 kernel with zero padding)."""
    q, k, v = make(dtype, 1, 128, 128, 2, 2, d)
    check(ops, dtype, q, k, v, full(128, 128))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", [96, 256, 40])
def test_headdims_more(ops, dtype, d):
    q, k, v = make(dtype, 1, 96, 64, 1, 1, d)
    check(ops, dtype, q, k, v, full(96, 64))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("q_pos,k_pos", [
    (0, 0),       # the diagonal straddles every tile of the block
    (300, 260),   # queries 40 positions ahead: shifted diagonal
    (0, 64),      # first 64 query rows see no key (lse -inf, out 0; no NaN), the rest straddle
    (1000, 0),    # wholly in the past: causal flag set but nothing masked
])
def test_causal_offsets(ops, dtype, q_pos, k_pos):
    q, k, v = make(dtype, 1, 128, 128, 2, 2, 64, seed=1)
    check(ops, dtype, q, k, v, [Block(0, 128, 0, 128, q_pos, k_pos, True)])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_fully_future_block(ops, dtype):
    """A block wholly in the future (every key after every query) leaves the state untouched,
    alone (all rows empty) and next to a visible block."""
    q, k, v = make(dtype, 1, 64, 128, 1, 1, 64, seed=2)
    future = Block(0, 64, 64, 64, 0, 100, True)
    check(ops, dtype, q, k, v, [future])
    check(ops, dtype, q, k, v, [Block(0, 64, 0, 64, 0, 0, False), future])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_ragged(ops, dtype, causal):
    """Lengths that are no multiple of any tile, and sub-rectangles starting mid-tensor."""
    q, k, v = make(dtype, 2, 77, 200, 2, 2, 64, seed=3)
    blocks = [Block(0, 77, 0, 200, 150, 0, causal)]
    check(ops, dtype, q, k, v, blocks)
    sub = [Block(5, 50, 33, 130, 120, 40, causal)]  # rows 55..76 and keys outside 33..162 see nothing
    check(ops, dtype, q, k, v, sub)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_gqa(ops, dtype, causal):
    """H = 4 query heads over Hkv = 2: head h reads kv head h // 2."""
    q, k, v = make(dtype, 1, 96, 96, 4, 2, 32, seed=4)
    check(ops, dtype, q, k, v, [Block(0, 96, 0, 96, 0, 0, causal)])


def split_steps(k, v, at: int, q_len: int, q_pos: int):
    """K/V rows [0, at) and [at, Sk) as two forward_step calls (causal, keys from position 0)."""
    a, b = slice(0, at), slice(at, k.shape[1])
    return [(k[:, a], v[:, a], [Block(0, q_len, 0, at, q_pos, 0, True)]),
            (k[:, b], v[:, b], [Block(0, q_len, 0, k.shape[1] - at, q_pos, at, True)])]


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_state_across_calls(ops, dtype):
    """Folding K/V in two forward_step calls equals one call over the concatenation.

    Split on a key-tile boundary (the kernel's BLOCK_N), the kernel sees the same tiles with the
    same running max, so only the fp32 order of the row sums differs: the outputs agree to the
    last bit or two of the dtype. Split mid-tile (77), P is rounded against different running
    maxima, so the two differ like any two correct fp16 kernels: both must meet the tolerance rule.
    """
    tile = ops.forward_variant(dtype, 64).launch.block_n
    q, k, v = make(dtype, 1, 128, tile + 128, 2, 1, 64, seed=5)
    blocks = [Block(0, 128, 0, tile + 128, 100, 0, True)]
    out1, lse1 = run_kernel(ops, q, k, v, [(k, v, blocks)])
    out2, lse2 = run_kernel(ops, q, k, v, split_steps(k, v, tile, 128, 100))
    eps = float(ml_dtypes.finfo(DTYPES[dtype]).eps)
    assert (np.abs(out1 - out2) <= 2 * eps * np.maximum(np.abs(out1), np.abs(out2)) + 1e-6).all()
    assert np.abs(lse1 - lse2).max() <= 1e-5
    check(ops, dtype, q, k, v, blocks, steps=split_steps(k, v, 77, 128, 100))


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_two_blocks_one_step(ops, dtype):
    """A zigzag-like step: two query segments against two key segments in one forward_step,
    one full rectangle and one straddling the diagonal."""
    q, k, v = make(dtype, 1, 128, 128, 2, 2, 64, seed=6)
    blocks = [Block(0, 64, 0, 64, 64, 0, False),      # early queries, earlier keys: full
              Block(64, 64, 0, 64, 448, 448, True),   # late queries, late keys: diagonal
              Block(64, 64, 64, 64, 448, 0, False)]   # late queries, early keys: full
    check(ops, dtype, q, k, v, blocks)


def test_randomized_thread_order():
    """The emulator's shuffled thread order finds races on shared memory between barriers."""
    ops = kernel_ops(randomize=True)
    q, k, v = make("float16", 1, 96, 130, 2, 2, 64, seed=7)
    check(ops, "float16", q, k, v, [Block(0, 96, 0, 130, 40, 0, True)])


@pytest.mark.parametrize("d", [64, 128, 256])
def test_sm90_tiles(d):
    """The sm_90 table's forward tiles (measured on an H100: 64 x 64 with 4 warps at d = 64,
    128 x 128 and 128 x 64 with 8 warps at d = 128 and 256), ragged and causal."""
    ops = kernel_ops(arch="sm_90")
    q, k, v = make("bfloat16", 1, 140, 150, 2, 1, d, seed=9)
    check(ops, "bfloat16", q, k, v, [Block(0, 140, 0, 150, 20, 0, True)])


def test_scale_and_float32_out(ops):
    """An explicit softmax scale is used as given; out_dtype float32 skips the final rounding."""
    q, k, v = make("bfloat16", 1, 64, 64, 1, 1, 64, seed=8)
    state = ops.forward_init(q, 0.05)
    ops.forward_step(state, k, v, full(64, 64))
    out, lse = ops.forward_finalize(state, np.float32)
    assert out.dtype == np.float32
    keep = keep_from_blocks(full(64, 64), 64, 64)
    ref, ref_lse = attention_ref(q, k, v, softmax_scale=0.05, keep=keep)
    assert np.abs(out - ref).max() < 2e-2
    assert np.abs(lse - ref_lse).max() < 1e-4


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("rows_aligned", [True, False], ids=["8-wide", "1-wide"])
def test_finalize_divides_every_row(ops, out_dtype, rows_aligned, monkeypatch):
    """flash_fwd_finalize on a state written here: out = acc / l rounded once to out_dtype, lse =
    (m + log2 l) ln 2; a row with l = 0 gives 0 and -inf, a row with l NaN gives NaN. Rows on 16
    bytes take the 8-elements-a-thread path, acc shifted by one float (on the device) the 1-wide
    one."""
    from burstcu.ops.cuda import kernel_ops as kernel_ops_module

    widths = []
    packer = kernel_ops_module.fwd_finalize_params
    monkeypatch.setattr(kernel_ops_module, "fwd_finalize_params",
                        lambda *a: widths.append(a[-1]) or packer(*a))
    B, S, H, D = 2, 37, 3, 64
    rng = np.random.default_rng(21)
    q = rng.standard_normal((B, S, H, D)).astype(np.float16)
    state = ops.forward_init(q)
    acc = (rng.standard_normal((B, S, H, D)) * 3).astype(np.float32)
    m = rng.standard_normal((B, H, S)).astype(np.float32)
    l = rng.uniform(0.5, 40.0, (B, H, S)).astype(np.float32)
    l[0, 1, 5] = 0.0
    l[1, 2, 7] = np.nan
    buf = ops.to_device(np.zeros(acc.size + 1, np.float32))   # the shift made where acc lives
    shifted = (buf[:-1] if rows_aligned else buf[1:]).reshape(acc.shape)
    shifted[...] = ops.to_device(acc)
    state.acc, state.m, state.l = shifted, ops.to_device(m), ops.to_device(l)
    state.fresh = False   # the state written here
    out, lse = ops.forward_finalize(state, out_dtype)
    assert widths == [8 if rows_aligned else 1]
    assert out.shape == (B, S, H, D) and lse.shape == (B, H, S)
    l_rows = l.astype(np.float64).transpose(0, 2, 1)[..., None]      # (B, S, H, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref = np.where(l_rows == 0, 0.0, acc.astype(np.float64) / l_rows)
        ref_lse = np.where(l == 0, -np.inf,
                           (m.astype(np.float64) + np.log2(l.astype(np.float64))) * math.log(2))
    got = out.astype(np.float64)
    nan_rows = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan_rows)
    assert np.isnan(lse[1, 2, 7]) and lse[0, 1, 5] == -np.inf
    assert np.all(got[0, 5, 1] == 0.0)
    # one rounding to out_dtype: half an ulp, or half the smallest subnormal step of float16,
    # on top of fp32's division (a few ulp of 2^-24)
    eps, tiny = {"float16": (2.0 ** -11, 2.0 ** -25), "bfloat16": (2.0 ** -8, 2.0 ** -134),
                 "float32": (2.0 ** -22, 2.0 ** -149)}[out_dtype]
    ok = ~nan_rows
    err = np.abs(got[ok] - ref[ok])
    assert np.all(err <= (eps + 2.0 ** -21) * np.abs(ref[ok]) + tiny), err.max()
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max() < 1e-5 * np.abs(ref_lse[fin]).max() + 1e-6


def test_rejects_bad_input(ops):
    q, k, v = make("float16", 1, 16, 16, 3, 2, 64)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ops.forward_step(ops.forward_init(q, None), k, v, full(16, 16))
    state = ops.forward_init(q[:, :, :2], None)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        ops.forward_init(q.astype(np.float32), None)
    with pytest.raises(ValueError, match="outside"):
        ops.forward_step(state, k, v, [Block(0, 16, 8, 16, 0, 0, False)])


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("block", [
    Block(0, 96, 0, 256, 180, 0, True, 37),      # causal window: late rows skip early key tiles
    Block(0, 77, 0, 200, 30, 0, False, 20, 9),   # both edges, no causal, ragged
    Block(0, 64, 0, 96, 60, 0, False, 40),       # left edge only; rows 0..(some) see few keys
    Block(0, 64, 0, 128, 0, 0, False, 0, 0),     # each row its own key: one visible key a row
    # the first row's first key the last of a key tile (63, 127): that tile is loaded
    Block(0, 64, 0, 160, 100, 0, False, 37),
    Block(0, 64, 0, 200, 160, 0, False, 33),
    Block(0, 128, 0, 256, 190, 0, True, 63),
])
def test_windows(ops, dtype, block):
    """Sliding-window bounds (Block.left / right) as the kernels' key bounds, against float64
    over the explicit mask keep_from_blocks builds."""
    q, k, v = make(dtype, 1, block.q_len, block.k_len, 2, 1, 64, seed=7)
    check(ops, dtype, q, k, v, [block])


# ------------------------------------------------------------------------------------------------
# a ring step's rectangles in one launch (flash_fwd_steps)

def _counting(ops):
    """Count the kernel launches of `ops` (a KernelOps, or HostArrays around one) by kernel name
    (the template's name before '<'): every launch looks its kernel up through `function`."""
    counts: dict = {}
    inner = getattr(ops, "ops", ops)
    function = inner.function

    def counted(name):
        kernel = name.split("<")[0]
        counts[kernel] = counts.get(kernel, 0) + 1
        return function(name)
    inner.function = counted
    return counts


STEP_CASES = {   # name: (dtype, d, G, N, documents, causal, window, H, Hkv)
    "per-document zigzag, causal": ("float16", 64, 3, 150, (0, 17, 40, 41, 90, 150), True, (-1, -1), 4, 2),
    "zigzag, window, bf16, d 80": ("bfloat16", 80, 2, 100, None, False, (20, 5), 2, 2),
    "per-document zigzag, causal window, d 128": ("float16", 128, 2, 96, (0, 30, 96), True, (24, 0), 2, 1),
}


def ring_steps(cases: dict, case: str, rng):
    """(q, k, v, blocks) of every step of cases[case]'s G-rank zigzag ring (cases as STEP_CASES)
    whose mask cuts it into several rectangles, q (1, Sq, H, D), k, v (1, Sk, Hkv, D) drawn from
    rng for every (q rank, kv rank) in order, listed or not."""
    from burstcu import layout

    dtype, d, size, n, docs, causal, window, h, hkv = cases[case]
    part = layout.partition("zigzag", size, n, docs)
    for qr in range(size):
        q = rng.standard_normal((1, part.lengths[qr], h, d)).astype(DTYPES[dtype])
        for kr in range(size):
            k, v = (rng.standard_normal((1, part.lengths[kr], hkv, d)).astype(DTYPES[dtype])
                    for _ in range(2))
            blocks = layout.blocks(part, qr, kr, causal, window, docs)
            if len(blocks) >= 2:
                yield q, k, v, blocks


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_a_step_in_one_launch_is_a_launch_a_rectangle_bit_for_bit(case):
    """Every step of a G-rank ring with several rectangles: forward_step over the whole list is
    one flash_fwd_steps launch (its careful twin beside it where pairs are masked) and gives the
    same bits, out and lse, as one flash_fwd_step launch a rectangle in the list's order; the
    list path against float64 too (the FlashAttention rule, `check`). On the sm_90a table a step
    of at most SM90_MAX_RECTS rectangles is the Hopper kernel a launch a rectangle both ways; a
    longer one is the list kernel, the same bits as the sm_90 table's kernel a rectangle."""
    dtype, d = STEP_CASES[case][:2]
    # shuffled thread order: a race on smem between rectangles shows
    ops = kernel_ops(randomize=True, pack_lists=False)
    counts = _counting(ops)
    hopper = ops.forward_variant(DTYPES[dtype], d).family == SM90_FAMILY
    if hopper:   # the sm_80 list here; the Hopper list's own: test_flash_fwd_sm90_lists_emulated.py
        getattr(ops, "ops", ops).sm90_lists = False
    # on the sm_90a table a single rectangle runs the Hopper kernel: the list's per-rectangle
    # twin is flash_fwd_step of the sm_90 table (the same mma.sync tiles)
    mma_sync = kernel_ops(randomize=True, arch="sm_90", pack_lists=False) if hopper else ops
    listed_steps = 0
    for q, k, v, blocks in ring_steps(STEP_CASES, case, np.random.default_rng(3)):
        counts.clear()
        whole = ops.forward_init(q)
        ops.forward_step(whole, k, v, blocks)
        masked = any(b.masked for b in blocks)
        per_rect = ops  # what runs one rectangle a launch with the kernels of the whole step
        if hopper and len(blocks) <= SM90_MAX_RECTS:
            # the Hopper kernel folds a rectangle a launch (plain + careful where masked)
            assert counts.get("flash_fwd_step_sm90") == len(blocks) + sum(b.masked for b in blocks), counts
            assert "flash_fwd_steps" not in counts, counts
        else:
            assert counts.get("flash_fwd_steps") == (2 if masked else 1), counts
            assert "flash_fwd_step" not in counts and "flash_fwd_step_sm90" not in counts, counts
            per_rect = mma_sync
        one_by_one = per_rect.forward_init(q)
        for blk in blocks:
            per_rect.forward_step(one_by_one, k, v, [blk])
        (out_a, lse_a), (out_b, lse_b) = (ops.forward_finalize(s, q.dtype)
                                          for s in (whole, one_by_one))
        assert np.array_equal(out_a.view(np.uint16), out_b.view(np.uint16))
        assert np.array_equal(lse_a.view(np.uint32), lse_b.view(np.uint32))
        if listed_steps == 0:
            check(ops, dtype, q, k, v, blocks)
        listed_steps += 1
    assert listed_steps >= 2


def test_query_ranges_that_overlap_unequal_run_a_launch_a_rectangle():
    """Blocks whose query ranges overlap without being equal cannot share a list launch (two
    blocks of threads would hold the same rows' state): forward_step runs flash_fwd_step a
    Block, the same bits as a step a Block."""
    from burstcu.layout import Block
    ops = kernel_ops(arch="sm_90")
    counts = _counting(ops)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 40, 2, 64)).astype(np.float16)
    k, v = (rng.standard_normal((1, 40, 2, 64)).astype(np.float16) for _ in range(2))
    blocks = [Block(0, 24, 0, 20, 0, 0, False), Block(16, 24, 20, 20, 16, 20, False)]
    whole = ops.forward_init(q)
    ops.forward_step(whole, k, v, blocks)
    assert counts == {"flash_fwd_step": 2}, counts
    apart = ops.forward_init(q)
    for blk in blocks:
        ops.forward_step(apart, k, v, [blk])
    (out_a, lse_a), (out_b, lse_b) = (ops.forward_finalize(s, q.dtype) for s in (whole, apart))
    assert np.array_equal(out_a.view(np.uint16), out_b.view(np.uint16))
    assert np.array_equal(lse_a.view(np.uint32), lse_b.view(np.uint32))


def test_a_steps_rectangle_list_is_built_once_and_kept(monkeypatch):
    """The rectangle list of a ring step given whole (a StepBlocks, as `layout.blocks` caches
    them) is built and uploaded on its first forward_step and reused by the next call (a model's
    next layer); `release_buffers` frees it, and so does the StepBlocks' end. A plain list of the
    same Blocks is built every call and gives the same bits."""
    import gc

    from burstcu.layout import StepBlocks
    from burstcu.ops.cuda import kernel_ops as kernel_ops_module

    builds = []
    build = kernel_ops_module.step_group_lists
    monkeypatch.setattr(kernel_ops_module, "step_group_lists",
                        lambda *args: builds.append(args[1]) or build(*args))
    ops = kernel_ops(arch="sm_80")
    q, k, v, blocks = next(ring_steps(STEP_CASES, "per-document zigzag, causal", np.random.default_rng(5)))
    step = StepBlocks(blocks.array)   # not in layout's cache: only this test holds it
    outs = []
    for given, want in ((step, 1), (step, 1), (list(blocks), 2)):
        state = ops.forward_init(q)
        ops.forward_step(state, k, v, given)
        outs.append(ops.forward_finalize(state, q.dtype))
        assert len(builds) == want
    ops.release_buffers()
    ops.forward_step(ops.forward_init(q), k, v, step)
    assert len(builds) == 3 and builds[0] is step and builds[2] is step
    kept = getattr(ops, "ops", ops).__dict__["_step_lists"]
    assert len(kept) == 1
    del step, builds[:], state
    gc.collect()
    assert len(kept) == 0
    for out, lse in outs[1:]:
        assert np.array_equal(out.view(np.uint16), outs[0][0].view(np.uint16))
        assert np.array_equal(lse.view(np.uint32), outs[0][1].view(np.uint32))


# ------------------------------------------------------------------------------------------------
# a pass of one fold: flash_fwd_pass (KernelOps.whole_pass)

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d,block", [
    (32, Block(0, 200, 0, 150, 0, 0, True)),
    (80, Block(0, 150, 0, 200, 0, 0, False)),      # runs the 96 tiles, zero-padded
    (96, Block(0, 130, 0, 160, 0, 90, True)),      # rows 0..89 see no key: whole blocks of them
    (128, Block(0, 100, 0, 256, 180, 0, True, 37)),  # a causal window
])
def test_a_pass_of_one_fold_runs_flash_fwd_pass(ops, dtype, d, block):
    """A fold over every query row said to be the pass's last, from a fresh state, on the
    mma.sync tiles: flash_fwd_pass alone (its careful twin beside it under masks), no state
    allocated, no finalize; bit for bit the zeroed state, flash_fwd_step and flash_fwd_finalize
    on the emulator; FlashAttention's rule against float64."""
    inner = getattr(ops, "ops", ops)
    if inner.forward_variant(dtype, d).family != "forward":
        pytest.skip("this table runs the Hopper kernel at this head dim")
    q, k, v = make(dtype, 2, block.q_len, block.k_len, 4, 2, d, seed=d)
    counts = _counting(ops)
    state = ops.forward_init(q, None)
    ops.forward_step(state, k, v, [block], True)
    got = ops.forward_finalize(state, q.dtype)
    scan = {"flash_any_nonfinite": 1} if block.masked else {}
    assert counts == {"flash_fwd_pass": 2 if block.masked else 1, **scan}, counts
    assert state.acc is None
    counts.clear()
    state = ops.forward_init(q, None)
    inner._materialize(state)   # as every fold but such a pass runs
    ops.forward_step(state, k, v, [block], True)
    want = ops.forward_finalize(state, q.dtype)
    assert counts == {"flash_fwd_step": 2 if block.masked else 1, "flash_fwd_finalize": 1, **scan}, counts
    if BACKEND == "emulated":
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    check(ops, dtype, q, k, v, [block], last=True)


def test_the_sm80_table_has_no_pass_at_d64():
    """At d = 64 the sm_80 tiles keep flash_fwd_step and the finalize: flash_fwd_pass took one
    block a SM there where the step keeps two (fwd_variants.PASS_HEADDIMS)."""
    ops = kernel_ops(arch="sm_80")
    q, k, v = make("float16", 1, 96, 96, 2, 1, 64)
    counts = _counting(ops)
    check(ops, "float16", q, k, v, full(96, 96), last=True)
    assert counts == {"flash_fwd_step": 1, "flash_fwd_finalize": 1}, counts


@pytest.mark.skipif(BACKEND != "emulated", reason="bit for bit, on the emulator")
@pytest.mark.parametrize("arch,d", [("sm_80", 96), ("sm_90", 96), ("sm_90a", 128)])
@pytest.mark.parametrize("poison", ["v unseen", "k seen", "none, two folds"])
def test_a_pass_of_one_fold_keeps_the_unfused_bits(arch, d, poison):
    """A pass of one fold (flash_fwd_pass; sm_90a: the Hopper step's fresh and finalize) against
    the zeroed state, the step and flash_fwd_finalize, bit for bit (NaN where NaN): a NaN and an
    Inf in V at keys some rows cannot see (causal: the careful twin runs, those rows stay
    finite), a NaN in K at a key rows see (their out and lse NaN), and a first fold over every
    row that is not the last (no pass: the state written, then read)."""
    ops = kernel_ops(arch=arch)
    inner = getattr(ops, "ops", ops)
    q, k, v = make("float16", 1, 150, 150, 2, 1, d, seed=3)
    block = Block(0, 150, 0, 150, 0, 0, True)
    if poison == "v unseen":
        v[:, 100], v[:, 120] = np.nan, np.inf   # rows before 100 (120) cannot see them
    elif poison == "k seen":
        k[:, 30] = np.nan                       # seen by rows 30 on
    steps = ([(k, v, [block])] if poison != "none, two folds" else
             [(k[:, :64], v[:, :64], [Block(0, 150, 0, 64, 0, 0, True)]),
              (k[:, 64:], v[:, 64:], [Block(0, 150, 0, 86, 0, 64, True)])])
    counts = _counting(ops)
    state = ops.forward_init(q, None)
    for i, (kk, vv, blocks) in enumerate(steps):
        ops.forward_step(state, kk, vv, blocks, i == len(steps) - 1)
    got = ops.forward_finalize(state, q.dtype)
    hopper = inner.forward_variant("float16", d).family != "forward"
    assert ("flash_fwd_pass" in counts) == (len(steps) == 1 and not hopper), counts
    assert ("flash_fwd_finalize" in counts) == (len(steps) > 1 and not hopper), counts
    state = ops.forward_init(q, None)
    inner._materialize(state)
    for kk, vv, blocks in steps:
        ops.forward_step(state, kk, vv, blocks)
    want = ops.forward_finalize(state, q.dtype)
    for a, b in zip(got, want):
        assert np.array_equal(a.astype(np.float32), b.astype(np.float32), equal_nan=True)
    out, lse = got
    if poison == "v unseen":
        assert np.isfinite(out[:, :100].astype(np.float32)).all() and np.isnan(out[:, 100:]).any()
    if poison == "k seen":
        assert np.isnan(lse[:, :, 30:]).all() and np.isfinite(lse[:, :, :30]).all()
