"""What the backward can check of its inputs: lse exactly as `attention(..., return_lse=True)`
returns it (dtype and shape), and option flags that must be booleans (`check_flags`)."""

import numpy as np
import pytest

import burstcu
from burstcu.ops.base import as_dtype
from burstcu.validate import InputError, check_backward_inputs, check_flags
from tests.mpi.bodies import make_inputs

# the lse dtype attention returns, written out from docs/api.md (attention)
LSE_DTYPE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


def _forward(dtype):
    q, k, v, dout = make_inputs(11, 1, 16, 2, 1, 8, dtype)
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("dtype", list(LSE_DTYPE))
def test_the_lse_attention_returns_is_accepted(dtype):
    dout, q, k, v, out, lse = _forward(dtype)
    assert lse.dtype == np.dtype(LSE_DTYPE[dtype]) and lse.shape == (1, 2, 16)
    dq, dk, dv = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert all(np.isfinite(g.astype(np.float64)).all() for g in (dq, dk, dv))


@pytest.mark.parametrize("dtype,wrong", [("float16", "float16"), ("float16", "float64"),
                                         ("bfloat16", "bfloat16"), ("float32", "float64"),
                                         ("float32", "float16"), ("float64", "float32")])
def test_lse_of_another_dtype_is_rejected(dtype, wrong):
    dout, q, k, v, out, lse = _forward(dtype)
    bad = lse.astype(as_dtype(wrong))
    want = (f"lse has dtype {wrong}; attention returns {LSE_DTYPE[dtype]} lse for {dtype} inputs: "
            "pass the lse that attention(..., return_lse=True) returned")
    with pytest.raises(TypeError) as info:
        burstcu.attention_backward(dout, q, k, v, out, bad, causal=True)
    assert str(info.value) == want


def test_integer_lse_is_rejected_with_the_dtype_wanted():
    dout, q, k, v, out, lse = _forward("float32")
    with pytest.raises(TypeError, match="lse has dtype int32; attention returns float32 lse for float32"):
        burstcu.attention_backward(dout, q, k, v, out, lse.astype(np.int32), causal=True)


@pytest.mark.parametrize("reshape", [
    lambda lse: lse.transpose(0, 2, 1),          # (B, S, H): the layout of q's first axes
    lambda lse: lse[:, :, :-1],                  # one row short
    lambda lse: np.concatenate([lse, lse], 1),   # twice the heads
    lambda lse: lse[:, :1],                      # one head of two
])
def test_lse_of_another_shape_is_rejected(reshape):
    dout, q, k, v, out, lse = _forward("float32")
    bad = np.ascontiguousarray(reshape(lse))
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, nheads, seqlen_local\) = "
                                         r"\(1, 2, 16\), got .*: pass the lse that attention"):
        burstcu.attention_backward(dout, q, k, v, out, bad, causal=True)


def test_lse_with_an_extra_axis_is_rejected():
    dout, q, k, v, out, lse = _forward("float32")
    with pytest.raises(ValueError, match="lse must have 3 dimensions, got shape"):
        burstcu.attention_backward(dout, q, k, v, out, lse[..., None], causal=True)


def test_check_backward_inputs_returns_the_error_never_raises():
    _, q, _, _, out, lse = _forward("float32")
    err = check_backward_inputs(out, out, lse.astype(np.float64), q, array_types=(np.ndarray,))
    assert isinstance(err, InputError) and err.kind is TypeError and "lse has dtype float64" in err.message
    assert check_backward_inputs(out, out, lse, q, array_types=(np.ndarray,)) is None


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False), np.True_])
def test_check_flags_accepts_bools(value):
    assert check_flags(causal=value, return_lse=value) is None


@pytest.mark.parametrize("value", ["no", "False", "", 0, 1, 1.0, None, [True], np.array(True),
                                   np.int8(1)])
def test_check_flags_rejects_anything_else(value):
    err = check_flags(return_lse=True, causal=value)
    assert isinstance(err, InputError) and err.kind is TypeError
    assert err.message == f"causal must be True or False, got {value!r} ({type(value).__name__})"


