"""Bodies for every strategy (burst, ring, allgather, ulysses, usp, "auto", and the linear lasp2
and lasp1), run on every rank under `mpiexec -n N` (any N) through tests/mpi/runner.py as
`strategy_bodies:<function>`: plain causal or not, windows, documents and uneven shards, and the
inputs each strategy refuses.

Each body checks its own rank's results against the independent float64 reference of
burstcu/testing/reference.py (the FlashAttention tolerance rule) and its own payload counters against the
byte/message formulas of `bodies.expected_traffic`, written out there rather than taken from burstcu.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

import burstcu
from burstcu.engine import lasp1
from burstcu.ops.base import as_dtype
from burstcu.testing.reference import attention_backward_ref, attention_ref, linear_attention_ref
from tests.mpi.bodies import (EPS, NAIVE, TRUTH, _check, attention_matches_reference, block_mask_of,
                              bundle_counts, dense_keep, make_inputs, my_rows,
                              on_rank0_then_bcast, ring_sends)


def strategy_matches_reference(strategy="ring", dtype="float32", cases=(), seqlen_local=24,
                               ulysses_degree=None):
    """`bodies.attention_matches_reference` for one strategy on the CPU backend."""
    return attention_matches_reference(dtype=dtype, cases=cases, seqlen_local=seqlen_local,
                                       strategy=strategy, seed=2000, ulysses_degree=ulysses_degree)


def strategies_agree(seqlen_local=16, causal=True, layout="zigzag"):
    """Every strategy gives the same out, lse and gradients to float64 rounding noise on one set
    of inputs (a cross-check independent of the reference's tolerance rule); Ulysses where the 4
    query heads split over the ranks."""
    group = burstcu.init(backend="numpy")
    size, rank = group.size, group.rank
    n = seqlen_local * size
    q, k, v, dout = make_inputs(77, 1, n, 4, 2, 16, "float64")
    rows = my_rows(layout, rank, size, n)
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
    results = {}
    names = ["burst", "ring", "allgather"] + (["ulysses"] if size in (1, 2, 4) else [])  # 4 heads
    other = [np.ascontiguousarray(x[:, ::-1]) * 3 for x in (ql, kl, vl, dol)]
    for strategy in names:
        # a call on other data of the same shapes first: the buffers each strategy keeps
        # between calls must carry nothing into the next
        o, l = burstcu.attention(*other[:3], group, causal=causal, layout=layout, return_lse=True,
                                 strategy=strategy)
        burstcu.attention_backward(other[3], *other[:3], o, l, group, causal=causal, layout=layout,
                                   strategy=strategy)
        out, lse = burstcu.attention(ql, kl, vl, group, causal=causal, layout=layout,
                                     return_lse=True, strategy=strategy)
        grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=causal,
                                           layout=layout, strategy=strategy)
        results[strategy] = (out, lse) + tuple(grads)
    worst = 0.0
    for strategy in names[1:]:
        for a, b in zip(results["burst"], results[strategy]):
            finite = np.isfinite(a)
            assert np.array_equal(finite, np.isfinite(b)), strategy
            worst = max(worst, float(np.abs(a[finite] - b[finite]).max(initial=0.0)))
    assert worst < 1e-12, worst  # float64 inputs: only summation order differs
    group.close()
    return {"max_diff": worst, "strategies": names}


def travelling_grads_keep_the_accumulator(seqlen_local=16, causal=True, layout="zigzag"):
    """The dK, dV that ring and allgather carry from rank to rank add up in the accumulation
    dtype and round to bfloat16 once, as burst's do: on bfloat16 inputs (MQA, 4 query heads on
    one kv head) every gradient is within one bfloat16 ulp of burst's. Rounding each step's
    partial to bfloat16 (or adding them in bfloat16) leaves several ulps on some element."""
    group = burstcu.init(backend="numpy")
    n = seqlen_local * group.size
    q, k, v, dout = make_inputs(78, 1, n, 4, 1, 16, "bfloat16")
    rows = my_rows(layout, group.rank, group.size, n)
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
    grads = {}
    for strategy in ("burst", "ring", "allgather"):
        out, lse = burstcu.attention(ql, kl, vl, group, causal=causal, layout=layout,
                                     return_lse=True, strategy=strategy)
        grads[strategy] = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=causal,
                                                     layout=layout, strategy=strategy)
    worst = {}
    for strategy in ("ring", "allgather"):
        for name, a, b in zip(("dq", "dk", "dv"), grads["burst"], grads[strategy]):
            a, b = a.astype(np.float64), b.astype(np.float64)
            larger = np.maximum(np.abs(a), np.abs(b))
            ulp = np.exp2(np.floor(np.log2(np.where(larger > 0, larger, 1.0))) - 7)  # 8-bit mantissa
            ulps = float((np.abs(a - b) / ulp).max())
            assert ulps <= 1.0, (strategy, name, ulps)
            worst[f"{strategy} {name}"] = ulps
    group.close()
    return worst


def ulysses_refuses_bad_head_counts(h=3, hkv=3):
    """Heads that do not split over the ranks: the same ValueError on every rank, before any
    data moves (the next call still works)."""
    group = burstcu.init(backend="numpy")
    n = 8 * group.size
    q, k, v, _ = make_inputs(5, 1, n, h, hkv, 8, "float32")
    rows = my_rows("contiguous", group.rank, group.size, n)
    ql, kl, vl = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v))
    try:
        burstcu.attention(ql, kl, vl, group, strategy="ulysses")
    except ValueError as exc:
        message = str(exc)
    else:
        raise AssertionError("no error")
    out = burstcu.attention(ql, kl, vl, group, strategy="burst")   # the group still works
    assert out.shape == ql.shape
    group.close()
    return {"error": message}


def usp_refuses_bad_degrees():
    """ulysses_degree that does not divide the ranks or the heads, or is given to another
    strategy: the same ValueError on every rank; the same call with a good degree then works."""
    group = burstcu.init(backend="numpy")
    n = 8 * group.size
    q, k, v, _ = make_inputs(5, 1, n, 4, 2, 8, "float32")
    rows = my_rows("contiguous", group.rank, group.size, n)
    ql, kl, vl = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v))
    errors = {}
    for name, how in {"degree 3": dict(strategy="usp", ulysses_degree=3),
                      "degree 0": dict(strategy="usp", ulysses_degree=0),
                      "degree for burst": dict(strategy="burst", ulysses_degree=2)}.items():
        try:
            burstcu.attention(ql, kl, vl, group, **how)
        except ValueError as exc:
            errors[name] = str(exc)
    assert set(errors) == {"degree 3", "degree 0", "degree for burst"}, errors
    out = burstcu.attention(ql, kl, vl, group, strategy="usp", ulysses_degree=2)
    assert out.shape == ql.shape
    group.close()
    return {"errors": errors}


def auto_runs_the_planned_strategy(causal=True, layout="zigzag", h=8, hkv=2, seqlen_local=16):
    """strategy="auto": the bytes this rank sends are those of `burstcu.plan`'s choice, the
    results are bitwise those of that strategy named explicitly, on every rank alike."""
    group = burstcu.init(backend="numpy")
    n = seqlen_local * group.size
    q, k, v, dout = make_inputs(9, 1, n, h, hkv, 8, "float32")
    rows = my_rows(layout, group.rank, group.size, n)
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
    chosen = burstcu.plan(ql.shape, kl.shape, group, causal=causal, layout=layout, dtype=ql.dtype)
    group.stats.reset()
    out, lse = burstcu.attention(ql, kl, vl, group, causal=causal, layout=layout, return_lse=True,
                                 strategy="auto")
    assert group.stats.bytes_sent == chosen.choice.forward_bytes, (chosen.choice, group.stats)
    grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=causal,
                                       layout=layout, strategy="auto")
    named = dict(strategy=chosen.strategy, **chosen.options)
    out2, lse2 = burstcu.attention(ql, kl, vl, group, causal=causal, layout=layout, return_lse=True,
                                   **named)
    grads2 = burstcu.attention_backward(dol, ql, kl, vl, out2, lse2, group, causal=causal,
                                        layout=layout, **named)
    assert all(np.array_equal(a, b) for a, b in zip((out, lse, *grads), (out2, lse2, *grads2)))
    group.close()
    return {"choice": chosen.choice.label}


def doc_boundaries(lengths, n: int):
    """(0, b_1, ..., n) from document lengths cycled until n is covered (None: no documents)."""
    if lengths is None:
        return None
    bounds, i = [0], 0
    while bounds[-1] < n:
        bounds.append(min(n, bounds[-1] + lengths[i % len(lengths)]))
        i += 1
    return tuple(bounds)


def case_rows(case: dict, size: int, n: int, docs, group) -> list:
    """Every rank's global positions under a case: "lengths" (contiguous shards of those
    lengths, a list per world size) or a near-equal split of n, written out here; zigzag and
    "documents" with documents as burstcu.shard cuts them (their pieces are checked in
    tests/test_documents.py; without documents "documents" is zigzag)."""
    layout = case["layout"]
    if layout != "contiguous" and docs is not None:
        whole = np.arange(n)[None, :, None]
        return [burstcu.shard(whole, SimpleNamespace(rank=r, size=size), layout,
                              cu_seqlens=list(docs))[0, :, 0] for r in range(size)]
    if layout == "contiguous":
        lengths = case.get("lengths", {}).get(str(size)) or \
            [n // size + (r < n % size) for r in range(size)]
        starts = np.cumsum([0] + list(lengths))
        return [np.arange(starts[r], starts[r + 1]) for r in range(size)]
    base, extra = divmod(n, 2 * size)           # 2G chunks, the first `extra` one row longer
    bounds = [c * base + min(c, extra) for c in range(2 * size + 1)]
    return [np.concatenate([np.arange(bounds[c], bounds[c + 1]) for c in (r, 2 * size - 1 - r)])
            for r in range(size)]


def mask_rects(name: str, n: int) -> list:
    """The rectangles (qs, qe, ks, ke, kind) of a named block mask over n positions:
    "question_answers": a question of n/3 rows (causal) and two answers, each seeing the whole
        question and itself causally but not the other answer;
    "four_kinds": causal, full, inverse_causal and bidir_causal rectangles of unequal sides,
        two of them sharing their query rows;
    "sparse": three small rectangles that leave most rows seeing no key (out 0, lse -inf)."""
    a, b = n // 3, (2 * n) // 3
    if name == "question_answers":
        return [(0, a, 0, a, "causal"), (a, b, 0, a, "full"), (a, b, a, b, "causal"),
                (b, n, 0, a, "full"), (b, n, b, n, "causal")]
    if name == "four_kinds":
        return [(0, b, 0, a + 1, "causal"), (0, b, a + 1, n, "inverse_causal"),
                (b, n, 0, b - 2, "full"), (b, n, b - 2, n, "bidir_causal")]
    if name == "sparse":
        return [(1, 3, n - 4, n, "full"), (n // 2, n // 2 + 2, 0, 5, "causal"),
                (n - 2, n, n - 2, n, "inverse_causal")]
    raise ValueError(f"no block mask named {name!r}")


def masked_attention_matches_reference(strategy="burst", dtype="float32", seqlen_local=12, cases=(),
                                       ulysses_degree=None, backend="numpy", options=None,
                                       headdim=8):
    """Sliding windows, documents and uneven shards (tests/test_mask_kinds.py's cases):
    out, lse, dq, dk, dv against a float64 reference over an explicit dense mask written here
    (key j visible to query i iff (not causal or j <= i) and i - left <= j <= i + right, -1
    unbounded, for a case's "window" (left, right)), within FlashAttention's tolerance rule;
    check=True passes. A case with "doc_lengths" also passes cu_seqlens: documents of those
    lengths, cycled until the sequence is full (the last one cut short), and the reference keeps
    only same-document pairs; one with "block_mask" (a name of `mask_rects`) passes that
    `burstcu.BlockMask`, the reference spelling out its rectangles. A case with "n" has that
    global length (any: shards differ by a row), one with "lengths" (per world size) contiguous
    shards of those lengths. Bytes sent are
    asserted for burst (rows of the blocks and bundles it passes on, each at its owner's
    length), ring and allgather; unshard gives the global output back. options: burstcu.init's
    keywords (e.g. the kernel table); headdim: of the inputs (4 query heads on 2 kv heads).
    Returns the number of cases, the step kernels the op launched (a kernel backend's) and how
    many of its list launches' groupings were packed and not."""
    group = burstcu.init(backend=backend, **(options or {}))
    launched: set = set()
    packed = []   # a kernel backend's list steps: whether each was packed (ops/cuda/packing.py)
    if hasattr(group.ops, "function"):   # the step kernels that ran, by name
        function, step_lists = group.ops.function, group.ops.step_lists
        group.ops.function = lambda name: launched.add(name.split("<")[0]) or function(name)

        def recorded(blocks, groupings):
            lists = step_lists(blocks, groupings)
            packed.extend(groups.packed for groups in lists)
            return lists
        group.ops.step_lists = recorded
    rank, size = group.rank, group.size
    # the kernels round P and dS to the input dtype, as a naive half-precision implementation does
    half = {"round_to": as_dtype(dtype)} if backend == "emulated" else {}
    how = dict(strategy=strategy) | ({"ulysses_degree": ulysses_degree} if ulysses_degree else {})
    for index, case in enumerate(cases):
        causal, layout, (left, right) = case["causal"], case["layout"], case.get("window", (-1, -1))
        lengths = case.get("lengths", {}).get(str(size))
        n = sum(lengths) if lengths else case.get("n", seqlen_local * size)
        docs = doc_boundaries(case.get("doc_lengths"), n)
        rects = mask_rects(case["block_mask"], n) if "block_mask" in case else None
        keep = dense_keep(np.arange(n), np.arange(n), causal, (left, right), docs, rects)
        q, k, v, dout = make_inputs(300 + index, 1, n, 4, 2, headdim, dtype)
        groups = case_rows(case, size, n, docs, group)
        rows = groups[rank]
        ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
        kw = dict(causal=causal, layout=layout, window_size=(left, right), **how,
                  **({} if docs is None else {"cu_seqlens": np.asarray(docs, np.int32)}),
                  **({"uneven": True} if "lengths" in case else {}),
                  **({} if rects is None else {"block_mask": block_mask_of(rects)}))
        group.stats.reset()
        out, lse = burstcu.attention(ql, kl, vl, group, return_lse=True, **kw)
        kv_row = (kl.nbytes + vl.nbytes) // kl.shape[1]          # one row of K and V
        acc = np.dtype(np.float64 if dtype == "float64" else np.float32).itemsize
        kv_row_acc = 2 * kl.shape[0] * kl.shape[2] * kl.shape[3] * acc
        lengths = [len(g) for g in groups]
        fwd_want = {   # bytes sent, from each strategy's definition
            # K, V go on only while a rank they reach needs them, at their owner's length
            "burst": ring_sends(groups, rank, causal, (left, right), docs, True, rects) * kv_row,
            "ring": sum(lengths[(rank - s) % size] for s in range(size - 1)) * kv_row,
            "allgather": (size - 1) * max(lengths) * kv_row,   # padded to the longest shard
        }.get(strategy)
        if fwd_want is not None:
            assert group.stats.bytes_sent == fwd_want, (case, fwd_want, group.stats)
        if strategy == "burst":
            sends = ring_sends(groups, rank, causal, (left, right), docs, rects=rects)
            assert group.stats.messages == sends
        if strategy == "allgather":   # one all-gather: my K, V to each of the G-1 others
            assert group.stats.messages == size - 1, (case, group.stats)
        group.stats.reset()
        burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, **kw)
        b, _, h, d = ql.shape
        if strategy == "burst":  # bundles go only as far as the last rank that needs them
            bundle_rows, dq_rows = bundle_counts(groups, rank, causal, (left, right), docs,
                                                 rows=True, rects=rects)
            messages = bundle_counts(groups, rank, causal, (left, right), docs, rects=rects)[2]
            want = bundle_rows * b * h * (2 * d * ql.itemsize + 2 * acc) + dq_rows * b * h * d * acc
            assert (group.stats.bytes_sent, group.stats.messages) == \
                ((want, messages) if size > 1 else (0, 0)), (case, group.stats, bundle_rows, dq_rows)
        elif strategy in ("ring", "allgather") and size > 1:
            # ring: every dK, dV goes round (N rows); allgather: the other owners' sums pass by
            passed = n if strategy == "ring" else n - lengths[rank]
            assert group.stats.bytes_sent == fwd_want + passed * kv_row_acc, (case, group.stats)
            if strategy == "allgather":   # the all-gather again (G-1), then G-1 reduce-scatter hops
                assert group.stats.messages == 2 * (size - 1), (case, group.stats)
        grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, check=True, **kw)
        ref_out, ref_lse = attention_ref(q, k, v, keep=keep)
        # the naive same-dtype implementation (float64 for float64: no float32 slack)
        naive_out, naive_lse = attention_ref(q, k, v, keep=keep, dtype=NAIVE[dtype], **half)
        _check("out", out.astype(np.float64), ref_out[:, rows], naive_out[:, rows], dtype)
        _check("lse", lse, ref_lse[:, :, rows], naive_lse[:, :, rows], dtype)
        refs = attention_backward_ref(dout, q, k, v, keep=keep)
        naives = attention_backward_ref(dout, q, k, v, keep=keep, dtype=NAIVE[dtype], **half)
        # a gradient that is exactly 0 in the reference (window (0, 0): each row sees itself,
        # P = 1, so dS = dP - delta cancels) has no error scale of its own: it must be within
        # rounding of the terms that cancel, |dO| |v| D per dS entry, times |k| (or |q|)
        cancel = 8 * EPS[dtype] * q.shape[-1] * float(np.abs(dout).max() * np.abs(v).max()
                                                      * max(np.abs(k).max(), np.abs(q).max()))
        for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, refs, naives):
            if not np.any(ref[:, rows]):   # e.g. a one-row shard at position 0 under causal
                worst = float(np.abs(got.astype(np.float64)).max())
                assert worst <= cancel, f"{name}: {worst:.3e} where the reference is 0 (> {cancel:.3e})"
                continue
            _check(name, got.astype(np.float64), ref[:, rows], naive[:, rows], dtype, factor=3.0)
        # the whole output comes back from uneven shards too
        whole = burstcu.unshard(out, group, layout, cu_seqlens=kw.get("cu_seqlens"),
                                uneven=kw.get("uneven", False))
        assert whole.shape[1] == n and np.array_equal(whole[:, rows], out)
    group.close()
    return {"cases": len(cases), "kernels": sorted(launched), "packed": sum(packed),
            "unpacked": len(packed) - sum(packed)}


