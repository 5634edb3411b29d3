"""flash_bwd_dkdv_steps_sm90 (kernels/flash_bwd_sm90.cu, LIST): the Hopper dK/dV step over a ring
step's whole rectangle list in one launch, on the CPU emulator (KernelOps(arch="sm_90a")).

The steps are test_flash_bwd_lists_emulated.py's (zigzag rings whose masks cut steps into several
rectangles: documents, a sliding window, causal chunks whose key ranges repeat across query
ranges), and so are the checks:

* deterministic mode: one flash_bwd_dkdv_steps_sm90 launch and one flash_bwd_dq_steps launch
  (the mma.sync careful list twin beside the first where the list has masked pairs or rows that
  end inside a tile, beside the second where it has masked pairs); dk, dv, dq and the row sums of
  P have the bits of one Hopper launch a rectangle in the list's order;
* atomic mode: one flash_bwd_dkdv_steps_sm90 launch; dk, dv have the bits of a launch a
  rectangle (one writer a row), and dq, dk, dv are within FlashAttention's rule of the float64
  reference whose mask is spelled out from the rows' global positions.

SM90_MAX_RECTS is lowered to 1 so that steps of 2 or more rectangles take the list kernel (the
emulator's time keeps the sizes small). Shapes as in test_flash_bwd_lists_emulated.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from burstcu.layout import Block
from burstcu.ops.cuda import kernel_ops as kernel_ops_module
from burstcu.testing.reference import keep_from_blocks, softmax_stats_ref
from tests.kernels.backend import BACKEND, kernel_ops
from tests.kernels.test_flash_bwd_lists_emulated import (CASES, check_float64, ring_steps, run_backward,
                                                          same_bits, step_inputs)
from tests.kernels.test_flash_bwd_sm90_emulated import adds_since, hopper_global_adds, record_dq_adds
from tests.kernels.test_flash_fwd_emulated import _counting

pytestmark = pytest.mark.emulated

LIST = "flash_bwd_dkdv_steps_sm90"


@pytest.fixture
def lists_always(monkeypatch):
    """Every step of 2 or more Blocks takes the Hopper list kernel."""
    monkeypatch.setattr(kernel_ops_module, "SM90_MAX_RECTS", 1)
    monkeypatch.setattr(kernel_ops_module, "SM90_MIN_FLOP_PER_RECT", math.inf)


def hopper_ops(deterministic: bool = False, randomize: bool = False, pack_lists: bool = True,
               dq_adds: str = "pairs"):
    """The sm_90a table, whose dQ is the Hopper kernel's atomic one at every head dim (at 256 the
    backward adds it in a pass of its own unless told: `KernelOps.dq_own_pass`), added as
    `dq_adds` says (`KernelOps.sm90_dq_adds`); pack_lists as `kernel_ops`."""
    wrapper = kernel_ops(deterministic=deterministic, randomize=randomize, arch="sm_90a",
                         pack_lists=pack_lists)
    wrapper.ops.dq_own_pass_headdims = ()
    wrapper.ops.sm90_dq_adds = dq_adds
    return wrapper


def block_inputs(blocks, sq: int, sk: int, h: int, hkv: int, d: int, seed: int):
    """float16 q, dout (1, sq, h, d), k, v (1, sk, hkv, d) and float32 lse, delta (1, h, sq) of
    attention over the pairs `blocks` keep; and that mask (sq, sk)."""
    keep = keep_from_blocks(blocks, sq, sk)
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((1, sq, h, d)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, sk, hkv, d)).astype(np.float16) for _ in range(2))
    lse, delta = softmax_stats_ref(q, k, v, dout, keep, 1 / np.sqrt(d))
    return (q, dout, k, v, lse.astype(np.float32), delta.astype(np.float32)), keep


def careful_pairs(blocks, d: int) -> bool:
    """Whether the list runs its careful twins: masked pairs, or rows that end inside a tile of
    the Hopper list kernel (its tensor maps cover the whole arrays)."""
    block_m, block_n = {64: (128, 128), 128: (64, 128), 256: (64, 64)}[d]
    return any(b.masked or b.q_len % block_m or b.k_len % block_n for b in blocks)


def assert_list_launches(counts: dict, blocks, d: int, deterministic: bool) -> None:
    masked = any(b.masked for b in blocks)
    assert counts.get(LIST) == 1, counts
    assert counts.get("flash_bwd_dkdv_steps", 0) == careful_pairs(blocks, d), counts   # the twin
    assert counts.get("flash_bwd_dq_steps", 0) == ((1 + masked) if deterministic else 0), counts
    assert not {"flash_bwd_dkdv_sm90", "flash_bwd_dkdv", "flash_bwd_dq"} & set(counts), counts


@pytest.mark.parametrize("case", list(CASES))
def test_deterministic_list_is_a_hopper_launch_a_rectangle_bit_for_bit(lists_always, case):
    # shuffled thread order: a race between the walker, the copies and the consumers shows
    ops = hopper_ops(deterministic=True, randomize=True, pack_lists=False)
    d = CASES[case][1]
    counts = _counting(ops)
    for n, (qr, kr, sq, sk, blocks, keep) in enumerate(ring_steps(case)):
        x = step_inputs(case, sq, sk, keep, seed=n)
        counts.clear()
        whole = run_backward(ops, x, [blocks], with_psum=True)
        assert_list_launches(counts, blocks, d, deterministic=True)
        counts.clear()
        one_by_one = run_backward(ops, x, [[blk] for blk in blocks], with_psum=True)
        assert counts.get("flash_bwd_dkdv_sm90") == len(blocks) and LIST not in counts, counts
        for grad, a, b in zip(("dq", "dk", "dv", "psum"), whole, one_by_one):
            same_bits(f"{case} step {qr}<-{kr} {grad}", a, b)
        if n == 0:
            check_float64(f"{case} deterministic", whole[:3], x, keep, CASES[case][0])


# d = 64 takes query tiles of 128 rows, two 64-row dQ blocks a tile: with more than 128 rows a
# rank, the second consumer's block holds rows too
WIDE_D64 = ("float16", 64, 2, 600, (0, 150, 330, 600), True, (-1, -1), 2, 1)


@pytest.mark.parametrize("dq_adds", ["pairs", "bulk"])
@pytest.mark.parametrize("case", list(CASES) + ["documents, d 64, 300 rows a rank"])
def test_atomic_list_matches_float64(monkeypatch, lists_always, case, dq_adds):
    """dq, dk, dv within FlashAttention's rule of float64, dk and dv with a launch a rectangle's
    bits, dQ added by atomics (two floats an add) or by bulk reductions (whose boxes add zeros to
    the rows past a rectangle: another rectangle's, in the list's whole-array maps); on the
    emulator its counts show that path ran."""
    monkeypatch.setitem(CASES, "documents, d 64, 300 rows a rank", WIDE_D64)
    ops = hopper_ops(randomize=True, pack_lists=False, dq_adds=dq_adds)
    seen = record_dq_adds(monkeypatch)
    d = CASES[case][1]
    before = hopper_global_adds(ops, dq_adds, CASES[case][0], d, listed=True)
    counts = _counting(ops)
    for n, (qr, kr, sq, sk, blocks, keep) in enumerate(ring_steps(case)):
        x = step_inputs(case, sq, sk, keep, seed=10 + n)
        counts.clear()
        got = run_backward(ops, x, [blocks], with_psum=False)
        assert_list_launches(counts, blocks, d, deterministic=False)
        check_float64(f"{case} step {qr}<-{kr} atomic", got, x, keep, CASES[case][0])
        apart = run_backward(ops, x, [[blk] for blk in blocks], with_psum=False)
        for grad, a, b in zip(("dk", "dv"), got[1:], apart[1:]):
            same_bits(f"{case} step {qr}<-{kr} {grad}", a, b)
    assert seen and set(seen) == {3 if dq_adds == "bulk" else 2}, seen   # every launch added dQ so
    device = adds_since(ops, before, dq_adds, CASES[case][0], d, listed=True)
    if device:
        used = "bulk_reduce" if dq_adds == "bulk" else "red_add_v2"
        assert device[used] > 0 and sum(device.values()) == device[used], device


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_head_dim_256(lists_always, deterministic):
    """d = 256 (64 keys a block of threads, the consumers splitting the head dims): three causal
    documents, 4 query heads on 2, one Hopper launch a rectangle against the list."""
    blocks = [Block(0, 40, 0, 40, 0, 0, True), Block(40, 70, 40, 70, 40, 40, True),
              Block(110, 40, 110, 40, 110, 110, True)]
    x, keep = block_inputs(blocks, 150, 150, 4, 2, 256, seed=9)
    ops = hopper_ops(deterministic, pack_lists=False)
    counts = _counting(ops)
    whole = run_backward(ops, x, [blocks], with_psum=False)
    assert_list_launches(counts, blocks, 256, deterministic)
    apart = run_backward(ops, x, [[blk] for blk in blocks], with_psum=False)
    for grad, a, b in list(zip(("dq", "dk", "dv"), whole, apart))[0 if deterministic else 1:]:
        same_bits(f"d 256 {grad}", a, b)
    check_float64("d 256", whole, x, keep, "float16")


def test_a_group_of_several_rectangles_and_gqa(lists_always):
    """One key range seen by three query ranges (a full block, a causal diagonal, a window, each
    its own k_pos - q_pos), a second key range of one, 4 query heads on 2, keys and queries both
    ragged: every rectangle's dK, dV is added at its end and the next one's start from its own
    products."""
    blocks = [Block(0, 100, 0, 130, 200, 0, False), Block(100, 90, 0, 130, 300, 190, True),
              Block(190, 70, 0, 130, 400, 300, False, 60, 20), Block(0, 100, 130, 70, 200, 330, False)]
    x, keep = block_inputs(blocks, 260, 200, 4, 2, 64, seed=21)
    ops = hopper_ops(deterministic=True, randomize=True, pack_lists=False)
    counts = _counting(ops)
    whole = run_backward(ops, x, [blocks], with_psum=True)
    assert_list_launches(counts, blocks, 64, deterministic=True)
    apart = run_backward(ops, x, [[blk] for blk in blocks], with_psum=True)
    for grad, a, b in zip(("dq", "dk", "dv", "psum"), whole, apart):
        same_bits(f"group {grad}", a, b)
    check_float64("group", whole[:3], x, keep, "float16")


# (blocks, q rows, poisoned (operand, rows, value)): full documents whose query and key ranges
# end inside the list kernel's tiles (128 x 128 at d = 64), or whose key ranges alone do
POISONED_GAPS = {
    "queries and keys ragged": (
        [Block(0, 50, 0, 60, 0, 0, False), Block(70, 40, 90, 30, 100, 100, False)], 130,
        ((0, slice(50, 70), np.nan), (1, slice(110, 130), np.inf), (2, slice(60, 90), -np.inf),
         (3, slice(120, 140), np.nan))),
    "keys ragged only": (
        [Block(0, 128, 0, 60, 0, 0, False), Block(128, 128, 90, 30, 200, 200, False)], 256,
        ((2, slice(60, 90), np.nan), (3, slice(60, 90), np.inf), (3, slice(120, 140), np.nan))),
}


@pytest.mark.parametrize("deterministic,dq_adds", [(False, "pairs"), (True, "pairs"), (False, "bulk")])
@pytest.mark.parametrize("gaps", list(POISONED_GAPS))
def test_nan_in_rows_no_rectangle_holds_is_inert(lists_always, deterministic, dq_adds, gaps):
    """NaN and Inf in q, dO, k and v rows that no rectangle of the step holds, but that a tile of
    the list kernel reads (the rows between two documents, past a ragged end): the careful twins
    run though no pair is masked (full documents), and every gradient is finite and within
    FlashAttention's rule of float64."""
    blocks, sq, poison = POISONED_GAPS[gaps]
    clean, keep = block_inputs(blocks, sq, 140, 2, 1, 64, seed=5)
    poisoned = [a.copy() for a in clean]
    for i, rows, value in poison:
        poisoned[i][:, rows] = value
    ops = hopper_ops(deterministic, dq_adds=dq_adds)
    counts = _counting(ops)
    got = run_backward(ops, poisoned, [blocks], with_psum=False)
    assert_list_launches(counts, blocks, 64, deterministic)
    for name, g in zip(("dq", "dk", "dv"), got):
        assert np.isfinite(g).all(), name
    check_float64(f"poisoned rows, {gaps}", got, clean, keep, "float16")
    assert not got[1][:, 60:90].any() and not got[1][:, 120:].any()   # rows no rectangle holds