def test_check_flags_names_the_first_bad_flag():
    err = check_flags(causal=True, return_lse="yes", other=3)
    assert err.message.startswith("return_lse must be True or False, got 'yes'")
    assert check_flags() is None


@pytest.mark.parametrize("call", ["attention", "attention_backward"])
def test_flags_must_be_bool_through_the_api(call):
    """causal="no" used to be taken as True; now a TypeError naming the flag (every rank: the
    check runs before the agreement round)."""
    q = np.zeros((1, 8, 2, 8))
    with pytest.raises(TypeError, match="causal must be True or False, got 'no'"):
        if call == "attention":
            burstcu.attention(q, q, q, causal="no")
        else:
            out, lse = burstcu.attention(q, q, q, return_lse=True)
            burstcu.attention_backward(q, q, q, q, out, lse, causal="no")
    with pytest.raises(TypeError, match="return_lse must be True or False"):
        burstcu.attention(q, q, q, return_lse=1)
    assert burstcu.attention(q, q, q, causal=np.bool_(True)).shape == q.shape


# -- check=True: the recomputed probabilities of every row sum to 1 over the ring --------------------

def test_check_accepts_the_forward_lse_and_changes_nothing():
    dout, q, k, v, out, lse = _forward("float32")
    checked = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, check=True)
    plain = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert all(np.array_equal(a, b) for a, b in zip(checked, plain))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_check_rejects_an_lse_of_the_right_dtype_and_shape_from_elsewhere(dtype):
    dout, q, k, v, out, lse = _forward(dtype)
    _, lse_full = burstcu.attention(q, k, v, causal=False, return_lse=True)
    _, lse_other = burstcu.attention((q * 1.25).astype(q.dtype), k, v, causal=True, return_lse=True)
    shifted, lowered = lse.copy(), lse.copy()
    shifted[0, 1, 7] += 0.01
    lowered[0, 0, 0] -= 0.5   # causal row 0 sees one key: its P past 1 (held at 1 for dv and dk)
    for bad, causal in ((lse_full, True), (lse_other, True), (shifted, True), (lowered, True),
                        (lse, False)):
        bad = bad.view()   # without the forward's options remembered (a device array has none)
        with pytest.raises(ValueError, match=r"probabilities recomputed from lse sum to .* not 1"):
            burstcu.attention_backward(dout, q, k, v, out, bad, causal=causal, check=True)
        # without check the same call returns plausible, wrong gradients: what check is for
        grads = burstcu.attention_backward(dout, q, k, v, out, bad, causal=causal)
        assert all(np.isfinite(g).all() for g in grads)


def test_check_must_be_a_bool():
    dout, q, k, v, out, lse = _forward("float32")
    with pytest.raises(TypeError, match="check must be True or False"):
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, check="yes")


def test_row_sums_tolerance_grows_with_lse():
    """The check's tolerance, written out here: t = 1e-3 + 64 ulps x max(1, |lse|), a sum within
    [1 - t, e^t] (t is the exponent's error; e^t, not 1 + t, what it makes of a sum: at lse
    1.4e8 in float32 a right lse gave sums of e^8, refused; at 1.7e11, of inf)."""
    from burstcu.validate import check_row_sums
    lse = np.array([[[0.0, 1e4, -np.inf, 1.4e8]]], np.float32)
    eps = float(np.finfo(np.float32).eps)
    t = 1e-3 + 64 * eps * 1e4
    ok = np.array([[[1 + 0.9e-3, 1 - t * 0.99, 0.0, np.exp(8)]]], np.float32)
    assert check_row_sums(lse, ok) is None
    assert check_row_sums(lse, np.array([[[1.0, np.exp(t) * 0.999, 0.0, np.inf]]], np.float32)) is None
    for bad in ([1.002, 1.0, 0.0, 1.0], [1.0, 1 - t * 1.2, 0.0, 1.0], [1.0, np.exp(t) * 1.01, 0.0, 1.0],
                [1.0, 1.0, 1e-3, 1.0], [np.nan, 1.0, 0.0, 1.0], [1.0, np.inf, 0.0, 1.0],
                [1.0, 1.0, 0.0, np.nan]):
        err = check_row_sums(lse, np.array([[bad]], np.float32))
        assert err is not None and err.kind is ValueError and "rank" not in err.message, bad


