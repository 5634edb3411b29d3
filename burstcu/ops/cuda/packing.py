"""Packed rectangle lists: a ring step of many small rectangles re-cut into the kernels' tiles.

With documents packed into one sequence (cu_seqlens) under per-document zigzag, a step holds a few
rectangles a document, each a few dozen rows (a 272-token document over 4 ranks is cut into
34-row pieces), while a kernel's tile holds 64-128 rows: a rectangle list (`params.step_group_lists`)
runs one mostly empty tile a rectangle. A packed list cuts the step into tiles of the kernel's
rows instead, each holding pieces of several documents, and says which pairs are kept with one
interval a row (kernels/params.cuh, "A PACKED list"):

    row_keys (q_end, 2) int32  query row i sees the key rows [row_keys[i, 0], row_keys[i, 1])
    key_rows (k_end, 2) int32  key row j is seen by the query rows [key_rows[j, 0], key_rows[j, 1])

q_end and k_end are the step's last query and key rows + 1. These exist where the keys every query
row sees form one run of key rows and neither end of the runs decreases from one row to the next
(`row_intervals`; then the rows that see a key form one run too). burstcu.layout's steps are so:
a rank's rows are in position order, a document's pieces lie next to each other, and a row sees
keys from its document's first (or its window's) up to a bound that moves with the row. A list
that is not so is never packed.

A packed grouping (`packed_groups`) has one group a tile of `tile_rows` rows (query rows, or key
rows for the dK/dV kernels) that sees any key, with one rectangle: its rows against the run of
keys (queries) its rows see together, no key bound (hi = lo = NO_BOUND). Which grouping is packed
is decided by counting tiles (`worth_packing`): a rectangle list runs, for each query tile of
each rectangle, the key tiles its rows' bounds reach (`list_tiles`), a packed one ceil(span / T)
key tiles a tile (T = tile_rows, square tiles); pack where that is at most PACK_GAIN of the
other. The masks cost a packed tile a little more (every tile runs the element test), hence a
gain below 1; a step without masked pairs (documents without a causal mask) pays the careful
pair's check of its inputs too, which the count leaves out. The tiles are square, where the
kernels' are not all (32 x 64 for some dK/dV tables): the ratio is a model, not a measurement
(bench/gpu/step_lists.py times both ways).

Whole-array NumPy throughout; the results are kept in the step's memo by `params`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...layout import ragged

# pack a grouping when its packed tiles are at most this fraction of the rectangle list's
PACK_GAIN = 0.8
# rows of rectangles, counted with repeats, above which a step is not looked at for packing
# (many rectangles over the same rows: a block mask of long ranges, where tiles are full already)
MAX_ROW_REPEATS = 8


def row_intervals(cols: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(row_keys (q_end, 2), key_rows (k_end, 2)) int32 of the rectangles whose BlockRect fields
    are the rows of `cols` (8, n) int64 (q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo:
    pair (i, j) of a rectangle, counted from its q_start and k_start, kept iff q_pos + i - lo <=
    k_pos + j <= q_pos + i + hi), or None where a row's keys are not one run, the runs' ends
    decrease somewhere, or rows repeat more than MAX_ROW_REPEATS times over. A row that sees no
    key gets the empty run [x, x), x the largest end of the rows before it (0 at first); so does
    a key no row sees (x where its rows would start)."""
    if cols.shape[1] == 0:
        return None
    # int32 throughout (half the memory traffic): positions stay below 2^30 and the bounds at
    # most NO_BOUND = 2^29, so every sum below fits
    q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo = cols.astype(np.int32)
    q_end, k_end = int((q_start + q_len).max()), int((k_start + k_len).max())
    total = int(q_len.sum())
    if total > MAX_ROW_REPEATS * q_end or total >= 2**31:
        return None
    first_of = (q_len.cumsum() - q_len).astype(np.int32)   # each rectangle's first expanded row
    row = np.arange(total, dtype=np.int32) + np.repeat(q_start - first_of, q_len)
    offset = row + np.repeat(q_pos - k_pos - q_start, q_len)   # q_pos + i - k_pos
    first = np.maximum(0, offset - np.repeat(lo, q_len))
    end = np.minimum(np.repeat(k_len, q_len), offset + np.repeat(hi, q_len) + 1)
    base = np.repeat(k_start, q_len)
    seen = first < end
    run_lo = np.full(q_end, np.iinfo(np.int32).max, np.int32)
    run_hi = np.zeros(q_end, np.int32)
    keys = np.zeros(q_end, np.int32)
    np.minimum.at(run_lo, row, np.where(seen, base + first, run_lo[0]))
    np.maximum.at(run_hi, row, np.where(seen, base + end, 0))
    np.add.at(keys, row, np.maximum(end - first, 0))
    sees = keys > 0
    if np.any(run_hi[sees] - run_lo[sees] != keys[sees]):
        return None   # not one run (pairs never repeat, by contract: a repeat hidden by a gap
                      # of its size would pass this test; `layout.blocks` and BlockMask make none)
    before = np.maximum.accumulate(np.where(sees, run_hi, 0))
    run_lo = np.where(sees, run_lo, before)
    run_hi = np.where(sees, run_hi, before)
    if np.any(run_lo[1:] < run_lo[:-1]) or np.any(run_hi[1:] < run_hi[:-1]):
        return None
    # the rows that see key j: from the first whose run ends past j (the rows whose run ends at
    # or before j, counted) to the last whose run starts at or before j (both ends sorted)
    seen_from = np.bincount(run_hi, minlength=k_end + 1).cumsum()[:k_end]
    seen_to = np.maximum(np.bincount(run_lo, minlength=k_end + 1).cumsum()[:k_end], seen_from)
    row_keys = np.stack([run_lo, run_hi], axis=1).astype(np.int32)
    key_rows = np.stack([seen_from, seen_to], axis=1).astype(np.int32)
    for x in (row_keys, key_rows):
        x.flags.writeable = False
    return row_keys, key_rows


