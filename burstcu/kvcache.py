"""Inference against a sequence-sharded KV cache: `decode` (new tokens attending to every rank's
cache rows) and `KVCache` (the cache itself: appends land on one rank each, balanced).

Shapes (B batch, T new tokens, H query heads, Hkv kv heads, D head dim, S_cache rows a rank
holds, capacity the most it can hold):
    q (B, T, H, D): the same on every rank;  k_cache, v_cache (B, S_cache, Hkv, D): this rank's
    shard, rows in any order;  cache_seqlens (B,) ints: valid rows of each batch row on this rank
    out (B, T, H, D) in q's dtype, lse (B, H, T) float32 (float64 for float64 q): the same on
    every rank
One partial attention per rank over its valid rows (`burstcu.ops.decode.partial` on the CPU;
on the kernel backends the split-K kernels of kernels/flash_decode.cu, `ops.kernel_decode`), then ONE
all-gather of the partials (acc (B,T,H,D), row max and row sum (B,H,T), accumulation dtype)
merged in rank order (`burstcu.ops.decode.merge`), so every rank holds the same bits:
    bytes sent per rank = (G-1) * B*T*H*(D+2) * acc itemsize    (`decode_bytes`)
independent of the cache length. Validation and agreement as `burstcu.attention`: a bad input
or ranks disagreeing raise on every rank before the gather.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .api import _agreed, _group_for, _returned
from .group import Call, Group
from .ops import decode as local
from .ops.cuda import decode as kernel_decode
from .ops.base import Message, accum_dtype
from .validate import InputError, _check_array, agree, dtype_name, host_ints, metadata, resolve_scale


def _dtypes(ops) -> tuple:
    """What decode computes in with this backend's arrays (CuPy has no bfloat16)."""
    return ("float16", "bfloat16", "float32", "float64") if ops.xp is np else \
        ("float16", "float32", "float64")


def _check_local(ops, arrays, cache_seqlens, softmax_scale, return_lse, agreed: dict):
    """(InputError or None, metadata, (valid rows per batch row, scale)) of this rank's inputs."""
    q, k, v = arrays
    for name, x in (("q", q), ("k_cache", k), ("v_cache", v)):
        err = _check_array(name, x, 4, ops.array_types, _dtypes(ops))
        if err:
            return err, None, None
    if not dtype_name(q) == dtype_name(k) == dtype_name(v):
        return InputError(TypeError, f"q, k_cache, v_cache dtypes differ: {dtype_name(q)}, "
                                     f"{dtype_name(k)}, {dtype_name(v)}"), None, None
    if tuple(k.shape) != tuple(v.shape):
        return InputError(ValueError, f"k_cache has shape {tuple(k.shape)} but v_cache has "
                                      f"{tuple(v.shape)}"), None, None
    b, t, h, d = q.shape
    bk, s, hkv, dk = k.shape
    if bk != b or dk != d or min(b, t, h, d, hkv) < 1 or h % hkv:
        return InputError(ValueError, f"q {tuple(q.shape)} does not fit the cache {tuple(k.shape)}: "
                                      f"(B, T, H, D) against (B, S_cache, Hkv, D), H a multiple "
                                      f"of Hkv"), None, None
    if not isinstance(return_lse, (bool, np.bool_)):
        return InputError(TypeError, f"return_lse must be True or False, got {return_lse!r}"), None, None
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float, np.floating))
                                          and not isinstance(softmax_scale, bool)
                                          and np.isfinite(float(softmax_scale))):
        return InputError(ValueError, f"softmax_scale must be a finite number, got "
                                      f"{softmax_scale!r}"), None, None
    if cache_seqlens is None:
        lengths = np.full(b, s, np.int64)
    else:
        lengths = host_ints(cache_seqlens)
        if not np.issubdtype(lengths.dtype, np.integer) or lengths.shape != (b,):
            return InputError(ValueError, f"cache_seqlens must be {b} integers (one a batch row), "
                                          f"got {lengths.dtype} {tuple(lengths.shape)}"), None, None
        if (lengths < 0).any() or (lengths > s).any():
            return InputError(ValueError, f"cache_seqlens must lie in [0, {s}] (this rank's "
                                          f"cache rows), got {lengths.tolist()}"), None, None
        lengths = lengths.astype(np.int64)
    scale = resolve_scale(softmax_scale, d)
    meta = metadata(q, k, v, seq_axes=(None, 1, 1), softmax_scale=scale,
                    return_lse=bool(return_lse), **agreed)
    return None, meta, (lengths, scale)