def documents_disagree():
    """One rank passes other cu_seqlens: attention and unshard raise on every rank, naming it."""
    group = burstcu.init(backend="numpy")
    q = np.zeros((1, 4, 2, 8))
    n = 4 * group.size
    cu = np.array([0, 1, n]) if group.rank == group.size - 1 else np.array([0, 2, n])
    for call in (lambda: burstcu.attention(q, q, q, group, cu_seqlens=cu),
                 lambda: burstcu.unshard(q, group, cu_seqlens=cu)):
        try:
            call()
        except ValueError as exc:
            assert "disagree" in str(exc) or "same shape" in str(exc), exc
            assert "cu_seqlens" in str(exc) or "documents" in str(exc), exc
        else:
            raise AssertionError("disagreeing cu_seqlens were accepted")
    group.close()
    return {"rank": group.rank}


def documents_bad_on_one_rank():
    """The last rank passes boundaries that do not end at the global length, or an array unshard
    cannot index: attention and unshard raise on every rank (no hang, no abort)."""
    group = burstcu.init(backend="numpy")
    q = np.zeros((1, 4, 2, 8))
    n = 4 * group.size
    last = group.rank == group.size - 1
    bad_cu = np.array([0, n - 1]) if last else np.array([0, n])
    raised = []
    for call in (lambda: burstcu.attention(q, q, q, group, cu_seqlens=bad_cu),
                 lambda: burstcu.unshard(q, group, cu_seqlens=bad_cu),
                 lambda: burstcu.unshard(np.zeros(4) if last else q, group)):
        try:
            call()
        except (ValueError, TypeError) as exc:
            raised.append(str(exc))
        else:
            raise AssertionError("a bad input on one rank was accepted")
    group.close()
    return {"rank": group.rank, "raised": len(raised)}


