"""How a global sequence is split across the ranks, and which (query, key) tiles a mask keeps.

Layouts (G ranks, global sequence length N, any N >= G; rank r holds S_r rows):

* ``"contiguous"``: rank r holds one run of consecutive positions; by default the G runs are
  near-equal (`near_equal`: the first N % G ranks one row longer), and ranks may hold any
  lengths they agree on (`partition(..., lengths=...)`), e.g. 1000, 1001 and 1000 of N = 3001.
* ``"zigzag"``: the sequence is cut into 2G near-equal chunks; rank r holds chunk r followed by
  chunk 2G-1-r. Under a causal mask every rank then owns one early and one late chunk, so the
  ring steps carry equal work on every rank (contiguous leaves rank 0 nearly idle, rank G-1
  busiest). With documents (cu_seqlens) *each document* is cut into 2G near-equal pieces and
  rank r holds pieces r and 2G-1-r of every document, document by document, so causal work
  stays balanced whatever the mix of lengths (no document needs to divide by anything).
* ``"documents"``: per-document zigzag, except that a document short enough is held whole by
  one rank (`_whole_documents`): the short documents are dealt out longest first, each to the
  rank it leaves least loaded in rows and causal pairs, so that no rank holds more than
  DOCUMENT_SLACK of a rank's share more rows or causal pairs than per-document zigzag's fullest
  rank; the longer documents are cut as zigzag cuts them. A short document then runs in the
  ring's local step alone (its rows' state is read and written once, not in every step, and its
  rectangles are not 2G pieces a few dozen rows long). Without documents it is zigzag.

A `Partition` lists every rank's rows as `Segment`s (runs of consecutive global positions, in
local order); the strategies take one, so any split works alike. For one ring step,
`rectangles` pairs this rank's query segments with the segments of the rank whose K/V it holds
(cut at document boundaries), drops pairs that lie wholly outside the mask, and marks the pairs
that straddle the diagonal or a window's edge, which need the per-element tests: one array of
`RECTANGLE` rows, built with whole-array operations, cached, ready to be uploaded whole;
`blocks` gives the same rows as a cached `StepBlocks`: the array seen as a sequence of `Block`s,
which the local ops read whole (`bench/cpu/varlen.py --schedule` times both).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:   # blockmask builds on this module (`ragged`)
    from .blockmask import BlockMask

LAYOUTS = ("contiguous", "zigzag", "documents")
# "documents": a rank may hold this fraction of a rank's share of the rows (and of the causal
# pairs) more than per-document zigzag's fullest rank does
DOCUMENT_SLACK = 0.05


class Segment(NamedTuple):
    """`length` local rows starting at local row `local`, holding global positions from `pos`
    (a named tuple: a partition of many documents holds thousands)."""

    local: int
    pos: int
    length: int


class Block(NamedTuple):
    """One rectangle of a ring step's attention: local query rows x local key rows (a named
    tuple: a step of many documents holds thousands, built at 0.8 us each).

    q_start, q_len: local query rows [q_start, q_start + q_len).
    k_start, k_len: rows of the K/V block being visited [k_start, k_start + k_len).
    q_pos, k_pos: global positions of rows q_start and k_start (under a block mask both are
        shifted alike so that the tests below say its diagonals: only k_pos - q_pos counts;
        `_block_mask_rectangles`).
    causal: True when the rectangle straddles the diagonal, so element (i, j) is kept only if
        q_pos + i >= k_pos + j. False means every element is kept.
    left, right: a sliding window's bounds that cut through the rectangle (-1: they do not):
        element (i, j) is kept only if k >= q - left and k <= q + right, q = q_pos + i and
        k = k_pos + j. All three tests apply together.
    """

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    q_pos: int
    k_pos: int
    causal: bool
    left: int = -1
    right: int = -1

    @property
    def masked(self) -> bool:
        """Whether some element of the rectangle is masked (needs the per-element tests)."""
        return self.causal or self.left >= 0 or self.right >= 0


class StepBlocks(Sequence):
    """A ring step's rectangles, what `blocks` returns: one read-only `RECTANGLE` array (`array`)
    seen as a sequence of `Block`s, made as they are read (none are kept: a local op that reads
    the step whole, `burstcu.ops.cuda.params.block_column`, never makes them). Immutable and
    cached by `blocks` per (partition, ranks, mask), so a model's layers meet the same object
    again: `memo` keeps what a local op derives from the rectangles alone (the kernels'
    rectangle lists), and a local op may keep device copies while the object lives (weakly)."""

    __slots__ = ("array", "memo", "__weakref__")

    def __init__(self, array: np.ndarray):
        self.array = array.view()
        self.array.flags.writeable = False
        self.memo: dict = {}

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(map(Block._make, self.array[index].tolist()))
        return Block._make(self.array[index].tolist())

    def __iter__(self):
        return map(Block._make, self.array.tolist())

    def __repr__(self) -> str:
        return f"StepBlocks({list(self)!r})"


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")


@dataclass(frozen=True)
class Partition:
    """Which global positions every rank holds: runs[r] are rank r's `Segment`s in local order
    (their lengths add up to rank r's S_r; together the runs cover [0, N) once). Hashable, so
    the schedules derived from it are cached."""

    layout: str
    runs: tuple[tuple[Segment, ...], ...]

    @cached_property
    def _hash(self) -> int:
        return hash((self.layout, self.runs))

    def __hash__(self) -> int:   # computed once: a partition of many documents has many segments
        return self._hash

    def __reduce__(self):         # pickled without what it computed (a hash is per process)
        return Partition, (self.layout, self.runs)

    @cached_property
    def arrays(self) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]:
        """Every rank's segments as read-only arrays (first positions, lengths, first local
        rows)."""
        def column(values) -> np.ndarray:
            out = np.array(values, np.int64).reshape(-1)
            out.flags.writeable = False
            return out
        return tuple(tuple(column(values) for values in
                           zip(*((seg.pos, seg.length, seg.local) for seg in mine)))
                     for mine in self.runs)

    @property
    def size(self) -> int:
        return len(self.runs)

    @property
    def lengths(self) -> tuple[int, ...]:
        """S_r of every rank r."""
        return tuple(sum(seg.length for seg in mine) for mine in self.runs)

    @property
    def total(self) -> int:
        """N, the global sequence length."""
        return sum(self.lengths)

    @property
    def even(self) -> bool:
        """Whether every rank holds the same number of rows."""
        return len(set(self.lengths)) == 1

    def positions(self, rank: int) -> list[int]:
        """Global position of each of `rank`'s local rows."""
        return [p for seg in self.runs[rank] for p in range(seg.pos, seg.pos + seg.length)]


