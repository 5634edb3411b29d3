"""Independent reference attention: the whole sequence at once, full score matrix, explicit softmax.

Written plainly from the definitions; it never calls burstcu. Shapes as in the public API:
q (B, N, H, D); k, v (B, N, Hkv, D); positions are global (N = whole sequence).

`dtype=np.float64` is the reference. The same code in float32 (or float16) is the "naive
same-dtype implementation" of the FlashAttention tolerance rule: an implementation under test may
err against float64 by at most a small multiple of what the naive one errs, plus rounding noise.
"""

from __future__ import annotations

import numpy as np


def _expand_kv(x, nheads):
    """(B, N, Hkv, D) -> (B, N, H, D): query head h reads kv head h // (H // Hkv)."""
    return np.repeat(x, nheads // x.shape[2], axis=2)


def _cast(dtype, *xs):
    return [np.asarray(x).astype(dtype) for x in xs]


def _round(x, to):
    """x rounded to the storage dtype `to` and back (what a half-precision kernel stores)."""
    return x if to is None else x.astype(to).astype(x.dtype)


def _probs(q, k, causal, scale, dtype):
    """Softmax probabilities (B, H, Nq, Nk) and lse (B, H, Nq); fully masked rows give 0, -inf."""
    s = (np.einsum("bihd,bjhd->bhij", q, _expand_kv(k, q.shape[2]), optimize=True) * dtype(scale)).astype(dtype)
    if causal:
        keep = np.arange(q.shape[1])[:, None] >= np.arange(k.shape[1])[None, :]
        s = np.where(keep, s, dtype(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, dtype(0))
    p = np.exp(s - m).astype(dtype)
    l = p.sum(axis=-1, keepdims=True, dtype=dtype)
    seen = l > 0
    probs = np.where(seen, p / np.where(seen, l, 1), 0).astype(dtype)
    with np.errstate(divide="ignore"):
        lse = np.where(seen[..., 0], m[..., 0] + np.log(np.where(seen, l, 1)[..., 0]), -np.inf)
    return probs, lse.astype(dtype)


def _scale(q, softmax_scale):
    return 1 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale


def attention_ref(q, k, v, causal=False, softmax_scale=None, dtype=np.float64, round_to=None):
    """(out (B, N, H, D), lse (B, H, N)) computed entirely in `dtype`. With round_to (e.g.
    np.float16), P is rounded to that dtype before P @ V, as a naive half-precision
    implementation with float32 accumulation does."""
    q, k, v = _cast(dtype, q, k, v)
    probs, lse = _probs(q, k, causal, _scale(q, softmax_scale), dtype)
    out = np.einsum("bhij,bjhd->bihd", _round(probs, round_to), _expand_kv(v, q.shape[2]), optimize=True).astype(dtype)
    return _round(out, round_to), lse


def attention_backward_ref(dout, q, k, v, causal=False, softmax_scale=None, dtype=np.float64,
                           round_to=None):
    """(dq, dk, dv) from the explicit softmax Jacobian, computed entirely in `dtype`; with
    round_to, P and dS are rounded to that dtype before their matmuls (naive half precision)."""
    dout, q, k, v = _cast(dtype, dout, q, k, v)
    scale = dtype(_scale(q, softmax_scale))
    h, hkv = q.shape[2], k.shape[2]
    probs, _ = _probs(q, k, causal, scale, dtype)                       # (B, H, Nq, Nk)
    p_stored = _round(probs, round_to)
    ke, ve = _expand_kv(k, h), _expand_kv(v, h)
    do = dout.transpose(0, 2, 1, 3)                                       # (B, H, Nq, D)
    dv_e = np.einsum("bhij,bhid->bjhd", p_stored, do, optimize=True)
    dprobs = np.einsum("bhid,bjhd->bhij", do, ve, optimize=True).astype(dtype)
    ds = _round((probs * (dprobs - (dprobs * probs).sum(axis=-1, keepdims=True))).astype(dtype), round_to)
    dq = np.einsum("bhij,bjhd->bihd", ds, ke, optimize=True) * scale
    dk_e = np.einsum("bhij,bihd->bjhd", ds, q, optimize=True) * scale
    b, n, _, d = k.shape
    dk = dk_e.reshape(b, n, hkv, h // hkv, d).sum(axis=3)
    dv = dv_e.reshape(b, n, hkv, h // hkv, d).sum(axis=3)
    return dq.astype(dtype), dk.astype(dtype), dv.astype(dtype)


def max_err(x, ref) -> float:
    """Largest absolute difference, in float64; NaN anywhere counts as infinite error."""
    d = np.abs(np.asarray(x, dtype=np.longdouble) - np.asarray(ref, dtype=np.longdouble))
    finite = np.isfinite(ref)
    d = np.where(finite, d, np.where(np.asarray(x) == ref, 0.0, np.inf))
    return float(np.nan_to_num(d, nan=np.inf).max()) if d.size else 0.0  # longdouble diff, then float


def within_fa_rule(x, ref, naive, eps, factor=2.0) -> tuple[bool, float, float]:
    """FlashAttention's rule: err(x) <= factor * err(naive) + rounding noise (eps * max|ref|)."""
    finite = np.asarray(ref)[np.isfinite(ref)]
    noise = 8 * eps * (float(np.abs(finite).max()) if finite.size else 1.0)
    err, naive_err = max_err(x, ref), max_err(naive, ref)
    return err <= factor * naive_err + noise, err, factor * naive_err + noise
