"""All-gather K and V, attend locally; reduce-scatter dK, dV (Megatron context parallelism,
LASP-2H for softmax layers) — a baseline beside BurstAttention, `burstcu.engine.burst`.

forward: all-gather K and V (one collective, K and V packed), then attend over the whole sequence.
backward: all-gather K, V again, compute dq and every rank's partial dk, dv, then reduce-scatter
    dk, dv to their owners: the classic ring reduce-scatter over `send_recv` (G-1 steps, dk and
    dv packed). No overlap: the gather is blocking, by design of the baseline.
    bytes fwd = (G-1) * (|k| + |v|)                         messages = G-1
    bytes bwd = (G-1) * (|k| + |v|) + (G-1) * 2 * |k|_acc   messages = 2(G-1)
    An all-gather counts G-1 messages, this rank's piece to each other rank (`CommStats`), and
    each reduce-scatter hop one.
Uneven shards (a `burstcu.layout.Partition`): the all-gather moves every rank's K, V padded to
the longest shard ((G-1) * S_max rows); the reduce-scatter sends each owner's rows
(N - S_r rows of dK, dV from rank r).
Trace: the blocking all-gather is recorded as the wait of step 0 (before any compute) and each
reduce-scatter step as its own entry (step G, G+1, ...). Shapes as in `burstcu.engine`.
"""

from __future__ import annotations

from ..layout import Partition, as_partition, blocks as mask_blocks
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import (cast_copy, grad_row_bytes, kv_row_bytes, laid_out, now, partial_kv_grads,
                    post_exchange, ring_folds, timed, timed_wait)


def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, softmax_scale: float,
            layout: str | Partition, trace=None, window_size=(-1, -1), cu_seqlens=None, block_mask=None):
    """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S).
    window_size, cu_seqlens, block_mask: the mask (`layout.blocks`)."""
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    kv, gather_s = _gather_kv(ops, transport, k, v, part.lengths)
    state = ops.forward_init(q, softmax_scale)
    # visit the shards in the ring's order so traces line up with the other strategies
    blocks_of, last = ring_folds(part, rank, causal, window_size, cu_seqlens, block_mask)
    for s in range(size):
        source = (rank - s) % size
        blocks = blocks_of[s]
        compute_s = 0.0
        if blocks:
            compute_s = timed(ops, f"allgather fwd {s} compute", ops.forward_step, state,
                              kv[source][0], kv[source][1], blocks, s == last)
        if trace is not None:
            trace.add("forward", s, source, len(blocks), compute_s, gather_s if s == 0 else 0.0)
    return ops.forward_finalize(state, q.dtype)


def backward(dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *, causal: bool,
             softmax_scale: float, layout: str | Partition, trace=None, row_sums=None,
             window_size=(-1, -1), cu_seqlens=None, block_mask=None):
    """Gradients of `forward`. Returns dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the input dtype.
    row_sums: as for `burstcu.engine.ring.backward`."""
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    acc = accum_dtype(q.dtype)
    kv, gather_s = _gather_kv(ops, transport, k, v, part.lengths)
    delta = ops.backward_delta(dout, out)
    dq = ops.zeros(q.shape, acc)

    # partial dk, dv for every owner, packed per owner so each reduce-scatter hop is one span
    def fields(rows):
        b, _, hkv, d = k.shape
        return [("dk", (b, rows, hkv, d), acc), ("dv", (b, rows, hkv, d), acc)]
    partial = [ops.message(fields(part.lengths[j])) for j in range(size)]
    for s in range(size):
        source = (rank - s) % size
        blocks = mask_blocks(part, rank, source, causal, window_size, cu_seqlens, block_mask)
        ops.copy_(partial[source].flat, 0)
        compute_s = 0.0
        if blocks:
            t0 = now()
            with ops.annotate(f"allgather bwd {s} compute"):
                dk_p, dv_p = partial_kv_grads(ops, kv[source][0], kv[source][1], q, dout, lse,
                                              delta, dq, blocks, softmax_scale, acc, row_sums)
                ops.copy_(partial[source]["dk"], dk_p)
                ops.copy_(partial[source]["dv"], dv_p)
            compute_s = now() - t0
        if trace is not None:
            trace.add("backward", s, source, len(blocks), compute_s, gather_s if s == 0 else 0.0)
    mine = _reduce_scatter(ops, transport, partial, fields, part.lengths, trace)
    return (cast_copy(ops, dq, q.dtype), cast_copy(ops, mine["dk"], k.dtype),
            cast_copy(ops, mine["dv"], v.dtype))


