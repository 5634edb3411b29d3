"""Local attention in NumPy: the CPU backend's LAO, tiled like FlashAttention.

Each ring step folds one (rows x keys) tile at a time into the running state with online softmax,
so memory is O(S*D + tile) per head, never O(S^2). Matmuls go to BLAS.

Layout, chosen so GQA costs no copy of K/V: queries are grouped under their KV head, as
`(B, Hkv, S*g, D)` with g = H // Hkv (row i*g + j is position i, query head j of the group).
One matmul against a KV head's keys then scores every query head of its group.

Speed on a CPU, where NumPy's elementwise passes run on one core and BLAS on all of them:
* work is split into independent items — (batch, kv head, query rows) in the forward,
  (batch, kv head, key rows) in the backward — run by a thread pool (NumPy and BLAS release the
  GIL) with BLAS held to one thread meanwhile, so exp/max passes use every core too;
* tiles of 512 score rows x 512 keys (1 MiB of float32 scores): the best of a sweep at seqlen
  4096, 8 heads, headdim 64 (256x512: 0.34 s, 512x512: 0.30 s, 1024x1024: 0.32 s, 2 cores);
* V carries an extra column of ones, so one matmul P @ [V | 1] updates both the output
  accumulator and the row sum l (its last column) — one fewer pass over P.
The thread count defaults to the BLAS library's (1 under OMP_NUM_THREADS=1, as with MPI ranks).

float16/bfloat16 inputs are computed in float32 (their accumulation dtype); float64 in float64.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import product

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

def _split(start: int, length: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous near-equal [lo, hi) ranges covering [start, start + length)."""
    edges = np.linspace(start, start + length, parts + 1).round().astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


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
        yield from _causal_split(block, q0, q1, k0, k1)


def _causal_split(block: Block, q0: int, q1: int, k0: int, k1: int):
    if not block.causal:
        yield q0, q1, k0, k1, False
        return
    first_q = block.q_pos + q0 - block.q_start
    last_q = block.q_pos + q1 - 1 - block.q_start
    first_k = block.k_pos + k0 - block.k_start
    last_k = block.k_pos + k1 - 1 - block.k_start
    if last_q < first_k:
        return  # wholly in the future
    if first_q >= last_k:
        yield q0, q1, k0, k1, False
        return
    if k1 - k0 <= MIN_DIAGONAL_TILE or q1 - q0 < 2:
        yield q0, q1, k0, k1, True
        return
    qm, km = (q0 + q1) // 2, (k0 + k1) // 2
    for a, b in ((q0, qm), (qm, q1)):
        for c, d in ((k0, km), (km, k1)):
            yield from _causal_split(block, a, b, c, d)