def block_masks_disagree():
    """The last rank passes another block mask, a block mask beside causal, or a tuple in place
    of a BlockMask, or every rank a mask past the sequence: attention and attention_backward
    raise on every rank, the message naming what is wrong (no hang, no abort)."""
    group = burstcu.init(backend="numpy")
    q = np.zeros((1, 4, 2, 8))
    n = 4 * group.size
    last = group.rank == group.size - 1
    mine = burstcu.BlockMask([[0, n]], [[0, n]], ["causal"])
    other = burstcu.BlockMask([[0, n]], [[0, n]], ["full"])
    calls = {
        "disagree": lambda: burstcu.attention(q, q, q, group, block_mask=other if last else mine),
        "without causal": lambda: burstcu.attention(q, q, q, group, causal=last, block_mask=mine),
        "BlockMask": lambda: burstcu.attention(q, q, q, group,
                                               block_mask=(0, n) if last else mine),
        "reaches position": lambda: burstcu.attention(   # the same mask, past N on every rank
            q, q, q, group, block_mask=burstcu.BlockMask([[0, n + 1]], [[0, 1]], ["full"])),
        "disagree ": lambda: burstcu.attention_backward(
            q, q, q, q, q, np.zeros((1, 2, 4)), group, block_mask=other if last else mine),
    }
    for words, call in calls.items():
        try:
            call()
        except (ValueError, TypeError) as exc:
            said = str(exc)
            assert words.strip() in said and ("block_mask" in said or "BlockMask" in said), said
        else:
            raise AssertionError(f"a bad block mask on one rank was accepted ({words})")
    group.close()
    return {"rank": group.rank}


