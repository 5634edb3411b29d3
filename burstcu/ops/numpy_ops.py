"""Local attention in NumPy: the CPU backend's LAO, tiled like FlashAttention.

Each ring step folds a (tile_q x tile_k) tile at a time into the running state with online
softmax, so memory is O(S*D + tile_q*tile_k) per head, never O(S^2). Matmuls go to BLAS.

Internal layout, chosen so GQA costs no copies of K/V: queries are grouped under their KV head,
`(B, Hkv, S, g, D)` with g = H // Hkv. A tile of rows [a, b) is then the contiguous
`(B, Hkv, (b-a)*g, D)` block, and one batched matmul against K `(B, Hkv, D, tk)` scores every
query head of the group at once. Row statistics use the same `(B, Hkv, S*g)` order.

float16/bfloat16 inputs are computed in float32 (their accumulation dtype); float64 in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layout import Block
from .base import LocalOps, accum_dtype

# 256 x 512 fp32 scores per (batch, kv head, group member) = 512 KiB: large enough that BLAS runs
# near peak, small enough to stay in L2/L3 next to the exp pass.
TILE_Q = 256
TILE_K = 512


def _grouped(x, hkv: int, dtype) -> np.ndarray:
    """(B, S, H, D) -> contiguous (B, Hkv, S, g, D) in `dtype`."""
    b, s, h, d = x.shape
    return np.ascontiguousarray(x.reshape(b, s, hkv, h // hkv, d).transpose(0, 2, 1, 3, 4), dtype=dtype)


def _ungrouped(x) -> np.ndarray:
    """(B, Hkv, S, g, D) -> (B, S, H, D) (a view when possible)."""
    b, hkv, s, g, d = x.shape
    return x.transpose(0, 2, 1, 3, 4).reshape(b, s, hkv * g, d)


def _rows_grouped(x, hkv: int, dtype) -> np.ndarray:
    """(B, H, S) -> contiguous (B, Hkv, S*g)."""
    b, h, s = x.shape
    return np.ascontiguousarray(x.reshape(b, hkv, h // hkv, s).transpose(0, 1, 3, 2), dtype=dtype).reshape(b, hkv, s * (h // hkv))


def _rows_ungrouped(x, g: int) -> np.ndarray:
    """(B, Hkv, S*g) -> (B, H, S)."""
    b, hkv, sg = x.shape
    return x.reshape(b, hkv, sg // g, g).transpose(0, 1, 3, 2).reshape(b, hkv * g, sg // g)


def _heads_major(x, dtype) -> np.ndarray:
    """(B, S, Hkv, D) -> contiguous (B, Hkv, S, D)."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3), dtype=dtype)


def _tiles(block: Block, tile_q: int, tile_k: int):
    """(q0, q1, k0, k1, masked) local row ranges of the tiles of `block` that are not skipped."""
    for q0 in range(block.q_start, block.q_start + block.q_len, tile_q):
        q1 = min(q0 + tile_q, block.q_start + block.q_len)
        for k0 in range(block.k_start, block.k_start + block.k_len, tile_k):
            k1 = min(k0 + tile_k, block.k_start + block.k_len)
            masked = False
            if block.causal:
                first_q = block.q_pos + (q0 - block.q_start)
                last_q = block.q_pos + (q1 - 1 - block.q_start)
                first_k = block.k_pos + (k0 - block.k_start)
                last_k = block.k_pos + (k1 - 1 - block.k_start)
                if last_q < first_k:
                    continue  # the whole tile is in the future
                masked = first_q < last_k
            yield q0, q1, k0, k1, masked


def _causal_keep(block: Block, q0: int, q1: int, k0: int, k1: int, g: int) -> np.ndarray:
    """Boolean (rows*g, keys): True where query position >= key position."""
    qp = block.q_pos + np.arange(q0 - block.q_start, q1 - block.q_start)
    kp = block.k_pos + np.arange(k0 - block.k_start, k1 - block.k_start)
    return np.repeat(qp[:, None] >= kp[None, :], g, axis=0)


@dataclass
class ForwardState:
    q: np.ndarray      # (B, Hkv, S, g, D), pre-multiplied by softmax_scale
    acc: np.ndarray    # (B, Hkv, S, g, D) un-normalised output
    m: np.ndarray      # (B, Hkv, S*g) running row max of the scaled scores
    l: np.ndarray      # (B, Hkv, S*g) running row sum of exp(score - m)
    hkv: int


@dataclass
class BackwardContext:
    k: np.ndarray      # (B, Hkv, S, D)
    v: np.ndarray
    dk: np.ndarray     # (B, Hkv, S, D) accumulators
    dv: np.ndarray
    scale: float


