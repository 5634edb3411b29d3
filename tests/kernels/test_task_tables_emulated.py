"""Steps of many rectangles: the task tables (`burstcu.ops.launch.task_table`) and the step kernels
that read them, on the CPU emulator.

A step under documents (cu_seqlens) has one `Block` per document piece pair; the kernels fold all
of them with one launch per kernel family. The blocks here come from documents of random lengths
1..70 laid over two query pieces and two key pieces at different global positions (as a zigzag
shard has), with causal masks and sliding windows, ragged lengths, GQA, float16 and bfloat16. The
references are float64 over the dense mask of the blocks (`keep_from_blocks`) with
FlashAttention's tolerance rule (tests/kernels/test_flash_fwd_emulated.py, test_flash_bwd_emulated.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from burstcu.layout import Block
from burstcu.ops.launch import RANGE_INTS, TASK_INTS, key_bounds, table_parts, task_table
from burstcu.testing.reference import keep_from_blocks, softmax_stats_ref, step_backward_ref
from tests.kernels.backend import kernel_ops
from tests.kernels.test_flash_bwd_emulated import assert_fa_rule
from tests.kernels.test_flash_fwd_emulated import DTYPES, check, make, run_kernel

pytestmark = pytest.mark.emulated

# (row_start, rows, position of the first row) of each piece, ragged lengths: the query rows hold
# positions 0..130 in two pieces, the key rows positions 63..132 and then 0..62, so that a document
# across position 63 gives its query rows two key ranges, and one across 66 spans two query pieces
Q_PIECES = [(0, 66, 0), (66, 65, 66)]
K_PIECES = [(0, 70, 63), (70, 63, 0)]
SQ, SK = 131, 133
# name -> (causal, left, right)
MASKS = {"causal": (True, -1, -1), "causal_window": (True, 23, -1), "window_both": (False, 17, 9)}


def document_blocks(seed: int, causal: bool, left: int, right: int) -> list[Block]:
    """The blocks of one step under documents of random lengths 1..70 (on the global position
    axis; four in five of them 1..8 long, so that there are many) over Q_PIECES x K_PIECES, in
    random order (a row meets its blocks in this order)."""
    rng = np.random.default_rng(seed)
    end = max(pos + n for _, n, pos in Q_PIECES + K_PIECES)
    edges = [0]
    while edges[-1] < end:
        edges.append(edges[-1] + int(rng.integers(1, 9 if rng.random() < 0.8 else 71)))
    blocks = []
    for a, b in zip(edges[:-1], edges[1:]):
        for qs, qn, qp in Q_PIECES:
            qa, qb = max(a, qp), min(b, qp + qn)
            for ks, kn, kp in K_PIECES:
                ka, kb = max(a, kp), min(b, kp + kn)
                if qa < qb and ka < kb:
                    blocks.append(Block(qs + qa - qp, qb - qa, ks + ka - kp, kb - ka, qa, ka,
                                        causal, left, right))
    order = rng.permutation(len(blocks))
    return [blocks[i] for i in order]


def counting(ops):
    """ops (KernelOps) with `function` wrapped to count launches by name expression."""
    inner = ops.ops if hasattr(ops, "ops") else ops
    counts: dict[str, int] = {}
    plain = inner.function

    def function(name):
        fn = plain(name)

        def launch(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return launch

    inner.function = function
    return counts


def step_launches(counts: dict[str, int], kernel: str) -> dict[str, int]:
    """{name: launches} of the step kernel `kernel` (e.g. "flash_fwd_step<")."""
    return {n: c for n, c in counts.items() if n.startswith(kernel)}


# ------------------------------------------------------------------------------------------------
# the host tables


@pytest.mark.parametrize("by_keys", [False, True])
@pytest.mark.parametrize("rows", [16, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_task_table_partitions_the_rows(by_keys, rows, seed):
    """Tasks are disjoint, at most `rows` long, cover exactly the blocks' rows, carry each row's
    position, and list for every row the blocks covering it, in the blocks' order."""
    blocks = document_blocks(seed, True, 23, -1)
    table, n_tasks = task_table(blocks, by_keys, rows)
    tasks, ranges = table_parts(table, n_tasks)
    tasks, ranges = tasks.reshape(-1, TASK_INTS), ranges.reshape(-1, RANGE_INTS)
    assert len(tasks) == n_tasks and n_tasks > len(blocks) // 4
    own = (lambda b: (b.k_start, b.k_len, b.k_pos)) if by_keys else (lambda b: (b.q_start, b.q_len, b.q_pos))
    other = (lambda b: (b.q_start, b.q_len, b.q_pos)) if by_keys else (lambda b: (b.k_start, b.k_len, b.k_pos))
    seen: dict[int, list] = {}
    for start, length, pos, first, last in tasks:
        assert 0 < length <= rows and 0 <= first < last <= len(ranges)
        for row in range(start, start + length):
            assert row not in seen, f"row {row} in two tasks"
            seen[row] = [tuple(r) for r in ranges[first:last]]
            covering = [b for b in blocks if own(b)[0] <= row < own(b)[0] + own(b)[1]]
            assert all(own(b)[2] + row - own(b)[0] == pos + row - start for b in covering)
            assert seen[row] == [(*other(b), *key_bounds(b)) for b in covering]
    covered = {row for b in blocks for row in range(own(b)[0], own(b)[0] + own(b)[1])}
    assert set(seen) == covered


