"""Ring Attention as Liu et al. / ring-flash-attention run it, on this library's transports and
local ops (a baseline beside BurstAttention, `burstcu.engine.burst`).

forward: K and V as TWO messages per step (queued together, one commit, double buffered, so the
    transfer still overlaps the step's compute);
backward: K, V and the dK, dV accumulators travel (4 messages per step); Q, dO, lse, delta and
    the dQ accumulator stay. The dK/dV of the block computed at step s is sent at step s+1 (its
    transfer overlaps that step's compute); after the last step one more hop brings every dK/dV
    home to its owner.
    bytes fwd = (G-1) * (|k| + |v|)                    messages = 2(G-1)
    bytes bwd = (G-1) * (|k| + |v|) + G * 2 * |k|_acc   messages = 2(G-1) + 2G
(|k|_acc: k's element count in the accumulation dtype: dK, dV travel in fp32.) Uneven shards
(a `burstcu.layout.Partition`): every block travels at its owner's length, so rank r sends the
rows of blocks r, r-1, ..., r-G+2 in the forward (N - S_{r+1} rows) and N rows of dK, dV.
Shapes as in `burstcu.engine`.
"""

from __future__ import annotations

from ..layout import Partition, as_partition, blocks as mask_blocks
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import (cast_copy, grad_row_bytes, kv_row_bytes, now, partial_kv_grads, post_exchange,
                    ring_folds, seq_view, timed, timed_wait)


