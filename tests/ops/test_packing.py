"""Packed rectangle lists on the host (burstcu/ops/cuda/packing.py): a step of many small
rectangles cut into the kernels' tiles, the kept pairs given by one run of keys a query row
(row_keys) and one run of query rows a key (key_rows).

The runs say exactly the pairs the rectangles keep, pair by pair against the dense mask of
`keep_from_blocks`, over random documents, windows and both layouts; a list that is not one run
a row (or whose runs go back) is not packed; a packed grouping covers every row that sees a key
once, in one tile whose rectangle spans its rows' runs; packing is chosen where it runs fewer
tiles and not for a causal step of one sequence. The kernels that read the runs:
tests/kernels/test_packed_lists_emulated.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from burstcu import layout
from burstcu.layout import Block
from burstcu.ops.cuda import packing
from burstcu.ops.cuda.params import NO_BOUND, _rect_columns, packed_list, step_group_lists
from burstcu.testing.reference import keep_from_blocks

# ------------------------------------------------------------------------------------------------
# host side


def _random_steps(rng, trials: int):
    """(blocks, Sq, Sk) of every step with 2 or more rectangles of `trials` random rings."""
    for trial in range(trials):
        size, n_docs, n = int(rng.integers(1, 5)), int(rng.integers(1, 12)), 600
        cuts = sorted(rng.choice(np.arange(1, n), n_docs - 1, replace=False).tolist())
        docs = tuple([0, *cuts, n])
        causal = bool(rng.integers(2))
        left = int(rng.integers(-1, 60))
        right = (0 if left >= 0 else -1) if causal else int(rng.integers(-1, 60))
        part = layout.partition(("zigzag", "contiguous")[trial % 2], size, n, docs)
        for qr in range(size):
            for kr in range(size):
                blocks = layout.blocks(part, qr, kr, causal, (left, right), docs)
                if len(blocks) >= 2:
                    yield blocks, part.lengths[qr], part.lengths[kr]


def _runs_mask(runs: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) bool: row i holds [runs[i, 0], runs[i, 1]) (rows past runs: none)."""
    out = np.zeros((rows, cols), bool)
    j = np.arange(cols)[None, :]
    out[:runs.shape[0]] = (j >= runs[:, :1]) & (j < runs[:, 1:])
    return out


def test_runs_keep_exactly_the_rectangles_pairs():
    """row_keys and key_rows of random steps (documents, causal or not, windows, zigzag and
    contiguous) give the dense mask of the rectangles pair by pair, and both ends of row_keys
    never decrease."""
    steps = 0
    for blocks, sq, sk in _random_steps(np.random.default_rng(0), 30):
        runs = packing.row_intervals(_rect_columns(blocks))
        assert runs is not None, list(blocks)
        row_keys, key_rows = runs
        keep = keep_from_blocks(blocks, sq, sk)
        assert np.array_equal(_runs_mask(row_keys, sq, sk), keep)
        assert np.array_equal(_runs_mask(key_rows, sk, sq).T, keep)
        assert (np.diff(row_keys, axis=0) >= 0).all()
        steps += 1
    assert steps >= 20


def _spelled_out(cols: np.ndarray) -> np.ndarray | None:
    """(q_end, k_end) bool: the pairs the BlockRects `cols` (8, n) keep, from their definition;
    None where a pair is kept twice (which no caller makes)."""
    q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo = cols
    i = np.arange((q_start + q_len).max())[:, None, None]
    j = np.arange((k_start + k_len).max())[None, :, None]
    offset = (k_pos + j - k_start) - (q_pos + i - q_start)
    kept = (i >= q_start) & (i < q_start + q_len) & (j >= k_start) & (j < k_start + k_len) \
        & (offset >= -lo) & (offset <= hi)
    return kept.any(axis=2) if kept.sum(axis=2).max() <= 1 else None


def _random_rectangles(rng, trials: int):
    """(cols (8, n) int64, keep) of `trials` random sets of BlockRects (rows and keys overlapping
    anyhow, bands of any width or none; sets keeping a pair twice, or with no row or no key,
    skipped), then two fixed sets that only a piece's slopes (a row of two runs) and its last row
    (an end going back) refuse; keep as `_spelled_out`."""
    for _ in range(trials):
        m, rows, keys = int(rng.integers(1, 10)), *rng.integers(1, int(rng.choice([12, 120])), 2)
        q_start, k_start = rng.integers(0, rows, m), rng.integers(0, keys, m)
        q_len, k_len = rng.integers(0, rows - q_start + 1), rng.integers(0, keys - k_start + 1)
        q_pos, k_pos = rng.integers(0, 2 * rows, m), rng.integers(0, 2 * keys, m)
        hi, lo = (np.where(rng.random(m) < 0.4, NO_BOUND, rng.integers(-4, rows, m)) for _ in "hl")
        cols = np.stack([q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo]).astype(np.int64)
        if q_len.any() and k_len.any() and (keep := _spelled_out(cols)) is not None:
            yield cols, keep
    for rows in ([[0, 4, 0, 10, 0, 0, NO_BOUND, NO_BOUND], [2, 2, 5, 15, 0, 0, NO_BOUND, -5]],
                 [[0, 3, 0, 10, 0, 0, 4, NO_BOUND], [3, 2, 0, 6, 0, 0, NO_BOUND, NO_BOUND]]):
        cols = np.array(rows, np.int64).T
        yield cols, _spelled_out(cols)


