"""burstcu.plan (strategy="auto"): the candidates it considers, the rule it picks by, and that
"auto" runs what it picked, on every rank alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import burstcu
from burstcu.plan import MACHINES, Machine, candidates, plan, predict
from tests.mpi_run import run_mpi


class _Group:
    def __init__(self, size, backend="numpy"):
        self.size = size
        self.ops = type("Ops", (), {"backend": backend})()


def test_candidates_are_what_can_take_the_shapes():
    names = [c[0] for c in candidates((1, 64, 8, 16), (1, 64, 8, 16), 4)]
    assert names[:3] == ["burst", "ring", "allgather"] and "ulysses" in names
    assert ("usp", {"ulysses_degree": 2}) in candidates((1, 64, 8, 16), (1, 64, 8, 16), 4)
    # 6 heads do not split over 4 ranks: no ulysses; usp only with u = 2
    six = candidates((1, 64, 6, 16), (1, 64, 6, 16), 4)
    assert "ulysses" not in [c[0] for c in six] and ("usp", {"ulysses_degree": 2}) in six
    assert candidates((1, 64, 8, 16), (1, 64, 8, 16), 1) == [("burst", {}), ("ring", {}), ("allgather", {})]


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("size,shape", [(4, (1, 256, 8, 64, 8)), (8, (2, 4096, 32, 128, 8)),
                                        (16, (1, 16384, 32, 128, 4)), (2, (1, 64, 2, 32, 1))])
@pytest.mark.parametrize("backward", [True, False])
def test_the_choice_is_the_smallest_predicted_time(machine, size, shape, backward):
    b, s, h, d, hkv = shape
    p = plan((b, s, h, d), (b, s, hkv, d), _Group(size), causal=True, layout="zigzag",
             machine=machine, backward=backward)
    total = [c.forward_s + (c.backward_s if backward else 0.0) for c in p.candidates]
    assert total == sorted(total) and p.choice is p.candidates[0]
    assert {c.strategy for c in p.candidates} >= {"burst", "ring", "allgather"}
    text = str(p)
    assert text.startswith("PREDICTION") and f"choice: {p.choice.label}" in text


def test_the_model_moves_the_way_it_should():
    """Slow links favour the strategy that sends least; free links and no overhead make the
    balanced ring and Ulysses equal in compute, and ties go to burst."""
    q, k = (1, 1024, 16, 64), (1, 1024, 16, 64)
    slow = Machine("slow", 1e15, 1e6, 1e6, 0.0, 64, "test")
    p = plan(q, k, _Group(8), causal=True, layout="zigzag", machine=slow)
    sent = {c.label: c.forward_bytes + c.backward_bytes for c in p.candidates}
    assert sent[p.choice.label] == min(sent.values())
    free = Machine("free", 1e12, 1e18, 1e18, 0.0, 64, "test")
    burst = predict("burst", {}, q, k, 8, causal=False, layout="zigzag", dtype="float16", machine=free)
    ring = predict("ring", {}, q, k, 8, causal=False, layout="zigzag", dtype="float16", machine=free)
    assert burst.forward_s == pytest.approx(ring.forward_s)
    assert plan(q, k, _Group(8), causal=False, machine=free).strategy == "burst"
    # contiguous causal: the last rank works every step, zigzag halves it
    contiguous = predict("burst", {}, q, k, 8, causal=True, layout="contiguous", dtype="float16", machine=free)
    zigzag = predict("burst", {}, q, k, 8, causal=True, layout="zigzag", dtype="float16", machine=free)
    assert contiguous.forward_s > 1.8 * zigzag.forward_s
    with_overhead = dataclasses.replace(free, step_overhead=1.0)
    assert predict("ulysses", {}, q, k, 8, causal=True, layout="zigzag", dtype="float16",
                   machine=with_overhead).forward_s < 2.0          # one local call, not eight


def test_on_links_that_bound_everything_time_is_bytes_over_bandwidth():
    """Free compute, no latency, every rank sending alike (non-causal, equal shards): each
    strategy's predicted seconds are the bytes it sends over the link's bandwidth (a message the
    timing left out, or counted without its bytes, breaks it), and the choice is the candidate
    that sends fewest bytes (usp over 4-way head groups here: 4 query heads, 2 kv heads, 8 ranks)."""
    q, k = (1, 4096, 4, 128), (1, 4096, 2, 128)
    wire = Machine("wire", 1e18, 1e9, 1e9, 0.0, 64, "test")
    for strategy in ("burst", "ring", "allgather"):
        c = predict(strategy, {}, q, k, 8, causal=False, layout="zigzag", dtype="float16", machine=wire)
        assert c.forward_s == pytest.approx(c.forward_bytes / 1e9, rel=1e-4), strategy
        assert c.backward_s == pytest.approx(c.backward_bytes / 1e9, rel=1e-4), strategy
    p = plan(q, k, _Group(8), causal=False, layout="zigzag", machine=wire)
    sent = {c.label: c.forward_bytes + c.backward_bytes for c in p.candidates}
    assert p.choice.label == "usp ulysses_degree=4" == min(sent, key=sent.get)


def test_auto_refuses_a_degree():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 2, 8))
    with pytest.raises(ValueError, match="ulysses_degree is an option of strategy='usp'"):
        burstcu.attention(q, q, q, strategy="auto", ulysses_degree=2)


def test_auto_in_one_process():
    """One rank: "auto" runs plan's choice, bit for bit as that strategy named."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 32, 2, 8)) for _ in range(4))
    choice = plan(q.shape, k.shape, None, causal=True, dtype=q.dtype)
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True, strategy="auto")
    out2, lse2 = burstcu.attention(q, k, v, causal=True, return_lse=True, strategy=choice.strategy)
    assert np.array_equal(out, out2) and np.array_equal(lse, lse2)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, strategy="auto")
    grads2 = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, strategy=choice.strategy)
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads2))


