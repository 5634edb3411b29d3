"""Masked positions are inert in the CUDA kernels (run on the CPU emulator, or a GPU with
BURSTCU_KERNEL_TEST_BACKEND=cupy): an Inf or NaN at a position a row cannot see never reaches that
row's out, lse or dq, nor a key's dk, dv through rows that cannot see the key — although the
tensor cores compute 0 x Inf = NaN wherever a masked (zero) probability meets it in a tile on the
causal diagonal. And where a row does see the poison, its results are not finite.

One causal block, S = 96 rows, head dim 64, two query heads on one kv head. Poison sits at
position 70 (K, V: rows 64..69 share its key tile and cannot see it) or 20 / 40 (Q, dO: the keys
after it in the same tile cannot be seen by that row). Each case runs the kernels on clean and on
poisoned inputs: where the poison cannot reach, the two must agree (exactly in the deterministic
backward and the forward; within float32 atomics' reordering in the atomic backward); where it
must reach, the results must be non-finite. The clean run itself is checked against float64 by
test_flash_{fwd,bwd}_emulated.py.

Also here: the careful kernels (variants.careful_variant) give the plain kernels' bits on finite
tiles, and the dQ pass's row sums of P (attention_backward(check=True)) add up to 1. The forward
cases run on the mma.sync kernels and on the Hopper kernel and its careful twin (arch "sm_90a",
kernels/flash_fwd_sm90.cu; its 128-key tiles hold the whole block).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from burstcu.layout import Block
from tests.kernels.backend import kernel_ops

pytestmark = pytest.mark.emulated

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
S, H, HKV, D = 96, 2, 1, 64
BLOCKS = [Block(0, S, 0, S, 0, 0, True)]
ROWS = np.arange(S)


def inputs(dtype, seed=3):
    rng = np.random.default_rng(seed)
    cast = DTYPES[dtype]
    q = rng.standard_normal((1, S, H, D)).astype(cast)
    k, v = (rng.standard_normal((1, S, HKV, D)).astype(cast) for _ in range(2))
    dout = rng.standard_normal((1, S, H, D)).astype(cast)
    return {"q": q, "k": k, "v": v, "dout": dout}


def poisoned(x: dict, name: str, pos: int, value: float, head: int = 0, col: int | None = None):
    """A copy of the inputs with x[name][0, pos, head, col] (whole row if col is None) = value."""
    out = {n: a.copy() for n, a in x.items()}
    out[name][0, pos, head, slice(None) if col is None else col] = value
    return out


def forward(ops, x, blocks=BLOCKS):
    state = ops.forward_init(x["q"])
    ops.forward_step(state, x["k"], x["v"], blocks)
    out, lse = ops.forward_finalize(state, x["q"].dtype)
    return out.astype(np.float64), lse.astype(np.float64)


def backward(ops, x, out, lse, blocks=BLOCKS, psum=None):
    ctx = ops.backward_init(x["k"], x["v"], 1 / np.sqrt(D))
    dq = np.zeros(x["q"].shape, np.float32)
    dout = x["dout"]
    ops.backward_step(ctx, x["q"], dout, lse.astype(np.float32),
                      ops.backward_delta(dout, out.astype(dout.dtype)), dq, blocks, psum)
    dk, dv = ops.backward_finalize(ctx, np.float32)
    return dq.astype(np.float64), dk.astype(np.float64), dv.astype(np.float64)


def assert_reach(name, got, clean, reached, exact: bool):
    """got is non-finite exactly where `reached` (broadcast) and equals clean elsewhere."""
    reached = np.broadcast_to(reached, got.shape)
    finite = np.isfinite(got)
    assert not finite[reached].any(), f"{name}: finite where the poison is seen"
    assert finite[~reached].all(), (f"{name}: the poison reached {int((~finite[~reached]).sum())} "
                                    f"entries that cannot see it")
    if exact:
        assert np.array_equal(got[~reached], clean[~reached]), f"{name}: differs from the clean run"
    else:
        np.testing.assert_allclose(got[~reached], clean[~reached], rtol=1e-5, atol=1e-6, err_msg=name)


def rows(mask_rows, axis_len=S):
    """(1, S, 1, 1) bool from a per-row mask (broadcasts over heads and columns)."""
    return np.asarray(mask_rows).reshape(1, axis_len, 1, 1)


def lse_rows(mask_rows):
    return np.asarray(mask_rows).reshape(1, 1, S)


# -- forward ------------------------------------------------------------------------------------

ARCHS = [pytest.param(None, id="default"), pytest.param("sm_90a", id="sm_90a")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("value", [np.inf, np.nan])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_poisoned_v(dtype, value, arch):
    ops = kernel_ops(arch=arch)
    x = inputs(dtype)
    out0, lse0 = forward(ops, x)
    out, lse = forward(ops, poisoned(x, "v", 70, value, col=5))
    seen = np.zeros((1, S, 1, D), bool)
    seen[0, 70:, 0, 5] = True                    # rows >= 70 see key 70, in column 5 only
    assert_reach("out", out, out0, seen, exact=True)
    assert_reach("lse", lse, lse0, np.zeros((1, 1, S), bool), exact=True)


@pytest.mark.parametrize("d", [128, 256])
def test_forward_poisoned_v_hopper_twin_with_its_own_stages(d):
    """At d = 128 the Hopper careful twin runs 2 K/V stages where the plain kernel runs 3 (its
    marks would not fit beside a third): over 3 key tiles and more it still gives the plain
    kernel's bits wherever the poison cannot reach."""
    from burstcu.build.fwd_variants import SM90_SMEM_LIMIT, careful_twin, sm90_step_variant

    plain = sm90_step_variant("float16", d)
    twin = careful_twin(plain)
    assert twin.launch.smem_bytes <= SM90_SMEM_LIMIT
    assert (plain.launch.stages, twin.launch.stages) == ((3, 2) if d == 128 else (2, 2))
    ops = kernel_ops(arch="sm_90a")
    s = 400
    rng = np.random.default_rng(4)
    x = {n: rng.standard_normal((1, s, h, d)).astype(np.float16)
         for n, h in (("q", H), ("k", HKV), ("v", HKV))}
    blocks = [Block(0, s, 0, s, 0, 0, True)]
    out0, _ = forward(ops, x, blocks)
    out, _ = forward(ops, poisoned(x, "v", 300, np.nan, col=7), blocks)
    seen = np.zeros((1, s, 1, d), bool)
    seen[0, 300:, 0, 7] = True
    assert_reach("out", out, out0, seen, exact=True)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward_poisoned_k(dtype, arch):
    ops = kernel_ops(arch=arch)
    x = inputs(dtype)
    out0, lse0 = forward(ops, x)
    out, lse = forward(ops, poisoned(x, "k", 70, np.nan))
    assert_reach("out", out, out0, rows(ROWS >= 70), exact=True)
    assert_reach("lse", lse, lse0, lse_rows(ROWS >= 70), exact=True)


