"""Documents (`cu_seqlens`, varlen): a query sees keys of its own document only. The rectangles
of each ring step cover exactly the dense mask, composed with causal and sliding windows, at
random boundaries; a document inside one shard sends nothing; zigzag cuts every document in 2G
pieces; empty documents change nothing; bad boundaries and disagreeing ranks refused on every
rank; layout="documents" holds the short documents whole within zigzag's balance. Documents on
every strategy against the float64 reference: tests/test_mask_kinds.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import burstcu
from burstcu.engine.burst import forward_sends
from burstcu.layout import (DOCUMENT_SLACK, RECTANGLE, Partition, Segment, blocks, global_positions,
                            kept_pairs, partition, rectangles, step_blocks)
from tests.mpi.bodies import dense_keep
from tests.mpi_run import run_mpi


def test_blocks_cover_exactly_the_dense_mask_once():
    """step_blocks with documents against the mask spelled out, over random boundaries, both
    layouts, causal or not, windows: every kept (query, key) pair in exactly one rectangle, no
    masked pair in any, no empty rectangle."""
    rng = np.random.default_rng(7)
    for _ in range(150):
        size, per = int(rng.integers(1, 5)), 2 * int(rng.integers(1, 7))
        n = size * per
        cuts = sorted(rng.choice(np.arange(0, n + 1), size=int(rng.integers(0, 7))).tolist())
        docs = tuple([0, *cuts, n])                 # repeated boundaries: empty documents
        causal = bool(rng.integers(2))
        window = (int(rng.choice([-1, 0, 2, 5])), 0 if causal else int(rng.choice([-1, 0, 3])))
        layout = str(rng.choice(["contiguous", "zigzag"]))
        for qr in range(size):
            for kr in range(size):
                covered = np.zeros((per, per), int)
                for b in step_blocks(layout, qr, kr, size, per, causal, window, docs):
                    assert b.q_len > 0 and b.k_len > 0
                    i = np.arange(b.q_len)[:, None] + b.q_pos
                    j = np.arange(b.k_len)[None, :] + b.k_pos
                    ok = np.ones((b.q_len, b.k_len), bool)
                    if b.causal:
                        ok &= j <= i
                    if b.left >= 0:
                        ok &= j >= i - b.left
                    if b.right >= 0:
                        ok &= j <= i + b.right
                    covered[b.q_start:b.q_start + b.q_len, b.k_start:b.k_start + b.k_len] += ok
                want = dense_keep(global_positions(layout, qr, size, per),
                                  global_positions(layout, kr, size, per), causal, window, docs)
                assert (covered == want).all(), (layout, size, per, docs, causal, window, qr, kr)


def test_rectangles_of_any_partition_cover_the_dense_mask_once():
    """`layout.rectangles` (one array a step) over the partitions the strategies take: per-document
    zigzag pieces and uneven contiguous runs as well as the even layouts, random documents,
    causal or not, windows: every kept (query, key) pair in exactly one row, no masked pair in
    any, no empty row, and `blocks` the same rows as Blocks; `kept_pairs` of the step (read
    whole, or as a list) and of each Block counts the dense mask's pairs."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        size = int(rng.integers(1, 6))
        n = size + int(rng.integers(0, 60))
        cuts = sorted(rng.choice(np.arange(0, n + 1), size=int(rng.integers(0, 9))).tolist())
        docs = None if rng.integers(4) == 0 else tuple([0, *cuts, n])
        causal = bool(rng.integers(2))
        window = (int(rng.choice([-1, 0, 1, 4, 20])), 0 if causal else int(rng.choice([-1, 0, 3])))
        kind = str(rng.choice(["contiguous", "uneven", "zigzag", "zigzag per document",
                               "documents"]))
        if kind == "uneven":
            cut = np.sort(rng.choice(np.arange(1, n), size=size - 1, replace=False)) if size > 1 else []
            lengths = tuple(int(x) for x in np.diff([0, *cut, n]))
            part = partition("contiguous", size, n, None, lengths)
        else:
            per_document = kind in ("zigzag per document", "documents") and docs is not None
            part = partition(kind.split()[0], size, n, docs if per_document else None)
        for qr in range(size):
            for kr in range(size):
                rows = rectangles(part, qr, kr, causal, window, docs)
                assert rows.dtype == RECTANGLE and not rows.flags.writeable
                assert [tuple(r) for r in rows.tolist()] == \
                    [tuple(b) for b in blocks(part, qr, kr, causal, window, docs)]
                sq, sk = part.lengths[qr], part.lengths[kr]
                covered = np.zeros((sq, sk), int)
                for r in rows:
                    assert r["q_len"] > 0 and r["k_len"] > 0
                    i = np.arange(r["q_len"])[:, None] + r["q_pos"]
                    j = np.arange(r["k_len"])[None, :] + r["k_pos"]
                    ok = np.ones((r["q_len"], r["k_len"]), bool)
                    if r["causal"]:
                        ok &= j <= i
                    if r["left"] >= 0:
                        ok &= j >= i - r["left"]
                    if r["right"] >= 0:
                        ok &= j <= i + r["right"]
                    covered[r["q_start"]:r["q_start"] + r["q_len"],
                            r["k_start"]:r["k_start"] + r["k_len"]] += ok
                want = dense_keep(part.positions(qr), part.positions(kr), causal, window, docs)
                assert (covered == want).all(), (kind, size, n, docs, causal, window, qr, kr)
                step = blocks(part, qr, kr, causal, window, docs)   # kept pairs, whole and a Block
                assert kept_pairs(step) == kept_pairs(list(step)) == int(want.sum())
                assert sum(kept_pairs(blk) for blk in step) == int(want.sum())


