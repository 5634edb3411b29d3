"""The public functions: validate on every rank, agree across ranks, then run a strategy.

Shapes (B batch, S = seqlen_local = this rank's share of the sequence, H query heads, Hkv
key/value heads, D head dim):

* q, out, dout: (B, S, H, D);  k, v: (B, S, Hkv, D) with H a multiple of Hkv (GQA/MQA: query
  head h attends with kv head h // (H // Hkv), as in flash-attn; K/V are never replicated).
* lse: (B, H, S), the natural log of each row's softmax denominator (scaled scores), float32
  (float64 for float64 input).

`layout` says which global positions a rank's S rows hold (see `burstcu.layout`):
"contiguous" (rank r: one run of rows after those of ranks 0..r-1; ranks may hold any
lengths, S_r >= 1) or "zigzag" (rank r: chunks r and 2G-1-r of 2G near-equal chunks; with
cu_seqlens, pieces r and 2G-1-r of every document, as `shard` cuts them). The global length
N is the ranks' lengths added up; nothing needs to divide by G.
`causal` masks over *global* positions: query position i attends to key position j iff j <= i,
whichever ranks hold them. A row that attends to no key gets out = 0 and lse = -inf.
"""

from __future__ import annotations

import hashlib
import sys
import warnings

import numpy as np

from . import engine
from .plan import plan
from .group import Call, Group, local_group
from .ops.base import DelegatingOps
from .layout import Partition, check_layout, partition
from .validate import (ARRAY_NAMES, InputError, agree, caller_stacklevel, check_attention_inputs,
                       check_backward_inputs, check_cu_seqlens, check_flags, check_row_sums,
                       check_window, docs_digest, dtype_name, masked_array_problem, metadata,
                       parse_cu_seqlens, partition_of, resolve_scale)

STRATEGIES = engine.NAMES + ("auto",)


_DL_CUDA = 2  # DLDeviceType kDLCUDA (kDLCPU is 1)


