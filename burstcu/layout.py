"""How a global sequence is split across the ranks, and which (query, key) tiles causal masking keeps.

Layouts (G ranks, global sequence length N, every rank holds N/G positions):

* ``"contiguous"``: rank r holds chunk r of G equal chunks, positions [r*N/G, (r+1)*N/G).
* ``"zigzag"``: the sequence is cut into 2G equal chunks; rank r holds chunk r followed by chunk
  2G-1-r. Under a causal mask every rank then owns one early and one late chunk, so the ring
  steps carry equal work on every rank (contiguous leaves rank 0 nearly idle, rank G-1 busiest).

A rank's local rows are described as `Segment`s (runs of consecutive global positions). For one
ring step, `step_blocks` pairs this rank's query segments with the segments of the rank whose K/V
it holds, drops pairs that lie wholly in the future (causal), and marks the pairs that straddle
the diagonal, which need the per-element mask ``q_pos >= k_pos``.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

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


def chunks_per_rank(layout: str) -> int:
    check_layout(layout)
    return 1 if layout == "contiguous" else 2


def segments(layout: str, rank: int, size: int, seqlen_local: int) -> list[Segment]:
    """The global positions of `rank`'s `seqlen_local` rows under `layout` (see module doc)."""
    check_layout(layout)
    if layout == "contiguous":
        return [Segment(0, rank * seqlen_local, seqlen_local)]
    if seqlen_local % 2:
        raise ValueError(f"zigzag layout needs an even local sequence length, got {seqlen_local}")
    half = seqlen_local // 2
    return [Segment(0, rank * half, half), Segment(half, (2 * size - 1 - rank) * half, half)]


def global_positions(layout: str, rank: int, size: int, seqlen_local: int) -> list[int]:
    """Global position of each local row (for tests and references)."""
    out: list[int] = []
    for seg in segments(layout, rank, size, seqlen_local):
        out.extend(range(seg.pos, seg.pos + seg.length))
    return out


def step_blocks(layout: str, q_rank: int, kv_rank: int, size: int, seqlen_local: int,
                causal: bool, window: tuple[int, int] = (-1, -1),
                docs: tuple[int, ...] | None = None) -> list[Block]:
    """The rectangles `q_rank`'s queries must attend to in `kv_rank`'s keys (empty: skip step).

    window = (left, right): a query at position q sees keys in [q - left, q + right] (-1:
    unbounded on that side; with causal the right bound is the diagonal). Rectangles wholly
    outside are dropped; those a bound cuts through carry it (`Block.left` / `Block.right`).
    docs: document boundaries (cu_seqlens: 0 = b_0 <= b_1 <= ... <= b_n = global length); a
    query sees keys of its own document [b_i, b_i+1) only. Each pair of segments is cut at the
    boundaries into one rectangle per document both touch, so a document is a set of rectangles
    and no kernel needs to know about it.
    """
    left, right = window
    hi = 0 if causal else (right if right >= 0 else None)   # keys up to q + hi
    lo = left if left >= 0 else None                          # keys from q - lo
    if hi is None and lo is None and docs is None:
        return [Block(0, seqlen_local, 0, seqlen_local, 0, 0, False)]
    blocks = []
    for qs in segments(layout, q_rank, size, seqlen_local):
        for ks in segments(layout, kv_rank, size, seqlen_local):
            for q_piece, k_piece in _same_document(qs, ks, docs):
                block = _rectangle(q_piece, k_piece, causal, lo, hi)
                if block is not None:
                    blocks.append(block)
    return blocks


def _same_document(qs: Segment, ks: Segment, docs):
    """(query piece, key piece) pairs of qs and ks that lie in one document (docs None: the
    whole sequence is one)."""
    if docs is None:
        yield qs, ks
        return
    q_end, k_end = qs.pos + qs.length, ks.pos + ks.length
    first = bisect_right(docs, max(qs.pos, ks.pos)) - 1    # the document of the later start
    for i in range(max(first, 0), len(docs) - 1):
        start, stop = docs[i], docs[i + 1]
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


def shard_slices(layout: str, rank: int, size: int, seqlen_global: int) -> list[slice]:
    """Slices of the global sequence axis that make up `rank`'s shard, in local order."""
    check_layout(layout)
    parts = size * chunks_per_rank(layout)
    if seqlen_global % parts:
        raise ValueError(
            f"{layout} layout over {size} ranks needs a sequence length divisible by {parts}, "
            f"got {seqlen_global}")
    local = seqlen_global // size
    return [slice(s.pos, s.pos + s.length) for s in segments(layout, rank, size, local)]
