"""`burstcu.Sharding` and packed (T, H, D) inputs: the split of the sequence carried from `shard`
through `attention`, its backward and `plan` to `unshard`, under mpiexec -n 1..4 against a
float64 reference (tests/mpi/sharding_bodies.py); disagreeing keywords refused on every rank."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from tests.mpi_run import run_mpi

CASES = {   # name: keywords of sharding_matches_reference
    "zigzag documents": dict(layout="zigzag"),
    "zigzag documents packed": dict(layout="zigzag", packed=True),
    "contiguous packed no documents": dict(layout="contiguous", docs=None, packed=True),
    "uneven contiguous documents": dict(layout="contiguous", uneven=True),
    "uneven packed ring": dict(layout="contiguous", uneven=True, packed=True, strategy="ring"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", (1, 2, 3, 4))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.mpi
def test_sharding_matches_the_float64_reference(world, case):
    if world == 1 and CASES[case].get("uneven"):
        pytest.skip("one rank holds the whole sequence: nothing is uneven")
    results = run_mpi(world, "sharding_bodies:sharding_matches_reference", **CASES[case])
    lengths = results[0]["lengths"]
    assert all(r["lengths"] == lengths for r in results) and sum(lengths) == 48
    if CASES[case].get("uneven"):
        assert lengths[0] > lengths[-1]            # the Sharding's lengths, not near-equal ones


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.mpi
def test_disagreeing_keywords_are_refused_on_every_rank(world):
    results = run_mpi(world, "sharding_bodies:disagreeing_keywords_are_refused")
    messages = results[0]["messages"]
    assert set(messages) == {"layout", "cu_seqlens", "uneven", "backward", "linear documents",
                             "uneven not a bool", "bad cu_seqlens", "unshard layout", "lengths",
                             "ranks' lengths differ"}, messages
    assert all(r["messages"] == messages for r in results)
    assert "the Sharding's layout is 'zigzag'" in messages["layout"]
    assert "pass the Sharding alone" in messages["cu_seqlens"]
    assert "Sharding says" in messages["lengths"]
    assert "uneven must be True or False" in messages["uneven not a bool"]
    assert "sharding_lengths" in messages["ranks' lengths differ"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.mpi
def test_bare_keyword_mistakes_are_refused_on_every_rank(world):
    """Without a Sharding: zigzag shards passed without layout=, documents given to shard or to
    attention only, unshard(lse) along axis 1, unshard(out) without the layout, keys and values
    (or queries and output gradients) cut two ways in a call without a mask: ValueError on every
    rank, naming the cuts. Correct programs still run: no mask (the answer does not depend on
    positions; queries cut one way beside keys and values cut another), a gather along the
    heads, buffers refilled in place."""
    results = run_mpi(world, "sharding_bodies:bare_keyword_mistakes")
    messages = results[0]["messages"]
    assert set(messages) == {"zigzag shards, no layout", "documents at shard only",
                             "documents at attention only", "backward without layout",
                             "lse along axis 1", "out without layout", "linear without layout",
                             "axis out of range", "misspelled layout", "values cut another way",
                             "output gradient cut another way", "linear values cut another way",
                             "cache values cut another way", "prefill values cut another way",
                             "linear gradient without layout", "layout after a projection"}
    for r in results:   # the same error everywhere, named by the rank that saw it first
        assert set(r["messages"]) == set(messages)
        assert r["ok"] == [1, 12, 2, 8] and r["lse"] == [1, 2, 12 * world]
        assert r["heads"] == [1, 12, 2 * world, 8] and r["refilled"][1] in (11, 12, 13)
    said = {name: m.split(": ", 1)[-1] if m.startswith("rank ") else m for name, m in messages.items()}
    assert "q was cut with layout='zigzag' but this call has layout='contiguous'" in \
        said["zigzag shards, no layout"]
    assert "with cu_seqlens=[0, 5," in said["documents at shard only"]
    assert "q was cut with layout='zigzag' without documents (cu_seqlens) but this call has " \
        "layout='zigzag' with cu_seqlens" in said["documents at attention only"]
    assert "x_local is an lse (B, H, S) whose sequence axis is 2, not axis=1" in \
        said["lse along axis 1"]
    # a layout no shard has is named as such (it read as a cut with another layout)
    assert said["misspelled layout"].startswith("layout must be one of ('contiguous', 'zigzag', "
                                                "'documents'), not 'zig-zag'"), said["misspelled layout"]
    assert "x_local was cut with layout='zigzag'" in said["out without layout"]
    assert "x_local was cut with layout='zigzag'" in said["linear gradient without layout"]
    assert "x_local was cut with layout='zigzag'" in said["layout after a projection"]
    assert "axis 4 is out of range for x_local of 4 dimensions" in said["axis out of range"]
    pairs = {"values cut another way": "v was cut with layout='zigzag' but k with layout='contiguous'",
             "output gradient cut another way": "dout was cut with layout='zigzag' but q with "
                                                "layout='contiguous'",
             "linear values cut another way": "v was cut with layout='zigzag' but k with",
             "cache values cut another way": "v_cache was cut with layout='zigzag' but k_cache with",
             "prefill values cut another way": "v_local was cut with layout='zigzag' but k_local with"}
    for name, start in pairs.items():
        assert start in said[name] and "row i of one would be paired" in said[name], said[name]


@pytest.mark.parametrize("axis,kind", [(4, ValueError), (-5, ValueError), (1.0, TypeError),
                                       (True, TypeError)])
def test_an_axis_the_array_lacks_is_refused(axis, kind):
    """shard and unshard of one process: an axis out of range, or not an int, is an error (not
    the axis it would wrap to); a negative one counts from the end, as NumPy's."""
    x = np.arange(2 * 12 * 2 * 8, dtype=np.float32).reshape(2, 12, 2, 8)
    for call in (burstcu.shard, burstcu.unshard):
        with pytest.raises(kind, match="axis"):
            call(x, None, axis=axis)
    assert np.array_equal(burstcu.unshard(burstcu.shard(x, None, axis=-3), None, axis=-3), x)