def test_many_documents_take_the_hopper_list_by_default_and_the_old_choice_stays():
    """With the real SM90_MAX_RECTS a step of more, smaller Blocks runs the Hopper list kernel;
    sm90_lists = False gives the mma.sync list kernel; both against float64."""
    n_rects = kernel_ops_module.SM90_MAX_RECTS + 2
    blocks = [Block(40 * i, 40, 40 * i, 40, 40 * i, 40 * i, True) for i in range(n_rects)]
    x, keep = block_inputs(blocks, 40 * n_rects, 40 * n_rects, 2, 2, 64, seed=n_rects)
    for lists, kernel in ((True, LIST), (False, "flash_bwd_dkdv_steps")):
        ops = hopper_ops()
        ops.ops.sm90_lists = lists
        counts = _counting(ops)
        got = run_backward(ops, x, [blocks], with_psum=False)
        assert counts.get(kernel) == (1 if lists else 2) and "flash_bwd_dkdv_sm90" not in counts, counts
        check_float64(f"sm90_lists {lists}", got, x, keep, "float16")


@pytest.mark.skipif(BACKEND != "emulated", reason="seeds a broken kernel")
@pytest.mark.parametrize("deterministic", [False, True])
def test_a_list_kernel_that_fails_its_first_use_check_is_not_used(monkeypatch, deterministic):
    """On a GPU the first use of the list variant runs a step of several rectangles with it and
    with the mma.sync list kernels (`KernelOps._sm90_backward_checked`, after the one-Block
    variant's own check). A list kernel whose results differ (here: launched with twice the
    softmax scale) warns, and the process keeps the mma.sync list kernel, so the caller's
    gradients are right; the one-Block variant passed and stays."""
    from burstcu.ops.cuda import backward as backward_module

    ops = hopper_ops(deterministic)
    ops.ops.first_use_check = True   # as on a GPU
    family = "bwd_dkdv_nodq_sm90" if deterministic else "bwd_dkdv_sm90"
    keys = [ops.ops._first_use_key(ops.ops.variant(f, "float16", 64)) for f in (family, family + "_list")]
    for key in keys:
        kernel_ops_module._SM90_FIRST_USE.pop(key, None)
    launch = backward_module._launch_hopper

    def broken(o, hopper, operands, blk, flag, scale, heads, groups=None):
        return launch(o, hopper, operands, blk, flag, scale * (1 if groups is None else 2), heads, groups)
    monkeypatch.setattr(backward_module, "_launch_hopper", broken)
    blocks = [Block(40 * i, 40, 40 * i, 40, 40 * i, 40 * i, True) for i in range(6)]
    x, keep = block_inputs(blocks, 240, 240, 2, 2, 64, seed=8)
    try:
        counts = _counting(ops)
        with pytest.warns(RuntimeWarning, match="Hopper backward kernel .* failed its first-use"):
            got = run_backward(ops, x, [blocks], with_psum=False)
        assert kernel_ops_module._SM90_FIRST_USE[keys[0]] is True, "the one-Block kernel passed"
        assert kernel_ops_module._SM90_FIRST_USE[keys[1]] is False, "the list kernel failed"
        counts.clear()
        again = run_backward(ops, x, [blocks], with_psum=False)   # no second check
        assert LIST not in counts and counts.get("flash_bwd_dkdv_steps") == 2, counts
        for g in (got, again):
            check_float64("after a failed first-use check", g, x, keep, "float16")
    finally:
        for key in keys:
            kernel_ops_module._SM90_FIRST_USE.pop(key, None)
