"""The NumPy op's tiles: how one (rows x keys) tile of a ring step is folded into the running
state, and how a step's blocks are cut into tiles and work items.

* layouts: queries grouped under their kv head as (B, Hkv, S*g, D+1), so GQA copies no K/V;
  q ends in -m (its row's shift) and K, V in ones, so Q K^T yields score - m and P @ V the row
  sums beside the output;
* tiles: TILE_Q score rows x TILE_K keys (BACKWARD_TILE_Q rows in the backward, which holds two
  tiles); tiles a causal or window bound cuts through come as strips of MASK_STRIP positions;
* folds: the lazy fold (`_fold_tile`: a row keeps its shift while a tile's P sums to at most
  LAZY_LIMIT), rows past it rescaled (`_rescale_rows`) or folded again exactly
  (`_fold_exactly`, `_fold_rows_exactly`); masked pairs kept exactly 0 and non-finite operand
  rows on a careful matmul (`_matmul_masked`), decided per head from max |x| (`_Clean`).

Why these choices (tile sizes, exp not exp2, the lazy fold, the extra columns): docs/numpy-op.md,
with the measurements behind each.
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_right
from functools import lru_cache
from itertools import product
from typing import NamedTuple

import numpy as np

from ...layout import Block

TILE_Q = 512   # score rows per tile (query positions x the g query heads of a kv head)
TILE_K = 512   # keys per tile
BACKWARD_TILE_Q = 256   # at most: the backward holds two tiles (P, dS), together one forward tile
LAZY_LIMIT = 2.0 ** 16       # a lazily folded row whose P sums past this is rescaled or redone
RESCALE_LIMIT = 2.0 ** 32    # ... rescaled if its largest P is at most this, or within the scores' rounding (`_rescalable`)
TAME_V = 2.0 ** 64           # max |V| below which neither a tile's P @ V (P summing to LAZY_LIMIT) nor
                             # acc, their sum over 2^47 tiles, can overflow float32 (`_fold_tile`)
SEED_KEYS = 8                # a row's first shift: its max over 2 x this many keys of the tile (`_seed`)


# -- layouts -----------------------------------------------------------------------------------------

def _put(dst, x, scale=None, *last) -> None:
    """One head into the op's layout: dst (S*g, D + len(last)) <- x (S, g, D) — the g query
    heads of a kv head (row i*g + j is position i, head j), or one kv head (g = 1) — in dst's
    dtype, times `scale` if given, then the extra columns `last` (each a scalar or (S*g,)).
    dst is contiguous: the copy strides, the scaling then runs over dst whole, its last columns
    zeroed first (stale values there could raise floating-point warnings) and set afterwards, as
    one flat pass — a strided multiply into dst's first D columns took 0.6 ms for 8 heads of
    1024 rows, copy and flat multiply 0.45 (the same bits)."""
    s, g, d = x.shape
    assert dst.flags.c_contiguous
    dst.reshape(s, g, dst.shape[-1])[..., :d] = x
    if scale is not None:
        dst[:, d:] = 0
        np.multiply(dst, dst.dtype.type(scale), out=dst)
    for i, column in enumerate(last):
        dst[:, d + i] = column


def _rows_grouped(x, hkv: int, dtype) -> np.ndarray:
    """(B, H, S) -> contiguous (B, Hkv, S*g)."""
    b, h, s = x.shape
    g = h // hkv
    return np.ascontiguousarray(x.reshape(b, hkv, g, s).transpose(0, 1, 3, 2), dtype=dtype).reshape(b, hkv, s * g)


def _rows_ungrouped(x, g: int) -> np.ndarray:
    """(B, Hkv, S*g) -> (B, H, S)."""
    b, hkv, sg = x.shape
    return x.reshape(b, hkv, sg // g, g).transpose(0, 1, 3, 2).reshape(b, hkv * g, sg // g)


# -- tiles ---------------------------------------------------------------------------------------------

def _spans(extents: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges of at most `size` rows covering the union of the [lo, hi) `extents`,
    cut at every extent's edges and then every `size` rows from each piece's start. They depend
    on the extents and `size` only — never on the thread count — so each row meets the same
    tiles, in the same order, however many threads share the work."""
    edges = sorted({e for extent in extents for e in extent})
    spans = []
    for a, c in zip(edges[:-1], edges[1:]):
        if any(lo <= a and c <= hi for lo, hi in extents):
            spans.extend((lo, min(lo + size, c)) for lo in range(a, c, size))
    return spans


