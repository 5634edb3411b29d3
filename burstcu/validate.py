"""Input checks that fail on every rank, before any communication that could hang.

Each rank first checks its own arrays *without raising*; then one small `allgather_object`
carries (error or None, metadata) from every rank; then every rank raises the same kind of error
if any rank found a problem or if the ranks disagree. A lone rank raising before the others
reached a collective would leave them waiting forever, so nothing raises before that exchange.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import numbers
import re
import sys
import threading
import warnings
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import numpy as np

from .blockmask import BlockMask
from .cpu_tensors import host_view
from .layout import LAYOUTS, Partition, partition
from .ops.base import (accum_dtype, caller_stacklevel, dtype_name, finfo, not_the_users_files,
                       users_file_name)

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class InputError:
    """A deferred error: the exception type and message, raised on every rank after the
    agreement round. The type is one of KINDS (a subclass is taken as the kind it derives from;
    anything else as TypeError), since it crosses ranks by name: `plain()` is what travels
    (`burstcu.transport.wire` carries plain values only), `from_plain` makes it again."""

    KINDS = (MemoryError, ValueError, TypeError)

    def __init__(self, kind: type[BaseException], message: str, own_data: bool = False):
        self.kind = next((k for k in self.KINDS if issubclass(kind, k)), TypeError)
        self.message = message
        # the message speaks of this rank's own data (its rows): `agree` names the rank even
        # where every rank has such an error (theirs are of other data)
        self.own_data = own_data

    def plain(self) -> tuple[str, str]:
        return (self.kind.__name__, self.message)

    def exception(self, rank: int | None = None) -> BaseException:
        """The exception to raise once every rank knows of this error (`rank`: the rank it is
        from, named in the message), marked agreed: `burstcu.group.Call` lets an agreed
        MemoryError end only the call, as it does every ValueError and TypeError."""
        exc = self.kind(self.message if rank is None else f"rank {rank}: {self.message}")
        exc.burstcu_agreed = True
        return exc

    @classmethod
    def from_plain(cls, plain) -> "InputError":
        """The error a peer sent as `plain()`; a kind of another name is a ValueError."""
        name, message = plain
        return cls(next((k for k in cls.KINDS if k.__name__ == name), ValueError), str(message))


def misread_array_problem(name: str, x: Any) -> InputError | None:
    """A TypeError for a NumPy array burstcu would misread: a numpy.ma.MaskedArray (its data
    would be taken and its mask dropped), or one stored in the other byte order (its dtype has
    the same name, so the ranks' agreement, the accumulation dtype and the kernels would each
    take it for a native array)."""
    if isinstance(x, np.ma.MaskedArray):
        return InputError(TypeError, f"{name} is a numpy.ma.MaskedArray: burstcu would read its "
                                     f"data and ignore its mask. Pass {name}.filled(0) (or "
                                     f"np.ma.getdata({name})) and say which keys a query may see "
                                     f"with causal, window_size or cu_seqlens")
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        return InputError(TypeError, f"{name} is stored in non-native byte order ({x.dtype.str}): "
                                     f"pass {name}.astype({name}.dtype.newbyteorder('='))")
    return None


def _check_array(name: str, x: Any, ndim: int, array_types: tuple,
                 dtypes: tuple | None = FLOAT_DTYPES) -> InputError | None:
    """x's array type (a masked or byte-swapped array is refused: `misread_array_problem`),
    number of dimensions and (unless `dtypes` is None) dtype."""
    misread = misread_array_problem(name, x)
    if misread is not None:
        return misread
    if not isinstance(x, array_types):
        allowed = " or ".join(f"{t.__module__}.{t.__name__}" for t in array_types)
        return InputError(TypeError, f"{name} must be a {allowed}, got {type(x).__module__}.{type(x).__name__}")
    if x.ndim != ndim:
        return InputError(ValueError, f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and dtype_name(x) not in dtypes:
        return InputError(TypeError, f"{name} has dtype {dtype_name(x)}; supported: {', '.join(dtypes)}")
    return None


def check_attention_inputs(q, k, v, *, array_types: tuple, dtypes: tuple, layout: str,
                           softmax_scale, op_rule=None) -> InputError | None:
    """Local checks of q (B,S,H,D), k, v (B,S,Hkv,D). Returns the first problem, or None."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        err = _check_array(name, x, 4, array_types, dtypes=None)   # the backend's dtypes below
        if err:
            return err
    if layout not in LAYOUTS:
        return InputError(ValueError, f"layout must be one of {LAYOUTS}, not {layout!r}")
    if not (dtype_name(q) == dtype_name(k) == dtype_name(v)):
        return InputError(TypeError, f"q, k, v dtypes differ: {dtype_name(q)}, {dtype_name(k)}, {dtype_name(v)}")
    if dtype_name(q) not in dtypes:
        return InputError(TypeError, f"this backend supports dtypes {', '.join(dtypes)}; got {dtype_name(q)}")
    if tuple(k.shape) != tuple(v.shape):
        return InputError(ValueError, f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
    b, s, h, d = q.shape
    bk, sk, hkv, dk = k.shape
    if bk != b:
        return InputError(ValueError, f"q has batch {b}, k and v have batch {bk}")
    if sk != s:
        swapped = f"; {SWAPPED_AXES}" if sk > 0 and h == hkv and s % sk == 0 else ""   # GQA (B, H, S, D)
        return InputError(ValueError, f"q has local seqlen {s}, k and v have {sk}: lengths must "
                                      f"match{swapped}")
    if dk != d:
        return InputError(ValueError, f"q has head dim {d}, k and v have {dk}")
    if s < 1 and min(b, h, d, hkv) >= 1:
        return InputError(ValueError, f"q {tuple(q.shape)} holds no rows: every rank must hold at "
                                      f"least one row of the sequence (uneven shards too)")
    if min(b, s, h, d, hkv) < 1:
        return InputError(ValueError, f"empty dimension in q {tuple(q.shape)} or k {tuple(k.shape)}")
    if h % hkv:
        return InputError(ValueError, f"q has {h} heads, k has {hkv}: nheads must be a multiple of nheads_kv")
    if softmax_scale is not None and not _finite_real(softmax_scale):
        return scale_problem(softmax_scale)
    if op_rule is not None:  # what this backend's local op cannot take (head dim, sizes)
        problem = op_rule(q, k)
        if problem:
            return InputError(ValueError, problem)
    return None


def scale_problem(softmax_scale) -> InputError:
    """Why `softmax_scale` (not a finite real number) is refused: a 0-d tensor or JAX array is
    not a number here (the scale is a constant of the call, not differentiable)."""
    if isinstance(softmax_scale, (bool, np.bool_)):
        return InputError(TypeError, f"softmax_scale must be a number, not a bool ({softmax_scale!r}): "
                                     f"the scale multiplies the scores (None: 1/sqrt(headdim))")
    if isinstance(softmax_scale, numbers.Real):
        return InputError(ValueError, f"softmax_scale must be a finite number, got {softmax_scale!r}")
    return InputError(TypeError, f"softmax_scale must be a Python or NumPy number (a constant of "
                                 f"the call, not differentiable), got {type(softmax_scale).__name__}"
                                 f" {softmax_scale!r}: pass float(scale)")


def _finite_real(x) -> bool:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    try:
        return math.isfinite(float(x))
    except (OverflowError, ValueError):
        return False


def resolve_scale(softmax_scale, headdim: int) -> float:
    """The softmax scale a call uses: the given one, or 1/sqrt(headdim)."""
    return 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)


def check_backward_inputs(dout, out, lse, q, *, array_types: tuple) -> InputError | None:
    """Local checks of dout, out (like q) and lse (B, H, S) for `attention_backward`."""
    for name, x in (("dout", dout), ("out", out)):
        err = _check_array(name, x, 4, array_types)
        if err:
            return err
        if tuple(x.shape) != tuple(q.shape):
            return InputError(ValueError, f"{name} has shape {tuple(x.shape)}, q has {tuple(q.shape)}")
        if dtype_name(x) != dtype_name(q):
            return InputError(TypeError, f"{name} has dtype {dtype_name(x)}, q has {dtype_name(q)}")
    return _check_lse(lse, q, array_types)


_PASS_LSE = "pass the lse that attention(..., return_lse=True) returned"


def _check_lse(lse, q, array_types: tuple) -> InputError | None:
    """lse exactly as `attention(..., return_lse=True)` returns it for q (B, S, H, D): shape
    (B, H, S), dtype float32 (float64 for float64 q) — the backward reads it as that."""
    err = _check_array("lse", lse, 3, array_types, dtypes=None)
    if err:
        return err
    want = accum_dtype(q.dtype).name
    if dtype_name(lse) != want:
        return InputError(TypeError, f"lse has dtype {dtype_name(lse)}; attention returns {want} lse "
                                     f"for {dtype_name(q)} inputs: {_PASS_LSE}")
    b, s, h, _ = q.shape
    if tuple(lse.shape) != (b, h, s):
        return InputError(ValueError, f"lse must have shape (batch, nheads, seqlen_local) = {(b, h, s)}, "
                                      f"got {tuple(lse.shape)}: {_PASS_LSE}")
    return None


def check_flags(**flags) -> InputError | None:
    """A TypeError naming the first flag (e.g. causal=..., return_lse=...) whose value is not a
    bool — Python's or NumPy's — else None. Without it `causal="no"` would read as True."""
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            return InputError(TypeError, f"{name} must be True or False, got {value!r} "
                                         f"({type(value).__name__})")
    return None