def block_mask_balanced_shards(strategy="burst"):
    """shard(..., block_mask=...) cuts contiguous shards whose queries keep pairs within 10% of
    the mean (many causal documents of random lengths and one shared prefix); attention and its
    backward on them (uneven=True) give the one-process results on this rank's rows. Without
    uneven=True the refusal names them as the mask's shards (it asked whether a rank had passed
    the global array)."""
    group = burstcu.init(backend="numpy")
    rng = np.random.default_rng(21)
    n = 600 * group.size
    bounds = np.unique(np.concatenate([[0, 40, n], rng.integers(40, n, 12 * group.size)]))
    docs = np.stack([bounds[:-1], bounds[1:]], axis=1)
    mask = burstcu.BlockMask(np.concatenate([docs, docs[1:]]),           # each document causal,
                             np.concatenate([docs, np.tile([[0, 40]], (len(docs) - 1, 1))]),
                             ["causal"] * len(docs) + ["full"] * (len(docs) - 1))  # + the prefix
    q, k, v, dout = make_inputs(31, 1, n, 2, 1, 8, "float64")
    ql, kl, vl, dol = (burstcu.shard(x, group, block_mask=mask) for x in (q, k, v, dout))
    lengths = mask.balanced_lengths(group.size, n)
    assert ql.shape[1] == lengths[group.rank]
    starts = np.cumsum([0, *lengths])
    work = mask.row_pairs(n)
    per_rank = [work[starts[r]:starts[r + 1]].sum() for r in range(group.size)]
    assert max(per_rank) <= 1.1 * np.mean(per_rank) and min(per_rank) >= 0.9 * np.mean(per_rank)
    assert max(lengths) - min(lengths) > 1, lengths   # so that uneven=True is needed:
    try:                                               # without it, named as the mask's shards
        burstcu.attention(ql, kl, vl, group, block_mask=mask, strategy=strategy)
        said = "ran"
    except ValueError as exc:
        said = str(exc)
    assert "the ones burstcu.shard(x, group, block_mask=mask) cuts for this mask; pass uneven=True" \
        in said and "global array" not in said, said
    out, lse = burstcu.attention(ql, kl, vl, group, block_mask=mask, uneven=True, return_lse=True,
                                 strategy=strategy)
    grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, block_mask=mask,
                                       uneven=True, strategy=strategy)
    whole_out, whole_lse = burstcu.attention(q, k, v, block_mask=mask, return_lse=True)
    whole = burstcu.attention_backward(dout, q, k, v, whole_out, whole_lse, block_mask=mask)
    mine = slice(starts[group.rank], starts[group.rank + 1])
    np.testing.assert_allclose(out, whole_out[:, mine], atol=1e-12)
    for got, ref in zip(grads, whole):
        np.testing.assert_allclose(got, ref[:, mine], atol=1e-12)
    group.close()
    return {"rows": int(ql.shape[1])}


