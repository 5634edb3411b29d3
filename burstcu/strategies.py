"""Baseline strategies for exact distributed attention, run through the same transport and the
same `LocalOps` as BurstAttention, so a benchmark compares schedules, never attention kernels.

`get(name)` returns an object with the engine interface of `burstcu.ring`:

    forward(q, k, v, ops, transport, *, causal, softmax_scale, layout, trace) -> (out, lse)
    backward(dout, q, k, v, out, lse, ops, transport, *, causal, softmax_scale, layout, trace)
        -> (dq, dk, dv)

plus the byte and message formulas of what one rank sends (`forward_bytes`, `backward_bytes`,
`forward_messages`, `backward_messages`), which the tests check against `transport.stats`.

Shapes (B batch, S local sequence length, H query heads, Hkv key/value heads, D head dim):
q, dout, out, dq: (B, S, H, D); k, v, dk, dv: (B, S, Hkv, D); lse: (B, H, S) in the accumulation
dtype (float32; float64 for float64 input). Masking follows `burstcu.layout.step_blocks`: causal
over *global* positions, whatever the layout. G ranks, next = (r+1) % G, prev = (r-1) % G.

"burst"      this library's engine (`burstcu.ring`): K and V in ONE message per step; backward
             moves (Q, dO, delta, lse) + a dQ accumulator while K, V stay.
"ring"       Ring Attention as Liu et al. / ring-flash-attention run it:
             forward: K and V as TWO messages per step (queued together, one commit, double
                 buffered, so the transfer still overlaps the step's compute);
             backward: K, V and the dK, dV accumulators travel (4 messages per step); Q, dO, lse,
                 delta and the dQ accumulator stay. The dK/dV of the block computed at step s is
                 sent at step s+1 (its transfer overlaps that step's compute); after the last
                 step one more hop brings every dK/dV home to its owner.
                 bytes fwd = (G-1) * (|k| + |v|)                   messages = 2(G-1)
                 bytes bwd = (G-1) * (|k| + |v|) + G * 2 * |k|_acc  messages = 2(G-1) + 2G
             (|k|_acc: k's element count in the accumulation dtype — dK, dV travel in fp32.)
"allgather"  Megatron context parallelism / LASP-2H for softmax layers: all-gather K and V
             (one collective, K and V packed), then attend locally over the whole sequence.
             backward: all-gather K, V again, compute dq and every rank's partial dk, dv, then
             reduce-scatter dk, dv to their owners. The transport has no reduce-scatter, so it
             is the classic ring reduce-scatter over `send_recv` (G-1 steps, dk and dv packed).
             No overlap: the gather is blocking, by design of the baseline.
                 bytes fwd = (G-1) * (|k| + |v|)                   messages = 0 (collective)
                 bytes bwd = (G-1) * (|k| + |v|) + (G-1) * 2 * |k|_acc   messages = G-1

Trace entries (`burstcu.ring.Trace`) have the engine's meaning: per step, host seconds in
compute and in `wait`. For "allgather" the blocking all-gather is recorded as the wait of step 0
(before any compute) and each reduce-scatter step as its own entry (step G, G+1, ...).
"""

from __future__ import annotations

import time

from . import ring
from .layout import step_blocks
from .ops.base import LocalOps, accum_dtype
from .transport.base import Transport

# ----------------------------------------------------------------------------------------------
# small helpers shared by the baselines


def _now() -> float:
    return time.perf_counter()


def _partial_kv_grads(ops: LocalOps, k, v, q, dout, lse, delta, dq, blocks, scale, acc,
                      row_sums=None):
    """dk, dv (B, S, Hkv, D) in `acc` contributed by the visiting queries q over keys (k, v),
    and dq += their dq (row_sums += their rows' sums of P, if given). Uses only the public
    LocalOps calls: a fresh context per block, so the partial can be added to an accumulator
    that travels (the ops' own context cannot)."""
    ctx = ops.backward_init(k, v, scale)
    ops.backward_step(ctx, q, dout, lse, delta, dq, blocks, *([] if row_sums is None else [row_sums]))
    return ops.backward_finalize(ctx, acc)


def _kv_bytes_acc(k) -> int:
    return int(k.size) * accum_dtype(k.dtype).itemsize


# ----------------------------------------------------------------------------------------------
# Ring Attention: K and V as separate messages; K, V, dK, dV travel in the backward pass


