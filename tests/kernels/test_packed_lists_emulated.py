"""Packed rectangle lists (burstcu/ops/cuda/packing.py) through the kernels, on the CPU emulator
(or a GPU, tests/kernels/backend.py): per-document zigzag steps packed on the sm_80 and sm_90a
tables (causal, and causal under a sliding window; GQA), forward and backward (atomic and
deterministic dQ, psum), against the float64 reference by FlashAttention's rule with the mask
spelled out from global positions (never from the runs); deterministic runs repeat bit for bit;
a NaN in V at a key that a packed tile spans but a row does not see leaves the forward's rows
that do not see it, and every gradient it cannot reach, as the clean run's: bit for bit, but for
the sm_90a table's backward, whose careful twin is the mma.sync kernel (within FlashAttention's
rule of float64 there). The host side: tests/ops/test_packing.py.

Shapes: q, dout (1, Sq, H, D); k, v (1, Sk, Hkv, D); lse, delta (1, H, Sq).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from burstcu import layout
from burstcu.ops.cuda import kernel_ops as kernel_ops_module
from burstcu.testing.reference import document_mask, keep_from_blocks, softmax_stats_ref
from tests.kernels.backend import kernel_ops
from tests.kernels.test_flash_bwd_emulated import DTYPES
from tests.kernels.test_flash_bwd_lists_emulated import check_float64, run_backward, same_bits
from tests.kernels.test_flash_fwd_emulated import _counting, check

pytestmark = pytest.mark.emulated   # BURSTCU_KERNEL_TEST_BACKEND=cupy runs it on a GPU

DOCS = (0, 20, 45, 50, 90, 130, 170, 200, 260, 300)   # a packed step over 2 ranks
N, SIZE = 300, 2
WINDOWS = {"causal": (-1, -1), "causal window": (30, 0)}
# (table, head dim, dtype, window): each table and head dim causal, two under the window too
CASES = [("sm_80", 64, "float16", "causal"), ("sm_80", 128, "bfloat16", "causal"),
         ("sm_90a", 64, "bfloat16", "causal"), ("sm_90a", 128, "float16", "causal"),
         ("sm_80", 128, "bfloat16", "causal window"), ("sm_90a", 64, "bfloat16", "causal window")]


@pytest.fixture
def lists_always(monkeypatch):
    """Every step of 2 or more Blocks takes a list kernel, on the sm_90a table the Hopper one."""
    monkeypatch.setattr(kernel_ops_module, "SM90_MAX_RECTS", 1)
    monkeypatch.setattr(kernel_ops_module, "SM90_MIN_FLOP_PER_RECT", math.inf)


def _steps(window=(-1, -1)):
    """(q_rank, kv_rank, Sq, Sk, blocks, keep) of the causal DOCS ring's steps under `window`,
    keep (Sq, Sk) from the global positions."""
    part = layout.partition("zigzag", SIZE, N, DOCS)
    every = document_mask(N, True, DOCS)
    if window[0] >= 0:
        every &= np.arange(N)[None, :] >= np.arange(N)[:, None] - window[0]
    for qr in range(SIZE):
        for kr in range(SIZE):
            blocks = layout.blocks(part, qr, kr, True, window, DOCS)
            keep = every[np.ix_(part.positions(qr), part.positions(kr))]
            assert np.array_equal(keep_from_blocks(blocks, part.lengths[qr], part.lengths[kr]), keep)
            yield qr, kr, part.lengths[qr], part.lengths[kr], blocks, keep


def _ops(arch: str, deterministic: bool = False):
    """`kernel_ops` on the `arch` table (a GPU without it: skip)."""
    try:
        return kernel_ops(arch=arch, deterministic=deterministic)
    except ValueError as e:   # sm_90a on a GPU other than compute capability 9.0
        pytest.skip(str(e))


def _packed_lists(ops) -> list:
    """Wraps ops.step_lists: the `packed` of every StepGroups it returns, in call order."""
    inner = ops.ops
    seen, step_lists = [], inner.step_lists

    def recorded(blocks, groupings):
        lists = step_lists(blocks, groupings)
        seen.extend(groups.packed for groups in lists)
        return lists
    inner.step_lists = recorded
    return seen


def _backward_inputs(sq, sk, keep, d, dtype, seed):
    """q, dout (1, sq, 4, d), k, v (1, sk, 2, d) in `dtype` and float32 lse, delta (1, 4, sq) of
    attention over `keep`."""
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((1, sq, 4, d)).astype(DTYPES[dtype]) for _ in range(2))
    k, v = (rng.standard_normal((1, sk, 2, d)).astype(DTYPES[dtype]) for _ in range(2))
    lse, delta = softmax_stats_ref(q, k, v, dout, keep, 1 / np.sqrt(d))
    return q, dout, k, v, lse.astype(np.float32), delta.astype(np.float32)


@pytest.mark.parametrize("arch, d, dtype, window", CASES)
@pytest.mark.usefixtures("lists_always")
def test_forward_packed_matches_float64(arch, d, dtype, window):
    """Every step of the ring packed, in one list launch (with its careful twin: a packed tile
    masks), within FlashAttention's rule of the float64 reference (4 query heads on 2)."""
    ops = _ops(arch)
    packed = _packed_lists(ops)
    counts = _counting(ops)
    rng = np.random.default_rng(5)
    kernel = "flash_fwd_steps_sm90" if arch == "sm_90a" else "flash_fwd_steps"
    for qr, kr, sq, sk, blocks, keep in _steps(WINDOWS[window]):
        q = rng.standard_normal((1, sq, 4, d)).astype(DTYPES[dtype])
        k, v = (rng.standard_normal((1, sk, 2, d)).astype(DTYPES[dtype]) for _ in range(2))
        packed.clear()
        counts.clear()
        check(ops, dtype, q, k, v, blocks)
        assert packed == [True], (qr, kr, packed)
        assert counts.get(kernel) == 2, counts


