"""Local attention in NumPy: the CPU backend's LAO, tiled like FlashAttention.

Each ring step folds one (rows x keys) tile at a time into the running state with online softmax,
so memory is O(S*D + tile) per head, never O(S^2). Matmuls go to BLAS.

Layout, chosen so GQA costs no copy of K/V: queries are grouped under their KV head, as
`(B, Hkv, S*g, D)` with g = H // Hkv (row i*g + j is position i, query head j of the group).
One matmul against a KV head's keys then scores every query head of its group.

What a tile costs (float32, one core of the Zen 5 machine measured): each of its two matmuls
~1.2 ns per score (~105 GFLOP/s, OpenBLAS); each other pass over the tile 0.1-0.4 ns (on an
Intel Xeon, Emerald Rapids: matmuls ~1.1 ns a score on OpenBLAS's SkylakeX kernels, exp 0.53 ns;
`bench/local_cpu.py` measures both). So the forward makes one other pass, exp, and folds the
rest into the matmuls:
* extra columns: q ends in -m and K in ones, so Q K^T yields score - m (a 65th column costs
  0.03 ns a score, against 0.23 for a subtraction pass); V ends in ones, and P times that
  column is the row sums l beside the output, as a matrix-vector product (~0.05 ns, against
  0.1 as a 65th column of P @ V and 0.18 for a row-sum pass: `_times_v`);
* lazy rescaling: a row keeps its shift m (a score it has seen) while a tile's P sums to at
  most LAZY_LIMIT, so there is no row max (0.21 ns) and no rescaling of the accumulator per
  tile; rows past it are rescaled alone (`_rescalable` says which may be), the others —
  and rows without a shift yet or with anything non-finite — folded again exactly
  (`_fold_tile`).
A tile is then two matmuls (and the row sums' matrix-vector product), exp, a max over its row
sums and one accumulate: ~3 ns per score
(the max / subtract / exp / rescale sequence took 3.5 ns with exp2, ~0.2 ns faster than exp).
The backward folds -lse and -delta into its matmuls the same way.

Why exp and not exp2 (with log2(e) folded into q): NumPy's float32 exp2 is an SVML routine that
takes 0.2 ns a value on ordinary scores but leaves its vector path for -inf (masked pairs) and
for results that underflow (scores far below the row's shift, as peaked attention has): 4-90x
slower on such arrays, where NumPy's own exp holds 0.36 ns for any input (2^16 values, half
-inf: exp2 295 us, exp 24 us). In about one process in four, exp2 is also ~4x slower on every
input for the process's life (address-space layout: never with randomisation off). exp gave
the same time, 0.97-1.01x torch's, at seqlen 4096 in every process measured.

Tiles: 512 score rows x 512 keys in the forward, a 1 MiB float32 score tile — the L2 of one
core — beside 130 KiB rows of Q, K, V; the ~10 ufunc calls of Python per tile (~20 us) then
weigh ~3% of its ~0.75 ms. Measured at seqlen 4096, 8 heads, d 64, forward, one thread:
512x512 0.401 s, 384x512 0.402, 256x512 0.405, 512x256 0.414, 256x256 0.425 (two threads:
0.211, -, 0.216, -, 0.233). The backward holds two tiles (P and dS), so its tiles have at most
BACKWARD_TILE_Q rows: together the bytes of one forward tile, and as fast as 512 x 512 (0.928 s
against 0.927). Tiles that a causal diagonal or a window bound cuts through come in strips of
MASK_STRIP query positions narrowed to the keys they see (`_mask_split`).

Threads: work items — in the forward each (batch, kv head)'s K/V layout, then (batch, kv head,
one tile of query rows), largest first; in the backward (batch, kv head, a range of key tiles)
— run on the calling thread and a pool (NumPy and BLAS
release the GIL) with BLAS held to one thread meanwhile. The thread count defaults to the BLAS
library's (1 under OMP_NUM_THREADS=1, as with MPI ranks). Between calls the op keeps its
per-thread scratch (tile-sized); `release_buffers()` frees it. Its (B, Hkv, S, D)-sized work
arrays are allocated per call (keeping them too saved only the page faults of fresh arrays:
1.00x the forward's time at seqlen 1024, 1.08x the backward's, 1.01x at 4096, measured).

Deterministic: the items are cut from the blocks, the shapes and the tile sizes alone, never
from the thread count, and the backward's per-key-range dQ partials are added in key order
whichever thread finishes first — so out, lse, dq, dk and dv are bitwise the same for any
`threads`. Each row's bits depend on that row's inputs alone: which path folds a tile is
decided row by row.

Masked positions are inert: a NaN or Inf in K or V (or Q, dO) at a position a row cannot see
never reaches that row's out, lse or dq, nor the dk/dv of that key through that row. Only tiles
cut by a mask bound hold masked pairs; there P and dS are kept exactly 0 at masked pairs, and a
matmul with a non-finite operand row takes a careful path (`_matmul_masked`). Whether a head
needs any of that is read once per step from per-head max |x| (`_Clean`), so finite inputs pay
one reduction over Q, dO, delta (and K, V once) per masked step, nothing per tile.

float16/bfloat16 inputs are computed in float32 (their accumulation dtype); float64 in float64.
"""