def test_unshard_told_no_axis_of_rows_cut_along_another_is_refused():
    """A packed (T, H, D) result remembers its rows cut along axis 0: burstcu.unshard(out, group)
    joined its heads (out (T/G, G*H, D), silently); now a ValueError on every rank asking for
    axis=0, which joins the rows the one-process call gives. Told axis=1 it still joins heads (a
    gather along another axis, by choice), and 4-D shards are joined along 1 as before."""
    from burstcu.testing.world import run_ranks

    rng = np.random.default_rng(0)
    cu = [0, 10, 35, 60]
    Q, K, V = (rng.standard_normal((60, 4, 16)).astype(np.float32) for _ in range(3))
    want = burstcu.attention(Q, K, V, causal=True, cu_seqlens=cu)
    X = rng.standard_normal((1, 12, 2, 8))

    def body(group):
        sh = burstcu.Sharding(group, cu_seqlens=cu)
        out = burstcu.attention(*(sh.shard(x) for x in (Q, K, V)), sh, causal=True)
        with pytest.raises(ValueError) as refused:
            burstcu.unshard(out, group)
        return (str(refused.value), burstcu.unshard(out, group, axis=0),
                burstcu.unshard(out, group, axis=1).shape, burstcu.unshard(burstcu.shard(X, group), group))
    for said, joined, heads, rows in run_ranks(2, body):
        assert said.endswith("x_local was cut along axis 0 (its sequence), but unshard joins along "
                             "axis 1 unless told, which would join other rows than the ones cut: "
                             "pass axis=0 (a burstcu.Sharding with the documents finds it)"), said
        assert np.abs(joined - want).max() < 1e-5
        assert heads == (30, 8, 16) and np.array_equal(rows, X)