class RingAttention:
    """Classic Ring Attention (see the module docstring for the schedule and byte formulas)."""

    name = "ring"

    def forward(self, q, k, v, ops: LocalOps, transport: Transport, *, causal: bool,
                softmax_scale: float, layout: str, trace=None):
        """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S)."""
        size, rank, seqlen = transport.size, transport.rank, q.shape[1]
        # separate allocations: K and V are distinct messages, as in the original
        kbuf = [ops.zeros(k.shape, k.dtype) for _ in range(2)]
        vbuf = [ops.zeros(v.shape, v.dtype) for _ in range(2)]
        ops.copy_(kbuf[0], k)
        ops.copy_(vbuf[0], v)
        state = ops.forward_init(q, softmax_scale)
        for s in range(size):
            cur, nxt = s % 2, (s + 1) % 2
            exchanging = s < size - 1
            if exchanging:
                ring.post_exchange(ops, transport, f"ring fwd {s} send/recv k, v",
                      [(kbuf[cur], kbuf[nxt]), (vbuf[cur], vbuf[nxt])])
            source = (rank - s) % size
            blocks = step_blocks(layout, rank, source, size, seqlen, causal)
            compute_s = 0.0
            if blocks:
                compute_s = ring.timed(ops, f"ring fwd {s} compute", ops.forward_step, state,
                                       kbuf[cur], vbuf[cur], blocks)
            wait_s = ring.timed_wait(ops, transport, f"ring fwd {s} wait") if exchanging else 0.0
            if trace is not None:
                trace.add("forward", s, source, len(blocks), compute_s, wait_s)
        return ops.forward_finalize(state, q.dtype)

    def backward(self, dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *,
                 causal: bool, softmax_scale: float, layout: str, trace=None, row_sums=None):
        """Gradients of `forward`. Returns dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the input dtype.
        row_sums: None, or (B,H,S) in the accumulation dtype, zeroed: receives each of this
        rank's rows' sum of the recomputed P over every rank's keys (Q stays, so it stays too)."""
        size, rank, seqlen = transport.size, transport.rank, q.shape[1]
        acc = accum_dtype(q.dtype)
        kbuf = [ops.zeros(k.shape, k.dtype) for _ in range(2)]
        vbuf = [ops.zeros(v.shape, v.dtype) for _ in range(2)]
        dkbuf = [ops.zeros(k.shape, acc) for _ in range(2)]
        dvbuf = [ops.zeros(v.shape, acc) for _ in range(2)]
        ops.copy_(kbuf[0], k)
        ops.copy_(vbuf[0], v)
        delta = ops.backward_delta(dout, out)
        dq = ops.zeros(q.shape, acc)
        for s in range(size):
            cur, nxt = s % 2, (s + 1) % 2
            # K, V of the next block go ahead; the dK, dV finished at step s-1 follow one behind
            pairs = []
            if s < size - 1:
                pairs += [(kbuf[cur], kbuf[nxt]), (vbuf[cur], vbuf[nxt])]
            if s >= 1:
                pairs += [(dkbuf[cur], dkbuf[nxt]), (dvbuf[cur], dvbuf[nxt])]
            if pairs:
                ring.post_exchange(ops, transport, f"ring bwd {s} send/recv", pairs)
            source = (rank - s) % size  # the keys are source's; the queries are ours
            blocks = step_blocks(layout, rank, source, size, seqlen, causal)
            compute_s, parts = 0.0, None
            if blocks:
                t0 = _now()
                with ops.annotate(f"ring bwd {s} compute"):
                    parts = _partial_kv_grads(ops, kbuf[cur], vbuf[cur], q, dout, lse, delta, dq,
                                              blocks, softmax_scale, acc, row_sums)
                compute_s = _now() - t0
            wait_s = ring.timed_wait(ops, transport, f"ring bwd {s} wait") if pairs else 0.0
            # nxt's dk/dv slot now holds what earlier holders accumulated for `source` (or
            # nothing at s == 0); the slot is sent on at step s+1
            self._fold(ops, dkbuf[nxt], dvbuf[nxt], parts, first=(s == 0))
            if trace is not None:
                trace.add("backward", s, source, len(blocks), compute_s, wait_s)
        dk, dv = self._return_home(ops, transport, dkbuf[size % 2], dvbuf[size % 2], trace)
        return self._cast(ops, dq, q.dtype), self._cast(ops, dk, k.dtype), self._cast(ops, dv, v.dtype)

    @staticmethod
    def _fold(ops, dk_slot, dv_slot, parts, first: bool) -> None:
        """dk_slot, dv_slot = (0 if first else themselves) + parts (None: nothing computed)."""
        if first:
            ops.copy_(dk_slot, 0)
            ops.copy_(dv_slot, 0)
        if parts is not None:
            ops.add_(dk_slot, parts[0])
            ops.add_(dv_slot, parts[1])

    @staticmethod
    def _return_home(ops, transport, dk_last, dv_last, trace):
        """After step G-1 a rank holds the dK, dV of block (r+1) % G: one hop brings it home."""
        dk, dv = ops.zeros(dk_last.shape, dk_last.dtype), ops.zeros(dv_last.shape, dv_last.dtype)
        if transport.size == 1:
            ops.copy_(dk, dk_last)
            ops.copy_(dv, dv_last)
            return dk, dv
        ring.post_exchange(ops, transport, "ring bwd return dk, dv", [(dk_last, dk), (dv_last, dv)])
        wait_s = ring.timed_wait(ops, transport, "ring bwd return wait")
        if trace is not None:
            trace.add("backward", transport.size, transport.rank, 0, 0.0, wait_s)
        return dk, dv

    @staticmethod
    def _cast(ops, x, dtype):
        y = ops.zeros(x.shape, dtype)
        ops.copy_(y, x)
        return y

    # -- what one rank sends -------------------------------------------------------------------
    @staticmethod
    def forward_bytes(size: int, q, k, v) -> int:
        return (size - 1) * (k.nbytes + v.nbytes)

    @staticmethod
    def backward_bytes(size: int, q, k, v) -> int:
        if size == 1:
            return 0
        return (size - 1) * (k.nbytes + v.nbytes) + size * 2 * _kv_bytes_acc(k)

    @staticmethod
    def forward_messages(size: int) -> int:
        return 2 * (size - 1)

    @staticmethod
    def backward_messages(size: int) -> int:
        return 0 if size == 1 else 2 * (size - 1) + 2 * size


