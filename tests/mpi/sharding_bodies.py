"""Bodies for tests/test_sharding.py: `burstcu.Sharding` carried through shard, attention, its
backward and unshard, in the 4-D (B, S, H, D) and the packed (T, H, D) form, against a float64
reference over a dense mask written here (tests/mpi/bodies.py's `dense_keep`), within
FlashAttention's tolerance rule."""

from __future__ import annotations

import numpy as np

import burstcu
from burstcu.testing.reference import attention_backward_ref, attention_ref
from tests.mpi.bodies import NAIVE, _check, dense_keep, make_inputs


def _lengths_for(size: int, n: int) -> list[int]:
    """Uneven contiguous lengths adding up to n: rank 0 holds three times the others' share."""
    rest = n // (size + 2)
    return [n - rest * (size - 1)] + [rest] * (size - 1)


def sharding_matches_reference(layout="zigzag", docs=(0, 5, 17, 30, 48), uneven=False,
                               packed=False, dtype="float32", strategy="burst"):
    """A Sharding(group, layout, cu_seqlens, lengths) cuts Q, K, V, dO; attention and its
    backward take it in place of the group (no layout=, cu_seqlens=, uneven= given); out, lse and
    dq, dk, dv, joined by sh.unshard / sh.unshard_lse on every rank, match the float64 reference
    of the whole sequence with causal masking inside each document. packed: flash-attn's varlen
    form, (T, H, D) arrays and lse (H, T)."""
    return check_sharding(burstcu.init(backend="numpy"), layout, docs, uneven, packed, dtype,
                          strategy)


def check_sharding(group, layout, docs, uneven, packed, dtype, strategy) -> dict:
    """`sharding_matches_reference` on `group` (closed here): the errors of out, lse, dq, dk,
    dv against float64 and the shard length every rank held."""
    n = docs[-1] if docs else 48
    lengths = _lengths_for(group.size, n) if uneven else None
    sh = burstcu.Sharding(group, layout=layout, cu_seqlens=None if docs is None else list(docs),
                          lengths=lengths)
    q, k, v, dout = make_inputs(7, 1, n, 4, 2, 8, dtype)
    axis = 0 if packed else 1
    whole = [x[0] if packed else x for x in (q, k, v, dout)]
    # the sequence axis, 0 packed and 1 else, found by the Sharding: told for packed rows without
    # documents or lengths, which nothing tells from (B, N, d_model) hidden states
    told = axis if packed and docs is None and lengths is None else None
    ql, kl, vl, dol = (sh.shard(x, told) for x in whole)
    out, lse = burstcu.attention(ql, kl, vl, sh, causal=True, return_lse=True, strategy=strategy)
    dq, dk, dv = burstcu.attention_backward(dol, ql, kl, vl, out, lse, sh, causal=True,
                                            strategy=strategy)
    assert out.shape == ql.shape and lse.shape == ((4,) if packed else (1, 4)) + ql.shape[axis:axis + 1]
    joined = [sh.unshard(x) for x in (out, dq, dk, dv)]
    joined_lse = sh.unshard_lse(lse)
    if packed:
        joined, joined_lse = [x[None] for x in joined], joined_lse[None]
    keep = dense_keep(np.arange(n), np.arange(n), True, (-1, -1), docs)
    ref_out, ref_lse = attention_ref(q, k, v, keep=keep)
    naive_out, naive_lse = attention_ref(q, k, v, keep=keep, dtype=NAIVE[dtype])
    errors = {"out": _check("out", joined[0].astype(np.float64), ref_out, naive_out, dtype),
              "lse": _check("lse", joined_lse, ref_lse, naive_lse, dtype)}
    refs = attention_backward_ref(dout, q, k, v, keep=keep)
    naives = attention_backward_ref(dout, q, k, v, keep=keep, dtype=NAIVE[dtype])
    for name, got, ref, naive in zip(("dq", "dk", "dv"), joined[1:], refs, naives):
        errors[name] = _check(name, got.astype(np.float64), ref, naive, dtype)
    lengths_held = group.transport.allgather_object(int(ql.shape[axis]), "lengths")
    group.close()
    return {"errors": errors, "lengths": lengths_held}


