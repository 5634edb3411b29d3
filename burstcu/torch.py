"""PyTorch autograd over burstcu: `attention` and `linear_attention` as `torch.autograd.Function`s
(their backward calls `burstcu.attention_backward` / `linear_attention_backward`, so the
gradients of every rank's K and V gather the contributions of every rank's queries), and
`decode` for inference. Install with the `torch` extra.

Shapes as `burstcu.api` (B batch, S this rank's rows, H query heads, Hkv kv heads, D head dim):
q (B, S, H, D); k, v (B, S, Hkv, D); out (B, S, H, D). Each rank passes its own shard (see
`burstcu.shard`) and calls the function collectively, with the same options, like
`burstcu.attention`.

Where the arithmetic runs: CPU tensors on the NumPy backend, viewed zero-copy (bfloat16
through an int16 view, since NumPy cannot import it over DLPack); CUDA tensors on the CUDA
kernels through CuPy, zero-copy over DLPack, with the kernels and the exchange ordered on
torch's current stream (CuPy runs on it as an external stream: nothing synchronises the host).
The group decides the backend for multi-rank jobs (`burstcu.init(backend=...)`); with
group=None the tensors' device does.

Only out is differentiable: `burstcu.attention(..., return_lse=True)` gives lse without autograd.
The backward recomputes probabilities from the saved out and lse (FlashAttention's way): it
keeps q, k, v, out and lse, nothing of size S x S.
"""

from __future__ import annotations


import numpy as np
import torch

from . import api, arrays
from .cpu_tensors import host_view, resolved, tensor_of
from .group import Group
from .validate import carry_cache_rows, carry_cut

__all__ = ["attention", "linear_attention", "decode"]

def _to_burstcu(t: torch.Tensor):
    """t as burstcu takes it: a CUDA tensor as itself (DLPack to CuPy), a CPU tensor as a NumPy
    view (bfloat16 through int16, viewed back as ml_dtypes.bfloat16). Detached, contiguous, its
    lazy negation or conjugation applied (`cpu_tensors.resolved`).
    A tensor NumPy cannot view (float8, ...) is passed as it is: the call's validation refuses
    it on every rank, where raising here would leave the other ranks waiting."""
    if not isinstance(t, torch.Tensor):
        return t  # validation names what it is
    try:
        t = resolved(t, detach=True).contiguous()
    except RuntimeError:   # a sparse or otherwise non-strided tensor: validation names it
        return t
    if t.is_cuda:
        return t
    try:
        return host_view(t)
    except (TypeError, RuntimeError):
        return t


def _as_tensors(*xs) -> tuple:
    """xs with each array that is no tensor as a tensor: a NumPy array as a CPU tensor copy of its
    values (`tensor_of`; another byte order made native), which later writes to the array
    cannot change, and which keeps what the array remembers of its cut (`burstcu.shard`'s
    arrays: a call that takes their rows for other positions is refused, as `burstcu.attention`
    refuses the array); another framework's array (JAX, CuPy) through DLPack, zero-copy. Autograd
    saves tensors only, so an array given on one rank would fail there alone once the
    collective forward had run. An array of a dtype torch cannot hold (burstcu refuses it too),
    a masked array and anything else stay as they are: validation names them on every rank."""
    out = []
    for x in xs:
        try:
            if isinstance(x, np.ma.MaskedArray):
                pass   # its mask would be dropped: validation refuses it
            elif isinstance(x, np.ndarray):
                array, x = x, tensor_of(x.astype(x.dtype.newbyteorder("="), copy=True))
                carry_cut(array, x)
            elif not isinstance(x, torch.Tensor) and hasattr(x, "__dlpack__"):
                x = torch.from_dlpack(x)
        except (TypeError, ValueError, RuntimeError, BufferError):
            pass
        out.append(x)
    return tuple(out)


