"""`Sharding`: how a sequence is split across a group's ranks, carried as one object so the calls
that cut the sequence (`shard`), attend over it (`attention`, its backward, `plan`, the
adapters) and join it again (`unshard`) cannot disagree.

    sh = burstcu.Sharding(group, layout="zigzag", cu_seqlens=cu)   # cu: global document bounds
    q, k, v = (sh.shard(x) for x in (Q, K, V))                      # (B, S_local, H, D) each
    out, lse = burstcu.attention(q, k, v, sh, causal=True, return_lse=True)
    OUT, LSE = sh.unshard(out), sh.unshard_lse(lse)                 # (B, N, H, D), (B, H, N)

Passed where a group goes, a Sharding supplies `layout`, `cu_seqlens` and (with `lengths`)
`uneven=True`; a keyword that disagrees with it is an error on every rank.

layout: "contiguous", "zigzag" or "documents" (`burstcu.layout`). cu_seqlens: global document boundaries
0 = b_0 <= ... <= b_n = N (host ints, the same on every rank), or None. lengths: rows each rank
holds (one at least), for contiguous shards of other than near-equal lengths (rank r holds the
run after the rows of ranks 0..r-1), or None. Packed inputs (flash-attn's varlen convention, no batch axis:
q (T, H, D)) have their sequence on axis 0: `sh.shard(x, axis=0)`, and their lse (H, T) on
axis 1: `sh.unshard_lse(lse)` finds it from lse's rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import api
from .group import Group, not_a_group
from .layout import LAYOUTS, partition
from .validate import cut_of, host_ints, parse_cu_seqlens


@dataclass(frozen=True, eq=False)   # identity: hashable (a jit static argument, a cache key)
class Sharding:
    """A group and the split of the sequence across its ranks (module docstring)."""

    group: Group
    layout: str = "contiguous"
    cu_seqlens: tuple | None = None
    lengths: tuple | None = None

    def __init__(self, group: Group, layout: str = "contiguous", cu_seqlens=None, lengths=None):
        if not isinstance(group, Group):
            raise TypeError(f"Sharding: {not_a_group(group)}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        err, docs = parse_cu_seqlens(cu_seqlens)
        if err is not None:
            raise err.exception()
        if lengths is not None:
            if layout != "contiguous":
                raise ValueError(f"lengths (rows per rank) describe contiguous shards; the "
                                 f"{layout} layout cuts its own")
            counts = host_ints(lengths)
            if counts.shape != (group.size,) or not np.issubdtype(counts.dtype, np.integer) \
                    or (counts < 1).any():
                raise ValueError(f"lengths must be {group.size} positive ints (rows each rank "
                                 f"holds: at least one), got {lengths!r}")
            lengths = tuple(int(n) for n in counts)
            if docs is not None and docs[-1] != sum(lengths):
                raise ValueError(f"cu_seqlens ends at {docs[-1]} but the lengths add up to "
                                 f"{sum(lengths)}")
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "cu_seqlens", docs)
        object.__setattr__(self, "lengths", lengths)

    @property
    def uneven(self) -> bool:
        """Whether the shards are of other than near-equal lengths on purpose (`lengths`)."""
        return self.lengths is not None

    def sharding_arguments(self) -> tuple:
        """(group, layout, cu_seqlens, lengths): what the public calls take from a Sharding
        passed where a group goes."""
        return self.group, self.layout, self.cu_seqlens, self.lengths

    def shard(self, x, axis: int | None = None):
        """This rank's rows of the global array `x` along `axis` (the sequence axis; None: 1 for
        (B, N, H, D), 0 for a 3-D `x` where this Sharding's documents or lengths say it is packed
        (T, H, D)). No communication. A 3-D `x` asks for `axis` (ValueError) where the Sharding
        cannot tell packed (T, H, D) from (B, N, d_model) hidden states: without documents or
        lengths, where axis 0 cannot be the sequence (fewer rows than ranks, or other than the N
        its documents or lengths say), or where it may not be (N along axes 0 and 1 both)."""
        if axis is None:
            total = (self.cu_seqlens[-1] if self.cu_seqlens is not None else
                     sum(self.lengths) if self.lengths is not None else None)
            problem = self._packed_rows_problem("shard", "x", x, total, "the sequence's",
                                                self.group.size)
            if problem is not None:   # x is the global array: alike on every rank
                raise ValueError(problem)
        return api.shard(x, self, axis=_sequence_axis(x, axis))

    def unshard(self, x_local, axis: int | None = None):
        """The global array on every rank from each rank's `x_local` (collective; axis as in
        `shard`, or where `shard` cut this very array when it remembers: hidden states cut
        along axis 1 join along axis 1). A 3-D `x_local` it remembers nothing of (a copy) asks
        for `axis` on every rank where the Sharding cannot tell its sequence axis (no documents
        or lengths; axis 0 and axis 1 both have this rank's rows) or axis 0 cannot be this
        rank's rows (other than the Sharding's lengths or documents say, or one row: an lse (1,
        H, S_local), for which there is `unshard_lse`)."""
        held = cut_of(x_local) if axis is None else None
        problem = None
        if held is not None and held[0][0] == "rows":
            axis = held[1]
        elif held is None and axis is None:   # raised on every rank (`gather_shards`)
            mine = self._rows_of_this_rank()
            problem = self._packed_rows_problem("unshard", "x_local", x_local, mine, "this rank's",
                                                2 if mine is None else 0)
        return api.gather_shards(x_local, self, None, _sequence_axis(x_local, axis), None, None,
                                 problem)

    def _rows_of_this_rank(self) -> int | None:
        """The rows this rank holds by the Sharding (its lengths, or the cut of its documents),
        or None where it says nothing (or cannot cut them: `unshard` says why)."""
        if self.lengths is not None:
            return self.lengths[self.group.rank]
        if self.cu_seqlens is None:
            return None
        try:
            part = partition(self.layout, self.group.size, self.cu_seqlens[-1], self.cu_seqlens)
        except ValueError:
            return None
        return part.lengths[self.group.rank]

    def _packed_rows_problem(self, call: str, name: str, x, rows: int | None, whose: str,
                             fewest: int) -> str | None:
        """Why a 3-D `x`, taken as packed (T, H, D) along axis 0 for want of `axis`, cannot be
        taken so, or None: this Sharding has no documents or lengths (nothing tells packed rows
        from (B, N, d_model) hidden states, which are 3-D too); axes 0 and 1 both of the `rows`
        known for it (`whose` rows, in words); fewer than `fewest` rows (the ranks, for the
        global array; 2 for one rank's shard whose rows are not known: one row is most likely a
        batch of one); or other than the rows known for it (hidden states, an lse (B, H, S))."""
        if getattr(x, "ndim", None) != 3:
            return None
        if self.cu_seqlens is None and self.lengths is None:
            return (f"Sharding.{call} cannot tell the sequence axis of {name} {tuple(x.shape)}: a "
                    f"3-D array is packed (T, H, D) (axis=0) or (B, N, ...), such as hidden states "
                    f"(B, N, d_model) (axis=1), and this Sharding has no documents or lengths to "
                    f"tell them apart: pass axis=" + (" (an lse (B, H, S): unshard_lse)"
                                                      if call == "unshard" else ""))
        n0, n1 = x.shape[:2]
        if rows is not None and n0 == rows == n1:
            return (f"Sharding.{call} cannot tell the sequence axis of {name} {tuple(x.shape)}: "
                    f"axis 0 and axis 1 both have {whose} {rows} rows: pass axis= (0 for packed "
                    f"(T, H, D), 1 for (B, N, ...) arrays such as hidden states)")
        if n0 >= fewest and (rows is None or n0 == rows):
            return None
        elsewhere = "" if rows is None else (f" and {whose} {rows} along axis 1" if n1 == rows
                                             else f", not {whose} {rows}")
        return (f"Sharding.{call} takes a 3-D array as packed (T, H, D), its sequence along axis 0, "
                f"but {name} {tuple(x.shape)} has {n0} row{'s' * (n0 != 1)} there{elsewhere}"
                + ": pass axis= (axis=1 for (B, N, ...) arrays such as hidden states; an lse "
                  "(B, H, S): unshard_lse)")

    def unshard_lse(self, lse_local):
        """The global lse on every rank: (B, H, N) from (B, H, S_local), or (H, N) from packed
        inputs' (H, T_local) — the sequence is lse's last axis (collective). An array of other
        than 2 or 3 dimensions (the output (B, S_local, H, D)) is a ValueError on every rank."""
        ndim, problem = getattr(lse_local, "ndim", None), None
        if ndim is not None and ndim not in (2, 3):
            problem = (f"Sharding.unshard_lse takes an lse, (B, H, S_local) or packed inputs' "
                       f"(H, T_local), but lse_local {tuple(lse_local.shape)} has {ndim} "
                       f"dimensions: use unshard for other arrays")
        return api.gather_shards(lse_local, self, None, -1, None, None, problem)


def _sequence_axis(x, axis: int | None) -> int:
    """`axis`, or where the sequence is when None: 0 for packed (T, H, D), else 1."""
    if axis is not None:
        return axis
    return 0 if getattr(x, "ndim", None) == 3 else 1