def linear_matches_reference(strategy="lasp2", dtype="float32", seqlen_local=40, cases=(),
                             backend="numpy"):
    """linear_attention and its backward (B=2, H=4, Hkv=2, D=8) against the quadratic float64
    form (burstcu.testing.reference.linear_attention_ref) within FlashAttention's rule (the naive
    implementation: the same form in float32), for each case {"causal", "layout"}; the bytes
    and messages each rank sends asserted against the strategy's formulas and, for lasp2, the
    seed's (G-1) x runs x B*Hkv*D*D x itemsize, independent of the sequence length."""
    group = burstcu.init(backend=backend)
    rank, size = group.rank, group.size
    n = seqlen_local * size
    b, h, hkv, d = 2, 4, 2, 8
    acc = 8 if dtype == "float64" else 4
    for index, case in enumerate(cases):
        causal, layout = case["causal"], case["layout"]
        q, k, v, dout = make_inputs(500 + index, b, n, h, hkv, d, dtype)
        rows = my_rows(layout, rank, size, n)
        ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
        kw = dict(causal=causal, layout=layout, strategy=strategy)
        group.stats.reset()
        out = burstcu.linear_attention(ql, kl, vl, group, **kw)
        fwd_bytes, fwd_msgs = group.stats.bytes_sent, group.stats.messages
        group.stats.reset()
        grads = burstcu.linear_attention_backward(dol, ql, kl, vl, group, **kw)
        bwd_bytes, bwd_msgs = group.stats.bytes_sent, group.stats.messages
        state = b * hkv * d * d * acc
        nruns = 1 if layout == "contiguous" else 2
        if strategy == "lasp2":
            assert (fwd_bytes, fwd_msgs) == ((size - 1) * nruns * state, size - 1), (case, fwd_bytes)
            assert (bwd_bytes, bwd_msgs) == (2 * (size - 1) * nruns * state, size - 1), (case, bwd_bytes)
        else:
            sends = lasp1.forward_sends(rank, size, seqlen_local, layout, causal)
            assert (fwd_bytes, fwd_msgs) == (sends * state, sends), (case, fwd_bytes, sends)
            bsends = lasp1.backward_sends(rank, size, seqlen_local, layout, causal)
            per = state * (1 if causal else 2)
            assert (bwd_bytes, bwd_msgs) == (bsends * per, bsends), (case, bwd_bytes, bsends)
            if layout == "contiguous" and causal:   # the chain, spelled out
                assert sends == (rank < size - 1) and bsends == (rank < size - 1) + (rank > 0)
        ref_out, ref_grads = linear_attention_ref(q, k, v, causal, TRUTH[dtype], dout=dout)
        naive_out, naive_grads = linear_attention_ref(q, k, v, causal, NAIVE[dtype], dout=dout)
        assert out.dtype == q.dtype and all(g.dtype == x.dtype for g, x in zip(grads, (q, k, v)))
        _check("out", out.astype(np.float64), ref_out[:, rows], naive_out[:, rows], dtype)
        for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
            _check(name, got.astype(np.float64), ref[:, rows], naive[:, rows], dtype, factor=3.0)
    group.close()
    return {"cases": len(cases)}


