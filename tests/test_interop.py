"""Arrays of other frameworks go in and come back out in their own framework, through DLPack
(zero-copy on the CPU): a stand-in framework defined here, and PyTorch/JAX when installed."""

import sys
import types

import numpy as np
import pytest

import burstcu
from burstcu.testing.reference import attention_ref


class _Tensor:
    """A minimal framework array: holds a NumPy buffer, speaks only DLPack."""

    def __init__(self, data):
        self._data = np.asarray(data)

    def __dlpack__(self, **kwargs):
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._data.__dlpack_device__()


_Tensor.__module__ = "fakefw"


@pytest.fixture
def fakefw(monkeypatch):
    module = types.ModuleType("fakefw")
    module.Tensor = _Tensor
    module.from_dlpack = lambda x: _Tensor(np.from_dlpack(x))
    monkeypatch.setitem(sys.modules, "fakefw", module)
    return module


def test_foreign_arrays_round_trip(fakefw):
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal(s, dtype=np.float32)
                     for s in ((1, 32, 2, 16), (1, 32, 1, 16), (1, 32, 1, 16), (1, 32, 2, 16)))
    out, lse = burstcu.attention(_Tensor(q), _Tensor(k), _Tensor(v), causal=True, return_lse=True)
    assert isinstance(out, _Tensor) and isinstance(lse, _Tensor)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert np.abs(np.from_dlpack(out) - ref_out).max() < 1e-5
    grads = burstcu.attention_backward(_Tensor(dout), _Tensor(q), _Tensor(k), _Tensor(v), out, lse, causal=True)
    assert all(isinstance(g, _Tensor) for g in grads)
    assert np.from_dlpack(grads[1]).shape == k.shape


def test_non_arrays_still_rejected_clearly():
    with pytest.raises(TypeError, match="must be a numpy.ndarray"):
        burstcu.attention([[1.0]], [[1.0]], [[1.0]])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_real_framework(framework):
    if framework == "torch":
        torch = pytest.importorskip("torch")
        make = lambda a: torch.from_numpy(a)  # noqa: E731
        kind = torch.Tensor
    else:
        jax = pytest.importorskip("jax")
        cpu = jax.devices("cpu")[0]  # the NumPy backend's device, also where a GPU is the default
        make = lambda a: jax.device_put(jax.numpy.asarray(a), cpu)  # noqa: E731
        kind = jax.Array
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 24, 2, 8), dtype=np.float32) for _ in range(3))
    out = burstcu.attention(make(q), make(k), make(v))
    assert isinstance(out, kind)
    assert np.abs(np.asarray(out) - attention_ref(q, k, v)[0]).max() < 1e-5


def test_an_array_class_defined_in_a_helper_package_returns_to_its_framework(monkeypatch):
    """jax.Array's class lives in jaxlib, its array functions in jax.numpy: results must still
    come back as the framework's arrays (here with stand-ins for both packages; host results
    through jax.numpy.array, `arrays.to_jax`)."""
    class Array(_Tensor):
        pass

    Array.__module__ = "jaxlib._jax"
    jax_like = types.ModuleType("jax")
    jax_like.numpy = types.SimpleNamespace(from_dlpack=lambda a: Array(np.from_dlpack(a)),
                                           array=lambda a, copy: Array(np.array(a, copy=copy)))
    monkeypatch.setitem(sys.modules, "jax", jax_like)
    monkeypatch.setitem(sys.modules, "jaxlib", types.ModuleType("jaxlib"))
    q = np.random.default_rng(2).standard_normal((1, 16, 2, 8))
    out = burstcu.attention(Array(q), Array(q), Array(q))
    assert isinstance(out, Array)
    assert np.abs(np.from_dlpack(out) - attention_ref(q, q, q)[0]).max() < 1e-12


def test_results_return_through_the_arrays_namespace(monkeypatch):
    """An array whose class lives in no importable package but which names its array-API
    namespace gets its results back through that namespace's from_dlpack."""
    class Array(_Tensor):
        def __array_namespace__(self, api_version=None):
            return types.SimpleNamespace(from_dlpack=lambda a: Array(np.from_dlpack(a)))

    Array.__module__ = "nowhere._private"
    q = np.random.default_rng(3).standard_normal((1, 16, 2, 8))
    out = burstcu.attention(Array(q), Array(q), Array(q))
    assert isinstance(out, Array)
    assert np.abs(np.from_dlpack(out) - attention_ref(q, q, q)[0]).max() < 1e-12


def test_torch_views_with_a_lazy_negation_are_read_as_their_values():
    """A torch view whose values are its memory negated (z.conj().imag, as complex rotary code
    makes; torch._neg_view, which a contiguous copy keeps): DLPack hands over the memory alone, so
    attention (error 1.2 in out), its backward with such a dout (1.25 in dq), linear attention
    and the torch adapter computed with the values negated. Each now gives what the same values
    without the lazy negation give, and out is the float64 reference's."""
    torch = pytest.importorskip("torch")
    import burstcu.torch as burstcu_torch
    from burstcu.testing.world import run_ranks

    gen = torch.Generator().manual_seed(0)
    z = torch.complex(torch.randn(1, 32, 2, 16, generator=gen), torch.randn(1, 32, 2, 16, generator=gen))
    k, v, dout = (torch.randn(1, 32, 2, 16, generator=gen) for _ in range(3))
    for lazy in (z.conj().imag, torch._neg_view(z.imag.contiguous())):
        assert lazy.is_neg()
        plain = lazy.resolve_neg().clone()
        ref_out, _ = attention_ref(plain.numpy(), k.numpy(), v.numpy(), causal=True)
        for attention in (burstcu.attention, burstcu_torch.attention):
            out = attention(lazy, k, v, causal=True)
            assert torch.equal(out, attention(plain, k, v, causal=True)), attention
            assert np.abs(out.detach().numpy() - ref_out).max() < 1e-5, attention
        out, lse = burstcu.attention(plain, k, v, causal=True, return_lse=True)
        for got, want in zip(burstcu.attention_backward(lazy, plain, k, v, out, lse, causal=True),
                             burstcu.attention_backward(plain, plain, k, v, out, lse, causal=True)):
            assert torch.equal(got, want)
        assert torch.equal(burstcu.linear_attention(lazy, k, v), burstcu.linear_attention(plain, k, v))

    def body(group):   # a shard that is a lazy negation, on two ranks
        sharding = burstcu.Sharding(group)
        q = sharding.shard(plain)
        lazy_q = torch.complex(torch.zeros_like(q), -q).conj().imag
        assert lazy_q.is_neg()
        return [sharding.unshard(burstcu.attention(x, sharding.shard(k), sharding.shard(v), sharding,
                                                   causal=True)) for x in (lazy_q, q)]
    for got, want in run_ranks(2, body):
        assert torch.equal(got, want)
