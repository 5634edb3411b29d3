"""flash_fwd_steps_sm90 (kernels/flash_fwd_sm90.cu, LIST): the Hopper forward step over a ring
step's whole rectangle list in one launch, under the CPU emulator (KernelOps(arch="sm_90a")).

Each listed step is checked three ways: it is one launch (its careful twin beside it where the
list has masked pairs or a key count off the tiles); its state (acc, m, l) has the bits of one
flash_fwd_step_sm90 launch a rectangle in the list's order; and its output matches the float64
reference (burstcu.testing.reference, written apart from the kernels) by FlashAttention's rule
(`check` of test_flash_fwd_emulated.py). The rectangles come from burstcu.layout.blocks over a
zigzag partition, as the mma.sync list tests' do. SM90_MAX_RECTS is lowered to 1 so that steps of
2 or more rectangles take the list kernel (the emulator's time keeps the sizes small).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from burstcu.build.fwd_variants import SM90_FAMILY, SM90_LIST_FAMILY
from burstcu.layout import Block
from burstcu.ops.cuda import kernel_ops as kernel_ops_module
from tests.kernels.backend import BACKEND, kernel_ops
from tests.kernels.test_flash_fwd_emulated import (DTYPES, _counting, check, make, ring_steps,
                                                    run_kernel)

pytestmark = [pytest.mark.emulated,
              pytest.mark.skipif(BACKEND != "emulated", reason="compares device state on the host")]


@pytest.fixture
def lists_always(monkeypatch):
    """Every step of 2 or more Blocks takes the Hopper list kernel."""
    monkeypatch.setattr(kernel_ops_module, "SM90_MAX_RECTS", 1)
    monkeypatch.setattr(kernel_ops_module, "SM90_MIN_FLOP_PER_RECT", math.inf)


def _state_bits(state):
    return [np.asarray(x).view(np.uint32).copy() for x in (state.acc, state.m, state.l)]


def _one_launch_a_rect(inner, q, k, v, blocks):
    """The state after flash_fwd_step_sm90 a Block, in the list's order."""
    state = inner.forward_init(q)
    hopper = inner.forward_variant(q.dtype, q.shape[-1])
    assert hopper.family == SM90_FAMILY
    for blk in blocks:
        inner._fold(hopper, state, k, v, [blk])
    return state


def _assert_one_launch(counts, blocks, block_n):
    masked = any(b.masked for b in blocks) or any(b.k_len % block_n for b in blocks)
    assert counts.get("flash_fwd_steps_sm90") == (2 if masked else 1), counts
    assert "flash_fwd_step_sm90" not in counts and "flash_fwd_steps" not in counts, counts


STEP_CASES = {   # name: (dtype, d, G, N, documents, causal, window, H, Hkv)
    "documents, causal": ("float16", 64, 2, 200, (0, 30, 75, 140, 200), True, (-1, -1), 2, 1),
    "documents, causal, bf16": ("bfloat16", 64, 2, 200, (0, 30, 75, 140, 200), True, (-1, -1), 2, 1),
    "window": ("bfloat16", 64, 2, 200, None, False, (40, 8), 2, 2),
    "causal chunks, d 128": ("float16", 128, 2, 160, None, True, (-1, -1), 2, 1),
    "documents, causal window, bf16, d 128": ("bfloat16", 128, 2, 160, (0, 50, 160), True, (30, 0), 2, 1),
}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_a_step_in_one_hopper_launch_is_a_launch_a_rectangle_bit_for_bit(lists_always, case):
    """The ring's steps of 2 or more rectangles (the first two of them): one list launch gives
    the state of one Hopper launch a rectangle, bit for bit, and the FlashAttention rule holds
    against float64."""
    dtype, d = STEP_CASES[case][:2]
    ops = kernel_ops(arch="sm_90a", pack_lists=False)
    inner = ops.ops
    counts = _counting(ops)
    listed = 0
    for q, k, v, blocks in ring_steps(STEP_CASES, case, np.random.default_rng(3)):
        variant = inner.variant(SM90_LIST_FAMILY, dtype, d)
        counts.clear()
        whole = inner.forward_init(q)
        inner.forward_step(whole, k, v, blocks)
        _assert_one_launch(counts, blocks, variant.launch.block_n)
        apart = _one_launch_a_rect(inner, q, k, v, blocks)
        for a, b in zip(_state_bits(whole), _state_bits(apart)):
            assert np.array_equal(a, b)
        if listed == 0:
            check(ops, dtype, q, k, v, blocks)
        listed += 1
        if listed == 2:
            break
    assert listed == 2


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_head_dim_256(lists_always, dtype):
    """d = 256 (64-key tiles, 2 stages): three documents, causal, against one launch a Block."""
    ops = kernel_ops(arch="sm_90a", pack_lists=False)
    q, k, v = make(dtype, 1, 150, 150, 2, 1, 256, seed=9)
    blocks = [Block(0, 40, 0, 40, 0, 0, True), Block(40, 70, 40, 70, 40, 40, True),
              Block(110, 40, 110, 40, 110, 110, True)]
    whole = ops.ops.forward_init(q)
    ops.ops.forward_step(whole, k, v, blocks)
    apart = _one_launch_a_rect(ops.ops, q, k, v, blocks)
    for a, b in zip(_state_bits(whole), _state_bits(apart)):
        assert np.array_equal(a, b)
    check(ops, dtype, q, k, v, blocks)