def _to_torch(x) -> torch.Tensor:
    """A burstcu result as a tensor: NumPy arrays zero-copy (bfloat16 through int16), tensors
    (CUDA results already handed back over DLPack) as they are."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return tensor_of(x)
    return torch.from_dlpack(x)


def _eager(fn):
    """fn run eagerly under torch.compile: Dynamo would trace into the ring (NumPy, MPI or gloo
    messages) and fail; this way the compiled program breaks its graph at the call (and a
    compiled backward at the ring backward). torch.compiler.disable, torch._dynamo's before
    torch 2.1."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if not callable(disable):
        from torch import _dynamo
        disable = _dynamo.disable
    return disable(fn)


@_eager
def _call(fn, tensors, *args, **kwargs):
    """fn(*tensors as burstcu takes them, *args, **kwargs) on torch's stream, results as tensors
    (a tuple stays a tuple). What a CPU tensor remembers of its cut (`burstcu.shard` of a tensor,
    or a result) goes with its NumPy view into the call, and back with the results: a call that
    takes its rows for other positions is refused as it is for NumPy arrays; so does being rows of
    a KVCache's array (decode refuses unfilled ones), where the way in copies them."""
    taken = tuple(_to_burstcu(t) for t in tensors)
    for t, x in zip(tensors, taken):
        carry_cut(t, x)
        carry_cache_rows(t, x)
    with arrays.torch_stream(tensors):
        result = fn(*taken, *args, **kwargs)
    results = result if isinstance(result, tuple) else (result,)
    back = tuple(_to_torch(r) for r in results)
    for r, t in zip(results, back):
        carry_cut(r, t)
    return back if isinstance(result, tuple) else back[0]


