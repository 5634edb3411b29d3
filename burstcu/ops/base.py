"""The local-operation interface: what one rank computes, the only door to compute.

The strategies (`burstcu.engine`) never touch array contents themselves: they allocate message
buffers, copy and add through a `LocalOps`, and ask it to run one step of attention, a decode
partial or a linear-attention chunk product. The NumPy op (`burstcu.ops.numpy`) and the CUDA
kernels (`burstcu.ops.cuda`, on a GPU or under the CPU emulator) implement it; wrappers (timing,
recording, the schedule checker's recorder) derive from `DelegatingOps`. What an op can take is
read from its capability attributes (`dtypes`, `array_dtypes`, `headdim_problem`,
`max_positions`, `masks_windows`, `device`, `device_id`, `current_device()`), never from a
backend's name.

Shapes (B batch, S local sequence length, H query heads, Hkv key/value heads, D head dim):

* q, dout, out, dq: (B, S, H, D);  k, v, dk, dv: (B, S, Hkv, D)
* lse, delta: (B, H, S)
* the running forward state and the backward context are private to the implementation.

Dtypes: inputs are float16, bfloat16, float32 or float64. Everything that accumulates across ring
steps (output accumulator, row max, row sum, lse, delta, dq, dk, dv) is held in
`accum_dtype(input dtype)`: float32, or float64 for float64 input; nothing is rounded to the input
dtype until the end of the pass.

Decode (`decode_partial`, `decode_merge`; `decode_whole` where one rank holds every cache row)
and linear attention (`linear_*`) have array-module defaults here (`burstcu.ops.decode`,
`burstcu.ops.linear`: any xp), which an op overrides with kernels where it has them.

Masking is described by `burstcu.layout.Block`s: each step is given the rectangles to compute
(wholly-masked rectangles are never passed), each either full or straddling the causal diagonal.
GQA: query head h uses key/value head h // (H // Hkv).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, ContextManager, Sequence

import numpy as np

from ..layout import Block
from . import decode as decode_xp
from . import linear as linear_xp


_DTYPE_NAMES: dict = {}


def dtype_name(x) -> str:
    """The name of x's dtype, or of x when it is a dtype ("float16", "bfloat16", ...); memoized,
    as NumPy builds the string anew on every `.name`."""
    dtype = x if isinstance(x, np.dtype) else x.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = np.dtype(dtype).name
    return name


def checked_option(name: str, value, kind: str):
    """A local op's constructor option, checked as `kind` says: "flag" True or False (Python's or
    NumPy's), "count" an int >= 1, "count or default" that or None or 0 (returned as None: the
    op's default). TypeError or ValueError naming it, so that `burstcu.init` refuses it on every
    rank rather than a call failing later on one."""
    if kind == "flag":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
        return bool(value)
    if kind == "count or default" and (value is None or (type(value) is not bool and value == 0)):
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def buffer_layout(fields: Sequence[tuple[str, tuple, Any]]) -> tuple:
    """The hashable layout of a message's `fields` [(name, shape, dtype)], dtypes spelled one way:
    what `LocalOps.double_buffer` keeps its buffers by (a caller that keeps its fields can make
    it once and pass it)."""
    return tuple((name, tuple(int(n) for n in shape), np.dtype(dtype).str) for name, shape, dtype in fields)


def as_dtype(dtype) -> np.dtype:
    """np.dtype(dtype), knowing ml_dtypes' names too ("bfloat16"): ml_dtypes, which registers
    them with NumPy and takes most of a second to import, is imported only when a name needs it
    (arrays of bfloat16 exist only once it is imported). TypeError for what no dtype is."""
    try:
        return np.dtype(dtype)
    except TypeError:
        importlib.import_module("ml_dtypes")    # registers bfloat16 and its kin by name
        return np.dtype(dtype)


def finfo(dtype):
    """The machine limits (eps, max, ...) of a float dtype: NumPy's, or ml_dtypes' for bfloat16."""
    dtype = as_dtype(dtype)
    if np.issubdtype(dtype, np.floating):
        return np.finfo(dtype)
    import ml_dtypes
    return ml_dtypes.finfo(dtype)


def accum_dtype(dtype) -> np.dtype:
    """float64 for float64 input, float32 for everything narrower."""
    return np.dtype(np.float64) if as_dtype(dtype).name == "float64" else np.dtype(np.float32)


# the frameworks whose frames stand between an adapter's caller and burstcu (torch's autograd
# and dynamo wrappers, JAX's custom_vjp and tracing, and the context managers and wrappers of
# the standard library they use): never the user's line
_FRAMEWORKS = ("torch", "jax", "jaxlib")
_WRAPPER_FILES = tuple(os.path.abspath(m.__file__) for m in (contextlib, functools))


def not_the_users_files() -> tuple:
    """The folders (and files) whose frames are never the user's: the burstcu package, the
    frameworks its adapters go through (those imported by now), contextlib and functools."""
    return _not_the_users(tuple(name in sys.modules for name in _FRAMEWORKS))


@functools.lru_cache(maxsize=None)
def _not_the_users(imported: tuple) -> tuple:
    """`not_the_users_files` once `_FRAMEWORKS` stand imported or not as `imported` says."""
    packages = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep]
    for name in _FRAMEWORKS:
        file = getattr(sys.modules.get(name), "__file__", None)   # imported by then, if used
        if file:
            packages.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(packages) + _WRAPPER_FILES


@functools.lru_cache(maxsize=4096)
def users_file_name(code_file: str, not_the_users: tuple) -> str | None:
    """The name of `code_file` (a code object's co_filename) where its frames are the user's:
    none of `not_the_users` (`not_the_users_files`); else None."""
    file = os.path.abspath(code_file)
    return None if file.startswith(not_the_users) else os.path.basename(file)


def caller_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` in the function that calls this one, so that the
    warning names the first frame outside the burstcu package and the frameworks its adapters
    go through (the user's line), or the outermost frame where none is (a thread burstcu
    started)."""
    not_the_users = not_the_users_files()
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and users_file_name(frame.f_code.co_filename, not_the_users) is None:
        frame, level = frame.f_back, level + 1
    return level


class Message:
    """Named arrays packed in one contiguous byte buffer, so a ring step sends one message.

    `fields` is a list of (name, shape, dtype). `span(first, last)` is the contiguous byte range
    from field `first` through field `last`, in declaration order, for sending a sub-message.
    Fields are packed back to back, padded only to each field's natural alignment, so a span's
    size is the payload size (exactly, whenever every field's byte size is a multiple of the next
    field's itemsize, as with any even head dim).
    """

    def __init__(self, xp: Any, fields: Sequence[tuple[str, tuple, Any]], flat=None):
        self.xp = xp
        self.offsets: dict[str, tuple[int, int]] = {}
        self.order = [name for name, _, _ in fields]
        offset = 0
        for name, shape, dtype in fields:
            itemsize = np.dtype(dtype).itemsize
            offset = -(-offset // itemsize) * itemsize
            size = int(np.prod(shape)) * itemsize
            self.offsets[name] = (offset, offset + size)
            offset += size
        if flat is None:
            self.flat = xp.empty(max(offset, 1), dtype=np.uint8)
        else:                      # `resized`: the same storage, other shapes
            assert offset <= flat.shape[0], f"fields of {offset} bytes over a {flat.shape[0]}-byte buffer"
            self.flat = flat
        self.fields = {}
        for name, shape, dtype in fields:
            lo, hi = self.offsets[name]
            self.fields[name] = self.flat[lo:hi].view(dtype).reshape(shape)

    def __getitem__(self, name: str):
        return self.fields[name]

    def resized(self, fields: Sequence[tuple[str, tuple, Any]]) -> "Message":
        """The same storage laid out for `fields` (the same names with other shapes, at most as
        many bytes): a ring's buffer, allocated for its longest shard, holding a shorter one."""
        return Message(self.xp, fields, flat=self.flat)

    def span(self, first: str, last: str):
        """The bytes from the start of `first` to the end of `last` (a contiguous uint8 view)."""
        i, j = self.order.index(first), self.order.index(last)
        assert i <= j, f"span({first!r}, {last!r}) runs backwards"
        return self.flat[self.offsets[first][0]:self.offsets[last][1]]


class LocalOps(ABC):
    """One rank's share of a ring step. See the module docstring for shapes and dtypes."""

    name: str = "abstract"
    xp: Any = np
    array_types: tuple = (np.ndarray,)           # what the public API accepts with this op
    dtypes: tuple = ("float16", "bfloat16", "float32", "float64")   # softmax attention's inputs
    array_dtypes: tuple = ("float16", "bfloat16", "float32", "float64")  # what xp's arrays hold:
    #                                            decode's and linear attention's inputs
    masks_windows: bool = False                  # Block.left / Block.right honoured (sliding windows)
    max_positions: int | None = None             # global positions it addresses (None: any)
    device: str = "cpu"                          # where its arrays live: "cpu" or "cuda"
    device_id: int | None = None                 # the CUDA device it was made on and computes on
    #                                              (its kernels, kept buffers and flags live there)
    compiles_on_first_use: bool = False          # builds a kernel variant at its first call

    def agreed_options(self) -> tuple:
        """((name, value), ...): the options, as this op resolved them, that change the bits it
        computes; the ranks of a group must agree on them (`burstcu.init`). None here."""
        return ()

    def current_device(self) -> int | None:
        """The CUDA device a launch would run on now (CuPy's current one; device "cuda"), else
        None. `arrays.device_problem` refuses a call where it is not `device_id`."""
        return None

    def input_problem(self, q, k, backward: bool = False) -> str | None:
        """Why this op cannot take q (B,S,H,D), k (B,S,Hkv,D) in the forward (or backward)
        pass — a message for the user — or None. Checked on every rank before any exchange."""
        return self.headdim_problem(q.shape[-1], backward)

    def headdim_problem(self, headdim: int, backward: bool = False) -> str | None:
        """Why this op cannot run `headdim` in the forward (or backward) pass — a message for
        the user — or None when it can."""
        return None

    def decode_problem(self, q_shape: tuple, k_shape: tuple, dtype: str) -> str | None:
        """Why this op cannot decode q (B,T,H,D) over a cache (B,S,Hkv,D) of `dtype` — a message
        for the user — or None. Checked on every rank before any exchange."""
        return None

    # -- memory ------------------------------------------------------------------------------------
    BUFFER_LAYOUTS_KEPT = 4

    def message(self, fields: Sequence[tuple[str, tuple, Any]]) -> Message:
        return Message(self.xp, fields)

    def double_buffer(self, fields: Sequence[tuple[str, tuple, Any]],
                      layout: tuple | None = None) -> tuple[Message, Message]:
        """The ring's two message buffers for `fields` (layout: `buffer_layout(fields)`, when the
        caller has it), allocated once per layout and reused by later calls, so neither a call
        nor a step allocates them. The last BUFFER_LAYOUTS_KEPT layouts stay allocated between
        calls (2 messages each); `release_buffers()` frees them.
        Safe because every exchange is waited on before a call returns, and on a GPU that wait
        orders the communication stream before later work on the same compute stream; buffers
        are kept per compute stream and calling thread (`stream_key`), since a call on another
        stream is not ordered after the last kernels that read them, and two threads' calls on
        one stream (a GPU group of one runs them as they come) would interleave their launches.
        """
        key = (self.stream_key(),) + (buffer_layout(fields) if layout is None else layout)
        cache = self.__dict__.setdefault("_double_buffers", OrderedDict())
        pair = cache.pop(key, None)
        if pair is None:
            pair = (self.message(fields), self.message(fields))
        cache[key] = pair
        while len(cache) > self.BUFFER_LAYOUTS_KEPT:
            cache.popitem(last=False)
        return pair

    def release_buffers(self) -> None:
        """Free the message buffers kept for reuse by `double_buffer`."""
        self.__dict__.pop("_double_buffers", None)

    def close(self) -> None:
        """Free everything the op holds (buffers; worker threads where it has them)."""
        self.release_buffers()

    def stream_key(self) -> Any:
        """Identifies the stream this op's work is ordered on and the thread issuing it (what
        the op keeps between calls is kept per key); None on the CPU."""
        return None

    def zeros(self, shape, dtype):
        return self.xp.zeros(shape, dtype=dtype)

    def copy_(self, dst, src) -> None:
        """dst[...] = src (dst's dtype)."""
        dst[...] = src

    def add_(self, dst, src) -> None:
        """dst += src, elementwise."""
        dst += src

    def sync(self) -> None:
        """Block the host until queued device work is done (no-op on the CPU)."""

    def annotate(self, label: str) -> ContextManager:
        """A named range around the work issued inside it (NVTX on a GPU; nothing on the CPU)."""
        return contextlib.nullcontext()

    # -- forward -----------------------------------------------------------------------------------
    @abstractmethod
    def forward_init(self, q, softmax_scale: float) -> Any:
        """A fresh running state for queries q: zero accumulator, row max -inf, row sum 0."""

    @abstractmethod
    def forward_step(self, state: Any, k, v, blocks: Sequence[Block], last: bool = False) -> None:
        """Fold attention of the state's queries over (k, v) rows in `blocks` into the state.
        last: no step follows before `forward_finalize` (an op may end the pass here)."""

    @abstractmethod
    def forward_finalize(self, state: Any, out_dtype) -> tuple[Any, Any]:
        """(out (B,S,H,D) in out_dtype, lse (B,H,S) in accum dtype). Rows that saw no key: out
        0, lse -inf."""

    # -- backward ----------------------------------------------------------------------------------
    @abstractmethod
    def backward_delta(self, dout, out) -> Any:
        """delta = rowsum(dout * out) per (batch, head, row): (B,H,S) in accum dtype."""

    @abstractmethod
    def backward_init(self, k, v, softmax_scale: float) -> Any:
        """Context holding the resident k, v and zeroed dk, dv accumulators."""

    @abstractmethod
    def backward_step(self, ctx: Any, q, dout, lse, delta, dq, blocks: Sequence[Block],
                      psum=None) -> None:
        """Accumulate into ctx's dk, dv and into dq (B,S,H,D, accum dtype) for the visiting
        queries: P is recomputed from lse; dS = P * (dP - delta). With psum ((B,H,S), accum
        dtype) also add to it each row's sum of P over the blocks' pairs (a row's sums over
        every ring step add up to 1 when lse is the forward's: `attention_backward(check=True)`)."""

    @abstractmethod
    def backward_finalize(self, ctx: Any, out_dtype) -> tuple[Any, Any]:
        """(dk, dv) in out_dtype."""

    # -- decode (a sequence-sharded KV cache) ---------------------------------------------------------
    def decode_partial(self, q, k_cache, v_cache, lengths, scale: float, out=None) -> tuple[Any, Any, Any]:
        """(acc (B,T,H,D), m (B,H,T), l (B,H,T)) in the accumulation dtype: this rank's share of
        decode for q (B,T,H,D) over the first lengths[b] rows of k_cache, v_cache (B,S,Hkv,D)
        (`burstcu.ops.decode`: unnormalised accumulator, row max of the scaled scores, row sum).
        k_cache, v_cache may instead be `burstcu.ops.decode.PagedRows` of a paged cache. out:
        None, or (acc, m, l) C-contiguous arrays of those shapes and dtype on the op's device,
        written and returned (the kernel ops' combine writes them directly: a partial made where
        the all-gather sends it, with no copy).

        Lifetime (out None): the arrays returned may be buffers the op keeps and reuses (the
        kernel ops: `double_buffer` pairs, whose two buffers calls of one layout take in turn).
        They stay valid through the op's next decode_partial or decode_whole call, whatever its
        shapes or arguments; a later call may overwrite them. Copy them to keep them longer;
        `release_buffers` drops the op's hold (arrays already returned stay readable). This
        default returns new arrays."""
        parts = decode_xp.partial(self.xp, q, k_cache, v_cache, lengths, scale, accum_dtype(q.dtype))
        if out is None:
            return parts
        for dst, src in zip(out, parts):
            self.copy_(dst, src)
        return out

    def decode_merge(self, parts: Sequence[tuple[Any, Any, Any]], out_dtype) -> tuple[Any, Any]:
        """(out (B,T,H,D) in out_dtype, lse (B,H,T)) from every rank's (acc, m, l), in rank order,
        so every rank that merges the same parts gets the same bits."""
        return decode_xp.merge(self.xp, parts, out_dtype)

    def decode_whole(self, q, k_cache, v_cache, lengths, scale: float, out_dtype) -> tuple[Any, Any]:
        """(out (B,T,H,D) in out_dtype, lse (B,H,T)): decode_partial's arguments where these
        cache rows are all there are (one rank): `decode_merge` of this partial alone, which an op
        may end in fewer steps; new arrays."""
        return self.decode_merge([self.decode_partial(q, k_cache, v_cache, lengths, scale)], out_dtype)

    # -- linear attention (chunkwise products; burstcu.ops.linear states the algebra) -----------------
    def linear_kv_state(self, k, v, acc):
        """M = K^T V (B,Hkv,D,D) in acc of k, v (B,C,Hkv,D)."""
        return linear_xp.kv_state(self.xp, k, v, acc)

    def linear_grad_state(self, q, dout, hkv: int, acc):
        """dM = sum over a kv head's query heads of Q^T dO: (B,Hkv,D,D) in acc."""
        return linear_xp.grad_state(self.xp, q, dout, hkv, acc)

    def linear_forward_run(self, q, k, v, prefix, acc):
        """Causal linear attention of one run of rows (B,C,H,D) in acc, after the state `prefix`
        (B,Hkv,D,D) of every earlier row outside the run (None: none)."""
        return linear_xp.forward_run(self.xp, q, k, v, prefix, acc)

    def linear_backward_run(self, dout, q, k, v, prefix, suffix, acc):
        """(dq (B,C,H,D), dk, dv (B,C,Hkv,D)) in acc of `linear_forward_run`, with `suffix` the
        gradient state of every later row outside the run (None: none)."""
        return linear_xp.backward_run(self.xp, dout, q, k, v, prefix, suffix, acc)

    def linear_forward_full(self, q, total, acc):
        """Non-causal linear attention: Q M (B,C,H,D) in acc, M = `total` (B,Hkv,D,D)."""
        return linear_xp.forward_full(self.xp, q, total, acc)

    def linear_backward_full(self, dout, k, v, total, grad_total, acc):
        """Non-causal gradients (dq, dk, dv) in acc, from the sequence's states M and dM."""
        return linear_xp.backward_full(self.xp, dout, k, v, total, grad_total, acc)


class DelegatingOps(LocalOps):
    """A LocalOps that forwards every call to `inner`: wrappers (timing, recording) derive from
    it and override only what they change."""

    def __init__(self, inner: LocalOps):
        self.inner = inner
        self.name, self.xp = f"{type(self).__name__}({inner.name})", inner.xp
        self.array_types, self.dtypes = inner.array_types, inner.dtypes
        self.array_dtypes, self.masks_windows = inner.array_dtypes, inner.masks_windows
        self.max_positions, self.device = inner.max_positions, inner.device
        self.device_id, self.compiles_on_first_use = inner.device_id, inner.compiles_on_first_use

    def current_device(self):
        return self.inner.current_device()

    def input_problem(self, q, k, backward: bool = False):
        return self.inner.input_problem(q, k, backward)

    def headdim_problem(self, headdim: int, backward: bool = False):
        return self.inner.headdim_problem(headdim, backward)

    def decode_problem(self, q_shape: tuple, k_shape: tuple, dtype: str):
        return self.inner.decode_problem(q_shape, k_shape, dtype)

    def double_buffer(self, fields, layout=None):
        return self.inner.double_buffer(fields, layout)

    def release_buffers(self) -> None:
        self.inner.release_buffers()

    def close(self) -> None:
        self.inner.close()

    def stream_key(self):
        return self.inner.stream_key()

    def message(self, fields):
        return self.inner.message(fields)

    def zeros(self, shape, dtype):
        return self.inner.zeros(shape, dtype)

    def copy_(self, dst, src) -> None:
        self.inner.copy_(dst, src)

    def add_(self, dst, src) -> None:
        self.inner.add_(dst, src)

    def sync(self) -> None:
        self.inner.sync()

    def annotate(self, label: str):
        return self.inner.annotate(label)

    def forward_init(self, q, softmax_scale):
        return self.inner.forward_init(q, softmax_scale)

    def forward_step(self, state, k, v, blocks, last: bool = False) -> None:
        self.inner.forward_step(state, k, v, blocks, last)

    def forward_finalize(self, state, out_dtype):
        return self.inner.forward_finalize(state, out_dtype)

    def backward_delta(self, dout, out):
        return self.inner.backward_delta(dout, out)

    def backward_init(self, k, v, softmax_scale):
        return self.inner.backward_init(k, v, softmax_scale)

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum=None) -> None:
        self.inner.backward_step(ctx, q, dout, lse, delta, dq, blocks, psum)

    def backward_finalize(self, ctx, out_dtype):
        return self.inner.backward_finalize(ctx, out_dtype)

    def decode_partial(self, q, k_cache, v_cache, lengths, scale, out=None):
        return self.inner.decode_partial(q, k_cache, v_cache, lengths, scale, out)

    def decode_merge(self, parts, out_dtype):
        return self.inner.decode_merge(parts, out_dtype)

    def decode_whole(self, q, k_cache, v_cache, lengths, scale, out_dtype):
        return self.inner.decode_whole(q, k_cache, v_cache, lengths, scale, out_dtype)

    def linear_kv_state(self, k, v, acc):
        return self.inner.linear_kv_state(k, v, acc)

    def linear_grad_state(self, q, dout, hkv, acc):
        return self.inner.linear_grad_state(q, dout, hkv, acc)

    def linear_forward_run(self, q, k, v, prefix, acc):
        return self.inner.linear_forward_run(q, k, v, prefix, acc)

    def linear_backward_run(self, dout, q, k, v, prefix, suffix, acc):
        return self.inner.linear_backward_run(dout, q, k, v, prefix, suffix, acc)

    def linear_forward_full(self, q, total, acc):
        return self.inner.linear_forward_full(q, total, acc)

    def linear_backward_full(self, dout, k, v, total, grad_total, acc):
        return self.inner.linear_backward_full(dout, k, v, total, grad_total, acc)