def linear_bad_input_on_one_rank():
    """The last rank passes k with another head dim, then another strategy: both calls raise
    on every rank."""
    group = burstcu.init(backend="numpy")
    last = group.rank == group.size - 1
    q = np.zeros((1, 8, 2, 8))
    k = np.zeros((1, 8, 2, 4 if last else 8))
    raised = 0
    for call in (lambda: burstcu.linear_attention(q, k, k, group),
                 lambda: burstcu.linear_attention(q, q, q, group,
                                                  strategy="lasp1" if last else "lasp2")):
        try:
            call()
        except ValueError:
            raised += 1
    assert raised == 2, raised
    group.close()
    return {"rank": group.rank}


def prime_length_matches_one_process(n=3001):
    """A global length no rank count divides, sharded over the world by `burstcu.shard`:
    causal forward and backward, unsharded, equal one process's attention over the whole
    sequence (burst, both layouts); returns each layout's shard lengths."""
    group = burstcu.init(backend="numpy")
    q, k, v, dout = make_inputs(11, 1, n, 2, 1, 16, "float64")
    want_out, want_lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    want = burstcu.attention_backward(dout, q, k, v, want_out, want_lse, causal=True)
    lengths = {}
    for layout in ("contiguous", "zigzag"):
        ql, kl, vl, dl = (burstcu.shard(x, group, layout) for x in (q, k, v, dout))
        lengths[layout] = [int(x) for x in group.transport.allgather_object(ql.shape[1], "lengths")]
        out, lse = burstcu.attention(ql, kl, vl, group, causal=True, layout=layout, return_lse=True)
        grads = burstcu.attention_backward(dl, ql, kl, vl, out, lse, group, causal=True, layout=layout)
        for got, ref in zip((out, *grads), (want_out, *want)):
            whole = burstcu.unshard(got, group, layout)
            assert whole.shape == ref.shape and np.allclose(whole, ref, rtol=1e-10, atol=1e-12), layout
        whole_lse = burstcu.unshard(lse, group, layout, axis=2)
        assert np.allclose(whole_lse, want_lse, rtol=1e-10, atol=1e-12), layout
    group.close()
    return {"lengths": lengths}