def test_a_group_in_an_arrays_place_says_an_argument_is_missing():
    """An array left out before the group (attention(q, k, sh), attention_backward without lse,
    decode without v_cache) puts the group in an array's slot and leaves the call none: a
    TypeError naming the slot on every rank, not "this call has no group" (the user passed one)
    nor the type of the array expected; through burstcu.torch and burstcu.jax too."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    from burstcu.testing.world import run_ranks

    rng = np.random.default_rng(0)
    Q, K, V, DO = (rng.standard_normal((1, 24, 2, 8)).astype(np.float32) for _ in range(4))

    def body(group):
        sh = burstcu.Sharding(group, layout="zigzag")
        q, k, v, dout = (sh.shard(x) for x in (Q, K, V, DO))
        out, lse = burstcu.attention(q, k, v, sh, causal=True, return_lse=True)
        tq, tk = torch.from_numpy(q), torch.from_numpy(k)
        jq, jk = jnp.asarray(q), jnp.asarray(k)
        calls = {"attention": (lambda: burstcu.attention(q, k, sh, causal=True), "v", "Sharding"),
                 "attention of views": (lambda: burstcu.attention(q[:], k[:], group), "v", "Group"),
                 "backward": (lambda: burstcu.attention_backward(dout, q, k, v, out, sh, causal=True),
                              "lse", "Sharding"),
                 "linear": (lambda: burstcu.linear_attention(q, k, group), "v", "Group"),
                 "linear backward": (lambda: burstcu.linear_attention_backward(dout, q, k, sh),
                                     "v", "Sharding"),
                 "decode": (lambda: burstcu.decode(q[:, :1], k, group), "v_cache", "Group"),
                 "torch": (lambda: burstcu.torch.attention(tq, tk, sh), "v", "Sharding"),
                 "torch decode": (lambda: burstcu.torch.decode(tq[:, :1], tk, group), "v_cache", "Group"),
                 "jax": (lambda: burstcu.jax.attention(jq, jk, sh), "v", "Sharding"),
                 "jax linear": (lambda: burstcu.jax.linear_attention(jq, jk, group), "v", "Group"),
                 "jax decode": (lambda: burstcu.jax.decode(jq[:, :1], jk, group), "v_cache", "Group")}
        said = {}
        for name, (call, slot, kind) in calls.items():
            with pytest.raises(TypeError) as caught:
                call()
            said[name] = (str(caught.value), slot, kind)
        return said
    for said in run_ranks(2, body):
        for name, (message, slot, kind) in said.items():
            assert message == (f"{slot} is a burstcu.{kind} where an array goes: an array is missing "
                               f"before it, or out of order (the group comes after the arrays)"), \
                (name, message)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.mpi
def test_a_group_left_out_is_refused_on_every_rank(world):
    """The shards of a group passed without it: each rank would attend over its own rows alone,
    a wrong answer with no error before; now a ValueError on every rank that says so, for the
    forward, the backward, linear attention and unshard; whole arrays passed as shards, and
    heads (packed arrays cut by shard's default axis 1 among them) passed as shards of the
    sequence, too. A view of the shards (local attention meant) runs, and so do heads split
    over the ranks attending locally."""
    results = run_mpi(world, "sharding_bodies:group_left_out")
    for r in results:
        assert set(r["messages"]) == {"attention", "causal attention", "backward", "unshard", "linear",
                                      "whole arrays as shards", "packed, cut along axis 1",
                                      "heads on the group", "decode", "KV cache", "projected, unshard",
                                      "projected, next layer", "projected, cut again"}, r["messages"]
        for name in ("attention", "causal attention", "backward", "linear", "decode", "KV cache"):
            assert f"is one rank's shard of {world} but this call has no group" in r["messages"][name]
        assert r["messages"]["decode"].startswith("k_cache is one rank's shard")
        assert r["messages"]["KV cache"].startswith("KVCache.from_prefill: k_local is one rank's shard")
        assert "x_local is one rank's shard of" in r["messages"]["unshard"]
        assert "x_local is one rank's shard of" in r["messages"]["projected, unshard"]
        assert f"q is one rank's shard of {world} but this call has no group" in \
            r["messages"]["projected, next layer"]
        assert "shard: x is already one rank's shard of" in r["messages"]["projected, cut again"]
        assert f"holds every row (cut for one process) but this call runs on {world} ranks" in \
            r["messages"]["whole arrays as shards"]
        assert "q was cut along axis 1, but the sequence axis of a packed (T, H, D) array is 0" in \
            r["messages"]["packed, cut along axis 1"]
        # the same cut of hidden states (B, S, d_model) is right: the message says to project
        # them, and asks for axis 0 only of packed rows (for hidden states it would cut the batch)
        assert ("If it holds hidden states (B, S, d_model), your cut along axis 1 is right: project "
                "and reshape them to (B, S, H, D) before attention") in \
            r["messages"]["packed, cut along axis 1"]
        assert "If it holds packed rows, cut it with burstcu.shard(x, group, axis=0)" in \
            r["messages"]["packed, cut along axis 1"]
        assert "q was cut along axis 2, but the sequence axis of a (B, S, H, D) array is 1" in \
            r["messages"]["heads on the group"]
        assert "(B, H, S, D) (SDPA's order), attention takes (B, S, H, D): pass x.transpose(0, 2, 1, 3)" \
            in r["messages"]["heads on the group"]
        assert r["view_error"] < 1e-5 and r["heads_error"] < 1e-5   # heads split, each local
        assert r["heads_shape"] == [1, 6 * world, 6 // world, 8]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (2, 4))
@pytest.mark.mpi
def test_cuts_that_are_right_still_run(world):
    """The checks of a cut refuse no right program: heads or a batch split and attended locally
    (forward, backward, next layer, the lse joined along the cut axis), a local call on a view
    joined and fed to the group, a one-process reference's lse cut by shard given to the
    backward, hidden states a Sharding cut along axis 1 joined back, and on 4 ranks sequence x
    heads parallelism on two sub-groups, cut in either order."""
    for r in run_mpi(world, "sharding_bodies:cuts_that_are_right_still_run"):
        assert all(e < 1e-4 for e in r["errors"].values()), r["errors"]
        assert set(r["errors"]) == {"heads", "heads next layer", "heads lse joined", "batch",
                                    "batch next layer", "batch lse joined", "reference lse cut",
                                    "hidden states joined"}
        assert r["joined"] == [2 * world, 8 * world, 2 * world, 8]
        assert r["on_group"] == [2 * world, 8, 2 * world, 8]
        if world == 4:
            assert r["orders"] == {"heads then sequence": [8, 16, 4, 8], "sequence then heads": [8, 16, 4, 8]}


def test_a_sharding_asks_for_the_axis_of_hidden_states():
    """A 3-D array is packed (T, H, D) to a Sharding with documents or lengths, cut along axis
    0; hidden states (B, N, d_model) are 3-D too: where the Sharding knows N and axis 1 has it,
    or knows nothing (no documents or lengths), it asks for axis= instead of cutting the batch;
    given axis=1 it cuts the sequence."""
    group = burstcu.init(backend="numpy")
    hidden = np.zeros((4, 64, 32), np.float32)
    for layout in ("contiguous", "zigzag"):   # nothing tells: it asks (it cut the batch before)
        with pytest.raises(ValueError, match=r"cannot tell the sequence axis of x \(4, 64, 32\): .* "
                                             r"\(B, N, d_model\) \(axis=1\), .*: pass axis="):
            burstcu.Sharding(group, layout).shard(hidden)
    for sh in (burstcu.Sharding(group, lengths=[64]), burstcu.Sharding(group, cu_seqlens=[0, 20, 64])):
        with pytest.raises(ValueError, match=r"x \(4, 64, 32\) has 4 rows there and the sequence's 64 "
                                             r"along axis 1: pass axis="):
            sh.shard(hidden)
        assert sh.shard(hidden, axis=1).shape == (4, 64, 32)
        assert sh.shard(np.zeros((64, 4, 16), np.float32)).shape == (64, 4, 16)   # packed


def test_a_sharding_is_checked_when_made():
    group = burstcu.init(backend="numpy")
    with pytest.raises(ValueError, match="layout must be one of"):
        burstcu.Sharding(group, layout="striped")
    with pytest.raises(ValueError, match="contiguous shards"):
        burstcu.Sharding(group, layout="zigzag", lengths=[4])
    with pytest.raises(ValueError, match="positive ints"):
        burstcu.Sharding(group, lengths=[0])
    with pytest.raises(ValueError, match="add up"):
        burstcu.Sharding(group, cu_seqlens=[0, 3, 9], lengths=[8])
    with pytest.raises(TypeError, match="burstcu group"):
        burstcu.Sharding("contiguous")


def test_plan_takes_a_sharding_and_packed_shapes():
    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag", cu_seqlens=[0, 30, 64])
    by_sharding = burstcu.plan((64, 4, 16), (64, 2, 16), sh, causal=True)
    by_keywords = burstcu.plan((1, 64, 4, 16), (1, 64, 2, 16), group, causal=True, layout="zigzag",
                               cu_seqlens=[0, 30, 64])
    assert [(c.label, c.forward_s) for c in by_sharding.candidates] == \
        [(c.label, c.forward_s) for c in by_keywords.candidates]
    for given in (dict(layout="contiguous"), dict(cu_seqlens=[0, 64]), dict(cu_seqlens="x")):
        with pytest.raises(ValueError, match="only through it"):
            burstcu.plan((64, 4, 16), (64, 2, 16), sh, **given)
    assert burstcu.plan((64, 4, 16), (64, 2, 16), sh, cu_seqlens=[0, 30, 30, 64]).strategy
    assert hash(sh) == hash(sh) and sh != burstcu.Sharding(group, layout="zigzag", cu_seqlens=[0, 30, 64])


def test_packed_inputs_on_one_process_equal_the_batched_form():
    """(T, H, D) inputs give bitwise the (1, T, H, D) results with the batch axis dropped, lse
    (H, T); the backward too."""
    rng = np.random.default_rng(5)
    q, dout = (rng.standard_normal((40, 4, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((40, 2, 8)).astype(np.float32) for _ in range(2))
    docs = [0, 9, 40]
    out, lse = burstcu.attention(q, k, v, causal=True, cu_seqlens=docs, return_lse=True)
    out4, lse4 = burstcu.attention(q[None], k[None], v[None], causal=True, cu_seqlens=docs,
                                   return_lse=True)
    assert out.shape == (40, 4, 8) and lse.shape == (4, 40)
    assert np.array_equal(out, out4[0]) and np.array_equal(lse, lse4[0])
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, cu_seqlens=docs)
    grads4 = burstcu.attention_backward(dout[None], q[None], k[None], v[None], out4, lse4,
                                        causal=True, cu_seqlens=docs)
    assert [g.shape for g in grads] == [(40, 4, 8), (40, 2, 8), (40, 2, 8)]
    assert all(np.array_equal(a, b[0]) for a, b in zip(grads, grads4))
    with pytest.raises(ValueError, match="q is packed .* k has 4 axes, v has 4 axes"):
        burstcu.attention(q, k[None], v[None])       # packed q beside batched k, v


def test_the_adapters_take_a_sharding():
    """burstcu.torch and burstcu.jax pass a Sharding on as a group: the same outputs as the
    keywords it stands for, and gradients."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, cu_seqlens=[0, 11, 32])
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 32, 2, 8)).astype(np.float32) for _ in range(3))
    want = burstcu.attention(q, k, v, group, causal=True, cu_seqlens=[0, 11, 32])
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = burstcu.torch.attention(tq, tk, tv, sh, causal=True)
    out.sum().backward()
    assert np.array_equal(out.detach().numpy(), want) and tq.grad.shape == tq.shape
    got = burstcu.jax.attention(*(jax.numpy.asarray(x) for x in (q, k, v)), sh, causal=True)
    assert np.array_equal(np.asarray(got), want)
    packed = jax.jit(lambda q, k, v: burstcu.jax.attention(q, k, v, sh, causal=True))(
        *(jax.numpy.asarray(x[0]) for x in (q, k, v)))      # (T, H, D), lse (H, T) inside
    assert np.array_equal(np.asarray(packed), want[0])