def _check_backward(name, got, x, keep, dtype, deterministic):
    """dq, dk, dv within FlashAttention's rule of float64 over `keep`; with psum (deterministic),
    each row's sum of P within 2e-2 of float64's."""
    check_float64(name, got[:3], x, keep, dtype)
    if deterministic:
        q, _, k, _, lse, _ = x
        scale = 1 / np.sqrt(q.shape[-1])
        heads = np.repeat(np.arange(k.shape[2]), q.shape[2] // k.shape[2])
        scores = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64),
                           k[:, :, heads].astype(np.float64)) * scale
        p_sum = np.where(keep, np.exp(scores - lse[..., None]), 0.0).sum(-1)
        assert np.allclose(got[3], p_sum, rtol=2e-2, atol=2e-2), np.abs(got[3] - p_sum).max()


@pytest.mark.parametrize("arch, d, dtype, window", CASES)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.usefixtures("lists_always")
def test_backward_packed_matches_float64(arch, d, dtype, deterministic, window):
    """Every step of the ring packed (every list the step's kernels read), dq, dk, dv within
    FlashAttention's rule of the float64 reference (4 query heads on 2); deterministic: the row
    sums of P (psum) those of float64, and a second run the same bits."""
    ops = _ops(arch, deterministic)
    ops.ops.dq_own_pass_headdims = ()
    packed = _packed_lists(ops)
    for qr, kr, sq, sk, blocks, keep in _steps(WINDOWS[window]):
        x = _backward_inputs(sq, sk, keep, d, dtype, seed=qr * SIZE + kr)
        packed.clear()
        got = run_backward(ops, x, [blocks], with_psum=deterministic)
        assert packed and all(packed), (qr, kr, packed)
        _check_backward(f"{qr}<-{kr}", got, x, keep, dtype, deterministic)
        if deterministic:
            again = run_backward(ops, x, [blocks], with_psum=True)
            for name, a, b in zip(("dq", "dk", "dv", "psum"), got, again):
                same_bits(f"{qr}<-{kr} {name} again", a, b)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.usefixtures("lists_always")