def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, softmax_scale: float,
            layout: str | Partition, trace=None, window_size=(-1, -1), cu_seqlens=None, block_mask=None):
    """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S).
    layout: a name, or a Partition (uneven shards: buffers of the longest, each block at its
    owner's length); window_size, cu_seqlens, block_mask: the mask (`layout.blocks`)."""
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    lengths = part.lengths
    # separate allocations: K and V are distinct messages, as in the original
    kflat = [ops.zeros((k.size // k.shape[1] * max(lengths),), k.dtype) for _ in range(2)]
    vflat = [ops.zeros((v.size // v.shape[1] * max(lengths),), v.dtype) for _ in range(2)]

    def kv(step: int):  # the buffers of `step`, at the length of the block they hold
        rows = lengths[(rank - step) % size]
        return seq_view(kflat[step % 2], k, rows), seq_view(vflat[step % 2], v, rows)

    k0, v0 = kv(0)
    ops.copy_(k0, k)
    ops.copy_(v0, v)
    state = ops.forward_init(q, softmax_scale)
    blocks_of, last = ring_folds(part, rank, causal, window_size, cu_seqlens, block_mask)
    for s in range(size):
        (kc, vc), (kn, vn) = kv(s), kv(s + 1)
        exchanging = s < size - 1
        if exchanging:
            post_exchange(ops, transport, f"ring fwd {s} send/recv k, v", [(kc, kn), (vc, vn)])
        source = (rank - s) % size
        blocks = blocks_of[s]
        compute_s = 0.0
        if blocks:
            compute_s = timed(ops, f"ring fwd {s} compute", ops.forward_step, state, kc, vc,
                              blocks, s == last)
        wait_s = timed_wait(ops, transport, f"ring fwd {s} wait") if exchanging else 0.0
        if trace is not None:
            trace.add("forward", s, source, len(blocks), compute_s, wait_s)
    return ops.forward_finalize(state, q.dtype)


def backward(dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *, causal: bool,
             softmax_scale: float, layout: str | Partition, trace=None, row_sums=None,
             window_size=(-1, -1), cu_seqlens=None, block_mask=None):
    """Gradients of `forward`. Returns dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the input dtype.
    row_sums: None, or (B,H,S) in the accumulation dtype, zeroed: receives each of this
    rank's rows' sum of the recomputed P over every rank's keys (Q stays, so it stays too)."""
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    lengths = part.lengths
    acc = accum_dtype(q.dtype)
    n = k.size // k.shape[1] * max(lengths)
    kflat, vflat = ([ops.zeros((n,), k.dtype) for _ in range(2)] for _ in range(2))
    dkflat, dvflat = ([ops.zeros((n,), acc) for _ in range(2)] for _ in range(2))

    def kv(step: int):   # K, V of the block of `step`
        rows = lengths[(rank - step) % size]
        return seq_view(kflat[step % 2], k, rows), seq_view(vflat[step % 2], v, rows)

    def grads(step: int):  # the dK, dV slots of `step`: those of the block of step - 1
        rows = lengths[(rank - step + 1) % size]
        return seq_view(dkflat[step % 2], k, rows), seq_view(dvflat[step % 2], v, rows)

    k0, v0 = kv(0)
    ops.copy_(k0, k)
    ops.copy_(v0, v)
    delta = ops.backward_delta(dout, out)
    dq = ops.zeros(q.shape, acc)
    for s in range(size):
        (kc, vc), (kn, vn) = kv(s), kv(s + 1)
        (dkc, dvc), (dkn, dvn) = grads(s), grads(s + 1)
        # K, V of the next block go ahead; the dK, dV finished at step s-1 follow one behind
        pairs = []
        if s < size - 1:
            pairs += [(kc, kn), (vc, vn)]
        if s >= 1:
            pairs += [(dkc, dkn), (dvc, dvn)]
        if pairs:
            post_exchange(ops, transport, f"ring bwd {s} send/recv", pairs)
        source = (rank - s) % size  # the keys are source's; the queries are ours
        blocks = mask_blocks(part, rank, source, causal, window_size, cu_seqlens, block_mask)
        compute_s, parts = 0.0, None
        if blocks:
            t0 = now()
            with ops.annotate(f"ring bwd {s} compute"):
                parts = partial_kv_grads(ops, kc, vc, q, dout, lse, delta, dq,
                                         blocks, softmax_scale, acc, row_sums)
            compute_s = now() - t0
        wait_s = timed_wait(ops, transport, f"ring bwd {s} wait") if pairs else 0.0
        # the step-(s+1) dk/dv slot now holds what earlier holders accumulated for
        # `source` (or nothing at s == 0); it is sent on at step s+1
        _fold(ops, dkn, dvn, parts, first=(s == 0))
        if trace is not None:
            trace.add("backward", s, source, len(blocks), compute_s, wait_s)
    dk, dv = _return_home(ops, transport, *grads(size), k.shape, trace)
    return cast_copy(ops, dq, q.dtype), cast_copy(ops, dk, k.dtype), cast_copy(ops, dv, v.dtype)


def _fold(ops, dk_slot, dv_slot, parts, first: bool) -> None:
    """dk_slot, dv_slot = (0 if first else themselves) + parts (None: nothing computed)."""
    if first:
        ops.copy_(dk_slot, 0)
        ops.copy_(dv_slot, 0)
    if parts is not None:
        ops.add_(dk_slot, parts[0])
        ops.add_(dv_slot, parts[1])


def _return_home(ops, transport, dk_last, dv_last, shape, trace):
    """After step G-1 a rank holds the dK, dV of block (r+1) % G: one hop brings it home
    (into arrays of this rank's `shape`)."""
    dk, dv = ops.zeros(shape, dk_last.dtype), ops.zeros(shape, dv_last.dtype)
    if transport.size == 1:
        ops.copy_(dk, dk_last)
        ops.copy_(dv, dv_last)
        return dk, dv
    post_exchange(ops, transport, "ring bwd return dk, dv", [(dk_last, dk), (dv_last, dv)])
    wait_s = timed_wait(ops, transport, "ring bwd return wait")
    if trace is not None:
        trace.add("backward", transport.size, transport.rank, 0, 0.0, wait_s)
    return dk, dv


# ----------------------------------------------------------------------------------------------
# what one rank sends (the strategy interface, `burstcu.engine`). Of the mask only the layout
# matters (a Partition: the blocks a rank passes on have their owners' lengths); the classic
# ring skips nothing

def forward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                  causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The blocks of ranks r, r-1, .., r-G+2 at their owners' lengths x a row of K and V."""
    lengths = as_partition(layout, size, q.shape[1]).lengths
    rows = sum(lengths[(rank - s) % size] for s in range(size - 1))
    return rows * kv_row_bytes(k, v)


def backward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                   causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The forward's K, V again, and every dK, dV (N rows in all) in the accumulation dtype."""
    if size == 1:
        return 0
    total = as_partition(layout, size, q.shape[1]).total          # every dK, dV goes round
    return forward_bytes(size, q, k, v, rank=rank, layout=layout) + total * grad_row_bytes(k, v)


def forward_messages(size: int, q, k, v, *, rank: int = 0,
                     layout: str | Partition = "contiguous", causal: bool = False,
                     window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """K and V, two messages a step but the last."""
    return 2 * (size - 1)


def backward_messages(size: int, q, k, v, *, rank: int = 0,
                      layout: str | Partition = "contiguous", causal: bool = False,
                      window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """K, V ahead (G-1 steps) and dK, dV behind (G steps, the last one home)."""
    return 0 if size == 1 else 2 * (size - 1) + 2 * size