def _mpi4py():
    pytest.importorskip("mpi4py")


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["burst", "ring", "allgather"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_check_on_the_ring(world, strategy):
    _mpi4py()
    from tests.mpi_run import run_mpi
    results = run_mpi(world, "backward_check_catches_wrong_lse", strategy=strategy)
    assert len(results) == world and all(len(r["raised"]) == 4 for r in results)


@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.parametrize("world", [2])
def test_check_on_the_ring_emulated_kernels(world):
    _mpi4py()
    from tests.mpi_run import run_mpi
    results = run_mpi(world, "backward_check_catches_wrong_lse", backend="emulated", dtype="float16",
                      seqlen_local=32, timeout=600)
    assert all(len(r["raised"]) == 4 for r in results)


@pytest.mark.parametrize("forward,backward,named", [
    (dict(causal=True), dict(), "causal: True in the forward, False here"),
    (dict(causal=True), dict(causal=True, window_size=(3, 0)),
     "window_size: (-1, 0) in the forward, (3, 0) here"),
    (dict(causal=True, cu_seqlens=[0, 5, 16]), dict(causal=True),
     "cu_seqlens: (0, 5, 16) in the forward, None here"),
    (dict(), dict(softmax_scale=0.5), "softmax_scale: 0.35355"),
    (dict(), dict(softmax_scale=1.0001 * 8 ** -0.5), "softmax_scale: 0.35355"),
    (dict(block_mask=burstcu.BlockMask([[0, 16]], [[0, 16]], ["causal"])), dict(causal=True),
     "block_mask: a BlockMask in the forward, None here"),
])
def test_the_backward_refuses_an_lse_of_other_options(forward, backward, named):
    """The lse attention returned remembers the options it depends on (mask and scale): a
    backward given others would silently compute the gradients of another attention. It is a
    ValueError naming them; the forward's own options, one spelled otherwise (the default scale
    given as a number) and a view of lse (other options meant) run."""
    q, k, v, dout = make_inputs(12, 1, 16, 2, 1, 8, "float32")
    out, lse = burstcu.attention(q, k, v, return_lse=True, **forward)
    with pytest.raises(ValueError, match="lse comes from an attention call with other options") as caught:
        burstcu.attention_backward(dout, q, k, v, out, lse, **backward)
    assert named in str(caught.value)
    burstcu.attention_backward(dout, q, k, v, out, lse, **forward)
    burstcu.attention_backward(dout, q, k, v, out, lse, softmax_scale=8 ** -0.5, **forward)
    burstcu.attention_backward(dout, q, k, v, out, lse.view(), **backward)


def test_a_causal_mismatch_names_causal_alone():
    """The window a causal flag implies is not a second difference: the message names causal and
    leaves the window out (the user gave none)."""
    q, k, v, dout = make_inputs(15, 1, 16, 2, 1, 8, "float32")
    out, lse = burstcu.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="causal: False in the forward, True here") as caught:
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert "window_size:" not in str(caught.value)
    with pytest.raises(ValueError, match=r"causal: False in the forward, True here \(a window_size "
                                         r"right bound of 0 is causal too\)"):
        burstcu.attention_backward(dout, q, k, v, out, lse, window_size=(-1, 0))
    out, lse = burstcu.attention(q, k, v, return_lse=True, window_size=(3, -1))
    with pytest.raises(ValueError, match=r"window_size: \(3, -1\) in the forward, \(5, 0\) here"):
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, window_size=(5, 0))