def _value_errors(calls: dict) -> dict:
    """{name: message} of the calls that raised ValueError (the others are left out)."""
    messages = {}
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def disagreeing_keywords_are_refused():
    """A keyword beside a Sharding that disagrees with it: the same ValueError on every rank,
    for attention, its backward and linear attention; the group still works afterwards. Shards
    cut otherwise than the Sharding's lengths say are refused too."""
    group = burstcu.init(backend="numpy")
    n = 8 * group.size
    sh = burstcu.Sharding(group, layout="zigzag")
    q, k, v, dout = make_inputs(3, 1, n, 2, 2, 8, "float32")
    ql, kl, vl, dol = (sh.shard(x) for x in (q, k, v, dout))
    lse = np.zeros((1, 2, ql.shape[1]), np.float32)
    calls = {   # name: a call that must raise ValueError on every rank
        "layout": lambda: burstcu.attention(ql, kl, vl, sh, layout="contiguous"),
        "cu_seqlens": lambda: burstcu.attention(ql, kl, vl, sh, cu_seqlens=[0, n]),
        "uneven": lambda: burstcu.attention(ql, kl, vl, sh, uneven=True),
        "backward": lambda: burstcu.attention_backward(dol, ql, kl, vl, ql, lse, sh,
                                                       layout="contiguous"),
        "linear documents": lambda: burstcu.linear_attention(
            ql, kl, vl, burstcu.Sharding(group, cu_seqlens=[0, n])),
        "uneven not a bool": lambda: burstcu.attention(ql, kl, vl, sh, uneven=np.array([1, 0])),
        "bad cu_seqlens": lambda: burstcu.attention(ql, kl, vl, sh, cu_seqlens=[0.5, n]),
        "unshard layout": lambda: burstcu.unshard(ql, sh, layout="contiguous"),
    }
    if group.size > 1:
        lengths = [n - group.size + 1] + [1] * (group.size - 1)
        near_equal = burstcu.shard(q, group)            # not the lengths the Sharding says
        calls["lengths"] = lambda: burstcu.attention(near_equal, near_equal, near_equal,
                                                     burstcu.Sharding(group, lengths=lengths))
        # ranks whose Shardings say different lengths: refused on every rank, not a hang
        mine = lengths if group.rank == 0 else [n - group.size, 2] + [1] * (group.size - 2)
        x = burstcu.Sharding(group, lengths=lengths).shard(q)
        calls["ranks' lengths differ"] = lambda: burstcu.attention(
            x, x, x, burstcu.Sharding(group, lengths=mine))
    messages = _value_errors(calls)
    same = burstcu.attention(ql, kl, vl, sh, layout="zigzag")   # agreeing keywords are fine
    assert same.shape == ql.shape
    assert np.array_equal(burstcu.shard(q, sh), ql)             # shard/unshard take it too
    assert np.array_equal(burstcu.unshard(ql, sh), q)
    group.barrier()
    group.close()
    return {"messages": messages}


