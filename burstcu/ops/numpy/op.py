"""`NumpyOps`: the CPU local op, the reference and portability path (float16 to float64).

Each ring step folds one (rows x keys) tile at a time into the running state with online softmax
(`tiles`), so memory is O(S*D + tile) per head, never O(S^2); matmuls go to BLAS; work items
(per (batch, kv head) and tile of query rows in the forward, per range of key tiles in the
backward) run on a `threads.WorkPool`.

Deterministic: the items are cut from the blocks, the shapes and the tile sizes alone, never
from the thread count, and the backward's per-key-range dQ partials are added in key order
whichever thread finishes first, so out, lse, dq, dk and dv are bitwise the same for any
`threads`. Each row's bits depend on that row's inputs alone.

Masked positions are inert: a NaN or Inf in K or V (or Q, dO) at a position a row cannot see
never reaches that row's out, lse or dq, nor the dk/dv of that key through that row.

float16/bfloat16 inputs are computed in float32 (their accumulation dtype); float64 in float64.
Shapes as `burstcu.ops.base`. How fast and why: docs/numpy-op.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np

from ...layout import Block
from ..base import LocalOps, accum_dtype, checked_option
from .threads import InOrder, WorkPool, default_threads
from .tiles import (BACKWARD_ITEMS, BACKWARD_TILE_Q, TILE_K, TILE_Q, _clip_k, _clip_q, _Clean,
                    _fold_tile, _future, _gaps, _matmul_masked, _max_abs, _neg_lse, _parts_by_span,
                    _put, _rows_grouped, _rows_ungrouped, _Scratch, _spans, _tiles)

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


class NumpyOps(LocalOps):
    """The CPU local op. tile_q: score rows per tile (query positions x g); tile_k: keys per
    tile; threads: work items run in parallel (None or 0, the default: as many as BLAS uses);
    deterministic: accepted for `burstcu.init(deterministic=True)` on every backend, and ignored: this op is
    deterministic already, bitwise the same for any `threads` (see the module docstring), so its
    `deterministic` attribute is always True.
    Between calls it keeps its per-thread scratch for the next call; `release_buffers()`
    frees it. scratch_bytes: the most bytes
    of per-thread scratch (tiles, dq partials) held at once, all threads together — what the op
    uses beyond its O(S * H * D) arrays; tile_scratch_bytes: the part of it in tiles (score-
    shaped, fixed by tile_q and tile_k), without the backward's O(S * D) dq partials."""

    name = "numpy"
    xp = np

    masks_windows = True  # sliding windows (Block.left / Block.right) are masked per element

    def __init__(self, tile_q: int = TILE_Q, tile_k: int = TILE_K, threads: int | None = None,
                 deterministic: bool = False):
        self.tile_q, self.tile_k = (checked_option(name, value, "count")
                                    for name, value in (("tile_q", tile_q), ("tile_k", tile_k)))
        checked_option("deterministic", deterministic, "flag")
        self.deterministic = True   # whatever was asked: see the class docstring
        self.threads = checked_option("threads", threads, "count or default") or default_threads()
        self._workers = WorkPool(self.threads)
        self._scratch = {}
        self.scratch_bytes = self.tile_scratch_bytes = 0

    def agreed_options(self) -> tuple:
        return (("tile_q", self.tile_q), ("tile_k", self.tile_k))   # threads: the same bits

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
        self._workers.close()

    @staticmethod
    def _each_head(fn, b: int, hkv: int) -> None:
        """fn(bi, hi) for every head, in this thread: the layout passes are memory-bound copies,
        cheaper here than on the pool (docs/numpy-op.md)."""
        for bi, hi in product(range(b), range(hkv)):
            fn(bi, hi)

    # -- forward -----------------------------------------------------------------------------------
    def forward_init(self, q, softmax_scale):
        return ForwardState(q_in=q, scale=softmax_scale)

    def forward_step(self, st, k, v, blocks, last=False):
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
        laid_out = InOrder(len(heads))
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
        self._workers.run(work, [(head, None) for head in range(len(heads))] + folds, laid_out.fail)
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
        rows that saw no key get out 0 and lse -inf (all of them when no step ran: a block mask
        can leave a rank's queries without a key)."""
        if st.q is None and st.q_in is not None:
            b, s, h, d = st.q_in.shape
            acc_t = accum_dtype(st.q_in.dtype)
            st.q_in = None
            return np.zeros((b, s, h, d), out_dtype), np.full((b, h, s), -np.inf, acc_t)
        if st.q is None:
            raise RuntimeError("forward_finalize twice")
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
        turns, scratch = InOrder(len(heads)), self._scratch_of(acc_t)

        def work(item):
            ci, head = item
            bi, hi = heads[head]
            self._backward_item(ctx, qs, do, dq_acc, p_sums, bi, hi, ci, parts_of[ci], g,
                                scratch, clean[bi][hi], turns, head)
        self._workers.run(work, list(product(range(len(ranges)), range(len(heads)))), turns.fail)
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
        with np.errstate(over="ignore", invalid="ignore"):   # garbage in, NaN/Inf out, quietly
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
            if row_p is not None:   # before the clamp: a P past 1 is what check=True looks for
                row_p[r0:r1] += np.matmul(p, np.ones(keys, p.dtype))
            # P <= 1 (lse >= every score of its row), but at |score| ~ 1e6 and more score - lse
            # rounds here otherwise than in the forward (whose -m column folded in another
            # shift), by many units: P reached 1e60 and inf, dv and dk with it
            np.minimum(p, 1, out=p)
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