from __future__ import annotations

import math
import os
import threading
from bisect import bisect_right
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from itertools import product
from typing import NamedTuple

import numpy as np

from ...layout import Block
from ..base import LocalOps, accum_dtype

TILE_Q = 512   # score rows per tile (query positions x the g query heads of a kv head)
TILE_K = 512   # keys per tile
BACKWARD_TILE_Q = 256   # at most: the backward holds two tiles (P, dS), together one forward tile
LAZY_LIMIT = 2.0 ** 16       # a lazily folded row whose P sums past this is rescaled or redone
RESCALE_LIMIT = 2.0 ** 32    # ... rescaled if its largest P is at most this, or within the scores' rounding (`_rescalable`)
TAME_V = 2.0 ** 100          # max |V| below which P @ V cannot overflow float32 when P sums to LAZY_LIMIT
SEED_KEYS = 8                # a row's first shift: its max over 2 x this many keys of the tile (`_seed`);
# 16 keys, not 64: a seed's matmul then costs ~10 us rather than ~45 (a seqlen-1024 causal forward
# seeds 40 tiles, most of them 128-row strips of the diagonal). Rows that jump past their seed are
# rescaled or refolded alone, so peaked scores gain little from a larger sample. Against the op that
# sampled 64 keys and redid whole tiles (seqlen 2048, 8 heads, one thread, interleaved in one process):
# score std 4 0.99x its time, std 8 0.84x, std 20 0.50x, std 40 0.64x, std 100 1.02x (rows overflow
# against any sampled seed there: whole tiles are redone, as before); seqlen 1024 causal, std 1: 0.94x


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
    return replace(block, q_start=a, q_len=b - a, q_pos=block.q_pos + a - block.q_start)


