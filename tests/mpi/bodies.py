"""Test bodies run on every rank under `mpiexec -n N` (any N). Each asserts on its own rank's
results and returns a small JSON-able summary that pytest checks for every rank.

The expected values are computed here independently of burstcu: the float64 reference of
burstcu/testing/reference.py over the whole sequence, each rank's rows picked by its own index arithmetic,
and the byte counts from the formulas written out below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

import burstcu
from burstcu.ops.base import as_dtype
from burstcu.testing.reference import attention_backward_ref, attention_ref, within_fa_rule

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}
# the naive same-dtype implementation of the tolerance rule: fp16/bf16 naive attention is
# computed in float32 with inputs rounded, as a framework's half-precision matmul would
NAIVE = {"float16": np.float32, "bfloat16": np.float32, "float32": np.float32, "float64": np.float64}
# the reference: float64, or long double when the implementation under test itself is float64
TRUTH = {"float16": np.float64, "bfloat16": np.float64, "float32": np.float64, "float64": np.longdouble}


def my_rows(layout: str, rank: int, size: int, n: int) -> np.ndarray:
    """Global row indices this rank holds (written independently of burstcu.layout)."""
    if layout == "contiguous":
        c = n // size
        return np.arange(rank * c, (rank + 1) * c)
    c = n // (2 * size)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)])


def make_inputs(seed, b, n, h, hkv, d, dtype, logit_scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, h, d)) * logit_scale
    k = rng.standard_normal((b, n, hkv, d))
    v = rng.standard_normal((b, n, hkv, d))
    dout = rng.standard_normal((b, n, h, d))
    return [x.astype(as_dtype(dtype)) for x in (q, k, v, dout)]


def on_rank0_then_bcast(compute):
    """The references are the same for every rank: compute once, share (saves CPU on 2 cores)."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    return comm.bcast(compute() if comm.Get_rank() == 0 else None, root=0)


def _check(name, got, ref, naive, dtype, factor=2.0):
    ok, err, bound = within_fa_rule(got, ref, naive, EPS[dtype], factor)
    assert ok, f"{name}: error {err:.3e} exceeds bound {bound:.3e}"
    return err


def block_mask_of(rects) -> burstcu.BlockMask:
    """The `burstcu.BlockMask` of rectangles (qs, qe, ks, ke, kind), as `dense_keep` reads them."""
    return burstcu.BlockMask([r[:2] for r in rects], [r[2:4] for r in rects], [r[4] for r in rects])


def dense_keep(qpos, kpos, causal: bool, window=(-1, -1), docs=None, rects=None) -> np.ndarray:
    """(len(qpos), len(kpos)) bool: key position k visible to query position q, spelled out:
    (not causal or k <= q) and q - left <= k <= q + right (-1: unbounded) and, with document
    boundaries docs = (0, b_1, ..., n), q and k in the same document. rects: a block mask's
    rectangles (qs, qe, ks, ke, kind) instead: q in [qs, qe), k in [ks, ke) and for "causal"
    k - ks <= q - qs + (ke - ks) - (qe - qs), for "inverse_causal" k - ks >= q - qs, for
    "bidir_causal" both, in any of them."""
    qpos, kpos = np.asarray(qpos)[:, None], np.asarray(kpos)[None, :]
    if rects is not None:
        keep = np.zeros((qpos.size, kpos.size), bool)
        for qs, qe, ks, ke, kind in rects:
            inside = (qpos >= qs) & (qpos < qe) & (kpos >= ks) & (kpos < ke)
            if kind in ("causal", "bidir_causal"):
                inside &= kpos - ks <= qpos - qs + (ke - ks) - (qe - qs)
            if kind in ("inverse_causal", "bidir_causal"):
                inside &= kpos - ks >= qpos - qs
            keep |= inside
        return keep
    left, right = window
    keep = np.ones((qpos.size, kpos.size), bool)
    if docs is not None:
        inner = np.asarray(docs[1:])      # a position's document: how many boundaries it passed
        keep &= (qpos[..., None] >= inner).sum(-1) == (kpos[..., None] >= inner).sum(-1)
    if causal:
        keep &= kpos <= qpos
    if left >= 0:
        keep &= kpos >= qpos - left
    if right >= 0:
        keep &= kpos <= qpos + right
    return keep


def kv_trips(groups: list, owner: int, causal: bool, window=(-1, -1), docs=None, rects=None,
             bidirectional: bool = False) -> tuple[int, int]:
    """(forwards, backwards): the hops member `owner`'s K/V block goes each way round the ring,
    by trying every pair (f, b), 0 <= f, b < g: those that bring it to every member that sees
    one of its keys (within f hops forwards or b backwards), the fewest hops in all first; then
    one way forwards (f, 0) when it is among them, the most even split, more forwards.
    bidirectional: the most even split before one way."""
    g = len(groups)
    seen_by = [t for t in range(1, g)
               if dense_keep(groups[(owner + t) % g], groups[owner], causal, window, docs, rects).any()]
    trips = [(f, b) for f in range(g) for b in range(g) if all(t <= f or t >= g - b for t in seen_by)]
    if bidirectional:
        return min(trips, key=lambda fb: (fb[0] + fb[1], max(fb), -fb[0]))
    return min(trips, key=lambda fb: (fb[0] + fb[1], fb[1] != 0, max(fb), -fb[0]))


def ring_sends(groups: list, index: int, causal: bool, window=(-1, -1), docs=None,
               rows: bool = False, rects=None, bidirectional: bool = False) -> int:
    """K/V blocks ring member `index` passes on in the burst forward, either way, when each
    block goes as far each way as `kv_trips` says: the block of member j is sent on by members
    j, j+1, .., j+f-1 forwards and j, j-1, .., j-b+1 backwards. groups: each member's global
    positions. rows: count the rows of the blocks sent instead (uneven shards). rects: a block
    mask (`dense_keep`)."""
    g = len(groups)
    total = 0
    for j in range(g):
        f, b = kv_trips(groups, j, causal, window, docs, rects, bidirectional)
        senders = [(j + t) % g for t in range(f)] + [(j - t) % g for t in range(b)]
        total += senders.count(index) * (len(groups[j]) if rows else 1)
    return total