# ----------------------------------------------------------------------------------------------
# All-gather K and V, attend locally; reduce-scatter dK, dV


class AllGatherAttention:
    """Megatron-CP / LASP-2H style (see the module docstring)."""

    name = "allgather"

    @staticmethod
    def _gather_kv(ops: LocalOps, transport: Transport, k, v):
        """Every rank's (k, v): a list of G pairs of (B,S,Hkv,D) views, and the seconds spent."""
        fields = [("k", k.shape, k.dtype), ("v", v.shape, v.dtype)]
        mine = ops.message(fields)
        ops.copy_(mine["k"], k)
        ops.copy_(mine["v"], v)
        packed = mine.span("k", "v")
        gathered = ops.zeros((transport.size,) + tuple(packed.shape), packed.dtype)
        t0 = _now()
        with ops.annotate("allgather k, v"):
            transport.allgather(packed, gathered)
        seconds = _now() - t0
        (k0, k1), (v0, v1) = mine.offsets["k"], mine.offsets["v"]
        base = mine.offsets["k"][0]
        pairs = []
        for j in range(transport.size):
            row = gathered[j]
            pairs.append((row[k0 - base:k1 - base].view(k.dtype).reshape(k.shape),
                          row[v0 - base:v1 - base].view(v.dtype).reshape(v.shape)))
        return pairs, seconds

    def forward(self, q, k, v, ops: LocalOps, transport: Transport, *, causal: bool,
                softmax_scale: float, layout: str, trace=None):
        """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S)."""
        size, rank, seqlen = transport.size, transport.rank, q.shape[1]
        kv, gather_s = self._gather_kv(ops, transport, k, v)
        state = ops.forward_init(q, softmax_scale)
        # visit the shards in the ring's order so traces line up with the other strategies
        for s in range(size):
            source = (rank - s) % size
            blocks = step_blocks(layout, rank, source, size, seqlen, causal)
            compute_s = 0.0
            if blocks:
                compute_s = ring.timed(ops, f"allgather fwd {s} compute", ops.forward_step, state,
                                       kv[source][0], kv[source][1], blocks)
            if trace is not None:
                trace.add("forward", s, source, len(blocks), compute_s, gather_s if s == 0 else 0.0)
        return ops.forward_finalize(state, q.dtype)

    def backward(self, dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *,
                 causal: bool, softmax_scale: float, layout: str, trace=None, row_sums=None):
        """Gradients of `forward`. Returns dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the input dtype.
        row_sums: as for RingAttention.backward."""
        size, rank, seqlen = transport.size, transport.rank, q.shape[1]
        acc = accum_dtype(q.dtype)
        kv, gather_s = self._gather_kv(ops, transport, k, v)
        delta = ops.backward_delta(dout, out)
        dq = ops.zeros(q.shape, acc)
        # partial dk, dv for every owner, packed per owner so each reduce-scatter hop is one span
        fields = [("dk", k.shape, acc), ("dv", v.shape, acc)]
        partial = [ops.message(fields) for _ in range(size)]
        for s in range(size):
            source = (rank - s) % size
            blocks = step_blocks(layout, rank, source, size, seqlen, causal)
            ops.copy_(partial[source].flat, 0)
            compute_s = 0.0
            if blocks:
                t0 = _now()
                with ops.annotate(f"allgather bwd {s} compute"):
                    dk_p, dv_p = _partial_kv_grads(ops, kv[source][0], kv[source][1], q, dout, lse,
                                                   delta, dq, blocks, softmax_scale, acc, row_sums)
                    ops.copy_(partial[source]["dk"], dk_p)
                    ops.copy_(partial[source]["dv"], dv_p)
                compute_s = _now() - t0
            if trace is not None:
                trace.add("backward", s, source, len(blocks), compute_s, gather_s if s == 0 else 0.0)
        mine = self._reduce_scatter(ops, transport, partial, fields, trace)
        return (RingAttention._cast(ops, dq, q.dtype), RingAttention._cast(ops, mine["dk"], k.dtype),
                RingAttention._cast(ops, mine["dv"], v.dtype))

    @staticmethod
    def _reduce_scatter(ops, transport, partial, fields, trace):
        """Sum over ranks of partial[owner], delivered to each owner: ring reduce-scatter.

        At hop t (0 <= t < G-1) rank r sends the running sum for owner (r-t-1) % G to next and
        receives the running sum for owner (r-t-2) % G from prev, then adds its own partial for
        that owner. After G-1 hops the running sum received is the one for owner r.
        """
        size, rank = transport.size, transport.rank
        if size == 1:
            return partial[0]
        bufs = [ops.message(fields) for _ in range(2)]
        ops.copy_(bufs[0].flat, partial[(rank - 1) % size].flat)
        for t in range(size - 1):
            cur, nxt = bufs[t % 2], bufs[(t + 1) % 2]
            ring.post_exchange(ops, transport, f"reduce-scatter {t}", [(cur.span("dk", "dv"), nxt.span("dk", "dv"))])
            wait_s = ring.timed_wait(ops, transport, f"reduce-scatter {t} wait")
            t0 = _now()
            owner = (rank - t - 2) % size
            ops.add_(nxt["dk"], partial[owner]["dk"])
            ops.add_(nxt["dv"], partial[owner]["dv"])
            if trace is not None:
                trace.add("backward", size + t, owner, 0, _now() - t0, wait_s)
        return bufs[(size - 1) % 2]

    # -- what one rank sends -------------------------------------------------------------------
    @staticmethod
    def forward_bytes(size: int, q, k, v) -> int:
        return (size - 1) * (k.nbytes + v.nbytes)

    @staticmethod
    def backward_bytes(size: int, q, k, v) -> int:
        return (size - 1) * (k.nbytes + v.nbytes + 2 * _kv_bytes_acc(k))

    @staticmethod
    def forward_messages(size: int) -> int:
        return 0  # the all-gather is a collective: bytes are counted, messages are not

    @staticmethod
    def backward_messages(size: int) -> int:
        return size - 1


