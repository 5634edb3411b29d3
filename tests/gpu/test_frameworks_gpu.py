"""PyTorch and JAX arrays on a GPU with group=None: routed to the CUDA kernels by their DLPack
device, viewed zero-copy, and handed back in their own framework on the same device, within
FlashAttention's tolerance rule of a float64 reference. Skipped without a GPU (and per framework
when it is not installed or has no GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import burstcu
from burstcu.group import gpu_usable
from burstcu.testing.reference import attention_backward_ref, attention_ref, within_fa_rule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU")]

NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
EPS32 = 2.0**-23  # the naive carries the half-precision roundings; the absolute term is fp32 noise
SHAPES = ((2, 160, 4, 64), (2, 160, 2, 64), (2, 160, 2, 64), (2, 160, 4, 64))  # q, k, v, dout


def _check_against_reference(host, results, dtype):
    """host: NumPy (q, k, v, dout) in the dtype; results: (out, dq, dk, dv) as float64 NumPy."""
    q, k, v, dout = host
    rnd = NP[dtype]
    refs = [attention_ref(q, k, v, True)[0], *attention_backward_ref(dout, q, k, v, True)]
    naives = [attention_ref(q, k, v, True, dtype=np.float32, round_to=rnd)[0],
              *attention_backward_ref(dout, q, k, v, True, dtype=np.float32, round_to=rnd,
                                      out_dtype=rnd)]
    for name, got, ref, naive, factor in zip(("out", "dq", "dk", "dv"), results, refs, naives,
                                             (2.0, 3.0, 3.0, 3.0)):
        ok, err, bound = within_fa_rule(got, ref, naive, EPS32, factor)
        assert ok, f"{name}: {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_cuda_tensors(dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    t = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(s, device="cuda", generator=gen).to(t) for s in SHAPES)
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    for x, like in zip((out, *grads), (q, q, k, v)):
        assert isinstance(x, torch.Tensor) and x.device == like.device and x.dtype == t
        assert x.shape == like.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 160)
    host = [x.float().cpu().numpy().astype(NP[dtype]) for x in (q, k, v, dout)]
    _check_against_reference(host, [x.double().cpu().numpy() for x in (out, *grads)], dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_gpu_arrays(dtype):
    jax = pytest.importorskip("jax")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend here")
    jnp = jax.numpy
    rng = np.random.default_rng(1)
    host = [rng.standard_normal(s, dtype=np.float32).astype(NP[dtype]) for s in SHAPES]
    q, k, v, dout = (jax.device_put(jnp.asarray(x), device) for x in host)
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    for x, like in zip((out, *grads), (q, q, k, v)):
        assert isinstance(x, jax.Array) and x.dtype == like.dtype and x.shape == like.shape
        assert list(x.devices())[0].platform == "gpu"
    _check_against_reference(host, [np.asarray(x.astype(jnp.float32), np.float64)
                                    for x in (out, *grads)], dtype)
