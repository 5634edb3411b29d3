"""A backward ring step's rectangle list in one launch a kernel (flash_bwd_dkdv_steps,
flash_bwd_dq_steps in kernels/flash_bwd.cu), on the CPU emulator (or a GPU,
tests/kernels/backend.py).

Each case is a G-rank ring over N global positions (zigzag sharding, `burstcu.layout`) with a
mask that cuts its steps into several rectangles: documents, a sliding window, causal chunks
whose key ranges repeat across query ranges. For every step of more than one rectangle:

* deterministic mode: dq, dk, dv and the row sums of P (psum) are bit for bit those of one
  backward_step a rectangle, in the list's order (the per-rectangle kernels), and the step is
  one flash_bwd_dkdv_steps and one flash_bwd_dq_steps launch (each with its careful twin beside
  it where pairs are masked);
* atomic mode: one flash_bwd_dkdv_steps launch, within FlashAttention's rule of a float64
  reference (`assert_fa_rule`, as test_flash_bwd_emulated.py states it) whose mask is spelled
  out from the global positions of the rows (`document_mask` and the window), never from the
  rectangles: a rectangle the kernel skipped would show (test_a_skipped_rectangle_is_caught
  seeds one).

Shapes: q, dout (1, Sq, H, D); k, v (1, Sk, Hkv, D); lse, delta, psum (1, H, Sq).
"""

from __future__ import annotations

import numpy as np
import pytest

from burstcu import layout
from burstcu.build.variants import careful_variant
from burstcu.layout import Block
from burstcu.ops.cuda import kernel_ops as kernel_ops_module
from burstcu.ops.cuda.params import step_group_lists
from burstcu.testing.reference import (document_mask, keep_from_blocks, softmax_stats_ref,
                                       step_backward_ref)
from tests.kernels.backend import kernel_ops
from tests.kernels.test_flash_bwd_emulated import DTYPES, assert_fa_rule
from tests.kernels.test_flash_fwd_emulated import _counting

pytestmark = pytest.mark.emulated

# name: (dtype, d, G ranks, N global positions, documents, causal, window, H, Hkv)
CASES = {
    "documents by zigzag, causal, GQA": ("float16", 64, 2, 128, (0, 17, 40, 90, 128), True,
                                         (-1, -1), 4, 2),
    "sliding window, bf16": ("bfloat16", 64, 2, 128, None, False, (20, 5), 2, 2),
    "causal chunks, key ranges repeat": ("bfloat16", 64, 4, 256, None, True, (-1, -1), 2, 1),
    "documents, causal window, d 128": ("float16", 128, 2, 96, (0, 30, 96), True, (24, 0), 2, 1),
}
MAX_STEPS = 3  # listed steps checked a case (each one compiles nothing new: time is emulation)


def ring_steps(case: str):
    """(q_rank, kv_rank, Sq, Sk, blocks, keep) of every step with more than one rectangle, at
    most MAX_STEPS; keep (Sq, Sk) is the mask over the local rows, from their global positions."""
    _, _, size, n, docs, causal, (left, right), _, _ = CASES[case]
    part = layout.partition("zigzag", size, n, docs)
    every = document_mask(n, causal, docs)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    if left >= 0:
        every &= j >= i - left
    if right >= 0:
        every &= j <= i + right
    out = []
    for qr in range(size):
        for kr in range(size):
            blocks = layout.blocks(part, qr, kr, causal, (left, right), docs)
            if len(blocks) > 1 and len(out) < MAX_STEPS:
                keep = every[np.ix_(part.positions(qr), part.positions(kr))]
                out.append((qr, kr, part.lengths[qr], part.lengths[kr], blocks, keep))
    assert out, f"{case}: no step with several rectangles"
    return out


def step_inputs(case: str, sq: int, sk: int, keep, seed: int):
    """q, dout, k, v in the case's dtype and float32 lse, delta of the step's rows over `keep`."""
    dtype, d, *_, h, hkv = CASES[case]
    rng = np.random.default_rng(seed)
    cast = DTYPES[dtype]
    q, dout = (rng.standard_normal((1, sq, h, d)).astype(cast) for _ in range(2))
    k, v = (rng.standard_normal((1, sk, hkv, d)).astype(cast) for _ in range(2))
    lse, delta = softmax_stats_ref(q, k, v, dout, keep, 1 / np.sqrt(d))
    return q, dout, k, v, lse.astype(np.float32), delta.astype(np.float32)


