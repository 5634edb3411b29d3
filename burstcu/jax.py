"""JAX over burstcu: `attention` and `linear_attention` differentiable with `jax.grad`
(`jax.custom_vjp` whose backward calls `burstcu.attention_backward` /
`linear_attention_backward`, so every rank's K and V gradients gather the contributions of
every rank's queries), usable inside `jax.jit`, and `decode` for inference. Install with the
`jax` extra.

Shapes as `burstcu.api` (B batch, S this rank's rows, H query heads, Hkv kv heads, D head dim):
q (B, S, H, D); k, v (B, S, Hkv, D); out (B, S, H, D). Each rank passes its own shard (see
`burstcu.shard`) and calls the function collectively, with the same options; every rank must
run the same program (the same jitted function, in the same order), since each call
exchanges data with the other ranks.

How the arithmetic is reached:
* outside `jax.jit` (eager, `jax.grad` included): the arrays themselves; CPU arrays as NumPy
  views of their buffers (the NumPy backend), GPU arrays zero-copy through DLPack to CuPy.
* inside `jax.jit` on a GPU (JAX's default backend, with a "cupy" group or group=None): a
  `jax.experimental.buffer_callback` marked as having side effects (XLA never drops one): XLA's
  device buffers are viewed zero-copy as CuPy arrays and the kernels and the exchange run on
  XLA's own stream. It is held in program order between two tiny ordered host callbacks
  (`_in_program_order`), so every rank runs its calls in the same order.
* inside `jax.jit` elsewhere: an ordered host callback (`jax.experimental.io_callback(ordered=
  True)`), so calls run in program order on every rank and XLA never drops or reorders one
  (each is a collective); on a CPU the arrays are host memory already.
`jax.vmap` is not supported (ordered callbacks cannot be batched): put the batch in B.
Errors (bad input, ranks that disagree) raise on every rank; inside `jax.jit` they surface as
JAX's runtime error carrying burstcu's message.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

try:  # JAX releases before buffer_callback go through the host under jax.jit on a GPU too
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:
    buffer_callback = None

from . import api, arrays
from .arrays import to_jax
from .group import Group, local_group
from .validate import cut_of, ordered_by, remember_cut

# the calling thread every rank compares for a callback: XLA runs them in program order, on its
# own threads or inline, so the thread that runs one says nothing of its order; a rank calling
# eagerly where another jits the call is refused on every rank, this label naming why
XLA_ORDERED = "burstcu.jax inside jax.jit (every rank must jit the same calls)"

__all__ = ["attention", "linear_attention", "decode"]


def _is_traced(arrays) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in arrays)


def _on_gpu(x) -> bool:
    return arrays.cuda_device(x) is not None


def _eager(fn, arrays, *args, **kwargs):
    """fn on concrete arrays: GPU arrays passed as they are (DLPack to CuPy; results come back
    as jax arrays), CPU arrays as NumPy views; a result is a jax array (a host one copied into
    memory JAX owns: `arrays.to_jax`), a tuple stays a tuple."""
    if any(_on_gpu(x) for x in arrays):
        return fn(*arrays, *args, **kwargs)
    result = fn(*(x if isinstance(x, np.ma.MaskedArray) else np.asarray(x) for x in arrays),
                *args, **kwargs)   # a masked array as it is: the call refuses it on every rank
    return tuple(to_jax(r) for r in result) if isinstance(result, tuple) else to_jax(result)


def _host(fn, group: Group | None, *args, **kwargs):
    """The host callback: the traced arrays arrive as host arrays; on a "cupy" group they go to
    the GPU and the results come back (XLA takes NumPy results)."""
    @ordered_by(XLA_ORDERED)
    def run(*arrays):
        arrays = tuple(np.asarray(x) for x in arrays)
        if group is not None and api.group_of(group).ops.device == "cuda":
            import cupy
            result = fn(*(cupy.asarray(x) for x in arrays), group, *args, **kwargs)
            as_host = cupy.asnumpy
        else:
            result, as_host = fn(*arrays, group, *args, **kwargs), np.asarray
        return tuple(as_host(r) for r in result) if isinstance(result, tuple) else as_host(result)
    return run


def _callback_group(group: Group | None) -> Group | None:
    """The group a host callback computes on: `group`; with None, where JAX computes (its
    default backend a GPU and CuPy usable: the CUDA kernels, else NumPy on the host)."""
    if group is not None or jax.default_backend() != "gpu":
        return group
    try:
        return local_group("cupy")
    except Exception:  # noqa: BLE001 - no CuPy here: the host's NumPy backend computes it
        return None


def _device_buffers(fn, group: Group | None, *args, **kwargs):
    """The body of a `buffer_callback` on a GPU: XLA's input buffers viewed zero-copy as CuPy
    arrays and the work run on their device and XLA's own stream (`ctx.stream`), the results
    copied into XLA's output buffers on that stream (the "cupy" group then takes CuPy arrays
    only: a computation placed on the CPU while a GPU is JAX's default is refused by it, on
    every rank). group None: the buffers' device's group of one."""
    import cupy

    def view(buffer):
        if hasattr(buffer, "__cuda_array_interface__"):
            try:
                return cupy.from_dlpack(buffer)       # keeps bfloat16, which the interface cannot say
            except (TypeError, BufferError, RuntimeError):
                return cupy.asarray(buffer)
        return np.asarray(buffer)

    @ordered_by(XLA_ORDERED)
    def run(ctx, outs, *ins_and_ticket):
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        ins = tuple(view(b) for b in ins_and_ticket[:-1])
        where = next((x.device.id for x in ins if isinstance(x, cupy.ndarray)), None)
        # the buffers' GPU current (a program over several local GPUs calls this once a device;
        # with group=None the call then takes that device's group of one)
        with cupy.cuda.Device(where) if where is not None else contextlib.nullcontext():
            with arrays.external_stream(int(ctx.stream)):
                result = fn(*ins, group, *args, **kwargs)
                for out, value in zip(outs, result if isinstance(result, tuple) else (result,)):
                    view(out)[...] = value
    return run


def _run(fn, arrays, results, group, *args, **kwargs):
    """fn(*arrays, group, *args, **kwargs) eagerly or, under tracing, as a callback whose results
    have the shapes and dtypes `results` (a ShapeDtypeStruct or a tuple of them): where JAX's
    default backend is a GPU and CuPy computes, a `buffer_callback` on XLA's device buffers and
    stream (zero-copy; XLA's GPU runtime issues its ops in program order from one thread);
    elsewhere an ordered host callback."""
    if not _is_traced(arrays):
        return _eager(fn, arrays, group, *args, **kwargs)
    chosen = _callback_group(group)
    if (buffer_callback is not None and chosen is not None and api.group_of(chosen).ops.device == "cuda"
            and jax.default_backend() == "gpu"):
        return _in_program_order(_device_buffers(fn, group, *args, **kwargs), arrays, results)
    return _ordered(io_callback, _host(fn, chosen, *args, **kwargs), results, *arrays)


def _ordered(callback, *args):
    """callback(*args, ordered=True) (io_callback), saying what to do where `jax.vmap` batches it
    (JAX's own ValueError, "Cannot `vmap` ordered IO callback", names the callback, not burstcu)."""
    try:
        return callback(*args, ordered=True)
    except ValueError as exc:
        if "vmap" not in str(exc):
            raise
        raise ValueError("burstcu.jax does not run under jax.vmap (each call is a collective "
                         "over the ranks, an ordered callback JAX cannot batch): put the batch "
                         "in the B axis of q, k, v instead") from exc


def _ticket():
    return np.int32(0)


def _receipt(_first_value) -> None:
    return None


def _in_program_order(body, arrays, results):
    """buffer_callback(body) held in program order among every ordered callback: an ordered
    host callback issues a ticket the call takes as an input, and another takes one element of
    its first result as a receipt. Ordered callbacks run in program order, so call n+1 (after
    its ticket) starts after call n's receipt, hence after call n — on every rank, whatever
    XLA's schedule (buffer_callback alone carries no ordering token). Costs two tiny host
    round trips a call."""
    ticket = _ordered(io_callback, _ticket, jax.ShapeDtypeStruct((), jnp.int32))
    outs = buffer_callback(body, results, has_side_effect=True)(*arrays, ticket)
    first = outs[0] if isinstance(outs, (tuple, list)) else outs
    _ordered(io_callback, _receipt, None, first.reshape(-1)[:1])
    return outs


def _remembering(fn, raw: tuple):
    """fn, whose first arrays are `raw`'s values: NumPy arrays among `raw` that remember their cut
    (`burstcu.shard`'s) lose it on the way in (JAX copies them), so the host arrays fn takes
    are given it back, and a call that takes their rows for other positions is refused on every
    rank, as `burstcu.attention` refuses the arrays themselves. fn as it is when none does
    (under jax.jit or jax.grad the arrays arrive traced: no memory to keep)."""
    cuts = [cut_of(x) if isinstance(x, np.ndarray) else None for x in raw]
    if not any(cuts):
        return fn

    def call(*arrays, **kwargs):
        for x, held in zip(arrays, cuts):
            if held is not None and isinstance(x, np.ndarray):
                remember_cut(x, *held)
        return fn(*arrays, **kwargs)
    return call


def _like(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _lse_struct(q) -> jax.ShapeDtypeStruct:
    """lse (B, H, S), or (H, T) for packed q (T, H, D): float32, float64 for float64 q."""
    shape = (q.shape[1], q.shape[0]) if q.ndim == 3 else (q.shape[0], q.shape[2], q.shape[1])
    return jax.ShapeDtypeStruct(shape, jnp.float64 if q.dtype == jnp.float64 else jnp.float32)


def _static(options: dict) -> dict:
    """`options`, TypeError where cu_seqlens is traced, in whole or in part (it decides the
    masks, so it must be known when tracing; `api.adapter_options` has made a concrete one a
    host copy of its values, which a jitted call keeps, as JAX keeps every NumPy constant a
    traced function closes over)."""
    leaves = jax.tree_util.tree_leaves(options.get("cu_seqlens"))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        raise TypeError("cu_seqlens must be concrete (a NumPy array, a list, or a jax array "
                        "made outside jax.jit): the document boundaries decide which blocks "
                        "are computed and sent")
    return options


def _arrays_only(names: tuple, arrays: tuple) -> None:
    """Raise (at trace time) where a Group or Sharding sits in an array's place: an argument left
    out before it (`api.misplaced_group`); JAX would refuse it as no JAX type."""
    error = api.misplaced_group(names, arrays)
    if error is not None:
        raise error.exception()


def _refuse_masked(fn, arrays: tuple, group, **kwargs) -> None:
    """Where one of `arrays` is a numpy.ma.MaskedArray (JAX refuses it as the call is traced, on
    this rank alone, the peers left to their timeout): fn run eagerly, whose validation refuses
    it on every rank (`_eager`). Under a transformation (another argument traced) JAX's own
    refusal stands."""
    if any(isinstance(x, np.ma.MaskedArray) for x in arrays) and not _is_traced(arrays):
        _eager(fn, arrays, group, **kwargs)
        raise AssertionError("the call took a masked array")   # (its validation raises first)


def _constant_scale(softmax_scale) -> None:
    """TypeError while tracing where `softmax_scale` is traced (computed inside `jax.jit` or
    `jax.grad`, or one of their arguments): the scale is a constant of the call (not
    differentiable), and `float()` of a tracer, which the call's own message asks for, fails
    there."""
    if isinstance(softmax_scale, jax.core.Tracer):
        raise TypeError("softmax_scale is traced (computed inside a JAX transformation such as "
                        "jax.jit or jax.grad, or passed to it as an argument): the scale is a "
                        "constant of the call, not differentiable; compute it with Python or NumPy "
                        "(headdim ** -0.5, from q.shape), or under jax.jit mark the argument static "
                        "(static_argnames=...)")


def _constant_options(options: dict) -> None:
    """TypeError while tracing where an option that decides the mask or the exchange (causal,
    window_size, uneven, ...) is traced, in whole or in part: it must be known when the call is
    traced (as cu_seqlens), and the call's own check would fail only when the program runs,
    wrapped in JAX's runtime error."""
    for name, value in options.items():
        parts = value if isinstance(value, (tuple, list)) else (value,)
        if name != "cu_seqlens" and any(isinstance(x, jax.core.Tracer) for x in parts):
            raise TypeError(f"{name} is traced (computed inside a JAX transformation such as "
                            f"jax.jit, or passed to it as an argument): it decides the mask and what "
                            f"the ranks send, so it must be known when the call is traced; under "
                            f"jax.jit mark the argument static (static_argnames=...)")


def attention(q, k, v, group: Group | None = None, *, causal: bool = False,
              softmax_scale: float | None = None, layout: str | None = None,
              strategy: str = "burst", **mask_kwargs):
    """`burstcu.attention` for jax arrays, differentiable and jit-able: out (B, S, H, D) in q's
    dtype.

    q: (B, S, H, D); k, v: (B, S, Hkv, D), this rank's shard. mask_kwargs: window_size,
    cu_seqlens (concrete; its values as the call is made), block_mask, uneven, ulysses_degree,
    bidirectional (as `burstcu.attention`) and check (verify lse in the backward). The backward
    (`jax.grad`) is collective too.
    """
    _arrays_only(("q", "k", "v"), (q, k, v))
    _constant_scale(softmax_scale)
    _constant_options({"causal": causal, **mask_kwargs})
    fwd_options, bwd_options = (_static(o) for o in api.adapter_options(mask_kwargs))
    common = dict(causal=causal, softmax_scale=softmax_scale, layout=layout, strategy=strategy)
    attend_forward = _remembering(api.attention, (q, k, v))
    _refuse_masked(attend_forward, (q, k, v), group, return_lse=True, **common, **fwd_options)

    def forward(q, k, v):
        return _run(attend_forward, (q, k, v), (_like(q), _lse_struct(q)), group,
                    return_lse=True, **common, **fwd_options)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_bwd(saved, dout):
        q, k, v, out, lse = saved
        return _run(api.attention_backward, (dout.astype(q.dtype), q, k, v, out, lse),
                    (_like(q), _like(k), _like(v)), group, **common, **bwd_options)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v)


def linear_attention(q, k, v, group: Group | None = None, *, causal: bool = False,
                     layout: str | None = None, strategy: str = "lasp2"):
    """`burstcu.linear_attention` for jax arrays, differentiable and jit-able: out (B, S, H, D)."""
    _arrays_only(("q", "k", "v"), (q, k, v))
    _constant_options({"causal": causal})
    options = dict(causal=causal, layout=layout, strategy=strategy)
    attend_forward = _remembering(api.linear_attention, (q, k, v))
    _refuse_masked(attend_forward, (q, k, v), group, **options)

    @jax.custom_vjp
    def attend(q, k, v):
        return _run(attend_forward, (q, k, v), _like(q), group, **options)

    def attend_fwd(q, k, v):
        return attend(q, k, v), (q, k, v)

    def attend_bwd(saved, dout):
        q, k, v = saved
        return _run(api.linear_attention_backward, (dout.astype(q.dtype), q, k, v),
                    (_like(q), _like(k), _like(v)), group, **options)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v)


def decode(q, k_cache, v_cache=None, group: Group | None = None, *, cache_seqlens=None,
           softmax_scale: float | None = None, return_lse: bool = False):
    """`burstcu.decode` for jax arrays (inference; jit-able, not differentiable): q (B, T, H, D)
    the same on every rank, k_cache, v_cache (B, S_cache, Hkv, D) this rank's rows,
    cache_seqlens (B,) ints (concrete, or traced: it travels into the callback then); or
    `decode(q, cache)` with a `burstcu.KVCache` (its arrays, group and row counts, read when the
    call runs). Returns out (B, T, H, D) (and lse (B, H, T) with return_lse), the same on every
    rank."""
    _constant_scale(softmax_scale)
    b, t, h, _ = q.shape
    lse = jax.ShapeDtypeStruct((b, h, t), jnp.float64 if q.dtype == jnp.float64 else jnp.float32)
    results = (_like(q), lse) if return_lse else _like(q)
    if callable(getattr(k_cache, "decode_arguments", None)):   # a KVCache: q alone is an array
        mine = api.group_of(group) in (None, k_cache.group)
        if v_cache is not None or cache_seqlens is not None or not mine:
            raise TypeError("decode(q, cache) takes the cache's own arrays, group and row counts: "
                            "pass no v_cache, group or cache_seqlens with a KVCache")   # (at trace time)

        def from_cache(q, _group):
            return api.decode(q, k_cache, v_cache, group, cache_seqlens=cache_seqlens,
                              softmax_scale=softmax_scale, return_lse=return_lse)
        return _run(from_cache, (q,), results, k_cache.group)
    if v_cache is None:
        raise TypeError("decode(q, k_cache, v_cache, ...) needs v_cache (or pass a KVCache)")
    _arrays_only(("q", "k_cache", "v_cache"), (q, k_cache, v_cache))
    lengths = () if cache_seqlens is None else (cache_seqlens,)
    arrays = (q, k_cache, v_cache)
    arrays += tuple(jnp.asarray(n) for n in lengths) if _is_traced(arrays + lengths) else lengths

    def call(q, k_cache, v_cache, *lengths_and_group):
        *lengths, group = lengths_and_group
        return api.decode(q, k_cache, v_cache, group,
                              cache_seqlens=lengths[0] if lengths else None,
                              softmax_scale=softmax_scale, return_lse=return_lse)

    return _run(call, arrays, results, group)