def bare_keyword_mistakes():
    """The mistakes a Sharding prevents, made with bare keywords instead: arrays that `shard` cut
    (and the results of calls on them) remember how, so a call with another layout, other
    documents, an lse joined along the wrong axis, or an axis the array lacks is the same
    ValueError on every rank (not a wrong answer); the calls that agree with the cut still run."""
    group = burstcu.init(backend="numpy")
    n = 12 * group.size
    docs = [0, 5, n - 7, n]
    q, k, v, dout = make_inputs(4, 1, n, 2, 2, 8, "float32")
    zq, zk, zv = (burstcu.shard(x, group, "zigzag") for x in (q, k, v))
    dq_, dk_, dv_ = (burstcu.shard(x, group, "zigzag", cu_seqlens=docs) for x in (q, k, v))
    out, lse = burstcu.attention(zq, zk, zv, group, causal=True, layout="zigzag", return_lse=True)
    cq, ck, cv = (burstcu.shard(x, group) for x in (q, k, v))
    calls = {   # name: a call that must raise ValueError on every rank
        "zigzag shards, no layout": lambda: burstcu.attention(zq, zk, zv, group, causal=True),
        "documents at shard only": lambda: burstcu.attention(dq_, dk_, dv_, group, causal=True,
                                                             layout="zigzag"),
        "documents at attention only": lambda: burstcu.attention(zq, zk, zv, group, causal=True,
                                                                 layout="zigzag", cu_seqlens=docs),
        "backward without layout": lambda: burstcu.attention_backward(
            burstcu.shard(dout, group, "zigzag"), zq, zk, zv, out, lse, group, causal=True),
        "lse along axis 1": lambda: burstcu.unshard(lse, group, layout="zigzag"),
        "out without layout": lambda: burstcu.unshard(out, group),
        "linear without layout": lambda: burstcu.linear_attention(zq, zk, zv, group, causal=True),
        # a layer without a mask on projections (its result remembers the ranks alone), then a
        # zigzag causal layer: its output remembers zigzag
        "layout after a projection": lambda: burstcu.unshard(burstcu.attention(
            projected, projected, projected, group, causal=True, layout="zigzag"), group),
        "linear gradient without layout": lambda: burstcu.unshard(burstcu.linear_attention_backward(
            burstcu.shard(dout, group, "zigzag"), zq, zk, zv, group, causal=True, layout="zigzag")[1],
            group),
        "axis out of range": lambda: burstcu.unshard(out, group, layout="zigzag", axis=4),
        "misspelled layout": lambda: burstcu.attention(zq, zk, zv, group, causal=True,
                                                       layout="zig-zag"),
        # rows that pair row by row cut two ways, in calls no position changes (no mask): each
        # key would meet another position's value, each query another's output gradient
        "values cut another way": lambda: burstcu.attention(cq, ck, zv, group),
        "output gradient cut another way": lambda: burstcu.attention_backward(
            burstcu.shard(dout, group, "zigzag"), cq, ck, cv, plain_c, plain_lse, group),
        "linear values cut another way": lambda: burstcu.linear_attention(cq, ck, zv, group),
        "cache values cut another way": lambda: burstcu.decode(q[:, -1:], ck, zv, group),
        "prefill values cut another way": lambda: burstcu.KVCache(group, 1, n, 2, 8, np.float32)
        .from_prefill(ck, zv),
    }
    plain_c, plain_lse = burstcu.attention(cq, ck, cv, group, return_lse=True)
    projected = burstcu.attention(zq * 1.0, zk * 1.0, zv * 1.0, group)
    messages = _value_errors(calls)
    # what agrees with the cut runs: contiguous shards with documents given at attention only
    # (documents move no contiguous row), the lse along its sequence axis, ...
    ok = burstcu.attention(cq, ck, cv, group, causal=True, cu_seqlens=docs)
    whole_lse = burstcu.unshard(lse, group, layout="zigzag", axis=2)
    # ... a call whose answer no position changes (no mask) on zigzag shards, equal to the
    # zigzag call's; a gather along another axis (heads) than the one the rows were cut on
    plain = burstcu.attention(zq, zk, zv, group)
    assert np.array_equal(plain, burstcu.attention(zq, zk, zv, group, layout="zigzag"))
    # ... queries cut one way beside keys and values cut another (each pair cut alike): the
    # same answer, the keys summed in another order
    mixed = burstcu.attention(zq, ck, cv, group)
    assert np.allclose(mixed, plain, rtol=1e-5, atol=1e-6), np.abs(mixed - plain).max()
    # ... and its backward, whose dk lies as its keys (a layer's contiguous output) and is that
    # layer's output gradient (each gradient remembered as its input's rows, dq as q's)
    out1, lse1 = burstcu.attention(cq, ck, cv, group, return_lse=True)
    out2, lse2 = burstcu.attention(zq, out1, out1, group, return_lse=True)
    _, dk2, _ = burstcu.attention_backward(burstcu.shard(dout, group, "zigzag"), zq, out1, out1,
                                           out2, lse2, group)
    burstcu.attention_backward(dk2, cq, ck, cv, out1, lse1, group)
    # ... and copies of zigzag shards (which remember nothing) in calls without a mask or a
    # layout: their results remember nothing either (the default layout would be a guess),
    # so they go with shards that remember zigzag, and unshard takes them with the layout
    uq, uk, uv = (x.copy() for x in (zq, zk, zv))
    out_u, lse_u = burstcu.attention(uq, uk, uv, group, return_lse=True)
    zdout = burstcu.shard(dout, group, "zigzag")
    burstcu.attention_backward(zdout, uq, uk, uv, out_u, lse_u, group)
    burstcu.attention(zq, out_u, out_u, group)
    _, dk_u, _ = burstcu.attention_backward(zdout, zq, uk, uv, *burstcu.attention(
        zq, uk, uv, group, return_lse=True), group)
    joined = [burstcu.unshard(x, group, layout="zigzag") for x in (out_u, dk_u)]
    assert all(x.shape == (1, n, 2, 8) for x in joined), [x.shape for x in joined]
    heads = burstcu.unshard(out, group, axis=2)
    # ... and buffers refilled in place with pieces of a new batch cut another way
    buffers = [burstcu.shard(x, group, "zigzag", cu_seqlens=docs) for x in (q, k, v)]
    other = [0, 9, n]
    for buffer, x in zip(buffers, make_inputs(5, 1, n, 2, 2, 8, "float32")):
        buffer[...] = burstcu.shard(x, group, "zigzag", cu_seqlens=other)
    refilled = burstcu.attention(*buffers, group, causal=True, layout="zigzag", cu_seqlens=other)
    group.barrier()
    group.close()
    return {"messages": messages, "ok": list(ok.shape), "lse": list(whole_lse.shape),
            "heads": list(heads.shape), "refilled": list(refilled.shape)}


