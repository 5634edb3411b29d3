"""Local attention in NumPy: the CPU backend's LAO, tiled like FlashAttention.

Each ring step folds one (rows x keys) tile at a time into the running state with online softmax,
so memory is O(S*D + tile) per head, never O(S^2). Matmuls go to BLAS.

Layout, chosen so GQA costs no copy of K/V: queries are grouped under their KV head, as
`(B, Hkv, S*g, D)` with g = H // Hkv (row i*g + j is position i, query head j of the group).
One matmul against a KV head's keys then scores every query head of its group.

Speed on a CPU, where NumPy's elementwise passes run on one core and BLAS on all of them:
* work is split into independent items — (batch, kv head, one tile of query rows) in the
  forward, (batch, kv head, a range of key tiles) in the backward — run by a thread pool (NumPy
  and BLAS release the GIL) with BLAS held to one thread meanwhile, so exp/max passes use every
  core;
* tiles of 512 score rows x 512 keys (1 MiB of float32 scores): the best of a sweep at seqlen
  4096, 8 heads, headdim 64 (256x512: 0.34 s, 512x512: 0.30 s, 1024x1024: 0.32 s, 2 cores);
* V carries an extra column of ones, so one matmul P @ [V | 1] updates both the output
  accumulator and the row sum l (its last column) — one fewer pass over P.
The thread count defaults to the BLAS library's (1 under OMP_NUM_THREADS=1, as with MPI ranks).

Deterministic: the items are cut from the blocks, the shapes and the tile sizes alone, never
from the thread count, and the backward's per-key-range dQ partials are added in key order
whichever thread finishes first — so out, lse, dq, dk and dv are bitwise the same for any
`threads`.

Masked positions are inert: a NaN or Inf in K or V (or Q, dO) at a position a row cannot see
never reaches that row's out, lse or dq, nor the dk/dv of that key through that row. Only tiles
straddling the causal diagonal hold masked pairs; there P and dS are kept exactly 0 at masked
pairs, and a matmul with a non-finite operand row takes a careful path (`_matmul_masked`). Whether
a head needs any of that is read once per step from per-head max |x| (`_Clean`), so finite
inputs pay one reduction over Q, dO, delta (and K, V once) per causal step, nothing per tile.

float16/bfloat16 inputs are computed in float32 (their accumulation dtype); float64 in float64.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_right
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import product
from typing import NamedTuple

import numpy as np

from ..layout import Block
from .base import LocalOps, accum_dtype

TILE_Q = 512   # score rows per tile (query positions x the g query heads of a kv head)
TILE_K = 512   # keys per tile


# -- layouts -----------------------------------------------------------------------------------------

def _grouped(x, hkv: int, dtype, scale=None) -> np.ndarray:
    """(B, S, H, D) -> new contiguous (B, Hkv, S*g, D) in `dtype`, times `scale` if given."""
    b, s, h, d = x.shape
    out = np.empty((b, hkv, s, h // hkv, d), dtype=dtype)
    out[...] = x.reshape(b, s, hkv, h // hkv, d).transpose(0, 2, 1, 3, 4)
    if scale is not None:
        out *= dtype.type(scale)
    return out.reshape(b, hkv, s * (h // hkv), d)


def _ungrouped(x, s: int) -> np.ndarray:
    """(B, Hkv, S*g, D) -> (B, S, H, D) (a view when possible)."""
    b, hkv, sg, d = x.shape
    g = sg // s
    return x.reshape(b, hkv, s, g, d).transpose(0, 2, 1, 3, 4).reshape(b, s, hkv * g, d)


def _rows_grouped(x, hkv: int, dtype) -> np.ndarray:
    """(B, H, S) -> contiguous (B, Hkv, S*g)."""
    b, h, s = x.shape
    g = h // hkv
    return np.ascontiguousarray(x.reshape(b, hkv, g, s).transpose(0, 1, 3, 2), dtype=dtype).reshape(b, hkv, s * g)


def _rows_ungrouped(x, g: int) -> np.ndarray:
    """(B, Hkv, S*g) -> (B, H, S)."""
    b, hkv, sg = x.shape
    return x.reshape(b, hkv, sg // g, g).transpose(0, 1, 3, 2).reshape(b, hkv * g, sg // g)


def _heads_major(x, dtype, extra_ones: bool = False) -> np.ndarray:
    """(B, S, Hkv, D) -> contiguous (B, Hkv, S, D), or (B, Hkv, S, D+1) ending in a ones column."""
    b, s, hkv, d = x.shape
    out = np.empty((b, hkv, s, d + extra_ones), dtype=dtype)
    out[..., :d] = x.transpose(0, 2, 1, 3)
    if extra_ones:
        out[..., d] = 1
    return out


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
MIN_DIAGONAL_TILE = 128  # keys: tiles straddling the causal diagonal are halved down to this


def _tiles(block: Block, tile_q: int, tile_k: int, keys_outer: bool = False):
    """(q0, q1, k0, k1, masked) for the tiles of `block` that are not wholly in the future.

    Under a causal block, a tile straddling the diagonal is split into quadrants (down to
    MIN_DIAGONAL_TILE keys) so that its future half is skipped rather than computed and masked.
    """
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
    mask: tiles a mask bound cuts through are split into quadrants (down to MIN_DIAGONAL_TILE
    keys), so that their wholly masked parts are skipped rather than computed and masked."""
    if not block.masked:
        yield q0, q1, k0, k1, False
        return
    lo, hi = _key_bounds(block)
    first_q = block.q_pos + q0 - block.q_start
    last_q = block.q_pos + q1 - 1 - block.q_start
    first_k = block.k_pos + k0 - block.k_start
    last_k = block.k_pos + k1 - 1 - block.k_start
    if first_k > last_q + hi or last_k < first_q - lo:
        return  # wholly masked (causal: wholly in the future)
    if last_k <= first_q + hi and first_k >= last_q - lo:
        yield q0, q1, k0, k1, False
        return
    if k1 - k0 <= MIN_DIAGONAL_TILE or q1 - q0 < 2:
        yield q0, q1, k0, k1, True
        return
    qm, km = (q0 + q1) // 2, (k0 + k1) // 2
    for a, b in ((q0, qm), (qm, q1)):
        for c, d in ((k0, km), (km, k1)):
            yield from _mask_split(block, a, b, c, d)