def test_task_table_refuses_rows_with_two_positions():
    blocks = [Block(0, 10, 0, 10, 0, 0, True), Block(5, 10, 0, 10, 7, 0, True)]
    with pytest.raises(ValueError, match="different positions"):
        task_table(blocks, False, 64)


# ------------------------------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mask", list(MASKS))
def test_forward_documents(dtype, mask):
    """One forward step of document blocks (GQA: 4 query heads on 2 kv heads), against float64."""
    blocks = document_blocks(3, *MASKS[mask])
    q, k, v = make(dtype, 1, SQ, SK, 4, 2, 64, seed=11)
    check(kernel_ops(), dtype, q, k, v, blocks)


def test_forward_sm90_tiles():
    """The sm_90 table's tiles (64-row tasks of 4 warps at d = 64)."""
    blocks = document_blocks(4, *MASKS["causal_window"])
    q, k, v = make("bfloat16", 1, SQ, SK, 2, 1, 64, seed=12)
    check(kernel_ops(arch="sm_90"), "bfloat16", q, k, v, blocks)


def test_forward_one_launch_and_per_block_steps():
    """A step of many blocks makes one launch of the plain and one of the careful step kernel
    (the masked twin pair), and agrees with the same blocks folded one step each (the former
    launch-per-block schedule): the fp32 order of a row's sums differs, so to the dtype's
    rounding, not bitwise."""
    blocks = document_blocks(5, *MASKS["causal"])
    assert len(blocks) > 10
    q, k, v = make("float16", 1, SQ, SK, 2, 2, 64, seed=13)
    ops = kernel_ops()
    counts = counting(ops)
    out1, lse1 = run_kernel(ops, q, k, v, [(k, v, blocks)])
    steps = step_launches(counts, "flash_fwd_step<")
    assert sorted(steps.values()) == [1, 1] and sum(n.endswith(", true>") for n in steps) == 1
    out2, lse2 = run_kernel(ops, q, k, v, [(k, v, [blk]) for blk in blocks])
    assert sum(step_launches(counts, "flash_fwd_step<").values()) == 2 + 2 * len(blocks)
    eps = float(np.finfo(np.float16).eps)
    assert (np.abs(out1 - out2) <= 2 * eps * np.maximum(np.abs(out1), np.abs(out2)) + 1e-6).all()
    seen = np.isfinite(lse2)
    assert (np.isfinite(lse1) == seen).all() and np.abs(lse1 - lse2)[seen].max() <= 1e-5