def kv_both_ways_matches_reference(seqlen_local=16, dtype="float32"):
    """burst's K/V going both ways round the ring, on every rank against float64 (out, lse, dq,
    dk, dv within FlashAttention's tolerance rule), with its bytes and messages:

    - a non-causal window of half a shard each side over contiguous shards: a block is needed
      by its neighbours only, so it goes one hop each way: 2 (G-1) block-hops in all, and on 4
      ranks the middle ranks send twice their K+V, the end ranks once (one way round it would
      be 3x on the end ranks: the left neighbour is G-1 hops away); every rank's count as
      `bodies.ring_sends` spells it out;
    - full attention with bidirectional=True (through `burstcu.engine.get`): every block goes
      ceil((G-1)/2) hops forwards and floor((G-1)/2) backwards, so each rank still sends G-1
      blocks, G-1 messages, but in ceil((G-1)/2) exchanges instead of G-1."""
    from burstcu.engine import get as strategy
    group = burstcu.init(backend="numpy")
    size, rank = group.size, group.rank
    n, half = seqlen_local * size, seqlen_local // 2
    q, k, v, dout = make_inputs(4100, 1, n, 4, 2, 8, dtype)
    groups = [my_rows("contiguous", r, size, n) for r in range(size)]
    rows = groups[rank]
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
    block = kl.nbytes + vl.nbytes                      # this rank's K and V
    sent = {}
    for name, window in (("window", (half, half)), ("bidirectional", (-1, -1))):
        keep = dense_keep(np.arange(n), np.arange(n), False, window)
        group.stats.reset()
        if name == "window":
            out, lse = burstcu.attention(ql, kl, vl, group, window_size=window, return_lse=True)
        else:
            out, lse = strategy("burst", bidirectional=True).forward(
                ql, kl, vl, group.ops, group.transport, causal=False, softmax_scale=8 ** -0.5,
                layout="contiguous")
        fwd = group.stats.as_dict()
        sent[name] = fwd["bytes_sent"] // block
        assert fwd["bytes_sent"] % block == 0 and fwd["messages"] == sent[name], (name, fwd)
        if name == "window":
            assert sent[name] == ring_sends(groups, rank, False, window), (sent, rank)
            if size == 4:
                assert sent[name] == (1 if rank in (0, 3) else 2), (sent, rank)
        else:
            assert sent[name] == size - 1, (sent, rank)
            assert fwd["steps"] == size // 2, fwd         # ceil((G-1)/2) exchanges
        refs = on_rank0_then_bcast(lambda: (attention_ref(q, k, v, keep=keep),
                                            attention_ref(q, k, v, keep=keep, dtype=NAIVE[dtype]),
                                            attention_backward_ref(dout, q, k, v, keep=keep),
                                            attention_backward_ref(dout, q, k, v, keep=keep,
                                                                   dtype=NAIVE[dtype])))
        (ref_out, ref_lse), (naive_out, naive_lse), ref_grads, naive_grads = refs
        _check(f"{name} out", out, ref_out[:, rows], naive_out[:, rows], dtype)
        _check(f"{name} lse", lse, ref_lse[:, :, rows], naive_lse[:, :, rows], dtype)
        grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, window_size=window,
                                           check=True)
        for label, got, ref, naive in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
            _check(f"{name} {label}", got, ref[:, rows], naive[:, rows], dtype, factor=3.0)
    every = group.transport.allgather_object(sent["window"], "test: window sends")
    assert sum(every) == 2 * (size - 1), every          # one hop to each neighbour a block
    group.close()
    return sent


# which global positions of (out, dq, dk, dv) a non-finite value at position p of each input of
# causal linear attention reaches, from out_i = sum_{j <= i} (q_i . k_j) v_j and its gradients
# (dq_i over j <= i of dO_i, v_j, k_j; dk_j, dv_j over i >= j of dO_i, q_i, and v_j resp. k_j)
LINEAR_REACH = {
    "q": {"out": "at", "dq": None, "dk": "to", "dv": "to"},
    "k": {"out": "from", "dq": "from", "dk": None, "dv": "at"},
    "v": {"out": "from", "dq": "from", "dk": "at", "dv": None},
    "dout": {"out": None, "dq": "at", "dk": "to", "dv": "to"},
}


def linear_reached(n: int, p: int, how: str | None) -> np.ndarray:
    """(n,) bool: the positions `how` says a value at p reaches ("at": p, "from": p and after,
    "to": up to p, None: none)."""
    pos = np.arange(n)
    return {"at": pos == p, "from": pos >= p, "to": pos <= p, None: np.zeros(n, bool)}[how]


def linear_poisoned(inputs: dict, name: str, p: int, value: float) -> tuple[dict, dict]:
    """(inputs with `value` at position p of `name` in every head, the same with 0 there: the
    reference of every entry the value cannot reach)."""
    poisoned, zeroed = dict(inputs), dict(inputs)
    for out, fill in ((poisoned, value), (zeroed, 0.0)):
        x = inputs[name].copy()
        x[:, p] = fill
        out[name] = x
    return poisoned, zeroed


