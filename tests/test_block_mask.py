"""Block masks (`burstcu.BlockMask`): rectangles over global positions with MagiAttention's four
kinds. The mask is spelled out densely here from its definition and compared pair by pair with
the kept-pair count, the mask's pieces and every ring step's rectangles over random masks and
partitions; malformed masks and masks given beside causal, windows or documents are refused
(on every rank: tests/mpi/strategy_bodies.py); burst sends nothing a mask does not need.
Every strategy against the float64 reference under mpiexec: tests/test_mask_kinds.py."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

import burstcu
from burstcu.blockmask import KINDS, box_pairs
from burstcu.engine.burst import backward_counts, forward_sends
from burstcu.layout import RECTANGLE, blocks, grouped, partition, rectangles
from burstcu.plan import _work
from burstcu.testing.reference import attention_backward_ref, attention_ref, keep_from_blocks
from burstcu.validate import check_block_mask_extent
from tests.mpi.bodies import _check
from tests.mpi_run import run_mpi


def dense(rects, n: int) -> np.ndarray:
    """(n, n) int: how many rectangles keep each (query, key) pair, from the definition."""
    count = np.zeros((n, n), int)
    for (qs, qe), (ks, ke), kind in rects:
        i = np.arange(qs, qe)[:, None]
        j = np.arange(ks, ke)[None, :]
        keep = np.ones((qe - qs, ke - ks), bool)
        if kind in ("causal", "bidir_causal"):
            keep &= j - ks <= (i - qs) + (ke - ks) - (qe - qs)
        if kind in ("inverse_causal", "bidir_causal"):
            keep &= j - ks >= i - qs
        count[qs:qe, ks:ke] += keep
    return count


def random_rects(rng, n: int, most: int) -> list:
    """Up to `most` random rectangles over n positions that keep no pair twice."""
    rects, taken = [], np.zeros((n, n), int)
    for _ in range(20 * most):
        if len(rects) == most:
            break
        qs, ks = (int(x) for x in rng.integers(0, n, 2))
        qe, ke = int(rng.integers(qs + 1, n + 1)), int(rng.integers(ks + 1, n + 1))
        rect = ((qs, qe), (ks, ke), KINDS[int(rng.integers(4))])
        mine = dense([rect], n)
        if not (mine & taken).any():
            rects.append(rect)
            taken += mine
    return rects


def mask_of(rects) -> burstcu.BlockMask:
    return burstcu.BlockMask([r[0] for r in rects], [r[1] for r in rects], [r[2] for r in rects])


def block_keeps(b) -> np.ndarray:
    """(q_len, k_len) bool: the pairs a `burstcu.layout.Block` keeps, by its documented tests."""
    return keep_from_blocks([b], b.q_start + b.q_len, b.k_start + b.k_len)[b.q_start:, b.k_start:]


def test_the_four_kinds_follow_their_definitions():
    """One square and one wide rectangle of each kind against pairs written out by hand:
    causal keeps the diagonal through the bottom-right corner, inverse_causal the one through
    the top-left corner, bidir_causal both."""
    square = {kind: mask_of([((0, 3), (0, 3), kind)]) for kind in KINDS}
    wide = {kind: mask_of([((0, 2), (0, 4), kind)]) for kind in KINDS}
    # 3 x 3: full 9, causal lower triangle 6, inverse upper 6, bidir the diagonal 3
    assert [square[k].kept_pairs() for k in KINDS] == [9, 6, 6, 3]
    # 2 queries x 4 keys: causal row 0 sees keys 0..2, row 1 all 4; inverse row 0 all 4, row 1
    # keys 1..3; bidir row 0 keys 0..2, row 1 keys 1..3
    assert [wide[k].kept_pairs() for k in KINDS] == [8, 7, 7, 6]
    assert mask_of([((0, 4), (0, 2), "causal")]).kept_pairs() == 3   # tall: rows 2, 3 see 1, 2


def test_kept_pairs_and_box_counts_match_the_dense_mask():
    """kept_pairs, and the keys of every row (row_pairs), against the dense mask."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        rects = random_rects(rng, n, int(rng.integers(1, 6)))
        mask = mask_of(rects)
        assert mask.kept_pairs() == dense(rects, n).sum()
        extra = int(rng.integers(0, 5))    # rows past the mask see nothing
        assert (mask.row_pairs(n + extra) == np.pad(dense(rects, n).sum(1), (0, extra))).all()
    for _ in range(500):   # any box and offset band
        q0, k0 = (int(x) for x in rng.integers(0, 20, 2))
        q1, k1 = q0 + int(rng.integers(0, 12)), k0 + int(rng.integers(0, 12))
        lower, upper = sorted(int(x) for x in rng.integers(-25, 25, 2))
        i, j = np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :]
        assert box_pairs(q0, q1, k0, k1, lower, upper) == ((j - i >= lower) & (j - i <= upper)).sum()


