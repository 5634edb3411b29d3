"""Local compute of (basic, unnormalised) linear attention, chunkwise, on any array module.

Linear attention as LASP-2 defines it (phi = identity, no normalisation), per head, with query
head h using kv head h // (H / Hkv) as in softmax attention:

    non-causal   O = Q (K^T V)
    causal       O_i = sum_{j <= i} (q_i . k_j) v_j

Chunkwise (the form every routine here uses): a run of C rows is cut into tiles of T rows; the
state M = sum K^T V (D x D per kv head) of the tiles before a tile carries its whole past, so

    O_tile = tril(Q_t K_t^T) V_t + Q_t (P + M_<t)

with P the state of everything before the run (another rank's chunks). Cost O(C T D + C D^2), all
of it batched matmuls plus one triangular mask a tile (no kernel of its own). The backward runs
the same sweep forwards for dQ and backwards for dK, dV with the gradient state
dM = sum Q^T dO (summed over the query heads of a kv head):

    dQ_t = tril(dO_t V_t^T) K_t + dO_t (P + M_<t)^T
    dK_t = sum_heads tril(dO_t V_t^T)^T Q_t + V_t (S + dM_>t)^T
    dV_t = sum_heads tril(Q_t K_t^T)^T dO_t + K_t (S + dM_>t)

with S the gradient state of everything after the run. The tiles of a span of TILES_AT_ONCE
tiles go through each product together (their states M_<t by a cumulative sum), so a run costs
C / (T * TILES_AT_ONCE) rounds of batched matmuls, not one a tile. Shapes: q, dout (B, C, H, D); k, v
(B, C, Hkv, D) (rows of one run); states (B, Hkv, D, D); results in the accumulation dtype `acc`
(float32; float64 for float64 input), rows-first like the inputs. The strategies
(burstcu/engine/lasp2.py, lasp1.py) say where P and S come from.

Masked positions are inert (docs/numerics.md): a NaN or Inf reaches only the rows the causal
order lets see it. So the tril masks select (a product times 0 would keep a NaN), the states of
the tiles before (after) a tile are sums of those tiles alone, never a total minus the rest, and
in a tile holding a non-finite value, where a product over the tile's rows would meet it with a
masked weight of 0 (0 x Inf = NaN), that product is taken with zeros in its place, and again row
by row for the rows that see it, each row summing its own past (future) as a running state
(`_running`): slower, and only in such tiles; the rows that do not see it get the bits that a 0
there gives.
"""

from __future__ import annotations

import functools

import numpy as np

TILE = 128  # rows a tile: tril(Q K^T) costs T/D of the state products, small at T = 128
TILES_AT_ONCE = 64  # tiles a batched matmul takes: B*H*64*T*T scores at a time