# -- backward -------------------------------------------------------------------------------------

MODES = [pytest.param(False, id="atomic"), pytest.param(True, id="deterministic")]


def _backward_case(dtype, deterministic, name, pos, value, head=0):
    ops = kernel_ops(deterministic=deterministic)
    x = inputs(dtype)
    bad = poisoned(x, name, pos, value, head=head)
    clean = backward(ops, x, *forward(ops, x))
    with np.errstate(invalid="ignore", over="ignore"):
        got = backward(ops, bad, *forward(ops, bad))
    return clean, got


@pytest.mark.parametrize("deterministic", MODES)
@pytest.mark.parametrize("dtype,name,pos,head,value", [("float16", "q", 20, 1, np.nan),
                                                        ("bfloat16", "dout", 40, 0, np.inf)])
def test_backward_poisoned_query_row(deterministic, dtype, name, pos, head, value):
    """q (NaN) or dout (+Inf) of one row and head: dq of that row and head only; dk, dv of the
    keys <= pos (the row sees them), never of the keys after it (same tile, masked for it)."""
    (dq0, dk0, dv0), (dq, dk, dv) = _backward_case(dtype, deterministic, name, pos, value, head=head)
    row = np.zeros((1, S, H, 1), bool)
    row[0, pos, head] = True
    assert_reach("dq", dq, dq0, row, exact=deterministic)
    for grad, got, clean in (("dk", dk, dk0), ("dv", dv, dv0)):
        assert_reach(grad, got, clean, rows(ROWS <= pos), exact=deterministic)