def decode(q, k_cache, v_cache=None, group: Group | None = None, *, cache_seqlens=None,
           softmax_scale: float | None = None, return_lse: bool = False):
    """Attention of the new tokens q over every rank's KV cache rows (module docstring).

    `decode(q, cache)` with a `KVCache` is `cache.decode(q, ...)` (its arrays, group and
    row counts).

    q: (B, T, H, D), the same on every rank (T new tokens, usually 1; their own K/V already in
    the cache; they see every valid cache row, no causal order among them). k_cache, v_cache:
    (B, S_cache, Hkv, D), this rank's shard in any order. cache_seqlens: (B,) ints, this rank's
    valid rows per batch row (0 allowed; None: all S_cache); rows past them are never read.
    Returns out (B, T, H, D) in q's dtype and array type, identical on every rank; with
    return_lse, (out, lse (B, H, T)). A batch row with no valid row anywhere gets out 0 and
    lse -inf.
    """
    if isinstance(k_cache, KVCache):
        if v_cache is not None or cache_seqlens is not None or group not in (None, k_cache.group):
            raise TypeError("decode(q, cache) takes the cache's own arrays, group and row counts: "
                            "pass no v_cache, group or cache_seqlens with a KVCache")
        return k_cache.decode(q, softmax_scale=softmax_scale, return_lse=return_lse)
    if v_cache is None:
        raise TypeError("decode(q, k_cache, v_cache, ...) needs v_cache (or pass a KVCache)")
    return _decode(q, k_cache, v_cache, group, cache_seqlens, softmax_scale, return_lse)


def _decode(q, k_cache, v_cache, group, cache_seqlens, softmax_scale, return_lse, **agreed):
    """`decode`; agreed: more values every rank must hold alike (a KVCache's counts)."""
    group = _group_for(group, q)
    with Call(group, "decode") as call:
        def check(native):
            err, meta, extra = _check_local(group.ops, native, cache_seqlens, softmax_scale,
                                            return_lse, agreed)
            return err, meta, extra, None

        (q, k_cache, v_cache), export, (lengths, scale) = _agreed(
            call, group, (q, k_cache, v_cache), "decode", check)
        xp, acc = group.ops.xp, accum_dtype(q.dtype)
        call.transport.where = "decode partial attention"
        if group.backend in ("cupy", "emulated") and dtype_name(q) in kernel_decode.KERNEL_DTYPES:
            mine = kernel_decode.partial(group.ops, q, k_cache, v_cache, lengths, scale)
        else:
            mine = local.partial(xp, q, k_cache, v_cache, lengths, scale, acc)
        parts = _gathered(group, mine)
        out, lse = local.merge(xp, parts, q.dtype)
    results = _returned(export, (out, lse))
    return results if return_lse else results[0]


def _fields(acc_shape, stat_shape, dtype):
    return [("acc", acc_shape, dtype), ("m", stat_shape, dtype), ("l", stat_shape, dtype)]


def _gathered(group: Group, mine):
    """Every rank's (acc, m, l), in rank order, after one all-gather of the packed partials."""
    acc, m, l = mine
    if group.size == 1:
        return [mine]
    xp = group.ops.xp
    fields = _fields(acc.shape, m.shape, acc.dtype)
    packed = Message(xp, fields)
    for name, x in zip(("acc", "m", "l"), mine):
        packed[name][...] = x
    flat = packed.span("acc", "l")
    gathered = xp.empty((group.size,) + tuple(flat.shape), dtype=flat.dtype)
    group.transport.where = "decode all-gather of the partials"
    group.transport.allgather(flat, gathered)
    parts = []
    for r in range(group.size):
        theirs = Message(xp, fields, flat=gathered[r])
        parts.append((theirs["acc"], theirs["m"], theirs["l"]))
    return parts


def decode_bytes(size: int, q) -> int:
    """Bytes one rank sends in `decode`: (G-1) * B*T*H*(D+2) * acc itemsize."""
    b, t, h, d = q.shape
    return (size - 1) * b * t * h * (d + 2) * accum_dtype(q.dtype).itemsize


