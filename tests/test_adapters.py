"""burstcu.jax and burstcu.torch: gradients through the autodiff adapters equal float64
references, under jax.jit and torch autograd, in one process and under mpiexec; bad options and
the plain API's framework errors say what to do."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import burstcu
from burstcu.testing.reference import (attention_backward_ref, attention_ref, document_mask,
                                       linear_attention_ref, max_err, within_fa_rule)
from tests.mpi.bodies import EPS
from tests.mpi_run import run_mpi

WORLDS = [1, 2, 3, 4]


def _inputs(seed=0, n=40, h=4, hkv=2, d=16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, n, h, d)), rng.standard_normal((2, n, hkv, d)),
            rng.standard_normal((2, n, hkv, d)), rng.standard_normal((2, n, h, d)))


# -- PyTorch ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def test_torch_gradcheck_with_window_and_gqa(torch):
    # 16 rows: the window (5 keys back) still cuts every row past the sixth; head dim 4 (gradcheck
    # calls the op twice an input element: 512 of them)
    q, k, v, _ = (torch.from_numpy(x[:1, :16, :, :4]).requires_grad_() for x in _inputs(1))
    assert torch.autograd.gradcheck(
        lambda q, k, v: burstcu.torch.attention(q, k, v, causal=True, window_size=(5, 0)), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: burstcu.torch.linear_attention(q, k, v, causal=True), (q, k, v))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_grads_in_each_dtype_within_the_fa_rule(torch, dtype):
    """out and grads in the tensors' dtype, within FlashAttention's rule of a naive same-dtype
    implementation (float32 arithmetic on inputs rounded to the dtype)."""
    q, k, v, dout = _inputs(2)
    rounded = [torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v, dout)]
    leaves = [x.clone().requires_grad_() for x in rounded[:3]]
    out = burstcu.torch.attention(*leaves, causal=True)
    (out.float() * rounded[3].float()).sum().backward()
    assert out.dtype == leaves[0].grad.dtype == getattr(torch, dtype)
    exact = [x.float().numpy().astype(np.float64) for x in rounded]    # the inputs as rounded
    _assert_fa_rule(dtype, exact, [x.detach().float().numpy() for x in (out, *(t.grad for t in leaves))])


def _assert_fa_rule(dtype: str, exact: list, got: list):
    """got = (out, dq, dk, dv) of causal attention of exact = (q, k, v, dout) (float64 values of
    the rounded inputs) within FlashAttention's rule against float64, where the naive
    implementation computes in float32 with P and dS rounded to `dtype`."""
    half = None if dtype == "float32" else np.float16 if dtype == "float16" else _bf16()
    ref = [attention_ref(*exact[:3], True)[0], *attention_backward_ref(exact[3], *exact[:3], True)]
    naive = [attention_ref(*exact[:3], True, dtype=np.float32, round_to=half)[0],
             *attention_backward_ref(exact[3], *exact[:3], True, dtype=np.float32, round_to=half,
                                     out_dtype=half)]
    for name, g, r, nv in zip(("out", "dq", "dk", "dv"), got, ref, naive):
        ok, err, bound = within_fa_rule(g, r, nv, EPS[dtype], factor=3.0)
        assert ok, (name, err, bound)


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def test_torch_decode_and_plain_api_errors(torch):
    q, k, v, _ = _inputs(3)
    out = burstcu.torch.decode(torch.from_numpy(q[:, :1]), torch.from_numpy(k), torch.from_numpy(v),
                               cache_seqlens=torch.tensor([40, 17]))
    assert isinstance(out, torch.Tensor)
    ref0 = attention_ref(q[:1, :1], k[:1], v[:1])[0]
    ref1 = attention_ref(q[1:, :1], k[1:, :17], v[1:, :17])[0]
    assert max_err(out.numpy(), np.concatenate([ref0, ref1])) < 1e-12
    needs_grad = torch.from_numpy(q).requires_grad_()
    with pytest.raises(TypeError, match="burstcu.torch.attention"):
        burstcu.attention(needs_grad, needs_grad, needs_grad)
    with pytest.raises(TypeError, match="bfloat16"):
        burstcu.attention(*(torch.from_numpy(q).to(torch.bfloat16),) * 3)
    with pytest.raises(TypeError, match=r"\['windw'\]"):
        burstcu.torch.attention(needs_grad, needs_grad, needs_grad, windw=(1, 1))


def test_torch_refuses_a_double_backward(torch):
    """create_graph=True (a gradient penalty) through either function: RuntimeError, not first
    gradients that would silently differentiate as constants; plain backward still runs."""
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _inputs(3)[:3])
    for fn in (burstcu.torch.attention, burstcu.torch.linear_attention):
        with pytest.raises(RuntimeError, match="no double backward"):
            torch.autograd.grad(fn(q, k, v, causal=True).sum(), q, create_graph=True)
        (dq,) = torch.autograd.grad(fn(q, k, v, causal=True).sum(), q)
        assert dq.shape == q.shape and not dq.requires_grad


def _torch_out_and_v_grad(torch, fn, q, k, v, dout, q_given=None, k_given=None, scribble=False):
    """(out, v's gradient) of burstcu.torch's `fn` (causal) on tensors of q, k, v needing gradients,
    q_given / k_given in place of q's / k's tensor; scribble: q_given zeroed after the forward."""
    tensors = [torch.from_numpy(x.copy()).requires_grad_(True) for x in (q, k, v)]
    given = [tensors[0] if q_given is None else q_given, tensors[1] if k_given is None else k_given]
    out = getattr(burstcu.torch, fn)(*given, tensors[2], causal=True)
    if scribble:
        q_given[...] = 0
    out.backward(torch.from_numpy(dout))
    return out, tensors[2].grad


def test_torch_func_transforms_are_refused_by_name(torch):
    """torch.func's grad, vmap and jvp around any of the adapter's functions: a RuntimeError that
    says they are not supported and what to use (torch's own asked the Function for a
    setup_context); plain autograd still runs after them."""
    from torch.func import grad, jvp, vmap

    q = torch.randn(2, 16, 2, 8, dtype=torch.float64)
    calls = {"grad attention": lambda: grad(lambda x: burstcu.torch.attention(x, q, q).sum())(q),
             "vmap attention": lambda: vmap(lambda x: burstcu.torch.attention(x, q[0], q[0]))(q),
             "jvp attention": lambda: jvp(lambda x: burstcu.torch.attention(x, q, q), (q,), (q,)),
             "grad linear": lambda: grad(lambda x: burstcu.torch.linear_attention(x, q, q).sum())(q),
             "vmap decode": lambda: vmap(lambda x: burstcu.torch.decode(x[None, :1], q, q))(q)}
    for name, call in calls.items():
        what = name.split()[1] if name.split()[1] != "linear" else "linear_attention"
        with pytest.raises(RuntimeError, match=rf"burstcu.torch.{what} does not run under torch.func "
                                               rf"transforms .*Use torch.autograd"):
            call()
    x = q.clone().requires_grad_()
    burstcu.torch.attention(x, q, q).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_torch_takes_numpy_arrays_as_tensors_of_their_values(torch):
    """A NumPy array among q, k, v (of either byte order, read-only too) beside tensors that need
    gradients is taken as a tensor copy of its values: autograd saves it (an array failed there,
    after the collective forward, on its rank alone), out and the gradients are the bits of the
    call given tensors, and writing to the array after the forward leaves the backward as it was."""
    q, k, v, dout = _inputs()
    swapped = q.astype(q.dtype.newbyteorder(">"))
    swapped.flags.writeable = False
    for fn in ("attention", "linear_attention"):
        want = _torch_out_and_v_grad(torch, fn, q, k, v, dout)
        for kw in ({"q_given": q}, {"q_given": swapped}, {"q_given": q.copy(), "scribble": True},
                   {"k_given": k}):
            got = _torch_out_and_v_grad(torch, fn, q, k, v, dout, **kw)
            assert got[0].requires_grad, (fn, kw)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (fn, kw)


DOCS, REFILLED = (0, 24, 40), (0, 8, 40)    # a batch's documents and the next batch's, rows 0..39


def _docs_grads_ref(q, k, v, dout, docs) -> list:
    """float64 (out, dq, dk, dv) of causal attention within the documents `docs` (rows of one
    sequence, batch 2), spelled out by the reference."""
    keep = document_mask(q.shape[1], True, docs)
    return [attention_ref(q, k, v, keep=keep)[0], *attention_backward_ref(dout, q, k, v, keep=keep)]


def _assert_documents(got: list, want: list, other: list) -> None:
    """got within float64 rounding of the reference `want`, which the reference of other
    documents (or another window) is not (the test could tell them apart)."""
    for g, w, o in zip(got, want, other):
        assert max_err(np.asarray(g, np.float64), w) < 1e-12
    assert max(max_err(w, o) for w, o in zip(want, other)) > 1e-2


def test_the_adapters_take_a_window_as_the_call_was_made(torch, jax):
    """A window_size list or NumPy array changed in place between the forward and the backward:
    the backward is that of the forward's window (jax.vjp's mixed the two windows without a
    word; torch's failed on the lse's options)."""
    jnp = jax.numpy
    q, k, v, dout = _inputs(8)
    keep = [(np.arange(40)[None, :] <= np.arange(40)[:, None])
            & (np.arange(40)[None, :] >= np.arange(40)[:, None] - left) for left in (5, 2)]
    want, other = ([attention_ref(q, k, v, keep=m)[0], *attention_backward_ref(dout, q, k, v, keep=m)]
                   for m in keep)
    for window in ([5, 0], np.array([5, 0])):
        leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
        out = burstcu.torch.attention(*leaves, causal=True, window_size=window)
        window[0] = 2
        (out * torch.from_numpy(dout)).sum().backward()
        _assert_documents([out.detach().numpy()] + [x.grad.numpy() for x in leaves], want, other)
        window[0] = 5
        out, vjp = jax.vjp(lambda q, k, v: burstcu.jax.attention(q, k, v, causal=True, window_size=window),
                           *(jnp.asarray(x) for x in (q, k, v)))
        window[0] = 2
        _assert_documents([out, *vjp(jnp.asarray(dout))], want, other)


@pytest.mark.parametrize("container", ["numpy", "tensor"])
def test_torch_backward_takes_cu_seqlens_as_the_forward_was_called(torch, container):
    """A cu_seqlens buffer the caller refills (the next batch's documents, in place) between the
    forward and the backward: the backward is that of the forward's documents (it failed on the
    lse's options, which held the new ones)."""
    q, k, v, dout = _inputs(6)
    docs = np.array(DOCS, np.int32) if container == "numpy" else torch.tensor(DOCS, dtype=torch.int32)
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    out = burstcu.torch.attention(*leaves, causal=True, cu_seqlens=docs)
    docs[:] = np.array(REFILLED) if container == "numpy" else torch.tensor(REFILLED)
    (out * torch.from_numpy(dout)).sum().backward()
    got = [out.detach().numpy()] + [x.grad.numpy() for x in leaves]
    _assert_documents(got, _docs_grads_ref(q, k, v, dout, DOCS), _docs_grads_ref(q, k, v, dout, REFILLED))


@pytest.mark.parametrize("jit", [False, True])
def test_jax_takes_cu_seqlens_as_the_call_was_made(jax, jit):
    """A NumPy cu_seqlens refilled in place after the call: jax.vjp's backward (run later) is
    that of the call's documents (it read the new ones: wrong gradients without a word), and a
    jitted function that closes over the buffer keeps the documents it was traced with, as JAX
    keeps every NumPy constant it closes over (it read the buffer each time the program ran,
    perhaps after JAX's asynchronous dispatch had returned and the caller had refilled it)."""
    jnp = jax.numpy
    q, k, v, dout = _inputs(7)
    docs = np.array(DOCS, np.int64)
    want, other = _docs_grads_ref(q, k, v, dout, DOCS), _docs_grads_ref(q, k, v, dout, REFILLED)

    def attend(q, k, v):
        return burstcu.jax.attention(q, k, v, causal=True, cu_seqlens=docs)
    forward = jax.jit(attend) if jit else attend
    out, vjp = jax.vjp(forward, *(jnp.asarray(x) for x in (q, k, v)))
    docs[:] = REFILLED
    _assert_documents([out, *vjp(jnp.asarray(dout))], want, other)
    if jit:
        _assert_documents([forward(*(jnp.asarray(x) for x in (q, k, v)))], want[:1], other[:1])


def test_torch_takes_jax_arrays_through_dlpack(torch, jax):
    """A JAX array among q, k, v is taken through DLPack: out and the gradients are the bits of
    the call given tensors (autograd saved the JAX array as it was given, on its rank alone)."""
    q, k, v, dout = (x.astype(np.float32) for x in _inputs())
    for fn in ("attention", "linear_attention"):
        want = _torch_out_and_v_grad(torch, fn, q, k, v, dout)
        got = _torch_out_and_v_grad(torch, fn, q, k, v, dout, q_given=jax.numpy.asarray(q))
        assert all(torch.equal(a, b) for a, b in zip(got, want)), fn


def test_torch_autocast_casts_the_inputs_as_sdpa_does(torch):
    """Under torch.autocast (CPU, bfloat16), bfloat16 q beside float32 k, v (a projection's
    output beside tensors no autocast op made; a TypeError on the mixed dtypes before): the
    floating inputs are cast to the region's dtype, as SDPA casts them, so out is the call on
    bfloat16 inputs bit for bit, and each input's gradient comes back in its own dtype, equal
    to the cast's. float64 stays float64 (autocast leaves it alone)."""
    q, k, v, _ = _inputs(5)
    for fn in (burstcu.torch.attention, burstcu.torch.linear_attention):
        mixed = [torch.from_numpy(x).float().requires_grad_() for x in (q, k, v)]
        cast = [t.detach().to(torch.bfloat16).requires_grad_() for t in mixed]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(mixed[0].to(torch.bfloat16), mixed[1], mixed[2], causal=True)
        want = fn(*cast, causal=True)
        assert out.dtype == torch.bfloat16 and torch.equal(out, want), fn
        out.float().sum().backward()
        want.float().sum().backward()
        for got, ref in zip(mixed, cast):
            assert got.grad.dtype == torch.float32 and torch.equal(got.grad, ref.grad.float()), fn
        with torch.autocast("cpu", dtype=torch.bfloat16):
            wide = fn(*(torch.from_numpy(x) for x in (q, k, v)), causal=True)
        assert wide.dtype == torch.float64, fn


def test_torch_float8_is_refused_naming_its_dtype(torch):
    """A float8 tensor (which DLPack cannot carry into NumPy): a TypeError naming its dtype and
    the dtypes burstcu takes, through the plain API and the adapter alike."""
    q = torch.from_numpy(_inputs(3)[0]).to(torch.float8_e4m3fn)
    for fn in (burstcu.attention, burstcu.torch.attention):
        with pytest.raises(TypeError, match=r"dtype float8_e4m3fn .*float16, bfloat16, float32"):
            fn(q, q, q)


@pytest.mark.mpi
@pytest.mark.parametrize("world", WORLDS)
def test_torch_grads_on_sharded_sequences(torch, world):
    for rank_errors in run_mpi(world, "adapter_bodies:torch_attention_grads", timeout=240):
        for case, err in rank_errors.items():
            assert err < 1e-12, (case, err)


# -- JAX ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jax():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":   # group=None would run the CUDA kernels (fp16/bf16 only)
        pytest.skip("these run burstcu.jax on the CPU; tests/gpu/test_frameworks_gpu.py covers a GPU")
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield jax
    jax.config.update("jax_enable_x64", previous)


def _jax_reference_attention(jnp, q, k, v, causal):
    """Plain jnp attention over the whole sequence (GQA by repetition), differentiable by JAX
    itself: an independent check of burstcu.jax's custom_vjp."""
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = jnp.where(np.tril(np.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - s.max(-1, keepdims=True)) /
                      jnp.exp(s - s.max(-1, keepdims=True)).sum(-1, keepdims=True), v)


@pytest.mark.parametrize("jit", [False, True])
def test_jax_grad_equals_jax_differentiating_plain_attention(jax, jit):
    jnp = jax.numpy
    q, k, v, w = (jnp.asarray(x) for x in _inputs(4))

    def loss(attend):
        return lambda q, k, v: (attend(q, k, v) * w).sum()

    ours = jax.grad(loss(lambda q, k, v: burstcu.jax.attention(q, k, v, causal=True)), (0, 1, 2))
    theirs = jax.grad(loss(lambda q, k, v: _jax_reference_attention(jnp, q, k, v, True)), (0, 1, 2))
    got = (jax.jit(ours) if jit else ours)(q, k, v)
    assert all(isinstance(g, jax.Array) for g in got)
    for g, r in zip(got, theirs(q, k, v)):
        assert g.dtype == jnp.float64 and max_err(np.asarray(g), np.asarray(r)) < 1e-12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_jit_grads_in_low_precision_within_the_fa_rule(jax, dtype):
    jnp = jax.numpy
    args = [jnp.asarray(x, getattr(jnp, dtype)) for x in _inputs(5)]

    def loss(q, k, v, dout):
        out = burstcu.jax.attention(q, k, v, causal=True)
        return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum(), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(*args)
    assert out.dtype == getattr(jnp, dtype) and all(g.dtype == out.dtype for g in grads)
    exact = [np.asarray(a.astype(jnp.float64)) for a in args]
    _assert_fa_rule(dtype, exact, [np.asarray(x.astype(jnp.float64)) for x in (out, *grads)])


def test_jax_linear_attention_and_decode_in_one_process(jax):
    jnp = jax.numpy
    q, k, v, dout = _inputs(6)
    grads = jax.jit(jax.grad(lambda q, k, v: (burstcu.jax.linear_attention(q, k, v, causal=True)
                                              * dout).sum(), (0, 1, 2)))(q, k, v)
    _, ref = linear_attention_ref(q, k, v, causal=True, dout=dout)
    assert max(max_err(np.asarray(g), r) for g, r in zip(grads, ref)) < 1e-10
    out, lse = jax.jit(lambda q: burstcu.jax.decode(q, jnp.asarray(k), jnp.asarray(v),
                                                    cache_seqlens=np.array([40, 17]),
                                                    return_lse=True))(jnp.asarray(q[:, :1]))
    assert lse.shape == (2, 4, 1)
    ref0 = attention_ref(q[:1, :1], k[:1], v[:1])[0]
    ref1 = attention_ref(q[1:, :1], k[1:, :17], v[1:, :17])[0]
    assert max_err(np.asarray(out), np.concatenate([ref0, ref1])) < 1e-12


def test_the_adapters_decode_from_a_kv_cache(torch, jax):
    """`burstcu.torch.decode(q, cache)` and `burstcu.jax.decode(q, cache)` (eager and under
    jax.jit) read a KVCache as `burstcu.decode(q, cache)` does, a bfloat16 cache included, whose
    rows a CPU torch tensor of bfloat16 appends (torch's own conversion refuses bfloat16)."""
    import ml_dtypes
    jnp = jax.numpy
    q, k, v, _ = _inputs(8)
    cache = burstcu.KVCache(None, 2, 64, k.shape[2], k.shape[3], np.float64)
    cache.append(k[:, :30], v[:, :30])
    want = burstcu.decode(q[:, :1], cache)
    got_torch = burstcu.torch.decode(torch.from_numpy(q[:, :1]), cache)
    got_eager = burstcu.jax.decode(jnp.asarray(q[:, :1]), cache)
    got_jit = jax.jit(lambda q: burstcu.jax.decode(q, cache))(jnp.asarray(q[:, :1]))
    for got in (got_torch.numpy(), np.asarray(got_eager), np.asarray(got_jit)):
        assert np.array_equal(got, want)
    half = burstcu.KVCache(None, 2, 64, k.shape[2], k.shape[3], ml_dtypes.bfloat16)
    half.append(*(torch.from_numpy(x[:, :30]).to(torch.bfloat16) for x in (k, v)))
    out = burstcu.torch.decode(torch.from_numpy(q[:, :1]).to(torch.bfloat16), half)
    assert out.dtype == torch.bfloat16
    ref = attention_ref(q[:, :1], k[:, :30], v[:, :30])[0]
    assert max_err(out.float().numpy(), ref) < 0.05
    with pytest.raises(TypeError, match="pass no v_cache"):
        burstcu.torch.decode(torch.from_numpy(q[:, :1]), cache, torch.from_numpy(v))
    with pytest.raises(TypeError, match="pass no v_cache"):   # at trace time, under jax.jit too
        jax.jit(lambda q, v: burstcu.jax.decode(q, cache, v))(jnp.asarray(q[:, :1]), jnp.asarray(v))
    with pytest.raises(TypeError, match="needs v_cache"):
        burstcu.jax.decode(jnp.asarray(q[:, :1]), jnp.asarray(k))
    grads_on = torch.from_numpy(k[:, 30:31]).float().requires_grad_()   # a tensor that requires grad
    small = burstcu.KVCache(None, 2, 8, k.shape[2], k.shape[3], np.float32)
    small.append(grads_on, grads_on)
    assert np.array_equal(small.rows()[0][:, :1], k[:, 30:31].astype(np.float32))


def test_torch_decode_of_a_q_that_requires_grad_refuses_a_backward(torch):
    """burstcu.torch.decode has no gradient. Given a q that requires grad (a model's projection
    in a loop without torch.no_grad()) its results used to leave the graph, so a loss through
    them got none of decode's share, silently; now they stay in it, as any op's results (fresh
    tensors, editable in place), and a backward reaching them raises. The values are decode's;
    under no_grad, or given q.detach(), nothing is added."""
    q, k, v, _ = _inputs(9)
    cache = burstcu.KVCache(None, 2, 64, k.shape[2], k.shape[3], np.float64)
    cache.append(k[:, :20], v[:, :20])
    want, want_lse = burstcu.decode(q[:, :1], cache, return_lse=True)
    tq = torch.from_numpy(q[:, :1]).requires_grad_()
    out, lse = burstcu.torch.decode(tq * 1.0, cache, return_lse=True)
    assert out.requires_grad and np.array_equal(out.detach().numpy(), want)
    assert np.array_equal(lse.detach().numpy(), want_lse)
    for result in (out, lse):
        with pytest.raises(RuntimeError, match=r"burstcu.torch.decode has no gradient .*torch.no_grad"):
            (result.sum() + tq.sum()).backward()
    out, lse = burstcu.torch.decode(tq * 1.0, cache, return_lse=True)
    out += 1                 # results are fresh tensors, as any op's: editable in place
    lse[0] = 0
    assert np.array_equal(out.detach().numpy(), want + 1)
    with torch.no_grad():
        assert not burstcu.torch.decode(tq, cache).requires_grad
    detached = burstcu.torch.decode(tq.detach(), cache)
    assert not detached.requires_grad and np.array_equal(detached.numpy(), want)


def test_torch_compile_around_the_plain_api_says_what_to_use(torch):
    """The plain calls (burstcu.attention, KVCache.decode) on tensors inside torch.compile see
    fake tensors; the error said only "cannot take these inputs: TorchRuntimeError"; it names
    the adapters, which run eagerly under torch.compile."""
    q = torch.randn(1, 8, 2, 16)
    cache = burstcu.KVCache(None, 1, 8, 2, 16, torch.float32)
    cache.append(q, q)
    for call in (lambda q: burstcu.attention(q, q, q) + 0, lambda q: cache.decode(q[:, :1]) + 0):
        with pytest.raises(TypeError, match=r"^got torch tensors traced by torch.compile .*: use "
                                            r"burstcu.torch.attention / linear_attention / decode"):
            torch.compile(call)(q)


def test_jax_tracers_in_the_plain_api_say_what_to_use(jax):
    q = jax.numpy.ones((1, 8, 2, 4))
    for transform in (jax.jit, jax.grad):
        with pytest.raises(TypeError, match="burstcu.jax.attention"):
            transform(lambda q: burstcu.attention(q, q, q).sum())(q)
    with pytest.raises(TypeError, match="cu_seqlens must be concrete"):
        jax.jit(lambda q, docs: burstcu.jax.attention(q, q, q, cu_seqlens=docs))(q, jax.numpy.array([0, 8]))
    with pytest.raises(TypeError, match="cu_seqlens must be concrete"):   # one boundary traced
        jax.jit(lambda q, n: burstcu.jax.attention(q, q, q, cu_seqlens=[0, n, 8]))(q, 4)


def test_jax_deleted_and_donated_arrays_are_named(jax):
    """A deleted JAX array (x.delete(), or donated to a jitted program) given to a plain call:
    the call's error, not the end of the process (reading whether a deleted array is ready
    crashes it)."""
    q = jax.numpy.ones((1, 8, 2, 4))
    k = jax.numpy.ones((1, 8, 2, 4))
    k.delete()
    with pytest.raises(TypeError, match="deleted"):
        burstcu.attention(q, k, q)
    donated = jax.numpy.ones((1, 8, 2, 4))
    jax.jit(lambda x: x + 1, donate_argnums=0)(donated)
    with pytest.raises(TypeError, match="deleted"):
        burstcu.attention(q, donated, q)


def test_jax_traced_softmax_scale_is_refused_while_tracing(jax):
    """A softmax_scale computed inside jax.jit (or passed as its argument) is refused while
    tracing, with a way that works there (its call's message asked for float(scale), which a
    tracer refuses); a Python number in the same program runs."""
    q = jax.numpy.ones((1, 8, 2, 4))
    for call in (lambda q: burstcu.jax.attention(q, q, q, softmax_scale=1 / jax.numpy.sqrt(4.0)),
                 lambda q: burstcu.jax.decode(q[:, :1], q, q, softmax_scale=jax.numpy.float32(0.5))):
        with pytest.raises(TypeError, match=r"softmax_scale is traced .* compute it with Python or "
                                            r"NumPy \(headdim \*\* -0.5"):
            jax.jit(call)(q)
    with pytest.raises(TypeError, match="softmax_scale is traced"):
        jax.jit(lambda q, s: burstcu.jax.attention(q, q, q, softmax_scale=s))(q, 0.5)
    ran = jax.jit(lambda q: burstcu.jax.attention(q, q, q, softmax_scale=q.shape[-1] ** -0.5))(q)
    assert np.allclose(np.asarray(ran), 1.0)


def test_jax_traced_mask_options_are_refused_while_tracing(jax):
    """causal or window_size passed as jax.jit arguments (traced) failed only when the program
    ran, as JAX's runtime error around "got JitTracer(...)": refused while tracing, saying to
    mark them static; marked static they run."""
    q = jax.numpy.ones((1, 8, 2, 4))
    for name, call, value in (
            ("window_size", lambda q, w: burstcu.jax.attention(q, q, q, window_size=w), (3, 0)),
            ("window_size", lambda q, w: burstcu.jax.attention(q, q, q, window_size=w),
             jax.numpy.array([3, 0])),
            ("causal", lambda q, c: burstcu.jax.attention(q, q, q, causal=c), True),
            ("causal", lambda q, c: burstcu.jax.linear_attention(q, q, q, causal=c), True)):
        with pytest.raises(TypeError, match=f"{name} is traced .* mark the argument static"):
            jax.jit(call)(q, value)
    ran = jax.jit(lambda q, w: burstcu.jax.attention(q, q, q, window_size=w),
                  static_argnames="w")(q, w=(3, 0))
    assert np.allclose(np.asarray(ran), 1.0)


def test_jax_refuses_forward_mode_and_second_derivatives(jax):
    """jax.jvp, jacfwd, hessian and a grad of a grad through either function raise JAX's own
    error (docs/adapters.md) instead of returning derivatives; one jax.grad still runs."""
    q = jax.numpy.asarray(np.random.default_rng(0).standard_normal((1, 16, 2, 8), dtype=np.float32))
    for fn in (burstcu.jax.attention, burstcu.jax.linear_attention):
        def f(q):
            return fn(q, q, q, causal=True).sum()

        with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
            jax.jvp(f, (q,), (q,))
        with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
            jax.jacfwd(f)(q)
        for second in (jax.hessian(f), jax.grad(lambda q: jax.grad(f)(q).sum())):
            with pytest.raises((TypeError, ValueError),
                               match="can't apply forward-mode autodiff|IO callbacks do not support JVP"):
                second(q)
        assert np.isfinite(np.asarray(jax.grad(f)(q))).all()


def test_jax_vmap_says_to_put_the_batch_in_b(jax):
    """jax.vmap around any of burstcu.jax's functions (alone, over a grad, itself jitted): burstcu's
    ValueError saying to use the B axis (JAX's own read "Cannot `vmap` ordered IO callback"); a
    vmap of a function jitted before it batches the traced program: JAX's own, as the docs say."""
    rng = np.random.default_rng(0)
    q = jax.numpy.asarray(rng.standard_normal((3, 1, 16, 2, 8), dtype=np.float32))
    calls = {"attention": lambda x: burstcu.jax.attention(x, x, x, causal=True),
             "linear": lambda x: burstcu.jax.linear_attention(x, x, x, causal=True),
             "decode": lambda x: burstcu.jax.decode(x[:, :1], x, x),
             "grad": jax.grad(lambda x: burstcu.jax.attention(x, x, x).sum())}
    for name, fn in calls.items():
        for wrapped in (jax.vmap(fn), jax.jit(jax.vmap(fn))):
            with pytest.raises(ValueError, match="does not run under jax.vmap.*B axis"):
                wrapped(q)
        with pytest.raises(ValueError, match="Cannot `vmap` ordered IO callback"):
            jax.vmap(jax.jit(fn))(q)
    assert np.isfinite(np.asarray(calls["attention"](q[0]))).all()


def test_results_handed_to_jax_own_their_memory(jax, monkeypatch):
    """The plain API's results for JAX inputs on the CPU (attention's here; unshard's and the
    backward's go the same way, `arrays.returned`) are jax arrays over memory JAX owns, not over
    the NumPy buffers they were computed in: jax arrays made by `jax.numpy.from_dlpack` of NumPy
    memory made jaxlib's CPU client hang, now and then, as Python exited
    (docs/troubleshooting.md)."""
    from burstcu import arrays

    jnp = jax.numpy
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 16, 2, 8)))
    assert arrays._exporter(q) is arrays.to_jax
    aligned = np.empty(4096 + 64, np.uint8)    # a 64-byte aligned buffer: DLPack would alias it
    host = aligned[-aligned.ctypes.data % 64:][:4096].view(np.float32)
    assert host.ctypes.data % 64 == 0
    assert arrays.to_jax(host).unsafe_buffer_pointer() != host.ctypes.data
    seen = []
    real = arrays.to_jax
    monkeypatch.setattr(arrays, "to_jax", lambda r: seen.append(r) or real(r))
    out, lse = burstcu.attention(q, q, q, return_lse=True)
    assert len(seen) == 2 and all(isinstance(r, np.ndarray) for r in seen)
    for given, handed in zip(seen, (out, lse)):
        assert isinstance(handed, jax.Array) and handed.dtype == given.dtype
        before = np.array(handed)
        given[...] = np.nan                 # the NumPy buffer changes; the jax array does not
        assert np.array_equal(np.array(handed), before)