def _grouped(xp, x, hkv: int, acc):
    """(B, C, H, D) -> (B, Hkv, H/Hkv, C, D) in acc (query heads of one kv head together)."""
    b, c, h, d = x.shape
    return xp.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(b, hkv, h // hkv, c, d).astype(acc))


def _heads(xp, x, acc):
    """(B, C, Hkv, D) -> (B, Hkv, C, D) in acc."""
    return xp.ascontiguousarray(x.transpose(0, 2, 1, 3).astype(acc))


def _rows_first(xp, x):
    """(B, Hkv, R, C, D) or (B, Hkv, C, D) back to (B, C, H, D)."""
    if x.ndim == 5:
        b, g, r, c, d = x.shape
        x = x.reshape(b, g * r, c, d)
    return xp.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _tril(xp, n: int):
    """(n, n) bool: row i keeps the columns j <= i."""
    return xp.tril(xp.ones((n, n), dtype=bool))


def _before(xp, states):
    """For each tile (axis 2 of `states` (B, Hkv, n, D, D)) the sum of the tiles before it."""
    out = xp.zeros_like(states)
    out[:, :, 1:] = xp.cumsum(states[:, :, :-1], axis=2)
    return out


def _after(xp, states):
    """For each tile (axis 2) the sum of the tiles after it."""
    return _before(xp, states[:, :, ::-1])[:, :, ::-1]


def _finite(xp, *arrays) -> bool:
    """Whether every value of `arrays` is finite, as far as a finite sum says (a NaN or Inf
    makes the sum one; a sum that overflows says False of finite values, which only costs the
    careful path): once a run, so that runs without a NaN or Inf (nearly all) look at no tile's
    (one host synchronisation a run on CuPy)."""
    return all(bool(xp.isfinite(x.sum())) for x in arrays)


def _masked(xp, products, keep):
    """products (..., T, T) with the pairs `keep` (T, T) leaves out set to 0, in place (a
    multiplication by 0 would keep a NaN or Inf there)."""
    xp.copyto(products, 0, where=~keep)
    return products


def _nonfinite_tiles(xp, *tiled) -> list[int]:
    """The tiles (axis -3 of each of `tiled`, (..., n, T, D)) holding a NaN or Inf in any."""
    bad = None
    for x in tiled:
        here = ~xp.isfinite(x).all(axis=tuple(i for i in range(x.ndim) if i != x.ndim - 3))
        bad = here if bad is None else bad | here
    return [int(t) for t in xp.flatnonzero(bad)]


def _running(xp, rows_a, rows_b, past: bool, spec: str):
    """Per row i of one tile, the sum over its rows j <= i (past) or j >= i (future) of the
    outer product rows_a[j]^T rows_b[j], by an einsum `spec` ('...jd,...je->...jde' summing any
    other axis) and a cumulative sum over the rows (axis -3 of the result)."""
    outer = xp.einsum(spec, rows_a, rows_b)
    if past:
        return xp.cumsum(outer, axis=-3)
    return xp.cumsum(outer[..., ::-1, :, :], axis=-3)[..., ::-1, :, :]


def _quiet(f):
    """f run under np.errstate(over="ignore", invalid="ignore"), as the softmax op runs: a NaN
    or Inf of the inputs reaches the rows that see it, as the math says, without warnings."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore"):
            return f(*args, **kwargs)
    return run


@_quiet
def kv_state(xp, k, v, acc):
    """M = K^T V: (B, Hkv, D, D) in acc from k, v (B, C, Hkv, D)."""
    kh, vh = _heads(xp, k, acc), _heads(xp, v, acc)
    return kh.transpose(0, 1, 3, 2) @ vh


@_quiet
def grad_state(xp, q, dout, hkv: int, acc):
    """dM = sum over a kv head's query heads of Q^T dO: (B, Hkv, D, D) in acc."""
    qg, dg = _grouped(xp, q, hkv, acc), _grouped(xp, dout, hkv, acc)
    return (qg.transpose(0, 1, 2, 4, 3) @ dg).sum(axis=2)


def _spans(c: int, rows: int):
    """[r0, r1) row ranges of at most `rows` rows covering 0..c."""
    return [(r0, min(c, r0 + rows)) for r0 in range(0, c, rows)]


def _tiled(xp, x, r0: int, r1: int, tile: int):
    """Rows r0..r1 of x (..., C, D) as (..., n_tiles, tile, D), zero-padded to whole tiles (zero
    rows add nothing to a state and their outputs are dropped)."""
    part = x[..., r0:r1, :]
    n = r1 - r0
    pad = -n % tile
    if pad:
        part = xp.concatenate([part, xp.zeros(part.shape[:-2] + (pad, part.shape[-1]), part.dtype)],
                              axis=-2)
    return part.reshape(part.shape[:-2] + ((n + pad) // tile, tile, part.shape[-1]))


def _untiled(x, n: int):
    """(..., n_tiles, tile, D) back to (..., n, D) (padding dropped)."""
    return x.reshape(x.shape[:-3] + (x.shape[-3] * x.shape[-2], x.shape[-1]))[..., :n, :]


def _t(x):
    return x.swapaxes(-1, -2)


def _nonfinite_rows(xp, x):
    """(B, G, T) bool: the rows of one tile x (B, G, [R,] T, D) holding a NaN or Inf (in any of
    the R query heads)."""
    bad = ~xp.isfinite(x).all(axis=-1)
    return bad.any(axis=2) if bad.ndim == 4 else bad


def _zeroed(xp, x, tiles: list[int]):
    """x (..., n, T, D) with its tiles `tiles`' NaN and Inf replaced by 0 (a copy; x itself where
    there are none)."""
    if not tiles:
        return x
    x = x.copy()
    for t in tiles:
        x[..., t, :, :] = xp.where(xp.isfinite(x[..., t, :, :]), x[..., t, :, :], 0)
    return x


def _causal_tiles(xp, a, b, c, before, keep, careful: bool):
    """tril(A B^T) C + A Before, tile by tile: a (B, G, R, n, T, D); b, c (B, G, n, T, D);
    before (B, G, n, D, D) each tile's state of what lies before it; keep the tril mask (T, T).
    The forward's O (Q, K, V, P + M_<t) and the backward's dQ (dO, V, K, (P + M_<t)^T). With
    `careful` (C may hold a NaN or Inf), a tile whose C does is multiplied with zeros in their
    place (the product with masked weights of 0 would spread them to every row), and its rows
    from the first that sees one on take their first term row by row (row i: A_i sum_{j <= i}
    B_j^T C_j, `_running`): the rows before it get the bits that zeros there give."""
    bad = _nonfinite_tiles(xp, c) if careful else []
    within = _masked(xp, a @ _t(b)[:, :, None], keep) @ _zeroed(xp, c, bad)[:, :, None]
    for t in bad:
        past = _running(xp, b[:, :, t], c[:, :, t], True, "bgjd,bgje->bgjde")
        seen = xp.cumsum(_nonfinite_rows(xp, c[:, :, t]), axis=-1) > 0     # (B, G, T)
        within[:, :, :, t] = xp.where(seen[:, :, None, :, None],
                                      (a[:, :, :, t, :, None, :] @ past[:, :, None])[..., 0, :],
                                      within[:, :, :, t])
    return within + a @ before[:, :, None]


@_quiet
def forward_run(xp, q, k, v, prefix, acc, tile: int = TILE):
    """Causal linear attention of one run of rows: out (B, C, H, D) in acc, with `prefix`
    (B, Hkv, D, D) the state of every earlier row outside the run (None: none). Tiles are
    processed TILES_AT_ONCE at a time as batched matmuls, the state carried between groups."""
    hkv = k.shape[2]
    qg, kh, vh = _grouped(xp, q, hkv, acc), _heads(xp, k, acc), _heads(xp, v, acc)
    b, _, r, c, d = qg.shape
    tile = max(1, min(tile, c))
    keep = _tril(xp, tile)
    out = xp.empty_like(qg)
    careful = not _finite(xp, vh)
    state = xp.zeros((b, hkv, d, d), dtype=acc) if prefix is None else prefix.astype(acc, copy=True)
    for r0, r1 in _spans(c, tile * TILES_AT_ONCE):
        qt = _tiled(xp, qg, r0, r1, tile)                        # (B, G, R, n, T, D)
        kt, vt = _tiled(xp, kh, r0, r1, tile), _tiled(xp, vh, r0, r1, tile)   # (B, G, n, T, D)
        states = _t(kt) @ vt                                     # (B, G, n, D, D)
        before = _before(xp, states) + state[:, :, None]
        out[..., r0:r1, :] = _untiled(_causal_tiles(xp, qt, kt, vt, before, keep, careful), r1 - r0)
        state = state + states.sum(axis=2)
    return _rows_first(xp, out)


@_quiet
def backward_run(xp, dout, q, k, v, prefix, suffix, acc, tile: int = TILE):
    """Gradients of `forward_run` for one run: (dq (B, C, H, D), dk, dv (B, C, Hkv, D)) in acc.
    prefix: the state of every earlier row outside the run; suffix: the gradient state dM of
    every later row outside the run (either None: none)."""
    hkv = k.shape[2]
    qg, dg = _grouped(xp, q, hkv, acc), _grouped(xp, dout, hkv, acc)
    kh, vh = _heads(xp, k, acc), _heads(xp, v, acc)
    b, _, r, c, d = qg.shape
    tile = max(1, min(tile, c))
    keep = _tril(xp, tile)
    dq, dk, dv = xp.empty_like(qg), xp.empty_like(kh), xp.empty_like(vh)
    spans = _spans(c, tile * TILES_AT_ONCE)
    careful_k, careful_q = not _finite(xp, kh), not _finite(xp, qg, dg)
    state = xp.zeros((b, hkv, d, d), dtype=acc) if prefix is None else prefix.astype(acc, copy=True)
    for r0, r1 in spans:                                # forwards: dQ needs the past
        dt = _tiled(xp, dg, r0, r1, tile)
        kt, vt = _tiled(xp, kh, r0, r1, tile), _tiled(xp, vh, r0, r1, tile)
        states = _t(kt) @ vt
        before = _before(xp, states) + state[:, :, None]
        dq[..., r0:r1, :] = _untiled(_causal_tiles(xp, dt, vt, kt, _t(before), keep, careful_k),
                                     r1 - r0)
        state = state + states.sum(axis=2)
    grad = xp.zeros((b, hkv, d, d), dtype=acc) if suffix is None else suffix.astype(acc, copy=True)
    for r0, r1 in reversed(spans):                      # backwards: dK, dV need the future
        qt, dt = _tiled(xp, qg, r0, r1, tile), _tiled(xp, dg, r0, r1, tile)
        kt, vt = _tiled(xp, kh, r0, r1, tile), _tiled(xp, vh, r0, r1, tile)
        grads = (_t(qt) @ dt).sum(axis=2)                # (B, G, n, D, D), summed over heads
        after = _after(xp, grads) + grad[:, :, None]
        # 0 weights x NaN in Q, dO: tiles holding one are multiplied with zeros in their place,
        # and their keys up to the last row that holds one (the keys it sees) row by row
        bad = _nonfinite_tiles(xp, qt, dt) if careful_q else []
        q0, d0 = _zeroed(xp, qt, bad), _zeroed(xp, dt, bad)
        scores = _masked(xp, q0 @ _t(kt)[:, :, None], keep)
        dscores = _masked(xp, d0 @ _t(vt)[:, :, None], keep)
        dk_within = (_t(dscores) @ q0).sum(axis=2)
        dv_within = (_t(scores) @ d0).sum(axis=2)
        for t in bad:
            future = _running(xp, dt[:, :, :, t], qt[:, :, :, t], False, "bgrjd,bgrje->bgjde")
            rows = _nonfinite_rows(xp, qt[:, :, :, t]) | _nonfinite_rows(xp, dt[:, :, :, t])
            seen = (xp.cumsum(rows[..., ::-1], axis=-1) > 0)[..., ::-1, None]   # (B, G, T, 1)
            dk_within[:, :, t] = xp.where(seen, (vt[:, :, t, :, None, :] @ future)[..., 0, :],
                                          dk_within[:, :, t])
            dv_within[:, :, t] = xp.where(seen, (kt[:, :, t, :, None, :] @ _t(future))[..., 0, :],
                                          dv_within[:, :, t])
        dk[..., r0:r1, :] = _untiled(dk_within + vt @ _t(after), r1 - r0)
        dv[..., r0:r1, :] = _untiled(dv_within + kt @ after, r1 - r0)
        grad = grad + grads.sum(axis=2)
    return _rows_first(xp, dq), _rows_first(xp, dk), _rows_first(xp, dv)


@_quiet
def forward_full(xp, q, total, acc):
    """Non-causal: out = Q M (B, C, H, D) in acc, M = `total` (B, Hkv, D, D), every row's."""
    qg = _grouped(xp, q, total.shape[1], acc)
    return _rows_first(xp, qg @ total[:, :, None])


@_quiet
def backward_full(xp, dout, k, v, total, grad_total, acc):
    """Non-causal gradients: dq = dO M^T, dk = V dM^T, dv = K dM in acc, with M = `total` and
    dM = `grad_total` (B, Hkv, D, D) summed over every row of the sequence."""
    hkv = k.shape[2]
    dg = _grouped(xp, dout, hkv, acc)
    kh, vh = _heads(xp, k, acc), _heads(xp, v, acc)
    dq = dg @ total[:, :, None].transpose(0, 1, 2, 4, 3)
    return (_rows_first(xp, dq), _rows_first(xp, vh @ grad_total.transpose(0, 1, 3, 2)),
            _rows_first(xp, kh @ grad_total))