class NumpyOps(LocalOps):
    name = "numpy"
    xp = np

    def __init__(self, tile_q: int = TILE_Q, tile_k: int = TILE_K):
        self.tile_q, self.tile_k = tile_q, tile_k

    # -- forward -----------------------------------------------------------------------------------
    def forward_init(self, q, softmax_scale):
        acc_t = accum_dtype(q.dtype)
        b, s, h, d = q.shape
        return {"q_dtype": acc_t, "scale": softmax_scale, "shape": q.shape, "q": q, "state": None}

    def _state(self, holder, hkv: int) -> ForwardState:
        """The state is built on the first step, when Hkv (from k) is known."""
        if holder["state"] is None:
            acc_t = holder["q_dtype"]
            # a new array: _grouped may return a view of the caller's q when no copy is needed
            q = _grouped(holder["q"], hkv, acc_t) * acc_t.type(holder["scale"])
            b, _, s, g, d = q.shape
            holder["state"] = ForwardState(
                q=q, acc=np.zeros_like(q), m=np.full((b, hkv, s * g), -np.inf, acc_t),
                l=np.zeros((b, hkv, s * g), acc_t), hkv=hkv)
        return holder["state"]

    def forward_step(self, holder, k, v, blocks):
        hkv = k.shape[2]
        st = self._state(holder, hkv)
        acc_t = st.q.dtype
        kh, vh = _heads_major(k, acc_t), _heads_major(v, acc_t)
        b, _, s, g, d = st.q.shape
        q_rows = st.q.reshape(b, hkv, s * g, d)
        acc_rows = st.acc.reshape(b, hkv, s * g, d)
        for block in blocks:
            for q0, q1, k0, k1, masked in _tiles(block, self.tile_q, self.tile_k):
                r0, r1 = q0 * g, q1 * g
                scores = q_rows[:, :, r0:r1] @ kh[:, :, k0:k1].swapaxes(-1, -2)
                if masked:
                    keep = _causal_keep(block, q0, q1, k0, k1, g)
                    scores = np.where(keep, scores, -np.inf)
                self._fold(scores, vh[:, :, k0:k1], st.m[:, :, r0:r1], st.l[:, :, r0:r1],
                           acc_rows[:, :, r0:r1])

    @staticmethod
    def _fold(scores, v_tile, m, l, acc):
        """Online softmax: merge one tile of scores (B,Hkv,R,T) into m, l (B,Hkv,R), acc (B,Hkv,R,D)."""
        m_new = np.maximum(m, scores.max(axis=-1))
        # a row with no key kept so far has m_new = -inf; shift by 0 instead so exp gives 0, not NaN
        shift = np.where(m_new == -np.inf, 0, m_new)
        scores -= shift[..., None]
        np.exp(scores, out=scores)
        alpha = np.exp(m - shift)
        l *= alpha
        l += scores.sum(axis=-1)
        acc *= alpha[..., None]
        acc += scores @ v_tile
        m[...] = m_new

    def forward_finalize(self, holder, out_dtype):
        st = holder["state"]
        if st is None:  # no step ran (impossible through the ring, kept for direct callers)
            raise RuntimeError("forward_finalize before any forward_step")
        b, hkv, s, g, d = st.acc.shape
        seen = st.l > 0
        l_safe = np.where(seen, st.l, 1)
        out = st.acc / l_safe.reshape(b, hkv, s, g, 1)
        lse = np.where(seen, st.m + np.log(l_safe), -np.inf)
        return (np.ascontiguousarray(_ungrouped(out), dtype=out_dtype),
                np.ascontiguousarray(_rows_ungrouped(lse, g)))

    # -- backward ----------------------------------------------------------------------------------
    def backward_delta(self, dout, out):
        acc_t = accum_dtype(dout.dtype)
        prod = dout.astype(acc_t) * out.astype(acc_t)
        return np.ascontiguousarray(prod.sum(axis=-1).transpose(0, 2, 1))

    def backward_init(self, k, v, softmax_scale):
        acc_t = accum_dtype(k.dtype)
        kh, vh = _heads_major(k, acc_t), _heads_major(v, acc_t)
        return BackwardContext(kh, vh, np.zeros_like(kh), np.zeros_like(vh), softmax_scale)

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks):
        acc_t = ctx.k.dtype
        hkv = ctx.k.shape[1]
        scale = acc_t.type(ctx.scale)
        # scores exactly as the forward computed them, (scale * q) @ k^T, so that P recomputed
        # from lse matches the forward's rounding (matters when logits are ~1e3)
        qg = _grouped(q, hkv, acc_t) * scale
        dog = _grouped(dout, hkv, acc_t)
        b, _, s, g, d = qg.shape
        # rows with lse = -inf saw no key in the forward: P = exp(score - inf) = 0 there
        lse_rows = _rows_grouped(lse, hkv, acc_t)
        lse_rows = np.where(lse_rows == -np.inf, np.inf, lse_rows)
        delta_rows = _rows_grouped(delta, hkv, acc_t)
        q_rows, do_rows = qg.reshape(b, hkv, s * g, d), dog.reshape(b, hkv, s * g, d)
        dq_acc = np.zeros_like(q_rows)
        for block in blocks:
            for q0, q1, k0, k1, masked in _tiles(block, self.tile_q, self.tile_k):
                r0, r1 = q0 * g, q1 * g
                k_t, v_t = ctx.k[:, :, k0:k1], ctx.v[:, :, k0:k1]
                q_t, do_t = q_rows[:, :, r0:r1], do_rows[:, :, r0:r1]
                p = q_t @ k_t.swapaxes(-1, -2)
                p -= lse_rows[:, :, r0:r1, None]
                if masked:  # mask before exp: a masked score may exceed lse, and inf * 0 is NaN
                    p = np.where(_causal_keep(block, q0, q1, k0, k1, g), p, -np.inf)
                np.exp(p, out=p)
                ctx.dv[:, :, k0:k1] += p.swapaxes(-1, -2) @ do_t
                ds = do_t @ v_t.swapaxes(-1, -2)
                ds -= delta_rows[:, :, r0:r1, None]
                ds *= p
                dq_acc[:, :, r0:r1] += ds @ k_t
                ctx.dk[:, :, k0:k1] += ds.swapaxes(-1, -2) @ q_t  # q_t carries the scale
        dq_acc *= scale
        dq += _ungrouped(dq_acc.reshape(b, hkv, s, g, d))

    def backward_finalize(self, ctx, out_dtype):
        return (np.ascontiguousarray(ctx.dk.transpose(0, 2, 1, 3), dtype=out_dtype),
                np.ascontiguousarray(ctx.dv.transpose(0, 2, 1, 3), dtype=out_dtype))
