"""MPI bodies of tests/test_adapters.py (any world size): burstcu.jax and burstcu.torch on
sharded sequences, gradients against float64 references over the whole sequence."""

from __future__ import annotations

import numpy as np

import burstcu
from burstcu.testing.reference import (attention_backward_ref, attention_ref, document_mask,
                                       linear_attention_ref, max_err)

N, H, HKV, D = 37, 4, 2, 8          # a global length no world size divides
DOCS = [0, 9, 10, 30, 37]


def _cases():
    """(layout, causal, window, cu_seqlens) covering masks and both layouts."""
    return [("contiguous", False, (-1, -1), None), ("zigzag", True, (-1, -1), None),
            ("contiguous", True, (6, 0), None), ("zigzag", True, (-1, -1), DOCS)]


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((2, N, H, D)) for _ in range(2))
    k, v = (rng.standard_normal((2, N, HKV, D)) for _ in range(2))
    return q, k, v, dout


def _keep(causal: bool, window, docs) -> np.ndarray:
    """(N, N) bool: query i sees key j (written here from the definitions, not from burstcu)."""
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    keep = document_mask(N, causal, None if docs is None else tuple(docs))
    left, right = window
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def jax_attention_grads(jit: bool = True):
    """jax.grad (under jax.jit when `jit`) of sum(out * dout) through burstcu.jax.attention on
    every rank's shard (shard and unshard given jax arrays): out and the gathered dq, dk, dv
    equal float64 attention over the whole sequence, on every rank."""
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    group = burstcu.init(backend="numpy")
    errors = {}
    for layout, causal, window, docs in _cases():
        q, k, v, dout = (jnp.asarray(x) for x in _inputs(3))
        local = [burstcu.shard(x, group, layout, cu_seqlens=docs) for x in (q, k, v, dout)]
        assert all(isinstance(x, jax.Array) for x in local), "shard must keep jax arrays"

        def loss(q, k, v, dout):
            out = burstcu.jax.attention(q, k, v, group, causal=causal, layout=layout,
                                        window_size=window, cu_seqlens=docs)
            return (out * dout).sum(), out

        step = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
        (_, out), grads = (jax.jit(step) if jit else step)(*local)
        got = [burstcu.unshard(x, group, layout, cu_seqlens=docs) for x in (out, *grads)]
        assert all(isinstance(x, jax.Array) for x in got), "unshard must keep jax arrays"
        keep = _keep(causal, window, docs)
        ref = [attention_ref(*_inputs(3)[:3], keep=keep)[0],
               *attention_backward_ref(_inputs(3)[3], *_inputs(3)[:3], keep=keep)]
        errors[f"{layout} causal={causal} window={window} docs={docs is not None}"] = \
            max(max_err(np.asarray(g), r) for g, r in zip(got, ref))
    group.close()
    return errors