def test_rectangles_come_by_query_segment_then_key_segment_by_position_then_document():
    """`layout.rectangles` lists its rows in the order it states (the order the kernels' lists
    fold a group in): by query segment (local order), then key segment (by position), then
    document, for per-document zigzag pieces, contiguous runs across documents, the Ulysses
    super-ranks' merged runs and rows held out of position order, causal or not, windows."""
    from burstcu.layout import _runs, grouped

    rng = np.random.default_rng(5)
    for _ in range(60):
        size = 2 * int(rng.integers(1, 4))
        n = 4 * size + int(rng.integers(0, 200))
        docs = tuple([0, *sorted(rng.choice(np.arange(1, n), size=int(rng.integers(1, 12))).tolist()), n])
        causal = bool(rng.integers(2))
        window = (int(rng.choice([-1, 3, 30])), 0 if causal else int(rng.choice([-1, 5])))
        zigzag = partition("zigzag", size, n, docs)
        backwards = Partition("zigzag", tuple(_runs([(seg.pos, seg.length) for seg in mine[::-1]])
                                              for mine in zigzag.runs))
        for part in (zigzag, partition("contiguous", size, n), grouped(partition("zigzag", size, n), 2),
                     backwards):
            for qr in range(part.size):
                for kr in range(part.size):
                    rows = rectangles(part, qr, kr, causal, window, docs)
                    q_local, (k_pos, _, k_local) = part.arrays[qr][2], part.arrays[kr]
                    q_seg = np.searchsorted(q_local, rows["q_start"], "right") - 1
                    k_seg = np.searchsorted(k_local, rows["k_start"], "right") - 1
                    k_rank = np.argsort(np.argsort(k_pos))[k_seg]
                    doc = np.searchsorted(docs, rows["q_pos"], "right") - 1
                    keys = list(zip(q_seg.tolist(), k_rank.tolist(), doc.tolist()))
                    assert keys == sorted(set(keys)), (part, qr, kr, causal, window, docs)


def test_rectangle_rows_are_the_same_bytes_whatever_memory_they_reuse():
    """`RECTANGLE` is aligned (7 bytes of padding after `causal`): `rectangles` zeroes them, so
    a step's array has the same bytes on every build and rank, even in reused dirty memory."""
    pad = slice(RECTANGLE.fields["causal"][1] + 1, RECTANGLE.fields["left"][1])
    assert pad.stop - pad.start == 7
    part, docs = partition("zigzag", 2, 64, (0, 5, 30, 64)), (0, 5, 30, 64)
    for causal, window in ((True, (-1, 0)), (False, (-1, -1)), (False, (4, 2))):
        for _ in range(20):
            dirty = np.full(1 << 12, 0xFF, np.uint8)   # freed memory full of ones, for reuse
            del dirty
            rows = rectangles(part, 0, 1, causal, window, docs)
            assert rows.size and not rows.view(np.uint8).reshape(rows.size, -1)[:, pad].any()


