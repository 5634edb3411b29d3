"""Independent reference attention: the whole sequence at once, full score matrix, explicit softmax.

Written plainly from the definitions; it never calls burstcu's attention (it reads the fields of
`burstcu.layout.Block` records handed to `keep_from_blocks`, and turns dtype names such as
"bfloat16" into dtypes with `burstcu.ops.base.as_dtype`). Shapes as in the public API:
q (B, N, H, D); k, v (B, N, Hkv, D); positions are global (N = whole sequence). With an explicit
`keep` mask (Sq, Sk) the query and key lengths may differ (one ring step's local rows).

`dtype=np.float64` is the reference. The same code in float32 (or float16) is the "naive
same-dtype implementation" of the FlashAttention tolerance rule: an implementation under test may
err against float64 by at most a small multiple of what the naive one errs, plus rounding noise.
"""

from __future__ import annotations

import numpy as np

from ..ops.base import as_dtype


def _expand_kv(x, nheads):
    """(B, N, Hkv, D) -> (B, N, H, D): query head h reads kv head h // (H // Hkv)."""
    return np.repeat(x, nheads // x.shape[2], axis=2)


def _cast(dtype, *xs):
    return [np.asarray(x).astype(as_dtype(dtype)) for x in xs]


def _round(x, to):
    """x rounded to the storage dtype `to` and back (what a half-precision kernel stores)."""
    return x if to is None else x.astype(as_dtype(to)).astype(x.dtype)


def keep_from_blocks(blocks, sq: int, sk: int) -> np.ndarray:
    """(Sq, Sk) bool: which (local query row, local key row) pairs one of `blocks` keeps.

    Each `burstcu.layout.Block` covers rows [q_start, q_start + q_len) x [k_start, k_start + k_len);
    with `causal` set it keeps element (i, j) of that rectangle only if q_pos + i >= k_pos + j,
    with `left` / `right` >= 0 only if k_pos + j >= q_pos + i - left / <= q_pos + i + right.
    """
    keep = np.zeros((sq, sk), dtype=bool)
    for b in blocks:
        qpos = b.q_pos + np.arange(b.q_len)[:, None]
        kpos = b.k_pos + np.arange(b.k_len)[None, :]
        rect = np.ones((b.q_len, b.k_len), bool)
        if b.causal:
            rect &= qpos >= kpos
        if getattr(b, "left", -1) >= 0:
            rect &= kpos >= qpos - b.left
        if getattr(b, "right", -1) >= 0:
            rect &= kpos <= qpos + b.right
        keep[b.q_start:b.q_start + b.q_len, b.k_start:b.k_start + b.k_len] |= rect
    return keep


def document_mask(n: int, causal: bool, docs=None) -> np.ndarray:
    """(n, n) bool over global positions, spelled out: key j visible to query i iff (not causal
    or j <= i) and, with document boundaries docs = (0, b_1, ..., n), i and j lie in the same
    document."""
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    keep = (j <= i) if causal else np.ones((n, n), bool)
    if docs is not None:
        doc = np.searchsorted(np.asarray(docs[1:]), np.arange(n), side="right")
        keep &= doc[:, None] == doc[None, :]
    return keep


def _mask(nq, nk, causal, keep):
    """The (Nq, Nk) bool mask to apply, or None: `keep` if given (it replaces causal), else the
    global causal mask q >= k if `causal`."""
    if keep is not None:
        if causal:
            raise ValueError("give either causal=True or an explicit keep mask, not both")
        keep = np.asarray(keep, dtype=bool)
        if keep.shape != (nq, nk):
            raise ValueError(f"keep must be (Sq, Sk) = {(nq, nk)}, got {keep.shape}")
        return keep
    if causal:
        return np.arange(nq)[:, None] >= np.arange(nk)[None, :]
    return None


def _scores(q, k, scale, dtype):
    """Scaled scores (B, H, Nq, Nk) in `dtype`."""
    return (np.einsum("bihd,bjhd->bhij", q, _expand_kv(k, q.shape[2]), optimize=True) * dtype(scale)).astype(dtype)


def _softmax(q, k, causal, scale, dtype, keep=None):
    """(p, l, lse): p = exp(s - rowmax) (B, H, Nq, Nk), 0 where masked; its row sums l
    (B, H, Nq, 1); lse (B, H, Nq). Fully masked rows give p 0, l 0, lse -inf."""
    s = _scores(q, k, scale, dtype)
    mask = _mask(q.shape[1], k.shape[1], causal, keep)
    if mask is not None:
        s = np.where(mask, s, dtype(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, dtype(0))
    p = np.exp(s - m).astype(dtype)
    l = p.sum(axis=-1, keepdims=True, dtype=dtype)
    seen = l != 0  # a NaN row is "seen": its lse is NaN, not -inf
    with np.errstate(divide="ignore"):
        lse = np.where(seen[..., 0], m[..., 0] + np.log(np.where(seen, l, 1)[..., 0]), -np.inf)
    return p, l, lse.astype(dtype)


def _probs(q, k, causal, scale, dtype, keep=None):
    """Softmax probabilities (B, H, Nq, Nk) and lse (B, H, Nq); fully masked rows give 0, -inf."""
    p, l, lse = _softmax(q, k, causal, scale, dtype, keep)
    seen = l != 0
    return np.where(seen, p / np.where(seen, l, 1), 0).astype(dtype), lse


def _scale(q, softmax_scale):
    return 1 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale


def attention_ref(q, k, v, causal=False, softmax_scale=None, dtype=np.float64, round_to=None,
                  keep=None, unnormalized_p=False):
    """(out (B, N, H, D), lse (B, H, N)) computed entirely in `dtype`. With round_to (e.g.
    np.float16), P is rounded to that dtype before P @ V, as a naive half-precision
    implementation with float32 accumulation does, and so is out.

    keep: an explicit (Sq, Sk) bool mask in place of `causal` (Sq may differ from Sk); a row
    with no kept key gives out 0 and lse -inf.
    unnormalized_p: the P rounded before P @ V is exp(s - rowmax), not yet divided by the row
    sum (what a flash kernel stores); P @ V is divided by the row sum afterwards."""
    q, k, v = _cast(dtype, q, k, v)
    ve = _expand_kv(v, q.shape[2])
    if unnormalized_p:
        p, l, lse = _softmax(q, k, causal, _scale(q, softmax_scale), dtype, keep)
        o = np.einsum("bhij,bjhd->bihd", _round(p, round_to), ve, optimize=True).astype(dtype)
        l = l[..., 0].transpose(0, 2, 1)[..., None]                         # (B, Nq, H, 1)
        out = np.where(l > 0, o / np.where(l > 0, l, 1), 0).astype(dtype)
    else:
        probs, lse = _probs(q, k, causal, _scale(q, softmax_scale), dtype, keep)
        out = np.einsum("bhij,bjhd->bihd", _round(probs, round_to), ve, optimize=True).astype(dtype)
    return _round(out, round_to), lse


def _grads(dv_e, ds, q, k, ke, scale, dtype):
    """(dq, dk, dv) in `dtype` from dV per query head dv_e (B, Nk, H, D) and dS (B, H, Nq, Nk):
    dq = dS K * scale, dk = dS^T Q * scale; dk, dv summed over the query heads of each kv head."""
    h, hkv = q.shape[2], k.shape[2]
    dq = np.einsum("bhij,bjhd->bihd", ds, ke, optimize=True) * scale
    dk_e = np.einsum("bhij,bihd->bjhd", ds, q, optimize=True) * scale
    b, n, _, d = k.shape
    dk = dk_e.reshape(b, n, hkv, h // hkv, d).sum(axis=3)
    dv = dv_e.reshape(b, n, hkv, h // hkv, d).sum(axis=3)
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)


def attention_backward_ref(dout, q, k, v, causal=False, softmax_scale=None, dtype=np.float64,
                           round_to=None, keep=None, out_dtype=None):
    """(dq, dk, dv) from the explicit softmax Jacobian, computed entirely in `dtype`; with
    round_to, P and dS are rounded to that dtype before their matmuls (naive half precision).
    out_dtype: the gradients are rounded to it at the end, as an implementation that returns
    them in the inputs' half precision does (compare like with like: the public API returns
    q's dtype; a step kernel's float32 accumulators are not rounded).
    keep: as in `attention_ref`; rows with no kept key contribute nothing."""
    dout, q, k, v = _cast(dtype, dout, q, k, v)
    scale = dtype(_scale(q, softmax_scale))
    h = q.shape[2]
    probs, _ = _probs(q, k, causal, scale, dtype, keep)                 # (B, H, Nq, Nk)
    p_stored = _round(probs, round_to)
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    do = dout.transpose(0, 2, 1, 3)                                       # (B, H, Nq, D)
    dv_e = np.einsum("bhij,bhid->bjhd", p_stored, do, optimize=True)
    dprobs = np.einsum("bhid,bjhd->bhij", do, ve, optimize=True).astype(dtype)
    ds = _round((probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))).astype(dtype), round_to)
    return tuple(_round(g, out_dtype) for g in _grads(dv_e, ds, q, k, ke, scale, dtype))


def softmax_stats_ref(q, k, v, dout, keep, softmax_scale=None):
    """float64 (lse, delta), each (B, H, Sq), of attention restricted to `keep` (Sq, Sk): what
    the forward pass hands the backward pass. delta = rowsum(dout * out); lse is -inf on rows
    with no kept key."""
    out, lse = attention_ref(q, k, v, softmax_scale=softmax_scale, keep=keep)
    delta = np.einsum("bihd,bihd->bhi", np.asarray(dout, np.float64), out, optimize=True)
    return lse, delta


def step_backward_ref(q, k, v, dout, lse, delta, keep, softmax_scale=None, dtype=np.float64,
                      round_to=None):
    """(dq, dk, dv) of ONE backward step: attention restricted to `keep` (Sq, Sk), with P
    recomputed from the GIVEN lse and delta (B, H, Sq) (those of the whole sequence, not of this
    block's own softmax), computed in `dtype`. A row whose lse is -inf has P = 0.

    dtype=np.float64 is the reference; dtype=np.float32 with round_to (np.float16, bfloat16) is
    the naive same-dtype implementation: P and dS rounded to that dtype before their matmuls."""
    dout, q, k, v, lse, delta = _cast(dtype, dout, q, k, v, lse, delta)
    scale = dtype(_scale(q, softmax_scale))
    h = q.shape[2]
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    s = _scores(q, k, scale, dtype)
    seen = np.isfinite(lse)[..., None]
    keep = seen if keep is None else _mask(q.shape[1], k.shape[1], False, keep) & seen
    with np.errstate(over="ignore", invalid="ignore"):
        p = _round(np.where(keep, np.exp(s - lse[..., None]), 0).astype(dtype), round_to)
    dv_e = np.einsum("bhij,bihd->bjhd", p, dout, optimize=True)
    dp = np.einsum("bihd,bjhd->bhij", dout, ve, optimize=True)
    ds = _round((p * (dp - delta[..., None])).astype(dtype), round_to)
    return _grads(dv_e, ds, q, k, ke, scale, dtype)


def max_err(x, ref) -> float:
    """Largest absolute difference, in float64; NaN anywhere counts as infinite error."""
    d = np.abs(np.asarray(x, dtype=np.longdouble) - np.asarray(ref, dtype=np.longdouble))
    finite = np.isfinite(ref)
    d = np.where(finite, d, np.where(np.asarray(x) == ref, 0.0, np.inf))
    return float(np.nan_to_num(d, nan=np.inf).max()) if d.size else 0.0  # longdouble diff, then float


def largest_finite(ref) -> float | None:
    """max |ref| over its finite entries, None when it has none."""
    finite = np.abs(np.asarray(ref)[np.isfinite(ref)])
    return float(finite.max()) if finite.size else None


def within_fa_rule(x, ref, naive, eps, factor=2.0, scale=None) -> tuple[bool, float, float]:
    """FlashAttention's rule: err(x) <= factor * err(naive) + rounding noise (8 eps * scale).
    scale: the quantity's magnitude, max|ref| by default; a piece of a larger result (one
    rank's rows) passes the whole result's, since a row whose exact value is ~0 (a causal
    first row's dq) is still rounded at the scale of the terms that cancel in it."""
    if scale is None:
        scale = largest_finite(ref)
        scale = 1.0 if scale is None else scale
    noise = 8 * eps * scale
    err, naive_err = max_err(x, ref), max_err(naive, ref)
    return err <= factor * naive_err + noise, err, factor * naive_err + noise


def linear_attention_ref(q, k, v, causal=False, dtype=np.float64, dout=None):
    """Basic linear attention (no normalisation, phi = identity) in the quadratic form, entirely
    in `dtype`: out_i = sum_j [j <= i if causal] (q_i . k_j) v_j, per head, kv head h // (H/Hkv).
    With dout, also its gradients (dq, dk, dv) from A = mask * Q K^T: dA = mask * dO V^T,
    dq = dA K, dk = dA^T Q, dv = A^T dO (summed over a kv head's query heads).
    Written without states or chunks: an independent check of burstcu.ops.linear."""
    q, k, v = _cast(dtype, q, k, v)
    h, n = q.shape[2], q.shape[1]
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    mask = np.tril(np.ones((n, n), dtype)) if causal else np.ones((n, n), dtype)
    a = np.einsum("bihd,bjhd->bhij", q, ke, optimize=True) * mask
    out = np.einsum("bhij,bjhd->bihd", a, ve, optimize=True)
    if dout is None:
        return out
    (do,) = _cast(dtype, dout)
    da = np.einsum("bihd,bjhd->bhij", do, ve, optimize=True) * mask
    dq = np.einsum("bhij,bjhd->bihd", da, ke, optimize=True)
    dk_e = np.einsum("bhij,bihd->bjhd", da, q, optimize=True)
    dv_e = np.einsum("bhij,bihd->bjhd", a, do, optimize=True)
    b, _, hkv, d = k.shape
    return out, (dq, dk_e.reshape(b, n, hkv, h // hkv, d).sum(axis=3),
                 dv_e.reshape(b, n, hkv, h // hkv, d).sum(axis=3))
