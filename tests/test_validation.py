"""Bad input gets a clear ValueError/TypeError on every rank, before any communication that could
hang; and the group keeps working afterwards."""

import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import burstcu
from tests.mpi.bodies import BAD_INPUTS, bad_input_raises_everywhere
from tests.mpi_run import run_mpi


@pytest.mark.parametrize("kind", [k for k, (who, _, _) in BAD_INPUTS.items() if who == "all"])
def test_bad_input_one_process(kind):
    pytest.importorskip("mpi4py")
    result = bad_input_raises_everywhere(kind)
    assert result["raised"] is not None


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_every_rank(world):
    results = run_mpi(world, "every_bad_input_raises_everywhere", timeout=120)
    for rank, per_kind in enumerate(results):
        for kind, (who, err_type, text) in BAD_INPUTS.items():
            raised = per_kind[kind]["raised"]
            if who == "none":
                assert raised is None, (rank, kind, raised)
                continue
            assert raised is not None, f"rank {rank} did not raise for {kind}"
            assert raised[0] == err_type, (rank, kind, raised)
            # every rank names the problem; where one rank had it, in the same words (that rank's
            # own too: it used to drop the "rank N: " its peers put first)
            assert text in raised[1], (rank, kind, raised)
            assert who == "all" or raised == results[0][kind]["raised"], (rank, kind, raised)


def test_messages_are_specific():
    q = np.zeros((1, 8, 6, 16), np.float32)
    k = np.zeros((1, 8, 4, 16), np.float32)
    with pytest.raises(ValueError, match="q has 6 heads, k has 4: nheads must be a multiple of nheads_kv"):
        burstcu.attention(q, k, k)
    with pytest.raises(TypeError, match="int64"):
        burstcu.attention(q.astype(np.int64), k.astype(np.int64), k.astype(np.int64))
    q3 = np.random.default_rng(0).standard_normal((1, 7, 2, 16)).astype(np.float32)
    np.testing.assert_allclose(burstcu.linear_attention(q3, q3, q3, layout="zigzag", causal=True),
                               burstcu.linear_attention(q3, q3, q3, causal=True), rtol=1e-5)
    with pytest.raises(ValueError, match="window_size left must be an int from -1"):
        burstcu.attention(q[:, :, :4], k, k, causal=True, window_size=(2**64, 0))
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D with at least 2 boundaries"):
        burstcu.attention(q[:, :, :4], k, k, cu_seqlens=[])
    with pytest.raises(ValueError, match="strategy must be one of"):
        burstcu.attention(q[:, :, :4], k, k, strategy="psychic")
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        burstcu.attention(q[:, :, :4], k, k, softmax_scale=float("nan"))
    for flag in (True, np.True_):   # a bool is no scale (it read "must be a finite number")
        with pytest.raises(TypeError, match="softmax_scale must be a number, not a bool"):
            burstcu.attention(q[:, :, :4], k, k, softmax_scale=flag)
    for layout in ("zigzag", "documents"):   # uneven describes contiguous shards: not ignored
        for call in (lambda: burstcu.attention(q[:, :, :4], k, k, layout=layout, uneven=True),
                     lambda: burstcu.unshard(q, None, layout=layout, uneven=True)):
            with pytest.raises(ValueError, match=f"uneven=True describes contiguous shards of other "
                                                 f"lengths; layout='{layout}' cuts its own shards"):
                call()


def test_init_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        burstcu.init(backend="tpu")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.mpi
def test_shards_in_sdpa_order_are_named_on_every_rank(world):
    """(batch, heads, seqlen, headdim) shards: a warning at the caller's line where nothing else
    tells the orders apart (512 heads, 4 rows a rank), the GQA length error and decode's shape
    error say transpose(1, 2); the same rows in burstcu's order stay quiet (more heads than rows
    but fewer than MANY_HEADS, or many heads that are meant: the unit test below)."""
    for rank, r in enumerate(run_mpi(world, "sdpa_order_on_every_rank", timeout=120)):
        assert r["warned"] == 1 and r["line_ok"], (rank, r)
        assert "q has 512 heads and its ranks at most 4 rows" in r["message"], (rank, r)
        assert "transpose(1, 2)" in r["message"] and "burstcu.HeadsAxisWarning" in r["message"], (rank, r)
        assert "lengths must match" in r["gqa_error"] and "transpose(1, 2)" in r["gqa_error"], (rank, r)
        assert r["meant_warned"] == 0 and r["linear_warned"] == 1, (rank, r)
        assert "does not fit the cache" in r["decode_error"], (rank, r)
        assert "q.transpose(1, 2)" in r["decode_error"], (rank, r)