def test_decode_and_the_kv_cache_take_a_sharding():
    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group, layout="zigzag")
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 20, 1, 8)).astype(np.float32) for _ in range(2))
    assert np.array_equal(burstcu.decode(q, k, v, sh), burstcu.decode(q, k, v, group))
    cache = burstcu.KVCache(sh, 1, 32, 1, 8, np.float32)
    assert cache.group is group


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (1, 2, 3))
@pytest.mark.mpi
def test_a_sharding_whose_lengths_miss_the_rows_is_refused(world):
    """Lengths that add up to another N than x's rows: an error at any world size (one rank
    accepted them before)."""
    for r in run_mpi(world, "sharding_bodies:lengths_that_miss_the_rows"):
        assert set(r["messages"]) == {"shard", "unshard"}, r["messages"]
        assert f"a sequence of {8 * world} rows, but the Sharding's lengths add up to {8 * world + 1}" \
            in r["messages"]["shard"]
        assert f"the Sharding says {[9] + [8] * (world - 1)}" in r["messages"]["unshard"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (1, 2, 3))
@pytest.mark.mpi
def test_packed_documents_cut_along_axis_1_ask_for_axis_0(world):
    """shard / unshard of packed (T, H, D) arrays with cu_seqlens and the default axis=1 name x's
    rows along axis 1 and where cu_seqlens ends, and tell to pass axis=0 (not the ranks' lengths
    added up, which shard has nothing to do with); a 3-D lse whose axis 0 is not the rows gets
    no such hint."""
    n = 8 * world
    for r in run_mpi(world, "sharding_bodies:packed_documents_along_axis_1"):
        assert set(r["messages"]) == {"shard", "unshard", "shard lse"} and r["joined"]
        lse_message = r["messages"].pop("shard lse")
        assert lse_message == f"x has 4 rows along axis 1 but cu_seqlens ends at {n}", lse_message
        assert r["messages"]["shard"].startswith(f"x has 4 rows along axis 1 but cu_seqlens ends at {n}")
        together = "" if world == 1 else f" (the {world} ranks' shards together)"
        assert r["messages"]["unshard"].startswith(f"x_local{together} has {4 * world} rows along axis 1 "
                                                   f"but cu_seqlens ends at {n}")
        for message in r["messages"].values():
            assert "ranks' local lengths" not in message and "packed (T, H, D)" in message
            assert "pass axis=0" in message


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", (1, 2, 3))
@pytest.mark.mpi
def test_unshard_joins_cpu_torch_tensors_bit_for_bit(world):
    """CPU torch tensors of every float dtype, bfloat16 included (refused on several ranks
    before), come back from unshard as on one rank: a tensor of their dtype, the global one
    (the three dtypes in one world: each start of one imports torch on every rank)."""
    pytest.importorskip("torch")
    dtypes = ("bfloat16", "float16", "float32")
    for r in run_mpi(world, "sharding_bodies:torch_tensors_unshard", dtypes=dtypes):
        assert sorted(r["joined"]) == sorted(f"{dtype} {layout}" for dtype in dtypes
                                             for layout in ("contiguous", "zigzag"))
        for case, got in r["joined"].items():
            dtype = case.split()[0]
            assert got == ["Tensor", f"torch.{dtype}", [1, 5 * world + 1, 2, 8], True], (case, got)


