"""All-gather K and V, attend locally; reduce-scatter dK, dV (Megatron context parallelism,
LASP-2H for softmax layers) — a baseline beside BurstAttention, `burstcu.engine.burst`.

forward: all-gather K and V (one collective, K and V packed), then attend over the whole sequence.
backward: all-gather K, V again, compute dq and every rank's partial dk, dv, then reduce-scatter
    dk, dv to their owners: the classic ring reduce-scatter over `send_recv` (G-1 steps, dk and
    dv packed). No overlap: the gather is blocking, by design of the baseline.
    bytes fwd = (G-1) * (|k| + |v|)                    messages = 0 (collective)
    bytes bwd = (G-1) * (|k| + |v|) + (G-1) * 2 * |k|_acc   messages = G-1
Trace: the blocking all-gather is recorded as the wait of step 0 (before any compute) and each
reduce-scatter step as its own entry (step G, G+1, ...). Shapes as in `burstcu.engine`.
"""

from __future__ import annotations

from ..layout import step_blocks
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import cast_copy, kv_bytes_acc, now, partial_kv_grads, post_exchange, timed, timed_wait


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
        t0 = now()
        with ops.annotate("allgather k, v"):
            transport.allgather(packed, gathered)
        seconds = now() - t0
        (k0, k1), (v0, v1) = mine.offsets["k"], mine.offsets["v"]
        base = mine.offsets["k"][0]
        pairs = []
        for j in range(transport.size):
            row = gathered[j]
            pairs.append((row[k0 - base:k1 - base].view(k.dtype).reshape(k.shape),
                          row[v0 - base:v1 - base].view(v.dtype).reshape(v.shape)))
        return pairs, seconds

    def forward(self, q, k, v, ops: LocalOps, transport: Transport, *, causal: bool,
                softmax_scale: float, layout: str, trace=None, window=(-1, -1), docs=None):
        """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S)."""
        size, rank, seqlen = transport.size, transport.rank, q.shape[1]
        kv, gather_s = self._gather_kv(ops, transport, k, v)
        state = ops.forward_init(q, softmax_scale)
        # visit the shards in the ring's order so traces line up with the other strategies
        for s in range(size):
            source = (rank - s) % size
            blocks = step_blocks(layout, rank, source, size, seqlen, causal, window, docs)
            compute_s = 0.0
            if blocks:
                compute_s = timed(ops, f"allgather fwd {s} compute", ops.forward_step, state,
                                       kv[source][0], kv[source][1], blocks)
            if trace is not None:
                trace.add("forward", s, source, len(blocks), compute_s, gather_s if s == 0 else 0.0)
        return ops.forward_finalize(state, q.dtype)

    def backward(self, dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *,
                 causal: bool, softmax_scale: float, layout: str, trace=None, row_sums=None,
                 window=(-1, -1), docs=None):
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
            blocks = step_blocks(layout, rank, source, size, seqlen, causal, window, docs)
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
        mine = self._reduce_scatter(ops, transport, partial, fields, trace)
        return (cast_copy(ops, dq, q.dtype), cast_copy(ops, mine["dk"], k.dtype),
                cast_copy(ops, mine["dv"], v.dtype))

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
            post_exchange(ops, transport, f"reduce-scatter {t}", [(cur.span("dk", "dv"), nxt.span("dk", "dv"))])
            wait_s = timed_wait(ops, transport, f"reduce-scatter {t} wait")
            t0 = now()
            owner = (rank - t - 2) % size
            ops.add_(nxt["dk"], partial[owner]["dk"])
            ops.add_(nxt["dv"], partial[owner]["dv"])
            if trace is not None:
                trace.add("backward", size + t, owner, 0, now() - t0, wait_s)
        return bufs[(size - 1) % 2]

    # -- what one rank sends -------------------------------------------------------------------
    @staticmethod
    def forward_bytes(size: int, q, k, v, **mask) -> int:
        return (size - 1) * (k.nbytes + v.nbytes)

    @staticmethod
    def backward_bytes(size: int, q, k, v, **mask) -> int:  # mask: the same bytes
        return (size - 1) * (k.nbytes + v.nbytes + 2 * kv_bytes_acc(k))

    @staticmethod
    def forward_messages(size: int, q=None, **mask) -> int:
        return 0  # the all-gather is a collective: bytes are counted, messages are not

    @staticmethod
    def backward_messages(size: int, q=None, **mask) -> int:
        return size - 1
