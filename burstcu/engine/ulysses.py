"""DeepSpeed-Ulysses sequence parallelism: trade the sequence shard for a head shard, attend
locally over the whole sequence, trade back.

G ranks, each holding rows of the sequence (its shard under `layout`) for all H query heads.
Rank j owns the query heads [j*H/G, (j+1)*H/G) and the kv heads they use (GQA: query head h
reads kv head h // (H/Hkv)); a kv head goes only to the ranks whose query heads use it:
    Hkv % G == 0   rank j gets kv heads [j*Hkv/G, (j+1)*Hkv/G)
    G % Hkv == 0   rank j gets the one kv head its H/G query heads share (G/Hkv ranks share it)
Any other split (each rank's query heads would need a fractional number of kv heads) and H not
divisible by G are refused on every rank (`input_problem`).

forward:
    all-to-all 1   to rank j: (q of j's query heads, k and v of j's kv heads) for my rows — one
                   message a peer; from rank i: the same of my heads for i's rows
    assemble       q (B, N, H/G, D), k, v (B, N, Hk, D) in global position order (N = G*S), so
                   one Block covers everything and causal is the plain diagonal
    attend         ops.forward_init / forward_step / forward_finalize over the whole sequence
    all-to-all 2   to rank i: (lse, out) of my heads for i's rows; from rank j: j's heads for
                   mine -> out (B, S, H, D), lse (B, H, S), sequence-sharded again
backward: delta = rowsum(dO o O) is formed first (sequence-sharded, so `out` never travels);
    all-to-all 1 carries (lse, delta, q, dO, k, v), the local backward runs over the whole
    sequence, all-to-all 2 brings (row sums of P if asked, dq, dk, dv) home in the accumulation
    dtype; dk, dv of a kv head shared by several ranks are summed by the owner of the rows.

Bytes one rank sends (exact; it = input itemsize, acc = accumulation itemsize, Hg = H/G query
heads and Hk kv heads a rank: Hkv/G, or 1 when G % Hkv == 0; S the local rows):
    fwd = (G-1) * B*S * ((Hg + 2*Hk)*D*it + Hg*(acc + D*it))
    bwd = (G-1) * B*S * (Hg*(2*acc + 2*D*it) + 2*Hk*D*it  +  (Hg + 2*Hk)*D*acc [+ Hg*acc])
(the last term with row_sums); messages: 2(G-1) in each pass. Each message is one contiguous
span of one packed buffer (fields ordered so no padding falls inside a span).
Trace: step 0 is all-to-all 1 (its wait), step 1 the local attention, step 2 all-to-all 2.
"""

from __future__ import annotations

from ..layout import Block, segments
from ..ops.base import LocalOps, Message, accum_dtype
from ..transport.base import Transport
from .steps import cast_copy, post_pairwise, timed, timed_wait


