"""Decode against a sequence-sharded KV cache: each rank's partial attention ("flash decoding":
the keys split across ranks, each rank reducing its own) and the merge of the partials.

Shapes (B batch, T new tokens, H query heads, Hkv kv heads, D head dim, S cache rows a rank
holds, n_b <= S the valid rows of batch row b on this rank):
    q (B, T, H, D); k_cache, v_cache (B, S, Hkv, D); lengths: n_b for each b (host ints)
    partial -> acc (B, T, H, D), m (B, H, T), l (B, H, T), all in the accumulation dtype:
        m = max over this rank's valid keys of the scaled score (-inf: no valid key),
        l = sum of exp(score - m), acc = sum of exp(score - m) * v (unnormalised)
    merge of G partials (the same order on every rank, so every rank gets the same bits):
        M = max_r m_r;  w_r = exp(m_r - M) (0 where m_r = -inf);  L = sum_r w_r l_r
        out = sum_r w_r acc_r / L (0 where L = 0);  lse = M + log L (-inf where L = 0)
GQA: query head h uses kv head h // (H // Hkv); K and V are never replicated. Rows past n_b are
never read, so whatever they hold (garbage, NaN) is inert. The keys are taken in chunks of
CHUNK rows with the same online-softmax update, so a long cache costs O(T H CHUNK) scratch.
Written against the array module `xp` (NumPy or CuPy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CHUNK = 4096   # keys per chunk of the local reduction


def partial(xp: Any, q, k_cache, v_cache, lengths, scale: float, acc_dtype):
    """(acc, m, l) of this rank's valid keys (module docstring)."""
    b, t, h, d = q.shape
    hkv = k_cache.shape[2]
    g = h // hkv
    acc = xp.zeros((b, t, h, d), dtype=acc_dtype)
    m = xp.full((b, h, t), -np.inf, dtype=acc_dtype)
    l = xp.zeros((b, h, t), dtype=acc_dtype)
    for bi in range(b):
        # (Hkv, G*T, D): the query heads of a kv head side by side, so one matmul serves them
        qg = q[bi].astype(acc_dtype).reshape(t, hkv, g, d).transpose(1, 2, 0, 3).reshape(hkv, g * t, d)
        qg = qg * acc_dtype.type(scale)
        mb = xp.full((hkv, g * t), -np.inf, dtype=acc_dtype)
        lb = xp.zeros((hkv, g * t), dtype=acc_dtype)
        ab = xp.zeros((hkv, g * t, d), dtype=acc_dtype)
        for start in range(0, int(lengths[bi]), CHUNK):
            stop = min(start + CHUNK, int(lengths[bi]))
            kc = k_cache[bi, start:stop].astype(acc_dtype).transpose(1, 2, 0)   # (Hkv, D, n)
            vc = v_cache[bi, start:stop].astype(acc_dtype).transpose(1, 0, 2)   # (Hkv, n, D)
            s = qg @ kc                                                          # (Hkv, G*T, n)
            m_new = xp.maximum(mb, s.max(axis=-1))
            # rows whose max is still -inf saw no finite score: keep them at zero weight
            shift = xp.where(xp.isneginf(m_new), 0, m_new)
            p = xp.exp(s - shift[..., None])
            rescale = xp.exp(xp.where(xp.isneginf(mb), -np.inf, mb - shift))
            lb = lb * rescale + p.sum(axis=-1)
            ab = ab * rescale[..., None] + p @ vc
            mb = m_new
        # back to (T, H, D) and (H, T)
        acc[bi] = ab.reshape(hkv, g, t, d).transpose(2, 0, 1, 3).reshape(t, h, d)
        m[bi] = mb.reshape(h, t)
        l[bi] = lb.reshape(h, t)
    return acc, m, l


def merge(xp: Any, parts, out_dtype):
    """(out (B,T,H,D) in out_dtype, lse (B,H,T) in the accumulation dtype) of the partials
    [(acc, m, l) of each rank, in rank order] (module docstring)."""
    ms = xp.stack([m for _, m, _ in parts])                         # (G, B, H, T)
    top = ms.max(axis=0)
    shift = xp.where(xp.isneginf(top), 0, top)
    weights = xp.exp(ms - shift)                                     # exp(-inf) = 0
    total = xp.zeros_like(top)
    out = xp.zeros(parts[0][0].shape, dtype=parts[0][0].dtype)
    for (acc, _, l), w in zip(parts, weights):
        total = total + w * l
        out = out + acc * w.transpose(0, 2, 1)[..., None]
    seen = total > 0
    norm = xp.where(seen, total, 1).transpose(0, 2, 1)[..., None]
    out = xp.where(seen.transpose(0, 2, 1)[..., None], out / norm, 0)
    lse = xp.where(seen, shift + xp.log(xp.where(seen, total, 1)), -np.inf)
    return out.astype(out_dtype), lse
