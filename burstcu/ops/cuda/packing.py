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
    a key no row sees (x where its rows would start).

    Steps whose rectangles keep every pair take a shortcut (`_whole_row_intervals`). Others
    work in pieces of rows, not row by row (`_pieces_row_intervals`): in step rows x, a
    rectangle's row x sees the keys [max(k_start, x + a), min(k_stop, x + b)), each end constant
    or rising one a row, and cutting
    the rows wherever some rectangle starts or stops seeing keys or an end of its turns from
    constant to rising (or back) leaves pieces on which every end is one line. On a piece, the
    runs of its rectangles keep their order (two disjoint runs that rise at most one a row cannot
    pass each other), so the union's first key is the leftmost run's, its end the rightmost's,
    and the union is one run iff its length equals the runs' lengths summed (pairs never repeat,
    by contract), which, both sides being lines, holds on the piece iff it holds at its first
    row with equal slopes (on a piece of two rows or more). The rows' arrays are then written
    from the pieces by cumulative sums."""
    if cols.shape[1] == 0:
        return None
    q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo = cols.astype(np.int64)
    q_end, k_end = int((q_start + q_len).max()), int((k_start + k_len).max())
    total = int(q_len.sum())
    if total > MAX_ROW_REPEATS * q_end:
        return None
    k_stop = k_start + k_len
    live = (q_len > 0) & (k_len > 0)
    whole = live & (k_pos - q_pos >= q_len - 1 - lo) & (k_pos - q_pos + k_len - 1 <= hi)
    if live.any() and np.array_equal(whole, live):
        runs = _whole_row_intervals(q_start[live], q_len[live], k_start[live], k_stop[live], q_end, k_end)
        if runs is not None:
            return runs
    return _pieces_row_intervals(q_start, q_len, k_start, k_stop, q_pos, k_pos, hi, lo, q_end, k_end)


def _whole_row_intervals(q_start, q_len, k_start, k_stop, q_end: int, k_end: int):
    """`row_intervals` of rectangles that keep every pair (no key bound cuts one; the steps of
    documents away from the diagonal) where a row's rectangles are one or several with the same
    rows whose keys follow one another, and the rows' runs do not go back: then every row sees
    the keys of its rectangles (one run), and the rows fall into segments of one run each. Else
    None (`_pieces_row_intervals` decides). int64 arrays of the rectangles with a row and a key."""
    order = np.lexsort((k_start, q_start))
    q_start, q_stop = q_start[order], (q_start + q_len)[order]
    k_start, k_stop = k_start[order], k_stop[order]
    same = (q_start[1:] == q_start[:-1]) & (q_stop[1:] == q_stop[:-1])
    if same.any():                                     # the same rows: keys one after another
        if np.any(same & (k_start[1:] != k_stop[:-1])):
            return None
        first, last = np.append(True, ~same), np.append(~same, True)
        q_start, q_stop, k_start, k_stop = q_start[first], q_stop[first], k_start[first], k_stop[last]
    gap = q_start[1:] > q_stop[:-1]                     # rows between two rectangles see no key
    if (np.any(q_start[1:] < q_stop[:-1]) or np.any(k_stop[1:] < k_stop[:-1])
            or np.any(k_start[1:] < np.where(gap, k_stop[:-1], k_start[:-1]))):
        return None
    # segments of rows: before the first rectangle, then each rectangle and the rows after it
    n = q_start.size
    start, end, length = (np.empty(2 * n + 1, np.int64) for _ in range(3))
    start[0] = end[0] = 0
    length[0] = q_start[0]
    start[1::2], end[1::2], length[1::2] = k_start, k_stop, q_stop - q_start
    start[2::2] = end[2::2] = k_stop
    length[2::2] = np.append(q_start[1:], q_end) - q_stop
    row_keys = _columns(np.repeat(start + (end << 32), length))
    # key j: seen from the rows whose run ends at or before it, up to those that start at or
    # before it: each segment's rows counted at its end (start), then summed over the keys
    counts = np.zeros(k_end + 1, np.int64)
    np.add.at(counts, end, length)
    np.add.at(counts, start, length << 32)
    key_rows = _columns(np.cumsum(counts, out=counts))[:k_end]
    for x in (row_keys, key_rows):
        x.flags.writeable = False
    return row_keys, key_rows


def _pieces_row_intervals(q_start, q_len, k_start, k_stop, q_pos, k_pos, hi, lo, q_end: int, k_end: int):
    """`row_intervals` of any rectangles (its docstring's pieces); int64 fields."""
    k_len = k_stop - k_start
    a = k_start + q_pos - k_pos - lo - q_start
    b = a + lo + hi + 1
    x0 = np.maximum(q_start, k_start - b + 1)          # its rows that see a key: [x0, x1)
    x1 = np.minimum(q_start + q_len, k_stop - a)
    live = (x0 < x1) & (k_len > 0) & (a < b)
    a, b, k_start, k_stop, x0, x1 = (v[live] for v in (a, b, k_start, k_stop, x0, x1))
    rises = np.clip(k_start - a + 1, x0, x1)           # from here its first key rises
    stops = np.clip(k_stop - b + 1, x0, x1)            # from here its end is k_stop
    marks = np.zeros(q_end + 1, bool)
    for x in (x0, x1, rises, stops, [0, q_end]):
        marks[x] = True
    cuts = np.flatnonzero(marks)                       # piece p: rows [cuts[p], cuts[p + 1])
    p0 = np.searchsorted(cuts, x0)
    owner, piece = ragged(p0, np.searchsorted(cuts, x1) - p0)   # each rectangle's pieces
    at = cuts[piece]
    lo_rise = (at >= rises[owner]).astype(np.int64)
    hi_rise = (at < stops[owner]).astype(np.int64)
    first = np.where(lo_rise == 1, at + a[owner], k_start[owner])   # at the piece's first row
    end = np.where(hi_rise == 1, at + b[owner], k_stop[owner])
    n = cuts.size - 1
    lo_key, hi_key = np.full(n, np.iinfo(np.int64).max), np.full(n, -1, np.int64)
    count, count_rise = np.zeros(n, np.int64), np.zeros(n, np.int64)
    np.minimum.at(lo_key, piece, 2 * first + lo_rise)  # the leftmost run, with its slope
    np.maximum.at(hi_key, piece, 2 * end + hi_rise)    # the rightmost
    np.add.at(count, piece, end - first)
    np.add.at(count_rise, piece, hi_rise - lo_rise)
    seen = hi_key >= 0
    lo_v, lo_s, hi_v, hi_s = lo_key >> 1, lo_key & 1, hi_key >> 1, hi_key & 1
    length = np.diff(cuts)
    if np.any(((hi_v - lo_v != count) | ((hi_s - lo_s != count_rise) & (length > 1)))[seen]):
        return None
    # a piece that sees nothing: the run [x, x), x the largest end before it
    reach = np.maximum.accumulate(np.where(seen, hi_v + hi_s * (length - 1), 0))
    value = np.stack([np.where(seen, lo_v, reach), np.where(seen, hi_v, reach)], axis=1)
    rise = np.stack([lo_s, hi_s], axis=1) * seen[:, None]
    last = value + rise * (length - 1)[:, None]        # at the piece's last row
    if np.any(value[1:] < last[:-1]):
        return None                                    # an end goes back
    steps = np.repeat(rise[:, 0] + (rise[:, 1] << 32), length)   # the step from the row before
    jump = value - np.concatenate([np.zeros((1, 2), np.int64), last[:-1]])
    steps[cuts[:-1]] = jump[:, 0] + (jump[:, 1] << 32)
    row_keys = _columns(np.cumsum(steps, out=steps))
    # key j: seen from the rows whose run ends at or before j, counted, up to those that start
    # at or before it (a row's run never ending before it starts, the second count is the larger)
    key_rows = _rows_at_or_below(value[:, ::-1], rise[:, ::-1], length, k_end)
    for x in (row_keys, key_rows):
        x.flags.writeable = False
    return row_keys, key_rows


def _rows_at_or_below(value: np.ndarray, rise: np.ndarray, length: np.ndarray, n: int) -> np.ndarray:
    """(n, 2) int32: for each j < n and column c, how many rows hold a value <= j in that column
    (values in [0, n]), the rows in pieces: in piece p's length[p] rows, column c holds
    value[p, c] each (rise[p, c] 0) or value[p, c], value[p, c] + 1, ... (rise 1)."""
    counts = np.zeros(n + 2, np.int64)                 # both columns at once (`_columns`)
    weight = np.where(rise == 1, 1, length[:, None])   # rows a value
    stop = np.minimum(value + np.where(rise == 1, length[:, None], 1), n + 1)
    for c in (0, 1):
        np.add.at(counts, value[:, c], weight[:, c] << 32 * c)
        np.add.at(counts, stop[:, c], -(weight[:, c] << 32 * c))
    np.cumsum(counts, out=counts)                      # rows holding j
    np.cumsum(counts, out=counts)                      # rows holding j or less
    return _columns(counts)[:n]


def _columns(pairs: np.ndarray) -> np.ndarray:
    """(m, 2) int32 of `pairs` (m,) int64, each a + b 2^32: column 0 the a, column 1 the b (a
    view where the low word comes first). Such numbers add both columns at once, so one pass of
    `add.at` or `cumsum` over them does the work of two over int32 columns (or one over a
    strided pair of them, slower), and exactly: wherever each column's sum so far lies in
    [0, 2^31), the int64's words are the two columns' sums. Every count and key row here does."""
    columns = pairs.view(np.int32).reshape(-1, 2)
    return columns if np.little_endian else np.ascontiguousarray(columns[:, ::-1])


def list_tiles(cols: np.ndarray, tile_rows: int) -> int:
    """Tiles of tile_rows x tile_rows pairs a rectangle list of `cols` (as `row_intervals`) runs:
    for each query tile of each rectangle, the key tiles from the one holding its first row's
    first key to the one holding its last row's last key (the list kernels skip the others). A
    rectangle that keeps every pair runs all its tiles, ceil(q_len / T) ceil(k_len / T); the
    others are counted query tile by query tile."""
    t = tile_rows
    q_start, q_len, k_start, k_len, q_pos, k_pos, hi, lo = cols
    live = (q_len > 0) & (k_len > 0)
    whole = live & (k_pos - q_pos >= q_len - 1 - lo) & (k_pos - q_pos + k_len - 1 <= hi)
    total = int(np.sum(-(-q_len[whole] // t) * -(-k_len[whole] // t)))
    bounded = live & ~whole
    if not bounded.any():
        return total
    q_len, k_len, q_pos, k_pos, hi, lo = (x[bounded] for x in (q_len, k_len, q_pos, k_pos, hi, lo))
    owner, m0 = ragged(np.zeros_like(q_len), -(-q_len // t))
    m0 = m0 * t
    offset = (q_pos - k_pos)[owner] + m0                   # q_pos + m0 - k_pos
    first = np.maximum(0, offset - lo[owner])
    end = np.minimum(k_len[owner], offset + np.minimum(t, q_len[owner] - m0) - 1 + hi[owner] + 1)
    return total + int(np.sum(np.maximum(0, -(-end // t) - first // t)))


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
    """A packed grouping of `runs` (row_keys for by "query", key_rows for "key"; both ends never
    decrease, as `row_intervals` makes them). Group t: the rows [t T, t T + T) (the last cut at
    the runs' end) that see anything, against the run of the other side's rows they see together
    (from its first seeing row's start to its last one's end, the ends never decreasing);
    positions 0 and key bounds `no_bound`, so that only the runs mask."""
    t = tile_rows
    rows = runs.shape[0]
    tiles = -(-rows // t)
    seeing = np.zeros(tiles * t, bool)                 # rows cut into tiles, the last padded
    np.less(runs[:, 0], runs[:, 1], out=seeing[:rows])
    seeing = seeing.reshape(tiles, t)
    live = np.flatnonzero(seeing.any(axis=1))
    seeing = seeing[live]
    g = live.size
    own_start = live * t
    own_len = np.minimum(t, rows - own_start)
    other_start = runs[own_start + seeing.argmax(axis=1), 0].astype(np.int64)   # first seeing row
    other_len = runs[own_start + (t - 1 - seeing[:, ::-1].argmax(axis=1)), 1] - other_start
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
