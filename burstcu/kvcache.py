"""`KVCache`: a KV cache sharded over a group's ranks for `burstcu.decode` (new tokens attending
to every rank's cache rows). Appends land on one rank each, balanced, with no message.

Shapes (B batch, capacity rows a rank can hold, Hkv kv heads, D head dim):
    k, v (B, capacity, Hkv, D) of the group's backend; seqlens (B,) int32: this rank's valid rows
    of each batch row; counts (G, B): every rank's, kept alike on every rank.
`cache.decode(q)` is `burstcu.decode(q, cache)`, with the ranks also agreeing on the counts.
"""

from __future__ import annotations

import hashlib

import numpy as np

from . import api
from .group import Call, Group, local_group
from .validate import InputError, agree


class KVCache:
    """A KV cache sharded over `group`'s ranks, rows in any order (decode needs no positions).

    k, v: (batch, capacity_per_rank, kv_heads, headdim) arrays of the group's backend in
    `dtype`; `seqlens` (batch,) int32: this rank's valid rows per batch row. Every rank keeps
    every rank's counts (`counts`, (G, batch)), updated alike on every rank, so each new row goes
    to the rank holding fewest rows of its batch row (ties: the lowest rank) without any message.
    """

    def __init__(self, group: Group | None, batch: int, capacity_per_rank: int, kv_heads: int,
                 headdim: int, dtype):
        group = api.group_of(group)             # a Group, or a Sharding's
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
        """`burstcu.decode(q, self.k, self.v, self.group, cache_seqlens=self.seqlens, ...)`, with
        the ranks also agreeing on every rank's counts (appends given different rows on some
        rank would make them differ: an error on every rank, not a silently wrong cache)."""
        return api.decode(q, self, softmax_scale=softmax_scale, return_lse=return_lse)

    def decode_arguments(self) -> tuple:
        """(k, v, group, this rank's seqlens, {values every rank must hold alike}) that
        `burstcu.decode` takes from a cache."""
        digest = hashlib.sha1(self.counts.tobytes()).hexdigest()[:16]
        return self.k, self.v, self.group, self.seqlens, {"kv_cache_counts": digest}