def test_pieces_cover_the_mask_with_aligned_ranges():
    """`BlockMask.pieces` keep exactly the mask's pairs, and any two of them have equal or
    disjoint query ranges, and equal or disjoint key ranges (what the list kernels group by)."""
    rng = np.random.default_rng(5)
    for _ in range(100):
        n = int(rng.integers(2, 40))
        rects = random_rects(rng, n, int(rng.integers(1, 7)))
        pieces = mask_of(rects).pieces
        got = np.zeros((n, n), int)
        for p in pieces:
            i = np.arange(p["q_start"], p["q_stop"])[:, None]
            j = np.arange(p["k_start"], p["k_stop"])[None, :]
            keep = (j - i >= p["lower"]) & (j - i <= p["upper"])
            assert keep.any()
            got[p["q_start"]:p["q_stop"], p["k_start"]:p["k_stop"]] += keep
        assert (got == dense(rects, n)).all()
        for lo, hi in (("q_start", "q_stop"), ("k_start", "k_stop")):
            ranges = set(zip(pieces[lo].tolist(), pieces[hi].tolist()))
            for a in ranges:
                for b in ranges:
                    assert a == b or a[1] <= b[0] or b[1] <= a[0], (rects, a, b)


@pytest.mark.parametrize("seed", range(4))
def test_every_step_keeps_exactly_the_masks_pairs(seed):
    """The rectangles of every (query rank, key rank) step of even, zigzag, uneven and grouped
    (Ulysses) partitions: each kept pair in exactly one Block, no masked pair in any, no empty
    Block, positions never negative, and query ranges equal or disjoint within a step."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        size = int(rng.integers(1, 5))
        n = 2 * size + int(rng.integers(0, 40))
        rects = random_rects(rng, n, int(rng.integers(1, 7)))
        mask = mask_of(rects)
        kind = str(rng.choice(["contiguous", "zigzag", "uneven", "grouped"]))
        if kind == "uneven":
            cut = np.sort(rng.choice(np.arange(1, n), size=size - 1, replace=False))
            part = partition("contiguous", size, n, None, tuple(int(x) for x in np.diff([0, *cut, n])))
        elif kind == "grouped" and size % 2 == 0:
            part = grouped(partition("zigzag", size, n), 2)
        else:
            part = partition("zigzag" if kind == "zigzag" else "contiguous", size, n)
        got = np.zeros((n, n), int)
        for qr in range(part.size):
            qpos = np.array(part.positions(qr))
            for kr in range(part.size):
                kpos = np.array(part.positions(kr))
                rows = rectangles(part, qr, kr, False, (-1, -1), None, mask)
                assert rows.dtype == RECTANGLE and not rows.flags.writeable
                q_spans, k_spans = set(), set()
                for b in blocks(part, qr, kr, False, (-1, -1), None, mask):
                    keep = block_keeps(b)
                    assert keep.any() and min(b.q_pos, b.k_pos) >= 0, b
                    # the kernels' limits: positions below twice the longer side, bounds below
                    # the sum of the sides
                    side = max(b.q_len, b.k_len)
                    assert max(b.q_pos + b.q_len, b.k_pos + b.k_len) <= 2 * side, b
                    assert b.left < b.q_len + b.k_len, b
                    assert b.masked or keep.all(), b
                    gq = qpos[b.q_start:b.q_start + b.q_len]
                    gk = kpos[b.k_start:b.k_start + b.k_len]
                    np.add.at(got, (np.repeat(gq, b.k_len), np.tile(gk, b.q_len)), keep.ravel())
                    q_spans.add((b.q_start, b.q_start + b.q_len))
                    k_spans.add((b.k_start, b.k_start + b.k_len))
                for spans in (q_spans, k_spans):   # what the list kernels group by
                    for a in spans:
                        assert all(a == c or a[1] <= c[0] or c[1] <= a[0] for c in spans)
        assert (got == dense(rects, n)).all(), (kind, size, n, rects)


def test_a_block_that_keeps_everything_is_not_masked():
    """A full rectangle, and the part of a causal one its diagonal does not cut, reach the local
    op as unmasked Blocks (the fast tiles): only Blocks a bound cuts carry it."""
    part = partition("contiguous", 4, 16)
    # queries 0..3 over keys 0..7, causal: key j kept iff j - i <= 8 - 4 = 4
    mask = mask_of([((0, 4), (0, 8), "causal"), ((4, 8), (8, 12), "full")])
    (b00,) = blocks(part, 0, 0, False, (-1, -1), None, mask)   # keys 0..3: j - i <= 3, all kept
    (b01,) = blocks(part, 0, 1, False, (-1, -1), None, mask)   # keys 4..7: the diagonal cuts
    (b12,) = blocks(part, 1, 2, False, (-1, -1), None, mask)
    assert not b00.masked and b01.masked and not b12.masked
    assert block_keeps(b01).sum() == 1 + 2 + 3 + 4
    assert len(blocks(part, 1, 0, False, (-1, -1), None, mask)) == 0


def test_burst_sends_only_what_the_mask_needs():
    """Rectangles inside each rank's own shard: no K/V block and no bundle ever leaves a rank.
    One rectangle from rank 3's queries to rank 0's keys: only that block travels, one hop
    back (3 hops forwards would reach the same rank)."""
    size, per = 4, 8
    part = partition("contiguous", size, size * per)
    local = mask_of([((r * per, r * per + per), (r * per, r * per + per), "causal")
                     for r in range(size)])
    for rank in range(size):
        assert forward_sends(rank, size, per, part, block_mask=local) == 0
        assert backward_counts(rank, size, per, part, block_mask=local) == (0, 0, 0)
    far = mask_of([((24, 32), (0, 8), "full")])
    # block 0 goes 0 -> 3, its previous rank, which never passes it on
    assert [forward_sends(rank, size, per, part, block_mask=far) for rank in range(size)] == \
        [1, 0, 0, 0]


@pytest.mark.parametrize("args,error", [
    (([[0, 4]], [[0, 4]], ["diagonal"]), ValueError),          # unknown kind
    (([[0, 4]], [[0, 4]], [4]), ValueError),                   # code out of range
    (([[0, 4]], [[0, 4]], "causal"), TypeError),               # a string, not one a rectangle
    (([[0, 4]], [[0, 4]], ["full", "full"]), ValueError),      # two kinds for one rectangle
    (([[4, 4]], [[0, 4]], ["full"]), ValueError),              # empty query range
    (([[-1, 4]], [[0, 4]], ["full"]), ValueError),             # negative start
    (([[0, 4, 8]], [[0, 4]], ["full"]), ValueError),           # not (n, 2)
    (([[0.5, 4]], [[0, 4]], ["full"]), TypeError),             # not integers
    (([[0, 4], [0, 4]], [[0, 4]], ["full", "full"]), ValueError),   # 2 query ranges, 1 key range
    (([[0, 4], [2, 6]], [[0, 4], [3, 5]], ["full", "full"]), ValueError),   # a pair kept twice
    (([[0, 4], [0, 4]], [[0, 4], [0, 4]], ["causal", "inverse_causal"]), ValueError),  # diagonal
    ((np.zeros((3, 0), int), np.zeros((3, 0), int), []), ValueError),        # 3 rows of nothing
    (([[0, 2**31 + 1]], [[0, 4]], ["full"]), ValueError),                     # past 2^31
    (([[0, 2**30], [0, 2**30]], [[0, 2**30], [0, 2**30]], ["full", "full"]), ValueError),
])
def test_malformed_masks_are_refused(args, error):
    with pytest.raises(error):
        burstcu.BlockMask(*args)


def test_a_range_past_int64_is_named_as_given():
    """An unsigned range past int64's largest value is named as given (it read as negative)."""
    with pytest.raises(ValueError, match=r"q_ranges\[0\] = \[0, 9223372036854775808\] is not a range"):
        burstcu.BlockMask(np.array([[0, 2**63]], np.uint64), [[0, 10]], ["full"])
    mask = burstcu.BlockMask(np.array([[0, 4]], np.uint64), np.array([[0, 4]], np.uint32), ["full"])
    assert mask.q_ranges.dtype == np.int64 and mask.kept_pairs() == 16