def jax_linear_and_decode():
    """burstcu.jax.linear_attention's jitted gradients and burstcu.jax.decode under jax.jit, on
    every rank, against float64 references over the whole sequence / cache."""
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    group = burstcu.init(backend="numpy")
    n = 12 * (N // 12)                  # linear attention takes equal shards only
    q, k, v, dout = (x[:, :n] for x in _inputs(4))
    local = [burstcu.shard(jnp.asarray(x), group) for x in (q, k, v, dout)]
    grads = jax.jit(jax.grad(lambda q, k, v, do: (burstcu.jax.linear_attention(
        q, k, v, group, causal=True) * do).sum(), argnums=(0, 1, 2)))(*local)
    got = [burstcu.unshard(g, group) for g in grads]
    _, ref = linear_attention_ref(q, k, v, causal=True, dout=dout)
    linear_err = max(max_err(np.asarray(g), r) for g, r in zip(got, ref))
    # decode: the new token's query (the same everywhere) against each rank's cache rows
    q_new = q[:, :1]
    out = jax.jit(lambda qn, kc, vc: burstcu.jax.decode(qn, kc, vc, group))(
        jnp.asarray(q_new), *local[1:3])
    decode_err = max_err(np.asarray(out), attention_ref(q_new, k, v)[0])
    group.close()
    return {"linear": linear_err, "decode": decode_err}


def torch_attention_grads():
    """torch autograd of sum(out * dout) through burstcu.torch.attention on every rank's shard
    (shard/unshard given tensors): out and the gathered grads equal float64 attention over the
    whole sequence; bfloat16 tensors go through and come back bfloat16."""
    import torch

    group = burstcu.init(backend="numpy")
    errors = {}
    for layout, causal, window, docs in _cases():
        q, k, v, dout = (torch.from_numpy(x) for x in _inputs(5))
        local = [burstcu.shard(x, group, layout, cu_seqlens=docs) for x in (q, k, v, dout)]
        assert all(isinstance(x, torch.Tensor) for x in local), "shard must keep tensors"
        qkv = [x.clone().requires_grad_() for x in local[:3]]
        out = burstcu.torch.attention(*qkv, group, causal=causal, layout=layout,
                                      window_size=window, cu_seqlens=docs)
        (out * local[3]).sum().backward()
        got = [burstcu.unshard(x.detach(), group, layout, cu_seqlens=docs)
               for x in (out, *(t.grad for t in qkv))]
        assert all(isinstance(x, torch.Tensor) for x in got), "unshard must keep tensors"
        keep = _keep(causal, window, docs)
        ref = [attention_ref(*_inputs(5)[:3], keep=keep)[0],
               *attention_backward_ref(_inputs(5)[3], *_inputs(5)[:3], keep=keep)]
        errors[f"{layout} causal={causal} window={window} docs={docs is not None}"] = \
            max(max_err(g.numpy(), r) for g, r in zip(got, ref))
    half = [burstcu.shard(torch.from_numpy(x).to(torch.bfloat16), group) for x in _inputs(5)[:3]]
    half = [x.requires_grad_() for x in half]
    burstcu.torch.attention(*half, group, causal=True).float().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 for t in half)
    # bfloat16 cannot cross DLPack into NumPy: unshard views it as on one rank, or as its bits
    whole = burstcu.unshard(half[0].detach(), group)
    bits = burstcu.unshard(half[0].detach().view(torch.int16), group).view(torch.bfloat16)
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, bits)
    assert torch.equal(bits.float(), burstcu.unshard(half[0].detach().float(), group))
    # a tensor NumPy cannot view (float8), on the last rank only: the same TypeError on every
    # rank, from the adapter as from the plain API, and the group goes on
    x = half[0].detach().float()
    odd = x.to(torch.float8_e4m3fn) if group.rank == group.size - 1 else x
    for call in (burstcu.torch.attention, burstcu.torch.linear_attention, burstcu.attention):
        try:
            call(odd, x, x, group)
        except TypeError as exc:
            assert "cannot take arrays of dtype float8_e4m3fn" in str(exc), exc
        else:
            raise AssertionError(f"{call.__module__}.{call.__name__} took a float8 q")
    assert burstcu.torch.attention(x, x, x, group).shape == x.shape
    group.close()
    return errors


def every_rank_passes_the_global_array():
    """Every rank gives attention the whole sequence (equal lengths, nothing to refuse): a
    RuntimeWarning with the shard hint on every rank; its own shard: no warning."""
    import warnings

    group = burstcu.init(backend="numpy")
    q, k, v, _ = _inputs(6)
    with warnings.catch_warnings(record=True) as whole:
        warnings.simplefilter("always")
        burstcu.attention(q, k, v, group)
    with warnings.catch_warnings(record=True) as sharded:
        warnings.simplefilter("always")
        burstcu.attention(*(burstcu.shard(x, group) for x in (q, k, v)), group)
    group.close()
    return {"whole": [str(w.message) for w in whole if issubclass(w.category, RuntimeWarning)],
            "sharded": [str(w.message) for w in sharded if issubclass(w.category, RuntimeWarning)]}


def adapters_warn_at_the_callers_line():
    """The same global array on every rank through burstcu.torch (attention, linear_attention)
    and burstcu.jax (eager, and a jitted function, whose check runs when it runs): the
    SameShardsWarning names this file and the line of the adapter's call (the jitted function's
    call), not a frame of torch's, JAX's or contextlib's wrappers between it and burstcu."""
    import inspect
    import os
    import warnings

    import jax
    import jax.numpy as jnp
    import torch

    group = burstcu.init(backend="numpy")
    q = _inputs(7)[0][:1].astype(np.float32)
    calls = (("torch", lambda x: burstcu.torch.attention(x, x, x, group), torch.from_numpy(q)),
             ("torch.linear", lambda x: burstcu.torch.linear_attention(x, x, x, group),
              torch.from_numpy(q)),
             ("jax", lambda x: burstcu.jax.attention(x, x, x, group), jnp.asarray(q)),
             ("jax.jit", jax.jit(lambda x: burstcu.jax.attention(x, x, x, group)), jnp.asarray(q)))
    warned, lines = {}, {}
    for name, call, x in calls:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            here = inspect.currentframe().f_lineno + 1
            call(x)
        lines[name] = here if name == "jax.jit" else inspect.getsourcelines(call)[1]
        warned[name] = [(os.path.basename(w.filename), w.lineno) for w in caught
                        if issubclass(w.category, burstcu.SameShardsWarning)]
    group.close()
    return {"warned": warned, "lines": lines}