@pytest.mark.parametrize("packed", [False, True])
def test_the_backward_refuses_another_calls_arrays(packed):
    """The lse attention returned also remembers the q, k, v it took and the out it gave (a
    sample of their rows, the end rows and some between): a backward given another call's out,
    or q, k or v changed in place since (a middle row too), would silently compute other
    gradients (check=True sees only q and k through lse). It is a ValueError naming them; the
    same values in other objects, and a view of lse (meant), run."""
    q, k, v, dout = make_inputs(16, 1, 16, 2, 1, 8, "float32")
    q2 = make_inputs(17, 1, 16, 2, 1, 8, "float32")[0]
    if packed:
        q, k, v, dout, q2 = (x[0] for x in (q, k, v, dout, q2))
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    out2 = burstcu.attention(q2, k, v, causal=True)
    said = {}
    for name, args in (("out", (dout, q, k, v, out2, lse)), ("q", (dout, q2, k, v, out, lse)),
                       ("q, out", (dout, q2, k, v, out2, lse))):
        with pytest.raises(ValueError) as caught:
            burstcu.attention_backward(*args, causal=True)
        said[name] = str(caught.value)
    assert said["out"].startswith("out is not what the attention call that returned this lse gave ")
    assert said["q"].startswith("q is not what the attention call that returned this lse took ")
    assert said["q, out"].startswith("q, out are not what the attention call that returned this lse "
                                     "took and gave (another call's, or changed in place since)")
    with pytest.raises(ValueError, match=r"^out is not what"):   # before check=True's round
        burstcu.attention_backward(dout, q, k, v, out2, lse, causal=True, check=True)
    before = v.copy()
    v += 1   # changed in place since the forward
    with pytest.raises(ValueError, match="^v is not what the attention call"):
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    v[...] = before
    middle = 8 if packed else (slice(None), 8)   # not an end row: the sample spreads between
    before = q.copy()
    q[middle] += 1
    with pytest.raises(ValueError, match="^q is not what the attention call"):
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    q[...] = before
    want = burstcu.attention_backward(dout, q, k, v, out, lse.view(), causal=True)
    for got in (burstcu.attention_backward(dout, q.copy(), k.copy(), v.copy(), out.copy(), lse, causal=True),
                burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    burstcu.attention_backward(dout, q, k, v, out2, lse.view(), causal=True)   # meant: runs


def test_a_middle_row_refilled_in_a_long_sequence_is_seen():
    """64 rows: the lse's memory samples rows 0, 1, 62, 63 whole and every fourth between (a
    grid of each): q's row 32 refilled in place since the forward is refused (the ends alone
    missed it, and the gradients came out wrong)."""
    q, k, v, dout = make_inputs(19, 2, 64, 4, 2, 16, "float32")
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    q[:, 32] = make_inputs(20, 2, 64, 4, 2, 16, "float32")[0][:, 32]
    with pytest.raises(ValueError, match="^q is not what the attention call that returned this lse"):
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)