def bundle_counts(groups: list, index: int, causal: bool, window=(-1, -1), docs=None,
                  received: bool = False, rows: bool = False, rects=None):
    """(bundles, dqs, messages) ring member `index` sends in the burst backward when a bundle
    goes round backwards under causal (forwards otherwise) only as far as the last member that
    sees one of its queries, its dQ one step behind it and then straight home.
    groups: each member's global positions. received: (bundles, dqs) it receives instead.
    rows: bundles and dqs counted in rows (each at its owner's length; uneven shards).
    rects: a block mask (`dense_keep`).
    The direction: the one with fewer bundle hops in all; on a tie back under causal."""
    g = len(groups)

    def last_in(d, j):   # the last step at which member j's bundle is held going way d
        return max([0] + [t for t in range(1, g) if dense_keep(
            groups[j], groups[(j + d * t) % g], causal, window, docs, rects).any()])

    forwards, backwards = (sum(last_in(d, j) for j in range(g)) for d in (1, -1))
    d = (1 if forwards < backwards else -1) if forwards != backwards else (-1 if causal else 1)

    def last(j):
        return last_in(d, j)

    held = [(index - d * s) % g for s in range(g + 1)]       # whose bundle at step s

    def size(j):
        return len(groups[j]) if rows else 1

    if rows and not received:
        return (sum(size(held[s]) for s in range(g) if s < last(held[s])),
                sum(size(held[s]) for s in range(g) if s < last(held[s]) or s == last(held[s]) >= 1))
    bundles = sum(s < last(held[s]) for s in range(g))
    returns = sum(s == last(held[s]) >= 1 for s in range(g))
    to_next = sum(s < last(held[s]) or (s >= 1 and s - 1 < last(held[s - 1])) for s in range(g))
    if received:   # bundles that come on to me, dQs riding behind them, my own dQ coming home
        got = sum(s < last(held[s + 1]) for s in range(g - 1))
        return got, sum(1 <= s <= last(held[s]) for s in range(g)) + (last(index) >= 1)
    return bundles, bundles + returns, to_next + returns


