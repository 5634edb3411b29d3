"""The public functions: validate on every rank, agree across ranks, then run a strategy.

Shapes (B batch, S = seqlen_local = this rank's share of the sequence, H query heads, Hkv
key/value heads, D head dim):

* q, out, dout: (B, S, H, D);  k, v: (B, S, Hkv, D) with H a multiple of Hkv (GQA/MQA: query
  head h attends with kv head h // (H // Hkv), as in flash-attn; K/V are never replicated).
* lse: (B, H, S), the natural log of each row's softmax denominator (scaled scores), float32
  (float64 for float64 input).

`layout` says which global positions a rank's S rows hold (see `burstcu.layout`):
"contiguous" (rank r: one run of rows after those of ranks 0..r-1; S_r >= 1 rows, the ranks'
lengths within one row of each other, or any lengths with uneven=True or a Sharding of
`lengths`), "zigzag" (rank r: chunks r and 2G-1-r of 2G near-equal chunks; with
cu_seqlens, pieces r and 2G-1-r of every document, as `shard` cuts them) or "documents" (zigzag
with the short documents held whole by one rank each). The global length N is the ranks'
lengths added up; nothing needs to divide by G.
`causal` masks over *global* positions: query position i attends to key position j iff j <= i,
whichever ranks hold them. A row that attends to no key gets out = 0 and lse = -inf.
"""

from __future__ import annotations

import sys

import numpy as np

from . import engine
from .arrays import (array_module, device_problem, group_for, is_cupy, is_jax, joined, native, returned,
                     to_jax, untakeable, wait_computed)
from .cpu_tensors import host_view, resolved, tensor_of
from .engine import decode as decode_strategy
from .group import CLOSED, Call, Group, not_a_group, says_ranks
from .layout import Partition, check_layout, partition
from .ops.base import DelegatingOps
from .plan import plan
from .validate import (ARRAY_NAMES, InputError, agree, appended_rows, appended_rows_problem,
                       axis_problem, cache_cut_problem,
                       cache_of_array, cache_rows_of, call_marks, call_site, calling_thread,
                       check_attention_call,
                       check_axis, check_block_mask, check_block_mask_extent, check_decode_call, check_flags,
                       check_linear_call, check_row_sums,
                       cut_of, cut_problem, docs_digest, ends_digest, first_rows_digest,
                       inherited_cut,
                       host_ints, lse_problem, mask_options, misread_array_problem, parse_cu_seqlens,
                       partition_of, q_summary, q_values_problem, remember_cut, rows_cut, site_digest,
                       sharding_keywords, thread_problem, uneven_problem, valid_rows_digest,
                       warn_if_all_the_same, warn_if_heads_look_like_rows, warn_if_sites_differ)

STRATEGIES = engine.NAMES + ("auto",)