def test_a_cast_out_is_named_for_its_dtype_not_as_another_calls():
    """out alone cast to another dtype (float64 for a float32 call) changes its bytes, which the
    lse's memory took for another call's out; the error is the dtype's, as without that memory.
    q, k, v, out and dout all cast to float16 pass the dtype checks (a float32 lse goes with
    float16 inputs): the memory refuses them, naming the cast; a float16 call's arrays cast to
    float32 (the same values exactly) run."""
    q, k, v, dout = make_inputs(18, 1, 16, 2, 1, 8, "float32")
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    for given in (lse, lse.view()):
        with pytest.raises(TypeError, match="^out has dtype float64, q has float32"):
            burstcu.attention_backward(dout, q, k, v, out.astype(np.float64), given, causal=True)
    halves = [x.astype(np.float16) for x in (dout, q, k, v, out)]
    with pytest.raises(ValueError, match=r"^q, k, v, out are not what the attention call that "
                                         r"returned this lse took and gave \(cast: the call had "
                                         r"float32, these are float16; or another call's\)"):
        burstcu.attention_backward(*halves, lse, causal=True)
    # a float16 call's arrays cast to float32 hold its values exactly: the same attention, run
    out16, lse16 = burstcu.attention(*halves[1:4], causal=True, return_lse=True)
    wide = [x.astype(np.float32) for x in (*halves[:4], out16)]
    got = burstcu.attention_backward(*wide, lse16, causal=True)
    want = burstcu.attention_backward(*wide, lse16.view(), causal=True)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_options_spelled_otherwise_for_the_same_mask_are_the_forwards():
    """A causal right bound of 0 or -1, one document or none, a float32 scale or its float64
    value: the same attention, so the backward takes the forward's lse."""
    q, k, v, dout = make_inputs(14, 1, 16, 2, 1, 8, "float32")
    for forward, backward in ((dict(causal=True, window_size=(-1, 0)), dict(causal=True)),
                              (dict(causal=True, window_size=(4, -1)), dict(causal=True, window_size=[4, 0])),
                              (dict(cu_seqlens=[0, 16]), dict()),
                              (dict(softmax_scale=np.float32(0.1)), dict(softmax_scale=0.1))):
        out, lse = burstcu.attention(q, k, v, return_lse=True, **forward)
        got = burstcu.attention_backward(dout, q, k, v, out, lse, **backward)
        want = burstcu.attention_backward(dout, q, k, v, out, lse, **forward)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), (forward, backward)


def test_a_packed_lse_remembers_its_documents():
    q, k, v, dout = (x[0] for x in make_inputs(13, 1, 16, 2, 1, 8, "float32"))
    out, lse = burstcu.attention(q, k, v, causal=True, cu_seqlens=[0, 9, 16], return_lse=True)
    with pytest.raises(ValueError, match=r"cu_seqlens: \(0, 9, 16\) in the forward, None here"):
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, cu_seqlens=[0, 16])
    burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, cu_seqlens=[0, 9, 16])


def test_check_refuses_an_lse_of_minus_inf_on_rows_that_see_keys():
    """A row's lse of -inf makes the backward take P = 0 on it, so its row sum alone cannot tell
    a row that saw no key from an lse of another mask: check=True asks the backward's mask
    which rows see keys. An lse whose rows were dead under the forward's block mask, given to a
    backward whose mask lets them see keys, is refused (their gradients would be dropped), as
    is the reverse; the forward's own lse, dead rows and all, passes; without a block mask every
    row sees its own position, so no row of a causal lse may be -inf."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 24, 2, 16)).astype(np.float32) for _ in range(4))
    half = burstcu.BlockMask([[0, 12]], [[0, 12]], ["causal"])     # rows 12..23 see no key
    whole = burstcu.BlockMask([[0, 24]], [[0, 24]], ["causal"])
    out, lse = burstcu.attention(q, k, v, block_mask=half, return_lse=True)
    assert np.isneginf(lse[:, :, 12:]).all()
    burstcu.attention_backward(dout, q, k, v, out, lse, block_mask=half, check=True)
    with pytest.raises(ValueError, match=r"lse is -inf at batch 0, head 0, row 12, a row that "
                                         r"sees keys under this mask \(rows wrong: 24\)"):
        burstcu.attention_backward(dout, q, k, v, out.view(), lse.view(), block_mask=whole, check=True)
    # (it said "sum to 0 ... not 0": the sum was right, the lse was not)
    with pytest.raises(ValueError, match=r"lse is finite \([0-9.]+\) at batch 0, head 0, row 6, a "
                                         r"row that sees no key under this mask, where the "
                                         r"forward's lse is -inf"):
        burstcu.attention_backward(dout, q, k, v, out.view(), lse.view(), check=True,
                                   block_mask=burstcu.BlockMask([[0, 6]], [[0, 6]], ["causal"]))
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    dead = lse.copy()
    dead[0, 1, 5] = -np.inf
    with pytest.raises(ValueError, match=r"lse is -inf at batch 0, head 1, row 5, a row that sees "
                                         r"keys under this mask \(rows wrong: 1\)"):
        burstcu.attention_backward(dout, q, k, v, out, dead, causal=True, check=True)