# ----------------------------------------------------------------------------------------------
# BurstAttention: this library's engine, with the same formula interface


class BurstAttention:
    """`burstcu.ring` behind the strategy interface (K and V together; Q, dO, delta, lse, dQ
    travel in the backward pass)."""

    name = "burst"
    forward = staticmethod(ring.forward)
    backward = staticmethod(ring.backward)

    @staticmethod
    def forward_bytes(size: int, q, k, v) -> int:
        return ring.forward_bytes(size, k, v)

    @staticmethod
    def backward_bytes(size: int, q, k, v) -> int:
        return ring.backward_bytes(size, q)

    @staticmethod
    def forward_messages(size: int) -> int:
        return ring.forward_messages(size)

    @staticmethod
    def backward_messages(size: int) -> int:
        return ring.backward_messages(size)


_STRATEGIES = {"burst": BurstAttention, "ring": RingAttention, "allgather": AllGatherAttention}
NAMES = tuple(_STRATEGIES)


def get(name: str):
    """The strategy object called `name` ("burst", "ring" or "allgather")."""
    try:
        return _STRATEGIES[name]()
    except KeyError:
        raise ValueError(f"strategy must be one of {NAMES}, not {name!r}") from None


__all__ = ["get", "NAMES", "BurstAttention", "RingAttention", "AllGatherAttention"]