def test_jax_errors_inside_jit_carry_burstcus_message(jax):
    q = jax.numpy.ones((1, 8, 2, 4))
    k = jax.numpy.ones((1, 8, 3, 4))
    with pytest.raises(Exception, match="multiple of"):
        jax.jit(lambda q, k: burstcu.jax.attention(q, k, k))(q, k)


@pytest.mark.mpi
@pytest.mark.parametrize("world", WORLDS)
def test_jax_jit_grads_on_sharded_sequences(jax, world):
    for rank_errors in run_mpi(world, "adapter_bodies:jax_attention_grads", timeout=300):
        for case, err in rank_errors.items():
            assert err < 1e-12, (case, err)


@pytest.mark.mpi
def test_jax_eager_grads_linear_and_decode_on_three_ranks(jax):
    for rank_errors in run_mpi(3, "adapter_bodies:jax_attention_grads", timeout=300, jit=False):
        assert max(rank_errors.values()) < 1e-12, rank_errors
    for rank_errors in run_mpi(3, "adapter_bodies:jax_linear_and_decode", timeout=300):
        assert rank_errors["linear"] < 1e-10 and rank_errors["decode"] < 1e-12, rank_errors


# -- examples/train_jax.py ----------------------------------------------------------------------

@pytest.mark.mpi
def test_train_jax_example_equals_one_process_jax(jax, tmp_path):
    """examples/train_jax.py under mpiexec -n 2: every rank's loss and gradients equal the
    one-process JAX run (plain attention, no burstcu) at every step, and the loss falls."""
    import os
    import subprocess
    import sys

    from tests.mpi_run import ROOT, mpiexec

    report = tmp_path / "train.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py",
                           str(ROOT / "examples" / "train_jax.py"), "--check", "--steps", "4",
                           "--json", str(report)], capture_output=True, text=True, timeout=240,
                          cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert proc.stdout.count(f"rank {rank}/2 step ") == 4, proc.stdout
    steps = json.loads(report.read_text())["steps"]
    assert len(steps) == 4 and all(s["loss_rel_err"] < 1e-5 and s["grad_rel_err"] < 1e-4 for s in steps)
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"], steps