def _first_order_only(what: str) -> None:
    """The backwards compute on arrays autograd does not see, so their gradients carry no graph:
    asked for one (create_graph=True: grad mode is on in the backward), RuntimeError rather
    than gradients that would silently differentiate as constants."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"burstcu.torch.{what} has no double backward: its gradients are not "
                           f"differentiable, so create_graph=True (a gradient penalty, Hessian "
                           f"products) cannot be honoured")


def _no_transforms(what: str) -> None:
    """RuntimeError under a torch.func transform (grad, vmap, jvp, ...): the work runs outside
    torch, where the transforms cannot follow (torch's own message asks the Function for a
    setup_context, which reads as burstcu's bug). The same on every rank that runs the same
    program, before anything is sent."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if callable(active) and active():
        raise RuntimeError(f"burstcu.torch.{what} does not run under torch.func transforms (grad, "
                           f"vmap, jvp, jacrev, ...): its work runs outside torch, where they cannot "
                           f"follow it. Use torch.autograd (loss.backward(), torch.autograd.grad) "
                           f"and put a batch in the B axis instead of vmap")


class _Attention(torch.autograd.Function):
    """out = softmax(q k^T * scale [masked]) v over every rank's keys; backward: the ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, group, forward_kwargs, backward_kwargs):
        out, lse = _call(api.attention, (q, k, v), group, return_lse=True, **forward_kwargs)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.backward_kwargs = group, backward_kwargs
        return out

    @staticmethod
    def backward(ctx, dout):
        _first_order_only("attention")
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _call(api.attention_backward, (dout, q, k, v, out, lse), ctx.group,
                           **ctx.backward_kwargs)
        return dq, dk, dv, None, None, None


def _autocast(*tensors) -> tuple:
    """The tensors as an op of torch's lower-precision list takes them under `torch.autocast`
    (SDPA's rule): floating tensors cast to the region's dtype for their device type, where
    autocast is on for it; otherwise as they are. The casts are recorded, so gradients come back
    in each input's own dtype. A cast keeps what its tensor remembers of its cut."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None:
        return tensors
    device = first.device.type
    try:
        on, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    except (TypeError, AttributeError):   # torch before 2.4: one query per device type
        old = {"cpu": ("is_autocast_cpu_enabled", "get_autocast_cpu_dtype"),
               "cuda": ("is_autocast_enabled", "get_autocast_gpu_dtype")}.get(device)
        if old is None:
            return tensors
        on, dtype = getattr(torch, old[0])(), getattr(torch, old[1])()
    except RuntimeError:   # a device type autocast does not know
        return tensors
    if not on:
        return tensors
    cast = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and
                 t.dtype != torch.float64 else t for t in tensors)
    for t, c in zip(tensors, cast):
        carry_cut(t, c)   # the same rows in another dtype: still cut as they were
    return cast


@_eager
def attention(q, k, v, group: Group | None = None, *, causal: bool = False,
              softmax_scale: float | None = None, layout: str | None = None,
              strategy: str = "burst", **mask_kwargs) -> torch.Tensor:
    """`burstcu.attention` for tensors, differentiable: out (B, S, H, D), q's dtype and device.

    q: (B, S, H, D); k, v: (B, S, Hkv, D), this rank's shard (tensors; a NumPy array is taken as
    a CPU tensor copy of its values, another framework's array through DLPack). mask_kwargs:
    window_size, cu_seqlens (its values as the call is made: the backward takes those too),
    block_mask, uneven, ulysses_degree, bidirectional (as `burstcu.attention`) and check (verify
    lse in the backward). Every rank must call it, and later run its backward, collectively.
    Under `torch.autocast` q, k and v are cast to the region's dtype first, as for SDPA.
    """
    _no_transforms("attention")
    fwd, bwd = api.adapter_options(mask_kwargs)
    common = dict(causal=causal, softmax_scale=softmax_scale, layout=layout, strategy=strategy)
    return _Attention.apply(*_autocast(*_as_tensors(q, k, v)), group, {**common, **fwd},
                            {**common, **bwd})


class _LinearAttention(torch.autograd.Function):
    """LASP linear attention; backward: `linear_attention_backward` (nothing saved but q, k, v)."""

    @staticmethod
    def forward(ctx, q, k, v, group, kwargs):
        ctx.save_for_backward(q, k, v)
        ctx.group, ctx.kwargs = group, kwargs
        return _call(api.linear_attention, (q, k, v), group, **kwargs)

    @staticmethod
    def backward(ctx, dout):
        _first_order_only("linear_attention")
        q, k, v = ctx.saved_tensors
        dq, dk, dv = _call(api.linear_attention_backward, (dout, q, k, v), ctx.group, **ctx.kwargs)
        return dq, dk, dv, None, None


@_eager
def linear_attention(q, k, v, group: Group | None = None, *, causal: bool = False,
                     layout: str | None = None, strategy: str = "lasp2") -> torch.Tensor:
    """`burstcu.linear_attention` for tensors, differentiable: out (B, S, H, D). Under
    `torch.autocast` q, k and v are cast to the region's dtype first."""
    _no_transforms("linear_attention")
    return _LinearAttention.apply(*_autocast(*_as_tensors(q, k, v)), group,
                                  dict(causal=causal, layout=layout, strategy=strategy))


class _Decode(torch.autograd.Function):
    """decode, where an input requires grad: results in the graph like any op's (fresh tensors,
    editable in place), whose backward raises. decode has no gradient; detached results would
    leave decode's share out of the inputs' gradients without a word."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, group, kwargs):
        return _call(api.decode, (q, k_cache, v_cache), group, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("burstcu.torch.decode has no gradient (inference only), but a backward "
                           "reached its output: call it under torch.no_grad(), or give it "
                           "q.detach() if no gradient should flow through it")


@_eager
def decode(q, k_cache, v_cache=None, group: Group | None = None, *, cache_seqlens=None,
           softmax_scale: float | None = None, return_lse: bool = False):
    """`burstcu.decode` for tensors (inference: no autograd): q (B, T, H, D) the same on every
    rank, k_cache, v_cache (B, S_cache, Hkv, D) this rank's rows, cache_seqlens (B,) ints; or
    `decode(q, cache)` with a `burstcu.KVCache` (its arrays, group and row counts).
    Returns out (B, T, H, D) (and lse (B, H, T) with return_lse), the same on every rank. Where
    an input requires grad (and grad mode is on), the results do too, as any op's, and a
    backward through them raises RuntimeError instead of leaving decode out of the gradients."""
    _no_transforms("decode")
    kwargs = dict(cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, return_lse=return_lse)
    wanting = any(isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k_cache, v_cache))
    if wanting and torch.is_grad_enabled():
        return _Decode.apply(q, k_cache, v_cache, group, kwargs)
    return _call(api.decode, (q, k_cache, v_cache), group, **kwargs)   # (a KVCache or None: as is)
