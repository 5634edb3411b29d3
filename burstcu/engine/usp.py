"""USP (unified sequence parallelism, long-context-attention): Ulysses inside groups of u ranks,
BurstAttention's ring across the G/u groups.

Ranks are numbered rank = i*u + j: group i (ranks i*u .. i*u+u-1, meant to be one node's GPUs)
runs Ulysses' all-to-all over its u ranks (`ulysses.HeadExchange`), after which rank (i, j) holds
H/u query heads (and the kv heads they use) for every row of group i; the ring of ranks
{j, j+u, j+2u, ...} (one per group, same heads) then runs `burst.forward` / `burst.backward` over
the G/u groups as if each group were one rank with u*S rows — K and V in one message per step,
double-buffered, the backward bundle travelling with dQ. The group's rows, sorted by position,
are exactly the rows of super-rank i under the same layout over G/u ranks (contiguous: chunks
i*u..i*u+u-1 are one chunk of the coarser split; zigzag: chunks i*u.. and 2G-1-i*u-.. are the
coarse chunks i and 2(G/u)-1-i), so causal masking and zigzag balance carry over unchanged.
u = 1 is the ring alone, u = G Ulysses alone.

ulysses_degree u must divide G and H and split the kv heads (`ulysses.heads_problem`); None
picks the largest u <= 8 that does (`choose_degree`).

Bytes one rank sends (exact; Hg = H/u, Hk the kv heads a rank holds after the all-to-all: Hkv/u,
or 1 when u % Hkv == 0; S local rows; it, acc: input and accumulation itemsize; r = G/u):
    fwd = (u-1) B S ((Hg + 2 Hk) D it + Hg (acc + D it))           Ulysses in, out + lse back
        + sends 2 B (u S) Hk D it                                  ring: K and V of a group
      (sends = r-1, fewer under causal contiguous or a window: `burst.forward_sends` of the
      group's super-rank in the ring of r groups)
    bwd = (u-1) B S (Hg (2 acc + 2 D it) + 2 Hk D it)              lse, delta, q, dO, k, v in
        + (r-1) (2 B (u S) Hg D it + 2 B Hg (u S) acc) + r B (u S) Hg D acc     ring bundle, dQ
        + (u-1) B S (Hg + 2 Hk) D acc                               dq, dk, dv back
(gradients come back in the accumulation dtype, so the shares of a kv head several ranks use are
summed before rounding). Messages: fwd 2(u-1) + sends; bwd 2(u-1) + (r+1 if r > 1 else 0). With
check=True the row sums ride along (in the all-to-all back, and with dQ in the ring, whose last
hop then carries two messages); those bytes are not in these formulas.
"""

from __future__ import annotations

from ..layout import Partition, as_partition, grouped
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from . import burst
from .steps import cast_copy, mask_key
from .ulysses import HeadExchange, heads_problem, kv_heads

MAX_DEGREE = 8  # the GPUs of one node, where all-to-all runs over NVLink