def torch_shards_remember_their_cut():
    """Tensors `burstcu.shard` cut remember it as NumPy shards do: zigzag shards passed to a
    causal burstcu.torch.attention without layout="zigzag", and packed (T, H, D) tensors cut by
    shard's default axis=1 (their heads), are refused on every rank (they ran, silently wrong);
    with the layout they run, forward and backward."""
    import torch

    group = burstcu.init(backend="numpy")
    q, k, v, _ = (torch.from_numpy(x) for x in _inputs(8))
    zig = [burstcu.shard(x, group, layout="zigzag") for x in (q, k, v)]
    refused = {}
    for case, call in (("no layout", lambda: burstcu.torch.attention(*zig, group, causal=True)),
                       ("packed by heads", lambda: burstcu.torch.attention(
                           *(burstcu.shard(x[0], group) for x in (q, k, v)), group, causal=True))):
        try:
            call()
        except ValueError as exc:
            refused[case] = str(exc)
    out = burstcu.torch.attention(*(x.requires_grad_() for x in zig), group, causal=True,
                                  layout="zigzag")
    out.sum().backward()
    whole = burstcu.unshard(out.detach(), group, layout="zigzag")
    keep = _keep(True, (-1, -1), None)
    ref = attention_ref(*(x.detach().numpy() for x in (q, k, v)), keep=keep)[0]
    group.close()
    return {"refused": refused, "err": max_err(whole.numpy(), ref),
            "grads": all(x.grad is not None for x in zig)}


def numpy_shards_remember_their_cut_in_the_adapters():
    """NumPy shards `burstcu.shard` cut with layout="zigzag", passed to burstcu.torch's and
    burstcu.jax's (eager) attention and linear_attention without the layout, and to torch's
    under autocast: each adapter copies them (a tensor, a jax array, a cast), and the copies keep
    the memory, so every call is refused on
    every rank as burstcu.attention refuses the arrays (they ran, silently wrong). With the
    layout, torch's and jax's outs equal the float64 reference."""
    import jax
    import torch

    jax.config.update("jax_enable_x64", True)
    group = burstcu.init(backend="numpy")
    q, k, v, _ = _inputs(12)
    zig = [burstcu.shard(x, group, layout="zigzag") for x in (q, k, v)]

    tensors = [burstcu.shard(torch.from_numpy(x.astype(np.float32)), group, layout="zigzag")
               for x in (q, k, v)]

    def under_autocast(*args, **kwargs):   # its casts are new tensors: they keep the memory too
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return burstcu.torch.attention(*tensors, *args[3:], **kwargs)

    calls = {"torch attention": burstcu.torch.attention, "jax attention": burstcu.jax.attention,
             "torch linear": burstcu.torch.linear_attention, "jax linear": burstcu.jax.linear_attention,
             "torch autocast": under_autocast}
    refused = {}
    for name, call in calls.items():
        try:
            call(*zig, group, causal=True)
        except ValueError as exc:
            refused[name] = str(exc)
    ref = attention_ref(q, k, v, keep=_keep(True, (-1, -1), None))[0]
    outs = {"torch": burstcu.torch.attention(*zig, group, causal=True, layout="zigzag").numpy(),
            "jax": np.asarray(burstcu.jax.attention(*zig, group, causal=True, layout="zigzag"))}
    errors = {name: max_err(burstcu.unshard(out, group, layout="zigzag"), ref)
              for name, out in outs.items()}
    group.close()
    return {"refused": refused, "errors": errors}


def jax_bfloat16_unshards():
    """unshard of CPU JAX arrays of bfloat16 (burstcu.jax's outputs in bfloat16), which DLPack
    cannot carry into NumPy: it was refused; now it joins them as it joins the same NumPy arrays
    of ml_dtypes.bfloat16, and hands back a JAX array of bfloat16."""
    import jax.numpy as jnp
    import ml_dtypes

    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag")
    whole = _inputs(13)[0].astype(ml_dtypes.bfloat16)
    mine = sh.shard(whole)
    joined = sh.unshard(jnp.asarray(mine))
    group.close()
    return {"type": type(joined).__module__.split(".")[0], "dtype": str(joined.dtype),
            "equal": bool(np.array_equal(np.asarray(joined).view(np.int16), whole.view(np.int16)))}


