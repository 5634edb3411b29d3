"""kernels/flash_fwd_sm90.cu (the Hopper forward step: wgmma, TMA, mbarriers, warp
specialisation) under the CPU emulator, through KernelOps(backend="emulated", arch="sm_90a").

The checks are test_flash_fwd_emulated.py's (float64 reference written independently of the
kernels, FlashAttention's tolerance rule); here they run on the kernel table "sm_90a", whose
forward steps for head dims 64, 128 and 256 are the Hopper kernel. The emulator runs the
persistent grid with 3 blocks, so blocks take several tiles and the pipelines carry their
barrier phases across tiles. Two pipeline mistakes are seeded into a copy of the kernel source
(a consumer that skips its wait for a K tile, and a wait on the wrong phase): the emulator must
catch each.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import burstcu

from burstcu.layout import Block
from tests.kernels.backend import BACKEND, kernel_ops, seeded_kernel_dir
from burstcu.ops.cuda.kernel_ops import SM90_MAX_RECTS
from tests.kernels.test_flash_fwd_emulated import DTYPES, _counting, check, full, make

BURSTCU = str(Path(burstcu.__file__).resolve().parent)   # a warning's line must be outside it

pytestmark = pytest.mark.emulated


@pytest.fixture(scope="module")
def ops():
    return kernel_ops(arch="sm_90a")


def test_the_hopper_family_runs_for_its_head_dims(ops):
    for d, family in ((32, "forward"), (64, "forward_sm90"), (80, "forward"), (96, "forward"),
                      (128, "forward_sm90"), (200, "forward_sm90"), (256, "forward_sm90")):
        assert ops.forward_variant("float16", d).family == family, d
    assert ops.arch == "sm_90a"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d", [64, 128, 256])
def test_headdims(ops, dtype, d):
    q, k, v = make(dtype, 1, 150, 200, 2, 2, d, seed=d)
    check(ops, dtype, q, k, v, full(150, 200))


@pytest.mark.parametrize("dtype,big,scale", [("bfloat16", 1e18, None), ("float16", 6e4, 1e5)])
def test_very_large_scores_keep_their_keys(ops, dtype, big, scale):
    """Rows whose scaled max reaches 2^12 scale first (SOFTMAX SHIFT in the kernel's header):
    one key of scores ~1e18, which rows 61.. see (causal); in float16 at scale 1e5 every
    row's scores are ~1e5 or more. In the fused form the max's own P was exp2 of up to half an
    ulp of the scaled max: of hundreds (lse -inf or +inf, out NaN), or a 16-bit P off 1 (out an
    ulp off where one key dominates)."""
    q, k, v = make(dtype, 1, 64, 64, 2, 1, 64, seed=5)
    k[:, 61] = big
    check(ops, dtype, q, k, v, [Block(0, 64, 0, 64, 0, 0, True)], scale=scale)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("q_pos,k_pos", [(0, 0), (200, 0), (64, 100), (0, 300)])
def test_causal_offsets(ops, dtype, q_pos, k_pos):
    """The diagonal at any offset: tiles wholly in the future are skipped, tiles that straddle it
    masked, query blocks taken longest first."""
    q, k, v = make(dtype, 1, 260, 190, 2, 1, 64, seed=q_pos + k_pos)
    check(ops, dtype, q, k, v, [Block(0, 260, 0, 190, q_pos, k_pos, True)])


@pytest.mark.parametrize("n_rects,min_flop,scale", [
    (2, None, None), (SM90_MAX_RECTS, None, None),
    (SM90_MAX_RECTS + 1, None, None),    # many small Blocks: the list kernel
    (SM90_MAX_RECTS + 1, 4 * 40 * 40 * 64 * 2, None),   # ... unless each is large enough
    (2, None, 0.0), (2, None, -0.125)])  # a scale <= 0: the mma.sync kernels (they scale first)
def test_which_kernel_runs_a_step(monkeypatch, n_rects, min_flop, scale):
    """On the sm_90a table a step of at most SM90_MAX_RECTS Blocks, or of Blocks of at least
    SM90_MIN_FLOP_PER_RECT each (lowered here to the test's Blocks: 40 x 40 pairs, d 64, 2 heads),
    runs the Hopper kernel a launch a Block; a step of more, smaller Blocks (packed documents) its
    rectangle-list twin in one launch; a softmax scale <= 0 the mma.sync kernels (the sm_80 list
    kernel for several Blocks). All against float64."""
    from burstcu.ops.cuda import kernel_ops as kernel_ops_module

    if min_flop is not None:
        monkeypatch.setattr(kernel_ops_module, "SM90_MIN_FLOP_PER_RECT", min_flop)
    ops = kernel_ops(arch="sm_90a")
    counts = _counting(ops)
    n = 40 * n_rects
    q, k, v = make("float16", 1, n, n, 2, 1, 64, seed=n_rects)
    # documents of 40 tokens each, causal: one Block a document
    blocks = [Block(40 * i, 40, 40 * i, 40, 40 * i, 40 * i, True) for i in range(n_rects)]
    check(ops, "float16", q, k, v, blocks, scale=scale)
    hopper = scale is None and (n_rects <= SM90_MAX_RECTS or min_flop is not None)
    if hopper:
        assert counts.get("flash_fwd_step_sm90") == 2 * n_rects and "flash_fwd_steps" not in counts, counts
    elif scale is None:   # the plain and careful launch of the Hopper list kernel
        assert counts.get("flash_fwd_steps_sm90") == 2 and "flash_fwd_step_sm90" not in counts, counts
        assert "flash_fwd_steps" not in counts, counts
    elif n_rects > 1:
        assert counts.get("flash_fwd_steps") == 2 and "flash_fwd_step_sm90" not in counts, counts


def test_fully_future_block(ops):
    """Every key in the future of every row: the state is untouched, rows stay empty."""
    q, k, v = make("float16", 1, 64, 64, 1, 1, 64)
    check(ops, "float16", q, k, v, [Block(0, 64, 0, 64, 0, 500, True)])


@pytest.mark.parametrize("causal", [False, True])
def test_ragged_and_gqa(ops, causal):
    """q_len and k_len not multiples of the tiles (rows past them read zeros through the tensor
    maps), a consumer warpgroup with no valid row (q_len <= 64 in a tile), GQA without
    replication (4 query heads on 2 kv heads) and a batch of 2."""
    q, k, v = make("bfloat16", 2, 200, 333, 4, 2, 128, seed=3)
    blocks = [Block(7, 150, 5, 301, 100, 90, causal), Block(170, 30, 0, 333, 500, 0, causal)]
    check(ops, "bfloat16", q, k, v, blocks)


@pytest.mark.parametrize("group", [1, 4])
def test_tiles_a_group_of_heads_at_a_time(group):
    """KernelOps.sm90_head_group: the grid takes the tiles of `group` (batch, head) pairs before
    the next pairs' (2 x 3 = 6 pairs: groups of 1, or of 4 then 2). Every tile runs exactly once,
    and gives the bits it gives in the default order (all pairs at once), under a causal bound
    (longest query blocks first within each group)."""
    from tests.kernels.test_flash_fwd_emulated import run_kernel

    ops = kernel_ops(arch="sm_90a")
    q, k, v = make("float16", 2, 300, 260, 3, 1, 64, seed=12)
    blocks = [Block(0, 300, 0, 260, 40, 0, True)]
    default = run_kernel(ops, q, k, v, [(k, v, blocks)])
    ops.ops.sm90_head_group = group
    check(ops, "float16", q, k, v, blocks)
    grouped = run_kernel(ops, q, k, v, [(k, v, blocks)])
    assert all(np.array_equal(a, b) for a, b in zip(default, grouped))


def test_state_across_calls_and_two_blocks_one_step(ops):
    """Three ring steps fold into one running state; two blocks of one step share query rows."""
    q, k, v = make("float16", 1, 192, 384, 2, 1, 128, seed=5)
    k1, k2, k3 = k[:, :128], k[:, 128:256], k[:, 256:]
    v1, v2, v3 = v[:, :128], v[:, 128:256], v[:, 256:]
    steps = [(k1, v1, [Block(0, 192, 0, 128, 256, 0, True)]),
             (k2, v2, [Block(0, 96, 0, 128, 256, 128, True), Block(96, 96, 0, 128, 352, 128, True)]),
             (k3, v3, [Block(0, 192, 0, 128, 256, 256, True)])]
    blocks = [Block(0, 192, 0, 384, 256, 0, True)]
    check(ops, "float16", q, k, v, blocks, steps=steps)


@pytest.mark.parametrize("block", [
    Block(0, 96, 0, 256, 180, 0, True, 37),      # causal window
    Block(0, 77, 0, 200, 30, 0, False, 20, 9),   # both edges, ragged
    Block(0, 128, 0, 128, 0, 0, False, 0, 0),    # one visible key a row
    # the first row's first key the last of a key tile (63, 127): that tile is loaded
    Block(0, 64, 0, 160, 100, 0, False, 37),
    Block(0, 128, 0, 256, 190, 0, True, 63),
])
def test_windows(ops, block):
    q, k, v = make("bfloat16", 1, block.q_len, block.k_len, 2, 1, 64, seed=7)
    check(ops, "bfloat16", q, k, v, [block])


@pytest.mark.parametrize("d", [64, 128])
def test_many_tiles_per_block_and_randomized_order(d):
    """More tiles than persistent blocks (each block runs several, its barrier phases carrying
    over), with the emulator's shuffled thread and block order and copies landing at random
    points: a missing barrier or a phase error shows as a wrong result or a reported error.
    Up to 4 key tiles a query tile: the ring of 3 K/V stages (d = 64 and 128) wraps."""
    ops = kernel_ops(arch="sm_90a", randomize=True)
    q, k, v = make("float16", 2, 300, 400, 3, 1, d, seed=11)
    check(ops, "float16", q, k, v, [Block(0, 300, 0, 400, 100, 0, True)])


# ------------------------------------------------------------------------------------------------
# seeded pipeline mistakes: the emulator must catch each

SEEDS = {
    # (anchor, replacement, what the emulator says)
    # the steady state issues S = Q K^T without waiting for the K tile to land: the tile is read
    # before its bytes arrive, and the copy is still in flight when the block ends
    "missing_wait": ("        mbar_wait(k_full + stage, phase);\n", "",
                     "TMA copies in flight"),
    # ... or waits on the phase of the other parity, which a fresh barrier reports complete
    "wrong_phase": ("        mbar_wait(k_full + stage, phase);\n",
                    "        mbar_wait(k_full + stage, phase ^ 1);\n", "TMA copies in flight"),
    # the producer waits for a free stage on the wrong parity: it waits for a phase no one
    # completes while the consumers wait for its copies
    "wrong_empty_phase": ("          mbar_wait(bar.kv_empty + stage, phase ^ 1);\n",
                          "          mbar_wait(bar.kv_empty + stage, phase);\n", "deadlock"),
    # the consumers never free a stage
    "missing_release": ("        taint(prev);\n        mbar_arrive(kv_empty + prev);\n",
                        "        taint(prev);\n", "deadlock"),
    # P V's registers are overwritten while it is in flight (no wait before the next P)
    "missing_wgmma_wait": ("      wgmma_wait<0>();  // P_{j-1} V_{j-1} done", "      // (no wait)",
                           "A-fragment registers"),
}


def seed_kernel(ops, folder, anchor: str, replacement: str):
    """Make `ops` run, for float16 at d = 64, a copy of flash_fwd_sm90.cu with the one line
    `anchor` replaced (`seeded_kernel_dir` in `folder`); returns the seeded variant."""
    from burstcu.build import emulate

    bad = seeded_kernel_dir(folder, "flash_fwd_sm90.cu", anchor, replacement) / "flash_fwd_sm90.cu"
    variant = ops.forward_variant("float16", 64)
    assert variant.family == "forward_sm90"
    module = emulate.build_module([bad], [variant.name])
    ops.ops._functions[variant.name] = module.get_function(variant.name)
    return variant


@pytest.mark.skipif(BACKEND != "emulated", reason="seeded mistakes are the emulator's to catch")
@pytest.mark.parametrize("seed", list(SEEDS))
def test_the_emulator_catches_a_seeded_pipeline_mistake(tmp_path, seed):
    old, new, message = SEEDS[seed]
    ops = kernel_ops(arch="sm_90a")
    seed_kernel(ops, tmp_path, old, new)
    q, k, v = make("float16", 1, 128, 512, 1, 1, 64, seed=1)
    with pytest.raises(RuntimeError, match=message):
        check(ops, "float16", q, k, v, full(128, 512))


@pytest.mark.skipif(BACKEND != "emulated", reason="seeded mistakes are the emulator's to catch")
def test_the_emulator_catches_a_missing_proxy_fence(tmp_path, monkeypatch):
    """The careful kernel zeroes V's non-finite values with ordinary (generic-proxy) stores;
    without the fence.proxy.async after them the tensor cores' reads (async proxy) are not
    ordered after the stores (PTX ISA): the emulator says so."""
    fence = "                                            tid);\n          fence_proxy_async();\n"
    unfenced = fence.replace("fence_proxy_async();", "")
    folder = seeded_kernel_dir(tmp_path, "flash_fwd_sm90.cu", fence, unfenced)
    monkeypatch.setenv("BURSTCU_KERNEL_DIR", str(folder))
    q, k, v = make("float16", 1, 128, 128, 1, 1, 64, seed=1)
    v[0, 100, 0, 5] = np.inf   # a causal block: rows 0-99 cannot see it, so the careful kernel runs
    with pytest.raises(RuntimeError, match="flash_fwd_step_sm90.*, true>: warpgroup 1 .* issued a wgmma "
                                           "whose B operand .* was written by ordinary stores with no "
                                           "fence_proxy_async"):
        check(kernel_ops(arch="sm_90a"), "float16", q, k, v, [Block(0, 128, 0, 128, 0, 0, True)])


def test_the_good_kernel_passes_the_same_check():
    """The control of the seeded tests: the unmodified kernel on the same input."""
    ops = kernel_ops(arch="sm_90a")
    q, k, v = make("float16", 1, 128, 512, 1, 1, 64, seed=1)
    check(ops, "float16", q, k, v, full(128, 512))


FIRST_USE_SEEDS = {
    # the even keys' scores at half scale: a silently wrong result, as a misread layout would give
    "wrong_result": ("          s[4 * jj + 2 * r] = exp2f(fmaf(s[4 * jj + 2 * r], scale_log2, -ref));\n",
                     "          s[4 * jj + 2 * r] = exp2f(fmaf(s[4 * jj + 2 * r], 0.5f * scale_log2, -ref));\n",
                     "differs from the mma.sync kernel"),
    # the pass of one fold writes out at twice its value: only the check's whole pass shows it
    "wrong_whole_pass": ("          const float x = lsum == 0.f ? 0.f : o[4 * j + 2 * r] / lsum;\n",
                         "          const float x = lsum == 0.f ? 0.f : 2.f * o[4 * j + 2 * r] / lsum;\n",
                         "differs from the mma.sync kernel"),
    # a launch that fails (here the emulator's report of a copy never waited for)
    "launch_fails": (*SEEDS["missing_wait"][:2], "RuntimeError: emulated kernel flash_fwd_step_sm90"),
}


@pytest.mark.skipif(BACKEND != "emulated", reason="seeds a broken kernel")
@pytest.mark.parametrize("seed", list(FIRST_USE_SEEDS))
def test_a_hopper_kernel_that_fails_its_first_use_check_is_not_used(tmp_path, seed):
    """On a GPU the first use of each Hopper variant runs it against the mma.sync kernel of its
    head dim; one that disagrees or fails warns, and the process keeps the mma.sync kernel for
    that variant: the caller's result is still right."""
    from burstcu.ops.cuda import kernel_ops as kops

    anchor, replacement, message = FIRST_USE_SEEDS[seed]
    ops = kernel_ops(arch="sm_90a")
    ops.ops.first_use_check = True  # as on a GPU
    ops.ops.whole_pass = False  # the check runs the whole pass all the same
    hopper = seed_kernel(ops, tmp_path, anchor, replacement)
    key = ops.ops._first_use_key(hopper)
    kops._SM90_FIRST_USE.pop(key, None)
    try:
        q, k, v = make("float16", 1, 100, 140, 2, 1, 64, seed=4)
        with pytest.warns(RuntimeWarning, match="failed its first-use check.*" + message):
            check(ops, "float16", q, k, v, full(100, 140))
        assert ops.forward_variant("float16", 64).family == "forward"
        assert ops.ops.whole_pass is False
        check(ops, "float16", q, k, v, full(100, 140))  # no second check, no warning
    finally:
        kops._SM90_FIRST_USE.pop(key, None)


@pytest.mark.skipif(BACKEND != "emulated", reason="the check's own path, on the emulator")
def test_a_correct_hopper_kernel_passes_its_first_use_check():
    from burstcu.ops.cuda import kernel_ops as kops

    ops = kernel_ops(arch="sm_90a")
    ops.ops.first_use_check = True
    hopper = ops.forward_variant("bfloat16", 128)
    key = ops.ops._first_use_key(hopper)
    kops._SM90_FIRST_USE.pop(key, None)
    try:
        q, k, v = make("bfloat16", 1, 64, 64, 1, 1, 128, seed=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning: it passes
            check(ops, "bfloat16", q, k, v, full(64, 64))
        assert kops._SM90_FIRST_USE[key] is True
        assert ops.forward_variant("bfloat16", 128).family == "forward_sm90"
    finally:
        kops._SM90_FIRST_USE.pop(key, None)


# ------------------------------------------------------------------------------------------------
# a pass that starts from a fresh state or ends in its step (FwdStepSm90Params.fresh / finalize)

def _unfused(ops, q, k, v, steps):
    """(out, lse) of `steps` as (k, v, blocks) folded from a zeroed state and finalized by
    flash_fwd_finalize: every fold reads and writes the state."""
    inner = ops.ops
    state = ops.forward_init(q)
    inner._materialize(state)
    for kk, vv, blocks in steps:
        ops.forward_step(state, kk, vv, blocks)
    return ops.forward_finalize(state, q.dtype)


def _fused(ops, q, k, v, steps):
    state = ops.forward_init(q)
    for i, (kk, vv, blocks) in enumerate(steps):
        ops.forward_step(state, kk, vv, blocks, i == len(steps) - 1)
    return ops.forward_finalize(state, q.dtype)


def _same(got, want, dtype):
    """out and lse alike: bit for bit on the emulator, whose arithmetic is one IEEE operation a
    step in both paths; on a GPU within a rounding of out's dtype (the two kernels' fast-math
    divisions and logarithms are the same instructions, which the test does not presume)."""
    if BACKEND == "emulated":
        return all(np.array_equal(a, b) for a, b in zip(got, want))
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    return all(np.array_equal(np.isfinite(a), np.isfinite(b)) and
               np.allclose(a[np.isfinite(b)].astype(np.float64), b[np.isfinite(b)].astype(np.float64),
                           rtol=eps, atol=eps)
               for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("d,block", [
    (64, Block(0, 300, 0, 260, 0, 0, True)),
    (128, Block(0, 200, 0, 333, 0, 140, True)),    # rows 0..139 see no key: whole tiles empty
    (256, Block(0, 150, 0, 200, 0, 0, False)),
    (64, Block(0, 130, 0, 100, 0, 500, True)),      # no row sees a key
    (128, Block(0, 96, 0, 256, 180, 0, True, 37)),  # a causal window
])
def test_one_fold_is_a_whole_pass(ops, dtype, d, block):
    """A pass of one Block over every query row with `last` runs one kernel: the Hopper step
    starts from a state it does not read and writes out and lse itself (no zeroing, no
    flash_fwd_finalize), within FlashAttention's rule of float64 and bit for bit what the
    zeroed state, the fold and the finalize give (`_same`), with no fp32 state allocated.
    Rows that see no key (whole tiles of them, which the fold skips) get out 0 and lse -inf."""
    q, k, v = make(dtype, 2, block.q_len, block.k_len, 4, 2, d, seed=d + block.k_pos)
    steps = [(k, v, [block])]
    want = _unfused(ops, q, k, v, steps)
    counts = _counting(ops)
    got = _fused(ops, q, k, v, steps)
    scan = {"flash_any_nonfinite": 1} if block.masked else {}   # V's scan, for the launch pair
    assert counts == {"flash_fwd_step_sm90": 2 if block.masked else 1, **scan}, counts
    assert _same(got, want, dtype)
    check(ops, dtype, q, k, v, [block], last=True)
    state = ops.forward_init(q)
    ops.forward_step(state, k, v, [block], True)
    assert state.acc is None and state.m is None and state.l is None


def test_a_ring_starts_fresh_and_ends_in_its_last_fold(ops):
    """A ring of three folds: the first (every row) writes the fresh state without reading it,
    the second (half the rows) reads and writes it, the last (every row) reads it and writes out
    and lse. Bit for bit the unfused pass (`_same`); a step after the last is refused."""
    q, k, v = make("float16", 1, 192, 384, 2, 1, 128, seed=5)
    k1, k2, k3 = k[:, :128], k[:, 128:256], k[:, 256:]
    v1, v2, v3 = v[:, :128], v[:, 128:256], v[:, 256:]
    steps = [(k1, v1, [Block(0, 192, 0, 128, 256, 0, True)]),
             (k2, v2, [Block(0, 96, 0, 128, 256, 128, True)]),
             (k3, v3, [Block(0, 192, 0, 128, 256, 256, True)])]
    want = _unfused(ops, q, k, v, steps)
    counts = _counting(ops)
    got = _fused(ops, q, k, v, steps)
    assert counts == {"flash_fwd_step_sm90": 6, "flash_any_nonfinite": 3}, counts   # launch pairs
    assert _same(got, want, "float16")
    seen = [Block(0, 192, 0, 128, 256, 0, True), Block(0, 96, 128, 128, 256, 128, True),
            Block(0, 192, 256, 128, 256, 256, True)]   # the three folds' pairs, over all of k
    check(ops, "float16", q, k, v, seen, steps=steps, last=True)
    state = ops.forward_init(q)
    ops.forward_step(state, k3, v3, steps[2][2], True)
    with pytest.raises(RuntimeError, match="last"):
        ops.forward_step(state, k3, v3, steps[2][2])


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_a_ring_starts_fresh_and_ends_over_tiles_without_keys(ops, dtype):
    """Two folds over every row, whole query tiles of whose rows see no key in either (rows
    0..139 against keys from position 140 on): the first writes the fresh state there, the last
    reads it and writes out 0 and lse -inf there, the unfused pass's bits (`_same`) and within
    FlashAttention's rule of float64 elsewhere."""
    q, k, v = make(dtype, 1, 330, 256, 2, 1, 64, seed=13)
    steps = [(k[:, :128], v[:, :128], [Block(0, 330, 0, 128, 0, 140, True)]),
             (k[:, 128:], v[:, 128:], [Block(0, 330, 0, 128, 0, 268, True)])]
    want = _unfused(ops, q, k, v, steps)
    got = _fused(ops, q, k, v, steps)
    assert _same(got, want, dtype)
    check(ops, dtype, q, k, v, [Block(0, 330, 0, 256, 0, 140, True)], steps=steps, last=True)


def test_a_fold_over_some_rows_zeroes_a_fresh_state_first(ops):
    """A first fold over part of the rows zeroes the fresh state first:
    the rows it does not cover come out empty (out 0, lse -inf), the others within the rule, and
    a last fold over part of the rows leaves the finalize to flash_fwd_finalize."""
    q, k, v = make("bfloat16", 1, 200, 150, 2, 2, 64, seed=9)
    blocks = [Block(40, 100, 0, 150, 0, 0, False)]
    counts = _counting(ops)
    check(ops, "bfloat16", q, k, v, blocks, last=True)
    assert counts == {"flash_fwd_step_sm90": 1, "flash_fwd_finalize": 1}, counts


# ------------------------------------------------------------------------------------------------
# kernels built with fewer registers than their setmaxnreg split hands out

class _Loaded:
    """A loaded kernel as CuPy shows it: num_regs, read from the CUBIN by the driver."""

    def __init__(self, num_regs: int):
        self.num_regs = num_regs


@pytest.mark.skipif(BACKEND != "emulated", reason="stands in for a GPU's loaded kernels")
def test_registers_are_read_from_the_loaded_kernels(monkeypatch):
    """On a GPU, `_registers_problem` reads each loaded Hopper kernel's registers a thread (a
    forward step or list kernel and its careful twin; a backward dK/dV kernel, one-block, list
    or bulk): 168 for 384 threads is what the setmaxnreg split hands out
    (`setmaxnreg_registers`), fewer would make setmaxnreg.inc wait forever."""
    from burstcu.build.compile import setmaxnreg_registers
    from burstcu.build.fwd_variants import careful_twin

    ops = kernel_ops(arch="sm_90a").ops
    forward = [ops.variant(family, "float16", 128) for family in ("forward_sm90", "forward_sm90_list")]
    backward = [ops.variant(family, "float16", 128) for family in
                ("bwd_dkdv_sm90", "bwd_dkdv_sm90_list", "bwd_dkdv_bulk_sm90", "bwd_dkdv_nodq_sm90")]
    assert setmaxnreg_registers(384) == 168
    assert all(v.launch.threads == 384 for v in forward + backward)
    assert ops._registers_problem(forward[0]) is None   # the emulator has no register file
    monkeypatch.setattr(ops, "device", "cuda")
    for hopper in forward + backward:
        loaded = [hopper] + ([careful_twin(hopper)] if hopper in forward else [])
        built = {v.name: 168 for v in loaded}
        monkeypatch.setattr(ops, "function", lambda name: _Loaded(built[name]))
        assert ops._registers_problem(hopper) is None, hopper.name
        for v in loaded:
            built[v.name] = 128
            problem = ops._registers_problem(hopper)
            assert problem is not None and v.name in problem and "128 registers" in problem, problem
            assert "needs 168" in problem and "wait forever" in problem and "NVRTC" in problem
            built[v.name] = 168


def _refusing(monkeypatch, why):
    """KernelOps whose Hopper kernels `_registers_problem` refuses (`why`: its message, or an
    exception it raises), with fresh verdicts."""
    from burstcu.ops.cuda import kernel_ops as kops

    monkeypatch.setattr(kops, "_SM90_FIRST_USE", {})
    monkeypatch.setattr(kops, "_SM90_REGISTERS_READ", set())

    def problem(self, v):
        if isinstance(why, Exception):
            raise why
        return f"{v.name} {why}"
    monkeypatch.setattr(kops.KernelOps, "_registers_problem", problem)


@pytest.mark.skipif(BACKEND != "emulated", reason="stands in for a GPU's loaded kernels")
@pytest.mark.parametrize("first_use_check", [True, False])
@pytest.mark.parametrize("why,said", [("was built with 128 registers a thread", "128 registers"),
                                      (RuntimeError("NVRTC failed on it"), "RuntimeError: NVRTC failed")])
def test_a_hopper_forward_without_its_registers_is_never_launched(monkeypatch, first_use_check, why,
                                                                  said):
    """A Hopper forward whose loaded kernels could not run their setmaxnreg split (another
    NVRTC's build), or that does not compile or load, warns once at the caller's line, is never
    launched (a launch of the first would hang the GPU: the first-use check cannot catch that,
    and runs after this), and the mma.sync kernel gives the caller's result."""
    _refusing(monkeypatch, why)
    ops = kernel_ops(arch="sm_90a")
    ops.ops.first_use_check = first_use_check
    assert ops.forward_variant("float16", 64).family == "forward_sm90"
    counts = _counting(ops)
    q, k, v = make("float16", 1, 100, 140, 2, 1, 64, seed=4)
    with pytest.warns(RuntimeWarning, match="Hopper forward kernel .* failed its first-use check "
                                            rf"on this GPU \(.*{said}") as seen:
        check(ops, "float16", q, k, v, full(100, 140))
    assert all(not str(Path(w.filename).resolve()).startswith(BURSTCU) for w in seen), \
        [w.filename for w in seen]
    assert not any("sm90" in name for name in counts), counts
    assert ops.forward_variant("float16", 64).family == "forward"
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said once
        check(ops, "float16", q, k, v, full(100, 140))


class _StickyError(RuntimeError):
    status = 700   # cudaErrorIllegalAddress: the context runs nothing more


@pytest.mark.skipif(BACKEND != "emulated", reason="stands in for a GPU's loaded kernels")
@pytest.mark.parametrize("error", ["sticky", "timeout"])
def test_a_sticky_cuda_error_or_a_compile_deadline_at_the_register_read_is_raised(monkeypatch, error):
    """Met at the register read, an earlier launch's error that leaves the context unusable, or
    a compile past its deadline (BuildTimeoutError, which ends the process), is raised as it is,
    and no verdict is recorded: the Hopper kernel is not blamed for it."""
    from burstcu.build.compile import BuildTimeoutError
    from burstcu.ops.cuda import kernel_ops as kops

    exc = (_StickyError("an illegal address, met here") if error == "sticky" else
           BuildTimeoutError("past 600 s"))
    _refusing(monkeypatch, exc)
    ops = kernel_ops(arch="sm_90a")
    q, k, v = make("float16", 1, 100, 140, 2, 1, 64, seed=4)
    with pytest.raises(type(exc), match="illegal address|past 600 s"):
        check(ops, "float16", q, k, v, full(100, 140))
    assert not kops._SM90_FIRST_USE and not kops._SM90_REGISTERS_READ