@pytest.mark.parametrize("deterministic", MODES)
@pytest.mark.parametrize("name,value", [("v", np.inf), ("k", np.nan)])
def test_backward_poisoned_key(deterministic, name, value):
    """k or v of key 70 poisoned: dq of rows 0..69 (rows 64..69 share the key's tile) stay
    clean, rows 70.. are not finite; dv does not depend on v, so a poisoned v leaves all of it
    clean (a NaN k makes the P of rows 70.. NaN, hence every dk, dv)."""
    (dq0, dk0, dv0), (dq, dk, dv) = _backward_case("float16", deterministic, name, 70, value)
    assert_reach("dq", dq, dq0, rows(ROWS >= 70), exact=deterministic)
    if name == "v":
        assert_reach("dv", dv, dv0, np.zeros(dv.shape, bool), exact=deterministic)
    else:
        assert not np.isfinite(dv).any() and not np.isfinite(dk).any()


@pytest.mark.parametrize("deterministic", MODES)
def test_backward_nan_key_past_the_rows_of_a_ragged_block(deterministic):
    """A block of 80 query rows over 96 keys: key 90 is seen by no row, and holds NaN. The
    zero-filled query rows 80..95 of the last query tile must not turn it into NaN in dk, dv
    (their S = 0 . NaN): every gradient equals the clean run's, key 90's dk, dv are 0."""
    ops = kernel_ops(deterministic=deterministic)
    x = inputs("float16")
    blocks = [Block(0, 80, 0, S, 0, 0, True)]
    out0, lse0 = forward(ops, x, blocks)
    clean = backward(ops, x, out0, lse0, blocks)
    bad = poisoned(x, "k", 90, np.nan)
    out, lse = forward(ops, bad, blocks)
    assert np.array_equal(out, out0) and np.array_equal(lse, lse0)
    with np.errstate(invalid="ignore"):
        got = backward(ops, bad, out, lse, blocks)
    for name, a, b in zip(("dq", "dk", "dv"), clean, got):
        assert np.isfinite(b).all(), name
        if deterministic:
            assert np.array_equal(a, b), name
        else:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)
    assert not got[1][0, 90].any() and not got[2][0, 90].any()


# -- the careful kernels on finite tiles, and the row sums of P ------------------------------------

def _spy_flags(ops) -> list:
    """The device flags the launcher computes from now on (see KernelOps.nonfinite_flag)."""
    inner, flags = ops.ops, []
    compute = inner.nonfinite_flag

    def spy(*tensors):
        flags.append(compute(*tensors))
        return flags[-1]
    inner.nonfinite_flag = spy
    return flags


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("deterministic", MODES)
def test_careful_kernels_match_the_plain_ones_on_finite_tiles(deterministic, arch):
    """NaN in keys 88..95 and query rows 88..95, which the block (rows and keys 0..87) does not
    cover: the flag is raised, so the careful kernels run (asserted), on tiles that are all
    finite. Their results must be the plain kernels' (run on the same inputs with the poison
    zeroed, flag not raised)."""
    ops = kernel_ops(deterministic=deterministic, arch=arch)
    flags = _spy_flags(ops)
    x = inputs("float16")
    blocks = [Block(0, 88, 0, 88, 0, 0, True)]
    bad = {n: a.copy() for n, a in x.items()}
    for name in ("q", "k", "v", "dout"):
        bad[name][0, 88:] = np.nan
        x[name][0, 88:] = 0
    fwd0 = forward(ops, x, blocks)
    fwd = forward(ops, bad, blocks)
    assert [int(ops.host(f)[0]) for f in flags] == [0, 1]      # plain, then careful
    for name, a, b in zip(("out", "lse"), fwd0, fwd):
        assert np.array_equal(a, b), name     # rows 88.. saw nothing: 0 and -inf in both
    out0, lse0 = fwd0
    g0 = backward(ops, x, out0, lse0, blocks)
    with np.errstate(invalid="ignore"):
        g = backward(ops, bad, out0, lse0, blocks)
    assert [int(ops.host(f)[0]) for f in flags[2:]] == [0, 1]
    # on "sm_90a" the backward's plain kernel is the Hopper one (flash_bwd_sm90.cu), its careful
    # twin the mma.sync one: two summation orders (bit-equal only under the emulator)
    for name, a, b in zip(("dq", "dk", "dv"), g0, g):
        if deterministic and arch is None:
            assert np.array_equal(a, b), name
        else:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=name)