def _clip_k(block: Block, lo: int, hi: int) -> Block | None:
    """The part of `block` whose local key rows fall in [lo, hi)."""
    a, b = max(block.k_start, lo), min(block.k_start + block.k_len, hi)
    if a >= b:
        return None
    return replace(block, k_start=a, k_len=b - a, k_pos=block.k_pos + a - block.k_start)


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
    threshold every allocation page-faults anew. by_name: what all threads' buffers of each
    name hold; nbytes: all of them."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.local = threading.local()   # its __dict__ is the calling thread's own
        self.by_name: dict[str, int] = {}
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(self.by_name.values())

    def get(self, name: str, rows: int, cols: int) -> np.ndarray:
        flat = self.local.__dict__
        buf = flat.get(name)
        if buf is None or buf.size < rows * cols:
            new = np.empty(rows * cols, self.dtype)
            grown = new.nbytes - (0 if buf is None else buf.nbytes)
            with self.lock:
                self.by_name[name] = self.by_name.get(name, 0) + grown
            buf = flat[name] = new
        return buf[:rows * cols].reshape(rows, cols)


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
    which its caller sets once for all its tiles (rows it overflows are redone).
    """
    shifted = math.isfinite(q[:, -1].sum())   # else a row without a shift (+inf), or dead
    if not shifted:
        _seed(q, acc, k, future)
        shifted = math.isfinite(q[:, -1].sum())
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


class _InOrder:
    """Turns per head: wait(head, turn) returns once done(head) was called `turn` times. The
    backward adds each head's dQ partials in key-range order with it, whichever thread
    finishes first (item (range c, head) adds only after (range c-1, head)); the forward's
    folds wait for their head's K/V layout (turn 1).

    No deadlock: an item waited for is queued before its waiters (key range by key range; the
    layouts before every fold), and `NumpyOps._run` hands items out in queue order, so it was
    taken by a thread before the waiter was. `_run` releases every waiter when any thread stops
    on an exception (`fail`, its on_failure), wherever it met it, so a pool thread never waits
    forever.
    """

    def __init__(self, heads: int):
        self.added = [0] * heads   # done() calls so far, per head
        self.failed = False
        self.cond = threading.Condition()

    def wait(self, head: int, turn: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.added[head] >= turn or self.failed)
            if self.failed:
                raise _Abandoned("another work item of this step failed")

    def done(self, head: int) -> None:
        with self.cond:
            self.added[head] += 1
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


class _Abandoned(RuntimeError):
    """A work item gave up because another one failed (`_InOrder.fail`): `NumpyOps._run` raises
    the failure itself, not this."""


_DONE = object()   # the end of `NumpyOps._run`'s items


# -- state ---------------------------------------------------------------------------------------------

@dataclass
class ForwardState:
    q_in: np.ndarray          # the caller's (B, S, H, D), grouped on the first step
    scale: float
    # (B, Hkv, S*g, D+1): queries times softmax_scale | -m, the negated running shift of the
    # rows' scores (+inf before a row's first key, NaN once a row is dead: `_mark_dead`)
    q: np.ndarray | None = None
    acc: np.ndarray | None = None   # (B, Hkv, S*g, D+1): un-normalised output | row sum l
    g: int = 1                      # query heads per kv head


@dataclass
class BackwardContext:
    k: np.ndarray      # (B, Hkv, S, D+1), ending in a ones column (against q's -lse)
    v: np.ndarray      # (B, Hkv, S, D+1), ending in a ones column
    dk: np.ndarray     # (B, Hkv, S, D) accumulators
    dv: np.ndarray
    scale: float
    kv_max: np.ndarray | None = None      # (B, Hkv, 2) max |k|, max |v|: at the first masked step


# the CPU flags OpenBLAS's SkylakeX kernels use
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})


def blas_advice(blas_info=None, cpu_flags=None, environ=None) -> str | None:
    """A sentence when NumPy's OpenBLAS runs AVX2 kernels (its core "Haswell" or "Zen") on a
    CPU with AVX-512, else None. The op's time is mostly its two matmuls a tile, and OpenBLAS's
    AVX-512 (SkylakeX) kernels take ~0.55x the time of its AVX2 ones on their shapes (measured
    on the Zen 5 machine of `bench/results/local_cpu_vs_torch.txt`: 512 x 512 x 65 and 512 x 65
    x 512 float32 at 180 and 160 GFLOP/s a core against 99 and 90). OpenBLAS picks its kernels
    when NumPy loads it, from the CPU, unless OPENBLAS_CORETYPE names them. blas_info:
    threadpoolctl's threadpool_info(); cpu_flags: the CPU's flags (default: /proc/cpuinfo's
    first flags line; none elsewhere); environ: default os.environ."""
    if blas_info is None:
        try:
            from threadpoolctl import threadpool_info
        except ImportError:
            return None
        blas_info = threadpool_info()
    openblas = [i for i in blas_info if i.get("internal_api") == "openblas"]
    numpys = [i for i in openblas if "numpy" in str(i.get("filepath", ""))]   # NumPy's own, if listed
    cores = {str(i.get("architecture")) for i in numpys or openblas}
    slow = sorted(cores & {"Haswell", "Zen"})
    if not slow:
        return None
    if cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as fh:
                line = next((ln for ln in fh if ln.startswith("flags")), "")
        except OSError:
            return None
        cpu_flags = line.partition(":")[2].split()
    if not AVX512_FLAGS <= set(cpu_flags):
        return None
    pinned = (os.environ if environ is None else environ).get("OPENBLAS_CORETYPE")
    why = (f"OPENBLAS_CORETYPE={pinned} in the environment makes NumPy's OpenBLAS run"
           if pinned else "NumPy's OpenBLAS picked")
    return (f"{why} its {'/'.join(slow)} (AVX2) kernels on a CPU with AVX-512: with "
            f"OPENBLAS_CORETYPE=SkylakeX (set before Python starts) the CPU backend's matmuls "
            f"take ~0.55x the time")


def _default_threads() -> int:
    try:
        from threadpoolctl import threadpool_info
        blas = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
        if blas:
            return max(1, min(blas))
    except ImportError:
        pass
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class NumpyOps(LocalOps):
    """The CPU local op. tile_q: score rows per tile (query positions x g); tile_k: keys per
    tile; threads: work items run in parallel (default: as many as BLAS uses).
    Between calls it keeps its per-thread scratch for the next call; `release_buffers()`
    frees it. scratch_bytes: the most bytes
    of per-thread scratch (tiles, dq partials) held at once, all threads together — what the op
    uses beyond its O(S * H * D) arrays; tile_scratch_bytes: the part of it in tiles (score-
    shaped, fixed by tile_q and tile_k), without the backward's O(S * D) dq partials."""

    name = "numpy"
    xp = np

    masks_windows = True  # sliding windows (Block.left / Block.right) are masked per element

    def __init__(self, tile_q: int = TILE_Q, tile_k: int = TILE_K, threads: int | None = None):
        if tile_q < 1 or tile_k < 1:
            raise ValueError(f"tile sizes must be positive, got tile_q={tile_q}, tile_k={tile_k}")
        self.tile_q, self.tile_k = tile_q, tile_k
        self.threads = threads or _default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="burstcu-lao") if self.threads > 1 else None
        self._blas = None
        self._scratch = {}
        self.scratch_bytes = self.tile_scratch_bytes = 0

    def release_buffers(self) -> None:
        """Free the kept message buffers and scratch."""
        super().release_buffers()
        self._scratch = {}

    def _scratch_of(self, dtype) -> _Scratch:
        """The scratch for `dtype`, kept between steps (see `_Scratch`)."""
        scratch = self._scratch.get(dtype)
        if scratch is None:
            scratch = self._scratch[dtype] = _Scratch(dtype)
        return scratch

    def _count_scratch(self) -> None:
        held = self._scratch.values()
        self.scratch_bytes = max(self.scratch_bytes, sum(x.nbytes for x in held))
        tiles = sum(n for x in held for name, n in x.by_name.items() if name != "dq")
        self.tile_scratch_bytes = max(self.tile_scratch_bytes, tiles)

    def close(self) -> None:
        """Free the buffers and stop the worker threads (the op runs serially afterwards)."""
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _run(self, work, items, on_failure=None) -> None:
        """work(item) for every item, in order of `items`, on this thread and threads - 1 pool
        threads, with BLAS held to one thread: the parallelism is across items; a multi-threaded
        BLAS on tile-sized matmuls spends more time synchronising its threads than multiplying
        (10x slower, measured). The calling thread works too rather than sleeping until the
        pool is done: each wake-up of a sleeping thread costs a core a context switch.
        Each thread takes the next item in order, so an item waited for (`_InOrder`) was
        taken before its waiter. A thread that meets an exception (in an item or between two)
        calls on_failure() (`_InOrder.fail`: waiters give up), and no thread takes another
        item; once every thread has stopped, the failure is raised — the first exception that
        is not a waiter's `_Abandoned`, whichever thread met it. Pool threads run under the
        caller's np.errstate, as the calling thread does."""
        if self._blas is None:
            from threadpoolctl import ThreadpoolController
            self._blas = ThreadpoolController()
        with self._blas.limit(limits=1, user_api="blas"):
            if self._pool is None or len(items) == 1:
                for item in items:
                    work(item)
                return
            queue, lock, failed = iter(items), threading.Lock(), []
            errstate = np.geterr()

            def drain():
                try:
                    with np.errstate(**errstate):
                        while not failed:
                            with lock:
                                item = next(queue, _DONE)
                            if item is _DONE:
                                return
                            work(item)
                except BaseException as error:
                    failed.append(error)
                    if on_failure is not None:
                        on_failure()
            helpers = [self._pool.submit(drain) for _ in range(min(self.threads, len(items)) - 1)]
            try:
                drain()
            finally:
                for helper in helpers:
                    helper.exception()   # waits; drain itself raises nothing
            if failed:
                raise next((e for e in failed if not isinstance(e, _Abandoned)), failed[0])

    @staticmethod
    def _each_head(fn, b: int, hkv: int) -> None:
        """fn(bi, hi) for every head, in this thread: the layout passes are memory-bound copies,
        and handing them to the pool in a `_run` of their own costs more than a second core
        gains (seqlen 1024, 8 heads: 0.47 ms here, 0.88 ms on two pool threads; forward_finalize's
        divide: 15.6 ms a forward either way; measured). The forward step lays out inside its
        folds' `_run` instead: the first step's queries in the fold items, on the thread that
        folds them next (1024 forward, two threads: 1.25 to 1.2x torch's time, causal 1.3 to
        1.2x, with the one-rank burst reading K, V in place), and K, V as items of their own
        queued before the folds."""
        for bi, hi in product(range(b), range(hkv)):
            fn(bi, hi)

    # -- forward -----------------------------------------------------------------------------------
    def forward_init(self, q, softmax_scale):
        return ForwardState(q_in=q, scale=softmax_scale)

    def forward_step(self, st, k, v, blocks):
        b, sk, hkv, d = k.shape
        first = st.q is None   # grouping needs Hkv, known from the first step's k
        if first:
            acc_t, st.g = accum_dtype(st.q_in.dtype), st.q_in.shape[2] // hkv
            st.q, st.acc = (np.empty((b, hkv, st.q_in.shape[1] * st.g, d + 1), acc_t) for _ in range(2))
        g, acc_t = st.g, st.q.dtype
        kh, vh = (np.empty((b, hkv, sk, d + 1), acc_t) for _ in range(2))
        v_max = np.empty((b, hkv))    # max |V| per head (see _fold_tile)

        rows = max(1, self.tile_q // g)   # query positions per tile
        spans = _spans([(blk.q_start, blk.q_start + blk.q_len) for blk in blocks], rows)
        parts = _parts_by_span(blocks, spans, _clip_q, lambda blk: (blk.q_start, blk.q_len))
        scratch = self._scratch_of(acc_t)

        def put_rows(bi, hi, lo, end):   # the first step lays out q's rows [lo, end) and zeroes acc's
            _put(st.q[bi, hi, lo * g:end * g], st.q_in[bi, lo:end, hi * g:(hi + 1) * g], st.scale, np.inf)
            st.acc[bi, hi, lo * g:end * g].fill(0)

        def layout(bi, hi):
            if first:   # rows no span covers here; each fold lays out its span's own
                for lo, end in _gaps(spans, st.q_in.shape[1]):
                    put_rows(bi, hi, lo, end)
            _put(kh[bi, hi], k[bi, :, hi:hi + 1], None, 1)
            _put(vh[bi, hi], v[bi, :, hi:hi + 1], None, 1)
            v_max[bi, hi] = _max_abs(vh[bi, hi, :, :d])

        # Items: each head's layout, then the folds (head, span), which wait for their head's
        # layout alone. So the threads lay out heads side by side rather than the calling thread
        # all of them while the others wait, and folds are queued largest first (by their tiles'
        # area: causal spans grow down the sequence), so the last to finish are small ones.
        heads = list(product(range(b), range(hkv)))
        laid_out = _InOrder(len(heads))
        area = [sum((q1 - q0) * (k1 - k0) for part in span_parts for q0, q1, k0, k1, _ in
                    _tiles(part, rows, self.tile_k)) for span_parts in parts]
        folds = sorted(product(range(len(heads)), range(len(spans))), key=lambda item: -area[item[1]])

        def work(item):
            head, span = item
            bi, hi = heads[head]
            if span is None:
                layout(bi, hi)
                laid_out.done(head)
                return
            laid_out.wait(head, 1)
            if first:   # on the thread that folds these rows next, while they are in its cache
                put_rows(bi, hi, *spans[span])
            for part in parts[span]:
                self._forward_block(st.q[bi, hi], kh[bi, hi], vh[bi, hi], st.acc[bi, hi], part, g,
                                    scratch, float(v_max[bi, hi]))
        self._run(work, [(head, None) for head in range(len(heads))] + folds, laid_out.fail)
        st.q_in = None
        self._count_scratch()

    def _forward_block(self, q, k, v, acc, block: Block, g: int, scratch: _Scratch,
                       v_max: float) -> None:
        """One head: q (S*g, D+1) scaled queries | -m; k, v (S, D+1) ending in ones; acc
        (S*g, D+1). Each tile is folded lazily when that is safe, else exactly."""
        with np.errstate(over="ignore", invalid="ignore"):   # once, not per tile (~1.2 us each)
            for q0, q1, k0, k1, masked in _tiles(block, max(1, self.tile_q // g), self.tile_k):
                r0, r1 = q0 * g, q1 * g
                # the backward's buffers under the same names: a step holds one set, whichever pass
                s = scratch.get("scores", r1 - r0, k1 - k0)
                pv = scratch.get("rows", r1 - r0, v.shape[1])
                future = _future(block, q0, q1, k0, k1, g) if masked else None
                _fold_tile(q[r0:r1], k[k0:k1], v[k0:k1], acc[r0:r1], future, s, pv, v_max)

    def forward_finalize(self, st, out_dtype):
        """out = acc / l in (B, S, H, D); lse = m + log l (B, H, S), from the running shift m;
        rows that saw no key get out 0 and lse -inf."""
        if st.q is None:
            raise RuntimeError("forward_finalize before any forward_step, or twice")
        b, hkv, sg, d = st.acc.shape[0], st.acc.shape[1], st.acc.shape[2], st.acc.shape[3] - 1
        g, acc_t = st.g, st.acc.dtype
        s = sg // g
        l = st.acc[..., d]
        seen = l != 0  # NaN rows count as seen, so their lse is NaN too, not "no key" (-inf)
        l_safe = np.where(seen, l, 1)
        # in float64 (longdouble for float64 input), rounded once to the state's dtype
        wide = np.longdouble if acc_t == np.float64 else np.float64
        m = -st.q[..., d].astype(wide)
        lse = np.where(seen, m + np.log(l_safe.astype(wide)), -np.inf).astype(acc_t)
        out = np.empty((b, s, hkv * g, d), acc_t)

        def divide(bi, hi):
            np.divide(st.acc[bi, hi, :, :d].reshape(s, g, d), l_safe[bi, hi].reshape(s, g, 1),
                      out=out[bi, :, hi * g:(hi + 1) * g])
        self._each_head(divide, b, hkv)
        st.q = st.acc = None
        return out.astype(out_dtype, copy=False), np.ascontiguousarray(_rows_ungrouped(lse, g))

    # -- backward ----------------------------------------------------------------------------------
    def backward_delta(self, dout, out):
        acc_t = accum_dtype(dout.dtype)
        prod = np.einsum("bshd,bshd->bhs", dout.astype(acc_t, copy=False), out.astype(acc_t, copy=False))
        return np.ascontiguousarray(prod)

    def backward_init(self, k, v, softmax_scale):
        b, s, hkv, d = k.shape
        acc_t = accum_dtype(k.dtype)
        ctx = BackwardContext(np.empty((b, hkv, s, d + 1), acc_t), np.empty((b, hkv, s, d + 1), acc_t),
                              np.empty((b, hkv, s, d), acc_t), np.empty((b, hkv, s, d), acc_t), softmax_scale)

        def layout(bi, hi):
            _put(ctx.k[bi, hi], k[bi, :, hi:hi + 1], None, 1)
            _put(ctx.v[bi, hi], v[bi, :, hi:hi + 1], None, 1)
            ctx.dk[bi, hi].fill(0)
            ctx.dv[bi, hi].fill(0)
        self._each_head(layout, b, hkv)
        return ctx

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum=None):
        b, hkv, _, d = ctx.dk.shape
        acc_t, g = ctx.k.dtype, q.shape[2] // hkv
        qs, do, dq_acc, clean = self._backward_layout(ctx, q, dout, lse, delta, blocks)
        # one item per (key range, batch, kv head); it owns the dk, dv rows of its keys. Items
        # are queued key range by key range, so threads mostly work on different heads at once.
        extents = [(blk.k_start, blk.k_start + blk.k_len) for blk in blocks]
        ranges = _spans(extents, self.tile_k * self._key_tiles_per_item(extents, b * hkv))
        parts_of = _parts_by_span(blocks, ranges, _clip_k, lambda blk: (blk.k_start, blk.k_len))
        heads = list(product(range(b), range(hkv)))
        # row sums of P: one slot per item, summed in range order afterwards (no races, and the
        # order of the sum never depends on threads)
        p_sums = None if psum is None else np.zeros((len(ranges),) + qs.shape[:3], acc_t)
        turns, scratch = _InOrder(len(heads)), self._scratch_of(acc_t)

        def work(item):
            ci, head = item
            bi, hi = heads[head]
            self._backward_item(ctx, qs, do, dq_acc, p_sums, bi, hi, ci, parts_of[ci], g,
                                scratch, clean[bi][hi], turns, head)
        self._run(work, list(product(range(len(ranges)), range(len(heads)))), turns.fail)
        self._count_scratch()

        def add_dq(bi, hi):
            dq_acc[bi, hi] *= acc_t.type(ctx.scale)
            dq[bi, :, hi * g:(hi + 1) * g] += dq_acc[bi, hi].reshape(-1, g, d)
        self._each_head(add_dq, b, hkv)
        if p_sums is not None:
            psum += _rows_ungrouped(p_sums.sum(axis=0), g)

    def _backward_layout(self, ctx, q, dout, lse, delta, blocks):
        """(qs, do, dq_acc, clean) for one step, laid out head by head. q ends in
        -lse and dO in -delta, against k's and v's ones columns: the matmuls yield score - lse
        and dO V^T - delta with no pass of their own. qs (B, Hkv, S*g, D+1): softmax_scale * q
        | -lse (`_neg_lse`); do (B, Hkv, S*g, D+1); dq_acc
        (B, Hkv, S*g, D) zeroed; clean[bi][hi]: `_Clean` of that head (checked only under a
        mask)."""
        b, hkv, _, d = ctx.dk.shape
        acc_t, rows, g = ctx.k.dtype, q.shape[1] * (q.shape[2] // hkv), q.shape[2] // hkv
        neg_lse = _neg_lse(_rows_grouped(lse, hkv, acc_t))
        delta_rows = _rows_grouped(delta, hkv, acc_t)
        qs, do = (np.empty((b, hkv, rows, d + 1), acc_t) for _ in range(2))
        dq_acc = np.empty((b, hkv, rows, d), acc_t)
        clean = [[_Clean()] * hkv for _ in range(b)]
        masked = any(blk.masked for blk in blocks)
        measure_kv = masked and ctx.kv_max is None
        if measure_kv:
            ctx.kv_max = np.empty((b, hkv, 2))

        def layout(bi, hi):
            _put(qs[bi, hi], q[bi, :, hi * g:(hi + 1) * g], ctx.scale, neg_lse[bi, hi])
            _put(do[bi, hi], dout[bi, :, hi * g:(hi + 1) * g], None, -delta_rows[bi, hi])
            dq_acc[bi, hi].fill(0)
            if measure_kv:
                ctx.kv_max[bi, hi] = _max_abs(ctx.k[bi, hi, :, :d]), _max_abs(ctx.v[bi, hi, :, :d])
            if masked:
                clean[bi][hi] = _Clean.of(qs[bi, hi, :, :d], do[bi, hi, :, :d], delta_rows[bi, hi],
                                          *ctx.kv_max[bi, hi])
        self._each_head(layout, b, hkv)
        return qs, do, dq_acc, clean

    def _backward_item(self, ctx, qs, do, dq_acc, p_sums, bi, hi, ci, parts, g, scratch,
                       clean, turns, head) -> None:
        """Key range ci of head (bi, hi): its dk, dv rows, and its dq partial added to dq_acc
        (B, Hkv, S*g, D) after range ci - 1's. Range 0 accumulates into dq_acc itself; later
        ranges into a partial added in range order, so the sum's order never depends on threads."""
        r0 = min((p.q_start for p in parts), default=0) * g
        r1 = max((p.q_start + p.q_len for p in parts), default=0) * g
        target = dq_acc[bi, hi] if ci == 0 else scratch.get("dq", dq_acc.shape[2], dq_acc.shape[3])
        if ci:
            target[r0:r1] = 0
        row_p = None if p_sums is None else p_sums[ci, bi, hi]
        for part in parts:
            self._backward_block(qs[bi, hi], do[bi, hi], ctx.k[bi, hi], ctx.v[bi, hi], ctx.dk[bi, hi],
                                 ctx.dv[bi, hi], target, part, g, scratch, clean, row_p)
        turns.wait(head, ci)
        if ci:
            dq_acc[bi, hi, r0:r1] += target[r0:r1]
        turns.done(head)

    def _key_tiles_per_item(self, extents, heads: int) -> int:
        """Key tiles per backward item, from the shapes alone (never the thread count, which
        would change how dq is summed): about BACKWARD_ITEMS items or more per step — enough
        to feed that many threads — with as few dq partials to add as that allows."""
        keys = _spans(extents, self.tile_k)
        return max(1, len(keys) * heads // BACKWARD_ITEMS)

    def _backward_block(self, q, do, k, v, dk, dv, dq, block: Block, g: int,
                        scratch: _Scratch, clean: _Clean, row_p=None) -> None:
        """One head: q (S*g, D+1) scaled queries | -lse; do (S*g, D+1) dO | -delta; k, v
        (S, D+1) ending in ones; dq (S*g, D); dk, dv (S, D);
        row_p (S*g,) or None: each row's sum of P is added to it."""
        d = dk.shape[1]
        rows_per_tile = max(1, min(self.tile_q, BACKWARD_TILE_Q) // g)
        for q0, q1, k0, k1, masked in _tiles(block, rows_per_tile, self.tile_k, keys_outer=True):
            r0, r1 = q0 * g, q1 * g
            rows, keys = r1 - r0, k1 - k0
            pair = scratch.get("scores", 2 * rows, keys)   # P and dS: the bytes of one forward tile
            p, ds = pair[:rows], pair[rows:]
            np.matmul(q[r0:r1], k[k0:k1].T, out=p)        # score - lse
            future = _future(block, q0, q1, k0, k1, g) if masked else None
            if masked:  # mask before exp: a masked score may exceed lse, and inf * 0 is NaN
                future.fill(p, -np.inf)
            np.exp(p, out=p)
            if row_p is not None:
                row_p[r0:r1] += np.matmul(p, np.ones(keys, p.dtype))
            key_grad, row_grad = scratch.get("keys", keys, d), scratch.get("rows", rows, d)
            q_r, do_r, k_k = q[r0:r1, :d], do[r0:r1, :d], k[k0:k1, :d]
            # with P and dS exactly 0 at masked pairs, _matmul_masked keeps a non-finite dO, K
            # or Q row out of the pairs that do not see it
            pairs = None if future is None else future.pairs
            future_t = None if future is None else pairs.T
            dv[k0:k1] += _matmul_masked(p.T, do_r, future_t, key_grad, clean.do)
            np.matmul(do[r0:r1], v[k0:k1].T, out=ds)      # dO V^T - delta
            ds *= p
            if masked and not clean.ds:
                # dS is 0 at masked pairs by definition; the product above is NaN there when
                # V, dO or delta is not finite (or dO V^T overflows)
                future.fill(ds, 0)
            dq[r0:r1] += _matmul_masked(ds, k_k, pairs, row_grad, clean.k)
            # q carries softmax_scale, which the sum over rows of dS q then holds too
            dk[k0:k1] += _matmul_masked(ds.T, q_r, future_t, key_grad, clean.q)

    def backward_finalize(self, ctx, out_dtype):
        """(dk, dv) (B, S, Hkv, D) in out_dtype."""
        b, hkv, s, d = ctx.dk.shape
        dk, dv = (np.empty((b, s, hkv, d), ctx.dk.dtype) for _ in range(2))

        def put(bi, hi):
            dk[bi, :, hi] = ctx.dk[bi, hi]
            dv[bi, :, hi] = ctx.dv[bi, hi]
        self._each_head(put, b, hkv)
        ctx.k = ctx.v = ctx.dk = ctx.dv = None
        return dk.astype(out_dtype, copy=False), dv.astype(out_dtype, copy=False)