def _is_cupy(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy"


def _dlpack_device(x) -> tuple[int, int] | None:
    """(DLPack device type, device id) that x reports through `__dlpack_device__`, else None."""
    report = getattr(x, "__dlpack_device__", None)
    if not callable(report):
        return None
    try:
        kind, device_id = report()
        return int(kind), int(device_id)
    except Exception:  # noqa: BLE001 - an array that cannot say is left to validation
        return None


def _cuda_device(x) -> int | None:
    """The CUDA device id x lives on (CuPy arrays; DLPack arrays on kDLCUDA), else None."""
    if _is_cupy(x):
        return int(x.device.id)
    where = _dlpack_device(x)
    return where[1] if where is not None and where[0] == _DL_CUDA else None


def _group_for(group: Group | None, q) -> Group:
    """`group`, or with None the one-process group for q's device: CuPy arrays and DLPack arrays
    on a CUDA device (torch, JAX, ...) -> "cupy"; everything else -> "numpy". Raises ValueError
    when q is on a GPU that CuPy cannot use in this process."""
    if group is not None:
        return group  # a closed group is refused by `Call`
    device_id = _cuda_device(q)
    if device_id is None:
        return local_group("numpy")
    try:
        return local_group("cupy")
    except Exception as exc:  # noqa: BLE001 - no GPU, no CuPy, no driver: one process, no peers
        raise ValueError(
            f"q is on CUDA device {device_id}, but the 'cupy' backend cannot start in this process "
            f"({exc.__class__.__name__}: {exc}); install burstcu[cuda13] where the GPU is "
            f"visible, or pass CPU arrays") from exc


def external_stream(handle: int):
    """A CuPy stream object for a CUDA stream another library created (torch's current stream,
    XLA's compute stream), so CuPy work issued under it (`with ...:`) joins that stream."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:                     # CuPy before the CUDA stream protocol
        return cupy.cuda.ExternalStream(handle)

    class _Handle:                                # the CUDA stream protocol: (version, handle)
        def __cuda_stream__(self):
            return 0, handle
    return from_external(_Handle())


def _device_problem(group: Group, names: tuple, arrays: tuple) -> InputError | None:
    """On the cupy backend, the first input that lives on a GPU other than CuPy's current
    device (the kernels and NCCL run on the current one), as a deferred error; else None."""
    if group.backend != "cupy":
        return None
    import cupy

    current = int(cupy.cuda.runtime.getDevice())
    for name, x in zip(names, arrays):
        device_id = _cuda_device(x)
        if device_id is not None and device_id != current:
            return InputError(ValueError, (
                f"{name} is on CUDA device {device_id} but the current CuPy device is {current}: "
                f"call cupy.cuda.Device({device_id}).use() before burstcu (with group=None), or "
                f"move the inputs to device {current}"))
    return None


# frameworks whose array type lives in another package than their `from_dlpack`
# (jax.Array's class is defined in jaxlib)
_FRAMEWORK_OF = {"jaxlib": "jax"}


def _exporter(x):
    """The `from_dlpack` of x's framework (jax.numpy, torch, ...), to hand results back in it:
    its array-API namespace's where it has one, else its package's; None when it cannot be
    found (the results then stay the backend's own arrays)."""
    namespace = getattr(x, "__array_namespace__", None)
    try:
        fn = getattr(namespace(), "from_dlpack", None) if callable(namespace) else None
    except Exception:  # noqa: BLE001 - a namespace that cannot be had: look up the package
        fn = None
    if callable(fn):
        return fn
    package = type(x).__module__.split(".")[0]
    for name in (_FRAMEWORK_OF.get(package), package):
        root = sys.modules.get(name) if name else None
        for owner in (root, getattr(root, "numpy", None)):
            fn = getattr(owner, "from_dlpack", None)
            if callable(fn):
                return fn
    return None


def _native(ops, *arrays):
    """Arrays of another framework (JAX, PyTorch, ...) viewed zero-copy through DLPack as the
    backend's own arrays, plus how to return results in the first one's framework (None: they
    already are native). Anything else is left for validation to reject with a clear error."""
    is_foreign = [not isinstance(x, ops.array_types) and hasattr(x, "__dlpack__") for x in arrays]
    if not any(is_foreign):
        return arrays, None
    converted = tuple(ops.xp.from_dlpack(x) if f else x for x, f in zip(arrays, is_foreign))
    return converted, _exporter(arrays[is_foreign.index(True)])


def _returned(export, results):
    return results if export is None else tuple(export(r) for r in results)


def _resolved(strategy: str, options: dict, group: Group, q, k, causal, layout: str,
              part: Partition, window=(-1, -1), docs=None) -> tuple[str, dict]:
    """strategy="auto" replaced by the choice of `burstcu.plan` for a training step (forward +
    backward), so attention and attention_backward pick alike; the same on every rank (it
    depends only on agreed shapes and options: the sequence extent is the mean shard's, since
    shards may differ)."""
    if strategy != "auto":
        return strategy, options
    seqlen = -(-part.total // part.size)
    q_shape, k_shape = ((x.shape[0], seqlen) + tuple(x.shape[2:]) for x in (q, k))
    choice = plan(q_shape, k_shape, group, causal=bool(causal), layout=part, dtype=q.dtype,
                  window_size=window, cu_seqlens=docs)
    return choice.strategy, choice.options


def _window(window_size) -> tuple[int, int]:
    """The validated window as plain ints."""
    return int(window_size[0]), int(window_size[1])


def _engine(strategy: str, options: dict):
    """The strategy object (`burstcu.engine`) with the forward/backward pair of `strategy`;
    options: its keywords (ulysses_degree for "usp"), None meaning the default."""
    return engine.get(strategy, **{k: v for k, v in options.items() if v is not None})


class _Tracking(DelegatingOps):
    """The group's local op, reporting each step the engine annotates ("fwd 2 compute") to the
    transport, so a failure or a timeout can say where it happened."""

    def __init__(self, inner, transport):
        super().__init__(inner)
        self.transport = transport

    def annotate(self, label: str):
        self.transport.where = label
        return self.inner.annotate(label)


def _untakeable(exc: Exception, arrays: tuple) -> InputError:
    """Why inputs could not be taken as the backend's arrays, with what to do instead: JAX
    tracers (jax.jit/grad/vmap), tensors requiring grad, bfloat16 over DLPack into NumPy. The
    kind is a builtin TypeError or ValueError (a framework's own exception class may not take a
    message: JAX's tracer errors want the tracer)."""
    kind = ValueError if isinstance(exc, ValueError) and not isinstance(exc, TypeError) else TypeError
    jax = sys.modules.get("jax")
    text = f"{exc.__class__.__name__}: {exc}".splitlines()[0]
    if isinstance(exc, MemoryError):
        return InputError(MemoryError, f"out of memory while taking the inputs ({text})")
    if jax is not None and any(isinstance(x, jax.core.Tracer) for x in arrays):
        return InputError(TypeError, "got JAX tracers (inside jax.jit, jax.grad or jax.vmap): use "
                                     "burstcu.jax.attention / linear_attention / decode, which "
                                     "are differentiable and run under jax.jit")
    if "require" in text and "grad" in text:
        return InputError(TypeError, f"cannot take tensors that require grad ({text}): use "
                                     f"burstcu.torch.attention for autograd, or pass .detach()")
    if "dtype" in text.lower() and any("bfloat16" in str(getattr(x, "dtype", "")) for x in arrays):
        return InputError(TypeError, f"bfloat16 arrays cannot cross DLPack into NumPy ({text}): "
                                     f"use burstcu.torch / burstcu.jax, or NumPy arrays of "
                                     f"ml_dtypes.bfloat16")
    return InputError(kind, f"cannot take these inputs: {text}")


def _agreed(call: Call, group: Group, arrays: tuple, what: str, local_check, finish=None):
    """Everything a rank checks alone, then one agreement round, then the same outcome on every
    rank: an exception everywhere, or (native arrays, exporter, extra) where
    local_check(native arrays) -> (InputError or None, metadata, extra, local length) and, if
    given, finish(every rank's local length, extra) -> extra' runs after the agreement, on
    what every rank knows alike (so what it raises, it raises everywhere).

    Nothing before `agree` may raise — a rank failing alone would leave the others waiting in
    the collective — so any exception from the local work becomes a deferred InputError.
    """
    err = meta = export = extra = length = None
    try:
        err = _device_problem(group, ARRAY_NAMES[what], arrays)
        if err is None:
            arrays, export = _native(group.ops, *arrays)
            err, meta, extra, length = local_check(arrays)
    except Exception as exc:  # e.g. a DLPack export that fails on this rank only
        err = _untakeable(exc, arrays)
    with call.raising_together():
        lengths = agree(group.transport, err, meta, what, length)
        if finish is not None:
            extra = finish(lengths, extra)
    return arrays, export, extra


def _checked(call: Call, group: Group, arrays: tuple, *, backward: bool, causal, softmax_scale,
             layout, strategy, options: dict, flags: dict, window=(-1, -1), cu_seqlens=None):
    """`_agreed` for softmax attention: (native arrays, exporter, resolved softmax scale,
    document boundaries as a tuple or None, the ranks' `burstcu.layout.Partition`)."""
    def local(native):
        err, scale, meta, docs = _check_local(
            group.ops, native, group.size, backward=backward, causal=causal,
            softmax_scale=softmax_scale, layout=layout, strategy=strategy, options=options,
            flags=flags, window=window, cu_seqlens=cu_seqlens)
        q = native[2 if backward else 0]
        return err, meta, (scale, docs), None if err else (int(q.shape[1]), _first_rows(q))

    def finish(reports, extra):
        scale, docs = extra
        lengths = [length for length, _ in reports]
        err, part = partition_of(layout, lengths, docs, bool(flags.get("uneven")),
                                 _max_positions(group))
        if err is not None:
            raise err.kind(err.message)
        _warn_if_all_the_same([rows for _, rows in reports], "q")
        return scale, docs, part

    what = "attention_backward" if backward else "attention"
    arrays, export, (scale, docs, part) = _agreed(call, group, arrays, what, local, finish)
    return arrays, export, scale, docs, part


def _first_rows(x) -> bytes | None:
    """A digest of x's first two rows along the sequence axis (axis 1) when x is in host memory
    (NumPy), else None (reading device memory would synchronise the host)."""
    if not isinstance(x, np.ndarray) or x.ndim < 2:
        return None
    return hashlib.blake2b(np.ascontiguousarray(x[:, :2]).tobytes(), digest_size=16).digest()


class SameShardsWarning(RuntimeWarning):
    """Every rank's shard starts with the same rows: most likely each rank passed the global
    array instead of its shard (`burstcu.shard` cuts them). Identical shards can be meant; then
    ``warnings.filterwarnings("ignore", category=burstcu.SameShardsWarning)`` silences it."""


def _warn_if_all_the_same(digests: list, name: str) -> None:
    """A SameShardsWarning on every rank (each sees every digest) when G > 1 ranks hold the same
    first rows, pointing at the caller's line (the first frame outside burstcu): most likely
    each passed the global array instead of its shard, which attends over G copies of the
    sequence. A warning, not an error: identical shards can be meant. (Where the shapes make it
    certain, documents that cover one copy of the rows, `validate.check_docs_total` raises.)"""
    if len(digests) > 1 and digests[0] is not None and all(d == digests[0] for d in digests):
        warnings.warn(f"every rank's {name} starts with the same rows: if each rank passed the "
                      f"global array instead of its shard, this attends over {len(digests)} "
                      f"copies of the sequence; cut shards with burstcu.shard(x, group, layout) "
                      f"(identical shards meant? warnings.filterwarnings('ignore', "
                      f"category=burstcu.SameShardsWarning))",
                      SameShardsWarning, stacklevel=caller_stacklevel())


def _max_positions(group: Group) -> int | None:
    """The most global positions the group's local op addresses (the kernels: 2^30)."""
    return 2**30 if group.backend in ("cupy", "emulated") else None


def _check_local(ops, arrays: tuple, size: int, *, backward: bool, causal, softmax_scale, layout,
                 strategy, options: dict, flags: dict, window=(-1, -1), cu_seqlens=None):
    """(InputError or None, resolved softmax scale, metadata, document boundaries or None) of
    this rank's native arrays in a group of `size` ranks. The ranks' sequence lengths may
    differ (the metadata leaves them out; `partition_of` checks them once all are known)."""
    q, k, v = arrays[1:4] if backward else arrays
    err = _check_options(strategy, options) or check_flags(**flags) or check_attention_inputs(
        q, k, v, array_types=ops.array_types, dtypes=ops.dtypes, layout=layout,
        softmax_scale=softmax_scale, op_rule=lambda q_, k_: ops.input_problem(q_, k_, backward))
    if err is None:
        err = _strategy_problem(strategy, options, q.shape, k.shape, size)
    if err is None:
        err = check_window(window, bool(causal), ops.masks_windows)
    docs = None
    if err is None:
        err, docs = parse_cu_seqlens(cu_seqlens)
    if err is None and backward:
        dout, _, _, _, out, lse = arrays
        err = check_backward_inputs(dout, out, lse, q, array_types=ops.array_types)
    if err is not None:
        return err, None, None, None
    scale = resolve_scale(softmax_scale, q.shape[-1])
    seq_axes = (1, 1, 1, 1, 1, 2) if backward else (1, 1, 1)
    # every flag is agreed on too (check=True changes what the backward ring sends)
    return None, scale, metadata(*arrays, seq_axes=seq_axes, layout=layout, strategy=strategy,
                                 softmax_scale=scale, window=tuple(int(w) for w in window),
                                 cu_seqlens=docs_digest(docs), **options,
                                 **{name: bool(value) for name, value in flags.items()}), docs


def _check_options(strategy: str, options: dict):
    if strategy not in STRATEGIES:
        return InputError(ValueError, f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    u = options.get("ulysses_degree")
    if u is not None:
        if strategy != "usp":  # "auto" picks a degree itself
            return InputError(ValueError, f"ulysses_degree is an option of strategy='usp', not of "
                                          f"strategy={strategy!r}")
        if isinstance(u, bool) or not isinstance(u, (int, np.integer)) or u < 1:
            return InputError(ValueError, f"ulysses_degree must be a positive int or None, got {u!r}")
    return None


def _strategy_problem(strategy: str, options: dict, q_shape, k_shape, size: int):
    """The strategy's own limits (Ulysses: heads divisible by the ranks), as an InputError."""
    if strategy == "auto":  # it only picks strategies that can take the shapes
        return None
    rule = getattr(_engine(strategy, options), "input_problem", None)
    problem = rule(q_shape, k_shape, size) if rule else None
    return None if problem is None else InputError(ValueError, problem)


def attention(q, k, v, group: Group | None = None, *, causal: bool = False,
              softmax_scale: float | None = None, layout: str = "contiguous",
              return_lse: bool = False, strategy: str = "burst", ulysses_degree: int | None = None,
              window_size: tuple[int, int] = (-1, -1), cu_seqlens=None, uneven: bool = False):
    """Exact softmax attention of this rank's queries over the keys of every rank in `group`.

    q: (B, S, H, D); k, v: (B, S, Hkv, D), this rank's shard under `layout` (see `shard`);
        S may differ between ranks (module docstring), every other extent may not.
    softmax_scale: defaults to 1/sqrt(D). causal: over global positions (module docstring).
    group: from `burstcu.init()`; None means one process (S is then the whole sequence), on
        the inputs' device: CUDA arrays (CuPy, or DLPack ones such as torch/JAX on a GPU) run
        the kernels on CuPy's current device, other arrays the NumPy backend.
    strategy: "burst" (K and V together in one message per ring step, double-buffered),
        "ring" (K and V as separate messages, the classic Ring Attention), "ulysses" (all-to-all
        to head shards: each rank attends over the whole sequence for H/G heads; needs H
        divisible by G, and Hkv dividing G or a multiple of it), "usp" (Ulysses inside groups of
        `ulysses_degree` ranks — u divides G and H; None picks the largest u <= 8 that works —
        and the burst ring across the G/u groups), "allgather" (gather all K and V, then attend
        locally), or "auto": the one `burstcu.plan` predicts fastest for these shapes on this
        group (printable: `print(burstcu.plan(q.shape, k.shape, group, causal=...))`). All give
        the same result.
    window_size: (left, right) sliding window (flash-attn's convention): a query at global
        position i sees keys in [i - left, i + right], -1 meaning unbounded on that side; with
        causal the right bound is the diagonal (right 0 or -1). Steps and tiles wholly outside
        are skipped; burst's K/V blocks (forward) and query bundles (backward) stop once
        no rank they would reach needs them.
    cu_seqlens: documents (varlen) — int array (any framework) of global boundaries
        0 = b_0 <= ... <= b_n = N, the same on every rank; a query at position i sees only
        keys of its own document [b_j, b_j+1) (together with causal and window_size); the
        same boundaries hold for every batch row. Any boundaries work (no divisibility), with
        every layout and strategy; with layout="zigzag" the shards are each document's 2G
        pieces (`shard(..., cu_seqlens=...)` cuts them: give shard the same cu_seqlens, since
        plain zigzag shards of the same lengths cannot be told apart), which balances causal
        work whatever the mix of lengths. A document is a set of rectangles of the steps
        (`burstcu.layout.blocks`): steps without a shared document compute nothing, and
        burst's (and usp's) ring stops a K/V block (forward) or a query bundle (backward)
        once no rank it would reach shares a document with it.
    uneven: contiguous shards of other than near-equal lengths are what the ranks mean to
        hold (default False: lengths differing by more than one row are refused on every rank,
        which catches a rank passing the global array instead of its shard).
    Returns out (B, S, H, D) in q's dtype and array type; with return_lse, (out, lse) where lse
    is (B, H, S) float32 (float64 for float64 input). Arrays of other frameworks that speak
    DLPack (JAX, PyTorch, ... on the backend's device) are viewed zero-copy and the results
    are handed back in the same framework.
    Every rank must call it with the same shapes, dtypes and options; a bad input raises
    ValueError/TypeError on every rank before any data moves.
    """
    group = _group_for(group, q)
    options = {"ulysses_degree": ulysses_degree}
    with Call(group, "attention forward") as call:
        (q, k, v), export, scale, docs, part = _checked(
            call, group, (q, k, v), backward=False, causal=causal, softmax_scale=softmax_scale,
            layout=layout, strategy=strategy, options=options,
            flags={"causal": causal, "return_lse": return_lse, "uneven": uneven}, window=window_size,
            cu_seqlens=cu_seqlens)
        strategy, options = _resolved(strategy, options, group, q, k, causal, layout, part,
                                       _window(window_size), docs)
        out, lse = _returned(export, _engine(strategy, options).forward(
            q, k, v, _Tracking(group.ops, group.transport), group.transport, causal=bool(causal),
            softmax_scale=scale, layout=part, trace=group.trace, window=_window(window_size),
            docs=docs))
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, group: Group | None = None, *,
                       causal: bool = False, softmax_scale: float | None = None,
                       layout: str = "contiguous", strategy: str = "burst",
                       ulysses_degree: int | None = None, check: bool = False,
                       window_size: tuple[int, int] = (-1, -1), cu_seqlens=None,
                       uneven: bool = False):
    """Gradients of `attention` with respect to this rank's q, k, v.

    dout, q, out: (B, S, H, D); k, v: (B, S, Hkv, D); lse: (B, H, S) as returned by
    `attention(..., return_lse=True)`; the other arguments as given to `attention`.
    Returns (dq, dk, dv) with q's, k's and v's shapes, dtype and array type.
    P is recomputed from lse; no score or probability matrix is stored beyond one tile.
    lse must have exactly the dtype and shape `attention` returns. check=True also verifies
    that lse belongs to these inputs and options: each row's recomputed probabilities are
    summed over every ring step (the sums travel with dQ) and must add up to 1, else ValueError
    on every rank. It costs a (B, H, S) accumulator in the messages and one more agreement
    round, and on the CUDA kernels it runs the deterministic backward (whose dQ pass sums P).
    """
    group = _group_for(group, q)
    options = {"ulysses_degree": ulysses_degree}
    with Call(group, "attention backward") as call:
        (dout, q, k, v, out, lse), export, scale, docs, part = _checked(
            call, group, (dout, q, k, v, out, lse), backward=True, causal=causal,
            softmax_scale=softmax_scale, layout=layout, strategy=strategy, options=options,
            flags={"causal": causal, "check": check, "uneven": uneven}, window=window_size,
            cu_seqlens=cu_seqlens)
        row_sums = {"row_sums": group.ops.zeros(lse.shape, lse.dtype)} if check else {}
        strategy, options = _resolved(strategy, options, group, q, k, causal, layout, part,
                                       _window(window_size), docs)
        grads = _engine(strategy, options).backward(
            dout, q, k, v, out, lse, _Tracking(group.ops, group.transport), group.transport,
            causal=bool(causal), softmax_scale=scale, layout=part, trace=group.trace,
            window=_window(window_size), docs=docs, **row_sums)
        if check:
            call.transport.where = "check of the row sums of P"
            try:  # nothing may raise on one rank alone before the agreement (see _checked)
                verdict = check_row_sums(lse, row_sums["row_sums"], group.rank)
            except Exception as exc:
                verdict = InputError(ValueError, f"cannot check the row sums on rank {group.rank}: "
                                                 f"{exc.__class__.__name__}: {exc}")
            with call.raising_together():
                agree(group.transport, verdict, None, "attention_backward check")
        return _returned(export, grads)


# the keywords of `attention` that the autodiff adapters (burstcu.jax, burstcu.torch) pass
# through besides causal, softmax_scale, layout and strategy
ADAPTER_OPTIONS = ("window_size", "cu_seqlens", "uneven", "ulysses_degree", "check")


def adapter_options(options: dict) -> tuple[dict, dict]:
    """An adapter's extra keywords split into (the forward's, the backward's): `check` applies to
    the backward only. TypeError names an unknown one."""
    unknown = sorted(set(options) - set(ADAPTER_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; the options besides causal, "
                        f"softmax_scale, layout and strategy are {list(ADAPTER_OPTIONS)}")
    return {k: v for k, v in options.items() if k != "check"}, dict(options)


# -- linear attention --------------------------------------------------------------------------

LINEAR_STRATEGIES = engine.LINEAR_NAMES


def _linear_checked(call: Call, group: Group, arrays: tuple, *, backward: bool, causal, layout,
                    strategy):
    """`_agreed` for linear attention: (native arrays, exporter)."""
    def local(native):
        err, meta = _linear_check_local(group.ops, native, backward=backward, causal=causal,
                                        layout=layout, strategy=strategy)
        return err, meta, None, None

    what = "linear_attention_backward" if backward else "linear_attention"
    arrays, export, _ = _agreed(call, group, arrays, what, local)
    return arrays, export


def _linear_dtypes(ops) -> tuple:
    """What the array module of `ops` can compute linear attention in (CuPy has no bfloat16)."""
    return ("float16", "bfloat16", "float32", "float64") if ops.xp is np else ("float16", "float32", "float64")


def _linear_check_local(ops, arrays: tuple, *, backward: bool, causal, layout, strategy):
    """(InputError or None, metadata) of this rank's native arrays."""
    q, k, v = arrays[1:] if backward else arrays
    err = None
    if strategy not in LINEAR_STRATEGIES:
        err = InputError(ValueError, f"strategy must be one of {LINEAR_STRATEGIES}, not {strategy!r}")
    err = err or check_flags(causal=causal) or check_attention_inputs(
        q, k, v, array_types=ops.array_types, dtypes=_linear_dtypes(ops), layout=layout,
        softmax_scale=None)
    if err is None and layout == "zigzag" and q.shape[1] % 2:
        err = InputError(ValueError, f"linear attention's zigzag layout needs an even local "
                                     f"seqlen, got {q.shape[1]}")
    if err is None and backward:
        dout = arrays[0]
        if not isinstance(dout, ops.array_types):
            err = InputError(TypeError, f"dout must be an array like q, got {type(dout).__name__}")
        elif tuple(dout.shape) != tuple(q.shape):
            err = InputError(ValueError, f"dout must have q's shape {tuple(q.shape)}, got "
                                         f"{tuple(dout.shape)}")
        elif dtype_name(dout) != dtype_name(q):
            err = InputError(TypeError, f"dout must have q's dtype {dtype_name(q)}, got "
                                        f"{dtype_name(dout)}")
    if err is not None:
        return err, None
    return None, metadata(*arrays, layout=layout, strategy=strategy, causal=bool(causal))


def linear_attention(q, k, v, group: Group | None = None, *, causal: bool = False,
                     layout: str = "contiguous", strategy: str = "lasp2"):
    """Basic linear attention (unnormalised, phi = identity, as LASP-2 defines it) of this
    rank's queries over every rank's keys: per head, with query head h using kv head
    h // (H // Hkv),
        non-causal   out_i = q_i (sum_j k_j^T v_j)        over every position j
        causal       out_i = sum_{j <= i} (q_i . k_j) v_j   (global positions, as `layout` says)
    q: (B, S, H, D); k, v: (B, S, Hkv, D), this rank's shard (`shard`). Returns out (B, S, H, D)
    in q's dtype and array type; computed in float32 (float64 for float64 input).
    strategy: "lasp2" (one all-gather of the D x D states a pass, overlapping the local work;
        `burstcu.engine.lasp2`) or "lasp1" (the states passed rank to rank along the sequence,
        one hop at a time; `burstcu.engine.lasp1`). Both give the same result up to rounding.
    Validation and agreement as in `attention`: a bad input raises on every rank.
    """
    group = _group_for(group, q)
    with Call(group, "linear attention forward") as call:
        (q, k, v), export = _linear_checked(call, group, (q, k, v), backward=False, causal=causal,
                                            layout=layout, strategy=strategy)
        out = engine.get_linear(strategy).forward(
            q, k, v, _Tracking(group.ops, group.transport), group.transport, causal=bool(causal),
            layout=layout, trace=group.trace)
    return _returned(export, (out,))[0]


def linear_attention_backward(dout, q, k, v, group: Group | None = None, *, causal: bool = False,
                              layout: str = "contiguous", strategy: str = "lasp2"):
    """Gradients (dq, dk, dv) of `linear_attention` with respect to this rank's q, k, v (shapes,
    dtype and array type of q, k, v); dout: (B, S, H, D). Nothing is kept from the forward."""
    group = _group_for(group, q)
    with Call(group, "linear attention backward") as call:
        (dout, q, k, v), export = _linear_checked(call, group, (dout, q, k, v), backward=True,
                                                  causal=causal, layout=layout, strategy=strategy)
        grads = engine.get_linear(strategy).backward(
            dout, q, k, v, _Tracking(group.ops, group.transport), group.transport,
            causal=bool(causal), layout=layout, trace=group.trace)
    return _returned(export, grads)


def shard(x, group: Group | None, layout: str = "contiguous", axis: int = 1, cu_seqlens=None):
    """This rank's piece of the global array `x` along `axis` (the sequence axis), N long.

    "contiguous": run `rank` of `size` near-equal runs (the first N % size ranks hold one row
    more). "zigzag": chunks `rank` and `2*size-1-rank` of 2*size near-equal chunks, in that
    order; with cu_seqlens, pieces `rank` and `2*size-1-rank` of *every document* cut into
    2*size, document by document (`burstcu.layout.partition`). Any N >= size works. No
    communication: every rank must hold the whole `x`. cu_seqlens: the documents `attention`
    will be given, checked against N (with "contiguous" they do not move any row). A
    numpy.ma.MaskedArray is refused (TypeError): its mask would be lost.
    """
    check_layout(layout)
    masked = masked_array_problem("x", x)
    if masked is not None:
        raise masked.exception()
    rank, size = (0, 1) if group is None else (group.rank, group.size)
    axis = axis % x.ndim
    part = _shard_partition(layout, size, x.shape[axis], cu_seqlens)
    pieces = [x[(slice(None),) * axis + (slice(seg.pos, seg.pos + seg.length),)]
              for seg in part.runs[rank]]
    return _joined(x, pieces, axis)


def _joined(x, pieces: list, axis: int):
    """The pieces of x joined along axis into one contiguous array of x's own framework: NumPy,
    CuPy, array-API arrays (JAX, ...) through their namespace's `concat`, torch tensors through
    `torch.cat`."""
    if isinstance(x, np.ndarray) or _is_cupy(x):
        xp = _array_module(x)
        return xp.ascontiguousarray(xp.concatenate(pieces, axis=axis))
    namespace = getattr(x, "__array_namespace__", None)
    if callable(namespace):
        return namespace().concat(pieces, axis=axis)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.cat(pieces, dim=axis).contiguous()
    return np.ascontiguousarray(np.concatenate(pieces, axis=axis))


def _shard_partition(layout: str, size: int, seqlen_global: int, cu_seqlens) -> Partition:
    """`shard`'s partition of a global sequence of `seqlen_global` rows (raises on bad input)."""
    err, docs = check_cu_seqlens(cu_seqlens, seqlen_global, layout)
    if err is not None:
        raise err.kind(err.message)
    return partition(layout, size, seqlen_global, docs if layout == "zigzag" else None)


def unshard(x_local, group: Group | None, layout: str = "contiguous", axis: int = 1,
            cu_seqlens=None, uneven: bool = False):
    """The global array on every rank, from each rank's `x_local` (the inverse of `shard`; with
    "contiguous", of any split the ranks' shards make in rank order).

    Collective: every rank calls it with the same dtype, axis and cu_seqlens and shapes equal
    but along `axis`, where shards may differ (zigzag: as `shard` cuts them; contiguous: by at
    most one row, or any lengths with uneven=True, as `attention` takes them). Traffic is
    counted in `group.stats` (uneven shards travel padded to the longest).
    """
    if group is None or group.size == 1:
        check_layout(layout)
        masked = masked_array_problem("x_local", x_local)
        if masked is not None:
            raise masked.exception()
        _shard_partition(layout, 1, x_local.shape[axis % x_local.ndim], cu_seqlens)
        return _joined(x_local, [x_local], axis % x_local.ndim)
    with Call(group, "unshard") as call:
        with call.raising_together():
            free = length = export = None
            try:  # nothing may raise on one rank alone before the gather (see _agreed)
                if not (isinstance(x_local, np.ndarray) or _is_cupy(x_local)):
                    (x_local,), export = _native(group.ops, x_local)  # torch, JAX, ... : DLPack
                check_layout(layout)
                axis = axis % x_local.ndim
                err, docs = parse_cu_seqlens(cu_seqlens)
                err = err or check_flags(uneven=uneven) or masked_array_problem("x_local", x_local)
                shape = tuple(int(n) for n in x_local.shape)
                free, length = shape[:axis] + ("S",) + shape[axis + 1:], shape[axis]
                dtype = str(x_local.dtype)
            except Exception as exc:  # what _untakeable names (bfloat16 over DLPack, ...) or a bad axis
                taken = _untakeable(exc, (x_local,))
                err, docs, dtype = InputError(taken.kind, f"unshard: {taken.message}"), None, None
            mine = (None,) * 7 if err else (free, dtype, axis, layout, docs_digest(docs), uneven, length)
            reports = group.transport.allgather_object((*mine, err.plain() if err else None), "unshard")
            failed = [(r, InputError.from_plain(e)) for r, (*_, e) in enumerate(reports) if e is not None]
            if failed:
                raise failed[0][1].exception(rank=failed[0][0])
            if any(rep[:6] != reports[0][:6] for rep in reports):
                raise ValueError(f"unshard needs the same shape (but along axis {axis}), dtype, "
                                 f"axis, layout, cu_seqlens and uneven on every rank; got "
                                 f"{[rep[:6] for rep in reports]}")
            err, part = partition_of(layout, [rep[6] for rep in reports], docs, bool(uneven))
            if err is not None:
                raise err.kind(err.message)
        return _returned(export, (_gathered(x_local, group, part, axis),))[0]


def _gathered(x_local, group: Group, part: Partition, axis: int):
    """The allgather and reassembly of `unshard`, after the ranks agreed on the shapes (each
    shard padded to the longest for the collective)."""
    xp = _array_module(x_local)
    moved = xp.moveaxis(x_local, axis, 0)
    longest = max(part.lengths)
    padded = xp.zeros((longest,) + moved.shape[1:], dtype=moved.dtype)
    padded[:moved.shape[0]] = moved
    gathered = xp.empty((group.size,) + padded.shape, dtype=moved.dtype)
    group.transport.allgather(padded, gathered)
    whole = xp.empty((part.total,) + moved.shape[1:], dtype=moved.dtype)
    for rank in range(group.size):
        for seg in part.runs[rank]:
            whole[seg.pos:seg.pos + seg.length] = gathered[rank, seg.local:seg.local + seg.length]
    return xp.ascontiguousarray(xp.moveaxis(whole, 0, axis))


def _array_module(x):
    if _is_cupy(x):
        import cupy
        return cupy
    return np