def test_runs_of_any_rectangles_exactly_where_every_row_sees_one_run_going_forward():
    """Over random rectangles (not only the steps burstcu.layout makes): where every row's kept
    keys form one run and, an empty row taking the largest end before it, neither end of the
    runs decreases, row_keys and key_rows give the dense mask pair by pair; elsewhere, None."""
    packed = refused = 0
    for cols, keep in _random_rectangles(np.random.default_rng(3), 1500):
        sq, sk = keep.shape
        sees = keep.any(axis=1)
        start = np.where(sees, keep.argmax(axis=1), 0)
        end = np.where(sees, sk - keep[:, ::-1].argmax(axis=1), 0)
        one_run = (end - start == keep.sum(axis=1))
        reach = np.maximum.accumulate(end)                # an empty row's end is 0 here
        start, end = np.where(sees, start, reach), np.where(sees, end, reach)
        expect = one_run.all() and (np.diff(start) >= 0).all() and (np.diff(end) >= 0).all() \
            and cols[1].sum() <= packing.MAX_ROW_REPEATS * sq
        runs = packing.row_intervals(cols)
        assert (runs is not None) == expect, cols.T
        if runs is None:
            refused += 1
            continue
        packed += 1
        row_keys, key_rows = runs
        assert row_keys.dtype == key_rows.dtype == np.int32
        assert np.array_equal(row_keys, np.stack([start, end], axis=1))
        assert np.array_equal(_runs_mask(key_rows, sk, sq).T, keep)
        assert (np.diff(key_rows, axis=0) >= 0).all()
    assert packed >= 200 and refused >= 200, (packed, refused)


def test_a_row_of_two_runs_or_runs_going_back_is_not_packed():
    """A row that sees two runs of keys, or a later row whose run starts before an earlier
    row's, has no packed form: the step keeps its rectangle list."""
    two_runs = [Block(0, 8, 0, 4, 0, 0, False), Block(0, 8, 10, 4, 0, 10, False)]
    going_back = [Block(0, 8, 10, 4, 0, 10, False), Block(8, 8, 0, 4, 8, 0, False)]
    for blocks in (two_runs, going_back):
        assert packing.row_intervals(_rect_columns(blocks)) is None
        assert packed_list(blocks, "query", 64) is None
        (groups,) = step_group_lists(np, blocks, [("query", 64)], pack=True)
        assert not groups.packed


def _doc_step(n: int = 4096, size: int = 4, n_docs: int = 30, seed: int = 1, kr: int = 1):
    rng = np.random.default_rng(seed)
    cuts = sorted(rng.choice(np.arange(1, n), n_docs - 1, replace=False).tolist())
    docs = tuple([0, *cuts, n])
    part = layout.partition("zigzag", size, n, docs)
    return layout.blocks(part, 0, kr, True, (-1, -1), docs), part


@pytest.mark.parametrize("by", ["query", "key"])
def test_a_packed_grouping_covers_every_seen_row_once(by):
    """Each row that sees a key lies in exactly one group, a tile of 64 rows, whose one
    rectangle (no key bound) spans the runs of its rows; a row that sees nothing may be in none."""
    blocks, _ = _doc_step()
    row_keys, key_rows = packing.row_intervals(_rect_columns(blocks))
    runs = row_keys if by == "query" else key_rows
    host, g, tiles, _ = packing.packed_groups(runs, by, 64, NO_BOUND)
    rects = host[:8 * g].reshape(g, 8)
    assert tiles == g and np.array_equal(host[8 * g:9 * g + 1], np.arange(g + 1))
    own, other = (0, 2) if by == "query" else (2, 0)
    covered = np.zeros(runs.shape[0], int)
    for r in rects:
        assert r[own] % 64 == 0 and 0 < r[own + 1] <= 64
        assert tuple(r[4:]) == (0, 0, NO_BOUND, NO_BOUND)
        rows = runs[r[own]:r[own] + r[own + 1]]
        seen = rows[:, 0] < rows[:, 1]
        assert (rows[seen, 0] >= r[other]).all() and (rows[seen, 1] <= r[other] + r[other + 1]).all()
        covered[r[own]:r[own] + r[own + 1]] += 1
    seen = runs[:, 0] < runs[:, 1]
    assert (covered[seen] == 1).all() and (covered <= 1).all()


