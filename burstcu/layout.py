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

A `Partition` lists every rank's rows as `Segment`s (runs of consecutive global positions, in
local order); the strategies take one, so any split works alike. For one ring step,
`blocks` pairs this rank's query segments with the segments of the rank whose K/V it holds,
drops pairs that lie wholly outside the mask, and marks the pairs that straddle the diagonal
or a window's edge, which need the per-element tests.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Segment:
    """`length` local rows starting at local row `local`, holding global positions from `pos`."""

    local: int
    pos: int
    length: int


@dataclass(frozen=True)
class Block:
    """One rectangle of a ring step's attention: local query rows x local key rows.

    q_start, q_len: local query rows [q_start, q_start + q_len).
    k_start, k_len: rows of the K/V block being visited [k_start, k_start + k_len).
    q_pos, k_pos: global positions of rows q_start and k_start.
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


@lru_cache(maxsize=256)
def partition(layout: str, size: int, seqlen_global: int,
              cu_seqlens: tuple[int, ...] | None = None,
              lengths: tuple[int, ...] | None = None) -> Partition:
    """The rows of every rank under `layout` (module docstring).

    lengths: each rank's S_r (contiguous only; default near-equal). cu_seqlens: document
    boundaries (a tuple of ints); with "zigzag" each document is cut into 2G pieces, the longer
    pieces of a document going on where the previous document's stopped, so the ranks' lengths
    differ by at most 2. Raises ValueError for a split it cannot make (lengths that do not add up
    to N, lengths with zigzag, N < G).
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
            raise ValueError(f"zigzag fixes every rank's length ({seqlen_global} positions over "
                             f"{size} ranks: {fixed}); got {tuple(lengths)}")
    pieces: list[list[tuple[int, int]]] = [[] for _ in range(size)]
    first = 0
    spans = [(0, seqlen_global)] if cu_seqlens is None else zip(cu_seqlens[:-1], cu_seqlens[1:])
    for start, stop in spans:                      # each document [start, stop) in 2G pieces
        cut = near_equal(stop - start, 2 * size, first)
        first = (first + (stop - start)) % (2 * size)
        bounds = [start + sum(cut[:c]) for c in range(2 * size + 1)]
        for r in range(size):
            for c in (r, 2 * size - 1 - r):
                pieces[r].append((bounds[c], bounds[c + 1] - bounds[c]))
    return Partition(layout, tuple(_runs(mine) for mine in pieces))


@lru_cache(maxsize=256)
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
    that gives every rank `seqlen_local` rows (N = G * seqlen_local)."""
    if isinstance(layout, Partition):
        assert layout.size == size, f"a partition of {layout.size} ranks used by {size}"
        return layout
    check_layout(layout)
    if layout == "zigzag" and seqlen_local % 2:
        raise ValueError(f"zigzag layout needs an even local sequence length, got {seqlen_local}")
    return partition(layout, size, seqlen_local * size)


def segments(layout: str | Partition, rank: int, size: int, seqlen_local: int) -> tuple[Segment, ...]:
    """The global positions of `rank`'s rows (see `as_partition` for the arguments)."""
    return as_partition(layout, size, seqlen_local).runs[rank]


def global_positions(layout: str | Partition, rank: int, size: int, seqlen_local: int) -> list[int]:
    """Global position of each local row (for tests and references)."""
    return as_partition(layout, size, seqlen_local).positions(rank)


def step_blocks(layout: str | Partition, q_rank: int, kv_rank: int, size: int, seqlen_local: int,
                causal: bool, window_size: tuple[int, int] = (-1, -1),
                cu_seqlens: tuple[int, ...] | None = None) -> list[Block]:
    """`blocks` of `as_partition(layout, size, seqlen_local)`."""
    return blocks(as_partition(layout, size, seqlen_local), q_rank, kv_rank, causal, window_size,
                  cu_seqlens)