def test_a_document_inside_one_shard_computes_and_sends_nothing_across():
    """Contiguous shards of 8 rows and documents aligned with them: every rank sees only its own
    keys (one step), and the forward ring sends nothing."""
    docs = (0, 8, 16, 24)
    for q_rank in range(3):
        sources = [s for s in range(3) if step_blocks("contiguous", q_rank, s, 3, 8, True,
                                                      cu_seqlens=docs)]
        assert sources == [q_rank]
        assert forward_sends(q_rank, 3, 8, "contiguous", True, cu_seqlens=docs) == 0


@pytest.mark.parametrize("cu,kind,message", [
    ([0, 5, 15], ValueError, "end at the global sequence length N = 16"),
    ([2, 16], ValueError, "start at 0"),
    ([0, 9, 4, 16], ValueError, "must not decrease"),
    ([0.0, 16.0], TypeError, "integers"),
    ([[0, 16]], ValueError, "1-D"),
    ([16], ValueError, "at least 2"),
    (np.array([0, 2**62, -2**63 + 17, 16], np.int64), ValueError, "lie in"),   # no wrap-around
    (np.array([0, 2**64 - 1, 16], np.uint64), ValueError, "lie in"),
])
def test_bad_boundaries_are_refused(cu, kind, message):
    q = np.zeros((1, 16, 2, 8))
    with pytest.raises(kind, match=message):
        burstcu.attention(q, q, q, cu_seqlens=np.asarray(cu))


def test_zigzag_with_documents_cuts_every_document_in_2g_pieces():
    """shard(layout="zigzag", cu_seqlens=...) gives rank r pieces r and 2G-1-r of every document
    (near-equal, no divisibility needed), and the shards' lengths differ by at most 2."""
    docs = (0, 5, 6, 23, 40)
    x = np.arange(40)[None, :, None]
    for size in (1, 2, 3, 4):
        part = partition("zigzag", size, 40, docs)
        shards = [burstcu.shard(x, SimpleNamespace(rank=r, size=size), "zigzag",
                                cu_seqlens=list(docs))[0, :, 0] for r in range(size)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(40))
        assert max(part.lengths) - min(part.lengths) <= 2, part.lengths
        order = list(range(size)) + list(range(size - 2, -1, -1))   # pieces G-1, G touch
        for r, rows in enumerate(shards):
            assert rows.tolist() == part.positions(r)
        owner = np.empty(40, int)
        for r, rows in enumerate(shards):
            owner[rows] = r
        for start, stop in zip(docs[:-1], docs[1:]):
            n = stop - start
            runs = [int(o) for i, o in enumerate(owner[start:stop]) if i == 0 or o != owner[start + i - 1]]
            it = iter(order)
            assert all(any(o == want for want in it) for o in runs), (size, start, runs)
            for r in range(size):   # two pieces of n // 2G or one more rows each
                held = int((owner[start:stop] == r).sum())
                assert n // (2 * size) * 2 <= held <= n // (2 * size) * 2 + 2, (size, r, start, held)


def _causal_pairs(positions: np.ndarray, docs: np.ndarray) -> int:
    """Causal pairs the rows at `positions` keep within their documents (`docs` boundaries)."""
    start = docs[np.searchsorted(docs, positions, "right") - 1]
    return int(np.sum(positions - start + 1))