@pytest.mark.parametrize("flags, said", [(["--steps", "0"], "--steps 0: train at least 1 step"),
                                         (["--steps", "-3"], "--steps -3: train at least 1 step"),
                                         (["--json", "{tmp}/missing/r.json"], "--json {tmp}/missing"),
                                         (["--json", "{tmp}"], "--json {tmp}: not a file"),
                                         (["--json", "{file}/r.json"], "--json {file}/r.json: not"),
                                         (["--json", "{tmp}/new/"], "--json {tmp}/new/: not")])
def test_train_jax_refuses_what_it_cannot_do_before_training(jax, flags, said, tmp_path):
    """`--check --steps 0` trained nothing, printed nothing and exited 0; `--json` into a missing
    folder failed after the training: both usage errors now, before any step."""
    import subprocess
    import sys

    from tests.mpi_run import ROOT

    (tmp_path / "a_file").write_text("")
    paths = {"tmp": tmp_path, "file": tmp_path / "a_file"}   # a file where a folder should be
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_jax.py"), "--check",
                           *(f.format(**paths) for f in flags)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and said.format(**paths) in proc.stderr, proc.stderr
    assert "step" not in proc.stdout, proc.stdout


def test_train_jax_check_sees_a_wrong_attention(jax, monkeypatch):
    """The example's comparison can fail: training with attention that is not causal differs
    from the reference far beyond the tolerance."""
    import sys

    from tests.mpi_run import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import train_jax as ex

    right = ex.train_reference(2, 0.5)
    monkeypatch.setattr(ex, "reference_attention", lambda q, k, v: _jax_reference_attention(
        jax.numpy, q, k, v, causal=False))
    wrong = ex.train_reference(2, 0.5)
    assert max(r["grad_rel_err"] for r in ex.compare(wrong, right)) > 1e-2
    sys.modules.pop("train_jax", None)


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_passing_the_global_array_is_warned_about(world):
    for rank_result in run_mpi(world, "adapter_bodies:every_rank_passes_the_global_array"):
        assert rank_result["sharded"] == []
        if world == 1:
            assert rank_result["whole"] == []
        else:
            assert len(rank_result["whole"]) == 1 and "burstcu.shard" in rank_result["whole"][0]


