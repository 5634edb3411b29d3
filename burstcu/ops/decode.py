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
never read, so whatever they hold (garbage, NaN) is inert; a NaN in q or a valid row of K (or
an Inf one: a +inf score) makes out and lse NaN where a row reads it (L is NaN then, not 0: not
an empty row); a NaN in a valid row of V makes NaN only the out columns it reaches. A row whose
scores over the valid rows are all -inf is empty as one with none (out 0, lse -inf).
A paged cache (`PagedRows`, in place of k_cache and v_cache): pages (P, page_size, Hkv, D) and a
page table (B, max_pages) int32 whose entry i names the page holding rows [i * page_size,
(i + 1) * page_size) of batch row b (vLLM's and FlashInfer's convention); row j of batch row b
is pages[table[b, j // page_size], j % page_size]. The keys are taken in chunks of
CHUNK rows with the same online-softmax update, so a long cache costs O(T H CHUNK) scratch.
Written against the array module `xp` (NumPy or CuPy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

CHUNK = 4096   # keys per chunk of the local reduction


@dataclass(frozen=True, eq=False)
class PagedRows:
    """One of K or V of a paged cache (module docstring).

    pages: (P, page_size, Hkv, D) of the op's array type; table: (B, max_pages) int32 on the
    op's device; host_table: the same on the host (NumPy), for the array path. The entries
    covering a batch row's valid rows (the first ceil(n_b / page_size)) must name pages in
    [0, P) (`check`: the array path refuses others; the kernels trust them); entries past them
    may name any page (or none, -1: they are never read)."""

    pages: Any
    table: Any
    host_table: np.ndarray

    @property
    def page_size(self) -> int:
        return int(self.pages.shape[1])

    @property
    def shape(self) -> tuple:
        """(B, max_pages * page_size, Hkv, D): the contiguous cache it stands for."""
        p = self.pages.shape
        return (self.host_table.shape[0], self.host_table.shape[1] * p[1], p[2], p[3])

    @property
    def dtype(self):
        return self.pages.dtype

    def check(self, lengths) -> None:
        """TypeError unless host_table is an int32 NumPy (B, max_pages) array; ValueError when
        an entry covering one of the first lengths[b] rows of batch row b lies outside [0, P)
        (-1 would wrap to the last page) or the rows need more entries than a row has."""
        t = self.host_table
        if not isinstance(t, np.ndarray) or t.dtype != np.int32 or t.ndim != 2:
            raise TypeError(f"a paged cache's host_table must be a (B, max_pages) int32 NumPy array, "
                            f"not {type(t).__name__} {getattr(t, 'dtype', '')}")
        need = -(-np.asarray(lengths, np.int64) // self.page_size)            # (B,) entries read
        if len(need) != t.shape[0] or (need > t.shape[1]).any():
            raise ValueError(f"lengths {np.asarray(lengths).tolist()} need more than the page table's "
                             f"{t.shape[0]} rows of {t.shape[1]} pages of {self.page_size} rows")
        read = np.arange(t.shape[1]) < need[:, None]
        bad = np.argwhere(read & ((t < 0) | (t >= self.pages.shape[0])))
        if len(bad):
            b, i = (int(x) for x in bad[0])
            raise ValueError(f"page table entry [{b}, {i}] = {int(t[b, i])} covers valid rows of batch "
                             f"row {b} but names no page of the {self.pages.shape[0]}")

    def rows(self, xp: Any, b: int, start: int, stop: int):
        """Rows [start, stop) of batch row b, (stop - start, Hkv, D) (gathered: a copy); the
        table entries they take must name pages (`check`)."""
        j = np.arange(start, stop)
        ps = self.page_size
        pages = self.host_table[b, j // ps].astype(np.int64)
        if len(pages) and (pages.min() < 0 or pages.max() >= self.pages.shape[0]):
            raise ValueError(f"rows [{start}, {stop}) of batch row {b}: the page table names pages "
                             f"{int(pages.min())}..{int(pages.max())}, outside [0, {self.pages.shape[0]})")
        flat = self.pages.reshape((-1,) + tuple(self.pages.shape[2:]))
        return flat[xp.asarray(pages * ps + j % ps)]


def _rows(xp: Any, cache, b: int, start: int, stop: int):
    """Rows [start, stop) of batch row b of a contiguous cache (B, S, Hkv, D) or PagedRows."""
    if isinstance(cache, PagedRows):
        return cache.rows(xp, b, start, stop)
    return cache[b, start:stop]


def partial(xp: Any, q, k_cache, v_cache, lengths, scale: float, acc_dtype):
    """(acc, m, l) of this rank's valid keys (module docstring); k_cache, v_cache: (B, S, Hkv, D)
    arrays or PagedRows (their tables checked first: `PagedRows.check`)."""
    for cache in (k_cache, v_cache):
        if isinstance(cache, PagedRows):
            cache.check(lengths)
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
            kc = _rows(xp, k_cache, bi, start, stop).astype(acc_dtype).transpose(1, 2, 0)   # (Hkv, D, n)
            vc = _rows(xp, v_cache, bi, start, stop).astype(acc_dtype).transpose(1, 0, 2)   # (Hkv, n, D)
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
    seen = total != 0       # 0: no valid key anywhere; a NaN or Inf a valid row brought stays
    norm = xp.where(seen, total, 1).transpose(0, 2, 1)[..., None]
    out = xp.where(seen.transpose(0, 2, 1)[..., None], out / norm, 0)
    lse = xp.where(seen, shift + xp.log(xp.where(seen, total, 1)), -np.inf)
    return out.astype(out_dtype), lse