def test_documents_layout_holds_short_documents_whole_within_the_balance_of_zigzag():
    """layout="documents" over long-tailed mixes of documents on 1 to 8 ranks: every position
    held once, each rank's in position order; every document either whole on one rank or cut
    exactly as zigzag cuts it; no rank holds more rows, or keeps more causal pairs, than
    zigzag's fullest rank plus DOCUMENT_SLACK of a share; short documents are held whole; and
    without documents it is zigzag."""
    rng = np.random.default_rng(5)
    whole_somewhere = 0
    for trial in range(60):
        size = int(rng.integers(1, 9))
        lengths_of = np.maximum(1, rng.lognormal(3.5, 1.3, int(rng.integers(1, 300)))).astype(int)
        docs = np.concatenate([[0], np.cumsum(lengths_of)])
        n = int(docs[-1])
        if n < size:
            continue
        part = partition("documents", size, n, tuple(docs.tolist()))
        zig = partition("zigzag", size, n, tuple(docs.tolist()))
        owner = np.full(n, -1)
        for r in range(size):
            held = np.array(part.positions(r))
            assert (np.diff(held) > 0).all() and (owner[held] == -1).all()
            owner[held] = r
        assert (owner >= 0).all()
        zig_owner = np.empty(n, int)
        for r in range(size):
            zig_owner[zig.positions(r)] = r
        for start, stop in zip(docs[:-1], docs[1:]):
            mine = owner[start:stop]
            if not (mine == mine[0]).all():
                assert (mine == zig_owner[start:stop]).all(), (trial, start, stop)
            whole_somewhere += size > 1 and (mine == mine[0]).all() and \
                not (zig_owner[start:stop] == mine[0]).all()
        share_rows, share_pairs = n / size, _causal_pairs(np.arange(n), docs) / size
        zig_pairs = max(_causal_pairs(np.array(zig.positions(r)), docs) for r in range(size))
        for r in range(size):
            assert part.lengths[r] <= max(zig.lengths) + DOCUMENT_SLACK * share_rows, trial
            assert _causal_pairs(np.array(part.positions(r)), docs) <= \
                zig_pairs + DOCUMENT_SLACK * share_pairs, trial
    assert whole_somewhere >= 500, whole_somewhere
    # many short documents (250, median ~90 rows, 38K rows) on 4 ranks: nearly all whole
    lengths_of = np.maximum(1, np.random.default_rng(1).lognormal(4.5, 1.2, 250)).astype(int)
    docs = tuple(np.concatenate([[0], np.cumsum(lengths_of)]).tolist())
    part = partition("documents", 4, docs[-1], docs)
    whole = {(s.pos, s.pos + s.length) for r in range(4) for s in part.runs[r]} & set(zip(docs, docs[1:]))
    assert len(whole) >= 240, len(whole)
    # three documents of a quarter share on 2 ranks: held whole, one rank would hold two of them,
    # beyond the slack; at an eighth of a share none is short enough: all three are cut
    docs = (0, 500, 600, 700, 800)
    assert partition("documents", 2, 800, docs).runs == partition("zigzag", 2, 800, docs).runs
    # one 40-row document cut in zigzag pieces of 10 (both ranks then hold 20 rows and 410
    # causal pairs) and four of 4 rows dealt in turn, each to the rank it leaves lower, the
    # first tie to the lowest rank
    runs = partition("documents", 2, 56, (0, 40, 44, 48, 52, 56)).runs
    assert [[(seg.pos, seg.length) for seg in r] for r in runs] == \
        [[(0, 10), (30, 10), (40, 4), (48, 4)], [(10, 10), (20, 10), (44, 4), (52, 4)]]
    assert partition("documents", 4, 1000).runs == partition("zigzag", 4, 1000).runs
    with pytest.raises(ValueError, match="documents fixes every rank's length"):
        partition("documents", 2, 10, (0, 4, 10), (3, 7))