def _resolved(strategy: str, options: dict, group: Group, q, k, causal, layout: str,
              part: Partition, window_size=(-1, -1), docs=None,
              block_mask=None) -> tuple[str, dict]:
    """strategy="auto" replaced by the choice of `burstcu.plan` for a training step (forward +
    backward), so attention and attention_backward pick alike; the same on every rank (it
    depends only on agreed shapes and options: the sequence extent is the mean shard's, since
    shards may differ)."""
    if strategy != "auto":
        return strategy, options
    seqlen = -(-part.total // part.size)
    q_shape, k_shape = ((x.shape[0], seqlen) + tuple(x.shape[2:]) for x in (q, k))
    choice = plan(q_shape, k_shape, group, causal=bool(causal), layout=part, dtype=q.dtype,
                  window_size=window_size, cu_seqlens=docs, block_mask=block_mask)
    return choice.strategy, choice.options


def _window(window_size) -> tuple[int, int]:
    """The validated window as plain ints."""
    return int(window_size[0]), int(window_size[1])


def _engine(strategy: str, options: dict):
    """The strategy object (`burstcu.engine`) with the forward/backward pair of `strategy`;
    options: its keywords (ulysses_degree for "usp", bidirectional for "burst"), None and False
    meaning the default."""
    return engine.get(strategy, **{k: v for k, v in options.items() if v not in (None, False)})


class _Tracking(DelegatingOps):
    """The group's local op, reporting each step the engine annotates ("fwd 2 compute") to the
    transport, so a failure or a timeout can say where it happened."""

    def __init__(self, inner, transport):
        super().__init__(inner)
        self.transport = transport

    def annotate(self, label: str):
        self.transport.where = label
        return self.inner.annotate(label)


def _agreed(call: Call, group: Group, arrays: tuple, what: str, local_check, finish=None,
            problem: InputError | None = None):
    """Everything a rank checks alone, then one agreement round, then the same outcome on every
    rank: an exception everywhere, or (native arrays, exporter, extra) where
    local_check(native arrays) -> (InputError or None, metadata, extra, local length) and, if
    given, finish(every rank's local length, extra) -> extra' runs after the agreement, on
    what every rank knows alike (so what it raises, it raises everywhere). problem: what is
    wrong with the call before its arrays are looked at, raised on every rank alike.

    Nothing before `agree` may raise — a rank failing alone would leave the others waiting in
    the collective — so any exception from the local work becomes a deferred InputError.
    """
    err = meta = export = extra = length = None
    try:
        err = problem or device_problem(group.ops, ARRAY_NAMES[what], arrays)
        if err is None:
            arrays, export = native(group.ops, *arrays)
            err, meta, extra, length = local_check(arrays)
    except Exception as exc:  # e.g. a DLPack export that fails on this rank only
        err = untakeable(exc, arrays)
    with call.raising_together():
        lengths = agree(group.transport, err, meta, what, length)
        if finish is not None:
            extra = finish(lengths, extra)
    return arrays, export, extra


def misplaced_group(names: tuple, arrays: tuple) -> InputError | None:
    """A TypeError, for every rank, where a Group or Sharding sits in an array's place (an
    argument left out before it, so the group took its slot and the call has none), or None."""
    for name, x in zip(names, arrays):
        if isinstance(x, Group) or callable(getattr(x, "sharding_arguments", None)):
            kind = "Group" if isinstance(x, Group) else "Sharding"
            return InputError(TypeError, f"{name} is a burstcu.{kind} where an array goes: an "
                                         f"array is missing before it, or out of order (the group "
                                         f"comes after the arrays)")
    return None


def _as_error(problem: str | InputError | None) -> InputError | None:
    """A call's problem found before its arrays are checked, as the error every rank raises
    (a message alone: a ValueError)."""
    return problem if problem is None or isinstance(problem, InputError) else \
        InputError(ValueError, problem)


def _checked(call: Call, group: Group, arrays: tuple, *, backward: bool, causal, softmax_scale,
             layout, strategy, options: dict, flags: dict, window_size=(-1, -1), cu_seqlens=None,
             block_mask=None, problem: str | InputError | None = None,
             sharding_lengths: tuple | None = None,
             packed: bool = False):
    """`_agreed` for softmax attention: (native arrays, exporter, resolved softmax scale,
    document boundaries as a tuple or None, the ranks' `burstcu.layout.Partition`).
    problem: what is wrong with the call before its arrays are looked at (a keyword that
    disagrees with the Sharding passed, packed and batched arrays mixed), for an error on every
    rank; sharding_lengths: the rows each rank holds by the Sharding, checked against the
    ranks' shards; packed: q was given as (T, H, D) (for the warning on hidden states)."""
    def local(native):
        conflict = _as_error(problem)
        agreed = options if sharding_lengths is None else {
            **options, "sharding_lengths": tuple(sharding_lengths)}   # the ranks' Shardings agree
        err, scale, meta, docs = check_attention_call(
            group.ops, native, backward=backward, causal=causal, softmax_scale=softmax_scale,
            layout=layout, strategy=strategy, options=agreed, flags=flags,
            options_problem=conflict or _check_options(strategy, options),
            strategy_problem=lambda q_shape, k_shape: _strategy_problem(
                strategy, options, q_shape, k_shape, group.size),
            window_size=window_size, cu_seqlens=cu_seqlens, block_mask=block_mask)
        q = native[1 if backward else 0]          # (dout, q, k, v, out, lse) backward
        return err, meta, (scale, docs), None if err else (int(q.shape[1]), first_rows_digest(q),
                                                           int(q.shape[2]))

    def finish(reports, extra):
        scale, docs = extra
        lengths = [length for length, _, _ in reports]
        if layout == "contiguous" and not flags.get("uneven") and \
                max(lengths) - min(lengths) > 1 and _balanced_for(block_mask, lengths):
            raise ValueError(f"contiguous shards of {tuple(lengths)} rows: the ones "
                             f"burstcu.shard(x, group, block_mask=mask) cuts for this mask; pass "
                             f"uneven=True to the calls (or give a burstcu.Sharding(group, "
                             f"lengths=mask.balanced_lengths(G, N)) as the group)")
        err, part = partition_of(layout, lengths, docs, bool(flags.get("uneven")),
                                 group.ops.max_positions)
        err = err or check_block_mask_extent(block_mask, part.total, group.ops.max_positions)
        if err is not None:
            raise err.kind(err.message)
        if sharding_lengths is not None and part.lengths != tuple(sharding_lengths):
            raise ValueError(f"the ranks hold {list(part.lengths)} rows but the Sharding says "
                             f"{list(sharding_lengths)}: cut the shards with sharding.shard(x)")
        warn_if_all_the_same([rows for _, rows, _ in reports], "q")
        if not backward:   # the forward of the same arrays warned already
            warn_if_heads_look_like_rows(reports[0][2], lengths, packed)   # heads: agreed (metadata)
        return scale, docs, part

    what = "attention_backward" if backward else "attention"
    arrays, export, (scale, docs, part) = _agreed(call, group, arrays, what, local, finish)
    return arrays, export, scale, docs, part


def group_of(group):
    """The Group of `group`: a Group, None, or a `burstcu.Sharding` (its group)."""
    arguments = getattr(group, "sharding_arguments", None)
    return arguments()[0] if callable(arguments) else group


def _packed_problem(names: tuple, arrays: tuple, ndims: tuple) -> str | None:
    """Why packed (batch-less) and batched arrays are mixed in one call, or None: arrays[i]
    must have ndims[i] axes when q is packed."""
    wrong = [f"{n} has {getattr(x, 'ndim', '?')} axes" for n, x, want in zip(names, arrays, ndims)
             if getattr(x, "ndim", None) != want]
    return None if not wrong else ("q is packed (T, H, D: no batch axis), so every array must be: "
                                   + ", ".join(wrong))


def _batched(x, ndim: int):
    """x with a batch axis of 1 put in front when it has `ndim` - 1 axes (packed varlen inputs,
    flash-attn's (T, H, D) convention), else x as it is (validation judges it)."""
    return x[None] if getattr(x, "ndim", None) == ndim - 1 else x


def _check_options(strategy: str, options: dict):
    if strategy not in STRATEGIES:
        return InputError(ValueError, f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    both = options.get("bidirectional")
    if both is not None and not isinstance(both, (bool, np.bool_)):
        return InputError(TypeError, f"bidirectional must be True or False, got {both!r}")
    if both and strategy != "burst":   # "auto" offers it itself where it is predicted faster
        return InputError(ValueError, f"bidirectional is an option of strategy='burst', not of "
                                      f"strategy={strategy!r}")
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


def attention(q, k, v, group=None, *, causal: bool = False,
              softmax_scale: float | None = None, layout: str | None = None,
              return_lse: bool = False, strategy: str = "burst", ulysses_degree: int | None = None,
              bidirectional: bool = False, window_size: tuple[int, int] = (-1, -1), cu_seqlens=None,
              uneven: bool | None = None, block_mask=None):
    """Exact softmax attention of this rank's queries over the keys of every rank in `group`.

    q: (B, S, H, D); k, v: (B, S, Hkv, D), this rank's shard under `layout` (see `shard`);
        S may differ between ranks (module docstring), every other extent may not. Packed
        (flash-attn's varlen convention, no batch axis): q (T, H, D), k, v (T, Hkv, D) with
        documents packed back to back (cu_seqlens); out (T, H, D), lse (H, T).
    A `burstcu.Sharding` in place of the group (a group and the split of the sequence)
        supplies layout, cu_seqlens and uneven: a keyword given beside it that disagrees is a
        ValueError on every rank.
    softmax_scale: defaults to 1/sqrt(D). causal: over global positions (module docstring).
    group: from `burstcu.init()`; None means one process (S is then the whole sequence), on
        the inputs' device: CUDA arrays (CuPy, or DLPack ones such as torch/JAX on a GPU) run
        the kernels on CuPy's current device, other arrays the NumPy backend.
    strategy: "burst" (K and V together in one message per ring step, double-buffered),
        "ring" (K and V as separate messages, the classic Ring Attention), "ulysses" (all-to-all
        to head shards: each rank attends over the whole sequence for H/G heads; needs H
        divisible by G, and Hkv dividing G or a multiple of it), "usp" (Ulysses inside groups of
        `ulysses_degree` ranks — u divides G and H, and Hkv divides u or is a multiple of it;
        None picks the largest u <= 8 that works —
        and the burst ring across the G/u groups), "allgather" (gather all K and V, then attend
        locally), or "auto": the one `burstcu.plan` predicts fastest for these shapes on this
        group (printable: `print(burstcu.plan(q.shape, k.shape, group, causal=...))`; its
        `strategy` and `options` can be passed back). All give the same result.
    bidirectional: burst's K/V blocks split both ways round the ring where the cheapest trips
        tie (docs/strategies.md), fewer steps of two messages each; strategy="burst" only.
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
        work whatever the mix of lengths; with layout="documents" the short documents stay
        whole on one rank each, which computes them in its local step alone (many short
        documents: fewer, larger rectangles). A document is a set of rectangles of the steps
        (`burstcu.layout.blocks`): steps without a shared document compute nothing, and
        burst's (and usp's) ring stops a K/V block (forward) or a query bundle (backward)
        once no rank it would reach shares a document with it.
    block_mask: any mask as rectangles over global positions, `burstcu.BlockMask(q_ranges,
        k_ranges, kinds)` (MagiAttention's q_ranges, k_ranges and its four kinds "full",
        "causal", "inverse_causal", "bidir_causal"; `burstcu.blockmask`), the same on every
        rank and given alone (no causal, window_size or cu_seqlens beside it); every strategy
        and layout takes it, and burst's ring stops a block once no rank it would reach has a
        rectangle needing it. Rows that see no key get out 0 and lse -inf.
    uneven: contiguous shards of other than near-equal lengths are what the ranks mean to
        hold (left out: False, or the Sharding's; with False, lengths differing by more than
        one row are refused on every rank, which catches a rank passing the global array
        instead of its shard). Contiguous shards only: True with another layout is refused.
    Returns out (B, S, H, D) in q's dtype and array type; with return_lse, (out, lse) where lse
    is (B, H, S) float32 (float64 for float64 input). Arrays of other frameworks that speak
    DLPack (JAX, PyTorch, ... on the backend's device) are viewed zero-copy and the results
    are handed back in the same framework.
    Every rank must call it with the same shapes, dtypes and options; a bad input raises
    ValueError/TypeError on every rank before any data moves.
    """
    wait_computed((q, k, v))
    said = _says_its_cut(group, layout)
    group, layout, cu_seqlens, uneven, lengths, conflict = sharding_keywords(
        group, layout, cu_seqlens, uneven, block_mask)
    given = {"q": q, "k": k, "v": v}               # as the caller holds them (`call_marks`)
    cut = _rows_of_call(layout, cu_seqlens, group)
    positional = _positional(causal, window_size, cu_seqlens, block_mask)
    conflict = conflict or misplaced_group(("q", "k", "v"), (q, k, v)) or \
        cut_problem(("q", "k", "v"), (q, k, v), cut, positional=positional)
    packed = getattr(q, "ndim", None) == 3
    cut = inherited_cut((q,), _known(cut, said or positional), 0 if packed else 1)
    if packed:
        conflict = conflict or _packed_problem(("k", "v"), (k, v), (3, 3))
        q, k, v = (_batched(x, 4) for x in (q, k, v))
    group = group_for(group, q)
    options = {"ulysses_degree": ulysses_degree, "bidirectional": bidirectional}
    with Call(group, "attention forward") as call:
        (q, k, v), export, scale, docs, part = _checked(
            call, group, (q, k, v), backward=False, causal=causal, softmax_scale=softmax_scale,
            layout=layout, strategy=strategy, options=options,
            flags={"causal": causal, "return_lse": return_lse, "uneven": uneven}, window_size=window_size,
            cu_seqlens=cu_seqlens, block_mask=block_mask, problem=conflict,
            sharding_lengths=lengths, packed=packed)
        strategy, options = _resolved(strategy, options, group, q, k, causal, layout, part,
                                       _window(window_size), docs, block_mask)
        out, lse = returned(export, _engine(strategy, options).forward(
            q, k, v, _Tracking(group.ops, group.transport), group.transport, causal=bool(causal),
            softmax_scale=scale, layout=part, trace=group.trace,
            window_size=_window(window_size), cu_seqlens=docs, block_mask=block_mask))
    if packed:
        out, lse = out[0], lse[0]
    if cut is not None:
        remember_cut(out, *cut)                     # unshard(out) with another layout is refused
    sharded = cut is not None and cut[1] == (0 if packed else 1) and cut[0][3] > 1   # its sequence
    remember_cut(lse, ("lse", mask_options(causal, window_size, cu_seqlens, softmax_scale, q,
                                           block_mask), sharded, call_marks({**given, "out": out})),
                 1 if packed else 2)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, group=None, *,
                       causal: bool = False, softmax_scale: float | None = None,
                       layout: str | None = None, strategy: str = "burst",
                       ulysses_degree: int | None = None, bidirectional: bool = False,
                       check: bool = False, window_size: tuple[int, int] = (-1, -1), cu_seqlens=None,
                       uneven: bool | None = None, block_mask=None):
    """Gradients of `attention` with respect to this rank's q, k, v.

    dout, q, out: (B, S, H, D); k, v: (B, S, Hkv, D); lse: (B, H, S) as returned by
    `attention(..., return_lse=True)`; the other arguments as given to `attention`. Packed
    (no batch axis): dout, q, out (T, H, D), k, v (T, Hkv, D), lse (H, T), gradients 3-D.
    Returns (dq, dk, dv) with q's, k's and v's shapes, dtype and array type.
    P is recomputed from lse; no score or probability matrix is stored beyond one tile.
    lse must have exactly the dtype and shape `attention` returns; a host lse remembers the
    options, q, k, v and out of the call that returned it, and other ones are a ValueError on
    every rank (`validate.lse_problem`; lse.view() forgets them). check=True also verifies
    that lse belongs to these inputs and options: each row's recomputed probabilities are
    summed over every ring step (the sums travel with dQ) and must add up to 1, else ValueError
    on every rank. It costs a (B, H, S) accumulator in the messages and one more agreement
    round, and on the CUDA kernels it runs the deterministic backward (whose dQ pass sums P).
    """
    wait_computed((dout, q, k, v, out, lse))
    said = _says_its_cut(group, layout)
    group, layout, cu_seqlens, uneven, lengths, conflict = sharding_keywords(
        group, layout, cu_seqlens, uneven, block_mask)
    cut = _rows_of_call(layout, cu_seqlens, group)
    positional = _positional(causal, window_size, cu_seqlens, block_mask)
    conflict = conflict or misplaced_group(("dout", "q", "k", "v", "out", "lse"),
                                            (dout, q, k, v, out, lse))
    conflict = conflict or cut_problem(("dout", "q", "k", "v", "out"), (dout, q, k, v, out), cut,
                                       positional=positional)
    conflict = conflict or lse_problem(lse, mask_options(causal, window_size, cu_seqlens, softmax_scale,
                                                         q, block_mask),
                                       {"q": q, "k": k, "v": v, "out": out})
    packed = getattr(q, "ndim", None) == 3
    cuts = tuple(inherited_cut((x,), _known(cut, said or positional), 0 if packed else 1)
                 for x in (q, k, v))                                              # dq's, dk's, dv's
    if packed:
        conflict = conflict or _packed_problem(("dout", "k", "v", "out", "lse"),
                                               (dout, k, v, out, lse), (3, 3, 3, 3, 2))
        dout, q, k, v, out = (_batched(x, 4) for x in (dout, q, k, v, out))
        lse = _batched(lse, 3)
    group = group_for(group, q)
    options = {"ulysses_degree": ulysses_degree, "bidirectional": bidirectional}
    with Call(group, "attention backward") as call:
        (dout, q, k, v, out, lse), export, scale, docs, part = _checked(
            call, group, (dout, q, k, v, out, lse), backward=True, causal=causal,
            softmax_scale=softmax_scale, layout=layout, strategy=strategy, options=options,
            flags={"causal": causal, "check": check, "uneven": uneven}, window_size=window_size,
            cu_seqlens=cu_seqlens, block_mask=block_mask, problem=conflict,
            sharding_lengths=lengths)
        row_sums = {"row_sums": group.ops.zeros(lse.shape, lse.dtype)} if check else {}
        strategy, options = _resolved(strategy, options, group, q, k, causal, layout, part,
                                       _window(window_size), docs, block_mask)
        grads = _engine(strategy, options).backward(
            dout, q, k, v, out, lse, _Tracking(group.ops, group.transport), group.transport,
            causal=bool(causal), softmax_scale=scale, layout=part, trace=group.trace,
            window_size=_window(window_size), cu_seqlens=docs, block_mask=block_mask, **row_sums)
        if check:
            call.transport.where = "check of the row sums of P"
            try:  # nothing may raise on one rank alone before the agreement (see _checked)
                verdict = check_row_sums(lse, row_sums["row_sums"],
                                         _rows_that_see(part, group.rank, block_mask))
            except Exception as exc:
                verdict = InputError(ValueError, f"cannot check the row sums: "
                                                 f"{exc.__class__.__name__}: {exc}")
            with call.raising_together():
                agree(group.transport, verdict, None, "attention_backward check", sites=False)
        grads = returned(export, grads)
    grads = tuple(g[0] for g in grads) if packed else grads
    return _remembering_each(grads, cuts)


def _rows_that_see(part: Partition, rank: int, block_mask) -> np.ndarray:
    """(S,) bool: which of `rank`'s rows see a key under the mask. Without a block mask every
    row does (its own position: causal, windows and documents all keep the diagonal)."""
    if block_mask is None:
        return np.ones(part.lengths[rank], bool)
    return block_mask.row_pairs(part.total)[part.positions(rank)] > 0


def _positional(causal, window_size, cu_seqlens, block_mask=None) -> bool:
    """Whether an attention call's result depends on where its rows sit (`cut_problem`):
    causal, a window, documents or a block mask (anything unreadable counts as yes)."""
    try:
        return bool(causal) or cu_seqlens is not None or block_mask is not None or \
            [int(w) for w in window_size] != [-1, -1]
    except Exception:  # noqa: BLE001 - the call itself refuses it on every rank
        return True


def _says_its_cut(group, layout) -> bool:
    """Whether a call's own arguments say how its rows are cut (a layout, or a Sharding): what a
    call that no position changes (no mask) may remember of its results' layout when its inputs
    remember nothing (else its default layout would be a guess, refused beside rows cut
    otherwise)."""
    return layout is not None or callable(getattr(group, "sharding_arguments", None))


def _known(cut: tuple, layout_known: bool) -> tuple:
    """What a call knows of its rows' cut (`rows_cut`): all of it, or, where its layout is a
    default no mask depends on (`_says_its_cut`), the number of ranks alone (layout None: any
    layout), which still refuses the group left out and a shard cut again."""
    return cut if layout_known else ("rows", None, None, cut[3])


def _remembering_each(grads: tuple, cuts: tuple) -> tuple:
    """`grads`, each remembered with its input's cut (`inherited_cut`; dk lies as k, ...)."""
    for g, lies_as in zip(grads, cuts):
        if lies_as is not None:
            remember_cut(g, *lies_as)
    return grads


def _rows_of_call(layout, cu_seqlens, group) -> tuple:
    """How a call's layout and documents place the rows on `group`'s ranks (a Group or None:
    one; `validate.rows_cut`); documents it cannot read count as none (the call refuses them on
    every rank)."""
    err, docs = parse_cu_seqlens(cu_seqlens)
    return rows_cut(layout, None if err is not None else docs, getattr(group, "size", 1))


# the keywords of `attention` that the autodiff adapters (burstcu.jax, burstcu.torch) pass
# through besides causal, softmax_scale, layout and strategy
ADAPTER_OPTIONS = ("window_size", "cu_seqlens", "uneven", "ulysses_degree", "bidirectional", "check",
                   "block_mask")


def adapter_options(options: dict) -> tuple[dict, dict]:
    """An adapter's extra keywords split into (the forward's, the backward's): `check` applies to
    the backward only; each as its values stand when the call is made (`_values_now`). TypeError
    names an unknown one."""
    unknown = sorted(set(options) - set(ADAPTER_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; the options besides causal, "
                        f"softmax_scale, layout and strategy are {list(ADAPTER_OPTIONS)}")
    options = {name: _values_now(name, value) for name, value in options.items()}
    return {k: v for k, v in options.items() if k != "check"}, dict(options)


def _values_now(name: str, value):
    """An option's values as the call is made, in an object of their own: an adapter runs the
    backward later (torch autograd, jax.vjp) and, inside jax.jit, the forward too (a callback
    when the program runs, perhaps after JAX's asynchronous dispatch has returned), so a buffer
    the caller refills in place (the next batch's documents, a window) would otherwise reach
    them with its new values. cu_seqlens as a NumPy copy on the host; a list or NumPy array
    (a window_size) as a copy of its own kind; the rest (ints, bools, BlockMask) cannot change.
    A cu_seqlens whose values cannot be read here (a tracer among them, no integers) stays as
    it is: the call says why, on every rank."""
    if name == "cu_seqlens" and value is not None:
        try:
            return np.array(host_ints(value), copy=True)
        except Exception:  # noqa: BLE001 - the call's own check names what is wrong with it
            return value
    return value.copy() if isinstance(value, (list, np.ndarray)) else value


# -- linear attention --------------------------------------------------------------------------

LINEAR_STRATEGIES = engine.LINEAR_NAMES


def _linearsharding_keywords(group, layout) -> tuple:
    """(group, layout, conflict) of a linear-attention call: `validate.sharding_keywords`, and a Sharding with
    documents or uneven lengths is a conflict (linear attention takes neither)."""
    group, layout, docs, _, lengths, conflict = sharding_keywords(group, layout, None, None)
    if conflict is None and (docs is not None or lengths is not None):
        conflict = ("linear attention takes neither documents (cu_seqlens) nor uneven lengths: "
                    "pass a Sharding of layout only")
    return group, layout, conflict


def _balanced_for(block_mask, lengths: list) -> bool:
    """Whether the ranks' `lengths` are those `shard(..., block_mask=block_mask)` cuts."""
    if not hasattr(block_mask, "balanced_lengths") or min(lengths) < 1:
        return False
    try:
        return tuple(lengths) == block_mask.balanced_lengths(len(lengths), sum(lengths))
    except ValueError:   # a mask the call refuses on its own
        return False


def _linear_checked(call: Call, group: Group, arrays: tuple, *, backward: bool, causal, layout,
                    strategy, sharding_conflict: str | InputError | None = None):
    """`_agreed` for linear attention: (native arrays, exporter, the ranks' Partition: the
    shards `burstcu.shard` cuts under `layout`, of any length, checked on every rank alike).
    sharding_conflict: what the Sharding passed says that linear attention cannot take, or a
    keyword disagreeing with it."""
    def local(native):
        if sharding_conflict is not None:
            return _as_error(sharding_conflict), None, None, None
        err, meta = check_linear_call(group.ops, native, backward=backward, causal=causal,
                                      layout=layout, strategy=strategy, strategies=LINEAR_STRATEGIES)
        q = native[1 if backward else 0]          # (dout, q, k, v) backward
        return err, meta, None, None if err else (int(q.shape[1]), int(q.shape[2]),
                                                  first_rows_digest(q))

    def finish(reports, extra):
        warn_if_all_the_same([rows for _, _, rows in reports], "q")
        if not backward:   # the forward of the same arrays warned already
            warn_if_heads_look_like_rows(reports[0][1], [rows for rows, _, _ in reports])
        err, part = partition_of(layout, [rows for rows, _, _ in reports], None, uneven=None)
        if err is None and len({len(runs) for runs in part.runs}) > 1:   # a rank short of a run
            need = "G" if layout == "contiguous" else "2 G (two pieces a rank; or N = G, one row a rank)"
            err = InputError(ValueError, f"linear attention's {layout} layout needs N >= {need} "
                                         f"rows: got N = {part.total} over G = {part.size} ranks")
        if err is not None:
            raise err.exception()
        return part

    what = "linear_attention_backward" if backward else "linear_attention"
    return _agreed(call, group, arrays, what, local, finish)


def linear_attention(q, k, v, group=None, *, causal: bool = False,
                     layout: str | None = None, strategy: str = "lasp2"):
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
    wait_computed((q, k, v))
    said = _says_its_cut(group, layout)
    group, layout, conflict = _linearsharding_keywords(group, layout)
    cut = rows_cut(layout, None, getattr(group, "size", 1))
    positional = _positional(causal, (-1, -1), None)
    conflict = conflict or misplaced_group(("q", "k", "v"), (q, k, v)) or \
        cut_problem(("q", "k", "v"), (q, k, v), cut, positional=positional)
    cut = inherited_cut((q,), _known(cut, said or positional), 1)
    group = group_for(group, q)
    with Call(group, "linear attention forward") as call:
        (q, k, v), export, part = _linear_checked(call, group, (q, k, v), backward=False,
                                                  causal=causal, layout=layout, strategy=strategy,
                                                  sharding_conflict=conflict)
        out = engine.get_linear(strategy).forward(
            q, k, v, _Tracking(group.ops, group.transport), group.transport, causal=bool(causal),
            layout=part, trace=group.trace)
    out = returned(export, (out,))[0]
    if cut is not None:
        remember_cut(out, *cut)
    return out


def linear_attention_backward(dout, q, k, v, group=None, *, causal: bool = False,
                              layout: str | None = None, strategy: str = "lasp2"):
    """Gradients (dq, dk, dv) of `linear_attention` with respect to this rank's q, k, v (shapes,
    dtype and array type of q, k, v); dout: (B, S, H, D). Nothing is kept from the forward."""
    wait_computed((dout, q, k, v))
    said = _says_its_cut(group, layout)
    group, layout, conflict = _linearsharding_keywords(group, layout)
    cut = rows_cut(layout, None, getattr(group, "size", 1))
    positional = _positional(causal, (-1, -1), None)
    conflict = conflict or misplaced_group(("dout", "q", "k", "v"), (dout, q, k, v)) or \
        cut_problem(("dout", "q", "k", "v"), (dout, q, k, v), cut, positional=positional)
    cuts = tuple(inherited_cut((x,), _known(cut, said or positional), 1)
                 for x in (q, k, v))                                              # dq's, dk's, dv's
    group = group_for(group, q)
    with Call(group, "linear attention backward") as call:
        (dout, q, k, v), export, part = _linear_checked(
            call, group, (dout, q, k, v), backward=True, causal=causal, layout=layout,
            strategy=strategy, sharding_conflict=conflict)
        grads = engine.get_linear(strategy).backward(
            dout, q, k, v, _Tracking(group.ops, group.transport), group.transport,
            causal=bool(causal), layout=part, trace=group.trace)
    return _remembering_each(returned(export, grads), cuts)


# -- decode against a sharded KV cache ------------------------------------------------------------

def decode(q, k_cache, v_cache=None, group: Group | None = None, *, cache_seqlens=None,
           softmax_scale: float | None = None, return_lse: bool = False):
    """Attention of the new tokens q over every rank's KV cache rows (`burstcu.engine.decode`:
    one partial a rank, one all-gather of the partials, the same merge on every rank; at one
    rank the op ends its partial itself).

    `decode(q, cache)` with a `burstcu.KVCache` is `cache.decode(q, ...)` (its arrays, group and
    row counts).

    q: (B, T, H, D), the same on every rank (T new tokens, usually 1; their own K/V already in
    the cache; they see every valid cache row, no causal order among them). k_cache, v_cache:
    (B, S_cache, Hkv, D), this rank's shard in any order. cache_seqlens: (B,) ints, this rank's
    valid rows per batch row (0 allowed; None: all S_cache); rows past them are never read.
    Returns out (B, T, H, D) in q's dtype and array type, identical on every rank; with
    return_lse, (out, lse (B, H, T) float32; float64 for float64 q). A batch row with no valid
    row anywhere gets out 0 and lse -inf. Validation and agreement as `attention`: a bad input
    or ranks disagreeing raise on every rank before the gather; a cache `shard` cut for another
    number of ranks (the group left out) is refused, and caches whose valid rows start and end
    alike on every rank (the global arrays on every rank) warn (`burstcu.SameShardsWarning`).
    """
    wait_computed((q, k_cache, v_cache, cache_seqlens))
    agreed, group, rows, problem, appended = {}, group_of(group), None, None, ()
    cache, cache_arguments = k_cache, getattr(k_cache, "decode_arguments", None)
    if callable(cache_arguments):                 # a KVCache
        from_cache = cache_arguments()
        if v_cache is not None or cache_seqlens is not None or group not in (None, from_cache[2]):
            problem = InputError(TypeError, "decode(q, cache) takes the cache's own arrays, group and "
                                            "row counts: pass no v_cache, group or cache_seqlens "
                                            "with a KVCache")
        # rows: what the kernels read (a paged cache's pages and table); k_cache, v_cache: what
        # the checks see, (B, S_cache, Hkv, D)
        k_cache, v_cache, group, cache_seqlens, agreed, rows, appended = from_cache
    elif v_cache is None:
        problem = InputError(TypeError, "decode(q, k_cache, v_cache, ...) needs v_cache (or pass a "
                                        "KVCache)")
    else:
        problem = misplaced_group(("q", "k_cache", "v_cache"), (q, k_cache, v_cache)) or \
            _cache_arrays_problem(k_cache, v_cache, cache_seqlens)
    group = group_for(group, q)
    if problem is None and rows is None:          # arrays, not a KVCache: cut for this group?
        said = cache_cut_problem(("k_cache", "v_cache"), (k_cache, v_cache),
                                 getattr(group, "size", 1))   # not a group: `Call` says so
        problem = None if said is None else InputError(ValueError, said)
    appended_summary = appended_rows(appended)    # (rows, their calls and tokens) or None
    with Call(group, "decode") as call:
        def check(native_arrays):
            err, meta, extra = check_decode_call(group.ops, native_arrays, cache_seqlens,
                                                 softmax_scale, return_lse, agreed, group.size)
            if err is not None or group.size == 1:
                return err, meta, extra, None
            rows_digest = None if rows is not None else valid_rows_digest(native_arrays[1], extra[0])
            return err, meta, extra, (q_summary(native_arrays[0]), rows_digest, appended_summary and
                                      (q_summary(appended_summary[0]), appended_summary[1]))

        def same_tokens(summaries, extra):   # every rank holds every summary: raises alike
            problems = [q_values_problem([s and s[0] for s in summaries]),
                        appended_rows_problem([s and s[2] for s in summaries])]
            if any(problems):
                raise ValueError("; ".join(filter(None, problems)))
            if appended:
                cache.appends_compared(len(appended))   # kept until compared: a failed call keeps them
            warn_if_all_the_same([s and s[1] for s in summaries], "k_cache")
            return extra

        (q, k_cache, v_cache), export, (lengths, scale) = _agreed(
            call, group, (q, k_cache, v_cache), "decode", check, same_tokens, problem)
        out, lse = decode_strategy.decode(q, *(rows or (k_cache, v_cache)), lengths, scale,
                                          _Tracking(group.ops, group.transport), group.transport)
    results = returned(export, (out, lse))
    return results if return_lse else results[0]


def _cache_arrays_problem(k_cache, v_cache, cache_seqlens) -> InputError | None:
    """decode given a KVCache's own `k`, `v` as arrays: a paged cache's page pool (read as batch
    rows, whatever the row counts), or, without cache_seqlens (every row read as valid), a
    cache's array or rows of it (`cache.k[:, :n]`, as a cache that is not sharded would be
    sliced) some of which this rank has not filled yet: a ValueError, or None."""
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        cache = cache_of_array(x)
        if cache is not None and cache.paged:
            return InputError(ValueError, f"{name} is a paged KVCache's page pool, which decode "
                                          f"would read as batch rows: pass the cache itself, "
                                          f"decode(q, cache)")
        if cache_seqlens is not None:
            continue
        if cache is not None and int(cache.seqlens.min()) < cache.capacity:
            return InputError(ValueError, f"{name} is a KVCache's own array, which decode reads "
                                          f"whole without cache_seqlens, its rows not filled yet "
                                          f"too: pass the cache itself, decode(q, cache), or "
                                          f"cache_seqlens=cache.seqlens")
        held = cache_rows_of(x) if cache is None else None
        if held is not None:
            cache, (b0, b1), (r0, r1) = held
            filled = cache.seqlens[b0:b1]
            if int(filled.min()) < r1:
                return InputError(ValueError, (
                    f"{name} holds rows {r0}..{r1 - 1} of batch rows {b0}..{b1 - 1} of a KVCache's "
                    f"array, which decode reads as valid without cache_seqlens, but this rank has "
                    f"filled only {int(filled.min())} row(s) of one of them (the cache deals each "
                    f"new row to the rank holding fewest: a rank holds about 1/G of the tokens): "
                    f"pass the cache itself, decode(q, cache), or cache_seqlens, this rank's filled "
                    f"rows among those given (cache.seqlens counts them from row 0)"))
    return None


def shard(x, group, layout: str | None = None, axis: int = 1, cu_seqlens=None, block_mask=None):
    """This rank's piece of the global array `x` along `axis` (the sequence axis), N long.

    "contiguous": run `rank` of `size` near-equal runs (the first N % size ranks hold one row
    more). "zigzag": chunks `rank` and `2*size-1-rank` of 2*size near-equal chunks, in that
    order; with cu_seqlens, pieces `rank` and `2*size-1-rank` of *every document* cut into
    2*size, document by document (`burstcu.layout.partition`). "documents": as "zigzag", but a
    short document goes whole to one rank, dealt out so that no rank holds more than 5% of a
    share more rows or causal pairs than zigzag's fullest rank (`burstcu.layout`; a rank may
    hold fewer rows). Any N >= size works. No
    communication: every rank must hold the whole `x` (a shard it remembers cutting for several
    ranks is refused, ValueError). cu_seqlens: the documents `attention`
    will be given, checked against N (with "contiguous" they do not move any row). A
    numpy.ma.MaskedArray is refused (TypeError): its mask would be lost. group: a group, None
    (one rank), or a `burstcu.Sharding` (its layout, documents and lengths; a keyword that
    disagrees raises ValueError). No communication, so an error is this rank's alone.
    block_mask: a `burstcu.BlockMask`: contiguous shards whose queries keep about the same number
    of pairs (`BlockMask.balanced_lengths`), for `attention(..., block_mask=..., uneven=True)`
    (or build a `Sharding(group, lengths=mask.balanced_lengths(size, N))` once).
    """
    group, layout, cu_seqlens, _, lengths, conflict = sharding_keywords(group, layout, cu_seqlens, None)
    if conflict is not None:
        raise ValueError(conflict)
    if group is not None and not says_ranks(group):
        raise TypeError(f"shard: {not_a_group(group)}")
    not_array = _not_an_array("shard", "x", x)
    if not_array is not None:
        raise not_array.exception()
    if block_mask is not None:
        err = check_block_mask(block_mask, False, (-1, -1), None, True)
        if err is not None:
            raise err.exception()
        if layout != "contiguous" or cu_seqlens is not None or lengths is not None:
            raise ValueError("shard(..., block_mask=...) cuts contiguous shards balanced for the "
                             "mask: give it with the contiguous layout, without cu_seqlens or a "
                             "Sharding's lengths")
        lengths = block_mask.balanced_lengths(1 if group is None else group.size,
                                              x.shape[check_axis(axis, x.ndim, "x")])
    check_layout(layout)
    misread = misread_array_problem("x", x)
    if misread is not None:
        raise misread.exception()
    rank, size = (0, 1) if group is None else (group.rank, group.size)
    axis = check_axis(axis, x.ndim, "x")
    held, seq = cut_of(x), 0 if x.ndim == 3 else 1
    if size > 1 and held is not None and held[0][0] == "rows" and held[1] == axis and \
            (held[0][3] or 1) > 1:   # one process cuts nothing: nothing to refuse
        raise ValueError(f"shard: x is already one rank's shard of {held[0][3]} (burstcu.shard "
                         f"cut it, or a call returned it for its rows): shard takes the global "
                         f"array, the same on every rank. To cut this piece again all the same, "
                         f"pass a view (x[:]): the memory is of this array object")
    part = _shard_partition(layout, size, x, axis, cu_seqlens, lengths)
    pieces = [x[(slice(None),) * axis + (slice(seg.pos, seg.pos + seg.length),)]
              for seg in part.runs[rank]]
    piece = joined(x, pieces, axis)
    if axis != seq and held is not None and held[0][0] == "rows" and held[1] == seq:
        remember_cut(piece, *held)      # heads (or a batch) cut from a shard: its rows as they were
    else:
        remember_cut(piece, _rows_of_call(layout, cu_seqlens, group), axis)   # another layout: refused
    return piece


def _shard_partition(layout: str, size: int, x, axis: int, cu_seqlens, lengths: tuple | None = None,
                     name: str = "x") -> Partition:
    """`shard`'s partition of the global sequence, the rows of `x` along `axis` (raises on bad
    input, calling x `name`); lengths: each rank's rows (contiguous shards of those lengths), which
    must add up to x's rows on one rank as on several."""
    seqlen_global = x.shape[axis]
    err, docs = parse_cu_seqlens(cu_seqlens)
    if err is not None:
        raise err.kind(err.message)
    ends = _docs_end_problem(name, seqlen_global, axis, x.ndim, x.shape[0], docs)
    if ends is not None:
        raise ValueError(ends)
    if lengths is not None:
        if sum(lengths) != seqlen_global:
            raise ValueError(f"a sequence of {seqlen_global} rows, but the Sharding's lengths "
                             f"add up to {sum(lengths)}")
        return partition("contiguous", size, seqlen_global, lengths=tuple(lengths) if size > 1 else None)
    return partition(layout, size, seqlen_global, None if layout == "contiguous" else docs)


def _docs_end_problem(name: str, rows: int, axis: int, ndim: int, rows0: int, docs) -> str | None:
    """Why documents `docs` (parsed cu_seqlens or None) do not cover the `rows` an `ndim`-D array
    `name` holds along `axis` (`rows0` along axis 0), or None. A 3-D array cut along another
    axis whose axis 0 has the rows cu_seqlens ends at may be packed (T, H, D): the message says
    to pass axis=0 (not for other 3-D arrays, such as an lse (B, H, S))."""
    if docs is None or docs[-1] == rows:
        return None
    hint = (" (if it is a packed (T, H, D) array, its documents lie along axis 0: pass axis=0)"
            if ndim == 3 and axis != 0 and rows0 == docs[-1] else "")
    return f"{name} has {rows} rows along axis {axis} but cu_seqlens ends at {docs[-1]}{hint}"


# unshard moves rows, never reads a value: integers of the same size gather any dtype's bits alike
UNSHARD_OTHER_DTYPE = ("unshard their bits instead, as integers of the same size viewed back "
                       "afterwards (torch: x.view(torch.uint8), then .view(the dtype))")
UNSHARD_BFLOAT16 = ("unshard their bits instead, as 16-bit integers viewed back afterwards "
                    "(torch: x.view(torch.int16), then .view(torch.bfloat16); JAX: "
                    "jax.lax.bitcast_convert_type(x, jnp.int16), then back to jnp.bfloat16), or "
                    "NumPy arrays of ml_dtypes.bfloat16")


def unshard(x_local, group, layout: str | None = None, axis: int | None = None,
            cu_seqlens=None, uneven: bool | None = None):
    """The global array on every rank, from each rank's `x_local` (the inverse of `shard`; with
    "contiguous", of any split the ranks' shards make in rank order).

    Collective: every rank calls it with the same dtype, axis and cu_seqlens and shapes equal
    but along `axis`, where shards may differ (zigzag: as `shard` cuts them; contiguous: by at
    most one row, or any lengths with uneven=True, as `attention` takes them). Traffic is
    counted in `group.stats` (uneven shards travel padded to the longest). group may be a
    `burstcu.Sharding`: its layout, documents and lengths; a keyword that disagrees raises
    ValueError on every rank. A torch tensor's result carries no autograd history (as
    torch.distributed's all_gather), whatever the group's size; float8 tensors travel as
    their bytes. axis left out: 1, except that an array which remembers being cut along another
    axis (packed (T, H, D) rows, along 0) is refused on every rank, asking for it.
    """
    problem = None
    if axis is None:
        held = cut_of(x_local)
        if held is not None and held[0][0] == "rows" and held[1] != 1:
            problem = (f"x_local was cut along axis {held[1]} (its sequence), but unshard joins "
                       f"along axis 1 unless told, which would join other rows than the ones cut: "
                       f"pass axis={held[1]} (a burstcu.Sharding with the documents finds it)")
        axis = 1
    return gather_shards(x_local, group, layout, axis, cu_seqlens, uneven, problem)


def gather_shards(x_local, group, layout: str | None, axis: int, cu_seqlens, uneven: bool | None,
                  problem: str | None = None):
    """`unshard`, with `problem`: what the caller found wrong before the call (`Sharding.unshard`:
    an axis it cannot tell), a ValueError on every rank through the call's agreement."""
    wait_computed((x_local,))
    group, layout, cu_seqlens, uneven, lengths, conflict = sharding_keywords(group, layout, cu_seqlens,
                                                                      uneven)
    conflict = conflict or problem
    if group is not None and not isinstance(group, Group):
        raise TypeError(f"unshard: {not_a_group(group)}")
    if group is not None and group.closed:   # as every call's (a group of one makes no Call)
        raise ValueError(CLOSED)
    if group is None or group.size == 1:
        if conflict is not None:
            raise ValueError(conflict)
        not_array = _not_an_array("unshard", "x_local", x_local)
        if not_array is not None:
            raise not_array.exception()
        axis = check_axis(axis, x_local.ndim, "x_local")
        conflict = cut_problem(("x_local",), (x_local,), _rows_of_call(layout, cu_seqlens, None),
                               axis=axis)
        if conflict is not None:
            raise ValueError(conflict)
        check_layout(layout)
        misread = misread_array_problem("x_local", x_local) or _gatherable_problem(x_local)
        if misread is not None:
            raise misread.exception()
        if (mixed := uneven_problem(layout, uneven)) is not None:
            raise ValueError(mixed)
        _shard_partition(layout, 1, x_local, axis, cu_seqlens, name="x_local")
        held = _held_problem((x_local.shape[axis],), lengths)
        if held is not None:
            raise ValueError(held)
        x_local = resolved(x_local, detach=True)
        return joined(x_local, [x_local], axis)
    with Call(group, "unshard") as call:
        with call.raising_together():
            free = length = export = docs = dtype = float8 = None
            try:  # nothing may raise on one rank alone before the gather (see _agreed)
                err = (InputError(ValueError, conflict) if conflict is not None
                       else _not_an_array("unshard", "x_local", x_local)
                       or device_problem(group.ops, ("x_local",), (x_local,))
                       or axis_problem(axis, x_local.ndim, "x_local"))
                if err is None:
                    axis = int(axis) % x_local.ndim
                    cut = cut_problem(("x_local",), (x_local,),
                                      _rows_of_call(layout, cu_seqlens, group), axis=axis)
                    err = None if cut is None else InputError(ValueError, cut)
                if err is None:
                    x_local, float8 = _float8_bits(resolved(x_local, detach=True))
                    if not (isinstance(x_local, np.ndarray) or is_cupy(x_local)):
                        x_local, export = _host_tensor(x_local, group)   # CPU torch: NumPy
                        if export is None:
                            (x_local,), export = native(group.ops, x_local)  # torch, JAX, ...: DLPack
                    check_layout(layout)
                    err, docs = parse_cu_seqlens(cu_seqlens)
                    err = (err or check_flags(uneven=uneven) or misread_array_problem("x_local", x_local)
                           or _gatherable_problem(x_local))
                    shape = tuple(int(n) for n in x_local.shape)
                    free, length = shape[:axis] + ("S",) + shape[axis + 1:], shape[axis]
                    dtype = float8[0] if float8 else str(x_local.dtype)
            except Exception as exc:  # what untakeable names (bfloat16 over DLPack, ...), a bad layout
                taken = untakeable(exc, (x_local,), UNSHARD_BFLOAT16, UNSHARD_OTHER_DTYPE)
                err, docs, dtype = InputError(taken.kind, f"unshard: {taken.message}"), None, None
            mine = (None,) * 7 if err else (free, dtype, axis, layout, docs_digest(docs),
                                            (uneven, lengths), length)
            rows_digest = None if err else ends_digest(x_local, axis)
            site = call_site()
            reports = group.transport.allgather_object(
                (*mine, calling_thread(), err.plain() if err else None, rows_digest,
                 site_digest(site)), "unshard")
            crossed = thread_problem("unshard", [rep[7] for rep in reports])
            if crossed is not None:
                raise ValueError(crossed)
            failed = [(r, InputError.from_plain(rep[8])) for r, rep in enumerate(reports)
                      if rep[8] is not None]
            if failed:
                raise failed[0][1].exception(rank=failed[0][0])
            if any(rep[:6] != reports[0][:6] for rep in reports):
                raise ValueError(f"unshard needs the same shape (but along axis {axis}), dtype, "
                                 f"axis, layout, cu_seqlens and uneven on every rank; got "
                                 f"{[rep[:6] for rep in reports]}")
            rows = sum(rep[6] for rep in reports)
            ends = (_docs_end_problem(f"x_local (the {group.size} ranks' shards together)", rows, axis,
                                      x_local.ndim, x_local.shape[0] * group.size, docs)
                    if x_local.ndim == 3 and axis != 0 else None)
            if ends is not None:   # packed arrays joined along their heads (else partition_of says)
                raise ValueError(ends)
            err, part = partition_of(layout, [rep[6] for rep in reports], docs, bool(uneven))
            if err is not None:
                raise err.kind(err.message)
            held = _held_problem(part.lengths, lengths)
            if held is not None:
                raise ValueError(held)
            warn_if_all_the_same([rep[9] for rep in reports], "x_local", "joins")
            warn_if_sites_differ(group.transport, "unshard", site, [rep[10] for rep in reports])
        whole = returned(export, (_gathered(x_local, group, part, axis),))[0]
    return whole if float8 is None else float8[1](whole)


def _not_an_array(call: str, name: str, x) -> InputError | None:
    """A TypeError for an `x` that is no array (a list, a Python number), or None."""
    if hasattr(x, "ndim") and hasattr(x, "shape"):
        return None
    return InputError(TypeError, f"{call} takes an array (NumPy, CuPy, torch, JAX, ...) as {name}, "
                                 f"not a {type(x).__name__}: pass np.asarray({name})")


def _held_problem(held: tuple, lengths: tuple | None) -> str | None:
    """Why shards of `held` rows (rank by rank) are not those a Sharding of `lengths` cuts, or
    None (no lengths, or the same)."""
    if lengths is None or tuple(held) == tuple(lengths):
        return None
    return (f"the ranks hold {list(held)} rows but the Sharding says {list(lengths)}: cut the "
            f"shards with sharding.shard(x)")


def _host_tensor(x_local, group: Group) -> tuple:
    """(x_local as `unshard` gathers it, how to hand the result back, or None): on a host group,
    a CPU torch tensor (detached) as a NumPy view (`cpu_tensors.host_view`: bfloat16 through
    int16, which DLPack cannot carry into NumPy), handed back as a tensor of its dtype
    (`cpu_tensors.tensor_of`), as one rank returns; anything else as it is, with None (DLPack takes
    it, or refuses it, as a GPU group refuses host arrays). A CPU JAX array of bfloat16 (which
    DLPack cannot carry into NumPy either) goes as JAX's own NumPy view (ml_dtypes.bfloat16),
    handed back as a JAX array (`to_jax`)."""
    on_host = group.ops.device != "cuda"
    if on_host and is_jax(x_local) and str(getattr(x_local, "dtype", "")) == "bfloat16":
        return np.asarray(x_local), to_jax
    view = host_view(x_local) if on_host else x_local
    return (x_local, None) if view is x_local else (view, tensor_of)


def _float8_bits(x_local) -> tuple:
    """For a torch tensor or JAX array of a float8 dtype (NumPy and CuPy have none, so DLPack
    cannot carry it): (its bytes as uint8 of its framework, (its dtype's name, what turns the
    gathered bytes back into that dtype)); else (x_local, None)."""
    name = str(getattr(x_local, "dtype", "")).removeprefix("torch.")
    if not name.startswith("float8_"):
        return x_local, None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x_local, torch.Tensor):
        dtype = x_local.dtype
        return x_local.view(torch.uint8), (name, lambda whole: whole.view(dtype))
    if is_jax(x_local):
        from jax import lax
        dtype = x_local.dtype
        return lax.bitcast_convert_type(x_local, "uint8"), (
            name, lambda whole: lax.bitcast_convert_type(whole, dtype))
    return x_local, None


def _gatherable_problem(x_local) -> InputError | None:
    """Why `unshard` cannot send x_local's elements as bytes (Python objects), or None."""
    if getattr(x_local.dtype, "hasobject", False):
        return InputError(TypeError, f"unshard takes arrays of numbers (their elements travel "
                                     f"between ranks as bytes, at any group size alike): x_local of "
                                     f"dtype {x_local.dtype} holds Python objects")
    return None


def _gathered(x_local, group: Group, part: Partition, axis: int):
    """The allgather and reassembly of `unshard`, after the ranks agreed on the shapes (each
    shard padded to the longest for the collective)."""
    xp = array_module(x_local)
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