def _gather_kv(ops: LocalOps, transport: Transport, k, v, lengths):
    """Every rank's (k, v): a list of G pairs of (B,S_j,Hkv,D) views, and the seconds spent.
    Each rank's K and V are packed in one buffer sized for the longest shard (uneven
    shards travel padded to it: the all-gather moves equal pieces)."""
    def fields(rows):
        b, _, hkv, d = k.shape
        return [("k", (b, rows, hkv, d), k.dtype), ("v", (b, rows, hkv, d), v.dtype)]
    longest = ops.message(fields(max(lengths)))
    mine = longest.resized(fields(lengths[transport.rank]))
    ops.copy_(mine["k"], k)
    ops.copy_(mine["v"], v)
    packed = longest.span("k", "v")
    gathered = ops.zeros((transport.size,) + tuple(packed.shape), packed.dtype)
    t0 = now()
    with ops.annotate("allgather k, v"):
        transport.allgather(packed, gathered)
    seconds = now() - t0
    pairs = []
    for j in range(transport.size):
        theirs = longest.resized(fields(lengths[j]))
        base = theirs.offsets["k"][0]
        row = gathered[j]
        (k0, k1), (v0, v1) = theirs.offsets["k"], theirs.offsets["v"]
        pairs.append((row[k0 - base:k1 - base].view(k.dtype).reshape(theirs["k"].shape),
                      row[v0 - base:v1 - base].view(v.dtype).reshape(theirs["v"].shape)))
    return pairs, seconds


def _reduce_scatter(ops, transport, partial, fields, lengths, trace):
    """Sum over ranks of partial[owner], delivered to each owner: ring reduce-scatter.

    At hop t (0 <= t < G-1) rank r sends the running sum for owner (r-t-1) % G to next and
    receives the running sum for owner (r-t-2) % G from prev, then adds its own partial for
    that owner. After G-1 hops the running sum received is the one for owner r.
    fields(rows): the message of one owner's dk, dv; lengths: every owner's rows (the two
    buffers are sized for the longest and laid out for the owner they hold).
    """
    size, rank = transport.size, transport.rank
    if size == 1:
        return partial[0]
    bufs = [ops.message(fields(max(lengths))) for _ in range(2)]

    def holding(t: int):  # the buffer of hop t, holding the running sum of owner r-t-1
        return laid_out(bufs[t % 2], fields(lengths[(rank - t - 1) % size]))

    first = holding(0)
    ops.copy_(first.span("dk", "dv"), partial[(rank - 1) % size].span("dk", "dv"))
    for t in range(size - 1):
        cur, nxt = holding(t), holding(t + 1)
        post_exchange(ops, transport, f"reduce-scatter {t}",
                      [(cur.span("dk", "dv"), nxt.span("dk", "dv"))])
        wait_s = timed_wait(ops, transport, f"reduce-scatter {t} wait")
        t0 = now()
        owner = (rank - t - 2) % size
        ops.add_(nxt["dk"], partial[owner]["dk"])
        ops.add_(nxt["dv"], partial[owner]["dv"])
        if trace is not None:
            trace.add("backward", size + t, owner, 0, now() - t0, wait_s)
    return holding(size - 1)


# ----------------------------------------------------------------------------------------------
# what one rank sends (the strategy interface, `burstcu.engine`). Of the mask only the layout
# matters (uneven shards travel padded to the longest in the all-gather; the reduce-scatter
# sends each owner's rows); allgather skips nothing

def forward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                  causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """This rank's K, V, padded to the longest shard, to each of the G-1 others."""
    longest = max(as_partition(layout, size, q.shape[1]).lengths)
    return (size - 1) * longest * kv_row_bytes(k, v)


def backward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                   causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The all-gather again, then every other owner's dK, dV sums passing by (N - S_r rows)."""
    part = as_partition(layout, size, q.shape[1])
    rows = part.total - part.lengths[rank]              # every other owner's sum passes by
    return forward_bytes(size, q, k, v, layout=layout) + rows * grad_row_bytes(k, v)


def forward_messages(size: int, q, k, v, *, rank: int = 0,
                     layout: str | Partition = "contiguous", causal: bool = False,
                     window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The all-gather: this rank's K, V to each other rank."""
    return size - 1


def backward_messages(size: int, q, k, v, *, rank: int = 0,
                      layout: str | Partition = "contiguous", causal: bool = False,
                      window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The all-gather again, then G-1 reduce-scatter hops."""
    return 2 * (size - 1)