@pytest.mark.mpi
@pytest.mark.parametrize("world,h,hkv", [(2, 8, 2), (4, 8, 2), (3, 6, 6)])
def test_auto_runs_the_planned_strategy(world, h, hkv):
    results = run_mpi(world, "strategy_bodies:auto_runs_the_planned_strategy", h=h, hkv=hkv)
    assert len({r["choice"] for r in results}) == 1


def test_the_mask_is_counted_per_rank_and_step():
    """Windows, documents and uneven shards change what the model predicts, the way they change
    what runs: a narrow window or documents inside shards cost a fraction of plain causal and
    send nothing burst can skip; many short documents cost a call each."""
    from burstcu.layout import partition

    q = k = (1, 1024, 8, 64)
    free = Machine("free", 1e12, 1e18, 1e18, 0.0, 64, "test")
    slow = Machine("slow", 1e15, 1e6, 1e6, 0.0, 64, "test")
    kw = dict(causal=True, layout="contiguous", dtype="float16")
    plain = predict("burst", {}, q, k, 4, machine=free, **kw)
    narrow = predict("burst", {}, q, k, 4, machine=free, window_size=(64, 0), **kw)
    assert narrow.forward_s < 0.1 * plain.forward_s
    inside = tuple(range(0, 4097, 1024))                       # one document a shard
    alone = predict("burst", {}, q, k, 4, machine=slow, cu_seqlens=inside, **kw)
    assert alone.forward_bytes == alone.backward_bytes == 0
    assert alone.forward_s < predict("burst", {}, q, k, 4, machine=slow, **kw).forward_s / 100
    with_calls = dataclasses.replace(free, step_overhead=1e-3)
    short = tuple(range(0, 4097, 16))                          # 256 documents of 16 rows
    few = predict("burst", {}, q, k, 4, machine=with_calls, cu_seqlens=inside, **kw)
    many = predict("burst", {}, q, k, 4, machine=with_calls, cu_seqlens=short, **kw)
    assert many.forward_s >= 64 * 1e-3 > 30 * (few.forward_s - 1e-3)   # 64 calls a shard, not one
    # a machine whose kernels take a step's rectangles in one call (the list kernels): one call
    # a step (burst's causal contiguous step here: one step of 64 rectangles) both ways
    listed = dataclasses.replace(with_calls, step_lists=True)
    lists = predict("burst", {}, q, k, 4, machine=listed, cu_seqlens=short, **kw)
    assert lists.forward_s < 2e-3 and lists.backward_s < 2e-3 < many.backward_s / 30
    assert MACHINES["h100"].step_lists and not MACHINES["cpu"].step_lists
    from burstcu.ops.cuda.kernel_ops import SM90_MAX_RECTS
    from burstcu.plan import LISTED_ABOVE
    assert LISTED_ABOVE == SM90_MAX_RECTS   # the model counts what the GPU backend launches
    few_docs = tuple(range(0, 4097, 256))                      # 4 documents a shard: 4 calls
    four = predict("burst", {}, q, k, 4, machine=listed, cu_seqlens=few_docs, **kw)
    assert four.forward_s >= 4 * 1e-3
    # uneven shards: the longest shard's rank sets the pace
    part = partition("contiguous", 4, 4096, lengths=(256, 256, 256, 3328))
    uneven = predict("burst", {}, q, k, 4, machine=free, causal=False, layout=part, dtype="float16")
    even = predict("burst", {}, q, k, 4, machine=free, causal=False, layout="contiguous", dtype="float16")
    assert uneven.forward_s > 2 * even.forward_s