def test_the_heads_warning_needs_many_heads_and_more_heads_than_rows():
    from burstcu.validate import MANY_HEADS, warn_if_heads_look_like_rows
    for heads, lengths, warns in [(MANY_HEADS, [MANY_HEADS - 1, 3], True),
                                  (MANY_HEADS, [MANY_HEADS, 3], False),      # a rank has as many rows
                                  (MANY_HEADS - 1, [4, 4], False), (4096, [32, 32], True)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_if_heads_look_like_rows(heads, lengths)
        assert [w.category for w in caught] == [burstcu.HeadsAxisWarning] * warns, (heads, lengths)


def test_hidden_states_given_as_packed_rows_are_warned_of():
    """(batch, seqlen, d_model) hidden states passed as q, k, v read as packed (T, H, D): the
    batch items as rows, each position a head, attending across the batch without a word (with
    fewer than 512 positions a rank); a packed q with more heads than rows on all ranks together
    is now warned of, naming hidden states, and a real packed sequence is not."""
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, 64, 32)).astype(np.float32)     # batch 2, 64 positions
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        burstcu.attention(hidden, hidden, hidden, causal=True)
    assert [w.category for w in caught] == [burstcu.HeadsAxisWarning], caught
    assert "hidden states (batch, seqlen, d_model)" in str(caught[0].message)
    assert caught[0].filename == __file__                       # points at the caller's line
    packed = rng.standard_normal((64, 4, 32)).astype(np.float32)   # 64 rows, 4 heads
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        burstcu.attention(packed, packed, packed, cu_seqlens=[0, 40, 64])
        burstcu.attention(packed[:4], packed[:4], packed[:4])        # 4 rows, 4 heads: as many
    assert caught == []


def test_kv_cache_rows_in_sdpa_order_are_named():
    cache = burstcu.KVCache(None, 1, 32, 2, 8, np.float32)
    rows = np.zeros((1, 2, 5, 8), np.float32)     # (batch, kv_heads, rows, headdim)
    with pytest.raises(ValueError, match=r"k\.transpose\(1, 2\), v\.transpose\(1, 2\)"):
        cache.append(rows, rows)
    for wrong in [(1, 5, 3, 8), (1, 2, 5, 4)]:      # kv heads wrong; head dim wrong: no hint
        with pytest.raises(ValueError, match=re.escape(f"got {wrong} and {wrong}") + "$"):
            cache.append(np.zeros(wrong), np.zeros(wrong))


def test_empty_axes_get_their_own_errors_not_the_swapped_axes_hint():
    q, k = np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 0, 2, 8), np.float32)
    with pytest.raises(ValueError, match="k and v have 0: lengths must match$"):
        burstcu.attention(q, k, k)
    with pytest.raises(ValueError, match=r"q \(1, 0, 2, 8\) holds no rows"):
        burstcu.attention(k, k, k)
    with pytest.raises(ValueError, match="empty dimension"):   # no head dim: not a row matter
        burstcu.attention(*(np.zeros((1, 0, 2, 0), np.float32),) * 3)
    with pytest.raises(ValueError, match="does not fit the cache .*of Hkv$"):
        burstcu.decode(np.zeros((1, 1, 4, 8), np.float32), *(np.zeros((1, 16, 0, 8), np.float32),) * 2)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.mpi
def test_a_call_one_rank_makes_alone_is_named_on_every_rank(world):
    """Rank 0's evaluation paired with the others' training step (same shapes, so nothing else
    tells): a CallSiteWarning on every rank, at the caller's line, naming where rank 0 and a
    peer made the call; none for the same call from one place, nor for calls that meet inside
    burstcu.ordered_by below a wrapper only rank 0 has; none in a world of one."""
    for rank, r in enumerate(run_mpi(world, "calls_from_different_places", timeout=120)):
        if world == 1:
            assert r["one_rank_alone"] == [], r
        else:
            (category, file, message), = r["one_rank_alone"]
            assert category == "CallSiteWarning" and file == "bodies.py", (rank, r)
            places = re.search(r"rank 0 from bodies\.py:(\d+) in evaluate; rank 1 from "
                               r"bodies\.py:(\d+) in train_step\. ", message)
            assert places, (rank, message)
            source = (Path(__file__).parent / "mpi" / "bodies.py").read_text().splitlines()
            assert all("burstcu.attention(q, k, v, group)" in source[int(n) - 1] for n in places.groups())
            assert "burstcu.ordered_by(label)" in message and "CallSiteWarning" in message, message
        assert r["same_place"] == [] and r["wrapped_inside_ordered_by"] == [], (rank, r)