class _Scratch:
    """Reusable buffers, one set per thread, kept for one step. A fresh tile-sized array per
    tile costs more than the arithmetic on it: above malloc's mmap threshold every allocation
    page-faults anew."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.local = threading.local()   # its __dict__ is the calling thread's own

    def get(self, name: str, rows: int, cols: int) -> np.ndarray:
        flat = self.local.__dict__
        buf = flat.get(name)
        if buf is None or buf.size < rows * cols:
            buf = flat[name] = np.empty(rows * cols, self.dtype)
        return buf[:rows * cols].reshape(rows, cols)


def _future(block: Block, q0: int, q1: int, k0: int, k1: int, g: int) -> np.ndarray:
    """Boolean (rows*g, keys): True where the pair is masked (the key in the query's future,
    or outside its window)."""
    lo, hi = _key_bounds(block)
    qp = block.q_pos - block.q_start + np.arange(q0, q1)
    kp = block.k_pos - block.k_start + np.arange(k0, k1)
    offset = kp[None, :] - qp[:, None]
    return np.repeat((offset > hi) | (offset < -lo), g, axis=0)


def _max_abs(x) -> np.ndarray:
    """(B, Hkv) largest |x| in each head of x (B, Hkv, ...): NaN if the head holds a NaN, inf if
    an Inf. Two reductions, no temporary array."""
    axes = tuple(range(2, x.ndim))
    return np.maximum(x.max(axis=axes), -x.min(axis=axes))


class _Clean(NamedTuple):
    """What one head's masked tiles may skip: each False sends them down a careful path.
    q, do, k: that operand is all finite (else `_matmul_masked` checks its rows);
    ds: dS = P * (dO V^T - delta) is finite everywhere, so exactly 0 where P is (else dS is
    zeroed at masked pairs, where 0 * inf would make it NaN)."""
    q: bool = True
    do: bool = True
    k: bool = True
    ds: bool = True


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


class _InOrder:
    """Turns per head, so that the backward adds each head's dQ partials in key-range order
    whichever thread finishes first: item (range c, head) adds only after (range c-1, head).

    No deadlock: items are queued range by range into a FIFO pool, so the item a waiter waits
    for was taken by a thread before the waiter was. An item that fails releases every waiter
    (which then fails too), so a pool thread never waits forever.
    """

    def __init__(self, heads: int):
        self.added = [0] * heads   # ranges whose partial each head has received
        self.failed = False
        self.cond = threading.Condition()

    def wait(self, head: int, turn: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.added[head] >= turn or self.failed)
            if self.failed:
                raise RuntimeError("another work item of this backward step failed")

    def done(self, head: int) -> None:
        with self.cond:
            self.added[head] += 1
            self.cond.notify_all()

    def fail(self) -> None:
        with self.cond:
            self.failed = True
            self.cond.notify_all()


# -- state ---------------------------------------------------------------------------------------------

@dataclass
class ForwardState:
    q_in: np.ndarray          # the caller's (B, S, H, D), grouped on the first step
    scale: float
    q: np.ndarray | None = None     # (B, Hkv, S*g, D), times softmax_scale
    acc: np.ndarray | None = None   # (B, Hkv, S*g, D+1): un-normalised output | row sum l
    m: np.ndarray | None = None     # (B, Hkv, S*g): running row max of the scaled scores
    g: int = 1                      # query heads per kv head


@dataclass
class BackwardContext:
    k: np.ndarray      # (B, Hkv, S, D)
    v: np.ndarray
    dk: np.ndarray     # (B, Hkv, S, D) accumulators (dk carries the softmax scale already)
    dv: np.ndarray
    scale: float
    k_max: np.ndarray | None = None      # (B, Hkv) max |k|, max |v|: at the first masked step
    v_max: np.ndarray | None = None


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
    tile; threads: work items run in parallel (default: as many as BLAS uses)."""

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

    def close(self) -> None:
        """Free the buffers and stop the worker threads (the op runs serially afterwards)."""
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _run(self, work, items) -> None:
        """work(item) for every item, on the pool or serially, with BLAS held to one thread:
        the parallelism is across items; a multi-threaded BLAS on tile-sized matmuls spends
        more time synchronising its threads than multiplying (10x slower, measured).
        Pool threads run under the caller's np.errstate, as the serial path does."""
        if self._blas is None:
            from threadpoolctl import ThreadpoolController
            self._blas = ThreadpoolController()
        with self._blas.limit(limits=1, user_api="blas"):
            if self._pool is None or len(items) == 1:
                for item in items:
                    work(item)
            else:
                errstate = np.geterr()

                def under_errstate(item):
                    with np.errstate(**errstate):
                        work(item)
                for _ in self._pool.map(under_errstate, items):  # re-raises a worker's exception
                    pass

    # -- forward -----------------------------------------------------------------------------------
    def forward_init(self, q, softmax_scale):
        return ForwardState(q_in=q, scale=softmax_scale)

    def _ensure_state(self, st: ForwardState, hkv: int) -> None:
        """Grouping needs Hkv, known from the first step's k."""
        if st.q is None:
            acc_t = accum_dtype(st.q_in.dtype)
            st.g = st.q_in.shape[2] // hkv
            st.q = _grouped(st.q_in, hkv, acc_t, st.scale)
            b, _, sg, d = st.q.shape
            st.acc = np.zeros((b, hkv, sg, d + 1), acc_t)
            st.m = np.full((b, hkv, sg), -np.inf, acc_t)
            st.q_in = None

    def forward_step(self, st, k, v, blocks):
        hkv = k.shape[2]
        self._ensure_state(st, hkv)
        acc_t = st.q.dtype
        kh, vh = _heads_major(k, acc_t), _heads_major(v, acc_t, extra_ones=True)
        b, g = st.q.shape[0], st.g
        tile_rows = max(1, self.tile_q // g)
        spans = _spans([(blk.q_start, blk.q_start + blk.q_len) for blk in blocks], tile_rows)
        parts = _parts_by_span(blocks, spans, _clip_q, lambda blk: (blk.q_start, blk.q_len))
        items = list(product(range(b), range(hkv), range(len(spans))))
        scratch = _Scratch(acc_t)
        v_finite = np.isfinite(_max_abs(vh)) if any(blk.masked for blk in blocks) else None

        def work(item):
            bi, hi, span = item
            finite = v_finite is None or bool(v_finite[bi, hi])
            for part in parts[span]:
                self._forward_block(st.q[bi, hi], kh[bi, hi], vh[bi, hi], st.acc[bi, hi],
                                    st.m[bi, hi], part, g, scratch, finite)
        self._run(work, items)

    def _forward_block(self, q, k, v_ext, acc, m, block: Block, g: int, scratch: _Scratch,
                       v_finite: bool) -> None:
        """One head: q (S*g, D), k (S, D), v_ext (S, D+1), acc (S*g, D+1), m (S*g,)."""
        for q0, q1, k0, k1, masked in _tiles(block, max(1, self.tile_q // g), self.tile_k):
            r0, r1 = q0 * g, q1 * g
            s = scratch.get("s", r1 - r0, k1 - k0)
            np.matmul(q[r0:r1], k[k0:k1].T, out=s)
            future = _future(block, q0, q1, k0, k1, g) if masked else None
            if masked:  # overwrites NaN/Inf scores of masked keys too
                np.copyto(s, -np.inf, where=future)
            m_old = m[r0:r1]
            m_new = np.maximum(m_old, s.max(axis=1))
            # a row that has seen no key yet has m_new = -inf: shift by 0 so exp gives 0, not NaN
            shift = np.where(m_new == -np.inf, 0, m_new)
            s -= shift[:, None]
            np.exp(s, out=s)
            alpha = np.exp(m_old - shift)
            pv = scratch.get("pv", r1 - r0, v_ext.shape[1])
            # P is 0 at masked keys (except on a row whose max is NaN: NaN already), but
            # 0 * inf would still be NaN in a plain P @ V
            _matmul_masked(s, v_ext[k0:k1], future, pv, v_finite)
            acc[r0:r1] *= alpha[:, None]
            acc[r0:r1] += pv
            m[r0:r1] = m_new

    def forward_finalize(self, st, out_dtype):
        if st.q is None:
            raise RuntimeError("forward_finalize before any forward_step")
        l = st.acc[..., -1]
        seen = l != 0  # NaN rows count as seen, so their lse is NaN too, not "no key" (-inf)
        l_safe = np.where(seen, l, 1)
        out = st.acc[..., :-1] / l_safe[..., None]
        lse = np.where(seen, st.m + np.log(l_safe), -np.inf)
        seqlen = st.acc.shape[2] // st.g
        return (np.ascontiguousarray(_ungrouped(out, seqlen), dtype=out_dtype),
                np.ascontiguousarray(_rows_ungrouped(lse, st.g)))

    # -- backward ----------------------------------------------------------------------------------
    def backward_delta(self, dout, out):
        acc_t = accum_dtype(dout.dtype)
        prod = np.einsum("bshd,bshd->bhs", dout.astype(acc_t, copy=False), out.astype(acc_t, copy=False))
        return np.ascontiguousarray(prod)

    def backward_init(self, k, v, softmax_scale):
        acc_t = accum_dtype(k.dtype)
        kh, vh = _heads_major(k, acc_t), _heads_major(v, acc_t)
        return BackwardContext(kh, vh, np.zeros_like(kh), np.zeros_like(vh), softmax_scale)

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum=None):
        acc_t = ctx.k.dtype
        b, hkv, _, d = ctx.k.shape
        # scores exactly as the forward computed them, (scale * q) @ k^T, so that P recomputed
        # from lse matches the forward's rounding (matters when logits are ~1e3)
        qs = _grouped(q, hkv, acc_t, ctx.scale)
        do = _grouped(dout, hkv, acc_t)
        g = qs.shape[2] // q.shape[1]
        # rows with lse = -inf saw no key in the forward: P = exp(score - inf) = 0 there
        lse_rows = _rows_grouped(lse, hkv, acc_t)
        lse_rows[lse_rows == -np.inf] = np.inf
        delta_rows = _rows_grouped(delta, hkv, acc_t)
        # one item per (key range, batch, kv head); it owns the dk, dv rows of its keys. Items
        # are queued key range by key range, so threads mostly work on different heads at once.
        extents = [(blk.k_start, blk.k_start + blk.k_len) for blk in blocks]
        ranges = _spans(extents, self.tile_k * self._key_tiles_per_item(extents, b * hkv))
        parts_of = _parts_by_span(blocks, ranges, _clip_k, lambda blk: (blk.k_start, blk.k_len))
        heads = list(product(range(b), range(hkv)))
        items = list(product(range(len(ranges)), range(len(heads))))
        dq_acc = np.zeros(qs.shape, acc_t)
        # row sums of P: one slot per item, summed in range order afterwards (no races, and the
        # order of the sum never depends on threads)
        p_sums = None if psum is None else np.zeros((len(ranges),) + qs.shape[:3], acc_t)
        turns, scratch = _InOrder(len(heads)), _Scratch(acc_t)
        clean = self._head_checks(ctx, qs, do, delta_rows, blocks)

        def work(item):
            ci, head = item
            bi, hi = heads[head]
            try:
                parts = parts_of[ci]
                # range 0 accumulates into dq_acc itself; later ranges into a partial that is
                # added to dq_acc in range order, so the sum's order never depends on threads
                r0 = min((p.q_start for p in parts), default=0) * g
                r1 = max((p.q_start + p.q_len for p in parts), default=0) * g
                target = dq_acc[bi, hi] if ci == 0 else scratch.get("dq", qs.shape[2], d)
                if ci:
                    target[r0:r1] = 0
                row_p = None if p_sums is None else p_sums[ci, bi, hi]
                for part in parts:
                    self._backward_block(qs[bi, hi], do[bi, hi], lse_rows[bi, hi], delta_rows[bi, hi],
                                         ctx.k[bi, hi], ctx.v[bi, hi], ctx.dk[bi, hi], ctx.dv[bi, hi],
                                         target, part, g, scratch, clean(bi, hi), row_p)
                turns.wait(head, ci)
                if ci:
                    dq_acc[bi, hi, r0:r1] += target[r0:r1]
                turns.done(head)
            except BaseException:
                turns.fail()
                raise
        self._run(work, items)
        dq_acc *= acc_t.type(ctx.scale)
        dq += _ungrouped(dq_acc, q.shape[1])
        if p_sums is not None:
            psum += _rows_ungrouped(p_sums.sum(axis=0), g)

    def _key_tiles_per_item(self, extents, heads: int) -> int:
        """Key tiles per backward item, from the shapes alone (never the thread count, which
        would change how dq is summed): about BACKWARD_ITEMS items or more per step — enough
        to feed that many threads — with as few dq partials to add as that allows."""
        keys = _spans(extents, self.tile_k)
        return max(1, len(keys) * heads // BACKWARD_ITEMS)

    @staticmethod
    def _head_checks(ctx: BackwardContext, qs, do, delta, blocks):
        """clean(bi, hi) -> that head's _Clean; checked only when a block has masked pairs."""
        if not any(blk.masked for blk in blocks):
            return lambda bi, hi: _Clean()
        if ctx.k_max is None:
            ctx.k_max, ctx.v_max = _max_abs(ctx.k), _max_abs(ctx.v)
        q_max, do_max, delta_max = _max_abs(qs), _max_abs(do), _max_abs(delta)
        with np.errstate(over="ignore", invalid="ignore"):
            # |dO . v| <= D max|dO| max|v|: with |delta| well below the largest float (half of
            # it: room for rounding), dS is finite. A NaN anywhere makes the bound NaN: False.
            bound = ctx.k.shape[-1] * do_max * ctx.v_max + delta_max
            ds_ok = bound < np.finfo(ctx.k.dtype).max / 2
        q_ok, do_ok, k_ok = (np.isfinite(x) for x in (q_max, do_max, ctx.k_max))
        return lambda bi, hi: _Clean(bool(q_ok[bi, hi]), bool(do_ok[bi, hi]), bool(k_ok[bi, hi]),
                                     bool(ds_ok[bi, hi]))

    def _backward_block(self, q, do, lse, delta, k, v, dk, dv, dq, block: Block, g: int,
                        scratch: _Scratch, clean: _Clean, row_p=None) -> None:
        """One head: q (scaled), do, dq (S*g, D); lse, delta (S*g,); k, v, dk, dv (S, D);
        row_p (S*g,) or None: each row's sum of P is added to it."""
        d = k.shape[1]
        for q0, q1, k0, k1, masked in _tiles(block, max(1, self.tile_q // g), self.tile_k, keys_outer=True):
            r0, r1 = q0 * g, q1 * g
            rows, keys = r1 - r0, k1 - k0
            p, ds = scratch.get("p", rows, keys), scratch.get("ds", rows, keys)
            np.matmul(q[r0:r1], k[k0:k1].T, out=p)
            p -= lse[r0:r1, None]
            future = _future(block, q0, q1, k0, k1, g) if masked else None
            if masked:  # mask before exp: a masked score may exceed lse, and inf * 0 is NaN
                np.copyto(p, -np.inf, where=future)
            np.exp(p, out=p)
            if row_p is not None:
                row_p[r0:r1] += p.sum(axis=1)
            key_grad, row_grad = scratch.get("kg", keys, d), scratch.get("rg", rows, d)
            # with P and dS exactly 0 at masked pairs, _matmul_masked keeps a non-finite dO, K
            # or Q row out of the pairs that do not see it
            future_t = None if future is None else future.T
            dv[k0:k1] += _matmul_masked(p.T, do[r0:r1], future_t, key_grad, clean.do)
            np.matmul(do[r0:r1], v[k0:k1].T, out=ds)
            ds -= delta[r0:r1, None]
            ds *= p
            if masked and not clean.ds:
                # dS is 0 at masked pairs by definition; the product above is NaN there when
                # V, dO or delta is not finite (or dO V^T overflows)
                np.copyto(ds, 0, where=future)
            dq[r0:r1] += _matmul_masked(ds, k[k0:k1], future, row_grad, clean.k)
            # q carries the softmax scale
            dk[k0:k1] += _matmul_masked(ds.T, q[r0:r1], future_t, key_grad, clean.q)

    def backward_finalize(self, ctx, out_dtype):
        return (np.ascontiguousarray(ctx.dk.transpose(0, 2, 1, 3), dtype=out_dtype),
                np.ascontiguousarray(ctx.dv.transpose(0, 2, 1, 3), dtype=out_dtype))
