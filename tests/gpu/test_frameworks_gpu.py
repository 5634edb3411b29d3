"""PyTorch and JAX arrays on a GPU with group=None: routed to the CUDA kernels by their DLPack
device, viewed zero-copy, and handed back in their own framework on the same device, within
FlashAttention's tolerance rule of a float64 reference. Skipped without a GPU (and per framework
when it is not installed or has no GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import burstcu
from burstcu.transport.bootstrap import gpu_usable
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


def _jax_gpu_inputs(dtype: str, seed: int):
    """(jax, host arrays (q, k, v, dout) in the dtype, the same as jax arrays on the GPU);
    skips without JAX or its GPU backend."""
    jax = pytest.importorskip("jax")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("jax has no GPU backend here")
    rng = np.random.default_rng(seed)
    host = [rng.standard_normal(s, dtype=np.float32).astype(NP[dtype]) for s in SHAPES]
    return jax, host, [jax.device_put(jax.numpy.asarray(x), device) for x in host]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_gpu_arrays(dtype):
    jax, host, (q, k, v, dout) = _jax_gpu_inputs(dtype, 1)
    jnp = jax.numpy
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    for x, like in zip((out, *grads), (q, q, k, v)):
        assert isinstance(x, jax.Array) and x.dtype == like.dtype and x.shape == like.shape
        assert list(x.devices())[0].platform == "gpu"
    _check_against_reference(host, [np.asarray(x.astype(jnp.float32), np.float64)
                                    for x in (out, *grads)], dtype)


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    return torch


def _torch_inputs(torch, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(s, device="cuda", generator=gen).to(getattr(torch, dtype)) for s in SHAPES]


def _adapter_step(torch, q, k, v, dout, group=None, **kwargs):
    """out and (dq, dk, dv) of burstcu.torch.attention through autograd."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = burstcu.torch.attention(*leaves, group, causal=True, **kwargs)
    (out.float() * dout.float()).sum().backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_adapter_autograd_on_cuda(dtype):
    torch = _torch_cuda()
    q, k, v, dout = _torch_inputs(torch, dtype)
    out, grads = _adapter_step(torch, q, k, v, dout)
    for x, like in zip((out, *grads), (q, q, k, v)):
        assert x.is_cuda and x.dtype == like.dtype and x.shape == like.shape
    host = [x.float().cpu().numpy().astype(NP[dtype]) for x in (q, k, v, dout)]
    _check_against_reference(host, [x.detach().double().cpu().numpy() for x in (out, *grads)], dtype)


def test_torch_adapter_orders_itself_after_a_side_streams_work():
    """Inputs written by a long chain of kernels on a side stream, used at once on that stream:
    burstcu runs on torch's current stream (CuPy's ExternalStream), so it reads them finished,
    and autograd's backward (on the same stream) sees out and lse finished too."""
    torch = _torch_cuda()
    dtype = "float16"
    q0, k0, v0, dout = _torch_inputs(torch, dtype, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):                       # ~tens of ms of work before the inputs exist
            big = torch.tanh(big @ big * 1e-3)
        scale = 1 + big.mean() * 0               # 1, but known only after the chain
        q, k, v = (x * scale.to(x.dtype) for x in (q0, k0, v0))
        out, grads = _adapter_step(torch, q, k, v, dout)
        results = [x.detach().double().cpu().numpy() for x in (out, *grads)]   # .cpu() syncs the side stream
    host = [x.float().cpu().numpy().astype(NP[dtype]) for x in (q0, k0, v0, dout)]
    _check_against_reference(host, results, dtype)


def test_torch_adapter_with_three_ranks_sharing_the_gpu():
    """run_ranks: 3 ranks on threads, each on its own torch stream, zigzag shards of one
    sequence; the gathered out and grads equal one process's within the FA rule. Each rank
    calls its node's backward itself: torch's autograd engine runs CUDA backward work on one
    thread per device, where three ranks of one process would wait on each other (ranks that
    are processes, as under mpiexec, each have their own)."""
    torch = _torch_cuda()
    from burstcu.testing.world import run_ranks
    dtype, size = "float16", 3
    whole = _torch_inputs(torch, dtype, seed=5)

    def body(group):
        with torch.cuda.stream(torch.cuda.Stream()):
            q, k, v, dout = (burstcu.shard(x, group, "zigzag") for x in whole)
            leaves = [x.requires_grad_() for x in (q, k, v)]
            out = burstcu.torch.attention(*leaves, group, causal=True, layout="zigzag")
            grads = out.grad_fn.apply(dout)[:3]
            gathered = [burstcu.unshard(x.detach(), group, "zigzag") for x in (out, *grads)]
            return [x.double().cpu().numpy() for x in gathered]

    host = [x.float().cpu().numpy().astype(NP[dtype]) for x in whole]
    for results in run_ranks(size, body, backend="cupy"):
        _check_against_reference(host, results, dtype)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_adapter_grads_on_gpu(dtype, jit):
    """jax.grad through burstcu.jax.attention on GPU arrays: eager (DLPack to CuPy) and under
    jax.jit (a buffer_callback on XLA's buffers and stream, held in program order)."""
    jax, host, (q, k, v, dout) = _jax_gpu_inputs(dtype, 7)
    jnp = jax.numpy

    def loss(q, k, v):
        out = burstcu.jax.attention(q, k, v, causal=True)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum(), out

    step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, out), grads = (jax.jit(step) if jit else step)(q, k, v)
    for x, like in zip((out, *grads), (q, q, k, v)):
        assert x.dtype == like.dtype and x.shape == like.shape
        assert list(x.devices())[0].platform == "gpu"
    _check_against_reference(host, [np.asarray(x.astype(jnp.float32), np.float64)
                                    for x in (out, *grads)], dtype)