@pytest.mark.mpi
def test_the_adapters_warn_at_the_callers_line(torch, jax):
    for r in run_mpi(2, "adapter_bodies:adapters_warn_at_the_callers_line", timeout=240):
        for name, line in r["lines"].items():
            assert r["warned"][name] == [["adapter_bodies.py", line]], (name, r)


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_torch_shards_remember_their_cut(world, torch):
    for rank_result in run_mpi(world, "adapter_bodies:torch_shards_remember_their_cut", timeout=240):
        refused = rank_result["refused"]
        assert set(refused) == {"no layout", "packed by heads"}, refused
        assert "layout='zigzag'" in refused["no layout"], refused
        if world == 2:     # (3 ranks cannot split 37 rows' 4 heads evenly: refused for that)
            assert "cut along axis 1" in refused["packed by heads"], refused
        assert rank_result["err"] < 1e-12 and rank_result["grads"]


@pytest.mark.mpi
def test_numpy_shards_remember_their_cut_in_the_adapters(torch, jax):
    for rank_result in run_mpi(2, "adapter_bodies:numpy_shards_remember_their_cut_in_the_adapters",
                               timeout=240):
        refused = rank_result["refused"]
        assert set(refused) == {"torch attention", "jax attention", "torch linear", "jax linear",
                                "torch autocast"}, refused
        for message in refused.values():
            assert message.startswith("q was cut with layout='zigzag' but this call has "
                                      "layout='contiguous'"), message
        assert max(rank_result["errors"].values()) < 1e-12, rank_result["errors"]