def test_every_rank_picks_alike_with_uneven_shards_and_documents():
    from burstcu.layout import partition

    part = partition("contiguous", 4, 1000, lengths=(100, 400, 250, 250))
    docs = (0, 90, 500, 777, 1000)
    choices = set()
    for rank in range(4):
        group = _Group(4)
        group.rank = rank
        p = plan((1, 250, 8, 64), (1, 250, 8, 64), group, causal=True, layout=part,
                 cu_seqlens=docs, machine="h100")
        choices.add((p.strategy, tuple(sorted(p.options.items())),
                     tuple((c.label, c.forward_s, c.backward_s) for c in p.candidates)))
    assert len(choices) == 1


def _ranks_plan(size: int, lengths, **kw) -> list:
    """plan on each rank r of a `size`-rank _Group, its q and k holding lengths[r] rows, as
    (strategy, options, the candidates' predictions), or the ValueError's text."""
    out = []
    for rank in range(size):
        group = _Group(size)
        group.rank = rank
        shape = (1, lengths[rank], 4, 64)
        try:
            p = plan(shape, shape, group, dtype="float32", machine="h100", **kw)
            out.append((p.strategy, tuple(sorted(p.options.items())),
                        tuple((c.label, c.forward_s, c.backward_s) for c in p.candidates)))
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_near_equal_shards_of_an_n_the_ranks_do_not_divide(layout):
    """N = 200 over 3 ranks (67, 67, 66 rows): a block mask over all 200 positions is planned on
    every rank (the rank of 66 rows models the mask's extent), and alike on every rank given
    seqlen=200, or documents ending at 200; a seqlen that does not give a rank its rows is
    refused, naming both, and one that is not an int on every rank."""
    from burstcu.layout import partition

    lengths = partition(layout, 3, 200).lengths
    assert sorted(lengths) == [66, 67, 67]
    mask = burstcu.BlockMask([[0, 200]], [[0, 200]], ["causal"])
    results = _ranks_plan(3, lengths, layout=layout, block_mask=mask)
    assert all(not isinstance(r, str) for r in results), results
    alike = [{"block_mask": mask, "seqlen": 200}, {"causal": True, "seqlen": 200}]
    if layout == "contiguous":    # (zigzag's documents are cut per document: another split)
        alike.append({"causal": True, "cu_seqlens": (0, 90, 200)})
    for kw in alike:
        results = _ranks_plan(3, lengths, layout=layout, **kw)
        assert all(not isinstance(r, str) for r in results), results
        assert len(set(results)) == 1, kw
    wrong = _ranks_plan(3, lengths, layout=layout, causal=True, seqlen=201)
    assert any("seqlen=201" in r and "rows, but q has" in r for r in wrong if isinstance(r, str)), wrong
    docs = _ranks_plan(3, lengths, layout=layout, causal=True, seqlen=201, cu_seqlens=(0, 90, 200))
    assert all(isinstance(r, str) and "cu_seqlens ends at 200" in r for r in docs), docs
    with pytest.raises(TypeError, match="seqlen must be an int"):
        plan((1, 67, 4, 64), (1, 67, 4, 64), _Group(3), machine="h100", seqlen=200.0)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_equal_shards_and_a_mask_short_of_the_end_plan_alike(layout):
    """S = 100 on 3 ranks (N = 300 divides), masks that stop short of the last positions: every
    rank models the same 300 positions and picks alike."""
    for stop in (299, 298, 290, 200):
        mask = burstcu.BlockMask([[0, stop]], [[0, stop]], ["full"])
        results = _ranks_plan(3, (100, 100, 100), layout=layout, block_mask=mask)
        assert all(not isinstance(r, str) for r in results) and len(set(results)) == 1, stop