class KVCache:
    """A KV cache sharded over `group`'s ranks, rows in any order (decode needs no positions).

    k, v: (batch, capacity_per_rank, kv_heads, headdim) arrays of the group's backend in
    `dtype`; `seqlens` (batch,) int32: this rank's valid rows per batch row. Every rank keeps
    every rank's counts (`counts`, (G, batch)), updated alike on every rank, so each new row goes
    to the rank holding fewest rows of its batch row (ties: the lowest rank) without any message.
    """

    def __init__(self, group: Group | None, batch: int, capacity_per_rank: int, kv_heads: int,
                 headdim: int, dtype):
        from .group import local_group
        self.group = group if group is not None else local_group("numpy")
        for name, n in (("batch", batch), ("capacity_per_rank", capacity_per_rank),
                        ("kv_heads", kv_heads), ("headdim", headdim)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"KVCache {name} must be a positive int, got {n!r}")
        xp = self.group.ops.xp
        shape = (batch, capacity_per_rank, kv_heads, headdim)
        self.dtype = np.dtype(dtype)
        self.k, self.v = xp.zeros(shape, dtype=self.dtype), xp.zeros(shape, dtype=self.dtype)
        self.counts = np.zeros((self.group.size, batch), np.int64)

    @property
    def capacity(self) -> int:
        return int(self.k.shape[1])

    @property
    def seqlens(self) -> np.ndarray:
        """(batch,) int32: this rank's valid rows per batch row."""
        return self.counts[self.group.rank].astype(np.int32)

    def _check_rows(self, what: str, k_new, v_new) -> tuple:
        b, _, hkv, d = self.k.shape
        xp = self.group.ops.xp
        k_new, v_new = xp.asarray(k_new), xp.asarray(v_new)
        if k_new.ndim != 4 or tuple(k_new.shape) != tuple(v_new.shape) or \
                (k_new.shape[0], k_new.shape[2], k_new.shape[3]) != (b, hkv, d):
            raise ValueError(f"KVCache.{what} takes k, v of shape (batch={b}, rows, kv_heads={hkv}, "
                             f"headdim={d}); got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
        return k_new, v_new

    def append(self, k_new, v_new) -> None:
        """Add rows (batch, T, kv_heads, headdim), the same on every rank: row t of batch row b
        lands on the rank holding fewest rows of b then. A cache with no room for them raises
        ValueError on every rank (before anything is stored). No communication."""
        with Call(self.group, "KVCache.append") as call:
            with call.raising_together():    # every rank sees the same counts and shapes
                k_new, v_new = self._check_rows("append", k_new, v_new)
                counts = self.counts.copy()
                owners = []
                for t in range(k_new.shape[1]):
                    for b in range(counts.shape[1]):
                        owner = int(np.argmin(counts[:, b]))
                        if counts[owner, b] >= self.capacity:
                            raise ValueError(
                                f"KVCache is full: batch row {b} holds {int(counts[:, b].sum())} rows "
                                f"on {self.group.size} ranks of {self.capacity} each")
                        owners.append((t, b, owner, int(counts[owner, b])))
                        counts[owner, b] += 1
            for t, b, owner, row in owners:
                if owner == self.group.rank:
                    self.k[b, row] = k_new[b, t]
                    self.v[b, row] = v_new[b, t]
            self.counts = counts

    def from_prefill(self, k_local, v_local) -> None:
        """Adopt this rank's shard of a prefill (B, S_local, kv_heads, headdim), as a sharded
        `attention` holds it (any layout: decode needs no order); replaces what the cache held.
        Collective: the ranks learn each other's S_local in one round."""
        with Call(self.group, "KVCache.from_prefill") as call:
            err = None
            try:
                k_local, v_local = self._check_rows("from_prefill", k_local, v_local)
                if k_local.shape[1] > self.capacity:
                    err = InputError(ValueError, f"KVCache.from_prefill: {k_local.shape[1]} rows "
                                                 f"exceed the capacity {self.capacity} a rank")
            except Exception as exc:  # noqa: BLE001 - whatever fails here fails on every rank
                err = InputError(exc.__class__, f"KVCache.from_prefill cannot take these rows: "
                                       f"{exc.__class__.__name__}: {exc}")
            with call.raising_together():
                lengths = agree(self.group.transport, err, None, "KVCache.from_prefill",
                                None if err else int(k_local.shape[1]))
            n = int(k_local.shape[1])
            self.k[:, :n] = k_local
            self.v[:, :n] = v_local
            self.counts = np.repeat(np.asarray(lengths, np.int64)[:, None], self.k.shape[0], axis=1)

    def decode(self, q, *, softmax_scale: float | None = None, return_lse: bool = False):
        """`decode(q, self.k, self.v, self.group, cache_seqlens=self.seqlens, ...)`, with the
        ranks also agreeing on every rank's counts (appends given different rows on some rank
        would make them differ: an error on every rank, not a silently wrong cache)."""
        digest = hashlib.sha1(self.counts.tobytes()).hexdigest()[:16]
        return _decode(q, self.k, self.v, self.group, self.seqlens, softmax_scale, return_lse,
                       kv_cache_counts=digest)