def test_empty_documents_are_dropped_and_lists_accepted():
    """Repeated boundaries (empty documents, as padding makes them) change nothing."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 10, 2, 8)) for _ in range(3))
    a = burstcu.attention(q, k, v, causal=True, cu_seqlens=[0, 3, 3, 10, 10])
    b = burstcu.attention(q, k, v, causal=True, cu_seqlens=np.array([0, 3, 10], np.int64))
    assert np.array_equal(a, b)


@pytest.mark.mpi
def test_ranks_disagreeing_on_documents_fail_on_every_rank():
    run_mpi(3, "strategy_bodies:documents_disagree", timeout=120)


@pytest.mark.mpi
def test_bad_documents_on_one_rank_fail_on_every_rank():
    run_mpi(3, "strategy_bodies:documents_bad_on_one_rank", timeout=120)


def test_a_partition_pickles_without_what_it_computed():
    """A partition's hash and segment arrays are computed once and kept; a pickle carries only
    its rows (a hash differs between processes), and the copy is equal, hashes alike here."""
    import pickle

    part = partition("zigzag", 3, 40, (0, 7, 40))
    hash(part), part.arrays
    copy = pickle.loads(pickle.dumps(part))
    assert "_hash" not in vars(copy) and "arrays" not in vars(copy)
    assert copy == part and hash(copy) == hash(part) and len({part, copy}) == 1
    assert not part.arrays[0][0].flags.writeable
    # the arrays the zigzag split hands over at once are those its segments give
    for made, given in zip(Partition(part.layout, part.runs).arrays, part.arrays):
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(made, given))


def _rows_and_pairs(part, docs):
    """(rows, causal pairs within documents) of each rank of `part`, counted over positions."""
    pos = [np.asarray(part.positions(r)) for r in range(part.size)]
    return [p.size for p in pos], [_causal_pairs(p, np.asarray(docs)) for p in pos]


def test_documents_keep_rows_and_pairs_within_the_slack_of_zigzag():
    """The "documents" layout's busiest rank holds at most DOCUMENT_SLACK of a share more rows,
    and more causal pairs, than per-document zigzag's."""
    docs = (0, 14, 24, 57, 89, 141, 180, 219, 250)
    lens = np.diff(docs)
    share_rows, share_pairs = docs[-1] / 2, (lens * (lens + 1) // 2).sum() / 2
    rows, pairs = _rows_and_pairs(partition("documents", 2, docs[-1], docs), docs)
    z_rows, z_pairs = _rows_and_pairs(partition("zigzag", 2, docs[-1], docs), docs)
    assert max(rows) <= max(z_rows) + DOCUMENT_SLACK * share_rows
    assert max(pairs) <= max(z_pairs) + DOCUMENT_SLACK * share_pairs


def test_a_short_document_goes_to_the_rank_it_leaves_least_loaded():
    """Documents (0, 9, 20, 31, 41, 43) on 2 ranks: the whole ones split 21 rows to 20; the last
    two-row document goes to the rank with 20."""
    part = partition("documents", 2, 43, (0, 9, 20, 31, 41, 43))
    assert part.lengths == (21, 22) and Segment(20, 41, 2) in part.runs[1]


def test_a_rectangle_wholly_below_the_diagonal_is_not_masked():
    """Contiguous over 2 ranks with a one-row document [3, 4): its 1 x 1 rectangle keeps its one
    pair, so it runs without the mask test."""
    one = [b for b in blocks(partition("contiguous", 2, 8), 0, 0, True, cu_seqlens=(0, 3, 4, 8))
           if b.q_len == 1 and b.k_len == 1]
    assert one and not any(b.masked for b in one)


def test_a_varlen_loop_keeps_a_few_partitions_whatever_the_batches():
    """New documents every batch, as a packed-varlen training loop brings: what the layout, the
    burst schedules and the planner keep stays a few partitions' worth. A partition of 1000
    documents at G = 8 is 2.4 MB; the caches kept 256 of them (615 MB a rank, growing through
    the first 256 batches; at the 300 documents here, 69 MB over the second 64 batches)."""
    import tracemalloc
    from types import SimpleNamespace

    from burstcu.engine import burst
    from burstcu import layout
    from burstcu.layout import partition

    ranks, n = SimpleNamespace(size=8), 1 << 15
    rng = np.random.default_rng(0)

    def batch():
        cu = (0, *np.sort(rng.choice(np.arange(1, n), 299, replace=False)).tolist(), n)
        for r in range(ranks.size):       # what each rank's ring asks of the batch's partition
            burst.kv_hops(r, partition("zigzag", ranks.size, n, cu), True, (-1, -1), cu)
        burstcu.plan((1, n // 8, 8, 64), (1, n // 8, 8, 64), ranks, causal=True, layout="zigzag",
                     cu_seqlens=cu)

    kept = max(getattr(layout, "PARTITIONS_KEPT", 16), burst.SCHEDULES_KEPT)
    tracemalloc.start()
    try:
        for _ in range(kept):
            batch()
        filled = tracemalloc.get_traced_memory()[0]
        for _ in range(kept):
            batch()
        grown = tracemalloc.get_traced_memory()[0] - filled
    finally:
        tracemalloc.stop()
    assert grown < 2e6, f"{grown / 1e6:.1f} MB more after {kept} more batches"