def test_overlaps_are_refused_exactly_when_a_pair_is_kept_twice():
    """Random rectangles, not filtered: the constructor refuses them iff the dense count of
    some pair is 2 or more, and names a pair that is."""
    rng = np.random.default_rng(8)
    refused = 0
    for _ in range(1500):
        n = int(rng.integers(2, 16))
        rects = []
        for _ in range(int(rng.integers(2, 5))):
            qs, ks = (int(x) for x in rng.integers(0, n, 2))
            rects.append(((qs, int(rng.integers(qs + 1, n + 1))),
                          (ks, int(rng.integers(ks + 1, n + 1))), KINDS[int(rng.integers(4))]))
        count = dense(rects, n)
        try:
            mask_of(rects)
        except ValueError as exc:
            refused += 1
            i, j = (int(x) for x in re.search(r"query (\d+), key (\d+)", str(exc)).groups())
            assert count[i, j] >= 2, (rects, str(exc))
        else:
            assert count.max() <= 1, rects
    assert 300 < refused < 1200    # both outcomes well represented


def test_a_pair_kept_twice_is_named():
    with pytest.raises(ValueError, match=r"rectangles 1 .* and 2 .* both keep the pair "
                                         r"\(query 5, key 2\)"):
        burstcu.BlockMask([[0, 4], [4, 8], [5, 6]], [[0, 8], [0, 4], [2, 3]],
                          ["full", "full", "full"])