def test_an_unshard_made_from_different_places_is_named_on_every_rank():
    """unshard compares the ranks' places too (ranks as threads: one CallSiteWarning each)."""
    from burstcu.testing.world import run_ranks

    def body(group):
        x = np.arange(8.0).reshape(1, 8, 1, 1)[:, 4 * group.rank:4 * group.rank + 4]
        rounds, agree = [], group.transport.allgather_object
        group.transport.allgather_object = lambda obj, what: rounds.append(what) or agree(obj, what)
        for _ in range(3):   # the same difference again: the places are gathered once
            if group.rank == 0:
                burstcu.unshard(x, group)   # rank 0 alone: logging, say
            else:
                burstcu.unshard(x, group)
        return rounds

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rounds = run_ranks(2, body)
    assert rounds == [["unshard", "unshard (the places it was called from)", "unshard", "unshard"]] * 2, \
        rounds
    said = [str(w.message) for w in caught if w.category is burstcu.CallSiteWarning]
    assert len(said) == 6 and len(set(said)) == 1, said
    assert re.match(r"the ranks made this unshard call from different places in the program: "
                    r"rank 0 from test_validation\.py:\d+ in body; rank 1 from "
                    r"test_validation\.py:\d+ in body\. ", said[0]), said[0]


def test_a_call_site_warning_made_an_error_is_raised_on_every_rank():
    """With the warning an error (`-W error`), every rank raises it from the call, catchable,
    and the group goes on: it is not one rank's failure that ends the world."""
    from burstcu.testing.world import run_ranks

    def body(group):
        q = np.random.default_rng(group.rank).standard_normal((1, 8, 1, 8))
        try:
            if group.rank == 0:
                burstcu.attention(q, q, q, group)
            else:
                burstcu.attention(q, q, q, group)
        except burstcu.CallSiteWarning as exc:
            caught = str(exc)
        return caught[:40], burstcu.attention(q, q, q, group).shape

    with warnings.catch_warnings():
        warnings.simplefilter("error", burstcu.CallSiteWarning)
        results = run_ranks(2, body)
    assert results == [("the ranks made this attention call from ", (1, 8, 1, 8))] * 2, results


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.mpi
def test_the_global_array_on_every_rank(world):
    """The warning points at the user's line and names its category, on every rank; with
    documents that cover one copy of the rows it is an error on every rank. Decode over the
    same cache rows on every rank, a KV cache prefilled with them, and linear attention (forward
    and backward) warn alike."""
    for rank, r in enumerate(run_mpi(world, "global_array_on_every_rank", timeout=120)):
        assert r["warned"] == 1 and r["file"] == "bodies.py" and r["line_ok"], (rank, r)
        assert f"{world} copies of the sequence" in r["message"], (rank, r)
        assert "burstcu.SameShardsWarning" in r["message"], (rank, r)
        assert r["docs_error"] and "each holds the whole sequence" in r["docs_error"], (rank, r)
        assert r["backward_warned"] == 0, (rank, r)   # q differs between ranks: no warning
        assert r["padded_warned"] == 0, (rank, r)     # shards that only begin alike
        for name, array in (("decode", "k_cache"), ("prefill", "k_local"),   # decode's caches too
                            ("decode_one_row", "k_cache"), ("one_row", "q"),  # one row alike
                            ("linear", "q"), ("linear_backward", "q")):      # and linear attention
            (file, message), = r[f"{name}_warned"]
            assert file == "bodies.py" and f"every rank's {array} starts and ends" in message, (rank, r)
        for name in ("decode_own_rows", "decode_empty", "appended", "linear_own_rows", "nan_rows",
                     "linear_nan_rows", "one_row_zeros"):
            assert r[f"{name}_warned"] == [], (rank, name, r)