def near_equal(total: int, parts: int, first: int = 0) -> list[int]:
    """`total` split into `parts` lengths differing by at most one; the longer ones are those
    numbered first, first + 1, ... (mod parts)."""
    base, extra = divmod(total, parts)
    return [base + ((i - first) % parts < extra) for i in range(parts)]


def _runs(pieces: list[tuple[int, int]], merge: bool = False) -> tuple[Segment, ...]:
    """(pos, length) pieces, in local order, as Segments (empty ones dropped; with `merge`,
    touching ones joined)."""
    out: list[Segment] = []
    local = 0
    for pos, length in pieces:
        if length <= 0:
            continue
        if merge and out and out[-1].pos + out[-1].length == pos:
            last = out.pop()
            out.append(Segment(last.local, last.pos, last.length + length))
        else:
            out.append(Segment(local, pos, length))
        local += length
    return tuple(out)


# Partitions kept by the caches here: a varlen job brings new documents every batch, and one of
# many documents is megabytes (1000 documents cut in 2G pieces at G = 8: 2.4 MB), so a few.
PARTITIONS_KEPT = 16


@lru_cache(maxsize=PARTITIONS_KEPT)
def partition(layout: str, size: int, seqlen_global: int,
              cu_seqlens: tuple[int, ...] | None = None,
              lengths: tuple[int, ...] | None = None) -> Partition:
    """The rows of every rank under `layout` (module docstring).

    lengths: each rank's S_r (contiguous only; default near-equal). cu_seqlens: document
    boundaries (a tuple of ints); with "zigzag" each document is cut into 2G pieces, the longer
    pieces of a document going on where the previous document's stopped, so the ranks' lengths
    differ by at most 2; with "documents" the short ones are held whole (`_whole_documents`).
    Raises ValueError for a split it cannot make (lengths that do not add up to N, lengths with
    zigzag or documents, N < G).
    """
    check_layout(layout)
    if size < 1 or seqlen_global < size:
        raise ValueError(f"a sequence of {seqlen_global} positions cannot be split over {size} "
                         f"ranks (every rank needs at least one row)")
    if layout == "contiguous":
        if lengths is None:
            lengths = tuple(near_equal(seqlen_global, size))
        if len(lengths) != size or sum(lengths) != seqlen_global or min(lengths) < 1:
            raise ValueError(f"lengths {lengths} do not split {seqlen_global} positions over "
                             f"{size} ranks of at least one row each")
        starts = [sum(lengths[:r]) for r in range(size)]
        return Partition(layout, tuple(_runs([(starts[r], lengths[r])]) for r in range(size)))
    if lengths is not None:
        fixed = partition(layout, size, seqlen_global, cu_seqlens).lengths
        if tuple(lengths) != fixed:
            raise ValueError(f"{layout} fixes every rank's length ({seqlen_global} positions over "
                             f"{size} ranks: {fixed}); got {tuple(lengths)}")
    spans = np.array([0, seqlen_global] if cu_seqlens is None else cu_seqlens, np.int64)
    bounds, cut = _zigzag_pieces(spans, size)
    owner = _whole_documents(np.diff(spans), cut) if layout == "documents" else None
    cut_docs = None if owner is None else owner < 0
    runs, arrays = [], []
    for r in range(size):                            # pieces r and 2G-1-r of every document
        chunks = np.stack([r, 2 * size - 1 - r])
        pos, length = bounds[:, chunks], cut[:, chunks]
        if owner is not None:                        # ... cut, and the documents r holds whole
            mine = owner == r
            pos = np.concatenate([pos[cut_docs].reshape(-1), spans[:-1][mine]])
            length = np.concatenate([length[cut_docs].reshape(-1), (spans[1:] - spans[:-1])[mine]])
            order = np.argsort(pos, kind="stable")
            pos, length = pos[order], length[order]
        pos, length = pos.reshape(-1), length.reshape(-1)
        keep = length > 0
        pos, length = pos[keep], length[keep]
        local = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
        runs.append(tuple(map(Segment, local.tolist(), pos.tolist(), length.tolist())))
        for column in (pos, length, local):
            column.flags.writeable = False
        arrays.append((pos, length, local))
    part = Partition(layout, tuple(runs))
    object.__setattr__(part, "arrays", tuple(arrays))   # `Partition.arrays`, already at hand
    return part