@pytest.mark.mpi
def test_jax_bfloat16_arrays_unshard(jax):
    for rank_result in run_mpi(2, "adapter_bodies:jax_bfloat16_unshards", timeout=240):
        assert rank_result == {"type": "jaxlib", "dtype": "bfloat16", "equal": True}, rank_result


@pytest.mark.mpi
def test_jax_results_not_yet_computed_are_waited_for(jax):
    """Plain calls given a jitted program's results while its burstcu call is still to run wait
    for them, then take the group (they ended the job: another thread's call)."""
    for result in run_mpi(2, "adapter_bodies:jax_results_not_yet_computed", timeout=240):
        errors = result["errors"]
        assert set(errors) == {"unshard", "attention", "linear", "decode", "KV cache"}, errors
        assert max(errors.values()) == 0.0, errors
        assert all(result["pending"].values()), result   # the case is the one meant


@pytest.mark.mpi
def test_torch_compile_runs_the_calls_eagerly(torch):
    for rank_result in run_mpi(2, "adapter_bodies:torch_compile_runs_the_calls_eagerly", timeout=300):
        assert rank_result == {"loss": 0.0, "grads": 0.0}, rank_result


@pytest.mark.mpi
def test_torch_activation_checkpointing_recomputes_collectively(torch):
    for rank_result in run_mpi(3, "adapter_bodies:torch_activation_checkpointing", timeout=300):
        assert rank_result.pop("plain forwards") == 1, rank_result
        for mode, got in rank_result.items():
            assert got == {"forwards": 2, "same_loss": True, "same_grads": True}, (mode, got)