def linear_masked_positions_are_inert(seqlen_local=192, cases=()):
    """Causal linear attention with a NaN or Inf at one position of q, k, v or dout: on every
    rank, exactly the entries of out, dq, dk, dv whose definition involves that position are
    non-finite (`LINEAR_REACH`), and every other entry matches the float64 quadratic form of the
    inputs with a 0 there, within FlashAttention's rule. Cases {"strategy", "layout", "name",
    "at" (a fraction of N), "value"}; runs of 96+ rows span several of ops.linear's tiles."""
    group = burstcu.init(backend="numpy")
    rank, size = group.rank, group.size
    n = seqlen_local * size
    b, h, hkv, d = 1, 4, 2, 8
    clean = dict(zip(("q", "k", "v", "dout"), make_inputs(900, b, n, h, hkv, d, "float32")))
    for case in cases:
        p = int(case["at"] * n)
        poisoned, zeroed = linear_poisoned(clean, case["name"], p, case["value"])
        rows = my_rows(case["layout"], rank, size, n)
        mine = {key: np.ascontiguousarray(x[:, rows]) for key, x in poisoned.items()}
        kw = dict(causal=True, layout=case["layout"], strategy=case["strategy"])
        got = {"out": burstcu.linear_attention(mine["q"], mine["k"], mine["v"], group, **kw)}
        got.update(zip(("dq", "dk", "dv"), burstcu.linear_attention_backward(
            mine["dout"], mine["q"], mine["k"], mine["v"], group, **kw)))
        args = (zeroed["q"], zeroed["k"], zeroed["v"], True)
        ref_out, ref_grads = linear_attention_ref(*args, TRUTH["float32"], dout=zeroed["dout"])
        naive_out, naive_grads = linear_attention_ref(*args, NAIVE["float32"], dout=zeroed["dout"])
        refs = {"out": (ref_out, naive_out), **{g: (r, nv) for g, r, nv in
                                               zip(("dq", "dk", "dv"), ref_grads, naive_grads)}}
        for name, value in got.items():
            reached = linear_reached(n, p, LINEAR_REACH[case["name"]][name])[rows]
            nonfinite = ~np.isfinite(value).all(axis=(0, 2, 3))
            assert np.array_equal(nonfinite, reached), (case, name, rank, np.flatnonzero(nonfinite),
                                                        np.flatnonzero(reached))
            ref, naive = (x[:, rows][:, ~reached].astype(np.float64) for x in refs[name])
            _check(f"{case} {name}", value[:, ~reached].astype(np.float64), ref, naive, "float32",
                   factor=3.0)
    group.close()
    return {"cases": len(cases)}


def near_equal_rows(layout: str, rank: int, size: int, n: int) -> np.ndarray:
    """Global rows of `rank` when N = n need not divide: contiguous, run `rank` of `size`
    near-equal runs; zigzag, chunks rank and 2 size - 1 - rank of 2 size near-equal chunks (the
    first n % chunks one row longer), written independently of burstcu.layout."""
    chunks = size if layout == "contiguous" else 2 * size
    sizes = [n // chunks + (i < n % chunks) for i in range(chunks)]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    mine = [rank] if layout == "contiguous" else [rank, 2 * size - 1 - rank]
    return np.concatenate([np.arange(starts[c], starts[c + 1]) for c in mine])


def linear_any_length(lengths=(), cases=()):
    """linear_attention and its backward on shards of global lengths the ranks do not divide
    (near-equal contiguous runs, zigzag chunks of unequal halves) against the float64
    quadratic form, within FlashAttention's rule, on every rank; cases {"causal", "layout",
    "strategy"}."""
    group = burstcu.init(backend="numpy")
    rank, size = group.rank, group.size
    b, h, hkv, d = 1, 4, 2, 8
    checked = 0
    for n in lengths:
        q, k, v, dout = make_inputs(700 + n, b, n, h, hkv, d, "float32")
        for case in cases:
            rows = near_equal_rows(case["layout"], rank, size, n)
            ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
            out = burstcu.linear_attention(ql, kl, vl, group, **case)
            grads = burstcu.linear_attention_backward(dol, ql, kl, vl, group, **case)
            ref_out, ref_grads = linear_attention_ref(q, k, v, case["causal"], TRUTH["float32"], dout=dout)
            naive_out, naive_grads = linear_attention_ref(q, k, v, case["causal"], NAIVE["float32"],
                                                          dout=dout)
            _check(f"{n} {case} out", out.astype(np.float64), ref_out[:, rows], naive_out[:, rows],
                   "float32")
            for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
                _check(f"{n} {case} {name}", got.astype(np.float64), ref[:, rows], naive[:, rows],
                       "float32", factor=3.0)
            checked += 1
    if size > 1:   # zigzag with a rank short of a piece (N < 2G): the same ValueError everywhere
        q, k, v, _ = make_inputs(7, b, 2 * size - 1, h, hkv, d, "float32")
        rows = near_equal_rows("zigzag", rank, size, 2 * size - 1)
        for strategy in ("lasp2", "lasp1"):
            try:
                burstcu.linear_attention(*(x[:, rows] for x in (q, k, v)), group, layout="zigzag",
                                         strategy=strategy)
            except ValueError as exc:
                assert "needs N >= 2 G (two pieces a rank; or N = G, one row a rank) rows" in str(exc), \
                    exc
            else:
                raise AssertionError(f"{strategy}: zigzag took N = {2 * size - 1} over {size} ranks")
        mine = q[:, :1] if rank == 0 else q[:, :3]    # contiguous shards of 1 and 3 rows
        try:
            burstcu.linear_attention(mine, mine, mine, group)
        except ValueError as exc:   # (linear attention has no uneven=: not offered)
            assert "differ by more than one row" in str(exc) and "uneven" not in str(exc), exc
            assert "this call takes near-equal shards only" in str(exc), exc
            assert "block_mask" not in str(exc), exc    # linear attention takes none
        else:
            raise AssertionError("linear attention took contiguous shards of 1 and 3 rows")
    group.close()
    return {"cases": checked}