def _zigzag_pieces(spans: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(first positions (D, 2G), lengths (D, 2G)) of the 2G near-equal pieces of each of the D
    documents between `spans` (D + 1 boundaries), the longer pieces of a document going on where
    the previous document's stopped."""
    lengths_of = np.diff(spans)
    first = np.concatenate([[0], np.cumsum(lengths_of)[:-1]]) % (2 * size)
    base, extra = np.divmod(lengths_of, 2 * size)
    cut = base[:, None] + ((np.arange(2 * size)[None, :] - first[:, None]) % (2 * size)
                           < extra[:, None])
    return spans[:-1, None] + np.cumsum(cut, axis=1) - cut, cut


def _whole_documents(lengths_of: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """(D,) the rank that holds each document whole under "documents", -1 where it is cut in the
    2G zigzag pieces `cut` (D, 2G). The candidates are the documents of at most a quarter of a
    rank's share of the rows and of the causal pairs; they are dealt out by most pairs first
    (ties: the first document), each to the rank whose larger load (rows or pairs, as a fraction
    of a rank's share) it leaves lowest (ties: the lowest rank), the other documents' zigzag
    pieces counted first; where that leaves a rank more than DOCUMENT_SLACK of a share above
    zigzag's fullest rank, the candidates are halved (an eighth, ...), down to none."""
    size = cut.shape[1] // 2
    pairs = lengths_of * (lengths_of + 1) // 2
    piece_pairs = cut * (np.cumsum(cut, axis=1) - cut) + cut * (cut + 1) // 2
    ranks = np.minimum(np.arange(2 * size), 2 * size - 1 - np.arange(2 * size))
    rows_cut = np.stack([cut[:, ranks == r].sum(axis=1) for r in range(size)], axis=1)
    pairs_cut = np.stack([piece_pairs[:, ranks == r].sum(axis=1) for r in range(size)], axis=1)
    share_rows, share_pairs = lengths_of.sum() / size, pairs.sum() / size
    most_rows = rows_cut.sum(axis=0).max() + DOCUMENT_SLACK * share_rows
    most_pairs = pairs_cut.sum(axis=0).max() + DOCUMENT_SLACK * share_pairs
    fraction = 0.25
    while fraction * share_rows >= 1:
        whole = (lengths_of <= fraction * share_rows) & (pairs <= fraction * share_pairs)
        rows, held = rows_cut[~whole].sum(axis=0).tolist(), pairs_cut[~whole].sum(axis=0).tolist()
        owner = np.full(lengths_of.size, -1)
        for d in np.flatnonzero(whole)[np.argsort(-pairs[whole], kind="stable")].tolist():
            n, p = int(lengths_of[d]), int(pairs[d])
            r = min(range(size), key=lambda r: max((rows[r] + n) / share_rows,
                                                   (held[r] + p) / share_pairs))
            owner[d], rows[r], held[r] = r, rows[r] + n, held[r] + p
        if max(rows) <= most_rows and max(held) <= most_pairs:
            return owner
        fraction /= 2
    return np.full(lengths_of.size, -1)


@lru_cache(maxsize=PARTITIONS_KEPT)
def grouped(part: Partition, u: int) -> Partition:
    """The partition of G/u super-ranks that groups of u consecutive ranks make (super-rank i:
    ranks i*u .. i*u+u-1, their rows sorted by position — the order Ulysses' all-to-all
    assembles them in, `burstcu.engine.ulysses.HeadExchange`)."""
    assert part.size % u == 0, f"groups of {u} do not split {part.size} ranks"
    supers = []
    for i in range(part.size // u):
        mine = sorted((seg.pos, seg.length) for r in range(i * u, (i + 1) * u)
                      for seg in part.runs[r])
        supers.append(_runs(mine, merge=True))
    return Partition(part.layout, tuple(supers))


def as_partition(layout: str | Partition, size: int, seqlen_local: int) -> Partition:
    """`layout` itself when it is a Partition (of `size` ranks), else the split of a layout name
    that gives every rank `seqlen_local` rows (N = G * seqlen_local; zigzag's 2G pieces then
    differ by at most one row, rank r's two adding up to seqlen_local, odd or even)."""
    if isinstance(layout, Partition):
        assert layout.size == size, f"a partition of {layout.size} ranks used by {size}"
        return layout
    part = partition(layout, size, seqlen_local * size)
    if part.lengths != (seqlen_local,) * size:
        raise ValueError(f"the {layout} layout of {seqlen_local * size} positions does not give each "
                         f"of {size} ranks {seqlen_local} rows: {part.lengths}")
    return part


def segments(layout: str | Partition, rank: int, size: int, seqlen_local: int) -> tuple[Segment, ...]:
    """The global positions of `rank`'s rows (see `as_partition` for the arguments)."""
    return as_partition(layout, size, seqlen_local).runs[rank]


def global_positions(layout: str | Partition, rank: int, size: int, seqlen_local: int) -> list[int]:
    """Global position of each local row (for tests and references)."""
    return as_partition(layout, size, seqlen_local).positions(rank)


def step_blocks(layout: str | Partition, q_rank: int, kv_rank: int, size: int, seqlen_local: int,
                causal: bool, window_size: tuple[int, int] = (-1, -1),
                cu_seqlens: tuple[int, ...] | None = None,
                block_mask: BlockMask | None = None) -> StepBlocks:
    """`blocks` of `as_partition(layout, size, seqlen_local)`."""
    return blocks(as_partition(layout, size, seqlen_local), q_rank, kv_rank, causal, window_size,
                  cu_seqlens, block_mask)


# one rectangle a row: `Block`'s fields, for arrays of a step's rectangles (`rectangles`)
RECTANGLE = np.dtype([("q_start", np.int64), ("q_len", np.int64), ("k_start", np.int64),
                      ("k_len", np.int64), ("q_pos", np.int64), ("k_pos", np.int64),
                      ("causal", np.bool_), ("left", np.int64), ("right", np.int64)], align=True)


def rectangle_rows(blocks: Block | Sequence[Block]) -> np.ndarray:
    """The `RECTANGLE` rows of one `Block`, of a `StepBlocks` (its array) or of any sequence of
    Blocks."""
    if isinstance(blocks, Block):
        return np.array([blocks], RECTANGLE)
    rows = getattr(blocks, "array", None)
    return np.array([tuple(blk) for blk in blocks], RECTANGLE) if rows is None else rows


def masked_rows(rows: np.ndarray) -> np.ndarray:
    """(n,) bool: which `RECTANGLE` rows some bound cuts (`Block.masked`, row by row)."""
    return rows["causal"] | (rows["left"] >= 0) | (rows["right"] >= 0)


def kept_pairs(blocks: Block | Sequence[Block]) -> int:
    """(query, key) pairs that one `Block`, or all Blocks of a sequence (a `StepBlocks` read
    whole), keeps, counted exactly: q_len x k_len where no bound cuts a Block, else per query
    row the keys between its lower and upper bound (whole-array over the cut Blocks' rows)."""
    rows = rectangle_rows(blocks)
    cut = masked_rows(rows)
    whole = rows[~cut]
    total = int(np.sum(whole["q_len"] * whole["k_len"]))
    rows = rows[cut]
    if rows.size == 0:
        return total
    owner, i = ragged(np.zeros(rows.size, np.int64), rows["q_len"])
    rows = rows[owner]
    q = rows["q_pos"] + i                                   # each query row's position
    upper = rows["k_pos"] + rows["k_len"] - 1
    upper = np.where(rows["causal"], np.minimum(upper, q), upper)
    upper = np.where(rows["right"] >= 0, np.minimum(upper, q + rows["right"]), upper)
    lower = np.where(rows["left"] >= 0, np.maximum(rows["k_pos"], q - rows["left"]), rows["k_pos"])
    return total + int(np.maximum(upper - lower + 1, 0).sum())


def blocks(part: Partition, q_rank: int, kv_rank: int, causal: bool,
           window_size: tuple[int, int] = (-1, -1),
           cu_seqlens: tuple[int, ...] | None = None,
           block_mask: BlockMask | None = None) -> StepBlocks:
    """The rectangles `q_rank`'s queries must attend to in `kv_rank`'s keys (empty: skip step),
    as one cached `StepBlocks`: `rectangles`, one Block a row (cu_seqlens: any sequence of
    ints)."""
    docs = None if cu_seqlens is None else tuple(int(b) for b in cu_seqlens)
    window = tuple(int(w) for w in window_size)
    return _step_blocks(part, q_rank, kv_rank, bool(causal), window, docs, block_mask)


@lru_cache(maxsize=128)   # as `rectangles`
def _step_blocks(part: Partition, q_rank: int, kv_rank: int, causal: bool, window_size: tuple,
                 cu_seqlens: tuple | None, block_mask: BlockMask | None) -> StepBlocks:
    return StepBlocks(rectangles(part, q_rank, kv_rank, causal, window_size, cu_seqlens, block_mask))


@lru_cache(maxsize=128)   # G^2 arrays a partition (`burst.needs`); varlen batches bring new ones
def rectangles(part: Partition, q_rank: int, kv_rank: int, causal: bool,
               window_size: tuple[int, int] = (-1, -1),
               cu_seqlens: tuple[int, ...] | None = None,
               block_mask: BlockMask | None = None) -> np.ndarray:
    """The rectangles `q_rank`'s queries must attend to in `kv_rank`'s keys, one `RECTANGLE` row
    each (a read-only array, cached; empty: skip the step). Built with whole-array operations,
    in time linear in the number of segment pieces.

    window_size = (left, right): a query at position q sees keys in [q - left, q + right] (-1:
    unbounded on that side; with causal the right bound is the diagonal). Rectangles wholly
    outside are dropped; those a bound cuts through carry it (`Block.left` / `Block.right`).
    cu_seqlens: document boundaries (0 = b_0 <= b_1 <= ... <= b_n = global length); a query
    sees keys of its own document [b_i, b_i+1) only. Each pair of segments is cut at the
    boundaries into one rectangle per document both touch, so a document is a set of rectangles
    and no kernel needs to know about it. Rows are ordered by query segment (local order), then
    key segment (by position), then document.
    block_mask: a `burstcu.BlockMask` instead (without causal, window or documents):
    `_block_mask_rectangles`.
    """
    if block_mask is not None:
        assert not causal and tuple(window_size) == (-1, -1) and cu_seqlens is None, \
            "a block mask comes alone"
        return _block_mask_rectangles(part, q_rank, kv_rank, block_mask)
    left, right = window_size
    hi = 0 if causal else (right if right >= 0 else None)   # keys up to q + hi
    lo = left if left >= 0 else None                          # keys from q - lo
    if hi is None and lo is None and cu_seqlens is None:  # no mask: one rectangle of all rows
        out = np.array([(0, part.lengths[q_rank], 0, part.lengths[kv_rank], 0, 0, False, -1, -1)],
                       RECTANGLE)
        out.flags.writeable = False
        return out
    q_doc, q_pos, q_len, q_local = _rank_pieces(part, q_rank, cu_seqlens)[:4]
    _, k_pos, k_len, k_local, by_position, first, count = _rank_pieces(part, kv_rank, cu_seqlens)
    # pair every query piece with the key pieces of its document, these by position: the query
    # pieces come by segment, then document, so the pairs come in the rows' order
    qi, ki = ragged(first[q_doc], count[q_doc])
    ki = by_position[ki]
    q0, q1 = q_pos[qi], (q_pos + q_len - 1)[qi]     # first and last query position
    k0, k1 = k_pos[ki], (k_pos + k_len - 1)[ki]     # first and last key position
    kept = np.ones(qi.size, bool)
    if hi is not None:
        kept &= k0 <= q1 + hi            # else every key is past every query's right bound
    if lo is not None:
        kept &= k1 >= q0 - lo            # else every key is before every query's left bound
    rows = kept.nonzero()[0]
    qi, ki = qi[rows], ki[rows]
    out = np.zeros(rows.size, RECTANGLE)   # zeros: the padding bytes too
    out["q_start"], out["q_len"], out["q_pos"] = q_local[qi], q_len[qi], q_pos[qi]
    out["k_start"], out["k_len"], out["k_pos"] = k_local[ki], k_len[ki], k_pos[ki]
    out["causal"], out["left"], out["right"] = False, -1, -1
    if hi is not None:                   # the right bound cuts through: causal, or a window's
        cut = k1[rows] > q0[rows] + hi
        if causal:
            out["causal"] = cut
        else:
            out["right"] = np.where(cut, hi, -1)
    if lo is not None:                   # the left bound cuts through
        out["left"] = np.where(k0[rows] < q1[rows] - lo, lo, -1)
    out.flags.writeable = False
    return out


def _block_mask_rectangles(part: Partition, q_rank: int, kv_rank: int,
                           mask: BlockMask) -> np.ndarray:
    """`rectangles` of a block mask: every piece of the mask (`BlockMask.pieces`) cut by
    `q_rank`'s query segments and `kv_rank`'s key segments, pieces that keep nothing dropped,
    rows ordered by first local query row, then key position.

    A piece keeps (i, j) iff lower <= j - i <= upper (global positions); a `Block` says the same
    with its positions shifted: q_pos = i0 + c for the first query position i0, so that its
    causal test (k_pos + j' <= q_pos + i') is j - i <= upper (c = upper) and its left bound is
    lower (left = upper - lower), or with only a lower bound c = lower and left = 0. Both
    positions then move together so that the smaller is 0 (only differences count; a Block no
    bound cuts gets 0 for both): a bound
    cuts the Block only where it lies within the offsets the Block holds, so its positions stay
    below twice its longer side and `left` below the sum of its sides."""
    pieces = mask.pieces
    q_piece, q0, q_len, q_local = _overlaps(pieces["q_start"], pieces["q_stop"], *part.arrays[q_rank])
    k_piece, k0, k_len, k_local = _overlaps(pieces["k_start"], pieces["k_stop"], *part.arrays[kv_rank])
    # every query overlap with every key overlap of the same piece (k_piece is ascending)
    first = np.searchsorted(k_piece, q_piece, "left")
    counts = np.searchsorted(k_piece, q_piece, "right") - first
    qi, ki = ragged(first, counts)
    lower, upper = pieces["lower"][q_piece[qi]], pieces["upper"][q_piece[qi]]
    qa, qb = q0[qi], q0[qi] + q_len[qi] - 1          # first and last query position
    ka, kb = k0[ki], k0[ki] + k_len[ki] - 1          # first and last key position
    kept = np.maximum(lower, ka - qb) <= np.minimum(upper, kb - qa)
    cut_upper, cut_lower = kb - qa > upper, ka - qb < lower
    rows = np.flatnonzero(kept)
    rows = rows[np.lexsort((ka[rows], q_local[qi[rows]]))]
    qi, ki, cut_upper, cut_lower = qi[rows], ki[rows], cut_upper[rows], cut_lower[rows]
    lower, upper = lower[rows], upper[rows]
    shift = np.where(cut_upper, upper, np.where(cut_lower, lower, 0))
    q_pos = q0[qi] + shift
    k_pos = np.where(cut_upper | cut_lower, k0[ki], q_pos)    # no bound: both 0 below
    base = np.minimum(q_pos, k_pos)
    out = np.zeros(rows.size, RECTANGLE)   # zeros: the padding bytes too
    out["q_start"], out["q_len"], out["q_pos"] = q_local[qi], q_len[qi], q_pos - base
    out["k_start"], out["k_len"], out["k_pos"] = k_local[ki], k_len[ki], k_pos - base
    out["causal"] = cut_upper
    out["left"] = np.where(cut_lower, np.where(cut_upper, upper - lower, 0), -1)
    out["right"] = -1
    out.flags.writeable = False
    return out


def _overlaps(start: np.ndarray, stop: np.ndarray, seg_pos: np.ndarray, seg_len: np.ndarray,
              seg_local: np.ndarray):
    """(range index, first position, length, first local row) of every non-empty overlap of the
    ranges [start, stop) with a rank's segments (`Partition.arrays`), ascending in the range
    index."""
    order = np.argsort(seg_pos, kind="stable")
    pos, end, local = seg_pos[order], seg_pos[order] + seg_len[order], seg_local[order]
    first = np.searchsorted(end, start, "right")     # the first segment ending after start
    counts = np.maximum(np.searchsorted(pos, stop, "left") - first, 0)
    idx, seg = ragged(first, counts)
    a = np.maximum(start[idx], pos[seg])
    b = np.minimum(stop[idx], end[seg])
    return idx, a, b - a, local[seg] + a - pos[seg]


def ragged(first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, value) of the runs first[i], first[i] + 1, ..., first[i] + counts[i] - 1 laid end
    to end: owner[t] the run element t belongs to, value[t] the element (whole-array
    operations; counts >= 0)."""
    counts = np.asarray(counts, np.int64)
    owner = np.arange(counts.size).repeat(counts)
    value = (np.asarray(first, np.int64) - counts.cumsum() + counts).repeat(counts) \
        + np.arange(counts.sum())
    return owner, value


@lru_cache(maxsize=64)   # the G ranks of a few partitions: each rank's pieces serve 2G arrays
def _rank_pieces(part: Partition, rank: int, cu_seqlens: tuple[int, ...] | None) -> tuple:
    """`rank`'s segments cut at the document boundaries cu_seqlens (None: one document), as
    read-only arrays: (doc, pos, length, local) of each piece (`_pieces`: (n,) each, by segment
    in local order, then document); by_position (n,) the pieces in position order, so by
    document; first, count (documents,) each document's first piece in by_position and its
    number of pieces."""
    bounds = None if cu_seqlens is None else _document_bounds(cu_seqlens)
    _, doc, pos, length, local = _pieces(*part.arrays[rank], bounds)
    count = np.bincount(doc, minlength=1 if bounds is None else bounds.size - 1)
    out = (doc, pos, length, local, pos.argsort(kind="stable"), count.cumsum() - count, count)
    for x in out:
        x.flags.writeable = False
    return out


@lru_cache(maxsize=16)   # once for every rank's pieces (`_rank_pieces`)
def _document_bounds(cu_seqlens: tuple[int, ...]) -> np.ndarray:
    """cu_seqlens as a read-only int64 array."""
    bounds = np.array(cu_seqlens, np.int64)
    bounds.flags.writeable = False
    return bounds


def _pieces(seg_pos: np.ndarray, seg_len: np.ndarray, seg_local: np.ndarray,
            bounds: np.ndarray | None):
    """(segment index, document, first position, length, first local row) of every piece the
    document boundaries `bounds` (None: one document) cut a rank's segments (`Partition.arrays`)
    into, empty pieces dropped."""
    index = np.arange(seg_pos.size)
    if bounds is None:
        return index, np.zeros(seg_pos.size, np.int64), seg_pos, seg_len, seg_local
    d0 = bounds.searchsorted(seg_pos, "right") - 1                      # document of the first row
    doc_end = bounds[np.minimum(d0 + 1, bounds.size - 1)]
    if ((d0 >= 0) & (seg_len > 0) & (seg_pos + seg_len <= doc_end)).all():
        return index, d0, seg_pos, seg_len, seg_local   # each segment within one document: whole
    d1 = np.searchsorted(bounds, seg_pos + seg_len - 1, "right") - 1    # ... and of the last
    counts = d1 - d0 + 1
    seg, doc = ragged(d0, counts)
    start = np.maximum(seg_pos[seg], bounds[doc])
    stop = np.minimum(seg_pos[seg] + seg_len[seg], bounds[np.minimum(doc + 1, bounds.size - 1)])
    keep = start < stop
    seg, doc, start, stop = seg[keep], doc[keep], start[keep], stop[keep]
    return seg, doc, start, stop - start, seg_local[seg] + start - seg_pos[seg]


def shard_slices(layout: str, rank: int, size: int, seqlen_global: int,
                 cu_seqlens: tuple[int, ...] | None = None,
                 lengths: tuple[int, ...] | None = None) -> list[slice]:
    """Slices of the global sequence axis that make up `rank`'s shard, in local order
    (`partition` for the arguments)."""
    return [slice(seg.pos, seg.pos + seg.length)
            for seg in partition(layout, size, seqlen_global, cu_seqlens, lengths).runs[rank]]