def test_buffer_callbacks_are_held_in_program_order(jax):
    """burstcu.jax's GPU path (`_in_program_order`): each buffer_callback sits between an ordered
    ticket and an ordered receipt, so two calls with no data dependence still run in program
    order (run here on the CPU, where buffer_callback works too)."""
    from burstcu.jax import _in_program_order
    jnp = jax.numpy
    log = []

    def make(tag):
        def body(ctx, out, x, ticket):
            log.append(tag)
            np.asarray(out)[...] = np.asarray(x) + 1
        return body

    def both(a, b):
        first = _in_program_order(make("first"), (a,), jax.ShapeDtypeStruct(a.shape, a.dtype))
        second = _in_program_order(make("second"), (b,), jax.ShapeDtypeStruct(b.shape, b.dtype))
        return first, second

    assert str(jax.make_jaxpr(both)(jnp.ones(3), jnp.ones(3))).count("ordered=True") == 4
    first, second = jax.jit(both)(jnp.ones(3), jnp.zeros(3))
    assert log == ["first", "second"]
    assert np.asarray(first).tolist() == [2.0] * 3 and np.asarray(second).tolist() == [1.0] * 3


def test_block_masks_through_torch_and_jax(torch, jax):
    """block_mask passes through both adapters (eager torch autograd, jax.grad under jit): the
    gradients equal the plain API's float64 backward over the same mask."""
    q, k, v, w = _inputs(6, n=24)
    mask = burstcu.BlockMask([[0, 12], [12, 24], [12, 24]], [[0, 12], [0, 6], [12, 24]],
                             ["causal", "full", "bidir_causal"])
    out, lse = burstcu.attention(q, k, v, block_mask=mask, return_lse=True)
    want = burstcu.attention_backward(w, q, k, v, out, lse, block_mask=mask)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    (burstcu.torch.attention(tq, tk, tv, block_mask=mask) * torch.from_numpy(w)).sum().backward()
    for got, ref in zip((tq.grad, tk.grad, tv.grad), want):
        assert max_err(got.numpy(), ref) < 1e-12
    jnp = jax.numpy
    grads = jax.jit(jax.grad(lambda q, k, v: (burstcu.jax.attention(q, k, v, block_mask=mask)
                                              * jnp.asarray(w)).sum(), (0, 1, 2)))(
        *(jnp.asarray(x) for x in (q, k, v)))
    for got, ref in zip(grads, want):
        assert max_err(np.asarray(got), ref) < 1e-12