def _gaps(spans: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The [lo, hi) ranges of [0, size) that no span of `spans` (sorted, disjoint) covers."""
    gaps, at = [], 0
    for lo, hi in spans:
        if lo > at:
            gaps.append((at, lo))
        at = max(at, hi)
    return gaps + ([(at, size)] if at < size else [])


def _clip_q(block: Block, lo: int, hi: int) -> Block | None:
    """The part of `block` whose local query rows fall in [lo, hi)."""
    a, b = max(block.q_start, lo), min(block.q_start + block.q_len, hi)
    if a >= b:
        return None
    return block._replace(q_start=a, q_len=b - a, q_pos=block.q_pos + a - block.q_start)


def _clip_k(block: Block, lo: int, hi: int) -> Block | None:
    """The part of `block` whose local key rows fall in [lo, hi)."""
    a, b = max(block.k_start, lo), min(block.k_start + block.k_len, hi)
    if a >= b:
        return None
    return block._replace(k_start=a, k_len=b - a, k_pos=block.k_pos + a - block.k_start)


def _parts_by_span(blocks, spans, clip, first) -> list[list[Block]]:
    """For each [lo, hi) of `spans` (sorted, disjoint), the blocks clipped to it by `clip`
    (_clip_q or _clip_k), in block order; first(block) -> (start, length) of the rows `clip`
    cuts. Each block meets only the spans it overlaps (found by bisection), so many small
    blocks (documents) cost their number, not their number times the spans'."""
    starts = [lo for lo, _ in spans]
    out: list[list[Block]] = [[] for _ in spans]
    for block in blocks:
        a, n = first(block)
        i = max(bisect_right(starts, a) - 1, 0)
        while i < len(spans) and spans[i][0] < a + n:
            part = clip(block, *spans[i])
            if part is not None:
                out[i].append(part)
            i += 1
    return out


BACKWARD_ITEMS = 16     # work items a backward step aims at, at least (see _key_tiles_per_item)
MASK_STRIP = 128  # query positions: tiles a mask bound cuts through are cut into strips this high


def _tiles(block: Block, tile_q: int, tile_k: int, keys_outer: bool = False):
    """(q0, q1, k0, k1, masked) for the tiles of `block` that are not wholly masked (causal:
    wholly in the future); a tile that a mask bound cuts through comes in strips
    (`_mask_split`), so that its masked half is skipped rather than computed and masked."""
    qs = range(block.q_start, block.q_start + block.q_len, tile_q)
    ks = range(block.k_start, block.k_start + block.k_len, tile_k)
    pairs = ((q0, k0) for k0, q0 in product(ks, qs)) if keys_outer else product(qs, ks)
    for q0, k0 in pairs:
        q1 = min(q0 + tile_q, block.q_start + block.q_len)
        k1 = min(k0 + tile_k, block.k_start + block.k_len)
        yield from _mask_split(block, q0, q1, k0, k1)


def _key_bounds(block: Block) -> tuple[float, float]:
    """(lo, hi): a query at q sees keys in [q - lo, q + hi] within `block` (inf: unbounded)."""
    hi = float("inf")
    if block.causal:
        hi = 0
    if block.right >= 0:
        hi = min(hi, block.right)
    return (block.left if block.left >= 0 else float("inf")), hi


def _mask_split(block: Block, q0: int, q1: int, k0: int, k1: int):
    """The tile's pieces that are not wholly masked, each with whether it needs the element
    mask: a tile that a mask bound cuts through is cut into strips of MASK_STRIP query
    positions, each narrowed to the keys that some of its queries see, so that wholly masked
    parts are skipped rather than computed and masked. One strip per MASK_STRIP rows keeps
    the matmuls wide (a 512-key tile on the causal diagonal: 4 strips of 128 x 128..512, where
    quadrants down to 128 keys give 7 pieces of 128 x 128 and 256 x 256)."""
    if not block.masked:
        yield q0, q1, k0, k1, False
        return
    lo, hi = _key_bounds(block)
    dq, dk = block.q_pos - block.q_start, block.k_pos - block.k_start   # local row -> position
    if dk + k0 > dq + q1 - 1 + hi or dk + k1 - 1 < dq + q0 - lo:
        return  # wholly masked (causal: wholly in the future)
    if dk + k1 - 1 <= dq + q0 + hi and dk + k0 >= dq + q1 - 1 - lo:
        yield q0, q1, k0, k1, False
        return
    for a in range(q0, q1, MASK_STRIP):
        b = min(a + MASK_STRIP, q1)
        # the keys some query of [a, b) sees: positions [a - lo, b - 1 + hi]
        c = k0 if lo == float("inf") else max(k0, int(dq + a - lo - dk))
        d = k1 if hi == float("inf") else min(k1, int(dq + b - 1 + hi - dk) + 1)
        if c < d:
            yield a, b, c, d, not (dk + d - 1 <= dq + a + hi and dk + c >= dq + b - 1 - lo)


class _Scratch:
    """Reusable tile buffers, one set per thread, kept by the op between steps and calls. A
    fresh tile-sized array per tile costs more than the arithmetic on it: above malloc's mmap
    threshold every allocation page-faults anew. by_name: what the live threads' buffers of each
    name hold (a thread's are gone with it: its thread-local storage is freed); nbytes: all of
    them."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.local = threading.local()    # .held: the calling thread's _ThreadScratch
        self.live: weakref.WeakSet = weakref.WeakSet()   # every live thread's
        self.lock = threading.Lock()

    @property
    def by_name(self) -> dict[str, int]:
        with self.lock:
            held = list(self.live)
        out: dict[str, int] = {}
        for one in held:
            for name, buf in list(one.buffers.items()):
                out[name] = out.get(name, 0) + buf.nbytes
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.by_name.values())

    def get(self, name: str, rows: int, cols: int) -> np.ndarray:
        held = getattr(self.local, "held", None)
        if held is None:
            held = self.local.held = _ThreadScratch()
            with self.lock:
                self.live.add(held)
        buf = held.buffers.get(name)
        if buf is None or buf.size < rows * cols:
            buf = held.buffers[name] = np.empty(rows * cols, self.dtype)
        return buf[:rows * cols].reshape(rows, cols)


class _ThreadScratch:
    """One thread's buffers of a `_Scratch` (name -> flat array)."""

    def __init__(self):
        self.buffers: dict[str, np.ndarray] = {}


class _Masked(NamedTuple):
    """A tile's masked pairs, read-only. pairs: boolean (rows*g, keys), True where the pair is
    masked (the key in the query's future, or outside its window); cols: the columns that hold
    every masked pair — a causal strip's last MASK_STRIP keys, a window's first ones — the only
    ones `fill` touches (a 128 x 512 strip on the causal diagonal: 9 us against 17 for the
    whole strip, measured); last, blind, sample_seen: what `_seed` needs."""
    pairs: np.ndarray
    cols: slice
    last: np.ndarray    # (rows*g,) each row's last column it sees (0 for a blind row)
    blind: np.ndarray   # (rows*g,) bool: rows that see no key of the tile
    sample_seen: bool   # every row sees one of the first 2 * SEED_KEYS columns (see _seed)

    def fill(self, x, value) -> None:
        """x (rows*g, keys) := value at the masked pairs."""
        np.copyto(x[:, self.cols], value, where=self.pairs[:, self.cols])


def _future(block: Block, q0: int, q1: int, k0: int, k1: int, g: int) -> _Masked:
    """The masked pairs of the tile [q0, q1) x [k0, k1) of `block`, g score rows a query."""
    offset = (block.k_pos - block.k_start + k0) - (block.q_pos - block.q_start + q0)
    return _mask(offset, q1 - q0, k1 - k0, g, *_key_bounds(block))


@lru_cache(maxsize=64)
def _mask(offset: int, rows: int, keys: int, g: int, lo: float, hi: float) -> _Masked:
    """`_future`'s mask for a tile whose first key is `offset` positions after its first query:
    the same for every head and every tile of that geometry (the causal diagonal's repeat down
    the sequence), so it is built once. At most 64 kept, each at most MASK_STRIP * g x tile_k
    booleans."""
    delta = offset + np.arange(keys)[None, :] - np.arange(rows)[:, None]
    pairs = np.repeat((delta > hi) | (delta < -lo), g, axis=0)
    pairs.flags.writeable = False
    cols = np.flatnonzero(pairs.any(axis=0))
    blind = pairs.all(axis=1)
    last = keys - 1 - np.argmin(pairs[:, ::-1], axis=1)   # argmin: the first False from the end
    last[blind] = 0
    for x in (last, blind):
        x.flags.writeable = False
    sample_seen = not pairs[:, :2 * SEED_KEYS].all(axis=1).any()
    return _Masked(pairs, slice(int(cols[0]), int(cols[-1]) + 1) if cols.size else slice(0, 0), last, blind,
                   sample_seen)


def _max_abs(x) -> float:
    """Largest |x| (NaN if x holds a NaN, inf if an Inf): two reductions, no temporary array."""
    return float(np.maximum(x.max(), -x.min())) if x.size else 0.0


class _Clean(NamedTuple):
    """What one head's masked tiles may skip: each False sends them down a careful path.
    q, do, k: that operand is all finite (else `_matmul_masked` checks its rows);
    ds: dS = P * (dO V^T - delta) is finite everywhere, so exactly 0 where P is (else dS is
    zeroed at masked pairs, where 0 * inf would make it NaN)."""
    q: bool = True
    do: bool = True
    k: bool = True
    ds: bool = True

    @classmethod
    def of(cls, q, do, delta, k_max: float, v_max: float) -> "_Clean":
        """One head's: q, do (S*g, D), delta (S*g,); k_max, v_max: max |k|, |v| of its keys."""
        do_max = _max_abs(do)
        with np.errstate(over="ignore", invalid="ignore"):
            # |dO . v| <= D max|dO| max|v|: with |delta| well below the largest float (half of
            # it: room for rounding), dS is finite. A NaN anywhere makes the bound NaN: False.
            bound = q.shape[1] * do_max * v_max + _max_abs(delta)
        fin = np.isfinite
        return cls(bool(fin(_max_abs(q))), bool(fin(do_max)), bool(fin(k_max)),
                   bool(bound < np.finfo(q.dtype).max / 2))


def _matmul_masked(a, b, masked, out, b_finite: bool) -> np.ndarray:
    """out = a @ b over the pairs (i, j) that are not `masked` (None: a tile without any).

    a: (m, n), exactly 0 wherever `masked` (m, n) is True; b: (n, d). A plain matmul spreads a
    NaN or Inf in row j of b to every row i as 0 * inf = NaN, even where (i, j) is masked. So
    when b is not all finite, its non-finite rows are zeroed for the matmul and then added back
    only to the rows that see them, giving those rows what the plain product gives them.
    b_finite: b's head is known to be all finite (then this is the plain matmul, unchecked).
    """
    if masked is None or b_finite or np.isfinite(np.sum(b)):  # any NaN/Inf makes the sum so
        return np.matmul(a, b, out=out)
    bad = np.flatnonzero(~np.isfinite(b).all(axis=1))
    if bad.size == 0:          # finite values whose sum overflowed
        return np.matmul(a, b, out=out)
    zeroed = b.copy()
    zeroed[bad] = 0
    np.matmul(a, zeroed, out=out)
    for j in bad:
        rows = ~masked[:, j]
        out[rows] += a[rows, j, None] * b[j]
    return out


def _times_v(p, v, out) -> None:
    """out = p @ v for v (keys, D+1) ending in ones: p @ v[:, :D], then the row sums p @ 1 as a
    matrix-vector product. As a 65th column of the matmul they cost ~0.1 ns a score (OpenBLAS
    runs its edge kernel over all of p again for it), as a matrix-vector product ~0.05 (512 x
    512 tiles, float32, interleaved: 309 us against 319 for the 65-column product).
    p (rows, keys); out (rows, D+1)."""
    np.matmul(p, v[:, :-1], out=out[:, :-1])
    np.matmul(p, v[:, -1], out=out[:, -1])


def _fold_tile(q, k, v, acc, future, s, pv, v_max: float) -> None:
    """acc += P @ [V | 1] for one tile, P = exp(score - m), folded lazily where that is exact
    and row by row elsewhere. q (rows, D+1): scaled queries | -m, the rows' negated running
    shift; k, v (keys, D+1) ending in ones; acc (rows, D+1); future: the tile's `_Masked` or
    None; s (rows, keys), pv (rows, D+1): scratch; v_max: max |V| of the head (NaN, inf: not
    finite).

    Lazily: against each row's shift m as it stands — no row max, no rescaling of acc, and with
    q's -m column against k's ones the matmul yields score - m directly. Exact because softmax
    is invariant to the shift, as long as P neither overflows nor loses the row's largest
    terms: m is a score the row has seen (so its largest P is at least 1). A row whose P sums
    to at most LAZY_LIMIT is added as it is; then |P @ V| <= LAZY_LIMIT * max |V|, finite
    unless V is huge (only then is P @ V checked). A row whose P sums past it but whose
    largest P stays within RESCALE_LIMIT (or, for large scores, within their rounding:
    `_rescalable`) is rescaled alone (`_rescale_rows`). A row meeting its first keys takes a
    seed (`_seed`). A row with a finite P too large for that is folded again exactly on its
    own (`_fold_rows_exactly`: ~30 us, where redoing the tile costs its two matmuls again —
    one such row sent a whole tile there before, 57 of 512 tiles at seqlen 4096 with scores of
    std 8); rows whose P @ [V | 1] is not finite (overflow, no shift, garbage they see) by
    the tile's exact fold (`_fold_exactly`). Which path a row takes depends on its own values
    alone, and so does its result on each path (the tiles, not the values, pick the matmul
    shapes), so garbage in one row never changes another's bits. The common case costs four
    ufunc calls beyond the matmuls. Runs under np.errstate(over="ignore", invalid="ignore"),
    which its caller sets once for all its tiles (rows it overflows are redone). With V past
    TAME_V a row's acc, P @ V summed over tiles against a shift far below its largest scores,
    may overflow where no tile's P @ V does: such rows are folded again exactly
    (`_refold_overflowed`). So are they when V holds a NaN or Inf (v_max not finite), which the
    rows that do not see it must not feel.
    """
    huge_v = not v_max < TAME_V
    before = (acc.copy(), q[:, -1].copy()) if huge_v else None
    if math.isfinite(q[:, -1].sum()):   # else a row without a shift (+inf), or dead
        _fold_shifted(q, k, v, acc, future, s, pv, v_max, True)
    else:
        fresh = q[:, -1] == np.inf                # rows seeded from this tile's keys
        _seed(q, acc, k, future)
        _fold_shifted(q, k, v, acc, future, s, pv, v_max, math.isfinite(q[:, -1].sum()))
        _refold_unfounded(q, k, v, acc, future, fresh, v_max)
    if huge_v:
        _refold_overflowed(q, k, v, acc, future, before, v_max)


def _refold_overflowed(q, k, v, acc, future, before, v_max: float) -> None:
    """Rows whose acc this tile's fold made non-finite from finite, and whose shift is not dead
    (NaN): acc and shift back as they were (`before`: acc and q's last column before the fold),
    then the tile folded again exactly (`_fold_rows_exactly`), which takes the row's shift up to
    its largest score and scales acc down with it. Where acc overflows even so (the sum of
    P @ V against the row's own max past float32's range), it stays non-finite, as an
    unnormalised accumulator's does. Shapes as `_fold_tile`."""
    acc_before, shift_before = before
    rows = np.flatnonzero(~np.isfinite(acc).all(axis=1) & np.isfinite(acc_before).all(axis=1)
                          & ~np.isnan(q[:, -1]))
    if len(rows):
        acc[rows] = acc_before[rows]
        q[rows, -1] = shift_before[rows]
        _fold_rows_exactly(q, k, v, acc, future, rows, v_max)


def _refold_unfounded(q, k, v, acc, future, fresh, v_max: float) -> None:
    """Rows `fresh` (bool) took their shift from this tile (`_seed`), so their seed key's P is
    about 1 and their P sums to at least about 1, unless the seed's product and the fold's round
    the row's scores apart by more than float32's exp can span (scores past ~1e9: ulps of
    hundreds), when every P of the row under- or overflows: out 0 and lse -inf, as if the row
    saw no key. Those rows (P summing under 1/2) start again and are folded exactly, against a
    max of their own product. Shapes as `_fold_tile`."""
    rows = np.flatnonzero(fresh & (acc[:, -1] < 0.5) & np.isfinite(q[:, -1]))
    if len(rows):
        acc[rows] = 0
        q[rows, -1] = np.inf
        _fold_rows_exactly(q, k, v, acc, future, rows, v_max)


def _fold_shifted(q, k, v, acc, future, s, pv, v_max: float, shifted: bool) -> None:
    """`_fold_tile` after the seed: shifted, whether every row has a finite shift."""
    np.matmul(q, k.T, out=s)
    if future is not None:  # overwrites NaN/Inf scores of masked keys too
        future.fill(s, -np.inf)
    np.exp(s, out=s)
    pairs = None if future is None else future.pairs
    if pairs is None:
        _times_v(s, v, pv)
    else:   # strips of a mask's edge: their short matmuls gain less than a call costs
        _matmul_masked(s, v, pairs, pv, math.isfinite(v_max))
    l = pv[:, -1]
    if shifted and l.max() <= LAZY_LIMIT and (v_max < TAME_V or math.isfinite(pv.sum())):
        acc += pv
        return
    if shifted and math.isfinite(pv.sum()):   # some rows sum past LAZY_LIMIT
        big = np.flatnonzero(l > LAZY_LIMIT)
        rows, r = _rescalable(q, s, big)
        alone = np.setdiff1d(big, rows, assume_unique=True)   # P past what a rescale takes
        before, kept = acc[rows], acc[alone]
        acc += pv
        acc[alone] = kept      # as they were: folded again below
        if len(rows):
            _rescale_rows(q, acc, pv, rows, r, before)
        if len(alone):
            _fold_rows_exactly(q, k, v, acc, future, alone, v_max)
        return
    ok = np.isfinite(pv).all(axis=1) & np.isfinite(q[:, -1])
    big = np.flatnonzero(ok & (l > LAZY_LIMIT))
    rows, r = _rescalable(q, s, big)
    ok[big] = False
    before = acc[rows]
    acc[ok] += pv[ok]
    if len(rows):
        _rescale_rows(q, acc, pv, rows, r, before)
    # rows that see no key of the tile (P = 0: nothing to add) or are dead (NaN) stay so
    idle = np.isnan(q[:, -1]) if future is None else np.isnan(q[:, -1]) | future.blind
    alone = np.setdiff1d(big, rows, assume_unique=True)   # finite, P past what a rescale takes
    ok[rows] = True
    ok[alone] = True
    redo = ~ok & ~idle    # P @ [V | 1] not finite: overflow, no shift, or garbage it sees
    if redo.any():
        _fold_exactly(q, k, v, acc, future, s, pv, v_max, redo)
    if len(alone):
        _fold_rows_exactly(q, k, v, acc, future, alone, v_max)


def _rescalable(q, p, rows):
    """(those of `rows` (indices) that may be rescaled, 1 / t as a column) — rows of a lazily
    folded tile whose P summed past LAZY_LIMIT, finite; t: a row's largest P. A row may when t
    is at most RESCALE_LIMIT, or when ln t is at most |m'|, m' = m + ln t its new shift: the
    error a stale shift leaves in each score, ~ulp(ln t), is then within the rounding of the
    scores themselves, ~ulp(m'), which a naive softmax carries too (very peaked attention,
    where a sampled seed falls far below the row's largest scores, lands here). In terms of
    the old shift: always when m >= 0, else only when m <= -2 ln t, so |m| <= 2 |m'| and the
    fused matmul's rounding stays within ~2 ulp(m'). A row whose scores jump far above a
    negative shift to near 0 (-100 to 0) is refolded instead. q (rows, D+1) ending in -m;
    p (rows, keys)."""
    # t >= 1 (m never falls): the row sums past LAZY_LIMIT over at most tile_k keys, so t >=
    # LAZY_LIMIT / tile_k, under 1 only for tiles wider than LAZY_LIMIT keys
    top = np.maximum(p[rows].max(axis=1, initial=0), 1)
    log_top = np.log(top)
    keep = (top <= RESCALE_LIMIT) | (log_top <= np.abs(log_top - q[rows, -1]))
    return rows[keep], (1 / top[keep])[:, None]


def _rescale_rows(q, acc, pv, rows, r, before) -> None:
    """Rows `rows` (indices) of a lazily folded tile, whose P summed past LAZY_LIMIT and whose
    largest P, t = 1 / r, `_rescalable` accepts: acc := (before + pv) / t and m := m + ln t, so
    their largest P is 1 again — the shift is then that score, as the exact fold's would be.
    before: acc[rows] before this tile. Their scores, computed against the old m, carry an
    absolute error of about ulp(score - m) / 2: for t <= RESCALE_LIMIT at most ulp(22) / 2 =
    1e-6 in float32 (ln RESCALE_LIMIT = 22.2), each P within ~8 ulp — a lazily folded row's
    within ~4 (ln LAZY_LIMIT = 11.1); for a larger t, within the rounding of the row's scores
    themselves (`_rescalable`). Peaked scores land here: queries x 4 on normal inputs, ln t
    9-19. q (rows, D+1) ending in -m; acc, pv (rows, D+1); r (len(rows), 1)."""
    # r <= 1 / 128 for tiles of up to 512 keys (t >= LAZY_LIMIT / keys): the sum shrinks
    acc[rows] = before * r + pv[rows] * r
    q[rows, -1] += np.log(r[:, 0])


def _seed(q, acc, k, future) -> None:
    """Rows that have seen no key yet (-m = +inf in q's last column) take as m their largest
    score against a few keys of the tile that they see: its first 2 x SEED_KEYS keys and, in a
    masked tile where some row sees none of those, the last key each row sees (`_Masked.last`)
    — a score of the row, so a valid shift for `_fold_tile`, and near the tile's max. A row
    scoring NaN or +inf there sees garbage: its out and lse are NaN whatever else it sees, so
    it is marked dead (m and acc NaN) and never computed again. Rows seeing none of those keys
    (scores -inf), or no key at all, keep +inf. q (rows, D+1); acc (rows, D+1); k (keys, D+1).
    ~10 us for 512 rows (the sample's matmul) when every row is new and scores finite."""
    d = k.shape[1] - 1
    keys = slice(0, min(k.shape[0], 2 * SEED_KEYS))
    sample = k[keys, :d] @ q[:, :d].T     # (keys, rows): the max runs across rows, vectorised
    if future is not None:
        np.copyto(sample, -np.inf, where=future.pairs[:, keys].T)
    best = sample.max(axis=0)
    if future is not None and not future.sample_seen:   # every row that sees a key sees its last
        own = np.einsum("ij,ij->i", q[:, :d], k[future.last, :d])
        own[future.blind] = -np.inf
        best = np.maximum(best, own)
    fresh = q[:, d] == np.inf
    if math.isfinite(best.sum()) and fresh.all():
        np.negative(best, out=q[:, d])
        return
    seeded = fresh & np.isfinite(best)
    q[seeded, d] = -best[seeded]
    _mark_dead(q, acc, fresh & ((best == np.inf) | np.isnan(best)))


def _fold_exactly(q, k, v, acc, future, s, pv, v_max: float, rows) -> None:
    """The online-softmax update of one tile with the exact row max (shapes as `_fold_tile`)
    for the rows `rows` (bool): m' = max(m, scores), acc := acc * exp(m - m') + exp(scores -
    m') @ [V | 1], q's -m := -m'. Every row is computed, so each row's bits are the same
    whichever others are updated: the path of rows whose P @ [V | 1] came out non-finite
    (overflow, no shift, garbage), where many rows of a tile at once are common (very peaked
    scores overflow against a sampled seed). A row whose m' is +inf or NaN saw garbage: it is
    marked dead (`_mark_dead`)."""
    d = k.shape[1] - 1
    np.matmul(q[:, :d], k[:, :d].T, out=s)
    if future is not None:  # overwrites NaN/Inf scores of masked keys too
        future.fill(s, -np.inf)
    m_old = -q[:, d]
    m_new = np.maximum(m_old, s.max(axis=1))
    # a row that has seen no key yet has m_new = -inf: shift by 0 so exp gives 0, not NaN
    shift = np.where(m_new == -np.inf, 0, m_new)
    s -= shift[:, None]
    np.exp(s, out=s)
    # P is 0 at masked keys (except on a row whose max is NaN: NaN already), but 0 * inf would
    # still be NaN in a plain P @ V
    _matmul_masked(s, v, None if future is None else future.pairs, pv, math.isfinite(v_max))
    alpha = np.exp(m_old - shift)
    acc[rows] = acc[rows] * alpha[rows, None] + pv[rows]
    q[rows, d] = -m_new[rows]
    _mark_dead(q, acc, rows & ((m_new == np.inf) | np.isnan(m_new)))


def _mark_dead(q, acc, rows) -> None:
    """Rows `rows` (bool or indices) saw garbage (a NaN or +inf score): their out and lse are NaN
    whatever else they see, so m and acc become NaN and no later tile folds them again (a tile
    holding one takes `_fold_tile`'s masked path: a few small passes, on garbage inputs only)."""
    q[rows, -1] = np.nan
    acc[rows] = np.nan


def _fold_rows_exactly(q, k, v, acc, future, rows, v_max: float) -> None:
    """The online-softmax update of one tile with the exact row max, for the rows `rows`
    (indices), each on its own (shapes as `_fold_tile`): m' = max(m, scores), acc := acc *
    exp(m - m') + exp(scores - m') @ [V | 1], q's -m := -m'. One row at a time, so that its
    bits are its own whichever other rows come here (a matmul's rows may round differently
    with its height); ~30 us a row of 512 keys, against ~0.8 ms for the tile's two matmuls."""
    d = k.shape[1] - 1
    v_finite = math.isfinite(v_max)
    for i in rows:
        s = q[i:i + 1, :d] @ k[:, :d].T          # (1, keys)
        pairs = None if future is None else future.pairs[i:i + 1]
        if pairs is not None:  # overwrites NaN/Inf scores of masked keys too
            s[pairs] = -np.inf
        m_old = -q[i, d]
        m_new = np.maximum(m_old, s.max())
        # a row that has seen no key yet has m_new = -inf: shift by 0 so exp gives 0, not NaN
        shift = m_new.dtype.type(0) if m_new == -np.inf else m_new
        p = np.exp(s - shift)
        # P is 0 at masked keys (except on a row whose max is NaN: NaN already), but 0 * inf
        # would still be NaN in a plain P @ V
        pv = _matmul_masked(p, v, pairs, np.empty((1, d + 1), acc.dtype), v_finite)
        acc[i] = acc[i] * np.exp(m_old - shift) + pv[0]
        q[i, d] = -m_new
        if m_new == np.inf or np.isnan(m_new):
            _mark_dead(q, acc, i)


def _neg_lse(lse_rows) -> np.ndarray:
    """-lse, the shift of the backward's scores (q's last column against k's ones gives
    score - lse), except -inf where lse = -inf: such a row saw no key in the forward, so its
    P = exp(score - inf) = 0 (-lse = +inf would make it inf)."""
    neg = -lse_rows
    neg[lse_rows == -np.inf] = -np.inf
    return neg