def group_left_out():
    """Shards of this group passed to a call without it (one process: attention, its backward,
    linear attention, decode, a KV cache's prefill), the results joined
    without it, whole arrays (cut for one process) passed as a rank's shard, and arrays cut
    along another axis than their sequence's (packed arrays cut by shard's default axis 1,
    heads) passed to a call on the group: ValueError on every rank, naming the ranks or the
    axis; a view (the rows meant as they are) still runs, as each rank's own attention over its
    own rows, and heads split over the ranks run locally, each over the whole sequence."""
    group = burstcu.init(backend="numpy")
    n = 6 * group.size
    q, k, v, dout = make_inputs(7, 1, n, 6, 6, 8, "float32")
    cq, ck, cv, cdo = (burstcu.shard(x, group) for x in (q, k, v, dout))
    out, lse = burstcu.attention(cq, ck, cv, group, causal=True, return_lse=True)
    whole = [burstcu.shard(x, None) for x in (q, k, v)]
    calls = {
        "attention": lambda: burstcu.attention(cq, ck, cv),
        "causal attention": lambda: burstcu.attention(cq, ck, cv, causal=True),
        "backward": lambda: burstcu.attention_backward(cdo, cq, ck, cv, out, lse, causal=True),
        "unshard": lambda: burstcu.unshard(out, None),
        "linear": lambda: burstcu.linear_attention(cq, ck, cv),
        "whole arrays as shards": lambda: burstcu.attention(*whole, group),
        "packed, cut along axis 1": lambda: burstcu.attention(
            *(burstcu.shard(x[0], group) for x in (q, k, v)), group),
        "heads on the group": lambda: burstcu.attention(*heads, group, causal=True),
        "decode": lambda: burstcu.decode(q[:, -1:], ck, cv),
        "KV cache": lambda: burstcu.KVCache(None, 1, n, 6, 8, np.float32).from_prefill(ck, cv),
        # a layer on rows that remember nothing (projections), no mask, no layout: its result
        # remembers the ranks (its layout would be a guess): left out of the next call, refused
        "projected, unshard": lambda: burstcu.unshard(projected, None),
        "projected, next layer": lambda: burstcu.attention(projected, projected, projected),
        "projected, cut again": lambda: burstcu.shard(projected, group),
    }
    projected = burstcu.attention(cq * 1.0, ck * 1.0, cv * 1.0, group)
    heads = [burstcu.shard(x, group, axis=2) for x in (q, k, v)]
    messages = _value_errors(calls)
    mine = burstcu.attention(cq.view(), ck.view(), cv.view(), causal=True)
    want = attention_ref(cq, ck, cv, causal=True)[0]
    my_heads = burstcu.attention(*heads, causal=True)
    heads_want = attention_ref(*heads, causal=True)[0]
    group.barrier()
    group.close()
    return {"messages": messages, "view_error": float(np.abs(mine - want).max()),
            "heads_error": float(np.abs(my_heads - heads_want).max()), "heads_shape": list(my_heads.shape)}