def test_what_one_rank_passes_wrongly_is_refused_on_every_rank_by_the_adapters(torch, jax):
    """A numpy.ma.MaskedArray (its mask would be dropped: the masked keys were attended to) and a
    sparse tensor (it failed in `.contiguous()` on its rank alone, the peer waiting out the
    timeout) given on rank 1 only: TypeError on both ranks at once, naming it, through
    burstcu.torch's and burstcu.jax's attention and linear_attention and burstcu.jax.decode (JAX
    refused the masked array on its rank alone)."""
    from burstcu.testing.world import run_ranks

    q, k, v, _ = (x[:1, :8].astype(np.float32) for x in _inputs(3))
    mask = np.zeros(k.shape, bool)
    mask[:, 4:] = True   # "keys 4.. are padding"
    masked = np.ma.masked_array(k, mask=mask)
    sparse = torch.from_numpy(k).to_sparse()
    calls = {"torch attention": (burstcu.torch.attention, masked, "MaskedArray"),
             "torch linear_attention": (burstcu.torch.linear_attention, masked, "MaskedArray"),
             "torch attention, sparse": (burstcu.torch.attention, sparse, "layout"),
             "jax decode": (lambda q, k, v, group: burstcu.jax.decode(q[:, :1], k, v, group),
                            masked, "MaskedArray"),
             "jax attention": (burstcu.jax.attention, masked, "MaskedArray"),
             "jax linear_attention": (burstcu.jax.linear_attention, masked, "MaskedArray")}

    def body(group):
        said = {}
        for name, (call, odd, word) in calls.items():
            start = time.perf_counter()
            try:
                call(q, odd if group.rank == 1 else k, v, group)
                said[name] = "ran"
            except TypeError as exc:
                said[name] = (word in str(exc), time.perf_counter() - start)
        return said

    for said in run_ranks(2, body, timeout=60):
        assert all(s != "ran" and s[0] and s[1] < 5 for s in said.values()), said