# ------------------------------------------------------------------------------------------------
# backward


def backward(ops, dtype, blocks, calls, seed=21, h=4, hkv=2, d=64):
    """(kernel (dq, dk, dv), reference, naive) for `calls` (lists of blocks, one backward_step
    each) covering `blocks`."""
    q, k, v = make(dtype, 1, SQ, SK, h, hkv, d, seed=seed)
    dout = np.random.default_rng(seed + 1).standard_normal(q.shape).astype(q.dtype)
    scale = 1.0 / np.sqrt(d)
    mask = keep_from_blocks(blocks, SQ, SK)
    lse, delta = softmax_stats_ref(q, k, v, dout, mask, scale)
    lse32, delta32 = lse.astype(np.float32), delta.astype(np.float32)
    ctx = ops.backward_init(k, v, scale)
    dq = np.zeros(q.shape, np.float32)
    for call in calls:
        ops.backward_step(ctx, q, dout, lse32, delta32, dq, call)
    dk, dv = ops.backward_finalize(ctx, np.float32)
    ref = step_backward_ref(q, k, v, dout, lse32, delta32, mask, scale)
    naive = step_backward_ref(q, k, v, dout, lse32, delta32, mask, scale, dtype=np.float32,
                              round_to=DTYPES[dtype])
    return (dq, dk, dv), ref, naive


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("mask", ["causal", "window_both"])
def test_backward_documents(dtype, deterministic, mask):
    """One backward step of document blocks (GQA), atomic and deterministic, against float64."""
    blocks = document_blocks(6, *MASKS[mask])
    got, ref, naive = backward(kernel_ops(deterministic=deterministic), dtype, blocks, [blocks])
    for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        assert_fa_rule(name, g, r, n)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_one_launch_and_per_block_steps(deterministic):
    """A step of many blocks makes one launch per step kernel family (each twin of the masked
    pair once); deterministic runs repeat bit for bit, and the blocks taken one step each (the
    former launch-per-block schedule) agree within the tolerance rule (the fp32 sums of dK, dV
    and dQ are formed in another order, so not bitwise)."""
    blocks = document_blocks(7, *MASKS["causal_window"])
    ops = kernel_ops(deterministic=deterministic)
    counts = counting(ops)
    got, ref, naive = backward(ops, "bfloat16", blocks, [blocks], h=2, hkv=1)
    kernels = ("flash_bwd_dkdv<", "flash_bwd_dq<") if deterministic else ("flash_bwd_dkdv<",)
    for kernel in kernels:
        steps = step_launches(counts, kernel)
        assert sorted(steps.values()) == [1, 1], steps
    assert not step_launches(counts, "flash_bwd_dq<") or deterministic
    for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        assert_fa_rule(name, g, r, n)
    if deterministic:
        again, _, _ = backward(ops, "bfloat16", blocks, [blocks], h=2, hkv=1)
        for g, a in zip(got, again):
            assert np.array_equal(g, a)
    per_block, _, _ = backward(ops, "bfloat16", blocks, [[blk] for blk in blocks], h=2, hkv=1)
    for name, g, r, n in zip(("dq", "dk", "dv"), per_block, ref, naive):
        assert_fa_rule(name, g, r, n)


def test_randomized_thread_order():
    """The emulator's shuffled thread order (races on shared memory between barriers) over tasks
    of several ranges, whose pipelines drain and restart within one CTA."""
    blocks = document_blocks(8, *MASKS["causal"])
    ops = kernel_ops(randomize=True)
    q, k, v = make("float16", 1, SQ, SK, 2, 1, 64, seed=14)
    check(ops, "float16", q, k, v, blocks)
    got, ref, naive = backward(ops, "float16", blocks, [blocks], h=2, hkv=1)
    for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
        assert_fa_rule(name, g, r, n)