def test_head_dim_256_packed(arch):
    """d = 256 (the Hopper backward's 64-key blocks, dQ in a pass of its own there by default;
    the mma.sync dK/dV list kernel whose run test reads its runs an element), forward and
    backward of the diagonal step packed, against float64."""
    qr, kr, sq, sk, blocks, keep = next(iter(_steps()))
    ops = _ops(arch)
    packed = _packed_lists(ops)
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, sq, 4, 256)).astype(np.float16)
    k, v = (rng.standard_normal((1, sk, 2, 256)).astype(np.float16) for _ in range(2))
    check(ops, "float16", q, k, v, blocks)
    x = _backward_inputs(sq, sk, keep, 256, "float16", seed=12)
    _check_backward("d 256", run_backward(ops, x, [blocks], with_psum=False), x, keep, "float16",
                    False)
    assert packed and all(packed), packed


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("seed", [9, 11, 12])
@pytest.mark.usefixtures("lists_always")
def test_a_nan_a_packed_tile_spans_stays_with_the_pairs_that_see_it(arch, seed):
    """V holds NaN at one key of the diagonal step; a packed tile spans it beside keys of other
    documents. The careful twins run (the flag is set). Forward: the rows that do not see the key
    keep the clean run's bits, the rows that see it are NaN. Backward (deterministic, the NaN in
    V): dk of the key and dq of the rows that see it are non-finite; dq of the other rows, dk of
    every other key and all of dv keep the clean run's bits on the sm_80 table. On sm_90a the
    clean step runs the Hopper dK/dV kernel and the poisoned one its careful twin, the mma.sync
    kernel, which rounds P and dS otherwise (seeds 11 and 12 move 64 entries of dk or dv by up to
    ~2e-4 relative): there dk and dv are within FlashAttention's rule of float64, as the clean
    run is, and dq (the mma.sync dQ pass either way) keeps its bits."""
    ops = _ops(arch, deterministic=True)
    packed = _packed_lists(ops)
    counts = _counting(ops)
    qr, kr, sq, sk, blocks, keep = next(iter(_steps()))
    x = _backward_inputs(sq, sk, keep, 64, "float16", seed=seed)
    q, dout, k, v, lse, delta = x
    key = int(np.argmax(keep.sum(0) > 0) + 3)          # a key some rows see
    sees = keep[:, key]
    assert sees.any() and not sees.all()
    poisoned = v.copy()
    poisoned[0, key] = np.nan

    def forward(v_in):
        state = ops.forward_init(q)
        ops.forward_step(state, k, v_in, blocks)
        return ops.forward_finalize(state, q.dtype)[0]
    clean = forward(v)
    counts.clear()
    got = forward(poisoned)
    assert counts.get("flash_any_nonfinite") == 1, counts
    assert np.isnan(got[0, sees].astype(np.float32)).all()
    assert np.array_equal(got[0, ~sees].view(np.uint16), clean[0, ~sees].view(np.uint16))

    clean = run_backward(ops, x, [blocks], with_psum=False)
    got = run_backward(ops, (q, dout, k, poisoned, lse, delta), [blocks], with_psum=False)
    reach = {"dq": np.broadcast_to(sees[None, :, None, None], got[0].shape),
             "dk": np.zeros(got[1].shape, bool), "dv": np.zeros(got[2].shape, bool)}
    reach["dk"][0, key] = True   # dS of the key is NaN (dP = dO . v); dV = P^T dO stays finite
    assert not np.isfinite(got[0][reach["dq"]]).any() and not np.isfinite(got[1][reach["dk"]]).any()
    hopper = ("dk", "dv") if arch == "sm_90a" else ()   # dQ: the mma.sync pass's, plain or careful
    for grad, a, b in zip(reach, got, clean):
        if grad not in hopper:
            same_bits(f"poisoned {grad}", np.where(reach[grad], 0, a), np.where(reach[grad], 0, b))
    if hopper:   # the unreached entries by the rule, the reached ones the clean run's
        check_float64("poisoned", [np.where(reach[g], b, a) for g, a, b in zip(reach, got, clean)],
                      x, keep, "float16")
    assert packed and all(packed), packed