def test_odd_arguments_get_messages_not_internal_errors():
    """What a user passes by mistake is named: a list to shard or unshard, a name of no machine or a
    causal that is not a bool to plan, a communicator or a string as the group, an array as the
    softmax scale (its message blamed the value); and what is
    valid is taken: a NumPy int softmax scale in decode as in attention, an lse flattened in
    place to (B*H, S) for unshard, a shard reshaped in place for a call without positions."""
    from mpi4py import MPI

    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 8, 2, 4)).astype(np.float32)
    with pytest.raises(TypeError, match="shard takes an array .* not a list"):
        burstcu.shard(x.tolist(), None)
    for group in (None, burstcu.init(backend="numpy")):
        with pytest.raises(TypeError, match=r"unshard takes an array .* as x_local, not a list"):
            burstcu.unshard(x.tolist(), group)
    with pytest.raises(TypeError, match="group must be a burstcu group"):
        burstcu.shard(x, "world")
    with pytest.raises(ValueError, match="machine must be a Machine or one of"):
        burstcu.plan(x.shape, x.shape, machine="H100")
    with pytest.raises(TypeError, match="causal must be True or False"):
        burstcu.plan(x.shape, x.shape, causal="no")
    for bad in (MPI.COMM_WORLD, "world", 3):
        with pytest.raises(TypeError, match="group must be a burstcu group from burstcu.init"):
            burstcu.attention(x, x, x, bad)
        with pytest.raises(TypeError, match="group must be a burstcu group from burstcu.init"):
            burstcu.KVCache(bad, 1, 4, 2, 4, np.float32)
        with pytest.raises(TypeError, match="group must be a burstcu group from burstcu.init"):
            burstcu.decode(x[:, :1], x, x, bad)
    with pytest.raises(TypeError, match="make the group of its ranks with burstcu.init"):
        burstcu.unshard(x, MPI.COMM_WORLD)
    with pytest.raises(TypeError, match="plan: group must be a burstcu group"):
        burstcu.plan(x.shape, x.shape, "world")
    with pytest.raises(TypeError, match="softmax_scale must be a Python or NumPy number .* ndarray"):
        burstcu.attention(x, x, x, softmax_scale=np.array(0.3))   # (a 0-d tensor alike)
    cache = burstcu.KVCache(None, 1, 4, 2, 4, np.float32)
    cache.append(x[:, :2], x[:, 2:4])
    q = x[:, :1]
    assert np.array_equal(burstcu.decode(q, cache, softmax_scale=np.int64(1)),
                          burstcu.decode(q, cache, softmax_scale=1.0))
    group = burstcu.init(backend="numpy")
    sh = burstcu.Sharding(group)
    out, lse = burstcu.attention(x, x, x, sh, causal=True, return_lse=True)
    flat = lse.copy()
    flat.shape = (2, 8)                       # (B*H, S), in place
    assert np.array_equal(sh.unshard_lse(flat), lse.reshape(2, 8))
    q_flat = sh.shard(x)
    q_flat.shape = (8, 8)                     # 2-D now: refused for its shape, not an IndexError
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        burstcu.linear_attention(q_flat, x, x, group)


def test_batches_past_the_cuda_grids_are_refused_before_any_launch():
    """The CUDA kernels' grids hold B in z and the heads in y (at most 65535 each): attention
    and decode on the kernel backends refuse more with ValueError before anything runs, where
    the NumPy op takes them."""
    from burstcu.group import local_group

    kernels = local_group("emulated")
    q = np.zeros((65536, 1, 1, 8), np.float16)
    with pytest.raises(ValueError, match=r"batch 65536: the CUDA kernels take at most 65535 batch "
                                         r"rows and heads a call"):
        burstcu.attention(q, q, q, kernels)
    with pytest.raises(ValueError, match=r"batch 65536: the CUDA decode kernels take at most 65535"):
        burstcu.decode(q, q, q, kernels)
    assert burstcu.decode(q, q, q).shape == (65536, 1, 1, 8)     # the NumPy op's group of one


@pytest.mark.parametrize("lengths,hinted", [((512, 1024), True), ((256, 1024, 256, 257), True),
                                            ((27, 12, 9), False), ((5, 20, 23), False),
                                            ((1, 3), True), ((400, 400, 100, 100), True),
                                            ((400, 399, 100, 100), False)])
def test_the_global_array_hint_fits_the_lengths(lengths, hinted):
    """Contiguous shards too far apart in length: the refusal asks whether a rank passed the
    global array only where the lengths look so (one rank's about G times every other's, as
    shard cuts them); shards a block mask balanced, or hand-cut ones, are not blamed on it."""
    from burstcu.validate import partition_of

    err, _ = partition_of("contiguous", lengths, None, uneven=False)
    assert "differ by more than one row" in err.message and "uneven=True" in err.message
    assert bool(re.search("did (it|they) pass the global array", err.message)) == hinted, err.message