def check_window(window_size, causal: bool, supported: bool) -> InputError | None:
    """A clear error unless window_size is (left, right), each an int from -1 to 2^62 (-1: unbounded),
    with right 0 or -1 under causal (flash-attn's convention), and the local op can mask it."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        return InputError(ValueError, f"window_size must be (left, right), got {window_size!r}")
    for name, value in (("left", left), ("right", right)):
        if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                or not -1 <= value <= MAX_POSITION):
            return InputError(ValueError, f"window_size {name} must be an int from -1 (-1: "
                                          f"unbounded) to 2^62 (a window past every position "
                                          f"is unbounded too), got {value!r}")
    if causal and right not in (0, -1):
        return InputError(ValueError, f"with causal=True the window's right bound is the diagonal: "
                                      f"window_size=({left}, 0) or ({left}, -1), not {window_size!r}")
    if (left, right) != (-1, -1) and not supported:
        return InputError(ValueError, "window_size is not supported by the CUDA kernels yet: use "
                                      "the NumPy backend, or window_size=(-1, -1)")
    return None


def axis_problem(axis, ndim: int, name: str) -> InputError | None:
    """Why `axis` names no axis of an array `name` of `ndim` dimensions (negative ones count
    from the end, as NumPy's): TypeError for one not an int, ValueError for one out of range."""
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        return InputError(TypeError, f"axis must be an int, got {axis!r} ({type(axis).__name__})")
    if not -ndim <= axis < ndim:
        return InputError(ValueError, f"axis {axis} is out of range for {name} of {ndim} dimensions")
    return None


def check_axis(axis, ndim: int, name: str) -> int:
    """`axis` as an index from 0, or the exception `axis_problem` names."""
    err = axis_problem(axis, ndim, name)
    if err is not None:
        raise err.exception()
    return int(axis) % ndim


def check_block_mask(block_mask, causal: bool, window_size, docs,
                     supported: bool) -> InputError | None:
    """A block mask must be a `burstcu.BlockMask`, given alone (it says the whole mask: no
    causal, window or documents beside it), to a local op that honours window bounds."""
    if block_mask is None:
        return None
    if not isinstance(block_mask, BlockMask):
        return InputError(TypeError, f"block_mask must be a burstcu.BlockMask(q_ranges, k_ranges, "
                                     f"kinds), got {type(block_mask).__name__}")
    if causal or docs is not None or [int(w) for w in window_size] != [-1, -1]:
        return InputError(ValueError, "block_mask is the whole mask: give it without causal, "
                                      "window_size or cu_seqlens (a rectangle's kind says causal; "
                                      "documents are rectangles of their own)")
    if not supported:
        return InputError(ValueError, "this backend's local op cannot take block masks")
    return None


def check_block_mask_extent(block_mask, seqlen_global: int,
                            max_positions: int | None = None) -> InputError | None:
    """Every range of a block mask must lie inside the global sequence [0, N); on a local op
    addressing max_positions, N at most a quarter of them (a block mask's Blocks carry positions
    up to twice their longer side and left bounds up to the sum of their sides:
    `burstcu.layout.rectangles`)."""
    if block_mask is None:
        return None
    if block_mask.extent > seqlen_global:
        return InputError(ValueError, f"block_mask reaches position {block_mask.extent - 1} but "
                                      f"the ranks hold {seqlen_global} positions in all")
    if max_positions is not None and 4 * seqlen_global > max_positions:
        return InputError(ValueError, f"a block mask over {seqlen_global} positions: this "
                                      f"backend's kernels take block masks over at most "
                                      f"{max_positions // 4} positions")
    return None


def host_ints(x) -> np.ndarray:
    """x (a list, NumPy, CuPy, PyTorch or JAX array of ints) as a NumPy array on the host."""
    if type(x).__module__.split(".")[0] == "cupy":
        return x.get()
    if hasattr(x, "cpu") and callable(x.cpu):          # torch tensors, wherever they live
        x = x.cpu()
    return np.asarray(x)


# boundaries beyond this are refused before any arithmetic (no int64 wrap-around)
MAX_POSITION = 2**62


def parse_cu_seqlens(cu_seqlens):
    """(InputError or None, docs): what a rank can check of cu_seqlens alone. docs is None
    without documents, else the boundaries as a tuple of ints with empty documents dropped.
    cu_seqlens must be a 1-D integer array 0 = b_0 <= b_1 <= ... <= b_n = N (flash-attn's
    convention); that b_n is the global length N is checked once the ranks' lengths are known
    (`check_docs_total`)."""
    if cu_seqlens is None:
        return None, None
    try:
        cu = host_ints(cu_seqlens)
    except Exception as exc:  # noqa: BLE001 - any array type that cannot come to the host
        return InputError(TypeError, f"cu_seqlens must be an integer array, cannot read it: "
                                     f"{exc.__class__.__name__}: {exc}"), None
    if cu.ndim != 1 or cu.size < 2:   # (first: an empty list comes as float64)
        return InputError(ValueError, f"cu_seqlens must be 1-D with at least 2 boundaries, got "
                                      f"shape {tuple(cu.shape)}"), None
    if not np.issubdtype(cu.dtype, np.integer):
        return InputError(TypeError, f"cu_seqlens must hold integers, got {cu.dtype}"), None
    if (cu < 0).any() or (cu > MAX_POSITION).any():
        return InputError(ValueError, "cu_seqlens must lie in [0, N] (N: the global sequence "
                                      "length, the ranks' local lengths added up)"), None
    if int(cu[0]) != 0:
        return InputError(ValueError, f"cu_seqlens must start at 0, got {int(cu[0])}"), None
    cu = cu.astype(np.int64)                       # in [0, 2^62]: no overflow now
    steps = np.diff(cu)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        return InputError(ValueError, f"cu_seqlens must not decrease: b[{i}] = {int(cu[i])} > "
                                      f"b[{i + 1}] = {int(cu[i + 1])}"), None
    docs = [0] + [int(b) for b, step in zip(cu[1:], steps) if step > 0]
    return None, tuple(docs)


def check_docs_total(docs, seqlen_global: int, size: int = 1) -> InputError | None:
    """cu_seqlens (parsed) must end at the global sequence length. With `size` ranks whose
    lengths add up to size times the documents' end, each rank holds all of them: the global
    array passed on every rank, which the message says."""
    if docs is not None and docs[-1] != seqlen_global:
        hint = ""
        if size > 1 and seqlen_global == size * docs[-1]:
            hint = (f": the {size} ranks hold {size} x {docs[-1]} rows, so each holds the whole "
                    f"sequence: pass each rank its shard (burstcu.shard; packed (T, H, D) arrays "
                    f"with axis=0: its default axis 1 cuts their heads), not the global array")
        return InputError(ValueError, f"cu_seqlens must end at the global sequence length "
                                      f"N = {seqlen_global} (the ranks' local lengths added up), "
                                      f"got {docs[-1]}{hint}")
    return None


def uneven_problem(layout: str, uneven) -> str | None:
    """Why `uneven` does not go with `layout`, or None: uneven shards are contiguous ones."""
    if uneven and layout != "contiguous":
        return (f"uneven=True describes contiguous shards of other lengths; layout='{layout}' cuts "
                f"its own shards (burstcu.shard makes them): leave uneven out")
    return None


def partition_of(layout: str, lengths, docs, uneven: bool | None = False,
                 max_positions: int | None = None) -> tuple[InputError | None, Partition | None]:
    """(InputError or None, the Partition) of the ranks' local `lengths` under `layout` with
    documents `docs` (parsed cu_seqlens or None) — the same verdict on every rank, which all
    know the lengths after the agreement round. Contiguous shards are near-equal (lengths
    differing by at most one, as `burstcu.shard` cuts them) unless `uneven` says the ranks hold
    other lengths on purpose (so one rank passing the global array is an error, not a silently
    other sequence); zigzag and "documents" ones must be the ones `burstcu.shard` cuts (each
    document in 2G pieces, or the short ones whole), and `uneven` with them is refused. uneven
    None: the call has no such option (linear attention), so the refusal does not offer it.
    max_positions: the most positions the local op can address (the kernels: 2^30)."""
    lengths = tuple(int(n) for n in lengths)
    size, total = len(lengths), sum(lengths)
    if (mixed := uneven_problem(layout, uneven)) is not None:
        return InputError(ValueError, mixed), None
    err = check_docs_total(docs, total, size)
    if err:
        return err, None
    if max_positions is not None and total > max_positions:
        return InputError(ValueError, f"the global sequence length N = {total} exceeds the "
                                      f"{max_positions} positions the CUDA kernels address"), None
    hint = ""
    most = max(lengths)
    whole = [r for r, n in enumerate(lengths) if n == most]            # the global array's?
    others = [n for n in lengths if n != most]
    if others and all(most // size - 1 <= n <= -(-most // size) + 1 for n in others):
        said = f"rank {whole[0]} holds" if len(whole) == 1 else \
            f"ranks {', '.join(map(str, whole))} hold"
        hint = (f" ({said} {most} rows and every other rank about 1/{size} of that: did "
                f"{'it' if len(whole) == 1 else 'they'} pass the global array instead of "
                f"{'its shard' if len(whole) == 1 else 'their shards'}? "
                f"see burstcu.shard)")   # (the others' rows near its G-th part, as shard cuts them)
    if layout == "contiguous":
        if not uneven and max(lengths) - min(lengths) > 1:
            offer, masks = ("; pass uneven=True if the ranks hold these lengths on purpose",
                            ", or with block_mask ones balanced for it") if uneven is not None else \
                ("; this call takes near-equal shards only", "")
            return InputError(ValueError, f"contiguous shards of {lengths} rows differ by more "
                                          f"than one row (burstcu.shard cuts near-equal ones"
                                          f"{masks}){offer}{hint}"), None
        return None, partition(layout, size, total, lengths=lengths)
    want = partition(layout, size, total, docs).lengths
    if lengths != want:
        what = "these documents" if docs is not None else "no documents"
        return InputError(ValueError, f"layout='{layout}' over {size} ranks cuts N = {total} "
                                      f"with {what} into shards of {want} rows (burstcu.shard "
                                      f"makes them); got {lengths}{hint}"), None
    return None, partition(layout, size, total, docs)


def docs_digest(docs) -> str | None:
    """What ranks agree on for cu_seqlens: its length and a hash (not the whole list)."""
    if docs is None:
        return None
    return f"{len(docs) - 1} documents, sha1 {hashlib.sha1(np.asarray(docs, np.int64).tobytes()).hexdigest()[:16]}"


# attention_backward(check=True): a row's sum of P is 1 within t = ROW_SUM_TOL plus ROW_SUM_ULPS
# ulps (of the accumulation dtype) times max(1, |lse|), and above 1 up to e^t (P = exp(score -
# lse) moves by a few ulps of the score and of lse, which grow with them: t is that error in the
# exponent, e^t what it makes of a sum; docs/numerics.md, "Very large logits")
ROW_SUM_TOL = 1e-3
ROW_SUM_ULPS = 64


def check_row_sums(lse, row_sums, sees=None) -> InputError | None:
    """A ValueError unless every row's sum of the recomputed P over the keys is within
    [1 - t, e^t] for t = ROW_SUM_TOL + ROW_SUM_ULPS ulps x max(1, |lse|) (in float32, past |lse|
    ~1.3e5 every sum from 0 to 1 passes, so an lse too large by any amount; past ~1.2e7 every
    finite sum, past ~9.3e7, where e^t overflows, inf too), and exactly 0 for rows that see no
    key:
    else lse is not the forward's for these inputs and options. lse, row_sums: (B, H, S), NumPy
    or CuPy. sees: (S,) bool, whether each local row sees a key under the backward's mask (a
    row with lse = -inf there has P = 0 by fiat, so its sum alone cannot tell); None: the rows
    with a finite lse. The message names no rank: `agree` names the one it comes from (its
    `own_data`)."""
    lse_h, sums = (np.asarray(x.get() if hasattr(x, "get") else x, dtype=np.float64) for x in (lse, row_sums))
    eps = float(np.finfo(np.asarray(row_sums.dtype.type(0)).dtype).eps)
    saw = lse_h != -np.inf
    sees = saw if sees is None else np.broadcast_to(np.asarray(sees, bool), saw.shape)
    expect = np.where(sees, 1.0, 0.0)
    with np.errstate(invalid="ignore"):
        # a row that saw no key has P = exp(score - inf) = 0 exactly
        size = np.where(np.isfinite(lse_h), np.abs(lse_h), 1.0)
        tol = np.where(sees, ROW_SUM_TOL + ROW_SUM_ULPS * eps * np.maximum(1.0, size), 0.0)
        with np.errstate(over="ignore"):
            upper = np.where(sees, np.exp(tol), 0.0)      # >= 1 + t
        good = (sums >= expect - tol) & (sums <= upper)   # inf only where e^t is: no limit
        bad = ~good | (saw != sees)  # NaN counts as bad
    if not bad.any():
        return None
    b, h, s = (int(i) for i in np.argwhere(bad)[0])
    where = f"batch {b}, head {h}, row {s}"
    if saw[b, h, s] == sees[b, h, s]:
        found = (f"the probabilities recomputed from lse sum to {sums[b, h, s]:.6g} over the keys "
                 f"in {int(bad.sum())} rows, not {expect[b, h, s]:g} (first: {where}, lse "
                 f"{lse_h[b, h, s]:.6g})")
    elif saw[b, h, s]:
        found = (f"lse is finite ({lse_h[b, h, s]:.6g}) at {where}, a row that sees no key under "
                 f"this mask, where the forward's lse is -inf (rows wrong: {int(bad.sum())})")
    else:
        found = (f"lse is -inf at {where}, a row that sees keys under this mask "
                 f"(rows wrong: {int(bad.sum())})")
    return InputError(ValueError, (
        f"attention_backward(check=True): {found}: lse is not the one "
        f"attention(..., return_lse=True) returned for these q, k, v and options (the same "
        f"mask?), or the inputs hold NaN/Inf, or a row's scores overflow (softmax_scale)"),
        own_data=True)


FREE = "S"   # a shape's sequence extent, which ranks need not agree on


def metadata(*arrays, seq_axes=None, **options) -> tuple:
    """What every rank must agree on: shapes, dtypes and options of one call. seq_axes: per
    array, the axis whose extent may differ between ranks (shown as "S"), or None."""
    seq_axes = seq_axes or (None,) * len(arrays)
    shapes = tuple(tuple(FREE if i == axis else int(n) for i, n in enumerate(a.shape))
                   if hasattr(a, "shape") else None for a, axis in zip(arrays, seq_axes))
    dtypes = tuple(dtype_name(a) if hasattr(a, "dtype") else None for a in arrays)
    return (shapes, dtypes, tuple(sorted(options.items())))


_ORIGIN = threading.local()   # .label: who orders this thread's calls, where a framework does


def calling_thread() -> str:
    """The name of the thread making a call, as every rank compares it: the thread's name with
    its numbers dropped ("Thread-7 (train)" -> "Thread (train)", "ThreadPoolExecutor-1_3" ->
    "ThreadPoolExecutor", "Dummy-3" -> "Dummy": ranks count the threads and pools they started
    differently, and a pool's idle workers take turns), or the label of `ordered_by`."""
    label = getattr(_ORIGIN, "label", None)
    return label or re.sub(r"[-_]?\d+", "", threading.current_thread().name)


def thread_problem(what: str, threads: list) -> str | None:
    """Why calls from threads `threads` (`calling_thread`, rank by rank) cannot be one call, or
    None where every rank's is the same."""
    odd = next((r for r, t in enumerate(threads) if t != threads[0]), None)
    if odd is None:
        return None
    seen = f"ranks disagree in {what}: calling thread: rank 0 {threads[0]!r}, rank {odd} " \
           f"{threads[odd]!r}. "
    names = ("Threads are compared by name, numbers dropped: where names differ between ranks "
             "but the calls come in one order, make them inside burstcu.ordered_by(label)")
    if what.startswith("burstcu.init"):
        return (seen + "burstcu.init makes the group whose calls every rank must make in the same "
                "order, and the calls of two threads can reach the ranks in different orders: "
                "call it from a thread of the same name on every rank (the main thread, say). "
                + names)
    return (seen + "A group's calls must reach every rank in the same order, and calls of two "
            "threads can reach the ranks in different orders, pairing one thread's data with "
            "the other's: give each thread its own group (another burstcu.init over the same "
            "ranks: comm=comm.Dup() for MPI), or make the calls from one thread. " + names)


@contextmanager
def ordered_by(label: str):
    """Calls made inside, on this thread, count as coming from `label` where every rank compares
    its calling thread: for calls that reach every rank in the same order from threads whose
    names differ between ranks (JAX's ordered callbacks run on XLA's threads, or inline). Their
    places in the program (`call_site`) are compared from inside it only: for the same calls
    made from different places (a wrapper on one rank, each rank its own program)."""
    outer = getattr(_ORIGIN, "label", None), getattr(_ORIGIN, "frame", None)
    _ORIGIN.label, _ORIGIN.frame = label, sys._getframe(2)   # the frame of the `with` (or wrapper)
    try:
        yield
    finally:
        _ORIGIN.label, _ORIGIN.frame = outer


SITE_FRAMES = 64   # the innermost frames of the program's that a call's place is made of


def call_site() -> tuple:
    """Where in the program this call was made: (code, instruction offset, file name) for each
    frame of the user's code on the stack (`users_file_name`: none of burstcu's, nor of the
    frameworks its adapters go through), outermost first, at most SITE_FRAMES; inside
    `ordered_by`, only the frames called from where it was entered. Its digest (`site_digest`)
    is what ranks compare, its words (`site_words`) what they show."""
    inside, frame = getattr(_ORIGIN, "frame", None), sys._getframe(1)
    not_the_users, site = not_the_users_files(), []
    while frame is not None and frame is not inside and len(site) < SITE_FRAMES:
        code = frame.f_code
        name = users_file_name(code.co_filename, not_the_users)
        if name is not None:
            site.append((code, frame.f_lasti, name))
        frame = frame.f_back
    return tuple(reversed(site))


def site_digest(site: tuple) -> str:
    """A short digest of a `call_site`, what each rank sends in every agreement: each frame by
    its file's name (not its folder: ranks may run copies of the program from different
    folders), its function and its instruction's offset (the line's, cheaper to read)."""
    plain = "\n".join([f"{name}:{code.co_name}:{at}" for code, at, name in site])
    return hashlib.blake2b(plain.encode(), digest_size=8).hexdigest()


def site_words(site: tuple) -> list[list]:
    """A `call_site` as words, outermost first: ["train.py:57 in step", its instruction's offset]
    for each frame (two calls on one line differ in the offset alone)."""
    def line(code, at):
        return next((n for start, end, n in code.co_lines() if start <= at < end), None)

    return [[f"{name}:{line(code, at)} in {code.co_name}", at] for code, at, name in site]


class CallSiteWarning(RuntimeWarning):
    """The ranks made one burstcu call from different places in the program: most likely one
    rank makes a call the others do not (an evaluation on rank 0 alone), which pairs its arrays
    with the others' next call, a wrong result on every rank. The same calls can be made from
    different places (a wrapper on one rank, each rank its own program); then make them inside
    `burstcu.ordered_by(label)` (the places are compared from there in), or
    ``warnings.filterwarnings("ignore", category=burstcu.CallSiteWarning)`` silences it."""


def warn_if_sites_differ(transport, what: str, site: tuple, digests: list) -> None:
    """A CallSiteWarning on every rank, naming where two ranks made the call, when the ranks'
    `site_digest`s differ (`digests`, rank by rank, what every rank was told alike: the round
    that gathers the sites is made by every rank or none). The sites gathered are kept with the
    transport (`Transport.sites_seen`, the same on every rank of its group) by the digests: the
    same difference again (every call of a loop, the warning silenced) costs no round."""
    odd = next((r for r, d in enumerate(digests) if d != digests[0]), None)
    if odd is None:
        return
    seen, key = getattr(transport, "sites_seen", None), (what, tuple(digests))
    sites = None if seen is None else seen.get(key)
    if sites is None:
        sites = transport.allgather_object(site_words(site), f"{what} (the places it was called from)")
        if seen is not None:
            if len(seen) >= 256:   # (every rank of the group empties it at the same call)
                seen.clear()
            seen[key] = sites
    first, other = sites[0], sites[odd]
    same = 0   # the outer frames alike; shown from the first that differs
    while same < min(len(first), len(other)) and first[same] == other[same]:
        same += 1
    one_line = same < min(len(first), len(other)) and first[same][0] == other[same][0]

    def shown(site) -> str:
        frames = [words for words, _ in site[same:]] or \
            ["(no frame of the program's: burstcu's own thread)"]
        return " -> ".join(frames if len(frames) <= 4 else frames[:2] + ["..."] + frames[-2:])

    warnings.warn(
        f"the ranks made this {what} call from different places in the program: rank 0 from "
        f"{shown(first)}; rank {odd} from {shown(other)}"
        f"{' (another call on its first line)' if one_line else ''}. Every rank must make the same "
        f"burstcu calls in the same order: a call one rank makes alone (an evaluation on rank 0, "
        f"say) pairs its arrays with the others' next call (wrong results, no error), and one "
        f"call is left waiting at the end. Where the ranks do make the same calls from different "
        f"places, make them inside burstcu.ordered_by(label), entered where their paths have met "
        f"again, or warnings.filterwarnings('ignore', category=burstcu.CallSiteWarning)",
        CallSiteWarning, stacklevel=caller_stacklevel())


def agree(transport, error: InputError | None, meta: tuple, what: str = "metadata",
          local=None, sites: bool = True) -> list:
    """One collective round; then raise on every rank if any rank failed or ranks disagree
    (the error marked `burstcu_agreed`, `InputError.exception`).
    `what` names the call, so ranks inside different calls fail together too; the calling
    thread (`calling_thread`) is compared too, so calls of two threads that reach the ranks in
    different orders fail rather than pair wrongly. `local`: a value each rank reports without
    agreeing on it (its sequence length); returns every rank's. `sites`: the ranks' places in
    the program are compared last, a CallSiteWarning where they differ (`warn_if_sites_differ`;
    False for the rounds inside a call, and init's)."""
    if transport.size == 1:
        if error:
            raise error.exception()
        return [local]
    thread, site = calling_thread(), call_site() if sites else ()
    gathered = transport.allgather_object(
        (error.plain() if error else None, meta, (local, thread, site_digest(site))), what)
    crossed = thread_problem(what, [t for _, _, (_, t, _) in gathered])
    if crossed is not None:
        raise InputError(ValueError, crossed).exception()
    digests = [d for _, _, (_, _, d) in gathered]
    gathered = [(e, m, value) for e, m, (value, _, _) in gathered]
    if error:   # this rank's own problem, named as its peers name it unless every rank has one
        alike = all(e is not None for e, _, _ in gathered) and not error.own_data
        raise error.exception(rank=None if alike else transport.rank)
    failed = [(r, InputError.from_plain(e)) for r, (e, _, _) in enumerate(gathered) if e is not None]
    if failed:
        r, e = failed[0]
        raise e.exception(rank=r)
    metas = [m for _, m, _ in gathered]
    if any(m != metas[0] for m in metas):
        differing = [r for r, m in enumerate(metas) if m != metas[0]]
        raise InputError(ValueError, f"ranks disagree in {what}: " + _difference(
            metas[0], metas[differing[0]], differing[0], ARRAY_NAMES.get(what), transport.size)).exception()
    warn_if_sites_differ(transport, what, site, digests)
    return [value for _, _, value in gathered]


# the arrays a call's metadata lists, in order, for naming them in a disagreement
ARRAY_NAMES = {"attention": ("q", "k", "v"),
               "attention_backward": ("dout", "q", "k", "v", "out", "lse"),
               "linear_attention": ("q", "k", "v"),
               "linear_attention_backward": ("dout", "q", "k", "v"),
               "decode": ("q", "k_cache", "v_cache")}


def _difference(mine: tuple, theirs: tuple, rank: int, names, size: int) -> str:
    """What differs between rank 0's metadata and `rank`'s, one item each ("causal: rank 0
    False, rank 2 True"), with a hint when a sequence length is G times another's."""
    (shapes0, dtypes0, options0), (shapes1, dtypes1, options1) = mine, theirs
    names = names or tuple(f"array {i}" for i in range(len(shapes0)))
    items, hint = [], ""
    for name, s0, s1, d0, d1 in zip(names, shapes0, shapes1, dtypes0, dtypes1):
        if s0 != s1:
            items.append(f"{name} shape: rank 0 {s0}, rank {rank} {s1}")
            if s0 and s1 and len(s0) == len(s1) > 1 and size > 1 and \
                    size * min(s0[1], s1[1]) == max(s0[1], s1[1]):
                big = 0 if s0[1] > s1[1] else rank
                hint = (f" (rank {big}'s sequence length is {size} times the other's: did it pass "
                        f"the global array instead of its shard? see burstcu.shard)")
        if d0 != d1:
            items.append(f"{name} dtype: rank 0 {d0}, rank {rank} {d1}")
    if len(shapes0) != len(shapes1):
        items.append(f"number of arrays: rank 0 {len(shapes0)}, rank {rank} {len(shapes1)}")
    o0, o1 = dict(options0), dict(options1)
    for key in sorted(set(o0) | set(o1)):
        if o0.get(key) != o1.get(key):
            items.append(f"{key}: rank 0 {o0.get(key)!r}, rank {rank} {o1.get(key)!r}")
    return "; ".join(items or ["their calls differ"]) + hint


# -- how an array was cut: `shard` and `attention` remember it for the host arrays they return ----

_CUTS: dict[int, tuple] = {}   # id(array) -> (weak reference, cut, axis, fingerprint)


def _fingerprint(x, axis: int, dtype=None) -> bytes:
    """A digest of a sample of x's rows along `axis`: the first and last two whole, and 16 spread
    between through a grid of their elements (every (n // 8)-th along each other axis, so the
    cost stays about four rows' whatever the batch): what tells a buffer refilled in place (a
    new batch) from the piece it was when remembered. An edit outside the sample goes
    unseen. dtype: the sample's values cast to it first (what they were, if x is a cast)."""
    rows = x.shape[axis]
    ends = sorted({i for i in (0, 1, rows - 2, rows - 1) if 0 <= i < rows})
    digest = hashlib.blake2b(np.ascontiguousarray(np.take(x, ends, axis=axis), dtype).tobytes(),
                             digest_size=16)
    between = [i for i in range(0, rows, max(1, rows // 16)) if i not in ends]
    if between:
        moved = np.moveaxis(x, axis, 0)
        grid = moved[(slice(None),) + tuple(slice(None, None, max(1, n // 8))
                                            for n in moved.shape[1:])]
        digest.update(np.ascontiguousarray(grid[between], dtype).tobytes())
    digest.update(repr(x.shape).encode())   # reshaped in place (x.shape = ...): another array
    return digest.digest()


def _host(x) -> np.ndarray | None:
    """x's values as a NumPy array, for its fingerprint: a NumPy array itself, a CPU torch tensor
    through a view (`cpu_tensors.host_view`); None for anything else (device arrays, whose rows
    cannot be read without a sync)."""
    if isinstance(x, np.ndarray):
        return x
    try:
        view = host_view(x)
    except Exception:  # noqa: BLE001 - a tensor NumPy cannot view: nothing to remember
        return None
    return view if isinstance(view, np.ndarray) else None


def remember_cut(x, cut: tuple, axis: int) -> None:
    """Remember that the host array object `x` (NumPy, or a CPU torch tensor) is a piece cut as
    `cut` along `axis`: ("rows", layout, documents, ranks) (a shard, or a result whose rows are
    a shard's; layout None: the number of ranks alone is known) or ("lse", the call's
    `mask_options`, whether its sequence is sharded over ranks, the `call_marks` of its q, k, v
    and out) (its sequence axis `axis`). Kept while `x`
    lives and holds the same sampled rows (`_fingerprint`); device arrays and arrays that take
    no weak reference are not remembered."""
    import weakref

    host = _host(x)
    if host is None or host.ndim == 0:
        return
    key = id(x)
    try:
        ref = weakref.ref(x, lambda _, key=key: _CUTS.pop(key, None))
    except TypeError:
        return
    _CUTS[key] = (ref, cut, axis, _fingerprint(host, axis))


# id of a KVCache's `k` or `v`: (a weak reference to that array, one to its cache); and the
# caches' arrays' spans, for `cache_of_array` and `cache_rows_of`: (their (interface, first
# byte), sorted; their (end, held, memory)), replaced whole when a cache is made (dead ones pruned
# then, now and again: a weak reference's callback, which the garbage collector may run inside
# any of this, never touches them)
_CACHE_ARRAYS: dict[int, tuple] = {}
_SPANS: tuple = ((), ())
_SPANS_LOCK = threading.Lock()
_SPANS_DEAD = 0      # cache arrays that died since the spans were last pruned (a hint)
# a copy of a cache's rows made on the way into a call (burstcu.torch's): id -> (ref, rows)
_CARRIED_ROWS: dict[int, tuple] = {}


def remember_cache_arrays(cache) -> None:
    """Remember `cache.k`, `cache.v` (a `burstcu.KVCache`'s arrays) as the cache's, by object and
    by memory, for `cache_of_array` and `cache_rows_of` (arrays that take no weak reference are
    not remembered)."""
    import weakref

    for x in (cache.k, cache.v):
        key, where = id(x), _memory(x)

        def forget(_, key=key):
            global _SPANS_DEAD
            _SPANS_DEAD += 1
            _CACHE_ARRAYS.pop(key, None)
        try:
            ref = weakref.ref(x, forget)
        except TypeError:
            continue
        held = _CACHE_ARRAYS[key] = (ref, weakref.ref(cache))
        if where is not None:
            end = where[1] + sum((n - 1) * step for n, step in zip(where[2], where[3])) + where[4]
            _add_span(where[:2], (end, held, where))


def _add_span(start: tuple, span: tuple) -> None:
    """`span` among `_SPANS` at `start`, in place of the spans that start inside it (dead: live
    arrays never overlap, so the one a view's first byte bisects to is the array it lies in),
    the dead ones left out once they may be half of them. Built outside the lock, which is held
    only to swap the whole (nothing allocated under it: a collection there could run a __del__
    that makes a cache, on this very thread); built again where another swap came first."""
    global _SPANS, _SPANS_DEAD
    while True:
        seen = _SPANS
        starts, spans = list(seen[0]), list(seen[1])
        pruned = 2 * _SPANS_DEAD > len(starts)
        if pruned:
            kept = [(s, t) for s, t in zip(starts, spans) if t[1][0]() is not None]
            starts, spans = [s for s, _ in kept], [t for _, t in kept]
        lo = bisect.bisect_left(starts, start)
        hi = bisect.bisect_left(starts, (start[0], span[0]))
        starts[lo:hi], spans[lo:hi] = [start], [span]
        new = (tuple(starts), tuple(spans))
        with _SPANS_LOCK:
            if _SPANS is seen:
                _SPANS = new
                if pruned:
                    _SPANS_DEAD = 0
                return


def _cache_around(where) -> tuple | None:
    """(cache, its array's memory) of the live cache array whose span holds the first byte of
    `where` (a `_memory`), else None."""
    starts, spans = _SPANS
    if where is None or not starts:
        return None
    i = bisect.bisect_right(starts, where[:2]) - 1
    if i < 0 or starts[i][0] != where[0] or where[1] >= spans[i][0]:
        return None
    _, held, whole = spans[i]
    array, cache = held[0](), held[1]()
    if cache is None or array is None or not (array is cache.k or array is cache.v):
        return None
    return cache, whole


def carry_cache_rows(source, target) -> None:
    """What `cache_rows_of(source)` finds, remembered for `target`: a copy of the same rows made
    on the way into a call (burstcu.torch makes a non-contiguous tensor contiguous)."""
    import weakref

    held = cache_rows_of(source) if target is not source and _SPANS[0] else None
    if held is None:
        return
    key = id(target)
    try:
        _CARRIED_ROWS[key] = (weakref.ref(target, lambda _, key=key: _CARRIED_ROWS.pop(key, None)),
                              weakref.ref(held[0]), held[1:])
    except TypeError:
        pass


def cache_rows_of(x) -> tuple | None:
    """(cache, (b0, b1), (r0, r1)) where x holds whole rows (every kv head, every element) of a
    live unpaged KVCache's `k` or `v`: batch rows b0..b1-1 and rows r0..r1-1 of each, in the
    cache's order (`cache.k[:, :n]`, `cache.k[1:3]`, a torch tensor over them, a copy of them
    `carry_cache_rows` remembered), at least one of each; else None."""
    carried = _CARRIED_ROWS.get(id(x))
    if carried is not None and carried[0]() is x and carried[1]() is not None:
        return (carried[1](), *carried[2])
    where = _memory(x) if _SPANS[0] else None
    found = _cache_around(where)
    if found is None or found[0].paged:
        return None
    (cache, (_, start, whole, _, element)), (_, address, shape, strides, size) = found, where
    if len(shape) != 4 or shape[2:] != whole[2:] or size != element or 0 in shape:
        return None
    steps = tuple(int(np.prod(whole[axis + 1:], dtype=np.int64)) * size for axis in range(4))
    if any(n > 1 and stride != step for n, stride, step in zip(shape, strides, steps)):
        return None
    b0, rest = divmod(address - start, steps[0])
    r0, rest = divmod(rest, steps[1])
    if rest or b0 + shape[0] > whole[0] or r0 + shape[1] > whole[1]:
        return None
    return cache, (b0, b0 + shape[0]), (r0, r0 + shape[1])


def cache_of_array(x):
    """The live KVCache whose `k` or `v` is this very array object (still), or whose memory x
    is, element for element (a view of the whole array: `cache.k[:]`, `torch.from_numpy(cache.k)`,
    a CuPy cache's array as a torch CUDA tensor), else None."""
    held = _CACHE_ARRAYS.get(id(x))
    if held is not None and held[0]() is x and held[1]() is not None \
            and (x is held[1]().k or x is held[1]().v):
        return held[1]()
    where = _memory(x) if _SPANS[0] else None
    found = _cache_around(where)
    return found[0] if found is not None and found[1] == where else None


def _memory(x) -> tuple | None:
    """Where x's elements lie: (memory, address, shape, byte strides, bytes an element) for an
    array that says so through NumPy's or CUDA's array interface (NumPy, CuPy) or a torch tensor
    (its own pointer and strides: no copy), a size-1 axis's stride read as 0 (it steps nowhere);
    None for anything else, or where they cannot be read."""
    try:
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            size = x.element_size()
            memory = "__array_interface__" if x.device.type == "cpu" else "__cuda_array_interface__"
            shape, address = tuple(int(n) for n in x.shape), int(x.data_ptr())
            strides = tuple(int(n) * size for n in x.stride())
        else:
            for memory in ("__array_interface__", "__cuda_array_interface__"):
                face = getattr(x, memory, None)
                if isinstance(face, dict):
                    break
            else:
                return None
            shape, size = tuple(int(n) for n in face["shape"]), int(face["typestr"][2:])
            address, strides = int(face["data"][0]), face.get("strides")
            if strides is None:                        # C-contiguous
                strides, step = [], size
                for n in reversed(shape):
                    strides.insert(0, step)
                    step *= n
            strides = tuple(int(n) for n in strides)
        if len(strides) != len(shape):
            return None
        return memory, address, shape, tuple(0 if n == 1 else st for n, st in zip(shape, strides)), size
    except Exception:  # noqa: BLE001 - an object that cannot say where its elements lie
        return None


def cut_of(x) -> tuple | None:
    """(cut, axis) that `remember_cut` holds for this very array object, unless its sampled rows
    changed since (refilled in place), or None."""
    held = _CUTS.get(id(x))
    if held is None or held[0]() is not x:
        return None
    ref, cut, axis, fingerprint = held
    host = _host(x)
    if host is None or host.ndim <= axis:      # reshaped in place to fewer axes: no cut holds
        return None
    return (cut, axis) if _fingerprint(host, axis) == fingerprint else None


def carry_cut(source, target) -> None:
    """What `source` remembers of its cut, remembered for `target` too: the same values in
    another framework's object (a torch tensor and the NumPy view the call computes on)."""
    held = cut_of(source)
    if held is not None:
        remember_cut(target, *held)


def rows_cut(layout, docs, size: int) -> tuple:
    """A call's rows on `size` ranks as `remember_cut` records them, written so that two cuts
    that place the rows alike by construction are equal: contiguous shards are the same with or
    without documents (they move no row), zigzag and "documents" ones are not (unless the
    documents are one); one rank holds every row in order whatever the layout; shards of another
    number of ranks never place them alike. Zigzag and "documents" stay apart even where they
    happen to place the rows alike (no document, or none short enough): a call naming the other
    is refused. (Lengths are not part of it: uneven shards are checked by the calls
    themselves.)"""
    if not isinstance(size, (int, np.integer)):
        return ("rows", None, None, None)   # not a group (the call says so on every rank): no cut
    if size == 1 or layout == "contiguous" or docs is None or len(docs) <= 2:
        docs = None
    return ("rows", "contiguous" if size == 1 else layout, docs, int(size))


def _said(cut: tuple, other: tuple | None = None) -> str:
    """A cut's layout and documents in words; "without cu_seqlens" where only `other` has them."""
    _, layout, docs, _ = cut
    if docs is None:
        bare = other is not None and other[2] and layout == other[1] != "contiguous"
        return f"layout={layout!r}" + (" without documents (cu_seqlens)" if bare else "")
    return f"layout={layout!r} with cu_seqlens={list(docs)}"


def _axis_problem(name: str, ndim: int, cut_axis: int) -> str:
    """Why an attention call on a group refuses `name`, cut along `cut_axis`."""
    seq, shape = (0, "packed (T, H, D)") if ndim == 3 else (1, "(B, S, H, D)")
    sdpa = (" If the arrays are (B, H, S, D) (SDPA's order), attention takes (B, S, H, D): pass "
            "x.transpose(0, 2, 1, 3) (torch: x.transpose(1, 2)), then shard along axis 1"
            if ndim == 4 and cut_axis == 2 else "")
    hidden = ndim == 3 and cut_axis == 1      # hidden states cut as they should be, not projected
    lead = (" If it holds hidden states (B, S, d_model), your cut along axis 1 is right: project "
            "and reshape them to (B, S, H, D) before attention (cutting them along axis 0 would cut "
            "the batch). If it holds packed rows, cut" if hidden else " Cut")
    return (f"{name} was cut along axis {cut_axis}, but the sequence axis of a {shape} array is {seq}: "
            f"its rows would be taken for a shard of the sequence.{lead} it with "
            f"burstcu.shard(x, group, axis={seq}) (whose default is axis 1), or with a "
            f"burstcu.Sharding: sh.shard(x, axis={seq}) (it finds the axis of packed arrays "
            f"from its documents or lengths, and asks for it without).{sdpa}")


def _ranks_problem(name: str, cut_for: int, size: int) -> str:
    """Why a call on `size` ranks refuses `name`, rows cut for `cut_for` ranks."""
    if cut_for == 1:
        said = (f"{name} holds every row (cut for one process) but this call runs on {size} ranks: "
                f"pass each rank's shard (burstcu.shard(x, group))")
    elif size == 1:
        said = (f"{name} is one rank's shard of {cut_for} but this call has no group (one process): "
                f"pass the group it was cut for (without it each rank works on its own rows alone)")
    else:
        said = f"{name} is one rank's shard of {cut_for} but this call runs on {size} ranks"
    return (f"{said}. If the rows are right, pass a view ({name}[:]): the memory is of this "
            f"array object")


def cut_problem(names: tuple, arrays: tuple, want: tuple, *, axis: int | None = None,
                positional: bool = True) -> str | None:
    """What contradicts how `shard` (or `attention`) cut these arrays, or None: a call that
    takes their rows for other positions than they hold (another layout or other documents:
    a wrong answer), or an lse joined along another axis than its sequence's.
    want: the call's own cut (`rows_cut`); axis: the axis `unshard` joins along (None: an
    attention call, along the sequence); positional: whether the call's result depends on
    where the rows sit (causal, a window, documents; a plain softmax or linear attention over
    every key does not). Only arrays this process remembers are looked at (`remember_cut`).
    Rows cut for another number of ranks than the call's are refused whatever the call: its
    keys, or the rows it joins, would be this rank's alone (a group left out, most often). An
    attention call on a group refuses arrays cut along another axis than their sequence's (axis 0
    of packed (T, H, D), else 1): heads taken for a shard; without a group (heads split over the
    ranks, each attending over the whole sequence) they run. Arrays whose rows pair row by row
    (`ROW_PAIRS`: keys with values, queries with their outputs and output gradients) must hold
    one cut whatever the call: rows of two cuts would pair other positions' keys and values even
    where the call's mask reads no position."""
    if not isinstance(want[1], str) or want[1] not in LAYOUTS:   # no layout: the call says so
        return None
    rows = {}                         # name: the cut of its rows, where it is one of the call's
    for name, x in zip(names, arrays):
        held = cut_of(x)
        if held is None:
            continue
        cut, cut_axis = held
        if axis is not None and axis != cut_axis:
            if cut[0] == "lse" and cut[2]:   # a sharded sequence's lse (not heads split locally)
                return (f"{name} is an lse {'(H, T)' if cut_axis == 1 else '(B, H, S)'} whose "
                        f"sequence axis is {cut_axis}, not axis={axis}: pass axis={cut_axis}, "
                        f"or use Sharding.unshard_lse")
            continue                 # joined along another axis than the one it was cut on
        if cut[0] == "rows" and axis is None and cut_axis != (0 if x.ndim == 3 else 1):
            if cut[3] > 1 and want[3] > 1:
                return _axis_problem(name, x.ndim, cut_axis)
            continue                 # heads cut, the whole sequence in each: a local call
        if cut[0] == "rows" and cut[3] != want[3]:
            return _ranks_problem(name, cut[3], want[3])
        if cut[0] == "rows" and cut[1] is None:
            continue                 # the ranks alone are known (`api._known`): any layout
        if cut[0] == "rows" and axis is None:
            rows[name] = cut
        if cut[0] == "lse" or cut == want or not (positional or axis is not None):
            continue
        return (f"{name} was cut with {_said(cut, want)} but this call has {_said(want, cut)}: its rows "
                f"would be taken for other positions. Pass the same layout and cu_seqlens as "
                f"shard (or one burstcu.Sharding, which carries them to every call); if the rows "
                f"are right, pass a view ({name}[:]): the memory is of this array object")
    for pair in ROW_PAIRS:
        held = [(name, rows[name]) for name in pair if name in rows]
        for name, cut in held[1:]:
            if cut != held[0][1]:
                first, other = held[0]
                return (f"{name} was cut with {_said(cut, other)} but {first} with "
                        f"{_said(other, cut)}: row i of one would be paired with row i of the other, "
                        f"which holds another position. Cut them the same way (one layout and "
                        f"cu_seqlens, or one burstcu.Sharding); if the rows are right, pass a view "
                        f"({name}[:]): the memory is of this array object")
    return None


# The arguments whose rows pair row by row in every call (`cut_problem`): a key with its value,
# a query with its output and that output's gradient.
ROW_PAIRS = (("k", "v"), ("k_cache", "v_cache"), ("k_local", "v_local"), ("q", "out", "dout"))


def cache_cut_problem(names: tuple, arrays: tuple, ranks: int) -> str | None:
    """`cut_problem` for a KV cache's rows (decode, `KVCache.from_prefill`): their order is free,
    but rows `shard` cut for another number of ranks than the call's `ranks` are refused (a
    group left out: each rank would decode over its own rows alone), as are heads cut for
    rows."""
    return cut_problem(names, arrays, rows_cut("contiguous", None, ranks), positional=False)


def mask_options(causal, window_size, cu_seqlens, softmax_scale, q, block_mask) -> dict | None:
    """What of an attention call's options its lse depends on, as the forward remembers them with
    lse (`remember_cut(lse, ("lse", options, ...))`) and its backward compares them (`lse_problem`):
    {causal, window_size, cu_seqlens, softmax_scale (resolved for q's head dim), block_mask},
    spelled one way
    where spellings mean the same mask (a causal right bound 0 or -1, a right bound 0 without
    causal, one document or none), or
    None where one cannot be read (the call itself refuses it on every rank)."""
    if not isinstance(causal, (bool, np.bool_)):
        return None
    try:
        err, docs = parse_cu_seqlens(cu_seqlens)
        left, right = (int(w) for w in window_size)
        if err is not None:
            return None
        causal = bool(causal) or right == 0          # keys up to the query's own: causal
        return {"causal": causal, "window_size": (left, 0 if causal else right),
                "cu_seqlens": None if docs is None or len(docs) <= 2 else docs,   # one document: none
                "softmax_scale": resolve_scale(softmax_scale, int(q.shape[-1])), "block_mask": block_mask}
    except Exception:  # noqa: BLE001 - the call refuses it on every rank
        return None


def call_marks(arrays: dict) -> dict:
    """{name: (its NumPy dtype, a digest of a sample of its rows along its sequence axis:
    `_fingerprint`; axis 0 of a packed (T, H, D) array, else 1)} of the host arrays among
    `arrays` ({name: array}): what `attention` remembers with its lse of the q, k, v it took and
    the out it gave, and what its backward compares (`lse_problem`; a lossless cast of the same
    values passes). Device arrays are left out (reading them would sync)."""
    marks = {}
    for name, x in arrays.items():
        host = _host(x)
        if host is not None and host.ndim >= 3 and host.size:
            marks[name] = (host.dtype, _fingerprint(host, _marked_axis(host)))
    return marks


def _cast_of(x, mark: tuple) -> bool:
    """Whether x, of another dtype than the array `mark` was taken of (`call_marks`), holds its
    values exactly (a cast to a wider dtype: float32 copies of a bfloat16 call's arrays)."""
    dtype, digest = mark
    host = _host(x)
    if host is None or host.dtype == dtype:
        return False
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _fingerprint(host, _marked_axis(host), dtype) == digest


def _marked_axis(x) -> int:
    """The sequence axis `call_marks` samples: 0 of a packed (T, H, D) array, else 1."""
    return 0 if x.ndim == 3 else 1


def _took_or_gave(names: list) -> str:
    """What an attention call did with the arrays `names`: took q, k, v; gave out."""
    return " and ".join(word for word, here in (("took", set(names) - {"out"}),
                                                 ("gave", "out" in names)) if here)


def lse_problem(lse, options: dict | None, arrays: dict | None = None) -> str | None:
    """What contradicts the call `attention` returned this very lse from, or None: the options
    it ran with (`mask_options`; gradients under another mask or scale than the forward's would
    be silently wrong), and `arrays` ({name: array} of q, k, v, out) against the ones it took
    and gave (`call_marks`: another call's out, or q changed in place since, would be too)."""
    held = cut_of(lse)
    if options is None or held is None or held[0][0] != "lse" or held[0][1] is None:
        return None     # no memory, or rows `shard` cut (a reference's lse): nothing to compare
    forward = held[0][1]
    differ = [name for name in options if not _same(forward[name], options[name])]
    left_alike = forward["window_size"][0] == options["window_size"][0]
    implied = {"causal", "window_size"} <= set(differ) and left_alike
    if implied:
        differ.remove("window_size")      # its right bound only follows causal (`mask_options`)
    marks, now = (held[0][3] if len(held[0]) > 3 else {}), call_marks(arrays or {})
    mixed = len({dtype for dtype, _ in now.values()}) > 1   # the dtype checks name that
    others = [name for name in now if name in marks and marks[name] != now[name]
              and not (mixed and marks[name][0] != now[name][0])
              and not _cast_of(arrays[name], marks[name])]
    cast = [(marks[name][0], now[name][0]) for name in others if marks[name][0] != now[name][0]]
    if not differ and others:
        return (f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not what the attention "
                f"call that returned this lse {_took_or_gave(others)} "
                + (f"(cast: the call had {cast[0][0]}, these are {cast[0][1]}; or another call's)"
                   if cast else "(another call's, or changed in place since)")
                + ": the gradients would be those of another attention. Pass the backward the "
                  "q, k, v and out of that call; if this is meant, pass a view of lse "
                  "(lse[:]): the memory is of this array object")
    if not differ:
        return None
    said = ", ".join(f"{name}: {_shown(forward[name])} in the forward, {_shown(options[name])} here"
                     for name in differ)
    if implied:
        said += " (a window_size right bound of 0 is causal too)"
    return (f"lse comes from an attention call with other options than this backward's ({said}): "
            f"the gradients would be those of another attention. Pass the backward the forward's "
            f"causal, window_size, cu_seqlens, softmax_scale and block_mask; if this is meant, pass "
            f"a view (lse[:]): the memory is of this array object")


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):   # a scale, as float32 holds it
        return math.isclose(a, b, rel_tol=2.0**-22)
    return a is b or (a is not None and b is not None and bool(a == b))


def _shown(value) -> str:
    if isinstance(value, tuple) and len(value) > 6:
        return docs_digest(value)
    return "a BlockMask" if value.__class__.__name__ == "BlockMask" else repr(value)


def inherited_cut(arrays: tuple, want: tuple, seq_axis: int) -> tuple | None:
    """(cut, axis) a call's results get (`remember_cut`): their inputs' remembered one (the first
    that has one: a result lies as its input, rows or heads), else the call's own `want` along
    the sequence axis; None for a call without a group on inputs it remembers nothing of (a
    view, a rank's own rows: what each rank computed alone says nothing of a cut). Inputs that
    remember the number of ranks alone (layout None) get the call's `want` where it says more
    (a layout), on as many ranks."""
    for x in arrays:
        held = cut_of(x)
        if held is not None and held[0][0] == "rows":
            cut, axis = held
            if cut[1] is None and axis == seq_axis and want[1] is not None and want[3] == cut[3]:
                return want, seq_axis
            return held
    return (want, seq_axis) if want[3] is not None and want[3] > 1 else None


def sharding_keywords(group, layout, cu_seqlens, uneven, block_mask=None) -> tuple:
    """(group, layout, cu_seqlens, uneven, lengths, conflict) of a call given `group` (a Group,
    None, or a `burstcu.Sharding`) and its keywords (None: left out). A Sharding fills the
    keywords left out; `conflict` says which given keyword disagrees with it (else None), for
    an error on every rank (the public calls defer it through their agreement round; `plan`,
    which sends nothing, raises it). block_mask: the call's; a Sharding with documents beside
    it is a conflict (the mask says the documents)."""
    arguments = getattr(group, "sharding_arguments", None)
    if not callable(arguments):
        return (group, "contiguous" if layout is None else layout, cu_seqlens,
                False if uneven is None else uneven, None, None)
    group, sh_layout, sh_docs, lengths = arguments()
    conflict = None
    if layout is not None and not (isinstance(layout, str) and layout == sh_layout):
        conflict = f"layout={layout!r} but the Sharding's layout is {sh_layout!r}"
    if cu_seqlens is not None:
        err, docs = parse_cu_seqlens(cu_seqlens)
        if err is not None:
            conflict = f"cu_seqlens beside the Sharding: {err.message}"
        elif docs != sh_docs:
            conflict = f"cu_seqlens={list(docs)} but the Sharding's is {sh_docs and list(sh_docs)}"
    if uneven is not None:
        if not isinstance(uneven, (bool, np.bool_)):
            conflict = f"uneven must be True or False, got {uneven!r}"
        elif bool(uneven) != (lengths is not None):
            conflict = (f"uneven={uneven!r} but the Sharding's shards are "
                        f"{'uneven (lengths)' if lengths is not None else 'not uneven'}")
    if conflict is not None:
        conflict += "; pass the Sharding alone: it carries layout, cu_seqlens and lengths"
    elif block_mask is not None and sh_docs is not None:
        conflict = (f"the Sharding holds documents (cu_seqlens, layout {sh_layout!r}) and block_mask "
                    f"is the whole mask: give the documents as rectangles of the block mask and "
                    f"make the Sharding without cu_seqlens (layout 'contiguous' or 'zigzag'; "
                    f"Sharding(group, lengths=mask.balanced_lengths(G, N)) balances the rows)")
    return group, sh_layout, sh_docs, lengths is not None, lengths, conflict


# -- the checks of each public call (what one rank checks alone, before the agreement) ------------

def check_attention_call(ops, arrays: tuple, *, backward: bool, causal, softmax_scale, layout,
                         strategy: str, options: dict, flags: dict, options_problem=None,
                         strategy_problem=None, window_size=(-1, -1), cu_seqlens=None,
                         block_mask=None):
    """(InputError or None, resolved softmax scale, metadata, document boundaries or None) of
    this rank's native arrays for `attention` (q, k, v) or `attention_backward` (dout, q, k, v,
    out, lse). options_problem: the strategy options' InputError (checked first);
    strategy_problem(q_shape, k_shape): the strategy's own limits as an InputError or None. The
    ranks' sequence lengths may differ (the metadata leaves them out; `partition_of` checks them
    once all are known)."""
    q, k, v = arrays[1:4] if backward else arrays
    err = options_problem or check_flags(**flags) or check_attention_inputs(
        q, k, v, array_types=ops.array_types, dtypes=ops.dtypes, layout=layout,
        softmax_scale=softmax_scale, op_rule=lambda q_, k_: ops.input_problem(q_, k_, backward))
    if err is None and strategy_problem is not None:
        err = strategy_problem(q.shape, k.shape)
    if err is None:
        err = check_window(window_size, bool(causal), ops.masks_windows)
    docs = None
    if err is None:
        err, docs = parse_cu_seqlens(cu_seqlens)
    if err is None:
        err = check_block_mask(block_mask, bool(causal), window_size, docs, ops.masks_windows)
    if err is None and backward:
        dout, _, _, _, out, lse = arrays
        err = check_backward_inputs(dout, out, lse, q, array_types=ops.array_types)
    if err is not None:
        return err, None, None, None
    scale = resolve_scale(softmax_scale, q.shape[-1])
    seq_axes = (1, 1, 1, 1, 1, 2) if backward else (1, 1, 1)
    # every flag is agreed on too (check=True changes what the backward ring sends)
    return None, scale, metadata(*arrays, seq_axes=seq_axes, layout=layout, strategy=strategy,
                                 softmax_scale=scale, window=tuple(int(w) for w in window_size),
                                 cu_seqlens=docs_digest(docs),
                                 block_mask=None if block_mask is None else block_mask.digest,
                                 **options,
                                 **{name: bool(value) for name, value in flags.items()}), docs


def check_linear_call(ops, arrays: tuple, *, backward: bool, causal, layout, strategy: str,
                      strategies: tuple):
    """(InputError or None, metadata) of this rank's native arrays for `linear_attention` (q, k,
    v) or its backward (dout, q, k, v); strategies: the linear strategies' names."""
    q, k, v = arrays[1:] if backward else arrays
    err = None
    if strategy not in strategies:
        err = InputError(ValueError, f"strategy must be one of {strategies}, not {strategy!r}")
    err = err or check_flags(causal=causal) or check_attention_inputs(
        q, k, v, array_types=ops.array_types, dtypes=ops.array_dtypes, layout=layout,
        softmax_scale=None)
    if err is None and backward:
        dout = arrays[0]
        if not isinstance(dout, ops.array_types):
            err = InputError(TypeError, f"dout must be an array like q, got {type(dout).__name__}")
        elif (misread := misread_array_problem("dout", dout)) is not None:
            err = misread
        elif tuple(dout.shape) != tuple(q.shape):
            err = InputError(ValueError, f"dout must have q's shape {tuple(q.shape)}, got "
                                         f"{tuple(dout.shape)}")
        elif dtype_name(dout) != dtype_name(q):
            err = InputError(TypeError, f"dout must have q's dtype {dtype_name(q)}, got "
                                        f"{dtype_name(dout)}")
    if err is not None:
        return err, None
    return None, metadata(*arrays, seq_axes=(1,) * len(arrays), layout=layout, strategy=strategy,
                          causal=bool(causal))


def check_decode_call(ops, arrays: tuple, cache_seqlens, softmax_scale, return_lse, agreed: dict,
                      ranks: int):
    """(InputError or None, metadata, (valid rows per batch row (B,) int64, scale)) of this
    rank's q (B,T,H,D), k_cache, v_cache (B,S_cache,Hkv,D) for `decode`; agreed: more values
    every rank must hold alike (a KVCache's counts); ranks: the group's size (at one rank there
    is nothing to agree on: metadata None). (A NumPy q's values are compared after the
    agreement: `q_summary`, `q_values_problem`.)"""
    q, k, v = arrays
    for name, x in (("q", q), ("k_cache", k), ("v_cache", v)):
        err = _check_array(name, x, 4, ops.array_types, ops.array_dtypes)
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
    if min(b, t, h, d) < 1:
        return InputError(ValueError, f"q {tuple(q.shape)} has an empty axis: decode takes (B, T, H, D) "
                                      f"with at least one batch row, new token (T), head and head "
                                      f"dim"), None, None
    if bk != b or dk != d or min(b, t, h, d, hkv) < 1 or h % hkv:
        swapped = ("; q's axis 1 is a multiple of Hkv: is it (batch, heads, tokens, headdim)? "
                   "Pass q.transpose(1, 2)" if hkv > 0 and h % hkv and t % hkv == 0 else "")
        return InputError(ValueError, f"q {tuple(q.shape)} does not fit the cache {tuple(k.shape)}: "
                                      f"(B, T, H, D) against (B, S_cache, Hkv, D), H a multiple "
                                      f"of Hkv{swapped}"), None, None
    problem = ops.decode_problem(tuple(q.shape), tuple(k.shape), dtype_name(q))
    if problem is not None:
        return InputError(ValueError, problem), None, None
    if not isinstance(return_lse, (bool, np.bool_)):
        return InputError(TypeError, f"return_lse must be True or False, got {return_lse!r}"), None, None
    if softmax_scale is not None and not _finite_real(softmax_scale):
        return scale_problem(softmax_scale), None, None
    if cache_seqlens is None:
        lengths = np.full(b, s, np.int64)
    else:
        lengths = host_ints(cache_seqlens)
        if lengths.dtype.kind not in "iu" or lengths.shape != (b,):
            return InputError(ValueError, f"cache_seqlens must be {b} integers (one a batch row), "
                                          f"got {lengths.dtype} {tuple(lengths.shape)}"), None, None
        if lengths.size and (lengths.min() < 0 or lengths.max() > s):
            return InputError(ValueError, f"cache_seqlens must lie in [0, {s}] (this rank's "
                                          f"cache rows), got {lengths.tolist()}"), None, None
        lengths = lengths.astype(np.int64)
    scale = resolve_scale(softmax_scale, d)
    meta = None if ranks == 1 else metadata(q, k, v, seq_axes=(None, 1, 1), softmax_scale=scale,
                                            return_lse=bool(return_lse), **agreed)
    return None, meta, (lengths, scale)


Q_PROJECTIONS = 4      # random ±1 projections of each summarised piece of q that `q_summary` keeps
Q_PIECES = 1024        # at most this many pieces: one a (b, t, h) head, or runs of heads when more
# the rounding `q_values_problem` forgives: a piece's projections may move by this fraction of the
# piece's summed |q|, 4 ulps of the dtype but at least sqrt(eps), at most 2**-12 (q of one token
# computed on two ranks by other BLAS paths: a long product's cancellation moves an element by
# far more than its own ulps); another token moves them by about that sum / sqrt(D)
Q_ULPS, Q_ROUNDING_CAP = 4, 2.0 ** -12
Q_SCALE = 2.0 ** -20   # q scaled by it first: float64 near its largest sums without overflow


@lru_cache(maxsize=8)
def _q_signs(width: int) -> np.ndarray:
    """(Q_PROJECTIONS, width) fixed random ±1, the same on every rank."""
    return np.random.default_rng(0).choice([-1.0, 1.0], size=(Q_PROJECTIONS, width))


def q_summary(q) -> tuple | None:
    """A NumPy q (B, T, H, D) in a few numbers, for `q_values_problem`: (shape, heads a piece,
    projections, rounding, non-finite digest). q's B*T*H heads are cut into consecutive pieces
    of g heads (g = 1 up to Q_PIECES heads); `projections` (bytes of float64 (pieces,
    Q_PROJECTIONS)) are each piece's finite values projected on fixed random ±1 vectors,
    `rounding` (bytes of float64 (pieces,)) how far rounding may move each (Q_ULPS,
    Q_ROUNDING_CAP), and the digest says where q holds NaN, +inf and -inf. None for a device
    array (reading it would synchronise) or an empty one (refused by `check_decode_call`)."""
    if not isinstance(q, np.ndarray) or q.ndim != 4 or q.size == 0:
        return None
    heads, d = q.shape[0] * q.shape[1] * q.shape[2], q.shape[3]
    g = -(-heads // Q_PIECES)
    x = np.zeros((-(-heads // g) * g, d))
    x[:heads] = q.reshape(heads, d)
    codes = b""                          # where NaN (1), +inf (2) and -inf (3) are, if anywhere
    if not np.isfinite(x).all():
        codes = (np.isnan(x) + 2 * np.isposinf(x) + 3 * np.isneginf(x)).astype(np.uint8)
        x = np.where(codes == 0, x, 0.0)
    x = x.reshape(-1, g * d) * Q_SCALE
    limits = finfo(q.dtype)   # an ulp is at most eps |x|, or the smallest subnormal near zero
    eps = float(limits.eps)
    rounding = (max(Q_ULPS * eps, min(math.sqrt(eps), Q_ROUNDING_CAP)) * np.abs(x).sum(axis=1)
                + Q_ULPS * float(limits.smallest_subnormal) * Q_SCALE * g * d)
    digest = hashlib.blake2b(bytes(codes), digest_size=16).digest()
    return (tuple(int(n) for n in q.shape), g, (x @ _q_signs(g * d).T).tobytes(), rounding.tobytes(), digest)


def _moved_head(summaries: list) -> tuple | None:
    """(rank, first head, heads a piece, whether it is the NaN and inf that differ) where a rank's
    `q_summary` shows other values than rank 0's beyond rounding, or None."""
    first = summaries[0]
    for rank, mine in enumerate(summaries[1:], 1):
        if first is None or mine is None or mine[:2] != first[:2]:
            continue
        g = first[1]
        if mine[4] != first[4]:
            return rank, None, g, True
        moved = np.abs(np.frombuffer(mine[2]) - np.frombuffer(first[2])).reshape(-1, Q_PROJECTIONS)
        allowed = np.maximum(np.frombuffer(mine[3]), np.frombuffer(first[3]))[:, None]
        if (moved > allowed).any():
            return rank, int(np.argwhere(moved > allowed)[0, 0]) * g, g, False
    return None


def q_values_problem(summaries: list) -> str | None:
    """Why the ranks' `q_summary`s show different new tokens (beyond rounding), or None. Every
    rank gets the same list, so each says the same."""
    moved = _moved_head(summaries)
    if moved is None:
        return None
    rank, head, g, nonfinite = moved
    rule = "every rank must decode the same new tokens (q the same on every rank)"
    if nonfinite:
        return f"ranks disagree in decode: q's NaN and inf on rank {rank} are not where rank 0's are: {rule}"
    (b, t, h, _) = summaries[0][0]
    where = (f"batch row {head // (t * h)}, token {head // h % t}, head {head % h}"
             + ("" if g == 1 else f" or one of the {min(g, b * t * h - head) - 1} heads after it "
                                  f"(in batch row, token, head order)"))
    return (f"ranks disagree in decode: q's values on rank {rank} differ from rank 0's by more than "
            f"rounding at {where}: {rule}")


def appended_rows(appended: list) -> tuple | None:
    """The rows a KV cache took since its last decode (`KVCache.append`'s samples: a (k, v, token
    indices) a call, k and v (B, t, Hkv, D) NumPy) as one array for `q_summary`, k's heads then
    v's: ((B, T, 2 Hkv, D), [(call, token) of each of the T]), or None without any."""
    if not appended:
        return None
    rows = np.concatenate([np.concatenate([k, v], axis=2) for k, v, _ in appended], axis=1)
    return rows, [(i, int(t)) for i, (_, _, tokens) in enumerate(appended) for t in tokens]


def appended_rows_problem(summaries: list) -> str | None:
    """Why the ranks' (`q_summary` of `appended_rows`' array, its (call, token) list), or None
    each, show rows appended otherwise on some rank, beyond rounding, or None."""
    moved = _moved_head([s and s[0] for s in summaries])
    if moved is None:
        return None
    (b, t, h2, _), tokens = summaries[0][0][0], summaries[0][1]   # rank 0's, as compared
    rank, head, g, nonfinite = moved
    rule = ("every rank must append the same rows (a new token's keys and values: the cache stores "
            "each row on one rank)")
    if nonfinite:
        return (f"ranks disagree in decode: the NaN and inf of the rows KVCache.append took since "
                f"the last decode on rank {rank} are not where rank 0's are: {rule}")

    def place(i: int) -> str:          # head i of the (B, T, 2 Hkv) rows: k's kv heads, then v's
        call, token = tokens[i // h2 % t]
        which, kv_head = ("k_new", i % h2) if i % h2 < h2 // 2 else ("v_new", i % h2 - h2 // 2)
        return f"{which} of call {call + 1}, batch row {i // (t * h2)}, token {token}, kv head {kv_head}"
    last = min(head + g, b * t * h2) - 1
    where = place(head) if last == head else \
        f"{place(head)} or a row up to {place(last)} (by batch row, call, token, k_new then v_new)"
    return (f"ranks disagree in decode: the rows KVCache.append took since the last decode differ "
            f"on rank {rank} from rank 0's by more than rounding at {where}: {rule}")


# -- q, k, v in torch SDPA's (batch, heads, seqlen, headdim) order ------------------------------

SWAPPED_AXES = ("are these (batch, heads, seqlen, headdim), torch SDPA's order? burstcu takes "
                "(batch, seqlen, heads, headdim): pass x.transpose(1, 2) for each (out comes back "
                "in burstcu's order)")
MANY_HEADS = 512      # query heads past any model's (the largest have 128): axes 1 and 2 swapped


HIDDEN_STATES = ("are these hidden states (batch, seqlen, d_model), read as packed rows (T, H, D): "
                 "the batch items as rows, each position a head? project and reshape them to "
                 "(batch, seqlen, heads, headdim) first")


class HeadsAxisWarning(RuntimeWarning):
    """q's heads axis most likely holds something else: q has MANY_HEADS or more heads (its
    axis 2), more than any rank's rows (axis 1), as arrays in torch SDPA's (batch, heads,
    seqlen, headdim) order have, which burstcu reads as (batch, seqlen, heads, headdim),
    attending across heads; or a packed q (T, H, D) has more heads than rows on all ranks
    together, as hidden states (batch, seqlen, d_model) have, attending across the batch.
    Either can be meant; then ``warnings.filterwarnings("ignore",
    category=burstcu.HeadsAxisWarning)`` silences it."""


def warn_if_heads_look_like_rows(heads: int, lengths: list, packed: bool = False) -> None:
    """A HeadsAxisWarning on every rank (heads: q's axis 2, agreed; lengths: every rank's rows)
    when q has MANY_HEADS or more heads and more heads than any rank has rows, or, `packed` (q
    given as (T, H, D)), more heads than the ranks' rows together, pointing at the caller's
    line. A warning, not an error: with multi-head q, k, v of one shape nothing else tells the
    orders apart (with fewer kv heads than query heads, the lengths differ: an error that says
    so)."""
    if packed and heads > sum(lengths):
        warnings.warn(f"q is packed with {heads} heads and {sum(lengths)} rows on all ranks "
                      f"together: {HIDDEN_STATES} (many heads meant? warnings.filterwarnings("
                      f"'ignore', category=burstcu.HeadsAxisWarning))",
                      HeadsAxisWarning, stacklevel=caller_stacklevel())
    elif heads >= MANY_HEADS and heads > max(lengths):
        warnings.warn(f"q has {heads} heads and its ranks at most {max(lengths)} rows: {SWAPPED_AXES} "
                      f"(many heads meant? warnings.filterwarnings('ignore', "
                      f"category=burstcu.HeadsAxisWarning))",
                      HeadsAxisWarning, stacklevel=caller_stacklevel())


# -- shards that are all the same (the global array passed on every rank) ----------------------

class SameShardsWarning(RuntimeWarning):
    """Every rank's shard starts and ends with the same rows: most likely each rank passed the
    global array instead of its shard (`burstcu.shard` cuts them). Identical shards can be meant;
    then ``warnings.filterwarnings("ignore", category=burstcu.SameShardsWarning)`` silences it."""


def first_rows_digest(x) -> bytes | None:
    """A digest of x's first two rows and its last row along the sequence axis (axis 1) when x
    is in host memory (NumPy), else None (reading device memory would synchronise the host).
    The last row keeps shards that only begin alike (padding at the sequence's start) apart.
    None too where those rows hold one value (`one_value`: shards of zeros, or a diverged step's
    NaN, are alike by right)."""
    if not isinstance(x, np.ndarray) or x.ndim < 2:
        return None
    if one_value(np.concatenate([x[:, :2], x[:, -1:]], axis=1)):
        return None
    digest = hashlib.blake2b(digest_size=16)
    digest.update(np.ascontiguousarray(x[:, :2]).tobytes())
    digest.update(np.ascontiguousarray(x[:, -1:]).tobytes())
    return digest.digest()


def ends_digest(x, axis: int) -> bytes | None:
    """A digest of a host array's rows along `axis` (`_fingerprint`) when its first and last
    rows differ, else None: shards of one constant value (zeros, NaN) are alike by right."""
    host = _host(x)
    if host is None or host.ndim <= axis or host.shape[axis] < 2 or \
            same_rows(np.take(host, 0, axis=axis), np.take(host, -1, axis=axis)):
        return None
    return _fingerprint(host, axis)


def same_rows(a, b) -> bool:
    """Whether two rows of a host array hold the same values, NaN alike (a diverged step's NaN
    shards are as alike by right as zeros); dtypes without NaN (strings, records) compared as
    they are."""
    try:
        return bool(np.array_equal(a, b, equal_nan=True))
    except TypeError:                         # no isnan for the dtype: no NaN to match
        return bool(np.array_equal(a, b))


def one_value(rows) -> bool:
    """Whether every element of `rows` (a host array) is the same value, NaN alike."""
    flat = rows.reshape(-1)
    return flat.size > 0 and same_rows(flat, np.broadcast_to(flat[:1], flat.shape))


def valid_rows_digest(x, lengths) -> bytes | None:
    """`first_rows_digest` of a KV cache x (B, S_cache, Hkv, D) over the rows every batch row
    holds (the fewest of `lengths`, (B,) ints, the valid rows per batch row); None where a batch
    row holds none (empty caches are alike on every rank by right) or x is not in host memory."""
    fewest = int(np.min(lengths)) if len(lengths) else 0
    return first_rows_digest(x[:, :fewest]) if fewest > 0 and isinstance(x, np.ndarray) else None


def warn_if_all_the_same(digests: list, name: str, does: str = "attends over") -> None:
    """A SameShardsWarning on every rank (each sees every digest) when G > 1 ranks hold the same
    first and last rows, pointing at the caller's line (the first frame outside burstcu): most likely
    each passed the global array instead of its shard, which attends over G copies of the
    sequence (`does`: what the call does with them instead). A warning, not an error: identical
    shards can be meant. (Where the shapes make it certain, documents that cover one copy of
    the rows, `check_docs_total` raises.)"""
    if len(digests) > 1 and digests[0] is not None and all(d == digests[0] for d in digests):
        warnings.warn(f"every rank's {name} starts and ends with the same rows: if each rank passed the "
                      f"global array instead of its shard, this {does} {len(digests)} "
                      f"copies of the sequence; cut shards with burstcu.shard(x, group, layout) "
                      f"(identical shards meant? warnings.filterwarnings('ignore', "
                      f"category=burstcu.SameShardsWarning))",
                      SameShardsWarning, stacklevel=caller_stacklevel())
