"""What every strategy's loop shares: step traces, timed compute and waits, posting an exchange,
and the partial-gradient helper of the strategies whose keys travel.

Shapes as in `burstcu.ops.base`: q, dout, dq (B, S, H, D); k, v, dk, dv (B, S, Hkv, D); lse,
delta (B, H, S).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..layout import Partition, blocks as mask_blocks
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport


def now() -> float:
    return time.perf_counter()


@dataclass
class StepTrace:
    """Host-side timings of one ring step on one rank (seconds; on a GPU: enqueue times only),
    noted as the step ends. `step`: the ring's 0, 1, ...; ulysses notes 0 (its all-to-all in),
    1 (the attention) and 2 (the all-to-all back), usp -1 (its all-to-all in) before the ring's
    steps and G/u (forward) or G/u + 1 (backward) after them (the all-to-all back: past the
    backward's last step G/u, which a ring of one group has not)."""

    pass_: str
    step: int
    source_rank: int
    blocks: int
    compute_s: float
    wait_s: float


@dataclass
class Trace:
    steps: list[StepTrace] = field(default_factory=list)

    def add(self, *args) -> None:
        self.steps.append(StepTrace(*args))


def ring_folds(part: Partition, rank: int, causal: bool, window_size, cu_seqlens,
               block_mask) -> tuple[list, int]:
    """The Blocks `rank` folds at each step s of a forward that visits the keys of rank - s in
    turn (empty: no fold), and the last step with a fold (-1: none), whose fold ends the pass
    (`LocalOps.forward_step`'s last)."""
    size = part.size
    folds = [mask_blocks(part, rank, (rank - s) % size, causal, window_size, cu_seqlens, block_mask)
             for s in range(size)]
    return folds, max((s for s, blocks in enumerate(folds) if blocks), default=-1)


def timed(ops: LocalOps, label: str, fn, *args) -> float:
    """Run fn(*args) inside an annotated range; host seconds spent issuing it."""
    t0 = time.perf_counter()
    with ops.annotate(label):
        fn(*args)
    return time.perf_counter() - t0


def timed_wait(ops: LocalOps, transport: Transport, label: str) -> float:
    """transport.wait() inside an annotated range; host seconds spent blocked."""
    t0 = time.perf_counter()
    with ops.annotate(label):
        transport.wait()
    return time.perf_counter() - t0


def post_exchange(ops: LocalOps, transport: Transport, label: str, pairs) -> None:
    """Queue one message per (send_buf, recv_buf) pair — send to next, receive from prev — and
    post them together in one commit."""
    with ops.annotate(label):
        for send_buf, recv_buf in pairs:
            transport.send_recv(send_buf, recv_buf, transport.next_rank, transport.prev_rank)
        transport.commit()


def post_pairwise(ops: LocalOps, transport: Transport, label: str, exchanges) -> None:
    """Queue one message per (send_buf, recv_buf, peer) — send to peer, receive from the same
    peer — and post them together in one commit (an all-to-all is one such call)."""
    with ops.annotate(label):
        for send_buf, recv_buf, peer in exchanges:
            transport.send_recv(send_buf, recv_buf, peer, peer)
        transport.commit()


def post_messages(ops: LocalOps, transport: Transport, label: str, messages) -> None:
    """Queue (send_buf, recv_buf, dst, src) exchanges, each side optional, and post them in one
    commit (a step whose messages go to different peers)."""
    with ops.annotate(label):
        for send_buf, recv_buf, dst, src in messages:
            transport.send_recv(send_buf, recv_buf, dst, src)
        transport.commit()


def partial_kv_grads(ops: LocalOps, k, v, q, dout, lse, delta, dq, blocks, scale, acc,
                      row_sums=None):
    """dk, dv (B, S, Hkv, D) in `acc` contributed by the visiting queries q over keys (k, v),
    and dq += their dq (row_sums += their rows' sums of P, if given). Uses only the public
    LocalOps calls: a fresh context per block, so the partial can be added to an accumulator
    that travels (the ops' own context cannot)."""
    ctx = ops.backward_init(k, v, scale)
    ops.backward_step(ctx, q, dout, lse, delta, dq, blocks, *([] if row_sums is None else [row_sums]))
    return ops.backward_finalize(ctx, acc)


def cast_copy(ops: LocalOps, x, dtype):
    """A fresh array of x's shape in `dtype` holding x."""
    y = ops.zeros(x.shape, dtype)
    ops.copy_(y, x)
    return y


def prefix(flat, shape):
    """The first prod(shape) elements of the 1-D array `flat`, as a contiguous array of `shape`
    (a buffer sized for the longest shard, holding a shorter one)."""
    n = 1
    for extent in shape:
        n *= int(extent)
    return flat[:n].reshape(shape)


def laid_out(message, fields):
    """`message` itself when its fields already have these shapes, else the same storage laid
    out for `fields` (`Message.resized`): uneven shards reuse the buffers of the longest."""
    same = all(tuple(message[name].shape) == tuple(shape) for name, shape, _ in fields
               if name in message.fields)
    return message if same and len(fields) == len(message.fields) else message.resized(fields)


def row_bytes(x) -> int:
    """Bytes of one sequence row of x (B, S, ...)."""
    return x.nbytes // x.shape[1]


def kv_row_bytes(k, v) -> int:
    """Bytes of one row of K and V together (k, v: (B, S, Hkv, D)): what a K/V block sends a row."""
    return row_bytes(k) + row_bytes(v)


def grad_row_bytes(k, v) -> int:
    """Bytes of one row of dK and dV in the accumulation dtype (the gradients travel in it)."""
    acc = accum_dtype(k.dtype).itemsize
    return (k.size // k.shape[1] + v.size // v.shape[1]) * acc


def mask_key(causal, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> tuple:
    """(causal, window_size, cu_seqlens, block_mask) as a bool, a pair of ints, a tuple of ints
    (or None) and a `burstcu.BlockMask` (or None): the hashable form the cached schedule
    queries (`burst.needs`, ...) take."""
    return (bool(causal), (int(window_size[0]), int(window_size[1])),
            None if cu_seqlens is None else tuple(int(b) for b in cu_seqlens), block_mask)


def seq_view(flat, x, rows: int):
    """A contiguous (B, rows, *x.shape[2:]) view at the start of the 1-D `flat` (in x's
    layout; x only gives the shape)."""
    return prefix(flat, (x.shape[0], rows) + tuple(x.shape[2:]))