@pytest.mark.timeout(120)
@pytest.mark.mpi
def test_unshard_of_a_copy_asks_for_the_axis():
    """A copy of an lse, of packed rows (a Sharding without documents or lengths) or of uneven
    hidden states (B, N_local, d) given to Sharding.unshard without an axis used to be joined
    along its batch axis, silently a wrong shape; now a ValueError on every rank asks for the
    axis, and with it (or unshard_lse) the copies join as the float64 reference says. Packed
    copies that are this rank's rows (one row where the Sharding's lengths say so) join without
    one. unshard_lse of the 4-D output (joined along its head dim before) is refused. A
    Sharding with documents asks too where axis 0 and axis 1 both have this rank's rows."""
    for r in run_mpi(2, "sharding_bodies:unshard_of_a_copy_asks_for_the_axis"):
        assert set(r["messages"]) == {"lse copy", "hidden states copy", "on a GPU", "packed copy",
                                      "out as lse", "hidden copy, documents",
                                      "lse copy, documents"}, r["messages"]
        assert "x_local (1, 2, 4) has 1 row there, not this rank's 4: pass axis=" in \
            r["messages"]["lse copy, documents"]
        assert "x_local (4, 4, 3): axis 0 and axis 1 both have this rank's 4 rows: pass axis=" in \
            r["messages"]["hidden copy, documents"]
        assert "x_local is on CUDA device 0 but this group computes on the host" in \
            r["messages"]["on a GPU"], r["messages"]
        for name, shape in (("lse copy", "(1, 4, 8)"), ("packed copy", "(2, 2, 4)")):
            assert f"cannot tell the sequence axis of x_local {shape}: a 3-D array is packed (T, " \
                   f"H, D) (axis=0) or (B, N, ...)" in r["messages"][name], r["messages"][name]
        assert "unshard_lse takes an lse, (B, H, S_local) or packed inputs' (H, T_local), but " \
               "lse_local (1, 8, 4, 8) has 4 dimensions" in r["messages"]["out as lse"]
        # rank 0's (3, 5, 16) gives itself away; rank 1's (3, 3, 16) does not, and raises rank 0's
        assert "(3, 5, 16) has 3 rows there and this rank's 5 along axis 1" in \
            r["messages"]["hidden states copy"]
        assert max(r["errors"].values()) < 1e-5, r["errors"]
        assert r["hidden_shape"] == [3, 8, 16]
        assert r["packed"] == [0, 1, 1, 1] and r["pairs"] == [0, 1, 1, 0]   # zigzag: rank 0 ends


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.mpi
def test_the_global_array_unsharded_and_a_shard_sharded_are_named(world):
    for r in run_mpi(world, "sharding_bodies:global_array_to_unshard_and_a_shard_to_shard"):
        (file, message), = r["global"]["warned"]
        assert file == "sharding_bodies.py" and message.startswith(
            f"every rank's x_local starts and ends with the same rows: if each rank passed the "
            f"global array instead of its shard, this joins {world} copies of the sequence"), r
        assert r["global"]["shape"] == [1, 6 * world * world, 2, 8]
        assert r["strings"]["shape"] == [1, 4 * world, 2]
        for name in ("shards", "zeros", "nan", "strings", "view cut again", "shard kept whole",
                     "one-process result cut"):
            assert r[name]["warned"] == [], (name, r[name])
        assert r["shards"]["shape"] == [1, 6 * world, 2, 8] == r["zeros"]["shape"] == r["nan"]["shape"]
        assert r["view cut again"]["shape"] == [1, 6 // world, 2, 8]
        assert r["shard kept whole"]["shape"] == [1, 6, 2, 8]
        assert r["one-process result cut"]["shape"] == [1, 6, 2, 8]
        assert r["shard of a shard"].startswith(f"shard: x is already one rank's shard of {world} "
                                                f"(burstcu.shard cut it, or a call returned it")


@pytest.mark.parametrize("world", (1, 2))
def test_unshard_takes_what_it_takes_at_any_group_size(world):
    """A torch tensor requiring grad (burstcu.torch.attention's output) and float8 torch and JAX
    arrays were joined on one rank and refused on several (a program passing its tests on one
    process failed on more): each is joined at any size now, bit for bit, a torch result
    without autograd history on every size."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    from burstcu.testing.world import run_ranks

    whole = torch.randn(1, 4 * world + 1, 2, 8, generator=torch.Generator().manual_seed(0))

    def body(group):
        sharding = burstcu.Sharding(group, layout="zigzag")
        q = sharding.shard(whole).requires_grad_()
        out = burstcu.torch.attention(q, q, q, sharding, causal=True)
        joined = {"requires grad": sharding.unshard(q), "attention out": sharding.unshard(out),
                  "torch float8": sharding.unshard(sharding.shard(whole.to(torch.float8_e5m2))),
                  "jax float8": sharding.unshard(sharding.shard(
                      jnp.asarray(whole.numpy()).astype(jnp.float8_e4m3fn)))}
        return joined, out
    for joined, _ in run_ranks(world, body):
        assert torch.equal(joined["requires grad"], whole) and not joined["requires grad"].requires_grad
        assert joined["attention out"].shape == whole.shape
        assert not joined["attention out"].requires_grad
        assert joined["torch float8"].dtype == torch.float8_e5m2
        assert torch.equal(joined["torch float8"].view(torch.uint8),
                           whole.to(torch.float8_e5m2).view(torch.uint8))
        assert str(joined["jax float8"].dtype) == "float8_e4m3fn"
        assert np.array_equal(np.asarray(joined["jax float8"]).view(np.uint8),
                              np.asarray(jnp.asarray(whole.numpy()).astype(jnp.float8_e4m3fn)).view(np.uint8))