def list_tiles(cols: np.ndarray, tile_rows: int) -> int:
    """Tiles of tile_rows x tile_rows pairs a rectangle list of `cols` (as `row_intervals`) runs:
    for each query tile of each rectangle, the key tiles from the one holding its first row's
    first key to the one holding its last row's last key (the list kernels skip the others)."""
    t = tile_rows
    q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo = cols
    owner, m0 = ragged(np.zeros_like(q_len), -(-q_len // t))
    m0 = m0 * t
    offset = (q_pos - k_pos)[owner] + m0                   # q_pos + m0 - k_pos
    first = np.maximum(0, offset - lo[owner])
    end = np.minimum(k_len[owner], offset + np.minimum(t, q_len[owner] - m0) - 1 + hi[owner] + 1)
    return int(np.sum(np.maximum(0, -(-end // t) - first // t)))


class PackedGroups(NamedTuple):
    """A packed grouping in `params.step_group_lists`' layout. host (10 g + 2,) int32: g
    BlockRects, one a group, then each group's first rectangle and g, then each group's first
    tile and g; n_groups g; tiles the launch's grid.x (g: a tile a group); work the tiles of
    tile_rows x tile_rows pairs it runs (`list_tiles`' unit)."""

    host: np.ndarray
    n_groups: int
    tiles: int
    work: int


def packed_groups(runs: np.ndarray, by: str, tile_rows: int, no_bound: int) -> PackedGroups:
    """A packed grouping of `runs` (row_keys for by "query", key_rows for "key"). Group t: the
    rows [t T, t T + T) (the last cut at the runs' end) that see anything, against the run of the
    other side's rows they see together; positions 0 and key bounds `no_bound`, so that only the
    runs mask."""
    t = tile_rows
    rows = runs.shape[0]
    starts = np.arange(0, rows, t)
    seen = runs[:, 0] < runs[:, 1]
    lo = np.minimum.reduceat(np.where(seen, runs[:, 0], np.iinfo(np.int32).max), starts)
    hi = np.maximum.reduceat(np.where(seen, runs[:, 1], -1), starts)
    live = (hi > lo).nonzero()[0]
    g = live.size
    own_start = starts[live]
    own_len = np.minimum(t, rows - own_start)
    other_start, other_len = lo[live], hi[live] - lo[live]
    zero = np.zeros(g, np.int64)
    bound = np.full(g, no_bound, np.int64)
    if by == "query":
        fields = (own_start, own_len, other_start, other_len, zero, zero, bound, bound)
    else:
        fields = (other_start, other_len, own_start, own_len, zero, zero, bound, bound)
    host = np.empty(10 * g + 2, np.int32)
    host[:8 * g].reshape(g, 8)[:] = np.stack(fields, axis=1)
    host[8 * g:9 * g + 1] = np.arange(g + 1)
    host[9 * g + 1:] = np.arange(g + 1)
    host.flags.writeable = False
    return PackedGroups(host, g, g, int(np.sum(-(-other_len // t))))


def worth_packing(listed_tiles: int, packed_tiles: int) -> bool:
    """Whether a packed grouping of `packed_tiles` beats the list's `listed_tiles` (PACK_GAIN)."""
    return packed_tiles <= PACK_GAIN * listed_tiles