def run_backward(ops, x, calls, with_psum: bool):
    """backward_step once per entry of `calls` (lists of Blocks) on inputs x: (dq, dk, dv[,
    psum]) in float32."""
    q, dout, k, v, lse, delta = x
    ctx = ops.backward_init(k, v, 1 / np.sqrt(q.shape[-1]))
    dq = np.zeros(q.shape, np.float32)
    psum = np.zeros(lse.shape, np.float32) if with_psum else None
    for blocks in calls:
        ops.backward_step(ctx, q, dout, lse, delta, dq, blocks, psum)
    return (dq, *ops.backward_finalize(ctx, np.float32)) + ((psum,) if with_psum else ())


def check_float64(name, got, x, keep, dtype):
    """dq, dk, dv within FlashAttention's rule of the float64 reference over `keep`."""
    q, dout, k, v, lse, delta = x
    scale = 1 / np.sqrt(q.shape[-1])
    ref = step_backward_ref(q, k, v, dout, lse, delta, keep, scale)
    naive = step_backward_ref(q, k, v, dout, lse, delta, keep, scale, dtype=np.float32,
                              round_to=DTYPES[dtype])
    for grad, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        assert_fa_rule(f"{name} {grad}", g, r, n)


def same_bits(name, a, b):
    """a and b non-finite at the same entries and bit for bit equal at the others."""
    finite = np.isfinite(a)
    assert np.array_equal(finite, np.isfinite(b)), f"{name}: non-finite at other entries"
    assert np.array_equal(a[finite].view(np.uint32), b[finite].view(np.uint32)), f"{name}: bits"


def launches(counts: dict, kernel: str, masked: bool) -> None:
    """`kernel` was launched once, beside its careful twin where the step has masked pairs."""
    assert counts.get(kernel) == (2 if masked else 1), counts


# ------------------------------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("case", list(CASES))
def test_deterministic_list_is_a_launch_a_rectangle_bit_for_bit(case):
    # shuffled thread order: a race on the shared-memory cursor or a stage between rectangles shows
    ops = kernel_ops(deterministic=True, randomize=True, pack_lists=False)
    counts = _counting(ops)
    for n, (qr, kr, sq, sk, blocks, keep) in enumerate(ring_steps(case)):
        x = step_inputs(case, sq, sk, keep, seed=n)
        counts.clear()
        whole = run_backward(ops, x, [blocks], with_psum=True)
        masked = any(blk.masked for blk in blocks)
        launches(counts, "flash_bwd_dkdv_steps", masked)
        launches(counts, "flash_bwd_dq_steps", masked)
        assert "flash_bwd_dkdv" not in counts and "flash_bwd_dq" not in counts, counts
        counts.clear()
        one_by_one = run_backward(ops, x, [[blk] for blk in blocks], with_psum=True)
        assert counts.get("flash_bwd_dkdv") == len(blocks) + sum(b.masked for b in blocks), counts
        for grad, a, b in zip(("dq", "dk", "dv", "psum"), whole, one_by_one):
            same_bits(f"{case} step {qr}<-{kr} {grad}", a, b)
        if n == 0:
            check_float64(f"{case} deterministic", whole[:3], x, keep, CASES[case][0])


@pytest.mark.parametrize("case", list(CASES))
def test_atomic_list_matches_float64(case):
    ops = kernel_ops(pack_lists=False)
    counts = _counting(ops)
    for n, (qr, kr, sq, sk, blocks, keep) in enumerate(ring_steps(case)):
        x = step_inputs(case, sq, sk, keep, seed=10 + n)
        counts.clear()
        got = run_backward(ops, x, [blocks], with_psum=False)
        launches(counts, "flash_bwd_dkdv_steps", any(blk.masked for blk in blocks))
        assert set(counts) <= {"flash_bwd_dkdv_steps", "flash_any_nonfinite"}, counts
        check_float64(f"{case} step {qr}<-{kr} atomic", got, x, keep, CASES[case][0])


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("block", [Block(0, 64, 0, 64, 0, 0, True), Block(0, 50, 0, 40, 0, 0, False)])
def test_a_step_of_one_rectangle_keeps_the_per_rectangle_kernels(deterministic, block):
    """One Block: the table's flash_bwd_dkdv (and flash_bwd_dq) instantiations themselves, each
    beside its careful twin where the block has masked pairs; no list kernel."""
    ops = kernel_ops(deterministic=deterministic)
    names: list = []
    inner = ops.ops
    function = inner.function
    inner.function = lambda name: names.append(name) or function(name)
    keep = keep_from_blocks([block], 64, 64)
    x = step_inputs("documents by zigzag, causal, GQA", 64, 64, keep, seed=5)
    got = run_backward(ops, x, [[block]], with_psum=False)
    expected = []
    for family in (["bwd_dkdv_nodq", "bwd_dq"] if deterministic else ["bwd_dkdv"]):
        variant = inner.variant(family, "float16", 64)
        expected += [variant.name] + ([careful_variant(variant).name] if block.masked else [])
    assert [n for n in names if n.startswith(("flash_bwd_dkdv", "flash_bwd_dq"))] == expected
    check_float64("one rectangle", got, x, keep, "float16")