def test_zigzag_shards_of_an_odd_length_are_planned():
    """Zigzag gives every rank an odd S where N = G S is odd a piece (N = 202 over 2 ranks: 101
    each): plan models that split, as attention runs it."""
    results = _ranks_plan(2, (101, 101), layout="zigzag", causal=True)
    assert all(not isinstance(r, str) for r in results) and len(set(results)) == 1, results


def test_burst_both_ways_is_offered_only_where_it_is_predicted_faster():
    """A non-causal window of half a shard on 3 ranks: the neighbour behind is one hop back, not
    two forwards, and the model predicts burst with its K/V both ways round (bidirectional=True)
    faster than one way, so it is among the candidates (and `auto` may pick it); without a mask
    both cost the same on one port and on 2 ranks the two ways are one, so it is not offered."""
    s = 512
    q, k = (1, s, 16, 128), (1, s, 4, 128)
    labels = lambda p: [(c.strategy, c.options) for c in p.candidates]   # noqa: E731
    kw = dict(layout="contiguous", dtype="float32", backward=False, machine="cpu")
    window = plan(q, k, _Group(3), window_size=(s // 2, s // 2), **kw)
    both = [c for c in window.candidates if c.options == {"bidirectional": True}]
    assert len(both) == 1 and both[0].strategy == "burst", labels(window)
    one_way = next(c for c in window.candidates if c.strategy == "burst" and not c.options)
    assert both[0].forward_s < one_way.forward_s
    # rank 1's block reaches rank 0 one hop back instead of two forwards through rank 2: the
    # same blocks on the wire (rank 0 sends its own to rank 1 either way), one step fewer
    assert both[0].forward_bytes == one_way.forward_bytes
    for size, window_size in ((3, (-1, -1)), (2, (s // 2, s // 2))):
        p = plan(q, k, _Group(size), window_size=window_size, **kw)
        assert all(c.options != {"bidirectional": True} for c in p.candidates), labels(p)


def test_the_plans_choice_runs_when_passed_back():
    """plan's choice may be burst bidirectional=True, which attention did not take (a TypeError on
    every rank); now `attention(..., strategy=p.strategy, **p.options)` runs it: the reference's
    result, auto's bits, and its own messages (rank 0 sends its block both ways, rank 1 one fewer
    than one way round). The keyword is burst's, and a bool."""
    from burstcu.testing.reference import attention_backward_ref, attention_ref
    from burstcu.testing.world import RankFailed, run_ranks
    rng = np.random.default_rng(0)
    q_all, dout_all = (rng.standard_normal((1, 25, 4, 8)) for _ in range(2))
    k_all, v_all = (rng.standard_normal((1, 25, 2, 8)) for _ in range(2))

    def body(group):
        q, k, v, dout = (burstcu.shard(x, group) for x in (q_all, k_all, v_all, dout_all))
        chosen = burstcu.plan(q.shape, k.shape, group, causal=True, dtype="float64", seqlen=25)
        assert chosen.options == {"bidirectional": True}
        assert f"(bytes rank {group.rank} sends)" in str(chosen)
        out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True,
                                     strategy=chosen.strategy, **chosen.options)
        grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True,
                                           strategy=chosen.strategy, **chosen.options)
        assert np.array_equal(out, burstcu.attention(q, k, v, group, causal=True, strategy="auto"))
        sent = []
        for both in (True, False):
            group.stats.reset()
            burstcu.attention(q, k, v, group, causal=True, bidirectional=both)
            sent.append(group.stats.messages)
        return [burstcu.unshard(x, group) for x in (out, *grads)], sent

    results = run_ranks(3, body)
    want = (attention_ref(q_all, k_all, v_all, True)[0],
            *attention_backward_ref(dout_all, q_all, k_all, v_all, True))
    for got, _ in results:
        for x, ref in zip(got, want):
            np.testing.assert_allclose(x, ref, rtol=1e-10, atol=1e-12)
    assert [sent for _, sent in results] == [[2, 1], [1, 2], [0, 0]]
    for kw, error in (({"strategy": "ring", "bidirectional": True}, "an option of strategy='burst'"),
                      ({"bidirectional": "yes"}, "bidirectional must be True or False")):
        with pytest.raises(RankFailed, match=error):
            run_ranks(2, lambda g, kw=kw: burstcu.attention(
                *(burstcu.shard(x, g) for x in (q_all, k_all, v_all)), g, **kw))


@pytest.mark.parametrize("q_shape,k_shape,said", [
    ((1, 64, 6, 16), (1, 64, 4, 16), "q has 6 heads, k has 4: nheads must be a multiple of nheads_kv"),
    ((1, 64, 4, 16), (1, 32, 4, 16), "differ in batch, length or head dim"),
    ((1, 64, 4, 16), (1, 64, 4, 8), "differ in batch, length or head dim"),
    ((64, 4, 16), (1, 64, 4, 16), "must both be (B, S, H, D) or packed (T, H, D)"),
    ((1, 0, 4, 16), (1, 0, 4, 16), "empty dimension"),
])
def test_plan_refuses_shapes_attention_refuses(q_shape, k_shape, said):
    """What attention would refuse is a ValueError from plan too, not a plan (it chose ulysses
    for 6 query heads over 4 kv heads)."""
    with pytest.raises(ValueError, match=f"plan: .*{said.replace('(', r'[(]').replace(')', r'[)]')}"):
        plan(q_shape, k_shape)


def test_plan_takes_dtype_names_and_refuses_others():
    """An unknown name is a TypeError that names the dtypes, not NumPy's own words; "bfloat16"
    plans as float16 does (a fresh process: tests/test_frictions.py)."""
    for bad in ("fp16", None, "int32", np.complex64):
        with pytest.raises(TypeError, match="plan: dtype must be float16, bfloat16, float32 or float64"):
            plan((1, 64, 4, 16), (1, 64, 4, 16), dtype=bad)
    halves = plan((1, 64, 4, 16), (1, 64, 4, 16), dtype="bfloat16")
    assert [c.forward_s for c in halves.candidates] == \
        [c.forward_s for c in plan((1, 64, 4, 16), (1, 64, 4, 16), dtype="float16").candidates]


@pytest.mark.parametrize("kwargs,said", [
    ({"cu_seqlens": [0, 30, 20, 40]}, "cu_seqlens must not decrease"),
    ({"cu_seqlens": [5, 20, 40]}, "cu_seqlens must start at 0"),
    ({"causal": True, "window_size": (3, 2)}, "right bound is the diagonal"),
    ({"window_size": (-2, 1)}, "window_size left must be an int from -1"),
    ({"window_size": (1, 1, 1)}, r"window_size must be \(left, right\)"),
    ({"layout": "zigzag", "cu_seqlens": [0, 20, 41]}, "gives rank 0 11 rows, but q has 10"),
    # one rank's own ends where the global ones go: no split of 12 over 4 gives a rank 10 rows
    ({"cu_seqlens": [0, 5, 12]}, r"cu_seqlens ends at N = 12, but q has 10 rows on rank 0: no "
                                 r"split of N over 4 ranks gives a rank more than N - 3"),
])
def test_plan_refuses_masks_attention_refuses(kwargs, said):
    """Documents or a window that `attention` refuses: plan refuses them too (on every rank:
    each sees the same arguments), rather than predict a call that cannot run."""
    group = _Group(4)
    group.rank = 0
    shape = (1, 10, 4, 16)
    with pytest.raises(ValueError, match=said):
        plan(shape, shape, group, machine="cpu", **kwargs)


def test_plan_takes_documents_over_shards_attention_takes():
    """Contiguous shards of N in any near-equal order ([20, 21] and [21, 20] of 41), and shards
    whose lengths no near-equal split gives (attention(..., uneven=True) runs them): plan models
    them rather than refuse, the same choice on every rank of the near-equal ones."""
    docs = [0, 7, 41]
    for lengths in ((20, 21), (21, 20), (13, 14, 14), (14, 14, 13)):
        picks = set()
        for rank, s in enumerate(lengths):
            group = _Group(len(lengths))
            group.rank = rank
            shape = (1, s, 4, 16)
            p = plan(shape, shape, group, machine="cpu", causal=True, cu_seqlens=docs)
            picks.add((p.strategy, tuple(sorted(p.options.items()))))
        assert len(picks) == 1, (lengths, picks)
    group = _Group(4)
    group.rank = 0
    plan((1, 10, 4, 16), (1, 10, 4, 16), group, machine="cpu", cu_seqlens=[0, 50, 100])   # uneven


@pytest.mark.parametrize("lengths", [(430, 338, 81, 151), (300, 479, 250, 250)])
def test_each_rank_with_its_own_uneven_shard_predicts_what_auto_does(lengths):
    """Uneven shards, each rank passing its own q: every prediction (Ulysses' and USP's
    all-to-alls at the busiest member's bytes included) depends on the split alone, so every
    rank's plan is the same table, and the one `strategy="auto"` computes from the mean shard."""
    from burstcu.layout import partition

    part = partition("contiguous", 4, sum(lengths), lengths=lengths)
    tables = set()
    for rank, rows in enumerate(lengths + (-(-sum(lengths) // 4),)):   # the last: auto's view
        group = _Group(4)
        group.rank = min(rank, 3)
        shape = (1, rows, 4, 64)
        p = plan(shape, shape, group, causal=True, layout=part, dtype="float32", machine="cpu")
        tables.add((p.strategy, tuple(sorted(p.options.items())),
                    tuple((c.label, c.forward_s, c.backward_s) for c in p.candidates)))
    assert len(tables) == 1
    (_, _, table), = tables
    assert {"ulysses", "usp ulysses_degree=2"} <= {label for label, _, _ in table}


def test_block_mask_balanced_shards_are_told_what_to_pass():
    """The shards `shard(..., block_mask=mask)` cuts, planned with the plain group: a rank whose
    G x S cannot hold the mask is refused saying what plan modelled (it said the ranks held
    fewer positions than they did) and what to pass; given the lengths, every rank makes the
    same table."""
    from burstcu.layout import partition

    mask = burstcu.BlockMask([[0, 50], [50, 100], [50, 100]], [[0, 50], [0, 50], [50, 100]],
                             ["causal", "full", "causal"])
    balanced = mask.balanced_lengths(3, 100)
    assert 3 * min(balanced) < 100                                # a case that can fail
    group = _Group(3)
    group.rank = balanced.index(min(balanced))
    shape = (1, min(balanced), 6, 8)
    with pytest.raises(ValueError, match=rf"plan models the sequence as 3 x this rank's {min(balanced)} "
                                         rf"rows = {3 * min(balanced)} positions .* "
                                         rf"lengths=mask.balanced_lengths\(3, N\)"):
        plan(shape, shape, group, block_mask=mask, machine="cpu")
    with pytest.raises(ValueError, match=r"For zigzag shards of N positions, pass seqlen=N"):
        plan(shape, shape, group, block_mask=mask, layout="zigzag", machine="cpu")
    given = partition("contiguous", 3, 100, lengths=balanced)
    tables = set()
    for rank, rows in enumerate(balanced):
        group = _Group(3)
        group.rank = rank
        p = plan((1, rows, 6, 8), (1, rows, 3, 8), group, block_mask=mask, layout=given,
                 dtype="float64", machine="cpu")
        tables.add(tuple((c.label, c.forward_s, c.backward_s) for c in p.candidates))
    assert len(tables) == 1


def test_ulysses_bytes_are_each_ranks_own_with_uneven_shards():
    """The strategy interface's `rank`: Ulysses' counts take rank r's rows from the split, so
    the model can ask for any rank's (what rank r sends: its rows for the other members' heads,
    and the others' rows of its own heads)."""
    from burstcu.engine import ulysses
    from burstcu.layout import partition
    from burstcu.plan import _Spec

    part = partition("contiguous", 3, 600, lengths=(100, 200, 300))
    q, k = _Spec((2, 100, 6, 8), np.float16), _Spec((2, 100, 3, 8), np.float16)
    for rank, rows in enumerate(part.lengths):
        mine, others = rows, 600 - rows
        # q, k, v rows out for 2 of the 3 members' heads (2 query, 1 kv head each); out and lse
        # back for the others' rows of my 2 heads (out in fp16, lse in fp32)
        assert ulysses.forward_bytes(3, q, k, k, rank=rank, layout=part) == \
            2 * 2 * mine * (2 + 2 * 1) * 8 * 2 + others * 2 * 2 * (4 + 8 * 2)


def test_plan_refuses_a_split_over_another_number_of_ranks():
    from burstcu.layout import partition

    part = partition("contiguous", 2, 64, lengths=(30, 34))
    with pytest.raises(ValueError, match=r"a split over 2 ranks, but the call \(group=None\) has 1"):
        plan((1, 30, 4, 64), (1, 30, 4, 64), None, layout=part)


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_predicted_decode_bytes_follow_the_partials_dtype(itemsize):
    """A decode sends each rank's partial (acc, m, l: D + 2 values a row and head) to the G - 1
    others, in float32, or float64 for a float64 decode (docs/decode.md)."""
    from burstcu.plan import predict_decode

    got = predict_decode(MACHINES["cpu"], 3, 1024, 2, 8, 2, 64, itemsize)["bytes"]
    assert got == 2 * 2 * 1 * 8 * (64 + 2) * (8 if itemsize == 8 else 4)


def test_usp_bytes_are_each_ranks_own_whatever_q_says():
    """USP's counts, like every strategy's, take rank r's rows from the split: q's S (auto
    plans from the mean shard's) does not change what rank r is counted to send."""
    from burstcu import engine
    from burstcu.layout import partition
    from burstcu.plan import _Spec

    usp = engine.get("usp", ulysses_degree=2)
    part = partition("contiguous", 4, 1000, lengths=(430, 338, 81, 151))
    for rank, rows in enumerate(part.lengths):
        own, mean = (_Spec((1, s, 4, 16), np.float32) for s in (rows, 250))
        for count in (usp.forward_bytes, usp.backward_bytes):
            assert count(4, mean, mean, mean, rank=rank, layout=part, causal=True) == \
                count(4, own, own, own, rank=rank, layout=part, causal=True) > 0