def blocks(part: Partition, q_rank: int, kv_rank: int, causal: bool,
           window_size: tuple[int, int] = (-1, -1),
           cu_seqlens: tuple[int, ...] | None = None) -> list[Block]:
    """The rectangles `q_rank`'s queries must attend to in `kv_rank`'s keys (empty: skip step).

    window_size = (left, right): a query at position q sees keys in [q - left, q + right] (-1:
    unbounded on that side; with causal the right bound is the diagonal). Rectangles wholly
    outside are dropped; those a bound cuts through carry it (`Block.left` / `Block.right`).
    cu_seqlens: document boundaries (0 = b_0 <= b_1 <= ... <= b_n = global length); a query
    sees keys of its own document [b_i, b_i+1) only. Each pair of segments is cut at the
    boundaries into one rectangle per document both touch, so a document is a set of rectangles
    and no kernel needs to know about it.
    """
    left, right = window_size
    hi = 0 if causal else (right if right >= 0 else None)   # keys up to q + hi
    lo = left if left >= 0 else None                          # keys from q - lo
    q_segs, k_segs = part.runs[q_rank], part.runs[kv_rank]
    if hi is None and lo is None and cu_seqlens is None:  # no mask: one rectangle of all rows
        return [Block(0, part.lengths[q_rank], 0, part.lengths[kv_rank], 0, 0, False)]
    by_pos = sorted(k_segs, key=lambda seg: seg.pos)
    starts = [seg.pos for seg in by_pos]
    out = []
    for qs in q_segs:
        for ks in by_pos[_first_reachable(qs, by_pos, starts, lo, cu_seqlens):]:
            if _beyond(qs, ks, hi, cu_seqlens):
                break
            for q_piece, k_piece in _same_document(qs, ks, cu_seqlens):
                block = _rectangle(q_piece, k_piece, causal, lo, hi)
                if block is not None:
                    out.append(block)
    return out


def _first_reachable(qs: Segment, k_sorted, starts, lo, cu_seqlens) -> int:
    """Index of the first key segment (by position) that could hold a key qs's queries see:
    none ends before qs's first query's document starts or its left bound."""
    floor = 0 if lo is None else qs.pos - lo
    if cu_seqlens is not None:
        floor = max(floor, cu_seqlens[bisect_right(cu_seqlens, qs.pos) - 1])
    i = max(bisect_right(starts, floor) - 1, 0)
    return i


def _beyond(qs: Segment, ks: Segment, hi, cu_seqlens) -> bool:
    """Whether ks (and every later key segment) starts past every key qs's queries can see."""
    last = qs.pos + qs.length - 1
    if hi is not None and ks.pos > last + hi:
        return True
    return cu_seqlens is not None and \
        ks.pos >= cu_seqlens[min(bisect_right(cu_seqlens, last), len(cu_seqlens) - 1)]


def _same_document(qs: Segment, ks: Segment, cu_seqlens):
    """(query piece, key piece) pairs of qs and ks that lie in one document (cu_seqlens None:
    the whole sequence is one)."""
    if cu_seqlens is None:
        yield qs, ks
        return
    q_end, k_end = qs.pos + qs.length, ks.pos + ks.length
    first = bisect_right(cu_seqlens, max(qs.pos, ks.pos)) - 1    # the document of the later start
    for i in range(max(first, 0), len(cu_seqlens) - 1):
        start, stop = cu_seqlens[i], cu_seqlens[i + 1]
        if start >= min(q_end, k_end):
            break                                           # past one of the two segments
        q0, q1 = max(qs.pos, start), min(q_end, stop)
        k0, k1 = max(ks.pos, start), min(k_end, stop)
        if q0 < q1 and k0 < k1:
            yield (Segment(qs.local + q0 - qs.pos, q0, q1 - q0),
                   Segment(ks.local + k0 - ks.pos, k0, k1 - k0))


def _rectangle(qs: Segment, ks: Segment, causal: bool, lo, hi) -> Block | None:
    """The block of queries qs x keys ks under key bounds q - lo <= k <= q + hi (None:
    unbounded), None when no element survives; the bounds that cut through it are kept."""
    q_first, q_last = qs.pos, qs.pos + qs.length - 1
    k_first, k_last = ks.pos, ks.pos + ks.length - 1
    if hi is not None and k_first > q_last + hi:
        return None  # every key is past every query's right bound (causal: its future)
    if lo is not None and k_last < q_first - lo:
        return None  # every key is before every query's left bound
    cut_right = hi is not None and k_last > q_first + hi
    cut_left = lo is not None and k_first < q_last - lo
    return Block(qs.local, qs.length, ks.local, ks.length, qs.pos, ks.pos, causal and cut_right,
                 lo if cut_left else -1, hi if cut_right and not causal else -1)


def shard_slices(layout: str, rank: int, size: int, seqlen_global: int,
                 cu_seqlens: tuple[int, ...] | None = None,
                 lengths: tuple[int, ...] | None = None) -> list[slice]:
    """Slices of the global sequence axis that make up `rank`'s shard, in local order
    (`partition` for the arguments)."""
    return [slice(seg.pos, seg.pos + seg.length)
            for seg in partition(layout, size, seqlen_global, cu_seqlens, lengths).runs[rank]]