class _Scratch:
    """Reusable per-work-item buffers. A fresh tile-sized array per tile costs more than the
    arithmetic on it: above malloc's mmap threshold every allocation page-faults anew."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.flat: dict[str, np.ndarray] = {}

    def get(self, name: str, rows: int, cols: int) -> np.ndarray:
        buf = self.flat.get(name)
        if buf is None or buf.size < rows * cols:
            buf = self.flat[name] = np.empty(rows * cols, self.dtype)
        return buf[:rows * cols].reshape(rows, cols)


def _future(block: Block, q0: int, q1: int, k0: int, k1: int, g: int) -> np.ndarray:
    """Boolean (rows*g, keys): True where the key lies in the query's future (masked)."""
    qp = block.q_pos - block.q_start + np.arange(q0, q1)
    kp = block.k_pos - block.k_start + np.arange(k0, k1)
    return np.repeat(qp[:, None] < kp[None, :], g, axis=0)


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

    def __init__(self, tile_q: int = TILE_Q, tile_k: int = TILE_K, threads: int | None = None):
        if tile_q < 1 or tile_k < 1:
            raise ValueError(f"tile sizes must be positive, got tile_q={tile_q}, tile_k={tile_k}")
        self.tile_q, self.tile_k = tile_q, tile_k
        self.threads = threads or _default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="burstcu-lao") if self.threads > 1 else None
        self._blas = None

    def _run(self, work, items) -> None:
        """work(item) for every item, on the pool or serially, with BLAS held to one thread:
        the parallelism is across items; a multi-threaded BLAS on tile-sized matmuls spends
        more time synchronising its threads than multiplying (10x slower, measured)."""
        if self._blas is None:
            from threadpoolctl import ThreadpoolController
            self._blas = ThreadpoolController()
        with self._blas.limit(limits=1, user_api="blas"):
            if self._pool is None or len(items) == 1:
                for item in items:
                    work(item)
            else:
                for _ in self._pool.map(work, items):  # re-raises a worker's exception here
                    pass

    def _chunks(self, units: int) -> int:
        """How many pieces to cut each of `units` independent units into to feed every thread."""
        return max(1, -(-self.threads // units))

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
        b, g, seqlen = st.q.shape[0], st.g, k.shape[1]
        ranges = _split(0, seqlen, self._chunks(b * hkv))
        items = list(product(range(b), range(hkv), ranges))

        def work(item):
            bi, hi, (lo, hi_row) = item
            scratch = _Scratch(acc_t)
            for block in blocks:
                part = _clip_q(block, lo, hi_row)
                if part is not None:
                    self._forward_block(st.q[bi, hi], kh[bi, hi], vh[bi, hi], st.acc[bi, hi],
                                        st.m[bi, hi], part, g, scratch)
        self._run(work, items)

    def _forward_block(self, q, k, v_ext, acc, m, block: Block, g: int, scratch: _Scratch) -> None:
        """One head: q (S*g, D), k (S, D), v_ext (S, D+1), acc (S*g, D+1), m (S*g,)."""
        for q0, q1, k0, k1, masked in _tiles(block, max(1, self.tile_q // g), self.tile_k):
            r0, r1 = q0 * g, q1 * g
            s = scratch.get("s", r1 - r0, k1 - k0)
            np.matmul(q[r0:r1], k[k0:k1].T, out=s)
            if masked:
                s[_future(block, q0, q1, k0, k1, g)] = -np.inf
            m_old = m[r0:r1]
            m_new = np.maximum(m_old, s.max(axis=1))
            # a row that has seen no key yet has m_new = -inf: shift by 0 so exp gives 0, not NaN
            shift = np.where(m_new == -np.inf, 0, m_new)
            s -= shift[:, None]
            np.exp(s, out=s)
            alpha = np.exp(m_old - shift)
            pv = scratch.get("pv", r1 - r0, v_ext.shape[1])
            np.matmul(s, v_ext[k0:k1], out=pv)
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

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks):
        acc_t = ctx.k.dtype
        b, hkv, seqlen, d = ctx.k.shape
        # scores exactly as the forward computed them, (scale * q) @ k^T, so that P recomputed
        # from lse matches the forward's rounding (matters when logits are ~1e3)
        qs = _grouped(q, hkv, acc_t, ctx.scale)
        do = _grouped(dout, hkv, acc_t)
        g = qs.shape[2] // q.shape[1]
        # rows with lse = -inf saw no key in the forward: P = exp(score - inf) = 0 there
        lse_rows = _rows_grouped(lse, hkv, acc_t)
        lse_rows[lse_rows == -np.inf] = np.inf
        delta_rows = _rows_grouped(delta, hkv, acc_t)
        ranges = _split(0, seqlen, self._chunks(b * hkv))
        items = list(product(range(b), range(hkv), range(len(ranges))))
        # each item owns the dk, dv rows of its key range; dq partials are private per item
        dq_parts = np.zeros((len(ranges),) + qs.shape, acc_t)

        def work(item):
            bi, hi, ci = item
            lo, hi_key = ranges[ci]
            scratch = _Scratch(acc_t)
            for block in blocks:
                part = _clip_k(block, lo, hi_key)
                if part is not None:
                    self._backward_block(qs[bi, hi], do[bi, hi], lse_rows[bi, hi], delta_rows[bi, hi],
                                         ctx.k[bi, hi], ctx.v[bi, hi], ctx.dk[bi, hi], ctx.dv[bi, hi],
                                         dq_parts[ci, bi, hi], part, g, scratch)
        self._run(work, items)
        dq_acc = dq_parts.sum(axis=0) if len(ranges) > 1 else dq_parts[0]
        dq_acc *= acc_t.type(ctx.scale)
        dq += _ungrouped(dq_acc, q.shape[1])

    def _backward_block(self, q, do, lse, delta, k, v, dk, dv, dq, block: Block, g: int,
                        scratch: _Scratch) -> None:
        """One head: q (scaled), do, dq (S*g, D); lse, delta (S*g,); k, v, dk, dv (S, D)."""
        d = k.shape[1]
        for q0, q1, k0, k1, masked in _tiles(block, max(1, self.tile_q // g), self.tile_k, keys_outer=True):
            r0, r1 = q0 * g, q1 * g
            rows, keys = r1 - r0, k1 - k0
            p, ds = scratch.get("p", rows, keys), scratch.get("ds", rows, keys)
            np.matmul(q[r0:r1], k[k0:k1].T, out=p)
            p -= lse[r0:r1, None]
            if masked:  # mask before exp: a masked score may exceed lse, and inf * 0 is NaN
                p[_future(block, q0, q1, k0, k1, g)] = -np.inf
            np.exp(p, out=p)
            key_grad, row_grad = scratch.get("kg", keys, d), scratch.get("rg", rows, d)
            dv[k0:k1] += np.matmul(p.T, do[r0:r1], out=key_grad)
            np.matmul(do[r0:r1], v[k0:k1].T, out=ds)
            ds -= delta[r0:r1, None]
            ds *= p
            dq[r0:r1] += np.matmul(ds, k[k0:k1], out=row_grad)
            dk[k0:k1] += np.matmul(ds.T, q[r0:r1], out=key_grad)  # q carries the softmax scale

    def backward_finalize(self, ctx, out_dtype):
        return (np.ascontiguousarray(ctx.dk.transpose(0, 2, 1, 3), dtype=out_dtype),
                np.ascontiguousarray(ctx.dv.transpose(0, 2, 1, 3), dtype=out_dtype))
