"""What the backward can check of its inputs: lse exactly as `attention(..., return_lse=True)`
returns it (dtype and shape), and option flags that must be booleans (`check_flags`)."""

import numpy as np
import pytest

import burstcu
from burstcu.validate import InputError, check_backward_inputs, check_flags
from tests.mpi.bodies import DTYPES, make_inputs

# the lse dtype attention returns, written out from the README's API table
LSE_DTYPE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}


def _forward(dtype):
    if dtype not in DTYPES:
        pytest.skip(f"{dtype} needs ml_dtypes")
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
    bad = lse.astype(DTYPES[wrong])
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