def expected_traffic(strategy: str, size: int, b: int, s: int, h: int, hkv: int, d: int,
                     itemsize: int, acc: int, ulysses_degree: int | None = None, rank: int = 0,
                     layout: str = "contiguous", causal: bool = False) -> dict:
    """(bytes, messages) one rank sends per pass, written out from the algorithms' definitions
    (burstcu.engine's modules' docstrings), not taken from burstcu."""
    g1 = size - 1
    rows = [my_rows(layout, x, size, s * size) for x in range(size)]
    kv = b * s * hkv * d * itemsize          # one of K, V in the input dtype
    kv_acc = b * s * hkv * d * acc           # one of dK, dV in the accumulation dtype
    qd = b * s * h * d
    row_stats = b * h * s
    if size == 1:
        return {"fwd": (0, 0), "bwd": (0, 0)}
    if strategy == "burst":                  # K and V in one message; q, dout, delta, lse + dq
        bundle = 2 * qd * itemsize + 2 * row_stats * acc
        sends = ring_sends(rows, rank, causal)   # K, V stop once no rank they reach needs them
        bundles, dqs, messages = bundle_counts(rows, rank, causal)
        got_b, got_dq = bundle_counts(rows, rank, causal, received=True)
        return {"fwd": (sends * 2 * kv, sends), "bwd": (bundles * bundle + dqs * qd * acc, messages),
                "bwd_received": got_b * bundle + got_dq * qd * acc}
    if strategy == "ring":                   # K and V apart; backward: K, V, dK, dV travel
        return {"fwd": (g1 * 2 * kv, 2 * g1),
                "bwd": (g1 * 2 * kv + size * 2 * kv_acc, 2 * g1 + 2 * size)}
    if strategy == "allgather":              # an all-gather: my K, V to each of the G-1 others
        return {"fwd": (g1 * 2 * kv, g1),    # (G-1 messages); backward: that, then G-1 hops
                "bwd": (g1 * 2 * kv + g1 * 2 * kv_acc, g1 + g1)}
    if strategy == "usp":                    # Ulysses in groups of u, the burst ring across them
        u = ulysses_degree
        r, hg = size // u, h // u
        hk = hkv // u if hkv % u == 0 else 1
        q_part, kv_part, row_part = b * s * hg * d, b * s * hk * d, b * hg * s
        groups = [np.concatenate(rows[i * u:(i + 1) * u]) for i in range(r)]
        sends = ring_sends(groups, rank // u, causal)
        fwd = ((u - 1) * ((q_part + 2 * kv_part) * itemsize + row_part * acc + q_part * itemsize)
               + sends * 2 * u * kv_part * itemsize)                # a group's K, V per ring hop
        bwd = (u - 1) * ((2 * q_part + 2 * kv_part) * itemsize + 2 * row_part * acc)
        bwd += (u - 1) * (q_part + 2 * kv_part) * acc             # dq, dk, dv back (fp32)
        received = bwd                       # the all-to-alls are symmetric
        bundles, dqs, messages = bundle_counts(groups, rank // u, causal) if r > 1 else (0, 0, 0)
        got_b, got_dq = bundle_counts(groups, rank // u, causal, received=True) if r > 1 else (0, 0)
        # the ring's bundles (a group's rows, its super-rank's) and dQ accumulators
        ring_bundle, ring_dq = 2 * u * q_part * itemsize + 2 * u * row_part * acc, u * q_part * acc
        bwd += bundles * ring_bundle + dqs * ring_dq
        return {"fwd": (fwd, 2 * (u - 1) + sends), "bwd": (bwd, 2 * (u - 1) + messages),
                "bwd_received": received + got_b * ring_bundle + got_dq * ring_dq}
    if strategy == "ulysses":                # one all-to-all each way; to every other rank:
        hg = h // size                       # its query heads of my rows,
        hk = hkv // size if hkv % size == 0 else 1   # and the kv heads those use
        q_part, kv_part, row_part = b * s * hg * d, b * s * hk * d, b * hg * s
        fwd = (q_part + 2 * kv_part) * itemsize + row_part * acc + q_part * itemsize  # + lse, out
        bwd = ((2 * q_part + 2 * kv_part) * itemsize + 2 * row_part * acc         # q, dout, k, v, lse, delta
               + (q_part + 2 * kv_part) * acc)                                   # dq, dk, dv back
        return {"fwd": (g1 * fwd, 2 * g1), "bwd": (g1 * bwd, 2 * g1)}
    raise ValueError(strategy)


def attention_matches_reference(backend="numpy", dtype="float32", cases=(), seqlen_local=38,
                                options=None, strategy="burst", seed=1000, ulysses_degree=None):
    """Forward (out, lse) and backward (dq, dk, dv) of `strategy` against float64, plus exact
    bytes and messages per pass."""
    group = burstcu.init(backend=backend, **(options or {}))
    if "arch" in (options or {}):  # the kernel table asked for is the one that runs
        assert group.ops.arch == options["arch"], (group.ops.arch, options)
    size, rank = group.size, group.rank
    summary = []
    for i, case in enumerate(cases):
        b, h, hkv, d = case["b"], case["h"], case["hkv"], case["d"]
        causal, layout = case["causal"], case["layout"]
        n = seqlen_local * size
        q, k, v, dout = make_inputs(seed + i, b, n, h, hkv, d, dtype)
        rows = my_rows(layout, rank, size, n)
        ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))

        group.stats.reset()
        how = dict(strategy=strategy) | ({"ulysses_degree": ulysses_degree} if ulysses_degree else {})
        out, lse = burstcu.attention(ql, kl, vl, group, causal=causal, layout=layout,
                                     return_lse=True, **how)
        fwd = group.stats.as_dict()
        assert out.dtype == ql.dtype and out.shape == ql.shape and type(out) is type(ql)
        acc = np.float64 if dtype == "float64" else np.float32
        assert lse.dtype == acc and lse.shape == (b, h, seqlen_local)

        # the kernels store P and dS in the input dtype (tensor-core operands), as a naive
        # half-precision implementation does; the NumPy backend keeps them in float32
        round_to = as_dtype(dtype) if backend == "emulated" else None
        refs = on_rank0_then_bcast(lambda: (
            attention_ref(q, k, v, causal, dtype=TRUTH[dtype]),
            attention_ref(q, k, v, causal, dtype=NAIVE[dtype], round_to=round_to),
            attention_backward_ref(dout, q, k, v, causal, dtype=TRUTH[dtype]),
            attention_backward_ref(dout, q, k, v, causal, dtype=NAIVE[dtype], round_to=round_to)))
        (ref_out, ref_lse), (naive_out, naive_lse), ref_grads, naive_grads = refs
        errs = {"out": _check("out", out, ref_out[:, rows], naive_out[:, rows], dtype),
                "lse": _check("lse", lse, ref_lse[:, :, rows], naive_lse[:, :, rows], dtype)}

        group.stats.reset()
        dq, dk, dv = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=causal,
                                                layout=layout, **how)
        bwd = group.stats.as_dict()
        for name, got, ref, naive in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads, naive_grads):
            assert got.dtype == ql.dtype and got.shape == (ql if name == "dq" else kl).shape
            # gradients sum over every ring step and tile (G * tiles partial sums, each rounded),
            # where the naive one rounds once per matmul: flash-attn's backward tests allow 3x too
            errs[name] = _check(name, got, ref[:, rows], naive[:, rows], dtype, factor=3.0)

        itemsize, acc_size = np.dtype(as_dtype(dtype)).itemsize, np.dtype(acc).itemsize
        want = expected_traffic(strategy, size, b, seqlen_local, h, hkv, d, itemsize, acc_size,
                                ulysses_degree, rank, layout, causal)
        # what I receive is what the rank before me in the ring sends (USP: in the ring of groups)
        before = (rank - (ulysses_degree or 1) if strategy == "usp" else rank - 1) % size
        sent_to_me = expected_traffic(strategy, size, b, seqlen_local, h, hkv, d, itemsize,
                                      acc_size, ulysses_degree, before, layout, causal)
        if "bwd_received" in want:   # burst, usp: bundles and dQs come from several ranks
            sent_to_me["bwd"] = (want["bwd_received"], None)
        for name, got in (("fwd", fwd), ("bwd", bwd)):
            assert (got["bytes_sent"], got["messages"]) == want[name], (strategy, name, got, want[name])
            assert got["bytes_received"] == sent_to_me[name][0], (name, got, sent_to_me[name])
        summary.append({"case": case, "errors": errs, "fwd_bytes": fwd["bytes_sent"],
                        "bwd_bytes": bwd["bytes_sent"]})
    group.close()
    return summary


BAD_INPUTS = {
    # name: (which ranks get the bad input: "all", "last", or "none" for inputs the ranks agree
    # on, where no rank may raise; expected error type; text in the message). SPOIL below says
    # how each kind spoils the call.
    "ndim": ("all", "ValueError", "must have 4 dimensions"),
    # q packed (T, H, D: flash-attn's varlen form) beside batched k, v
    "packed_q_beside_batched_kv": ("all", "ValueError", "q is packed"),
    "heads_not_multiple": ("all", "ValueError", "multiple of nheads_kv"),
    "headdim_differs": ("all", "ValueError", "head dim"),
    "dtype_differs": ("all", "TypeError", "dtypes differ"),
    "integer_dtype": ("all", "TypeError", "int32"),
    "lengths_differ": ("all", "ValueError", "lengths must match"),
    "not_an_array": ("all", "TypeError", "must be a numpy.ndarray"),
    "bad_layout": ("all", "ValueError", "layout must be one of"),
    "one_rank_wrong_ndim": ("last", "ValueError", "q is packed"),
    # contiguous shards may differ in length; zigzag ones must be the ones shard() cuts
    "ranks_disagree_seqlen": ("last", "ValueError", "layout='zigzag' over"),
    # the global array on one rank: refused (contiguous shards differ by one row at most
    # unless uneven=True), with a hint
    "one_rank_passes_the_global_array": ("last", "ValueError", "did it pass the global array"),
    "ranks_disagree_heads": ("last", "ValueError", "q shape: rank 0 (1, 'S', 2, 16)"),
    "uneven_contiguous_shards_agree": ("none", None, None),
    # uneven shards hold one row at least: a rank with none is named on every rank
    "one_rank_holds_no_rows": ("last", "ValueError", "holds no rows: every rank must hold at least one"),
    "ranks_disagree_dtype": ("last", "ValueError", "q dtype: rank 0 float32"),
    "ranks_disagree_causal": ("last", "ValueError", "causal: rank 0 False"),
    "lse_shape": ("all", "ValueError", "lse must have shape"),
    # local work that raises on one rank only must still reach the agreement round
    "one_rank_overflowing_scale": ("last", "ValueError", "softmax_scale must be a finite number"),
    "one_rank_broken_dlpack": ("last", "TypeError", "cannot take these inputs"),
    "scale_given_vs_default_agree": ("none", None, None),
}