def test_an_empty_mask_keeps_nothing():
    """No rectangle (from lists or arrays): every row gets out 0 and lse -inf."""
    for empty in (burstcu.BlockMask([], [], []), burstcu.BlockMask(np.zeros((0, 2), int),
                                                                    np.zeros((0, 2), int), [])):
        assert len(empty) == 0 and empty.kept_pairs() == 0 and empty.extent == 0
        q = np.ones((1, 6, 2, 4))
        out, lse = burstcu.attention(q, q, q, block_mask=empty, return_lse=True)
        assert not out.any() and np.isneginf(lse).all()


def test_masks_compare_and_hash_by_content():
    a = burstcu.BlockMask(np.array([[0, 4]]), [[0, 4]], ["causal"])
    b = burstcu.BlockMask([[0, 4]], np.array([[0, 4]], np.int32), [1])
    assert a == b and hash(a) == hash(b) and a.kinds == ("causal",)
    assert a != burstcu.BlockMask([[0, 4]], [[0, 4]], ["full"])
    # touching on the causal diagonal only is allowed: the two keep different pairs
    burstcu.BlockMask([[0, 4], [0, 4]], [[0, 4], [1, 5]], ["causal", "inverse_causal"])


def test_attention_refuses_a_mask_beside_other_masks_and_past_the_sequence():
    q = np.zeros((1, 8, 2, 8))
    mask = burstcu.BlockMask([[0, 8]], [[0, 8]], ["causal"])
    with pytest.raises(ValueError, match="without causal"):
        burstcu.attention(q, q, q, causal=True, block_mask=mask)
    with pytest.raises(ValueError, match="without causal"):
        burstcu.attention(q, q, q, cu_seqlens=[0, 4, 8], block_mask=mask)
    with pytest.raises(ValueError, match="reaches position 9"):
        burstcu.attention(q, q, q, block_mask=burstcu.BlockMask([[0, 10]], [[0, 8]], ["full"]))
    with pytest.raises(ValueError, match="without causal"):
        burstcu.attention(q, q, q, window_size=(2, 2), block_mask=mask)
    with pytest.raises(TypeError, match="BlockMask"):
        burstcu.attention(q, q, q, block_mask=([[0, 8]], [[0, 8]], ["full"]))