def test_packing_is_chosen_where_it_runs_fewer_tiles():
    """Small documents under per-document zigzag pack (fewer tiles than a tile a rectangle); a
    causal step of one sequence (few large rectangles) does not."""
    blocks, _ = _doc_step()
    cols = _rect_columns(blocks)
    for by in ("query", "key"):
        listed = packed_list(blocks, by, 128)
        assert listed is not None
        assert listed.work <= packing.PACK_GAIN * packing.list_tiles(cols, 128)
    part = layout.partition("zigzag", 2, 4096)
    one_sequence = layout.blocks(part, 0, 0, True, (-1, -1), None)
    assert len(one_sequence) >= 2
    assert packed_list(one_sequence, "query", 128) is None
    (groups,) = step_group_lists(np, one_sequence, [("query", 128)], pack=True)
    assert not groups.packed




def _kernel_tiles(blocks, t: int) -> int:
    """The (query tile, key tile) pairs the list kernels visit for `blocks` with square tiles of
    t, counted tile by tile from the rectangles' bounds as the kernels' `rect_view` walks them."""
    total = 0
    for b in blocks:
        hi = 0 if b.causal else (b.right if b.right >= 0 else NO_BOUND)
        lo = b.left if b.left >= 0 else NO_BOUND
        for q0 in range(0, b.q_len, t):
            q_last = min(q0 + t, b.q_len) - 1
            n_keys = max(0, min(b.k_len, b.q_pos + q_last + hi - b.k_pos + 1))
            first = b.q_pos + q0 - lo - b.k_pos
            begin = first // t if first > 0 else 0
            total += max(0, -(-n_keys // t) - begin)
    return total


def test_list_tiles_counts_the_tiles_the_list_kernels_visit():
    """`packing.list_tiles` (whole-array) against a walk over every rectangle's query tiles."""
    for blocks, _, _ in _random_steps(np.random.default_rng(3), 12):
        for t in (32, 64, 128):
            assert packing.list_tiles(_rect_columns(blocks), t) == _kernel_tiles(blocks, t)


def test_a_step_with_packed_and_unpacked_groupings():
    """Groupings packed and not in one step_group_lists call: every grouping's rectangles and
    offsets in one buffer; a packed grouping's runs the step's own (8-byte aligned int2 arrays;
    with NumPy the very arrays its memo keeps, not copied, and the next call's too); an unpacked
    grouping has no runs."""
    blocks, _ = _doc_step()
    assert hasattr(blocks, "memo")            # a layout.StepBlocks, as the ops get it
    grouped = step_group_lists(np, blocks, [("query", 128), ("key", 16)], pack=True)
    packed, plain = grouped
    assert packed.packed and not plain.packed and plain.row_keys is None
    row_keys, key_rows = packing.row_intervals(_rect_columns(blocks))
    assert np.array_equal(packed.row_keys, row_keys) and np.array_equal(packed.key_rows, key_rows)
    assert packed.row_keys.ctypes.data % 8 == 0 and packed.key_rows.ctypes.data % 8 == 0
    base = packed.rects.base if packed.rects.base is not None else packed.rects
    for groups in grouped:   # the rectangles and offsets: views of one uploaded buffer
        for x in (groups.rects, groups.offsets):
            assert np.shares_memory(x, base)
    assert not np.shares_memory(packed.row_keys, base)
    (again,) = step_group_lists(np, blocks, [("key", 64)], pack=True)
    assert again.packed and again.row_keys is packed.row_keys and again.key_rows is packed.key_rows
    unpacked = step_group_lists(np, blocks, [("key", 16)])[0]
    assert np.array_equal(plain.rects, unpacked.rects) and np.array_equal(plain.offsets, unpacked.offsets)


def test_a_step_that_keeps_no_pair_is_not_packed():
    """Causal rectangles whose keys all lie after their queries keep no pair: no packed grouping
    (it would launch a grid of 0 tiles); the rectangle list's launch, whose tiles do nothing."""
    blocks = [Block(0, 16, 0, 16, 0, 100, True), Block(16, 16, 16, 16, 0, 100, True)]
    assert packed_list(blocks, "query", 64) is None
    (groups,) = step_group_lists(np, blocks, [("query", 64)], pack=True)
    assert not groups.packed and groups.tiles == 2


def test_the_ops_keep_a_packed_and_an_unpacked_list_apart():
    """KernelOps.step_lists caches a step's lists per pack_lists: packed with it on, a tile a
    rectangle with it off, each built once."""
    pytest.importorskip("ml_dtypes")
    from burstcu.ops.cuda import KernelOps

    ops = KernelOps("emulated")
    blocks, _ = _doc_step()
    first = ops.step_lists(blocks, [("query", 64)])
    assert first[0].packed and ops.step_lists(blocks, [("query", 64)]) is first
    ops.pack_lists = False
    assert not ops.step_lists(blocks, [("query", 64)])[0].packed
    ops.pack_lists = True
    assert ops.step_lists(blocks, [("query", 64)]) is first


def _whole_rectangles(rng, trials: int):
    """cols (8, n) int64 of `trials` random sets of rectangles that keep every pair: runs of rows
    (gaps between them or none), each seeing a run of keys that moves forward (overlapping the
    run before where no row lies between), some split into rectangles of the same rows and keys
    one after another, a few rectangles with no row or no key, bands wide enough to cut nothing
    or none, in any order; a fifth of them then disturbed (keys shifted, rows moved) so that some
    no longer have a packed form or no longer keep every pair."""
    for _ in range(trials):
        rects, row, key_start, key_stop = [], 0, 0, 0
        for _ in range(int(rng.integers(1, 8))):
            gap = int(rng.integers(0, 3))
            row += gap
            start = int(rng.integers(key_stop if gap else key_start, key_stop + 3))
            stop = max(start + 1, key_stop, int(rng.integers(start + 1, start + 8)))
            rows = int(rng.integers(1, 6))
            cuts = np.unique(np.r_[start, rng.integers(start, stop, int(rng.integers(0, 3))), stop])
            rects += [[row, rows, a, b - a] for a, b in zip(cuts[:-1], cuts[1:])]
            row, key_start, key_stop = row + rows, start, stop
        dead = [[int(rng.integers(0, row + 1)), 0, 0, 3], [row + int(rng.integers(0, 4)), 2, 0, 0],
                [0, 0, key_stop + int(rng.integers(0, 4)), 2]]   # no row or no key: anywhere
        rects += [d for d in dead if rng.random() < 0.2]
        cols = np.array(rects, np.int64).T
        m = cols.shape[1]
        offset = rng.integers(-50, 50, m)                  # k_pos - q_pos
        q_pos = rng.integers(0, 100, m)
        wide = np.where(rng.random(m) < 0.5, NO_BOUND, 0)
        hi = np.maximum(wide, offset + cols[3] - 1 + rng.integers(0, 3, m))
        lo = np.maximum(wide, cols[1] - 1 - offset + rng.integers(0, 3, m))
        cols = np.concatenate([cols, [q_pos, q_pos + offset, hi, lo]])[:, rng.permutation(m)]
        if rng.random() < 0.2:
            i = int(rng.integers(0, m))
            cols[int(rng.choice([0, 2, 6, 7])), i] += int(rng.integers(-3, 4))
            cols[6:, i] = np.maximum(cols[6:, i], -4)
            cols[[0, 2], i] = np.maximum(cols[[0, 2], i], 0)
        yield cols


def test_rectangles_keeping_every_pair_take_the_shortcut_with_the_same_runs():
    """`_whole_row_intervals`, the shortcut for rectangles that keep every pair, gives the
    pieces' arrays bit for bit (row_keys, and key_rows with the empty runs' positions too) where
    it answers, and leaves to the pieces the sets it refuses; the pieces themselves are checked
    against the dense mask above."""
    taken = refused = 0
    for cols in _whole_rectangles(np.random.default_rng(5), 3000):
        q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo = cols
        q_end, k_end = int((q_start + q_len).max()), int((k_start + k_len).max())
        pieces = packing._pieces_row_intervals(q_start, q_len, k_start, k_start + k_len, q_pos,
                                               k_pos, hi, lo, q_end, k_end)
        runs = packing.row_intervals(cols)      # whichever way it took: the pieces' arrays
        assert (runs is None) == (pieces is None) or cols[1].sum() > packing.MAX_ROW_REPEATS * q_end
        if runs is not None:
            assert all(np.array_equal(a, b) for a, b in zip(runs, pieces)), cols.T
        live = (q_len > 0) & (k_len > 0)
        whole = live & (k_pos - q_pos >= q_len - 1 - lo) & (k_pos - q_pos + k_len - 1 <= hi)
        if not np.array_equal(whole, live):
            continue
        shortcut = packing._whole_row_intervals(q_start[live], q_len[live], k_start[live],
                                                (k_start + k_len)[live], q_end, k_end)
        if shortcut is None:
            refused += 1
            continue
        taken += 1
        assert pieces is not None, cols.T
        for a, b in zip(shortcut, pieces):
            assert a.dtype == b.dtype == np.int32 and np.array_equal(a, b), cols.T
    assert taken >= 1500 and refused >= 100, (taken, refused)