class _BrokenDLPack:
    """An array-like whose DLPack export fails (a framework error on one rank)."""

    def __dlpack__(self, **kwargs):
        raise RuntimeError("device lost")

    def __dlpack_device__(self):
        return (1, 0)


@dataclass
class BadCall:
    """One rank's arguments to the call a kind of bad input spoils: attention(q, k, v, ...), or
    with `backward` an attention_backward given an lse of the wrong shape."""

    q: Any
    k: Any
    v: Any
    dout: Any
    causal: bool = False
    layout: str = "contiguous"
    softmax_scale: float | None = None
    uneven: bool = False
    backward: bool = False

    def run(self, group) -> None:
        if self.backward:
            out, lse = burstcu.attention(self.q, self.k, self.v, group, return_lse=True)
            burstcu.attention_backward(self.dout, self.q, self.k, self.v, out, lse[:, :1], group)
        else:
            burstcu.attention(self.q, self.k, self.v, group, causal=self.causal, layout=self.layout,
                              softmax_scale=self.softmax_scale, uneven=self.uneven)


# How each kind of BAD_INPUTS spoils the call: spoil(call, singled_out, size), on every rank.
# singled_out: this rank is one the kind picks (every rank for "all", else the last rank).

def _drop_the_batch_axis(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.q = call.q[0]


def _two_axes_only(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.q = call.q[0, :, 0]


def _three_query_heads_over_two_kv_heads(call: BadCall, singled_out: bool, size: int) -> None:
    call.q = np.concatenate([call.q, call.q[:, :, :1]], axis=2)
    call.k, call.v = (np.concatenate([x, x], axis=2) for x in (call.k, call.v))


def _halve_the_kv_head_dim(call: BadCall, singled_out: bool, size: int) -> None:
    call.k, call.v = (x[..., :8].copy() for x in (call.k, call.v))


def _k_in_float64(call: BadCall, singled_out: bool, size: int) -> None:
    call.k = call.k.astype(np.float64)


def _integers(call: BadCall, singled_out: bool, size: int) -> None:
    call.q, call.k, call.v = (x.astype(np.int32) for x in (call.q, call.k, call.v))


def _shorter_keys(call: BadCall, singled_out: bool, size: int) -> None:
    call.k, call.v = call.k[:, :6].copy(), call.v[:, :6].copy()


def _q_as_a_list(call: BadCall, singled_out: bool, size: int) -> None:
    call.q = call.q.tolist()


def _unknown_layout(call: BadCall, singled_out: bool, size: int) -> None:
    call.layout = "diagonal"


def _shorter_shard(call: BadCall, singled_out: bool) -> None:
    if singled_out:
        call.q, call.k, call.v = (x[:, :6].copy() for x in (call.q, call.k, call.v))


def _zigzag_with_a_shorter_shard(call: BadCall, singled_out: bool, size: int) -> None:
    call.layout = "zigzag"            # on every rank: zigzag shards must be the ones shard() cuts
    _shorter_shard(call, singled_out)


def _uneven_contiguous_shards(call: BadCall, singled_out: bool, size: int) -> None:
    call.uneven = True                # declared on every rank: contiguous shards may differ
    _shorter_shard(call, singled_out)


def _no_rows_on_one_rank(call: BadCall, singled_out: bool, size: int) -> None:
    call.uneven = True
    if singled_out:
        call.q, call.k, call.v = (x[:, :0].copy() for x in (call.q, call.k, call.v))


def _the_global_array(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.q, call.k, call.v = (np.concatenate([x] * size, axis=1)
                                  for x in (call.q, call.k, call.v))


def _twice_the_query_heads(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.q = np.concatenate([call.q, call.q], axis=2)


def _all_in_float64(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.q, call.k, call.v = (x.astype(np.float64) for x in (call.q, call.k, call.v))


def _causal(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.causal = True


def _backward_with_a_short_lse(call: BadCall, singled_out: bool, size: int) -> None:
    call.backward = True


def _overflowing_scale(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.softmax_scale = 10**400


def _broken_dlpack(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.q = _BrokenDLPack()


def _the_default_scale_given(call: BadCall, singled_out: bool, size: int) -> None:
    if singled_out:
        call.softmax_scale = 0.25     # = 1/sqrt(16), what the other ranks get by default


SPOIL = {
    "ndim": _two_axes_only,
    "packed_q_beside_batched_kv": _drop_the_batch_axis,
    "heads_not_multiple": _three_query_heads_over_two_kv_heads,
    "headdim_differs": _halve_the_kv_head_dim,
    "dtype_differs": _k_in_float64,
    "integer_dtype": _integers,
    "lengths_differ": _shorter_keys,
    "not_an_array": _q_as_a_list,
    "bad_layout": _unknown_layout,
    "one_rank_wrong_ndim": _drop_the_batch_axis,
    "ranks_disagree_seqlen": _zigzag_with_a_shorter_shard,
    "one_rank_passes_the_global_array": _the_global_array,
    "ranks_disagree_heads": _twice_the_query_heads,
    "uneven_contiguous_shards_agree": _uneven_contiguous_shards,
    "one_rank_holds_no_rows": _no_rows_on_one_rank,
    "ranks_disagree_dtype": _all_in_float64,
    "ranks_disagree_causal": _causal,
    "lse_shape": _backward_with_a_short_lse,
    "one_rank_overflowing_scale": _overflowing_scale,
    "one_rank_broken_dlpack": _broken_dlpack,
    "scale_given_vs_default_agree": _the_default_scale_given,
}
assert SPOIL.keys() == BAD_INPUTS.keys()


def every_bad_input_raises_everywhere():
    """`bad_input_raises_everywhere` for every kind, in one world (one mpiexec start)."""
    return {kind: bad_input_raises_everywhere(kind) for kind in BAD_INPUTS}


def bad_input_raises_everywhere(kind: str):
    """Every rank must raise the expected error (none may hang or succeed); then the world is
    still usable: a correct call afterwards works on every rank. A kind whose ranks agree
    (who = "none") must raise on no rank."""
    group = burstcu.init(backend="numpy")
    size, rank = group.size, group.rank
    who, err_type, text = BAD_INPUTS[kind]
    call = BadCall(*make_inputs(7, 1, 8, 2, 1, 16, "float32"))
    SPOIL[kind](call, who == "all" or rank == size - 1, size)
    try:
        call.run(group)
    except (ValueError, TypeError) as exc:
        raised = (type(exc).__name__, str(exc))
    else:
        raised = None
    if who == "none" or (size == 1 and (kind.startswith("ranks_disagree")
                                        or kind == "one_rank_passes_the_global_array")):
        assert raised is None, raised  # one rank always agrees with itself
    else:
        assert raised is not None, f"{kind}: rank {rank} raised nothing"
        assert raised[0] == err_type and (text in raised[1] or "rank " in raised[1]), raised
        if kind.startswith("ranks_disagree"):   # named, not two dicts dumped
            assert text in raised[1] and len(raised[1]) < 200, raised
    # the group is still usable after the error
    q, k, v, _ = make_inputs(8, 1, 8, 2, 1, 16, "float32")
    out = burstcu.attention(q, k, v, group)
    assert np.isfinite(out).all()
    group.close()
    return {"raised": raised}


def shard_roundtrip(layout="zigzag"):
    """shard then unshard gives back the global array on every rank; shard picks my rows."""
    group = burstcu.init(backend="numpy")
    n = 4 * group.size
    x = np.arange(2 * n * 3, dtype=np.float32).reshape(2, n, 3)
    local = burstcu.shard(x, group, layout=layout, axis=1)
    assert np.array_equal(local, x[:, my_rows(layout, group.rank, group.size, n)])
    group.stats.reset()
    back = burstcu.unshard(local, group, layout=layout, axis=1)
    assert np.array_equal(back, x)
    # an all-gather of my rows (equal shards here): to each of the G-1 other ranks, one message
    got = (group.stats.bytes_sent, group.stats.bytes_received, group.stats.messages)
    assert got == ((group.size - 1) * local.nbytes, (group.size - 1) * local.nbytes,
                   group.size - 1), got
    group.close()
    return {"rows": my_rows(layout, group.rank, group.size, n).tolist()}


def unshard_rejects_mismatched_shapes():
    """Ranks passing shapes that differ off the sequence axis, or zigzag shards of the wrong
    lengths, get a ValueError on every rank; contiguous shards of different lengths are glued
    back in rank order."""
    group = burstcu.init(backend="numpy")
    rank, size = group.rank, group.size
    out = {}
    cases = {"other_axis": (np.zeros((1, 4, 3 + rank), np.float32), "contiguous"),
             "zigzag_lengths": (np.zeros((1, 4 + rank, 3), np.float32), "zigzag")}
    for name, (local, layout) in cases.items():
        try:
            burstcu.unshard(local, group, layout)
        except ValueError as exc:
            out[name] = str(exc)
        else:
            out[name] = None
    lengths = [2 + 3 * r for r in range(size)]
    local = np.arange(lengths[rank], dtype=np.float32)[None, :, None] + sum(lengths[:rank])
    if size > 1:   # lengths far apart need uneven=True (else: the global-array guard)
        try:
            burstcu.unshard(local, group)
        except ValueError as exc:
            out["uneven_not_declared"] = str(exc)
    whole = burstcu.unshard(local, group, uneven=True)
    assert whole.shape == (1, sum(lengths), 1), whole.shape
    assert np.array_equal(whole[0, :, 0], np.arange(sum(lengths))), whole[0, :, 0]
    group.close()
    return out


# -- masked positions are inert ------------------------------------------------------------------

def _world(one_process: bool, options, backend: str = "numpy"):
    """(group or None, rank, size): group=None (one process, default tiles) or a group of
    `backend` ("numpy" or "emulated": the CUDA kernels on the CPU emulator)."""
    if one_process:
        return None, 0, 1
    group = burstcu.init(backend=backend, **(options or {}))
    return group, group.rank, group.size


def _shared(compute, one_process: bool):
    return compute() if one_process else on_rank0_then_bcast(compute)


def poison_sites(n: int) -> list[tuple[str, int, int, int, int, float]]:
    """(tensor, batch, position, kv head, column, value) of the NaN/+Inf planted in K and V:
    batch 0 / kv head 0 has them in V, batch 1 / kv head 1 in K; the other two (batch, kv head)
    pairs stay clean. Positions are off any multiple of 8, so with 8-wide tiles some rows of
    the tile straddling the diagonal at each site come before it."""
    return [("v", 0, n // 3 + 3, 0, 3, np.inf), ("v", 0, n // 2 + 1, 0, 5, np.nan),
            ("k", 1, n // 4 + 5, 1, 1, np.nan), ("k", 1, n // 2 + 3, 1, 6, np.inf)]


def masked_positions_are_inert(layout="zigzag", seqlen_local=24, options=None, one_process=False,
                               seed=2024, backend="numpy", dtype="float32"):
    """Causal attention with NaN/+Inf planted in K and V (`poison_sites`). The truth for a row
    is the float64 reference computed on inputs poisoned only at the sites that row can see
    (positions <= its own): for rows that see none, the clean reference. out, lse and dq must be
    non-finite exactly where that truth is, and elsewhere within the tolerance rule of it. dk, dv
    of the clean (batch, kv head) pairs, and dv of the pair poisoned only in V (dv does not
    depend on V), must be finite and within the rule of the clean reference. With float16 or
    bfloat16 (the kernels' dtypes) the naive side of the rule rounds P, dS and the results to it."""
    group, rank, size = _world(one_process, options, backend)
    b, h, hkv, d, n = 2, 4, 2, 16, seqlen_local * size
    q, k, v, dout = make_inputs(seed, b, n, h, hkv, d, dtype)
    half = as_dtype(dtype) if dtype in ("float16", "bfloat16") else None
    naive_fwd = dict(round_to=half)
    naive_bwd = dict(round_to=half, out_dtype=half)
    sites = sorted(poison_sites(n), key=lambda site: site[2])

    def planted(count):
        """k, v with the first `count` sites (in position order) poisoned."""
        kp, vp = k.copy(), v.copy()
        for name, bi, pos, hi, col, value in sites[:count]:
            (kp if name == "k" else vp)[bi, pos, hi, col] = value
        return kp, vp

    def references():
        refs = []
        with np.errstate(all="ignore"):
            for count in range(len(sites) + 1):
                kp, vp = planted(count)
                refs.append([attention_ref(q, kp, vp, True, dtype=dt, **kw) + attention_backward_ref(
                    dout, q, kp, vp, True, dtype=dt, **kwb)[:1]
                    for dt, kw, kwb in ((np.float64, {}, {}), (np.float32, naive_fwd, naive_bwd))])
        return refs
    refs = _shared(references, one_process)

    rows = my_rows(layout, rank, size, n)
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, *planted(len(sites)), dout))
    with np.errstate(all="ignore"):
        out, lse = burstcu.attention(ql, kl, vl, group, causal=True, layout=layout, return_lse=True)
        dq, dk, dv = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=True,
                                                layout=layout)
    # the sites local row i can see: the first `seen[i]` in position order
    seen = np.searchsorted([site[2] for site in sites], rows, side="right")
    for index, (name, got) in enumerate((("out", out), ("lse", lse), ("dq", dq))):
        axis = 2 if name == "lse" else 1
        truth, naive = (np.empty_like(got, dtype=dt) for dt in (np.float64, np.float32))
        for count in range(len(sites) + 1):
            at, lead = seen == count, (slice(None),) * axis     # rows on the sequence axis
            for dst, ref in ((truth, refs[count][0][index]), (naive, refs[count][1][index])):
                dst[lead + (at,)] = ref[lead + (rows[at],)]
        finite = np.isfinite(truth)
        wrong = int((np.isfinite(got) != finite).sum())
        assert wrong == 0, f"{name}: {wrong} entries finite where the truth is not, or not where it is"
        assert np.isfinite(naive[finite]).all(), f"{name}: the naive float32 reference is not finite"
        _check(name, got[finite].astype(np.float64), truth[finite], naive[finite], dtype,
               factor=3.0 if name == "dq" else 2.0)
    clean = np.ones((b, hkv), bool)
    for _, bi, _, hi, _, _ in sites:
        clean[bi, hi] = False
    v_only = clean.copy()      # ... or poisoned in V alone: its dv does not depend on V
    v_only[0, 0] = all(name == "v" for name, bi, _, hi, _, _ in sites if (bi, hi) == (0, 0))
    (_, ref_dk, ref_dv), (_, nv_dk, nv_dv) = (
        attention_backward_ref(dout, q, k, v, True, dtype=dt, **kw)
        for dt, kw in ((np.float64, {}), (np.float32, naive_bwd)))
    for name, got, ref, nv, heads in (("dk", dk, ref_dk, nv_dk, clean), ("dv", dv, ref_dv, nv_dv, v_only)):
        sel = np.broadcast_to(heads[:, None, :, None], got.shape)
        got = got.astype(np.float64)
        assert np.isfinite(got[sel]).all(), f"{name} of a key with no poison is not finite"
        _check(name, got[sel], ref[:, rows][sel], nv[:, rows][sel], dtype, factor=3.0)
    if group is not None:
        group.close()
    return {"blind_rows": int((seen == 0).sum()), "seeing_rows": int((seen > 0).sum()),
            "nonfinite_out": int((~np.isfinite(out)).sum())}


def garbage(rng, shape) -> np.ndarray:
    """float32 of random bit patterns, as an np.empty buffer may hold: NaN, Inf, huge, tiny."""
    return rng.integers(0, 2**32, size=shape, dtype=np.uint64).astype(np.uint32).view(np.float32)


def garbage_padding_is_inert(layout="zigzag", seqlen_local=24, pad=15, options=None,
                             one_process=False, seed=77, backend="numpy", dtype="float32"):
    """A causal sequence padded at its end: garbage (random bits) in q, k, v and dout of the
    padding gives the real rows out, lse and dq identical to those of zero padding. (dk, dv of
    the real keys are not compared: the padding's own query rows see the garbage keys and pass
    NaN on to every key they see, as the reference does. Keys that no row sees at all are
    covered by tests/test_masked_inert.py::test_keys_no_row_sees_are_inert.) Half-precision
    inputs take the garbage rounded to them (huge values become Inf)."""
    group, rank, size = _world(one_process, options, backend)
    b, h, hkv, d, n = 1, 2, 1, 16, seqlen_local * size
    q, k, v, dout = make_inputs(seed, b, n, h, hkv, d, dtype)
    rng = np.random.default_rng(seed)
    rows = my_rows(layout, rank, size, n)
    real = rows < n - pad
    results = {}
    for fill in ("zeros", "garbage"):
        arrays = []
        for x in (q, k, v, dout):
            x = x.copy()
            with np.errstate(over="ignore", invalid="ignore"):
                x[:, n - pad:] = 0 if fill == "zeros" else garbage(rng, x[:, n - pad:].shape)
            arrays.append(np.ascontiguousarray(x[:, rows]))
        ql, kl, vl, dol = arrays
        with np.errstate(all="ignore"):
            out, lse = burstcu.attention(ql, kl, vl, group, causal=True, layout=layout, return_lse=True)
            dq, _, _ = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=True,
                                                  layout=layout)
        results[fill] = (out[:, real], lse[:, :, real], dq[:, real])
    for name, zero, junk in zip(("out", "lse", "dq"), results["zeros"], results["garbage"]):
        zero, junk = zero.astype(np.float64), junk.astype(np.float64)
        assert np.isfinite(zero).all() and np.array_equal(zero, junk), f"{name} of real rows changed"
    if group is not None:
        group.close()
    return {"real_rows": int(real.sum())}


# -- attention_backward(check=True) ----------------------------------------------------------------

def backward_check_catches_wrong_lse(strategy="burst", layout="zigzag", backend="numpy",
                                     dtype="float32", seqlen_local=24, ulysses_degree=None):
    """check=True on the lse of the forward: no error, and the same gradients as check=False.
    Then four wrong lse of the right dtype and shape — from a non-causal forward, from another q,
    shifted by 0.05 in one row on the last rank only, and a causal lse given to a non-causal
    backward — each raise a ValueError on every rank (the row sums travel around the ring, so
    a wrong row on one rank is seen by its owner; the agreement makes every rank raise)."""
    group = burstcu.init(backend=backend)
    rank, size = group.rank, group.size
    b, h, hkv, d, n = 1, 4, 2, 16, seqlen_local * size
    q, k, v, dout = make_inputs(31, b, n, h, hkv, d, dtype)
    rows = my_rows(layout, rank, size, n)
    ql, kl, vl, dol = (np.ascontiguousarray(x[:, rows]) for x in (q, k, v, dout))
    opts = dict(layout=layout, strategy=strategy)
    if ulysses_degree:
        opts["ulysses_degree"] = ulysses_degree
    out, lse = burstcu.attention(ql, kl, vl, group, causal=True, return_lse=True, **opts)
    checked = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=True, check=True, **opts)
    plain = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=True, **opts)
    same = all(np.array_equal(a, c) for a, c in zip(checked, plain))
    if backend == "numpy":  # the kernels' check runs the deterministic dQ pass: not the same bits
        assert same, "check=True changed the gradients"

    _, lse_full = burstcu.attention(ql, kl, vl, group, causal=False, return_lse=True, **opts)
    q_other = np.ascontiguousarray((q * 1.25).astype(q.dtype)[:, rows])
    _, lse_other = burstcu.attention(q_other, kl, vl, group, causal=True, return_lse=True, **opts)
    lse_shifted = lse.copy()
    if rank == size - 1:
        lse_shifted[0, 1, len(rows) // 2] += 0.05
    wrong = {"non-causal lse": (lse_full, True), "lse of another q": (lse_other, True),
             "one row shifted on the last rank": (lse_shifted, True), "causal lse, non-causal call": (lse, False)}
    raised = {}
    for name, (bad, causal) in wrong.items():
        try:   # a view: without the forward's options remembered (a device array has none)
            burstcu.attention_backward(dol, ql, kl, vl, out, bad.view(), group, causal=causal, check=True,
                                       **opts)
        except ValueError as exc:
            raised[name] = str(exc)
    assert set(raised) == set(wrong), f"no error for {sorted(set(wrong) - set(raised))}"
    assert all("sum to" in m for m in raised.values()), raised
    if size > 1:  # the shifted row lives on the last rank: every rank's message names it, once
        assert raised["one row shifted on the last rank"].count("rank") == 1, raised
        assert raised["one row shifted on the last rank"].startswith(f"rank {size - 1}: "), raised
        # every rank's rows wrong: each names itself (its rows are not the others')
        assert raised["non-causal lse"].startswith(f"rank {rank}: "), raised
        assert raised["non-causal lse"].count("rank") == 1, raised
    group.close()
    return {"raised": sorted(raised), "same_as_unchecked": same}


def sdpa_order_on_every_rank():
    """Shards in torch SDPA's (batch, heads, seqlen, headdim) order: multi-head q, k, v of one
    shape (each rank's rows taken for heads, 512 of them): a HeadsAxisWarning naming this file's
    line, once for the forward and its backward (linear attention's too); with fewer kv heads, the lengths error saying so; the same rows
    in burstcu's order: no warning; q of decode in that order: the error says so."""
    import inspect
    import os
    import warnings

    group = burstcu.init(backend="numpy")
    rng = np.random.default_rng(group.rank)
    heads, rows = 4, 512                                   # what the caller means: (1, 4, 512, 8)
    q = rng.standard_normal((1, heads, rows, 8)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        out, lse = burstcu.attention(q, q, q, group, causal=True, return_lse=True)
        burstcu.attention_backward(q, q, q, q, out, lse, group, causal=True)   # warned already
    warned = [w for w in caught if issubclass(w.category, burstcu.HeadsAxisWarning)]
    result = {"warned": len(warned), "line_ok": bool(warned) and warned[0].lineno == line
              and os.path.basename(warned[0].filename) == "bodies.py",
              "message": str(warned[0].message) if warned else None}
    try:
        burstcu.attention(q, q[:, :2], q[:, :2], group)
        result["gqa_error"] = None
    except ValueError as exc:
        result["gqa_error"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        burstcu.linear_attention(q, q, q, group, causal=True)
    result["linear_warned"] = sum(issubclass(w.category, burstcu.HeadsAxisWarning) for w in caught)
    meant = q.transpose(0, 2, 1, 3)                         # the same rows in burstcu's order
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        burstcu.attention(meant, meant, meant, group, causal=True)
    result["meant_warned"] = sum(issubclass(w.category, burstcu.HeadsAxisWarning) for w in caught)
    cache = burstcu.KVCache(group, 1, 32, 2, 8, np.float32)
    cache.append(*rng.standard_normal((2, 1, 3, 2, 8)).astype(np.float32))
    try:
        cache.decode(np.ones((1, 4, 1, 8), np.float32))   # (batch, heads, tokens, headdim)
        result["decode_error"] = None
    except ValueError as exc:
        result["decode_error"] = str(exc)
    group.close()
    return result


def calls_from_different_places():
    """Rank 0 evaluates (an attention call of its own, through `evaluate`) while the others run
    their next step (through `train_step`): both calls have the same shapes, so they pair, and
    each rank reports the CallSiteWarnings it got (category, file, message). Then every rank
    runs `train_step` (no warning), and rank 0 alone through a wrapper of its own with the
    call inside burstcu.ordered_by (no warning: the places are compared from there in)."""
    import os
    import warnings

    group = burstcu.init(backend="numpy", timeout=60)
    rng = np.random.default_rng(group.rank)
    q, k, v = (rng.standard_normal((1, 16, 2, 8)) for _ in range(3))

    def train_step():
        return burstcu.attention(q, k, v, group)

    def evaluate():
        return burstcu.attention(q, k, v, group)

    def ordered_step():
        with burstcu.ordered_by("step"):
            return burstcu.attention(q, k, v, group)

    def timed(step):   # a wrapper rank 0 alone puts around its step
        return step()

    result = {}
    for name, calls in (("one_rank_alone", [evaluate if group.rank == 0 else train_step]),
                        ("same_place", [train_step]),
                        ("wrapped_inside_ordered_by",
                         [(lambda: timed(ordered_step)) if group.rank == 0 else ordered_step])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for call in calls:
                call()
        result[name] = [(w.category.__name__, os.path.basename(w.filename), str(w.message))
                        for w in caught]
    group.close()
    return result


def global_array_on_every_rank():
    """Every rank passes the same global array: a SameShardsWarning that names this file's line
    (not burstcu's) and says how to silence it; with documents that cover one copy of the rows
    (the mistake certain), a ValueError saying each rank holds the whole sequence."""
    import inspect
    import os
    import warnings

    group = burstcu.init(backend="numpy")
    q = np.random.default_rng(0).standard_normal((1, 16, 2, 8)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        burstcu.attention(q, q, q, group, causal=True)
    same = [w for w in caught if issubclass(w.category, burstcu.SameShardsWarning)]
    result = {"warned": len(same),
              "file": os.path.basename(same[0].filename) if same else None,
              "line_ok": bool(same) and same[0].lineno == line,
              "message": str(same[0].message) if same else None}
    try:
        burstcu.attention(q, q, q, group, causal=True, cu_seqlens=[0, 16])
        result["docs_error"] = None
    except ValueError as exc:
        result["docs_error"] = str(exc)
    # the backward looks at q (its second array), not at k: shards of q, the same global k
    mine = burstcu.shard(np.random.default_rng(1).standard_normal((1, 16 * group.size, 2, 8))
                         .astype(np.float32), group)
    lse = np.zeros((1, 2, 16), np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        burstcu.attention_backward(mine, mine, q, q, mine, lse, group)
    result["backward_warned"] = sum(issubclass(w.category, burstcu.SameShardsWarning)
                                    for w in caught)
    # shards that only begin alike (the sequence padded at its start): no warning
    padded = np.zeros((1, 16 * group.size, 2, 8), np.float32)
    padded[:, -4 * group.size:] = np.random.default_rng(2).standard_normal((1, 4 * group.size, 2, 8))
    mine = burstcu.shard(padded, group)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        burstcu.attention(mine, mine, mine, group, causal=True)
    result["padded_warned"] = sum(issubclass(w.category, burstcu.SameShardsWarning) for w in caught)
    # decode over the same cache rows on every rank, and a KV cache prefilled with them; a
    # cache of each rank's own rows, an empty one, and a KV cache's appended rows: no warning
    token = q[:, -1:]
    cache = burstcu.KVCache(group, 1, 16, 2, 8, np.float32)
    mine = mine[:, :16]   # this rank's rows of the padded sequence: the same first rows, not last
    for name, call in (("decode", lambda: burstcu.decode(token, q, q, group)),
                       ("prefill", lambda: cache.from_prefill(q, q)),
                       ("decode_own_rows", lambda: burstcu.decode(token, mine, mine, group)),
                       ("decode_empty", lambda: burstcu.decode(token, q, q, group, cache_seqlens=[0])),
                       ("decode_one_row", lambda: burstcu.decode(token, q, q, group, cache_seqlens=[1])),
                       ("appended", lambda: (cache.clear(0), cache.append(q[:, :3], q[:, :3]),
                                             cache.decode(token)))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        same = [w for w in caught if issubclass(w.category, burstcu.SameShardsWarning)]
        result[f"{name}_warned"] = [(os.path.basename(w.filename), str(w.message)) for w in same]
    # linear attention over the global arrays (its forward and backward), and over shards
    own = burstcu.shard(np.random.default_rng(3).standard_normal((1, 16 * group.size, 2, 8))
                        .astype(np.float32), group)
    for name, call in (("linear", lambda: burstcu.linear_attention(q, q, q, group, causal=True)),
                       ("linear_backward", lambda: burstcu.linear_attention_backward(
                           q, q, q, q, group, causal=True)),
                       ("linear_own_rows", lambda: burstcu.linear_attention(own, own, own, group)),
                       # one row, the same on every rank: its first row is its last
                       ("one_row", lambda: burstcu.attention(q[:, :1], q[:, :1], q[:, :1], group)),
                       ("one_row_zeros", lambda: burstcu.attention(*(np.zeros_like(q[:, :1]),) * 3,
                                                                   group)),
                       # a diverged step's shards, NaN on every rank: alike by right, as zeros
                       ("nan_rows", lambda: burstcu.attention(*(np.full_like(own, np.nan),) * 3,
                                                              group, causal=True)),
                       ("linear_nan_rows", lambda: burstcu.linear_attention(
                           *(np.full_like(own, np.nan),) * 3, group))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        same = [w for w in caught if issubclass(w.category, burstcu.SameShardsWarning)]
        result[f"{name}_warned"] = [(os.path.basename(w.filename), str(w.message)) for w in same]
    return result