def test_a_group_of_several_rectangles_and_gqa(lists_always):
    """One query range folding three rectangles in order (their own k_pos - q_pos: a causal
    diagonal, a full block, a window), a second query range of one, GQA (4 heads on 2), a batch
    of 2, several work items a persistent block (the emulator's grid is 3 blocks): the pipeline
    and the row sums carry across rectangles."""
    ops = kernel_ops(arch="sm_90a", randomize=True, pack_lists=False)
    q, k, v = make("float16", 2, 300, 330, 4, 2, 64, seed=21)
    blocks = [Block(0, 200, 0, 130, 200, 0, False), Block(0, 200, 130, 150, 200, 190, True),
              Block(0, 200, 280, 50, 200, 300, False, 60, 20), Block(200, 100, 0, 330, 400, 0, True)]
    counts = _counting(ops)
    whole = ops.ops.forward_init(q)
    ops.ops.forward_step(whole, k, v, blocks)
    _assert_one_launch(counts, blocks, 128)
    apart = _one_launch_a_rect(ops.ops, q, k, v, blocks)
    for a, b in zip(_state_bits(whole), _state_bits(apart)):
        assert np.array_equal(a, b)
    check(ops, "float16", q, k, v, blocks)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_where_no_row_looks_is_inert(lists_always, dtype):
    """NaN in V at keys no row sees: in the future of a causal rectangle, and in rows between
    rectangles that a key tile past k_len reads (the maps cover the whole array). The careful
    twin runs; the output has the bits of the same step with zeros there, and of one Hopper
    launch a rectangle with the NaN."""
    ops = kernel_ops(arch="sm_90a", pack_lists=False)
    q, k, v = make(dtype, 1, 200, 260, 2, 1, 64, seed=5)
    blocks = [Block(0, 100, 0, 90, 0, 0, True), Block(100, 100, 150, 110, 100, 100, True)]
    poisoned, clean = v.copy(), v.copy()
    for rows in (slice(90, 150), slice(250, 260)):   # between the rectangles; key 259 > q 199
        poisoned[:, rows] = np.nan
        clean[:, rows] = 0
    counts = _counting(ops)
    got = run_kernel(ops, q, k, poisoned, [(k, poisoned, blocks)])
    assert counts.get("flash_fwd_steps_sm90") == 2, counts   # the pair: the careful one ran
    want = run_kernel(ops, q, k, clean, [(k, clean, blocks)])
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    apart = _one_launch_a_rect(ops.ops, q, k, poisoned, blocks)
    out, lse = ops.ops.forward_finalize(apart, q.dtype)
    assert np.array_equal(out.astype(np.float64), got[0]) and np.array_equal(lse, got[1])
    check(ops, dtype, q, k, clean, blocks)


def test_many_documents_take_the_list_by_default_and_the_old_choice_stays():
    """With the real SM90_MAX_RECTS a step of more, smaller Blocks (packed documents) runs the
    Hopper list kernel in one launch; sm90_lists = False gives the mma.sync list kernel (the
    choice before it), a scale <= 0 too; both against float64."""
    n_rects = kernel_ops_module.SM90_MAX_RECTS + 2
    q, k, v = make("float16", 1, 40 * n_rects, 40 * n_rects, 2, 1, 64, seed=n_rects)
    blocks = [Block(40 * i, 40, 40 * i, 40, 40 * i, 40 * i, True) for i in range(n_rects)]
    for lists, scale, kernel in ((True, None, "flash_fwd_steps_sm90"), (False, None, "flash_fwd_steps"),
                                 (True, -0.125, "flash_fwd_steps")):
        ops = kernel_ops(arch="sm_90a")
        ops.ops.sm90_lists = lists
        counts = _counting(ops)
        check(ops, "float16", q, k, v, blocks, scale=scale)
        steps = {name for name in counts if name.startswith("flash_fwd_step")}
        assert counts.get(kernel) == 2 and steps == {kernel}, counts   # the pair, one launch


@pytest.mark.skipif(BACKEND != "emulated", reason="seeds a broken kernel")
def test_a_list_kernel_that_fails_its_first_use_check_is_not_used(lists_always, monkeypatch):
    """On a GPU the first use of the list variant runs a step of several rectangles with it and
    with the mma.sync list kernel (`KernelOps._sm90_checked`, after the one-Block variant's own
    check). A list kernel whose output differs (here: run with twice the softmax scale) warns,
    and the process keeps the mma.sync list kernel: the caller's output is right."""
    ops = kernel_ops(arch="sm_90a")
    ops.ops.first_use_check = True   # as on a GPU
    keys = [ops.ops._first_use_key(ops.ops.variant(family, "float16", 64))
            for family in (SM90_FAMILY, SM90_LIST_FAMILY)]
    for key in keys:
        kernel_ops_module._SM90_FIRST_USE.pop(key, None)
    real = kernel_ops_module.KernelOps._forward_steps_sm90

    def broken(self, variant, state, *rest):
        state.scale *= 2
        try:
            real(self, variant, state, *rest)
        finally:
            state.scale /= 2
    monkeypatch.setattr(kernel_ops_module.KernelOps, "_forward_steps_sm90", broken)
    q, k, v = make("float16", 1, 240, 240, 2, 1, 64, seed=6)
    blocks = [Block(40 * i, 40, 40 * i, 40, 40 * i, 40 * i, True) for i in range(6)]
    try:
        counts = _counting(ops)
        with pytest.warns(RuntimeWarning, match="failed its first-use check"):
            check(ops, "float16", q, k, v, blocks)
        assert kernel_ops_module._SM90_FIRST_USE[keys[0]] is True, "the one-Block kernel passed"
        assert kernel_ops_module._SM90_FIRST_USE[keys[1]] is False, "the list kernel failed"
        counts.clear()
        check(ops, "float16", q, k, v, blocks)   # no second check, no warning
        assert "flash_fwd_steps_sm90" not in counts and counts.get("flash_fwd_steps") == 2, counts
    finally:
        for key in keys:
            kernel_ops_module._SM90_FIRST_USE.pop(key, None)