def test_a_sharding_of_documents_beside_a_block_mask_is_named_as_the_conflict():
    """The documents came from the Sharding, so the message blamed a cu_seqlens the caller had
    not passed; it now says the Sharding holds them and how to make one for a block mask."""
    q = np.zeros((1, 8, 2, 8))
    mask = burstcu.BlockMask([[0, 4], [4, 8]], [[0, 4], [4, 8]], ["causal", "causal"])
    with burstcu.init(backend="numpy") as group:
        for layout in ("documents", "zigzag"):
            sh = burstcu.Sharding(group, layout=layout, cu_seqlens=[0, 4, 8])
            for call in (lambda: burstcu.attention(q, q, q, sh, block_mask=mask),
                         lambda: burstcu.attention_backward(q, q, q, q, q, np.zeros((1, 2, 8)), sh,
                                                            block_mask=mask),
                         lambda: burstcu.plan(q.shape, q.shape, sh, block_mask=mask)):
                with pytest.raises(ValueError, match=r"the Sharding holds documents \(cu_seqlens, "
                                                     rf"layout '{layout}'\) and block_mask is the "
                                                     r"whole mask.*balanced_lengths"):
                    call()
        out = burstcu.attention(q, q, q, burstcu.Sharding(group, layout="zigzag"), block_mask=mask)
        assert out.shape == q.shape


def test_plan_refuses_what_attention_refuses():
    mask = burstcu.BlockMask([[0, 8]], [[0, 8]], ["causal"])
    shape = (1, 8, 2, 8)
    with pytest.raises(ValueError, match="without causal"):
        burstcu.plan(shape, shape, causal=True, block_mask=mask)
    with pytest.raises(TypeError, match="BlockMask"):
        burstcu.plan(shape, shape, block_mask=[[0, 8]])
    with pytest.raises(ValueError, match="reaches position 8"):
        burstcu.plan((1, 8, 2, 8), shape, block_mask=burstcu.BlockMask([[0, 9]], [[0, 9]], [0]))


def test_the_kernels_take_block_masks_over_a_quarter_of_their_positions():
    """Blocks of a block mask carry positions up to twice their longer side: on a local op
    addressing 2^30 positions a mask may cover 2^28, refused beyond (on every rank: the check
    runs after the ranks agree on N)."""
    mask = burstcu.BlockMask([[0, 8]], [[0, 8]], ["causal"])
    assert check_block_mask_extent(mask, 2**28, 2**30) is None
    err = check_block_mask_extent(mask, 2**28 + 1, 2**30)
    assert err is not None and "at most 268435456 positions" in err.message
    assert check_block_mask_extent(mask, 7) is not None and check_block_mask_extent(None, 7) is None