def jax_results_not_yet_computed():
    """`jax.jit` returns before its program has run where its inputs are still being computed
    (and, by XLA:CPU's choice, some calls in a training loop): a plain call given its result
    (unshard, attention, linear attention, decode, a KV cache's rows) while the program's
    burstcu calls are still to run (on XLA's thread) waits for the result before it takes the
    group. It took the group first, then waited on the program, whose burstcu call found the
    group taken by another thread and ended the job. Returns each call's largest error
    against the same call on the computed values, and whether each result was pending."""
    import jax
    import jax.numpy as jnp

    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag")
    q, k, v, _ = (jnp.asarray(sh.shard(x.astype(np.float32))) for x in _inputs(17))
    grads = jax.jit(jax.grad(lambda q, k, v: (burstcu.jax.attention(q, k, v, sh, causal=True) ** 2)
                             .sum(), argnums=(0, 1, 2)))
    weights = jnp.eye(256, dtype=jnp.float32) * 0.5
    # q after a slow computation (an encoder's layers, say): XLA runs it after returning
    late = jax.jit(lambda q, w: q + 0 * jax.lax.fori_loop(0, 400, lambda i, a: jnp.tanh(a @ w), w)[0, 0])
    token = np.asarray(_inputs(18)[0][:, :1], np.float32)     # the same on every rank
    cache = burstcu.KVCache(group, 2, 64, HKV, D, np.float32)
    calls = {"unshard": sh.unshard,
             "attention": lambda dq: burstcu.attention(dq, k, v, sh, causal=True),
             "linear": lambda dq: burstcu.linear_attention(dq, k, v, sh),
             "decode": lambda dq: burstcu.decode(token, dq[:, :, :HKV], dq[:, :, :HKV], group),
             "KV cache": lambda dq: (cache.from_prefill(dq[:, :, :HKV], dq[:, :, :HKV]),
                                     cache.decode(token))[1]}
    jax.block_until_ready(grads(late(q, weights), k, v))    # compiled: later calls return at once
    errors, pending = {}, {}
    for name, call in calls.items():
        dq, _, _ = grads(late(q, weights), k, v)
        pending[name] = not dq.is_ready()
        got = np.asarray(call(dq))                 # before the program has run
        errors[name] = max_err(got, np.asarray(call(np.asarray(dq))))
    group.close()
    return {"errors": errors, "pending": pending}


def torch_activation_checkpointing():
    """A block around burstcu.torch.attention under torch.utils.checkpoint, reentrant and not:
    its forward runs again inside the backward, collectively on every rank, and the loss and
    gradients equal the plain block's bit for bit."""
    import torch
    from torch.utils.checkpoint import checkpoint

    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag")
    q, k, v, dout = (sh.shard(torch.from_numpy(x)) for x in _inputs(11))
    forwards = []

    def block(q, k, v):
        forwards.append(1)
        return burstcu.torch.attention(q.tanh(), k, v, sh, causal=True).sin()

    results = {}
    for mode in ("plain", "reentrant", "non-reentrant"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        forwards.clear()
        out = block(*leaves) if mode == "plain" else checkpoint(
            block, *leaves, use_reentrant=mode == "reentrant")
        loss = (out * dout).sum()
        loss.backward()
        results[mode] = (len(forwards), loss.detach(), [x.grad for x in leaves])
    group.close()
    plain = results.pop("plain")
    return {mode: {"forwards": n, "same_loss": bool(torch.equal(loss, plain[1])),
                   "same_grads": all(torch.equal(a, b) for a, b in zip(grads, plain[2]))}
            for mode, (n, loss, grads) in results.items()} | {"plain forwards": plain[0]}


def torch_compile_runs_the_calls_eagerly():
    """A loss around burstcu.torch.attention under torch.compile (backend "eager": no code made)
    gives the eager loss and gradients; Dynamo traced into the ring and every rank failed."""
    import torch

    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag")
    q, k, v, _ = (torch.from_numpy(x) for x in _inputs(9))
    leaves = [[sh.shard(x).requires_grad_() for x in (q, k, v)] for _ in range(2)]

    def loss(q, k, v):
        return burstcu.torch.attention(q, k, v, sh, causal=True).square().sum()

    eager = loss(*leaves[0])
    eager.backward()
    compiled = torch.compile(loss, backend="eager")(*leaves[1])
    compiled.backward()
    group.close()
    return {"loss": abs(float(eager) - float(compiled)),
            "grads": max(float((a.grad - b.grad).abs().max()) for a, b in zip(*leaves))}