def test_row_sums_of_p():
    """backward_step's psum (which runs the deterministic kernels whatever the mode): over the
    two halves of the keys (two steps) every row's sum of P is 1 (to float32 rounding); rows
    outside the blocks get nothing."""
    ops = kernel_ops()
    x = inputs("bfloat16")
    halves = [[Block(8, S - 8, 0, 48, 8, 0, False)], [Block(8, S - 8, 48, 48, 8, 48, True)]]
    state = ops.forward_init(x["q"])
    for blocks in halves:
        ops.forward_step(state, x["k"], x["v"], blocks)
    out, lse = ops.forward_finalize(state, x["q"].dtype)
    psum = np.zeros((1, H, S), np.float32)
    for blocks in halves:
        backward(ops, x, out.astype(np.float64), lse, blocks, psum)
    assert (psum[:, :, :8] == 0).all()
    assert np.abs(psum[:, :, 8:] - 1).max() < 1e-4, np.abs(psum[:, :, 8:] - 1).max()
    # with an lse off by 0.1 in one row, that row's sum is exp(-0.1) instead of 1
    shifted = lse.copy()
    shifted[0, 1, 50] += 0.1
    psum[:] = 0
    for blocks in halves:
        backward(ops, x, out.astype(np.float64), shifted, blocks, psum)
    assert abs(psum[0, 1, 50] - np.exp(-0.1)) < 1e-4


# -- the flag itself -------------------------------------------------------------------------------

FLAG_DTYPES = {**DTYPES, "float32": np.float32}
POISONS = {"float16": [np.inf, -np.inf, np.nan], "bfloat16": [np.inf, np.nan, 2.0**56, -2.0**60],
           "float32": [np.inf, np.nan]}


@pytest.mark.parametrize("dtype", list(FLAG_DTYPES))
@pytest.mark.parametrize("shape", [(1, 40, 2, 64), (2, 33, 3, 96), (1, 17, 1, 8), (2, 5, 2, 40)])
def test_nonfinite_flag_finds_every_poison(shape, dtype):
    """The flag kernel (16-byte loads where rows allow, one element a thread where they do not)
    is 0 on finite data (bfloat16 just below its 2^56 threshold too) and 1 for a poison at any
    of 20 random positions, each in its own launch; also through views with a head stride
    (every other head) and an unaligned start (column 1 on)."""
    ops = kernel_ops()
    rng = np.random.default_rng(sum(shape))
    x = rng.standard_normal(shape).astype(FLAG_DTYPES[dtype])

    def flag(a, view=lambda d: d):
        return int(ops.host(ops.ops.nonfinite_flag(view(ops.to_device(a))))[0])

    assert flag(x) == 0
    if dtype == "bfloat16":
        y = x.copy()
        y.flat[7] = 2.0**55
        assert flag(y) == 0
    for i in range(20):
        y = x.copy()
        y[tuple(int(rng.integers(0, n)) for n in shape)] = POISONS[dtype][i % len(POISONS[dtype])]
        assert flag(y) == 1, (i, np.argwhere(~np.isfinite(y.astype(np.float64))))
    y = x.copy()
    y[:, -1, 0, 0] = POISONS[dtype][0]                   # the last row's first column, head 0
    assert flag(y, lambda d: d[:, :, ::2]) == 1
    assert flag(y, lambda d: d[..., 1:]) == 0 and flag(y, lambda d: d[:, :, 1:]) == 0


def test_nonfinite_flag_of_row_statistics():
    """(B, H, S) float32 statistics (delta, lse) go through a transposed view: a NaN anywhere."""
    ops = kernel_ops()
    d = np.zeros((2, 3, 40), np.float32)
    assert int(ops.host(ops.ops.nonfinite_flag(ops.to_device(d)))[0]) == 0
    for pos in [(0, 0, 0), (1, 2, 39), (0, 1, 17)]:
        e = d.copy()
        e[pos] = np.nan
        assert int(ops.host(ops.ops.nonfinite_flag(ops.to_device(e)))[0]) == 1, pos