def test_one_process_matches_a_dense_reference_forward_and_backward():
    """Every strategy in one process, float64: out, lse (rows without a key: 0 and -inf) and the
    gradients against softmax over the dense mask written here."""
    rng = np.random.default_rng(9)
    n, h, d = 40, 2, 8
    rects = random_rects(rng, n, 5)
    keep = dense(rects, n).astype(bool)
    q, k, v, do = (rng.standard_normal((1, n, h, d)) for _ in range(4))
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(d)
    s = np.where(keep, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(-1, keepdims=True)
    p = np.where(l > 0, p / np.where(l > 0, l, 1), 0)
    out_ref = np.einsum("bhij,bjhd->bihd", p, v)
    lse_ref = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + m[..., 0], -np.inf)
    dp = np.einsum("bihd,bjhd->bhij", do, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(d)
    dq_ref = np.einsum("bhij,bjhd->bihd", ds, k)
    dk_ref = np.einsum("bhij,bihd->bjhd", ds, q)
    dv_ref = np.einsum("bhij,bihd->bjhd", p, do)
    mask = mask_of(rects)
    for strategy in ("burst", "ring", "allgather", "ulysses", "auto"):
        out, lse = burstcu.attention(q, k, v, block_mask=mask, return_lse=True, strategy=strategy)
        np.testing.assert_allclose(out, out_ref, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        np.testing.assert_allclose(lse[np.isfinite(lse)], lse_ref[np.isfinite(lse_ref)], atol=1e-12)
        grads = burstcu.attention_backward(do, q, k, v, out, lse, block_mask=mask, check=True,
                                           strategy=strategy)
        for got, ref in zip(grads, (dq_ref, dk_ref, dv_ref)):
            np.testing.assert_allclose(got, ref, atol=1e-12)
    assert (~keep).all(axis=1).any(), "the random mask should leave some row without a key"


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_disagreeing_or_malformed_masks_raise_on_every_rank(world):
    run_mpi(world, "strategy_bodies:block_masks_disagree", timeout=120)


def test_balanced_lengths_even_out_the_kept_pairs():
    """One causal rectangle over the whole sequence and many causal documents: every rank's
    queries keep pairs within 1% of the mean; any split leaves every rank a row."""
    rng = np.random.default_rng(4)
    n = 4096
    bounds = np.unique(np.concatenate([[0, n], rng.integers(1, n, 60)]))
    docs = np.stack([bounds[:-1], bounds[1:]], axis=1)
    for mask in (mask_of([((0, n), (0, n), "causal")]),
                 burstcu.BlockMask(docs, docs, ["causal"] * len(docs))):
        work = mask.row_pairs(n)
        assert work.sum() == mask.kept_pairs()
        for size in (2, 4, 8):
            lengths = mask.balanced_lengths(size, n)
            assert sum(lengths) == n and min(lengths) >= 1
            starts = np.cumsum([0, *lengths])
            per_rank = np.array([work[starts[r]:starts[r + 1]].sum() for r in range(size)])
            assert np.abs(per_rank / per_rank.mean() - 1).max() < 0.01, (size, lengths)
    lonely = mask_of([((0, 1), (0, 1), "full")])   # all the work in row 0
    assert lonely.balanced_lengths(3, 8) == (1, 1, 6)
    assert lonely.balanced_lengths(8, 8) == (1,) * 8
    # work per row 1, 1, 1, 1, 10, then 0s (14 in all) over 3 ranks: the busiest rank holds row 4
    # alone at best; the first cut nearest 14/3 is after row 3 (4), the second nearest 28/3 is
    # any of rows 5.. (14), the earliest taken
    step = burstcu.BlockMask([[0, 4], [4, 5]], [[0, 1], [0, 10]], ["full", "full"])
    assert step.row_pairs(10).tolist() == [1, 1, 1, 1, 10, 0, 0, 0, 0, 0]
    assert step.balanced_lengths(3, 10) == (4, 1, 5)


def test_balanced_lengths_leave_the_busiest_rank_the_least_any_split_can():
    """Random masks of up to 24 rows over 1-6 ranks: the busiest rank's kept pairs (counted on
    the dense mask) equal the least over every contiguous split of a row a rank at least,
    found by exhaustive recursion; the causal square of 64 rows over 8 ranks as well, where
    cutting at the row nearest each r/8 of the pairs leaves the busiest rank 290 (the least
    is 285)."""
    def busiest(work, lengths):
        starts = np.cumsum([0, *lengths])
        return max(work[starts[r]:starts[r + 1]].sum() for r in range(len(lengths)))

    def least(work, size):
        running = np.concatenate([[0], np.cumsum(work)])

        @functools.lru_cache(None)
        def best(start, ranks):
            if ranks == 1:
                return running[-1] - running[start]
            return min(max(running[cut] - running[start], best(cut, ranks - 1))
                       for cut in range(start + 1, work.size - ranks + 2))
        return best(0, size)

    rng = np.random.default_rng(12)
    for _ in range(150):
        n = int(rng.integers(1, 25))
        rects = random_rects(rng, n, int(rng.integers(1, 5)))
        work = dense(rects, n).sum(1)
        for size in sorted({1, int(rng.integers(1, min(n, 6) + 1)), min(n, 6)}):
            lengths = mask_of(rects).balanced_lengths(size, n)
            assert len(lengths) == size and sum(lengths) == n and min(lengths) >= 1
            assert busiest(work, lengths) == least(work, size), (rects, n, size, lengths)
    square = [((0, 64), (0, 64), "causal")]
    work = dense(square, 64).sum(1)
    assert busiest(work, mask_of(square).balanced_lengths(8, 64)) == least(work, 8) == 285


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_shards_balanced_for_a_mask_match_one_process(world):
    run_mpi(world, "strategy_bodies:block_mask_balanced_shards", timeout=180)


def test_the_planner_counts_the_kept_pairs():
    """`burstcu.plan` models the work of a block mask by its kept pairs: the pairs it sums over
    the ranks' steps are the mask's, and a mask keeping a quarter of the pairs is predicted
    cheaper than full attention."""
    n, size = 64, 4
    mask = mask_of([((0, 32), (0, 32), "causal"), ((32, 64), (0, 8), "full"),
                    ((32, 64), (32, 64), "bidir_causal")])
    pairs, calls = _work(partition("zigzag", size, n), False, (-1, -1), None, mask)
    assert pairs.sum() == mask.kept_pairs() == dense([((0, 32), (0, 32), "causal"),
                                                      ((32, 64), (0, 8), "full"),
                                                      ((32, 64), (32, 64), "bidir_causal")], n).sum()
    assert calls.sum() >= len(mask)
    big = 4096
    quarter = mask_of([((0, big), (0, big // 4), "full")])
    shape = (1, big, 8, 64)
    masked = burstcu.plan(shape, shape, block_mask=quarter).candidates[0]
    full = burstcu.plan(shape, shape).candidates[0]
    assert masked.forward_s < 0.5 * full.forward_s


@pytest.mark.emulated
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_kernels_fold_rectangles_of_shifted_diagonals(deterministic):
    """The CUDA kernels (CPU emulator), one process: rectangles sharing query rows whose Blocks
    carry positions shifted apart (a causal and an inverse_causal rectangle, then a
    bidir_causal one) fold in one list launch each way: out, lse, dq, dk, dv within
    FlashAttention's rule of float64 over the dense mask written here."""
    n = 40
    rects = [((0, 26), (0, 13), "causal"), ((0, 26), (13, 40), "inverse_causal"),
             ((26, 40), (20, 40), "bidir_causal"), ((26, 40), (0, 20), "full")]
    keep = dense(rects, n).astype(bool)
    rng = np.random.default_rng(2)
    q, dout = (rng.standard_normal((1, n, 4, 16)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, n, 2, 16)).astype(np.float16) for _ in range(2))
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref_out, ref_lse = attention_ref(*wide[:3], keep=keep)
    naive_out, naive_lse = attention_ref(*wide[:3], keep=keep, dtype=np.float32, round_to=np.float16)
    refs = attention_backward_ref(wide[3], *wide[:3], keep=keep)
    naives = attention_backward_ref(wide[3], *wide[:3], keep=keep, dtype=np.float32,
                                    round_to=np.float16)
    with burstcu.init(backend="emulated", deterministic=deterministic) as group:
        out, lse = burstcu.attention(q, k, v, group, block_mask=mask_of(rects), return_lse=True)
        grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, check=True,
                                           block_mask=mask_of(rects))
    _check("out", out.astype(np.float64), ref_out, naive_out, "float16")
    _check("lse", lse, ref_lse, naive_lse, "float16")
    for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
        _check(name, got.astype(np.float64), ref, naive, "float16", factor=3.0)


def test_a_mask_whose_keys_pass_the_sequence_is_refused():
    """The mask's extent counts its key ranges too: keys past N are a ValueError naming the
    position, not silently dropped."""
    mask = burstcu.BlockMask([[0, 8]], [[0, 10]], ["full"])
    assert mask.extent == 10
    q = np.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="reaches position 9"):
        burstcu.attention(q, q, q, block_mask=mask)


def test_a_range_may_stop_at_2_to_the_31():
    """Positions run below 2^31: a range stopping at 2^31 is the largest legal one."""
    mask = burstcu.BlockMask([[2**31 - 4, 2**31]], [[0, 4]], ["full"])
    assert mask.extent == 2**31 and mask.kept_pairs() == 16


def test_balanced_cuts_go_to_the_nearest_row():
    """One pair a row, 8 rows on 3 ranks: targets 8/3 and 16/3, so cuts at rows 3 and 5."""
    mask = burstcu.BlockMask([[0, 8]], [[0, 1]], ["full"])
    assert mask.balanced_lengths(3, 8) == (3, 2, 3)


def test_pieces_are_trimmed_to_the_rows_their_rectangle_keeps():
    """Causal q [0, 8) x k [4, 8) (the diagonal through the bottom-right corner): rows 0-3 keep
    nothing, so no piece starts before row 4."""
    mask = burstcu.BlockMask([[0, 8]], [[4, 8]], ["causal"])
    assert mask.pieces["q_start"].min() == 4