def test_a_kv_cache_refuses_masked_and_sparse_rows():
    """KVCache.from_prefill and append stored a masked array's masked rows too (decode then
    attended to them); both refuse it now, before anything is stored, and append a sparse
    tensor (it failed inside torch, which ended the job)."""
    cache = burstcu.KVCache(None, 1, 16, 2, 16, np.float32)
    k = np.ones((1, 8, 2, 16), np.float32)
    masked = np.ma.masked_array(k, mask=np.broadcast_to(np.arange(8)[None, :, None, None] >= 4, k.shape))
    with pytest.raises(TypeError, match="k is a numpy.ma.MaskedArray"):
        cache.from_prefill(masked, k)
    cache.from_prefill(k, k)
    with pytest.raises(TypeError, match="v is a numpy.ma.MaskedArray"):
        cache.append(k[:, :1], masked[:, :1])
    torch = pytest.importorskip("torch")
    sparse = torch.from_numpy(k[:, :1]).to_sparse()   # it ended the job: no message agreed
    with pytest.raises(TypeError, match=r"k is a tensor of layout torch.sparse_coo .*to_dense\(\)"):
        cache.append(sparse, k[:, :1])
    assert int(cache.seqlens[0]) == 8


def test_the_advice_for_refused_dtypes_and_tensors_names_what_works():
    """The emulated backend refused int32 with "supported: float16, bfloat16, float32, float64"
    (it refuses the last two); decode given a tensor that requires grad was told to use
    burstcu.torch.attention."""
    from burstcu.testing.world import run_ranks

    def body(group):
        x = np.ones((1, 8, 2, 16), np.int32)
        with pytest.raises(TypeError, match="supports dtypes float16, bfloat16; got int32"):
            burstcu.attention(x, x, x, group)
        return True

    assert run_ranks(1, body, backend="emulated") == [True]
    torch = pytest.importorskip("torch")
    t = torch.ones(1, 8, 2, 16, requires_grad=True)
    with pytest.raises(TypeError, match="burstcu.torch.attention / linear_attention / decode"):
        burstcu.decode(t[:, :1], t, t)
