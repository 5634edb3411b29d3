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
(the last term with check=True's row sums, which `backward_bytes` leaves out); messages: 2(G-1)
in each pass. Uneven shards (a `burstcu.layout.Partition`): the inbound terms go out at a rank's
own S rows to each of the G-1 others, the outbound ones (out, lse; dq, dk, dv) at the other
ranks' rows, N - S in all. Each message is one contiguous span of one packed buffer (fields
ordered so no padding falls inside a span).
Trace: step 0 is all-to-all 1 (its wait), step 1 the local attention, step 2 all-to-all 2.
"""

from __future__ import annotations

import numpy as np

from ..layout import Partition, as_partition, step_blocks
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import cast_copy, post_pairwise, timed, timed_wait


def heads_problem(h: int, hkv: int, size: int, what: str) -> str | None:
    """Why `size` ranks cannot share out h query heads on hkv kv heads Ulysses' way, or None."""
    if h % size:
        return f"{what} gives each of its {size} ranks H/{size} query heads: H = {h} is not divisible by {size}"
    if hkv % size and size % hkv:
        group = max(h // hkv, 1)                   # query heads a kv head serves
        spans = [(r * (h // size) // group, ((r + 1) * (h // size) - 1) // group) for r in range(2)]
        used = [f"rank {r}'s kv head {a}" if a == b else f"rank {r}'s kv heads {a}-{b}"
                for r, (a, b) in enumerate(spans)]
        return (f"{what} over {size} ranks with {h} query heads on {hkv} kv heads: each rank's "
                f"{h // size} query heads would use kv heads shared unevenly with another rank "
                f"({', '.join(used)}), which its exchange does not send (Hkv must divide {size} "
                f"or be a multiple of it); strategy='burst' or 'auto' takes any heads")
    return None


def kv_heads(rank: int, size: int, h: int, hkv: int) -> tuple[int, int]:
    """(first, count) of the kv heads that `rank`'s h/size query heads use."""
    if hkv % size == 0:
        return rank * (hkv // size), hkv // size
    return rank * (h // size) // (h // hkv), 1


class HeadExchange:
    """The all-to-alls of Ulysses inside one group of ranks (the whole group for "ulysses", one
    node-sized group for "usp"): from this rank's rows of every head to the group's rows of this
    rank's heads, and back.

    transport: the group's transport; its members are the world ranks `ranks` of `part` (the
    world's `burstcu.layout.Partition`; members may hold different numbers of rows). Assembled
    arrays hold the group's rows sorted by global position (for "ulysses" the whole sequence in
    order; for "usp" exactly the rows of the group's super-rank, `layout.grouped`).
    Parts are (kind, array): "q" (B, S, H, D) query heads, "kv" (B, S, Hkv, D) kv heads, "st"
    (B, H, S) a row statistic of the query heads.
    """

    def __init__(self, transport: Transport, ranks, part: Partition, h: int, hkv: int):
        self.transport, self.g = transport, transport.size
        ranks = list(ranks)
        self.lengths = [part.lengths[r] for r in ranks]          # rows of each member
        self.hg = h // self.g
        self.kv = [kv_heads(m, self.g, h, hkv) for m in range(self.g)]
        runs = sorted((seg.pos, m, seg.local, seg.length) for m, r in enumerate(ranks)
                      for seg in part.runs[r])
        self.rows: list[list[tuple[int, int, int]]] = [[] for _ in ranks]  # (local, assembled, n)
        offset = 0
        for _, m, local, length in runs:
            self.rows[m].append((local, offset, length))
            offset += length
        self.n = offset

    def _chunk(self, kind: str, x, m: int):
        """The part of my array `x` that member m gets: its query heads or kv heads."""
        if kind == "kv":
            k0, hk = self.kv[m]
            return x[:, :, k0:k0 + hk]
        heads = slice(m * self.hg, (m + 1) * self.hg)
        return x[:, heads] if kind == "st" else x[:, :, heads]

    def _chunk_shape(self, kind: str, x_shape, rows: int) -> tuple:
        """The shape of one member's heads of `rows` rows of an array shaped like x."""
        if kind == "st":
            return (x_shape[0], self.hg, rows)
        heads = self.kv[self.transport.rank][1] if kind == "kv" else self.hg
        return (x_shape[0], rows, heads) + tuple(x_shape[3:])

    def _exchange(self, ops: LocalOps, fields, mine_out: bool):
        """fields(m, rows) -> [(name, shape, dtype)] of what member m and I exchange for `rows`
        rows; the messages go out at my rows and come back at m's (mine_out) or the reverse.
        Returns (send, recv, laid), laid(m, rows) the fields of member m's span. Fields are
        ordered widest dtype first, so no padding falls inside a member's span."""
        me = self.transport.rank

        def laid(m, rows):
            return sorted(fields(m, rows), key=lambda f: -np.dtype(f[2]).itemsize)
        out_rows = [self.lengths[me] if mine_out else self.lengths[m] for m in range(self.g)]
        in_rows = [self.lengths[m] if mine_out else self.lengths[me] for m in range(self.g)]
        send = ops.message([f for m in range(self.g) for f in laid(m, out_rows[m])])
        recv = ops.message([f for m in range(self.g) for f in laid(m, in_rows[m])])
        return send, recv, lambda m: laid(m, 0)

    def _post(self, ops, label, send, recv, laid) -> float:
        me = self.transport.rank

        def span(msg, m):
            names = [f[0] for f in laid(m)]
            return msg.span(names[0], names[-1])
        ops.copy_(span(recv, me), span(send, me))
        peers = [(span(send, m), span(recv, m), m) for m in range(self.g) if m != me]
        if not peers:
            return 0.0
        post_pairwise(ops, self.transport, label, peers)
        return timed_wait(ops, self.transport, f"{label} wait")

    def to_heads(self, ops: LocalOps, label: str, parts):
        """([assembled arrays], seconds waited): each part of all my rows, for member m's heads,
        to member m; mine, from every member's rows, assembled in position order."""
        def fields(m, rows):
            return [(f"{i}.{m}", self._chunk_shape(kind, x.shape, rows), x.dtype)
                    for i, (kind, x) in enumerate(parts)]
        send, recv, laid = self._exchange(ops, fields, mine_out=True)
        for m in range(self.g):
            for i, (kind, x) in enumerate(parts):
                ops.copy_(send[f"{i}.{m}"], self._chunk(kind, x, m))
        waited = self._post(ops, label, send, recv, laid)
        out = []
        for i, (kind, x) in enumerate(parts):
            shape = self._chunk_shape(kind, x.shape, self.n)
            axis = 2 if kind == "st" else 1
            full = ops.zeros(shape, x.dtype)
            lead = (slice(None),) * axis
            for m in range(self.g):
                for local, at, length in self.rows[m]:
                    ops.copy_(full[lead + (slice(at, at + length),)],
                              recv[f"{i}.{m}"][lead + (slice(local, local + length),)])
            out.append(full)
        return out, waited

    def to_rows(self, ops: LocalOps, label: str, parts, homes) -> float:
        """The inverse: parts are (kind, assembled array) of my heads over the group's rows; each
        member's rows go back to it, and land in `homes` (my rows, all heads): "q" and "st"
        chunks are copied into their heads, "kv" chunks added (members sharing a kv head each
        send their share). Returns the seconds waited."""
        def fields(m, rows):  # sent in the parts' dtype, added into the homes' dtype
            return [(f"{i}.{m}", self._chunk_shape(kind, home.shape, rows), full.dtype)
                    for i, ((kind, full), home) in enumerate(zip(parts, homes))]
        send, recv, laid = self._exchange(ops, fields, mine_out=False)
        for m in range(self.g):
            for i, (kind, full) in enumerate(parts):
                axis = 2 if kind == "st" else 1
                lead = (slice(None),) * axis
                for local, at, length in self.rows[m]:
                    ops.copy_(send[f"{i}.{m}"][lead + (slice(local, local + length),)],
                              full[lead + (slice(at, at + length),)])
        waited = self._post(ops, label, send, recv, laid)
        for m in range(self.g):
            for i, ((kind, _), home) in enumerate(zip(parts, homes)):
                (ops.add_ if kind == "kv" else ops.copy_)(self._chunk(kind, home, m), recv[f"{i}.{m}"])
        return waited


def input_problem(q_shape, k_shape, size: int) -> str | None:
    """Why Ulysses cannot split these heads over `size` ranks, or None."""
    return heads_problem(int(q_shape[2]), int(k_shape[2]), size, "strategy 'ulysses'")


def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, softmax_scale: float,
            layout: str | Partition, trace=None, window_size=(-1, -1), cu_seqlens=None, block_mask=None):
    """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S).
    window_size, cu_seqlens, block_mask: the mask over global positions (`layout.blocks`)."""
    x = HeadExchange(transport, range(transport.size),
                     as_partition(layout, transport.size, q.shape[1]), q.shape[2], k.shape[2])
    (q_all, k_all, v_all), wait_in = x.to_heads(
        ops, "ulysses fwd all-to-all q, k, v", [("q", q), ("kv", k), ("kv", v)])
    _trace(trace, "forward", 0, transport.rank, wait_s=wait_in)
    state = ops.forward_init(q_all, softmax_scale)
    compute_s = timed(ops, "ulysses fwd compute", ops.forward_step, state, k_all, v_all,
                      step_blocks("contiguous", 0, 0, 1, x.n, bool(causal), window_size,
                                  cu_seqlens, block_mask), True)
    out_all, lse_all = ops.forward_finalize(state, q.dtype)   # (B, N, Hg, D), (B, Hg, N)
    _trace(trace, "forward", 1, transport.rank, compute_s=compute_s)
    out, lse = ops.zeros(q.shape, q.dtype), ops.zeros(lse_all.shape[:1] + (q.shape[2], q.shape[1]),
                                                      lse_all.dtype)
    wait_out = x.to_rows(ops, "ulysses fwd all-to-all out, lse", [("q", out_all), ("st", lse_all)],
                         [out, lse])
    _trace(trace, "forward", 2, transport.rank, wait_s=wait_out)
    return out, lse


def backward(dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *, causal: bool,
             softmax_scale: float, layout: str | Partition, trace=None, row_sums=None,
             window_size=(-1, -1), cu_seqlens=None, block_mask=None):
    """Gradients of `forward`: dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the inputs' dtype.
    row_sums: None, or (B,H,S) in the accumulation dtype: receives each of this rank's rows'
    sum of the recomputed P over the whole sequence (computed where the heads are)."""
    acc = accum_dtype(q.dtype)
    x = HeadExchange(transport, range(transport.size),
                     as_partition(layout, transport.size, q.shape[1]), q.shape[2], k.shape[2])
    delta = ops.backward_delta(dout, out)                  # (B, H, S): out stays home
    (lse_all, delta_all, q_all, do_all, k_all, v_all), wait_in = x.to_heads(
        ops, "ulysses bwd all-to-all q, dout, k, v",
        [("st", lse), ("st", delta), ("q", q), ("q", dout), ("kv", k), ("kv", v)])
    _trace(trace, "backward", 0, transport.rank, wait_s=wait_in)
    ctx = ops.backward_init(k_all, v_all, softmax_scale)
    dq_all = ops.zeros(q_all.shape, acc)
    sums = [ops.zeros(lse_all.shape, acc)] if row_sums is not None else []
    compute_s = timed(ops, "ulysses bwd compute", ops.backward_step, ctx, q_all, do_all,
                      lse_all, delta_all, dq_all,
                      step_blocks("contiguous", 0, 0, 1, x.n, bool(causal), window_size,
                                  cu_seqlens, block_mask),
                      *sums)
    dk_all, dv_all = ops.backward_finalize(ctx, acc)       # (B, N, Hk, D)
    _trace(trace, "backward", 1, transport.rank, compute_s=compute_s)
    dq, dk, dv = ops.zeros(q.shape, acc), ops.zeros(k.shape, acc), ops.zeros(v.shape, acc)
    wait_out = x.to_rows(ops, "ulysses bwd all-to-all dq, dk, dv",
                         [("q", dq_all), ("kv", dk_all), ("kv", dv_all)]
                         + [("st", p) for p in sums],
                         [dq, dk, dv] + ([row_sums] if sums else []))
    _trace(trace, "backward", 2, transport.rank, wait_s=wait_out)
    return cast_copy(ops, dq, q.dtype), cast_copy(ops, dk, k.dtype), cast_copy(ops, dv, v.dtype)


# ----------------------------------------------------------------------------------------------
# what one rank sends (the strategy interface, `burstcu.engine`). Of the mask its layout and
# rank matter with uneven shards (a rank sends its own rows of every other member's heads, and
# every other member's rows of its own heads); the counts are without check=True's row sums

def _head_split(size: int, q, k, rank: int, layout: str | Partition) -> tuple:
    """(B, S, others' rows, D, Hg, Hk, input itemsize, accumulation itemsize) of rank `rank`
    (its S from `layout` where that is a Partition: with uneven shards each rank's differs; else
    q's) for q (B,S,H,D), k (B,S,Hkv,D)."""
    b, s, h, d = q.shape
    part = as_partition(layout, size, s)
    s = part.lengths[rank]
    return (b, s, part.total - s, d, h // size, kv_heads(0, size, h, k.shape[2])[1],
            q.dtype.itemsize, accum_dtype(q.dtype).itemsize)


def forward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                  causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """q, k, v of my rows for each other member's heads; out, lse of their rows for mine."""
    b, s, others, d, hg, hk, it, acc = _head_split(size, q, k, rank, layout)
    return (size - 1) * b * s * (hg + 2 * hk) * d * it + others * b * hg * (acc + d * it)


def backward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                   causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """lse, delta, q, dO, k, v of my rows out; dq, dk, dv of their rows back, in the
    accumulation dtype."""
    b, s, others, d, hg, hk, it, acc = _head_split(size, q, k, rank, layout)
    inbound = hg * (2 * acc + 2 * d * it) + 2 * hk * d * it
    outbound = (hg + 2 * hk) * d * acc
    return (size - 1) * b * s * inbound + others * b * outbound


def forward_messages(size: int, q, k, v, *, rank: int = 0,
                     layout: str | Partition = "contiguous", causal: bool = False,
                     window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """Two all-to-alls, one message to each other member each."""
    return 2 * (size - 1)


backward_messages = forward_messages   # the backward's two all-to-alls, the same count


def _trace(trace, pass_: str, step: int, rank: int, compute_s: float = 0.0, wait_s: float = 0.0) -> None:
    """Note step 0 (the all-to-all in), 1 (the local attention) or 2 (the all-to-all back) as it
    ends, as the ring strategies note theirs: a tracing transport gives a step what it moved since
    the note before."""
    if trace is not None:
        trace.add(pass_, step, rank, int(step == 1), compute_s, wait_s)