def cuts_that_are_right_still_run():
    """What the checks of a cut must let through, against float64 where it computes: heads and
    a batch split over the ranks, attended locally (no group) forward, backward and as the next
    layer; a local call on a view (its result remembered as nothing) joined by unshard and fed to
    a call on the group; on 4 ranks, sequence x heads parallelism on two sub-groups, the cuts
    made in either order."""
    from mpi4py import MPI

    group = burstcu.init(backend="numpy")
    n = 8 * group.size
    q, k, v, dout = make_inputs(8, 2 * group.size, n, 2 * group.size, 2 * group.size, 8, "float32")
    errors = {}
    for name, axis in (("heads", 2), ("batch", 0)):
        hq, hk, hv, hdo = (burstcu.shard(x, group, axis=axis) for x in (q, k, v, dout))
        out, lse = burstcu.attention(hq, hk, hv, causal=True, return_lse=True)
        grads = burstcu.attention_backward(hdo, hq, hk, hv, out, lse, causal=True)
        want = attention_backward_ref(hdo, hq, hk, hv, causal=True)
        nxt = burstcu.attention(out, hk, hv)
        errors[name] = max(float(np.abs(g - w).max()) for g, w in zip(grads, want))
        errors[name + " next layer"] = float(np.abs(nxt - attention_ref(out, hk, hv)[0]).max())
        whole_lse = burstcu.unshard(lse, group, axis=0 if axis == 0 else 1)   # an lse joined as cut
        errors[name + " lse joined"] = float(np.abs(whole_lse - attention_ref(q, k, v, causal=True)[1]).max())
    # a one-process reference's out and lse cut by shard, given to the backward on the group
    ref_out, ref_lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    pieces = [burstcu.shard(x, group) for x in (dout, q, k, v, ref_out)]
    grads = burstcu.attention_backward(*pieces, burstcu.shard(ref_lse, group, axis=2), group, causal=True)
    want = [burstcu.shard(w, group) for w in attention_backward_ref(dout, q, k, v, causal=True)]
    errors["reference lse cut"] = max(float(np.abs(g - w).max()) for g, w in zip(grads, want))
    # hidden states (B, N, d) cut along axis 1 by a Sharding join along axis 1
    sh = burstcu.Sharding(group)
    hidden = np.arange(4 * n * 8, dtype=np.float32).reshape(4, n, 8)
    errors["hidden states joined"] = float(np.abs(sh.unshard(sh.shard(hidden, axis=1)) - hidden).max())
    cq, ck, cv = (burstcu.shard(x, group) for x in (q, k, v))
    local = burstcu.attention(cq.view(), ck.view(), cv.view(), causal=True)
    joined = burstcu.unshard(local, group)
    on_group = burstcu.attention(local, ck, cv, group)
    orders = {}
    if group.size == 4:
        world, r = MPI.COMM_WORLD, group.rank
        sp = burstcu.init(comm=world.Split(r // 2, r), backend="numpy")
        tp = burstcu.init(comm=world.Split(r % 2, r), backend="numpy")
        for order, cut in (("heads then sequence",
                            lambda x: burstcu.shard(burstcu.shard(x, tp, axis=2), sp)),
                           ("sequence then heads",
                            lambda x: burstcu.shard(burstcu.shard(x, sp), tp, axis=2))):
            orders[order] = list(burstcu.attention(*(cut(x) for x in (q, k, v)), sp, causal=True).shape)
        sp.close()
        tp.close()
    group.barrier()
    group.close()
    return {"errors": errors, "joined": list(joined.shape), "on_group": list(on_group.shape),
            "orders": orders}


def lengths_that_miss_the_rows():
    """A Sharding whose lengths add up to one row more than the (1, N, 2, 8) array holds, N = 8G:
    `sh.shard(x)` refuses x, and `sh.unshard` refuses shards of other lengths than it says, with
    the same ValueError on every rank at any world size, one rank included."""
    group = burstcu.init(backend="numpy")
    n = 8 * group.size
    x = np.zeros((1, n, 2, 8), np.float32)
    longer = burstcu.Sharding(group, lengths=[9] + [8] * (group.size - 1))
    messages = _value_errors({"shard": lambda: longer.shard(x),
                              "unshard": lambda: longer.unshard(burstcu.shard(x, group))})
    group.barrier()
    group.close()
    return {"messages": messages}


def packed_documents_along_axis_1():
    """A packed (T, H, D) array, T = 8G, with cu_seqlens ending at T, given to `shard` and
    `unshard` with their default axis=1 (its heads): a ValueError on every rank that names the
    rows along axis 1, where cu_seqlens ends, and axis=0; with axis=0 both run. A (B, H, S)
    lse cut along its heads: the same error, without the packed-array hint."""
    group = burstcu.init(backend="numpy")
    n = 8 * group.size
    packed = np.arange(n * 4 * 8, dtype=np.float32).reshape(n, 4, 8)
    docs = [0, 5, n]
    mine = burstcu.shard(packed, group, axis=0, cu_seqlens=docs)
    lse = np.zeros((1, 4, n), np.float32)              # (B, H, S): axis 0 is not the rows
    messages = _value_errors({
        "shard": lambda: burstcu.shard(packed, group, cu_seqlens=docs),
        "unshard": lambda: burstcu.unshard(mine.view(), group, cu_seqlens=docs),   # a view: no memory
        "shard lse": lambda: burstcu.shard(lse, group, axis=1, cu_seqlens=docs)})
    whole = burstcu.unshard(mine, group, axis=0, cu_seqlens=docs)
    group.barrier()
    group.close()
    return {"messages": messages, "joined": bool(np.array_equal(whole, packed))}


def torch_tensors_unshard(dtypes=("bfloat16",)):
    """CPU torch tensors of each of `dtypes`, (1, N, 2, 8) with N = 5G + 1, cut by `shard`
    (contiguous and zigzag, near-equal lengths) and joined by `unshard` on every rank: what one
    rank returns at any world size ({"DTYPE LAYOUT": [type, dtype, shape, equal]}), a tensor of
    that dtype equal to the global one bit for bit (bfloat16 included, which DLPack cannot carry
    into NumPy)."""
    import torch

    group = burstcu.init(backend="numpy")
    n = 5 * group.size + 1
    rng = np.random.default_rng(11)    # the same global tensor on every rank
    draw = torch.from_numpy(rng.standard_normal((1, n, 2, 8)).astype(np.float32))
    joined = {}
    for dtype in dtypes:
        whole = draw.to(getattr(torch, dtype))
        for layout in ("contiguous", "zigzag"):
            got = burstcu.unshard(burstcu.shard(whole, group, layout), group, layout=layout)
            joined[f"{dtype} {layout}"] = [type(got).__name__, str(got.dtype), list(got.shape),
                                           bool(torch.equal(got.view(torch.uint8), whole.view(torch.uint8)))]
    group.barrier()
    group.close()
    return {"joined": joined}


def unshard_of_a_copy_asks_for_the_axis():
    """Sharding.unshard of a 3-D array it remembers nothing of (a copy) asks for the axis, on
    every rank, instead of joining batch rows: where the Sharding has no documents or lengths
    (a packed copy, an lse copy) and where axis 0 cannot be this rank's rows (hidden states (B,
    N, d) whose rows are the Sharding's lengths); the same arrays with their axis (or
    unshard_lse) join as the reference says; unshard_lse refuses the 4-D output."""
    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag")
    q, k, v, _ = make_inputs(9, 1, 8 * group.size, 4, 2, 8, "float32")
    out, lse = burstcu.attention(*(sh.shard(x) for x in (q, k, v)), sh, causal=True, return_lse=True)
    rows = [5] + [3] * (group.size - 1)
    uneven = burstcu.Sharding(group, lengths=rows)
    hidden = np.zeros((group.size + 1, rows[group.rank], 16), np.float32)  # (B, N_local, d), B > G
    # documents cut 4 rows to a rank (2 ranks): hidden states (4, 4, d) whose batch is as long
    documents = burstcu.Sharding(group, layout="zigzag", cu_seqlens=[0, 3, 4 * group.size])
    hidden_docs = documents.shard(np.zeros((4, 4 * group.size, 3)), axis=1)
    class OnAGpu:   # a framework's array on CUDA device 0 (its DLPack device says so)
        ndim, shape, dtype = 4, (1, 8, 4, 8), np.dtype(np.float32)

        def __dlpack_device__(self):
            return (2, 0)

    messages = _value_errors({"lse copy": lambda: sh.unshard(lse.copy()),
                              "hidden states copy": lambda: uneven.unshard(hidden.copy()),
                              "on a GPU": lambda: sh.unshard(OnAGpu()),
                              "packed copy": lambda: sh.unshard(np.zeros((2, 2, 4), np.float32)),
                              "hidden copy, documents": lambda: documents.unshard(hidden_docs.copy()),
                              "lse copy, documents": lambda: documents.unshard(np.zeros((1, 2, 4))),
                              "out as lse": lambda: sh.unshard_lse(out)})
    want_out, want_lse = attention_ref(q, k, v, causal=True)
    errors = {"lse": float(np.abs(sh.unshard_lse(lse.copy()) - want_lse).max()),
              "lse axis": float(np.abs(sh.unshard(lse.copy(), axis=2) - want_lse).max()),
              "out copy": float(np.abs(sh.unshard(out.copy()) - want_out).max())}
    shape = uneven.unshard(hidden.copy(), axis=1).shape
    # packed copies that are this rank's rows: one row where the lengths say so; told, without
    ones = [1] + [3] * (group.size - 1)
    packed = np.zeros((ones[group.rank], 2, 4), np.float32) + group.rank
    joined = burstcu.Sharding(group, lengths=ones).unshard(packed.copy())
    pairs = sh.unshard(np.zeros((2, 2, 4), np.float32) + group.rank, axis=0)
    group.close()
    return {"messages": messages, "errors": errors, "hidden_shape": list(shape),
            "packed": joined[:, 0, 0].tolist(), "pairs": pairs[:, 0, 0].tolist()}


def global_array_to_unshard_and_a_shard_to_shard():
    """unshard given the global array on every rank joined G copies of it without a word, and
    shard given a shard cut it again: a SameShardsWarning at the caller's line, and a
    ValueError. Shards of their own, shards of one constant value (zeros, NaN), a view of a shard
    cut again, a shard "cut" for one process (kept whole) and the result of a one-process call
    cut for the group: nothing said."""
    import warnings

    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag")
    whole = make_inputs(4, 1, 6 * group.size, 2, 2, 8, "float32")[0]
    result = {}
    for name, call in (("global", lambda: sh.unshard(whole)),
                       ("shards", lambda: sh.unshard(sh.shard(whole))),
                       ("zeros", lambda: sh.unshard(np.zeros_like(sh.shard(whole)))),
                       ("nan", lambda: sh.unshard(np.full_like(sh.shard(whole), np.nan))),
                       ("strings", lambda: burstcu.unshard(np.char.add(f"{group.rank}.", np.arange(
                           8).reshape(1, 4, 2).astype(str)), group)),   # no NaN to match there
                       ("view cut again", lambda: burstcu.shard(sh.shard(whole)[:], group)),
                       ("shard kept whole", lambda: burstcu.shard(sh.shard(whole), None)),
                       ("one-process result cut", lambda: sh.shard(burstcu.attention(whole, whole,
                                                                                     whole)))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shape = list(call().shape)
        result[name] = {"shape": shape, "warned": [(w.filename.rsplit("/", 1)[-1], str(w.message))
                                                   for w in caught]}
    try:
        sh.shard(sh.shard(whole))
        result["shard of a shard"] = None
    except ValueError as exc:
        result["shard of a shard"] = str(exc)
    return result
