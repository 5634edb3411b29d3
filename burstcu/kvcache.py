"""`KVCache`: a KV cache sharded over a group's ranks for `burstcu.decode` (new tokens attending
to every rank's cache rows). Appends land on one rank each, balanced, with no message.

Shapes (B batch, capacity rows a rank can hold, Hkv kv heads, D head dim):
    k, v (B, capacity, Hkv, D) of the group's backend; seqlens (B,) int32: this rank's valid rows
    of each batch row; counts (G, B): every rank's, kept alike on every rank.
`cache.decode(q)` is `burstcu.decode(q, cache)`, with the ranks also agreeing on the counts.

Paged (`page_size=P`, vLLM's and FlashInfer's convention): k, v are a pool of pages
(num_pages, P, Hkv, D) on each rank and `page_table` (B, ceil(capacity / P)) int32 names, for
each batch row, the page holding its rows [i * P, (i + 1) * P) on this rank (-1: none yet). A
batch row takes a page from the rank's free pages when its rows there reach a new multiple of
P, so the sequences of a batch grow independently without copying; `clear(rows)` gives a
finished sequence's pages back. The decode kernel reads through the table. How many pages a
rank uses follows from the counts, so every rank knows when any rank's pool is full.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import numbers
import sys
from contextlib import contextmanager

import numpy as np

from . import api
from .arrays import device_problem, torch_stream, wait_computed
from .cpu_tensors import host_view
from .group import Call, Group, local_group, not_a_group
from .ops.base import as_dtype, finfo
from .ops.decode import PagedRows
from .validate import (InputError, agree, cache_cut_problem, cut_of, first_rows_digest,
                       remember_cache_arrays, warn_if_all_the_same)

# the appends since the last decode whose rows it compares across ranks (the first ones), and
# the tokens of a call it compares (spread over the call's rows, its first and last among them)
APPENDS_COMPARED, TOKENS_COMPARED = 64, 8


def _cache_dtype(dtype, names: tuple) -> np.dtype:
    """`dtype` as NumPy's: a NumPy or JAX dtype, its name, or a torch dtype (`torch.float16`, by
    its name); None or anything else is a TypeError naming `names`, the dtypes a cache may hold
    (not NumPy's default float64 for None)."""
    if type(dtype).__module__ == "torch":
        dtype = str(dtype).removeprefix("torch.")
    if dtype is not None:
        try:
            return as_dtype(dtype)
        except TypeError:
            pass
    raise TypeError(f"KVCache dtype must be one of {', '.join(names)}, got {dtype!r}")


def _real(dtype) -> bool:
    """Whether arrays of `dtype` hold real numbers a float cache stores (bool, ints, floats,
    bfloat16 and the other ml_dtypes floats), not complex, strings or objects."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biuf" or np.can_cast(dtype, np.float64, "safe")


class KVCache:
    """A KV cache sharded over `group`'s ranks, rows in any order (decode needs no positions).

    k, v: (batch, capacity_per_rank, kv_heads, headdim) arrays of the group's backend in
    `dtype`; `seqlens` (batch,) int32: this rank's valid rows per batch row. Every rank keeps
    every rank's counts (`counts`, (G, batch)), updated alike on every rank, so each new row goes
    to the rank holding fewest rows of its batch row (ties: the lowest rank) without any message.

    page_size: None (k, v as above) or the rows of a page: k, v are then (num_pages, page_size,
    kv_heads, headdim) and `page_table` (batch, ceil(capacity_per_rank / page_size)) int32 (module
    docstring); num_pages: the pool a rank holds, by default enough for every batch row to reach
    capacity_per_rank (fewer: batch rows share a smaller pool).
    """

    def __init__(self, group: Group | None, batch: int, capacity_per_rank: int, kv_heads: int,
                 headdim: int, dtype, *, page_size: int | None = None, num_pages: int | None = None):
        """Collective: every rank of `group` makes its cache with the same arguments (the ranks
        agree on them in one round); arguments a rank refuses, or that differ between ranks,
        raise ValueError/TypeError on every rank."""
        group = api.group_of(group)             # a Group, or a Sharding's
        if group is not None and not isinstance(group, Group):
            raise TypeError(f"KVCache: {not_a_group(group)}")
        self.group = group if group is not None else local_group("numpy")
        with Call(self.group, "KVCache") as call:
            err = arguments = None
            try:
                arguments = self._arguments(batch, capacity_per_rank, kv_heads, headdim, dtype,
                                            page_size, num_pages)
            except (ValueError, TypeError) as exc:
                err = InputError(type(exc), str(exc))
            with call.raising_together():
                agree(self.group.transport, err, ((), (), arguments and tuple(arguments.items())),
                      "KVCache")
        self.dtype = np.dtype(arguments["dtype"])
        self.batch, self._capacity, self.page_size = batch, capacity_per_rank, page_size
        xp = self.group.ops.xp
        shape = (batch, capacity_per_rank, kv_heads, headdim)
        if page_size is not None:
            per_row = -(-capacity_per_rank // page_size)
            self.num_pages = arguments["num_pages"]
            shape = (self.num_pages, page_size, kv_heads, headdim)
            self.page_table = np.full((batch, per_row), -1, np.int32)
            self._free = list(range(self.num_pages))   # this rank's free pages: a heap, lowest first
            self._taken: list | None = None             # (b, i) of pages taken in a store block
            self._table_dev = None                           # the table on the device, when current
            # stand-ins of (batch, capacity, kv_heads, headdim) for the shape checks: no memory
            self._views = tuple(xp.broadcast_to(xp.zeros((), self.dtype), (batch, capacity_per_rank,
                                                                          kv_heads, headdim)) for _ in "kv")
        self.k, self.v = xp.zeros(shape, dtype=self.dtype), xp.zeros(shape, dtype=self.dtype)
        self.counts = np.zeros((self.group.size, batch), np.int64)
        # (k, v, tokens) samples of the rows each append took since the last decode, which
        # compares them across ranks (`validate.appended_rows`)
        self._appended: list = []
        remember_cache_arrays(self)    # known as this cache's where decode is given them

    def _arguments(self, batch, capacity_per_rank, kv_heads, headdim, dtype, page_size,
                   num_pages) -> dict:
        """The constructor's arguments as every rank must give them (ints, the dtype's name,
        the pages of a rank's pool), else ValueError/TypeError."""
        for name, n in (("batch", batch), ("capacity_per_rank", capacity_per_rank),
                        ("kv_heads", kv_heads), ("headdim", headdim)):
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"KVCache {name} must be a positive int, got {n!r}")
        dtype = _cache_dtype(dtype, self.group.ops.array_dtypes)
        if dtype.name not in self.group.ops.array_dtypes:
            raise TypeError(f"KVCache dtype must be one of {', '.join(self.group.ops.array_dtypes)} "
                            f"(what decode takes on this group's backend), got {dtype.name}")
        if page_size is not None:
            for name, n in (("page_size", page_size), ("num_pages", num_pages)):
                if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
                    raise ValueError(f"KVCache {name} must be a positive int, got {n!r}")
            if num_pages is None:
                num_pages = batch * -(-capacity_per_rank // page_size)
        elif num_pages is not None:
            raise ValueError("KVCache num_pages needs page_size")
        return {"batch": int(batch), "capacity_per_rank": int(capacity_per_rank),
                "kv_heads": int(kv_heads), "headdim": int(headdim), "dtype": dtype.name,
                "page_size": None if page_size is None else int(page_size),
                "num_pages": None if num_pages is None else int(num_pages)}

    @property
    def capacity(self) -> int:
        """Rows a rank can hold of each batch row."""
        return int(self._capacity)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    def _pages_used(self, counts) -> np.ndarray:
        """(G,): the pages each rank's rows take at `counts` (G, batch)."""
        return (-(-np.asarray(counts) // self.page_size)).sum(axis=1)

    def _page_of(self, b: int, row: int) -> int:
        """The page holding row `row` of batch row b on this rank, taken from the free pages
        when the row starts a page."""
        i = row // self.page_size
        if self.page_table[b, i] < 0:
            self.page_table[b, i] = heapq.heappop(self._free)
            self._table_dev = None
            if self._taken is not None:
                self._taken.append((b, i))
        return int(self.page_table[b, i])

    def _store(self, b: int, row: int, k_row, v_row) -> None:
        """Row `row` of batch row b on this rank (in its page when paged)."""
        if self.paged:
            page = self._page_of(b, row)
            self.k[page, row % self.page_size] = k_row
            self.v[page, row % self.page_size] = v_row
        else:
            self.k[b, row] = k_row
            self.v[b, row] = v_row

    @contextmanager
    def _pages_restored_on_error(self):
        """Around stores: if one raises, the pages taken inside go back to the free pages and
        their entries of the page table to -1, so no page stays taken by rows the counts do not
        hold (a later append on this rank alone would otherwise find the free pages short). Its
        cost is the pages taken, not the pool's size."""
        if not self.paged:
            yield
            return
        outer, self._taken = self._taken, []
        try:
            yield
        except BaseException:
            for b, i in self._taken:
                heapq.heappush(self._free, int(self.page_table[b, i]))
                self.page_table[b, i] = -1
            self._table_dev = None
            raise
        finally:
            if outer is not None:
                outer.extend(self._taken)
            self._taken = outer

    def _full(self, counts) -> str | None:
        """Why `counts` (G, batch) do not fit (the same text on every rank), or None."""
        over = np.argwhere(counts > self.capacity)
        if len(over):
            _, b = over[0]
            return (f"KVCache is full: batch row {b} holds {int(counts[:, b].sum())} rows "
                    f"on {self.group.size} ranks of {self.capacity} each")
        if self.paged and (self._pages_used(counts) > self.num_pages).any():
            return (f"KVCache is full: rank {int(np.argmax(self._pages_used(counts)))} needs more "
                    f"than its {self.num_pages} pages of {self.page_size} rows")
        return None

    def clear(self, rows) -> None:
        """Forget every rank's rows of the batch rows `rows` (an int or a sequence of ints in
        [0, batch); not bools, no negative indices), the same on every rank: a finished
        sequence's slot starts empty again; a paged cache's pages go back to the free pages.
        Bad rows raise TypeError/ValueError on every rank given the same rows before anything
        is cleared. No communication (an error left uncaught ends the job, `raising_alike`)."""
        with Call(self.group, "KVCache.clear") as call:
            with call.raising_alike():    # every rank checks the same rows alike
                index = self._batch_rows(rows)
            for b in index:
                if self.paged:
                    taken = self.page_table[b][self.page_table[b] >= 0]
                    self._free += taken.tolist()
                    heapq.heapify(self._free)
                    self.page_table[b] = -1
                    self._table_dev = None
                self.counts[:, b] = 0
                for k, v, _ in self._appended:   # the same rows on every rank: nothing to compare
                    k[b], v[b] = 0, 0

    def _batch_rows(self, rows) -> list[int]:
        """`rows` (an int or a 1-d sequence of them) as a list of batch rows, each checked."""
        items = [rows] if np.ndim(rows) == 0 else list(rows)
        for x in items:
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
                raise TypeError(f"KVCache.clear takes batch rows as ints, got {x!r} "
                                f"({type(x).__name__}) in {rows!r}")
            if not 0 <= x < self.batch:
                raise ValueError(f"KVCache.clear: batch row {int(x)} is not in [0, {self.batch}) "
                                 f"(batch={self.batch}; negative indices are not taken)")
        return [int(x) for x in items]

    @property
    def seqlens(self) -> np.ndarray:
        """(batch,) int32: this rank's valid rows per batch row."""
        return self.counts[self.group.rank].astype(np.int32)

    def _check_rows(self, what: str, k_new, v_new) -> tuple:
        """k_new, v_new as arrays of the group's backend: (batch, rows, kv_heads, headdim) of
        real numbers (stored in the cache's dtype), else ValueError/TypeError, the same on every
        rank given the same rows."""
        b, (hkv, d) = self.batch, self.k.shape[2:]
        xp = self.group.ops.xp
        elsewhere = device_problem(self.group.ops, ("k", "v"), (k_new, v_new))
        if elsewhere is not None:
            raise ValueError(f"KVCache.{what}: {elsewhere.message}")
        torch = sys.modules.get("torch")
        for name, x in (("k", k_new), ("v", v_new)):
            if torch is not None and isinstance(x, torch.Tensor) and x.layout != torch.strided:
                raise TypeError(f"KVCache.{what}: {name} is a tensor of layout {x.layout} (no "
                                f"rows in memory to copy): pass {name}.to_dense()")
        if xp is np:   # CPU torch tensors of any dtype, bfloat16 and requires_grad too
            k_new, v_new = host_view(k_new), host_view(v_new)
        for name, x in (("k", k_new), ("v", v_new)):   # None, a number: no shape to speak of
            if x is None or isinstance(x, (numbers.Number, str, bytes)):
                raise TypeError(f"KVCache.{what} takes k, v arrays (batch={b}, rows, kv_heads={hkv}, "
                                f"headdim={d}); {name} is {type(x).__name__}")
            if isinstance(x, np.ma.MaskedArray):
                raise TypeError(f"KVCache.{what}: {name} is a numpy.ma.MaskedArray, whose mask the "
                                f"cache would drop (storing the masked rows too): pass only the "
                                f"rows to keep, as a plain array")
        k_new, v_new = xp.asarray(k_new), xp.asarray(v_new)
        if k_new.ndim != 4 or tuple(k_new.shape) != tuple(v_new.shape) or \
                (k_new.shape[0], k_new.shape[2], k_new.shape[3]) != (b, hkv, d):
            swapped = k_new.ndim == 4 and (k_new.shape[0], k_new.shape[1], k_new.shape[3]) == (b, hkv, d) \
                and k_new.shape[2] != hkv
            raise ValueError(f"KVCache.{what} takes k, v of shape (batch={b}, rows, kv_heads={hkv}, "
                             f"headdim={d}); got {tuple(k_new.shape)} and {tuple(v_new.shape)}" +
                             ("; are they (batch, kv_heads, rows, headdim)? Pass k.transpose(1, 2), "
                              "v.transpose(1, 2)" if swapped else ""))
        rows = []
        for name, x in (("k", k_new), ("v", v_new)):
            if not _real(x.dtype):
                raise TypeError(f"KVCache.{what} takes k, v of real numbers to store as {self.dtype}; "
                                f"{name} is {x.dtype}")
            rows.append(x if np.can_cast(x.dtype, self.dtype, "safe") else
                        self._cast_in_range(what, name, x, xp))
        return tuple(rows)

    def _cast_in_range(self, what: str, name: str, x, xp):
        """`x` cast to the cache's dtype (the cast the store would make), or ValueError if a
        finite value of `x` turns inf there. One finiteness pass over the cast rows (on a GPU
        the host waits for it); the rows are read again only where it finds a non-finite."""
        with np.errstate(over="ignore", invalid="ignore"):   # NumPy's warning on the cast
            cast = x.astype(self.dtype)
            if bool(xp.isfinite(cast).all()):
                return cast
            overflows = xp.isfinite(x) & ~xp.isfinite(cast)
            if not bool(overflows.any()):                    # inf or NaN given as such
                return cast
            largest = xp.abs(x[overflows]).max()
        raise ValueError(f"KVCache.{what}: {name} holds values beyond {self.dtype}'s range "
                         f"(|{name}| up to {largest!s}; {self.dtype} reaches "
                         f"{float(finfo(self.dtype).max):.9g}): stored, they would be inf, and "
                         f"decode would return inf or NaN: scale them, or make the cache of a "
                         f"wider dtype (KVCache(..., dtype=...))")

    def _rows_stream(self, rows):
        """On a GPU cache, `arrays.torch_stream` of the rows (CUDA torch tensors are copied on
        torch's current stream); a no-op on the host."""
        return torch_stream(rows) if self.group.ops.device == "cuda" else contextlib.nullcontext()

    def append(self, k_new, v_new) -> None:
        """Add rows (batch, T, kv_heads, headdim), the same on every rank: row t of batch row b
        lands on the rank holding fewest rows of b then. Rows `burstcu.shard` cut for several
        ranks (a rank's own rows, which `from_prefill` takes), rows of another shape or not of
        real numbers (`_check_rows`), or a cache with no room for them, raise ValueError/TypeError
        before anything is stored, on every rank given the same rows (No communication: a rank
        given other rows raises alone, so an error left uncaught ends the job, `raising_alike`;
        rows that differ between ranks beyond rounding are refused by the next decode, on every
        rank, which compares TOKENS_COMPARED tokens of each of the first APPENDS_COMPARED appends
        since the last decode that passed, until `clear` empties their batch rows).
        Rows that are CUDA torch tensors are copied on torch's current stream, as
        `burstcu.torch.decode` reads there."""
        wait_computed((k_new, v_new))
        with Call(self.group, "KVCache.append") as call, self._rows_stream((k_new, v_new)):
            with call.raising_alike():    # every rank sees the same counts and shapes
                for name, x in (("k_new", k_new), ("v_new", v_new)):
                    held = cut_of(x)
                    if held is not None and held[0][0] == "rows" and held[0][3] not in (None, 1):
                        raise ValueError(
                            f"KVCache.append: {name} is one rank's shard of {held[0][3]} (as "
                            f"burstcu.shard cut it), but append takes rows that are the same on "
                            f"every rank (a new token's keys and values) and stores each row on one "
                            f"rank; give a rank's own rows of a prefill to from_prefill (if these "
                            f"rows are right, pass a view, {name}[:]: the memory is of this array "
                            f"object)")
                k_new, v_new = self._check_rows("append", k_new, v_new)
                counts = self.counts.copy()
                owners = []
                for t in range(k_new.shape[1]):
                    for b in range(counts.shape[1]):
                        owner = int(np.argmin(counts[:, b]))
                        owners.append((t, b, owner, int(counts[owner, b])))
                        counts[owner, b] += 1
                full = self._full(counts)
                if full:
                    raise ValueError(full)
                sample = self._sample(k_new, v_new)
            with self._pages_restored_on_error():
                for t, b, owner, row in owners:
                    if owner == self.group.rank:
                        self._store(b, row, k_new[b, t], v_new[b, t])
            self.counts = counts
            if sample is not None:
                self._appended.append(sample)

    def _sample(self, k_new, v_new) -> tuple | None:
        """(k, v, tokens): copies of TOKENS_COMPARED of the rows' tokens in the cache's dtype,
        for the next decode to compare across ranks; None on one rank, for device arrays (read
        only with a sync) and past APPENDS_COMPARED appends since the last decode."""
        if self.group.size == 1 or len(self._appended) >= APPENDS_COMPARED or \
                not isinstance(k_new, np.ndarray):
            return None
        t = k_new.shape[1]
        if t <= TOKENS_COMPARED:     # a token a call, as decoding appends: every one, copied
            return k_new.astype(self.dtype), v_new.astype(self.dtype), range(t)
        tokens = np.unique(np.linspace(0, t - 1, TOKENS_COMPARED).round().astype(int))
        return (k_new[:, tokens].astype(self.dtype, copy=False),
                v_new[:, tokens].astype(self.dtype, copy=False), tokens)

    def appends_compared(self, count: int) -> None:
        """The first `count` appends' samples were compared by a decode: forgotten."""
        del self._appended[:count]

    def from_prefill(self, k_local, v_local) -> None:
        """Adopt this rank's shard of a prefill (B, S_local, kv_heads, headdim), as a sharded
        `attention` holds it (any layout: decode needs no order); replaces what the cache held.
        Collective: the ranks learn each other's S_local in one round. Rows `burstcu.shard` cut
        for another number of ranks than the cache's group (the group left out) raise ValueError
        on every rank; the same rows on every rank (the global arrays passed instead of each
        rank's shard) warn (`burstcu.SameShardsWarning`)."""
        wait_computed((k_local, v_local))
        with Call(self.group, "KVCache.from_prefill") as call, self._rows_stream((k_local, v_local)):
            err = None
            try:
                cut = cache_cut_problem(("k_local", "v_local"), (k_local, v_local), self.group.size)
                k_local, v_local = self._check_rows("from_prefill", k_local, v_local)
                if cut is not None:
                    err = InputError(ValueError, f"KVCache.from_prefill: {cut}")
                elif k_local.shape[1] > self.capacity:
                    err = InputError(ValueError, f"KVCache.from_prefill: {k_local.shape[1]} rows "
                                                 f"exceed the capacity {self.capacity} a rank")
                elif self.paged and self.batch * -(-k_local.shape[1] // self.page_size) > self.num_pages:
                    err = InputError(ValueError, f"KVCache.from_prefill: {k_local.shape[1]} rows a "
                                                 f"batch row exceed the {self.num_pages} pages of "
                                                 f"{self.page_size} rows a rank")
            except Exception as exc:  # noqa: BLE001 - whatever fails here fails on every rank
                err = InputError(exc.__class__, f"KVCache.from_prefill cannot take these rows: "
                                       f"{exc.__class__.__name__}: {exc}")
            with call.raising_together():
                reports = agree(self.group.transport, err, None, "KVCache.from_prefill",
                                None if err else (int(k_local.shape[1]),
                                                   first_rows_digest(k_local) if k_local.shape[1] else None))
            warn_if_all_the_same([digest for _, digest in reports], "k_local")
            lengths = [n for n, _ in reports]
            n = int(k_local.shape[1])
            if self.paged:   # the whole table replaced: put back whole if a store raises
                saved = self.page_table.copy(), list(self._free)
                try:
                    self._prefill_pages(k_local, v_local)
                except BaseException:
                    self.page_table[...], self._free, self._table_dev = saved[0], saved[1], None
                    raise
            else:
                self.k[:, :n] = k_local
                self.v[:, :n] = v_local
            self.counts = np.repeat(np.asarray(lengths, np.int64)[:, None], self.batch, axis=1)
            self._appended = []

    def _prefill_pages(self, k_local, v_local) -> None:
        """Rows (B, n, Hkv, D) into fresh pages: batch row b takes pages b * ceil(n / P) on."""
        b, n = k_local.shape[:2]
        per_row, ps = -(-n // self.page_size), self.page_size
        self.page_table[:] = -1
        self.page_table[:, :per_row] = np.arange(b * per_row, dtype=np.int32).reshape(b, per_row)
        self._free = list(range(b * per_row, self.num_pages))
        self._table_dev = None
        xp = self.group.ops.xp
        flat_k = self.k.reshape((-1,) + tuple(self.k.shape[2:]))
        flat_v = self.v.reshape((-1,) + tuple(self.v.shape[2:]))
        j = np.arange(n)
        for bi in range(b):
            index = xp.asarray(self.page_table[bi, j // ps].astype(np.int64) * ps + j % ps)
            flat_k[index] = k_local[bi]
            flat_v[index] = v_local[bi]

    def rows(self) -> tuple:
        """(k, v) as the decode kernels read them: the arrays, or PagedRows of a paged cache."""
        if not self.paged:
            return self.k, self.v
        if self._table_dev is None:
            self._table_dev = self.group.ops.xp.asarray(self.page_table)
        return tuple(PagedRows(x, self._table_dev, self.page_table) for x in (self.k, self.v))

    def decode(self, q, *, softmax_scale: float | None = None, return_lse: bool = False):
        """`burstcu.decode(q, self.k, self.v, self.group, cache_seqlens=self.seqlens, ...)`, with
        the ranks also agreeing on every rank's counts (appends given different rows on some
        rank would make them differ: an error on every rank, not a silently wrong cache)."""
        return api.decode(q, self, softmax_scale=softmax_scale, return_lse=return_lse)

    def decode_arguments(self) -> tuple:
        """(k, v, group, this rank's seqlens, {values every rank must hold alike}, rows, appended)
        that `burstcu.decode` takes from a cache: k, v (batch, capacity, Hkv, D) for the checks
        (stand-ins without memory when paged), rows: `rows()`, what the kernels read, appended:
        samples of the rows appended since the last decode, which it compares across ranks and
        then forgets (`appends_compared`)."""
        appended = tuple(self._appended)
        agreed = {} if self.group.size == 1 else {   # the key and value read as the message says
            "the KV cache's rows (every rank appends and clears the same rows)":
                f"{int(self.counts.sum())} rows, counts sha1 "
                f"{hashlib.sha1(self.counts.tobytes()).hexdigest()[:16]}"}
        k, v = self._views if self.paged else (self.k, self.v)
        return k, v, self.group, self.seqlens, agreed, self.rows(), appended