class USPAttention:
    """USP (see the module docstring): a class, since it has an option. ulysses_degree: u, or
    None to choose (`choose_degree`)."""

    def __init__(self, ulysses_degree: int | None = None):
        self.ulysses_degree = ulysses_degree

    @staticmethod
    def choose_degree(size: int, h: int, hkv: int) -> int:
        """The largest u <= MAX_DEGREE dividing `size` whose Ulysses split of the heads works."""
        return max(u for u in range(1, min(MAX_DEGREE, size) + 1)
                   if size % u == 0 and heads_problem(h, hkv, u, "") is None)

    def degree(self, size: int, h: int, hkv: int) -> int:
        """u for `size` ranks and these heads: the one given, else `choose_degree`'s."""
        return self.ulysses_degree or self.choose_degree(size, h, hkv)

    def input_problem(self, q_shape, k_shape, size: int) -> str | None:
        u = self.ulysses_degree
        if u is None:
            return None
        if size % u:
            return f"strategy 'usp': ulysses_degree={u} must divide the number of ranks, {size}"
        return heads_problem(int(q_shape[2]), int(k_shape[2]), u,
                             f"strategy 'usp' with ulysses_degree={u}")

    @staticmethod
    def groups(transport: Transport, u: int) -> tuple[Transport, Transport]:
        """(this rank's Ulysses group of u ranks, its ring of G/u ranks), made once and kept."""
        i, j = divmod(transport.rank, u)
        return (transport.split(i, j, f"usp ulysses groups of {u}"),
                transport.split(j, i, f"usp rings of {transport.size // u}"))

    def _exchange(self, transport: Transport, layout: str | Partition, q, k) -> tuple:
        """(the group's HeadExchange, the ring of groups, the ring's partition of super-ranks)."""
        u = self.degree(transport.size, q.shape[2], k.shape[2])
        ulysses, ring = self.groups(transport, u)
        part = as_partition(layout, transport.size, q.shape[1])
        x = HeadExchange(ulysses, ulysses.members, part, q.shape[2], k.shape[2])
        return x, ring, grouped(part, u)

    def forward(self, q, k, v, ops: LocalOps, transport: Transport, *, causal: bool,
                softmax_scale: float, layout: str | Partition, trace=None, window_size=(-1, -1),
                cu_seqlens=None, block_mask=None):
        """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype, lse (B,H,S).
        window_size, cu_seqlens, block_mask: the mask over global positions (`layout.blocks`)."""
        x, ring, groups = self._exchange(transport, layout, q, k)
        (q_g, k_g, v_g), wait_in = x.to_heads(ops, "usp fwd all-to-all q, k, v",
                                              [("q", q), ("kv", k), ("kv", v)])
        if trace is not None:   # the all-to-all in, noted as it ends (before the ring's steps)
            trace.add("forward", -1, transport.rank, 0, 0.0, wait_in)
        out_g, lse_g = burst.forward(q_g, k_g, v_g, ops, ring, causal=causal,
                                     softmax_scale=softmax_scale, layout=groups, trace=trace,
                                     window_size=window_size, cu_seqlens=cu_seqlens, block_mask=block_mask)
        out = ops.zeros(q.shape, q.dtype)
        lse = ops.zeros((q.shape[0], q.shape[2], q.shape[1]), lse_g.dtype)
        wait_out = x.to_rows(ops, "usp fwd all-to-all out, lse", [("q", out_g), ("st", lse_g)],
                             [out, lse])
        if trace is not None:   # the all-to-all back, after the ring's steps 0 .. ring.size - 1
            trace.add("forward", ring.size, transport.rank, 0, 0.0, wait_out)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *,
                 causal: bool, softmax_scale: float, layout: str | Partition, trace=None,
                 row_sums=None, window_size=(-1, -1), cu_seqlens=None, block_mask=None):
        """Gradients of `forward`: dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the inputs' dtype.
        row_sums: None, or (B,H,S) in the accumulation dtype (see burst.backward)."""
        acc = accum_dtype(q.dtype)
        x, ring, groups = self._exchange(transport, layout, q, k)
        delta = ops.backward_delta(dout, out)                   # out stays home
        (lse_g, delta_g, q_g, do_g, k_g, v_g), wait_in = x.to_heads(
            ops, "usp bwd all-to-all q, dout, k, v",
            [("st", lse), ("st", delta), ("q", q), ("q", dout), ("kv", k), ("kv", v)])
        if trace is not None:
            trace.add("backward", -1, transport.rank, 0, 0.0, wait_in)
        sums = ops.zeros(lse_g.shape, acc) if row_sums is not None else None
        dq_g, dk_g, dv_g = burst.backward(do_g, q_g, k_g, v_g, None, lse_g, ops, ring,
                                          causal=causal, softmax_scale=softmax_scale,
                                          layout=groups, trace=trace, row_sums=sums, delta=delta_g,
                                          grad_dtype=acc, window_size=window_size,
                                          cu_seqlens=cu_seqlens, block_mask=block_mask)
        dq, dk, dv = ops.zeros(q.shape, acc), ops.zeros(k.shape, acc), ops.zeros(v.shape, acc)
        parts = [("q", dq_g), ("kv", dk_g), ("kv", dv_g)] + ([("st", sums)] if sums is not None else [])
        wait_out = x.to_rows(ops, "usp bwd all-to-all dq, dk, dv", parts,
                             [dq, dk, dv] + ([row_sums] if sums is not None else []))
        if trace is not None:   # after the ring's steps 0 .. ring.size (dQ's hop home)
            trace.add("backward", ring.size + 1, transport.rank, 0, 0.0, wait_out)
        return cast_copy(ops, dq, q.dtype), cast_copy(ops, dk, k.dtype), cast_copy(ops, dv, v.dtype)

    # -- what one rank sends (the strategy interface, `burstcu.engine`) ----------------------
    # the counts are without check=True's row sums

    def ring_of_groups(self, size: int, q, k, *, rank: int = 0,
                       layout: str | Partition = "contiguous") -> tuple[int, Partition, int]:
        """(u, the partition of the G/u super-ranks the ring of groups runs over, `rank`'s
        super-rank) for this rank's q (B,S,H,D) and k (B,S,Hkv,D)."""
        u = self.degree(size, q.shape[2], k.shape[2])
        return u, grouped(as_partition(layout, size, q.shape[1]), u), rank // u

    def forward_bytes(self, size: int, q, k, v, *, rank: int = 0,
                      layout: str | Partition = "contiguous", causal: bool = False,
                      window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
        """The group's all-to-alls (Ulysses in, out + lse back), then the ring across the
        groups, which skips hops as `burst.forward_rows` says for the group's super-rank."""
        b, _, h, d = q.shape
        s = as_partition(layout, size, q.shape[1]).lengths[rank]   # rank's rows (uneven shards)
        u, groups, i = self.ring_of_groups(size, q, k, rank=rank, layout=layout)
        hg, hk = h // u, kv_heads(0, u, h, k.shape[2])[1]
        it, acc = q.dtype.itemsize, accum_dtype(q.dtype).itemsize
        ring_rows = burst.forward_rows(i, groups, *mask_key(causal, window_size, cu_seqlens, block_mask))
        return ((u - 1) * b * s * (hg + 2 * hk) * d * it
                + (groups.lengths[i] - s) * b * hg * (acc + d * it)
                + ring_rows * 2 * b * hk * d * it)

    def backward_bytes(self, size: int, q, k, v, *, rank: int = 0,
                       layout: str | Partition = "contiguous", causal: bool = False,
                       window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
        """The group's all-to-alls (lse, delta, q, dO, k, v in; dq, dk, dv back), then the ring
        across the groups, whose bundles stop as `burst.backward_rows` says for the group's
        super-rank."""
        b, _, h, d = q.shape
        s = as_partition(layout, size, q.shape[1]).lengths[rank]
        u, groups, i = self.ring_of_groups(size, q, k, rank=rank, layout=layout)
        hg, hk = h // u, kv_heads(0, u, h, k.shape[2])[1]
        it, acc = q.dtype.itemsize, accum_dtype(q.dtype).itemsize
        bundle_rows, dq_rows = (0, 0) if groups.size == 1 else \
            burst.backward_rows(i, groups, *mask_key(causal, window_size, cu_seqlens, block_mask))
        ring_bytes = bundle_rows * b * hg * (2 * d * it + 2 * acc) + dq_rows * b * hg * d * acc
        back = (hg + 2 * hk) * d * acc
        return ((u - 1) * b * s * (hg * (2 * acc + 2 * d * it) + 2 * hk * d * it) + ring_bytes
                + (groups.lengths[i] - s) * b * back)

    def forward_messages(self, size: int, q, k, v, *, rank: int = 0,
                         layout: str | Partition = "contiguous", causal: bool = False,
                         window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
        """Two all-to-alls in the group, then one message a block the ring passes on."""
        u, groups, i = self.ring_of_groups(size, q, k, rank=rank, layout=layout)
        return 2 * (u - 1) + burst.forward_sends(i, groups.size, 0, groups, causal, window_size,
                                                 cu_seqlens, block_mask)

    def backward_messages(self, size: int, q, k, v, *, rank: int = 0,
                          layout: str | Partition = "contiguous", causal: bool = False,
                          window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
        """Two all-to-alls in the group, then the ring's `burst.backward_counts` messages."""
        u, groups, i = self.ring_of_groups(size, q, k, rank=rank, layout=layout)
        return 2 * (u - 1) + burst.backward_counts(i, groups.size, 0, groups, causal, window_size,
                                                   cu_seqlens, block_mask)[2]