def test_a_skipped_rectangle_is_caught(monkeypatch):
    """The float64 check of the atomic test fails when one rectangle of a group goes missing
    from the list the kernel runs (the largest one of the step, cut out on the host)."""
    case = "documents by zigzag, causal, GQA"
    qr, kr, sq, sk, blocks, keep = ring_steps(case)[0]
    x = step_inputs(case, sq, sk, keep, seed=3)
    check_float64("whole list", run_backward(kernel_ops(), x, [blocks], False), x, keep, "float16")
    largest = max(blocks, key=lambda blk: blk.q_len * blk.k_len)
    real = kernel_ops_module.step_group_lists   # what KernelOps.step_lists builds with
    monkeypatch.setattr(kernel_ops_module, "step_group_lists",
                        lambda xp, blks, groupings, *pack: real(xp, [b for b in blks if b != largest],
                                                                groupings, *pack))
    got = run_backward(kernel_ops(), x, [blocks], with_psum=False)
    with pytest.raises(AssertionError):
        check_float64("one rectangle skipped", got, x, keep, "float16")


def test_key_ranges_that_overlap_unequal_run_a_launch_a_rectangle():
    """Blocks whose key ranges overlap without being equal cannot share a list launch (two
    blocks of threads would add into the same dK/dV rows): the step runs the per-rectangle
    kernels, bit for bit what a step a Block gives, and one list launch refuses them."""
    ops = kernel_ops(deterministic=True)
    counts = _counting(ops)
    x = step_inputs("documents by zigzag, causal, GQA", 40, 40, np.ones((40, 40), bool), seed=1)
    blocks = [Block(0, 20, 0, 20, 0, 0, False), Block(20, 20, 10, 20, 20, 10, False)]
    whole = run_backward(ops, x, [blocks], with_psum=False)
    assert counts == {"flash_bwd_dkdv": 2, "flash_bwd_dq": 2}, counts
    apart = run_backward(ops, x, [[blk] for blk in blocks], with_psum=False)
    for name, a, b in zip(("dq", "dk", "dv"), whole, apart):
        same_bits(name, a, b)
    with pytest.raises(ValueError, match="key ranges .* overlap"):
        step_group_lists(np, blocks, [("key", 64)])


def test_poisoned_masked_key_runs_the_careful_list_twins():
    """V holds Inf at a key of a causal diagonal rectangle, lse and delta from clean inputs. The
    step's careful list twins run (the flag is set): dq of the rows that see the key and dk of
    the key are non-finite, every other entry (those rows in the same tiles that cannot see it
    included) has the clean run's bits, and the per-rectangle launches give the same."""
    case = "documents by zigzag, causal, GQA"
    ops = kernel_ops(deterministic=True, pack_lists=False)
    counts = _counting(ops)
    qr, kr, sq, sk, blocks, keep = next(s for s in ring_steps(case) if s[0] == s[1])
    x = step_inputs(case, sq, sk, keep, seed=7)
    diagonal = next(b for b in blocks if b.causal and b.k_len >= 8)
    key = diagonal.k_start + diagonal.k_len // 2
    assert not keep[diagonal.q_start:diagonal.q_start + diagonal.q_len, key].all()
    poisoned = list(x)
    poisoned[3] = x[3].copy()
    poisoned[3][0, key] = np.inf
    clean = run_backward(ops, x, [blocks], with_psum=True)
    counts.clear()
    whole = run_backward(ops, poisoned, [blocks], with_psum=True)
    launches(counts, "flash_bwd_dkdv_steps", True)
    launches(counts, "flash_bwd_dq_steps", True)
    one_by_one = run_backward(ops, poisoned, [[blk] for blk in blocks], with_psum=True)
    reach = {"dq": np.broadcast_to(keep[:, key][None, :, None, None], whole[0].shape),
             "dk": np.zeros(whole[1].shape, bool), "dv": np.zeros(whole[2].shape, bool),
             "psum": np.zeros(whole[3].shape, bool)}
    reach["dk"][0, key] = True
    for grad, got, want, per_rect in zip(reach, whole, clean, one_by_one):
        assert not np.isfinite(got[reach[grad]]).any(), f"{grad}: finite where the Inf is seen"
        same_bits(f"poisoned {grad}", np.where(reach[grad], 0, got), np.where(reach[grad], 0, want))
        same_bits(f"poisoned {grad} per rectangle", got, per_rect)