class UlyssesAttention:
    """DeepSpeed-Ulysses (see the module docstring)."""

    name = "ulysses"

    # -- what it can take ------------------------------------------------------------------------
    @staticmethod
    def input_problem(q_shape, k_shape, size: int) -> str | None:
        """Why Ulysses cannot split these heads over `size` ranks, or None."""
        h, hkv = int(q_shape[2]), int(k_shape[2])
        if h % size:
            return (f"strategy 'ulysses' gives each of the {size} ranks H/G query heads: H = {h} "
                    f"is not divisible by {size}")
        if hkv % size and size % hkv:
            return (f"strategy 'ulysses' over {size} ranks with {h} query heads on {hkv} kv heads: "
                    f"each rank's {h // size} query heads would need a fraction of a kv head "
                    f"(Hkv must divide G or be a multiple of it)")
        return None

    @staticmethod
    def kv_heads(rank: int, size: int, h: int, hkv: int) -> tuple[int, int]:
        """(first, count) of the kv heads `rank`'s query heads use."""
        if hkv % size == 0:
            return rank * (hkv // size), hkv // size
        return rank * (h // size) // (h // hkv), 1

    # -- passes ------------------------------------------------------------------------------------
    def forward(self, q, k, v, ops: LocalOps, transport: Transport, *, causal: bool,
                softmax_scale: float, layout: str, trace=None):
        """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S)."""
        g, rank = transport.size, transport.rank
        b, s, h, d = q.shape
        hg, (_, hk) = h // g, self.kv_heads(rank, g, h, k.shape[2])
        acc = accum_dtype(q.dtype)

        def inbound(j):  # what rank j and I exchange in all-to-all 1, from my side
            return [(f"q{j}", (b, s, hg, d), q.dtype), (f"k{j}", (b, s, hk, d), k.dtype),
                    (f"v{j}", (b, s, hk, d), v.dtype)]
        send, recv = (ops.message([f for j in range(g) for f in inbound(j)]) for _ in range(2))
        for j in range(g):
            k0, _ = self.kv_heads(j, g, h, k.shape[2])
            ops.copy_(send[f"q{j}"], q[:, :, j * hg:(j + 1) * hg])
            ops.copy_(send[f"k{j}"], k[:, :, k0:k0 + hk])
            ops.copy_(send[f"v{j}"], v[:, :, k0:k0 + hk])
        wait_in = self._all_to_all(ops, transport, "ulysses fwd all-to-all q, k, v", send, recv,
                                   ("q", "v"))
        q_all, k_all, v_all = (_by_position(ops, recv, name, shape, dtype, layout, g, s)
                               for name, shape, dtype in (("q", (b, s, hg, d), q.dtype),
                                                          ("k", (b, s, hk, d), k.dtype),
                                                          ("v", (b, s, hk, d), v.dtype)))
        state = ops.forward_init(q_all, softmax_scale)
        n = g * s
        compute_s = timed(ops, "ulysses fwd compute", ops.forward_step, state, k_all, v_all,
                          [Block(0, n, 0, n, 0, 0, bool(causal))])
        out_h, lse_h = ops.forward_finalize(state, q.dtype)    # (B, N, Hg, D), (B, Hg, N)

        def outbound(i):  # lse first: no padding inside a peer's span
            return [(f"l{i}", (b, hg, s), acc), (f"o{i}", (b, s, hg, d), q.dtype)]
        send2, recv2 = (ops.message([f for i in range(g) for f in outbound(i)]) for _ in range(2))
        for i in range(g):
            for seg in segments(layout, i, g, s):
                ops.copy_(send2[f"l{i}"][:, :, seg.local:seg.local + seg.length],
                          lse_h[:, :, seg.pos:seg.pos + seg.length])
                ops.copy_(send2[f"o{i}"][:, seg.local:seg.local + seg.length],
                          out_h[:, seg.pos:seg.pos + seg.length])
        wait_out = self._all_to_all(ops, transport, "ulysses fwd all-to-all out, lse", send2, recv2,
                                    ("l", "o"))
        out, lse = ops.zeros(q.shape, q.dtype), ops.zeros((b, h, s), acc)
        for j in range(g):
            ops.copy_(out[:, :, j * hg:(j + 1) * hg], recv2[f"o{j}"])
            ops.copy_(lse[:, j * hg:(j + 1) * hg], recv2[f"l{j}"])
        if trace is not None:
            trace.add("forward", 0, rank, 0, 0.0, wait_in)
            trace.add("forward", 1, rank, 1, compute_s, 0.0)
            trace.add("forward", 2, rank, 0, 0.0, wait_out)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *,
                 causal: bool, softmax_scale: float, layout: str, trace=None, row_sums=None):
        """Gradients of `forward`: dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the inputs' dtype.
        row_sums: None, or (B,H,S) in the accumulation dtype: receives each of this rank's rows'
        sum of the recomputed P over the whole sequence (computed where the heads are)."""
        g, rank = transport.size, transport.rank
        b, s, h, d = q.shape
        hkv = k.shape[2]
        hg, (_, hk) = h // g, self.kv_heads(rank, g, h, hkv)
        acc = accum_dtype(q.dtype)
        delta = ops.backward_delta(dout, out)                  # (B, H, S): out stays home

        def inbound(j):  # row statistics first (accumulation dtype), then the inputs
            return [(f"st{j}", (2, b, hg, s), acc), (f"q{j}", (b, s, hg, d), q.dtype),
                    (f"do{j}", (b, s, hg, d), q.dtype), (f"k{j}", (b, s, hk, d), k.dtype),
                    (f"v{j}", (b, s, hk, d), v.dtype)]
        send, recv = (ops.message([f for j in range(g) for f in inbound(j)]) for _ in range(2))
        for j in range(g):
            heads, (k0, _) = slice(j * hg, (j + 1) * hg), self.kv_heads(j, g, h, hkv)
            ops.copy_(send[f"st{j}"][0], lse[:, heads])
            ops.copy_(send[f"st{j}"][1], delta[:, heads])
            ops.copy_(send[f"q{j}"], q[:, :, heads])
            ops.copy_(send[f"do{j}"], dout[:, :, heads])
            ops.copy_(send[f"k{j}"], k[:, :, k0:k0 + hk])
            ops.copy_(send[f"v{j}"], v[:, :, k0:k0 + hk])
        wait_in = self._all_to_all(ops, transport, "ulysses bwd all-to-all q, dout, k, v", send,
                                   recv, ("st", "v"))
        q_all, do_all, k_all, v_all = (
            _by_position(ops, recv, name, shape, dtype, layout, g, s)
            for name, shape, dtype in (("q", (b, s, hg, d), q.dtype), ("do", (b, s, hg, d), q.dtype),
                                       ("k", (b, s, hk, d), k.dtype), ("v", (b, s, hk, d), v.dtype)))
        stats = _by_position(ops, recv, "st", (2, b, hg, s), acc, layout, g, s, axis=3)
        n = g * s
        ctx = ops.backward_init(k_all, v_all, softmax_scale)
        dq_all = ops.zeros((b, n, hg, d), acc)
        sums = [ops.zeros((b, hg, n), acc)] if row_sums is not None else []
        compute_s = timed(ops, "ulysses bwd compute", ops.backward_step, ctx, q_all, do_all,
                          stats[0], stats[1], dq_all, [Block(0, n, 0, n, 0, 0, bool(causal))], *sums)
        dk_all, dv_all = ops.backward_finalize(ctx, acc)       # (B, N, Hk, D)

        def outbound(i):
            return ([(f"p{i}", (b, hg, s), acc)] if sums else []) + [
                (f"dq{i}", (b, s, hg, d), acc), (f"dk{i}", (b, s, hk, d), acc),
                (f"dv{i}", (b, s, hk, d), acc)]
        send2, recv2 = (ops.message([f for i in range(g) for f in outbound(i)]) for _ in range(2))
        for i in range(g):
            for seg in segments(layout, i, g, s):
                mine, there = slice(seg.local, seg.local + seg.length), slice(seg.pos, seg.pos + seg.length)
                if sums:
                    ops.copy_(send2[f"p{i}"][:, :, mine], sums[0][:, :, there])
                for name, full in (("dq", dq_all), ("dk", dk_all), ("dv", dv_all)):
                    ops.copy_(send2[f"{name}{i}"][:, mine], full[:, there])
        wait_out = self._all_to_all(ops, transport, "ulysses bwd all-to-all dq, dk, dv", send2,
                                    recv2, ("p" if sums else "dq", "dv"))
        dq = ops.zeros(q.shape, acc)
        dk, dv = ops.zeros(k.shape, acc), ops.zeros(v.shape, acc)
        for j in range(g):
            heads, (k0, _) = slice(j * hg, (j + 1) * hg), self.kv_heads(j, g, h, hkv)
            ops.copy_(dq[:, :, heads], recv2[f"dq{j}"])
            ops.add_(dk[:, :, k0:k0 + hk], recv2[f"dk{j}"])    # summed where ranks share a kv head
            ops.add_(dv[:, :, k0:k0 + hk], recv2[f"dv{j}"])
            if sums:
                ops.copy_(row_sums[:, heads], recv2[f"p{j}"])
        if trace is not None:
            trace.add("backward", 0, rank, 0, 0.0, wait_in)
            trace.add("backward", 1, rank, 1, compute_s, 0.0)
            trace.add("backward", 2, rank, 0, 0.0, wait_out)
        return cast_copy(ops, dq, q.dtype), cast_copy(ops, dk, k.dtype), cast_copy(ops, dv, v.dtype)

    @staticmethod
    def _all_to_all(ops: LocalOps, transport: Transport, label: str, send: Message, recv: Message,
                    fields: tuple[str, str]) -> float:
        """Every rank j gets span(fields[0]{j} .. fields[1]{j}) of my `send`, into that span of
        its `recv` for me; my own span is copied. Returns the host seconds spent waiting."""
        first, last = fields
        me = transport.rank
        ops.copy_(recv.span(f"{first}{me}", f"{last}{me}"), send.span(f"{first}{me}", f"{last}{me}"))
        peers = [(send.span(f"{first}{j}", f"{last}{j}"), recv.span(f"{first}{j}", f"{last}{j}"), j)
                 for j in range(transport.size) if j != me]
        if not peers:
            return 0.0
        post_pairwise(ops, transport, label, peers)
        return timed_wait(ops, transport, f"{label} wait")

    # -- what one rank sends -------------------------------------------------------------------
    @classmethod
    def forward_bytes(cls, size: int, q, k, v) -> int:
        b, s, h, d = q.shape
        hg, hk = h // size, cls.kv_heads(0, size, h, k.shape[2])[1]
        it, acc = q.dtype.itemsize, accum_dtype(q.dtype).itemsize
        return (size - 1) * b * s * ((hg + 2 * hk) * d * it + hg * (acc + d * it))

    @classmethod
    def backward_bytes(cls, size: int, q, k, v, row_sums: bool = False) -> int:
        b, s, h, d = q.shape
        hg, hk = h // size, cls.kv_heads(0, size, h, k.shape[2])[1]
        it, acc = q.dtype.itemsize, accum_dtype(q.dtype).itemsize
        inbound = hg * (2 * acc + 2 * d * it) + 2 * hk * d * it
        outbound = (hg + 2 * hk) * d * acc + (hg * acc if row_sums else 0)
        return (size - 1) * b * s * (inbound + outbound)

    @staticmethod
    def forward_messages(size: int) -> int:
        return 2 * (size - 1)

    @staticmethod
    def backward_messages(size: int) -> int:
        return 2 * (size - 1)


def _by_position(ops: LocalOps, recv: Message, name: str, shape: tuple, dtype, layout: str,
                 size: int, seqlen_local: int, axis: int = 1):
    """The fields `name`0..`name`{G-1} of `recv` (rank i's rows, each of `shape`, the sequence on
    `axis`) assembled into one array with G*seqlen_local rows on `axis`, in global position
    order."""
    full_shape = shape[:axis] + (size * seqlen_local,) + shape[axis + 1:]
    full = ops.zeros(full_shape, dtype)
    lead = (slice(None),) * axis
    for i in range(size):
        for seg in segments(layout, i, size, seqlen_local):
            ops.copy_(full[lead + (slice(seg.pos, seg.pos + seg.length),)],
                      recv[f"{name}{i}"][lead + (slice(seg.local, seg.local + seg.length),)])
    return full
