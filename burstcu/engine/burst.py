"""BurstAttention (GAO): the ring of this library — forward and backward schedules with double
buffers, K and V in one message, the backward bundle (Q, dO, delta, lse) travelling with dQ.

Written once against two small interfaces: a `Transport` (burstcu.transport.base) that moves
bytes, and a `LocalOps` (burstcu.ops.base) that computes one step. The same loops therefore run
NumPy tiles over MPI, CUDA kernels over NCCL, or the emulated kernels over MPI.

G ranks; rank r's neighbours are next = (r+1) % G and prev = (r-1) % G. At step s (0 <= s < G)
rank r works on the data that originated at rank (r - s) % G (and, when blocks go both ways
round, at rank (r + s) % G).

Forward (Algorithm 1 of the paper): K and V travel *together* as one message per step.
    buffers A, B each hold (k, v) in one contiguous byte buffer (and (kb, vb), the block that
    came the other way, when some block comes back to this rank)
    for s in 0..G-1:
        post: cur.(k, v) -> next, nxt.(k, v) <- prev; cur.(kb, vb) -> prev, nxt.(kb, vb) <- next
            (each only where the schedule has it; at step 0 our own block goes both ways)
        fold attention(q, cur.k, cur.v), then attention(q, cur.kb, cur.vb), into the running
            state                                                  (overlaps the transfer)
        wait; swap
    Block j goes f_j hops forwards and b_j backwards (`kv_hops`): the fewest hops in all that
    reach every rank needing it (`needs`), one way forwards where that is among the cheapest
    (the one-way ring's trip: causal or a window ends it early), both ways where a mask needs
    keys from both sides of the block (a block needed by its two neighbours: one hop each way,
    not G-1 round the ring). The trips reach different ranks, so each rank folds each block it
    needs once; a receiver posts the same receives as the sender's sends (`forward_steps` lists
    each step's blocks and whether they go on). So
    Bytes sent per rank = rows * 2*B*Hkv*D*itemsize (`forward_rows`: the blocks passed on either
    way at their owners' lengths), messages = sends (`forward_sends`) = G-1 without a mask;
    under causal over contiguous shards r+1 for rank r < G-1 and 0 for the last (G(G-1)/2
    block-hops in all, half the ring's); G-1 under causal zigzag (every rank needs every block);
    for a window only the hops to the ranks it reaches, each way (non-causal, half a shard each
    side over contiguous shards on 4 ranks: 1, 2, 2, 1 blocks); for documents (cu_seqlens) only
    the hops to ranks holding part of a document the block holds. With bidirectional=True
    (`BurstAttention`) ties go to the most even split: without a mask ceil((G-1)/2) hops
    forwards and floor((G-1)/2) back, G-1 sends in ceil((G-1)/2) exchanges.

Backward (Algorithms 2-3): K and V stay; the bundle (Q, dO, delta, lse) travels with a dQ
accumulator. The dQ that rank r adds at step s is needed by the bundle's next holder only
*after* that rank's own step s+1 compute, so it rides in the message of step s+1 and its transfer
overlaps that compute. Bundles go round in `backward_direction`: the way with fewer bundle hops
under the mask (under causal over contiguous shards, to the previous rank: causal queries see
earlier keys), each only as far as the last rank that needs it (`bundle_hops`); the dQ of a
bundle that stopped goes straight home from there (a message to a non-neighbour):
    rank r holds bundle j_s = (r - d s) % G at step s while s <= hops(j_s)
    message to the next holder at step s = [bundle j_s if s < hops(j_s)]
                                         + [dQ_{j_{s-1}} if s - 1 < hops(j_{s-1})]
    message home at step s                = dQ_{j_{s-1}} if s - 1 == hops(j_{s-1}) >= 1
    buffers hold (dq, q, dout, delta, lse) contiguously, so each message is one byte span.
    for s in 0..G:
        post those sends and the matching receives (from the previous holder; our own dQ home
            at step hops(r) + 1) in one commit
        if we hold a bundle and see its queries: dq_part = 0; accumulate dk, dv and dq_part
        wait; nxt.dq = (nxt.dq if s >= 1 else 0) + dq_part; swap
Without a mask every bundle goes G-1 hops (the paper's ring, plus the return hop); under causal
over contiguous shards bundle j goes j hops down to rank 0, half the ring's bundles in all.
    Bytes sent per rank (G > 1) = bundles * bundle + dqs * dq (`backward_counts`; per step:
    `backward_steps`), where
        bundle = B*S*H*D*itemsize*2 (q, dout) + B*H*S*acc_itemsize*2 (delta, lse)
        dq     = B*S*H*D*acc_itemsize          (fp32 accumulator; fp64 for fp64 input)
    and without a mask bundles = G-1, dqs = G, messages = G + 1.

On one rank nothing travels in either pass: the forward's one step reads K and V where they
are, the backward's Q, dO, lse and delta (`_backward_alone`), with no message buffers.

With `row_sums` (attention_backward(check=True)) each rank also adds its keys' share of every
visiting row's sum of P into a (B, H, S) accumulator that rides right behind dQ, exactly as dQ
does (one step behind, home with it as a second message); the check is that every row's total
is 1. Byte counts above are without it.

Masks (causal, window_size, cu_seqlens: document boundaries; or a block mask) change what a step computes
(`layout.blocks`) and how far each K/V block (forward) and each bundle (backward) travels. All
accumulation state stays in the accumulation dtype. The strategy is `forward` and `backward`;
then come the schedule's queries and the byte and message counts of the strategy interface
(`burstcu.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..layout import Partition, as_partition, blocks as mask_blocks, rectangles
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import (Trace, cast_copy, kv_row_bytes, laid_out, mask_key,
                    post_messages, prefix, timed, timed_wait)

# ----------------------------------------------------------------------------------------------
# forward

def _kv_fields(k, v, rows: int, back_rows: int | None = None):
    """The fields of a forward message holding a K/V block of `rows` rows, then (back_rows not
    None) the K/V block of `back_rows` rows that came the other way round ("kb", "vb")."""
    b, _, hkv, d = k.shape
    back = [] if back_rows is None else [("kb", (b, back_rows, hkv, d), k.dtype),
                                         ("vb", (b, back_rows, hkv, d), v.dtype)]
    return [("k", (b, rows, hkv, d), k.dtype), ("v", (b, rows, hkv, d), v.dtype), *back]


def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, softmax_scale: float,
            layout: str | Partition, trace: Trace | None = None, window_size=(-1, -1),
            cu_seqlens=None, block_mask=None, bidirectional: bool = False):
    """Exact attention of this rank's queries over every rank's keys.

    q: (B, S, H, D); k, v: (B, S, Hkv, D) — this rank's shard under `layout` (a layout name:
    every rank holds S rows; or a `burstcu.layout.Partition`: rank j holds S_j rows, and the
    buffers, sized for the longest shard, hold each block at its own length).
    window_size, cu_seqlens, block_mask: the mask's window and document boundaries, or a
    `burstcu.BlockMask` alone (`layout.blocks`).
    bidirectional: where a block's cheapest trips tie, split them as evenly as the two ways
    allow (`kv_hops`; without a mask: half the hops each way, half the steps).
    Returns out (B, S, H, D) in q's dtype and lse (B, H, S) in the accumulation dtype.
    """
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    assert part.lengths[rank] == q.shape[1], \
        f"rank {rank} holds {q.shape[1]} rows, not {part.lengths[rank]}"
    mask = (part, *mask_key(causal, window_size, cu_seqlens, block_mask))
    ring = _KVRing(k, v, ops, transport, mask, bool(bidirectional))
    state = ops.forward_init(q, softmax_scale)
    for s in range(size):
        ring.step(s, state, trace)
    return ops.forward_finalize(state, q.dtype)


class _KVRing:
    """The K/V blocks of one `forward` call: the message buffers of each way round, which
    block this rank holds at each step and what it sends and receives then.

    Rank r holds at step s the block that came forwards, (r - s) % G, while s <= its forward
    hops, and from s = 1 the block that came backwards, (r + s) % G, while s <= its backward
    hops (`kv_hops`). The two message buffers hold both (k, v; then kb, vb only when some block
    comes back to this rank), the buffer of step s those of step s. On one rank the one step
    reads K and V where they are (strided or not): no buffers.
    """

    def __init__(self, k, v, ops: LocalOps, transport: Transport, mask: tuple, bidirectional: bool):
        """k, v: this rank's block (B, S, Hkv, D); mask: (partition, causal, window_size,
        cu_seqlens, block_mask). Allocates the buffers and copies the block into the first."""
        self.k, self.v, self.ops, self.transport, self.mask = k, v, ops, transport, mask
        self.part, self.rank, self.size = mask[0], transport.rank, transport.size
        plan = [forward_steps(r % self.size, *mask, bidirectional=bidirectional)
                for r in (self.rank - 1, self.rank, self.rank + 1)]
        self.from_prev, self.steps, self.from_next = plan
        # the last step with a fold (a block held whose pairs some query here sees: a block mask
        # may have a rank hold a block only to pass it on): its last fold ends the pass
        # (`LocalOps.forward_step`)
        def folds(t: ForwardStep) -> bool:
            return any(held and mask_blocks(self.part, self.rank, source, *mask[1:])
                       for held, source in ((t.held, t.source), (t.back_held, t.back_source)))
        self.last_step = max((s for s, t in enumerate(self.steps) if folds(t)), default=-1)
        if self.size == 1:
            self.own = {"k": k, "v": v}
            return
        longest = max(self.part.lengths)
        self.two_ways = any(t.back_held for t in self.steps)
        self.buffers = ops.double_buffer(_kv_fields(k, v, longest, longest if self.two_ways else None))
        first = self.holding(0)
        ops.copy_(first["k"], k)
        ops.copy_(first["v"], v)

    def holding(self, step: int):
        """The buffer of `step`, laid out for the blocks held then: the one that came forwards
        (k, v) and the one that came backwards (kb, vb; at step 0 our own block is in k, v)."""
        if self.size == 1:
            return self.own
        lengths, size = self.part.lengths, self.size
        back = lengths[(self.rank + step) % size] if self.two_ways else None
        return laid_out(self.buffers[step % 2],
                        _kv_fields(self.k, self.v, lengths[(self.rank - step) % size], back))

    @staticmethod
    def block(back: bool, step: int) -> tuple[str, str]:
        """The fields of a step's buffer (`holding`) holding the block that came forwards, or
        backwards (our own block at step 0)."""
        return ("kb", "vb") if back and step > 0 else ("k", "v")

    def messages(self, s: int) -> list:
        """The (send, recv, dst, src) exchanges of step s, posted in one commit: the block that
        came forwards on to the next rank and the one from the previous rank, then the block
        that came backwards on to the previous rank and the one from the next rank (two ranks:
        every block goes forwards, so the two ways never share a peer)."""
        nxt, prv = self.transport.next_rank, self.transport.prev_rank
        cur, new = self.holding(s), self.holding(s + 1)
        here, out = self.steps[s], []
        if here.sends or self.from_prev[s].sends:
            out.append((cur.span("k", "v") if here.sends else None,
                        new.span("k", "v") if self.from_prev[s].sends else None, nxt, prv))
        if here.sends_back or self.from_next[s].sends_back:
            out.append((cur.span(*self.block(True, s)) if here.sends_back else None,
                        new.span("kb", "vb") if self.from_next[s].sends_back else None, prv, nxt))
        return out

    def step(self, s: int, state, trace: Trace | None) -> None:
        """Step s: post its exchanges; fold the block that came forwards, then the one that came
        backwards, into the running state meanwhile (those whose keys our queries see); wait."""
        ops, (part, *flags), here = self.ops, self.mask, self.steps[s]
        messages = self.messages(s) if s < self.size - 1 else []
        if messages:
            post_messages(ops, self.transport, f"fwd {s} send/recv kv", messages)
        compute_s, count = 0.0, 0
        folds = [(back, blocks) for back, source, held in ((False, here.source, here.held),
                                                           (True, here.back_source, here.back_held))
                 if held and (blocks := mask_blocks(part, self.rank, source, *flags))]
        for i, (back, blocks) in enumerate(folds):
            cur = self.holding(s)
            k, v = (cur[name] for name in self.block(back, s))
            last = s == self.last_step and i == len(folds) - 1   # the pass's last fold
            compute_s += timed(ops, f"fwd {s} compute" + (" back" if back else ""),
                               ops.forward_step, state, k, v, blocks, last)
            count += len(blocks)
        wait_s = timed_wait(ops, self.transport, f"fwd {s} wait") if messages else 0.0
        if trace is not None:
            trace.add("forward", s, here.source, count, compute_s, wait_s)


# ----------------------------------------------------------------------------------------------
# backward

def _bundle_fields(q, acc, dq_rows: int, rows: int, row_sums: bool = False):
    """The fields of a backward message: the dQ (and row sums) of a bundle of `dq_rows` rows
    riding behind, then a bundle of `rows` rows."""
    b, _, h, d = q.shape
    # dq (and psum) first: each step's message is then one contiguous span (prefix, suffix or
    # all), and the large fields stay 16-byte aligned for vector loads (psum is followed by the
    # bytes that bring q back to a 16-byte boundary; they travel only inside a whole bundle).
    sums = []
    if row_sums:
        ends = (b * dq_rows * h * d + b * h * dq_rows) * acc.itemsize
        sums = [("psum", (b, h, dq_rows), acc), ("psum_pad", ((-ends) % 16,), np.uint8)]
    return [("dq", (b, dq_rows, h, d), acc), *sums, ("q", (b, rows, h, d), q.dtype),
            ("dout", (b, rows, h, d), q.dtype), ("delta", (b, h, rows), acc),
            ("lse", (b, h, rows), acc)]


def backward(dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *, causal: bool,
             softmax_scale: float, layout: str | Partition, trace: Trace | None = None,
             row_sums=None, delta=None, grad_dtype=None, window_size=(-1, -1), cu_seqlens=None,
             block_mask=None):
    """Gradients of `forward` for this rank's shard.

    dout, q, out: (B, S, H, D); k, v: (B, S, Hkv, D); lse: (B, H, S) from `forward`; layout,
    window_size, cu_seqlens and block_mask as in `forward` (with uneven shards each bundle and dQ travel at
    their owner's length).
    Returns dq (B, S, H, D) and dk, dv (B, S, Hkv, D), in the inputs' dtype.
    row_sums: None, or (B, H, S) in the accumulation dtype, contiguous: receives each of this
    rank's rows' sum of the recomputed P over every rank's keys (1 when lse is right).
    delta: rowsum(dout * out) (B, H, S) when the caller has it already (then `out` is unused).
    grad_dtype: the dtype of the returned gradients (default: the inputs'; USP asks for the
    accumulation dtype, to sum the shares of a kv head before rounding).
    Schedule (module docstring): bundles go round in `backward_direction`, each only as far as
    the last rank that needs it (`bundle_hops`), its dQ one step behind, then home.
    """
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    assert part.lengths[rank] == q.shape[1], \
        f"rank {rank} holds {q.shape[1]} rows, not {part.lengths[rank]}"
    causal, window_size, cu_seqlens, block_mask = mask_key(causal, window_size, cu_seqlens, block_mask)
    if size == 1:
        return _backward_alone(dout, q, k, v, out, lse, ops, part, causal=causal,
                               softmax_scale=softmax_scale, trace=trace, row_sums=row_sums,
                               delta=delta, grad_dtype=grad_dtype, window_size=window_size,
                               cu_seqlens=cu_seqlens, block_mask=block_mask)
    ring = _BundleRing(q, ops, transport, (part, causal, window_size, cu_seqlens, block_mask), row_sums)
    ring.load(dout, out, lse, delta)
    ctx = ops.backward_init(k, v, softmax_scale)
    ring.allocate_dq()
    for s in range(size + 1):                                   # step G: the last dQ returns
        ring.step(s, ctx, trace)
    dk, dv = ops.backward_finalize(ctx, k.dtype if grad_dtype is None else grad_dtype)
    return cast_copy(ops, ring.dq, q.dtype if grad_dtype is None else grad_dtype), dk, dv


class _BundleRing:
    """One `backward` call on G > 1 ranks: the two message buffers, whose bundle this rank holds
    at each step and how far each bundle goes, the dQ (and row sums) it adds to the bundle it
    holds, and this rank's own dQ (and row sums) once home.

    Rank r holds bundle(s) = (r - d s) % G at step s (d: `backward_direction`, +1 or -1) while
    s <= hops(bundle(s)); the buffer of step s holds the dQ of bundle(s - 1) and bundle(s).
    """

    def __init__(self, q, ops: LocalOps, transport: Transport, mask: tuple, row_sums):
        """q: this rank's queries (B, S, H, D); mask: (partition, causal, window_size,
        cu_seqlens, block_mask); row_sums: as in `backward`. Allocates the two message buffers."""
        self.q, self.ops, self.transport, self.mask = q, ops, transport, mask
        self.part, self.rank, self.size = mask[0], transport.rank, transport.size
        self.acc, self.sums, self.row_sums = accum_dtype(q.dtype), row_sums is not None, row_sums
        self.longest = max(self.part.lengths)
        # allocated for the longest shard in both places (plus slack for the psum padding,
        # which a shorter dQ may need more of)
        self.buffers = ops.double_buffer(
            _bundle_fields(q, self.acc, self.longest, self.longest, self.sums)
            + ([("slack", (16,), np.uint8)] if self.sums else []))
        self.d = _direction(*mask)
        self.to_next = (self.rank + self.d) % self.size
        self.from_prev = (self.rank - self.d) % self.size
        self.dq_only = ("dq", "psum") if self.sums else ("dq", "dq")
        self.own_hops = self.hops(self.rank)

    def bundle(self, step: int) -> int:
        """Whose bundle this rank holds at `step`."""
        return (self.rank - self.d * step) % self.size

    def hops(self, owner: int) -> int:
        """How far `owner`'s bundle travels (`bundle_hops`)."""
        return _bundle_hops(owner, *self.mask)

    def holding(self, step: int):
        """The buffer of `step`, laid out for the dQ of bundle(step - 1) and bundle(step)."""
        dq_rows, rows = (self.part.lengths[self.bundle(t)] for t in (step - 1, step))
        return laid_out(self.buffers[step % 2],
                        _bundle_fields(self.q, self.acc, dq_rows, rows, self.sums))

    def load(self, dout, out, lse, delta) -> None:
        """This rank's bundle (q, dout, delta, lse) into the buffer of step 0; delta None:
        computed here from dout and out."""
        first = self.holding(0)
        self.ops.copy_(first["q"], self.q)
        self.ops.copy_(first["dout"], dout)
        self.ops.copy_(first["delta"],
                       self.ops.backward_delta(dout, out) if delta is None else delta)
        self.ops.copy_(first["lse"], lse)

    def allocate_dq(self) -> None:
        """The dQ (and row sums) scratch of the bundle held, sized for the longest shard, and
        this rank's dQ (B, S, H, D) in the accumulation dtype, filled once it is home."""
        b, _, h, hd = self.q.shape
        self.dq_flat = self.ops.zeros((b * self.longest * h * hd,), self.acc)
        self.psum_flat = self.ops.zeros((b * h * self.longest,), self.acc) if self.sums else None
        self.dq = self.ops.zeros(self.q.shape, self.acc)
        self.home = (("dq", self.dq),) + ((("psum", self.row_sums),) if self.sums else ())

    def messages(self, s: int, cur, nxt) -> tuple[list, str]:
        """The (send, recv, dst, src) exchanges of step s, posted in one commit, and their label:
        the bundle held and/or the dQ riding one step behind it on to the next holder, a dQ
        whose bundle stopped here home, and the matching receives."""
        bundle, hops = self.bundle, self.hops
        out = []
        sent = _span(s < hops(bundle(s)),                               # it goes on from here
                     s >= 1 and s - 1 < hops(bundle(s - 1)), self.dq_only)  # ... one step behind
        if sent:
            out.append((cur.span(*sent), None, self.to_next, self.to_next))
        if s >= 1 and s - 1 == hops(bundle(s - 1)) >= 1:         # it ended here: dQ goes home
            owner = bundle(s - 1)
            out += [(cur[name], None, owner, owner) for name, _ in self.home]
        received = _span(s < self.size and s < hops(bundle(s + 1)),   # prev sends it on
                         1 <= s <= hops(bundle(s)), self.dq_only)
        if received:
            out.append((None, nxt.span(*received), self.from_prev, self.from_prev))
        if s >= 1 and s - 1 == self.own_hops >= 1:                # our dQ comes home
            holder = (self.rank + self.d * self.own_hops) % self.size
            out += [(None, mine, holder, holder) for _, mine in self.home]
        shown = sent or received
        label = f"bwd {s} send/recv {shown[0]}..{shown[1]}" if shown else f"bwd {s} dq home"
        return out, label

    def _zeroed_parts(self, s: int) -> list:
        """The scratch dQ (and row sums) of bundle(s), at its length, zeroed."""
        b, _, h, hd = self.q.shape
        rows = self.part.lengths[self.bundle(s)]
        parts = [("dq", prefix(self.dq_flat, (b, rows, h, hd)))]
        if self.sums:
            parts.append(("psum", prefix(self.psum_flat, (b, h, rows))))
        for _, x in parts:
            self.ops.copy_(x, 0)
        return parts

    def step(self, s: int, ctx, trace: Trace | None) -> None:
        """Step s: post its messages; if this rank holds a bundle whose queries see its keys,
        accumulate dK, dV (in ctx) and the bundle's dQ part meanwhile; wait; add the part to the
        dQ that arrived with the bundle (nothing at step 0) in the next step's buffer."""
        ops, part, (_, causal, window_size, cu_seqlens, block_mask) = self.ops, self.part, self.mask
        cur, nxt = self.holding(s), self.holding(s + 1)
        messages, label = self.messages(s, cur, nxt)
        if messages:
            post_messages(ops, self.transport, label, messages)
        held = s < self.size and s <= self.hops(self.bundle(s))
        blocks = (mask_blocks(part, self.bundle(s), self.rank, causal, window_size, cu_seqlens, block_mask)
                  if held else [])
        adds = held and (bool(blocks) or s == 0)    # a bundle passing through adds nothing
        compute_s, parts = 0.0, []
        if adds:
            parts = self._zeroed_parts(s)
            if blocks:
                compute_s = timed(ops, f"bwd {s} compute", ops.backward_step, ctx, cur["q"],
                                  cur["dout"], cur["lse"], cur["delta"], parts[0][1], blocks,
                                  *[x for _, x in parts[1:]])
        wait_s = timed_wait(ops, self.transport, f"bwd {s} wait") if messages else 0.0
        for name, x in parts:  # nxt holds the dQ of the bundle just used so far, or nothing at 0
            (ops.copy_ if s == 0 else ops.add_)(nxt[name], x)
        if adds and s == 0 and self.own_hops == 0:               # it never left: home already
            for name, mine in self.home:
                ops.copy_(mine, nxt[name])
        if trace is not None and (held or messages):
            trace.add("backward", s, self.bundle(s) if s < self.size else self.rank, len(blocks),
                      compute_s, wait_s)


def _backward_alone(dout, q, k, v, out, lse, ops: LocalOps, part: Partition, *, causal: bool,
                    softmax_scale: float, trace: Trace | None, row_sums, delta, grad_dtype,
                    window_size, cu_seqlens, block_mask):
    """`backward` on a group of one rank: the one step reads Q, dO, lse and delta where they
    are and adds into the dQ it returns — no bundle buffers, and no copies of Q and dO into
    them, of dQ out of them, or of dQ into a second array in the inputs' dtype when that is
    the accumulation dtype (seqlen 1024, 8 heads, float32: six 2 MiB copies, ~2 ms of a
    ~30 ms backward on two threads, measured). Shapes as in `backward`."""
    acc = accum_dtype(q.dtype)
    delta = ops.backward_delta(dout, out) if delta is None else delta
    ctx = ops.backward_init(k, v, softmax_scale)
    dq = ops.zeros(q.shape, acc)
    if row_sums is not None:
        ops.copy_(row_sums, 0)
    blocks = mask_blocks(part, 0, 0, causal, window_size, cu_seqlens, block_mask)
    compute_s = 0.0
    if blocks:
        compute_s = timed(ops, "bwd 0 compute", ops.backward_step, ctx, q, dout, lse, delta, dq,
                          blocks, *([] if row_sums is None else [row_sums]))
    if trace is not None:
        trace.add("backward", 0, 0, len(blocks), compute_s, 0.0)
    dk, dv = ops.backward_finalize(ctx, k.dtype if grad_dtype is None else grad_dtype)
    dq_dtype = q.dtype if grad_dtype is None else grad_dtype
    if np.dtype(dq_dtype) == np.dtype(acc):
        return dq, dk, dv
    return cast_copy(ops, dq, dq_dtype), dk, dv


def _span(bundle: bool, dq: bool, dq_only: tuple[str, str]) -> tuple[str, str] | None:
    """The fields of a message carrying a bundle and/or the dQ (and row sums) riding behind."""
    if bundle and dq:
        return ("dq", "lse")
    if bundle:
        return ("q", "lse")
    return dq_only if dq else None


# ----------------------------------------------------------------------------------------------
# the schedule: which block and which bundle each rank holds and sends at each step. The mask
# arguments (causal, window_size, cu_seqlens, block_mask) are hashable: `steps.mask_key` makes them so.

class _Schedule:
    """What burst's schedule derives from one partition and mask, memoized as it is asked for:
    which ranks' queries see which ranks' keys, the K/V trips, the bundles' direction and hops.
    Kept by `_schedule` for the last SCHEDULES_KEPT (partition, mask) pairs, so the partitions
    and masks of a varlen job's past batches go with them."""

    def __init__(self, part: Partition, mask: tuple):
        self.part, self.mask = part, mask
        self._needs: dict = {}
        self._trips: dict = {}
        self._bundles: dict = {}
        self._direction: int | None = None

    def needs(self, q_rank: int, kv_rank: int) -> bool:
        key = (q_rank, kv_rank)
        if key not in self._needs:
            causal, window_size, cu_seqlens, block_mask = self.mask
            self._needs[key] = rectangles(self.part, q_rank, kv_rank, causal, tuple(window_size),
                                          cu_seqlens, block_mask).size > 0
        return self._needs[key]

    def kv_hops(self, owner: int, bidirectional: bool) -> tuple[int, int]:
        key = (owner, bidirectional)
        if key not in self._trips:
            size = self.part.size
            ends = [0] + [t for t in range(1, size) if self.needs((owner + t) % size, owner)] + [size]
            trips = [(a, size - b) for a, b in zip(ends, ends[1:])]
            self._trips[key] = (min(trips, key=lambda fb: (sum(fb), max(fb), -fb[0])) if bidirectional
                                else min(trips, key=lambda fb: (sum(fb), fb[1] > 0, max(fb), -fb[0])))
        return self._trips[key]

    def hops(self, d: int, owner: int) -> int:
        """The last step at which a rank on `owner`'s way in direction d needs its bundle (0: none)."""
        size = self.part.size
        return max([0] + [t for t in range(1, size) if self.needs(owner, (owner + d * t) % size)])

    def direction(self) -> int:
        if self._direction is None:
            forwards, backwards = (sum(self.hops(d, j) for j in range(self.part.size)) for d in (1, -1))
            self._direction = ((1 if forwards < backwards else -1) if forwards != backwards
                               else (-1 if self.mask[0] else 1))
        return self._direction

    def bundle_hops(self, owner: int) -> int:
        if owner not in self._bundles:
            self._bundles[owner] = self.hops(self.direction(), owner)
        return self._bundles[owner]


SCHEDULES_KEPT = 16   # (partition, mask) pairs: varlen batches and block masks bring new ones each call


@lru_cache(maxsize=SCHEDULES_KEPT)
def _schedule(part: Partition, causal: bool, window_size=(-1, -1), cu_seqlens=None,
              block_mask=None) -> _Schedule:
    return _Schedule(part, (causal, window_size, cu_seqlens, block_mask))


def needs(part: Partition, q_rank: int, kv_rank: int, causal: bool, window_size=(-1, -1),
          cu_seqlens=None, block_mask=None) -> bool:
    """Whether `q_rank`'s queries see any key of `kv_rank`'s block."""
    return _schedule(part, causal, window_size, cu_seqlens, block_mask).needs(q_rank, kv_rank)


def kv_hops(owner: int, part: Partition, causal: bool, window_size=(-1, -1), cu_seqlens=None,
            block_mask=None, bidirectional: bool = False) -> tuple[int, int]:
    """(forwards, backwards): how many hops `owner`'s K/V block goes to the next ranks and to
    the previous ones in `forward` — the fewest in all that bring it to every rank that needs
    it (`needs`). Write D for the distances t (1..G-1) forwards from `owner` of the ranks that
    do; the trips are (a, G - b) for two neighbours a < b of 0, D..., G: every needed rank lies
    within a hops forwards or G - b backwards, and the widest gap b - a costs least. Among the
    cheapest: one way forwards when that is one of them (the one-way ring's trip, so a mask
    whose blocks need one direction sends what it always did), then the most even split, then
    more forwards; with `bidirectional`, the most even split first (without a mask: ceil and
    floor of (G-1)/2). The two trips reach different ranks, as a + (G - b) < G."""
    return _schedule(part, causal, window_size, cu_seqlens, block_mask).kv_hops(owner, bidirectional)


def _direction(part: Partition, causal: bool, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """`backward_direction` of a partition: the way round with fewer bundle hops in all (a tie:
    backwards under a causal mask, else forwards)."""
    return _schedule(part, causal, window_size, cu_seqlens, block_mask).direction()


def _bundle_hops(owner: int, part: Partition, causal: bool, window_size=(-1, -1),
                 cu_seqlens=None, block_mask=None) -> int:
    """`bundle_hops` of a partition."""
    return _schedule(part, causal, window_size, cu_seqlens, block_mask).bundle_hops(owner)


@dataclass(frozen=True)
class ForwardStep:
    """Forward step s on one rank: the block that came forwards, that of rank `source`
    (= rank - s), which it attends to while it `held` it and passes on to the next rank if
    `sends`; and the block that came backwards, that of rank `back_source` (= rank + s), held
    from step 1 while `back_held`, passed on to the previous rank if `sends_back` (at step 0
    that is the rank's own block, held as `source`)."""

    source: int
    sends: bool
    held: bool = True
    back_source: int = 0
    back_held: bool = False
    sends_back: bool = False


@dataclass(frozen=True)
class BackwardStep:
    """Backward step s on one rank: whose bundle it holds (`bundle`), whether it still does (it
    then computes with it: `held`), whether it passes the bundle on (`passes_on`), and whether
    it sends that bundle's dQ on or home at step s + 1 (`sends_dq`)."""

    bundle: int
    held: bool
    passes_on: bool
    sends_dq: bool


def forward_steps(rank: int, part: Partition, causal: bool = False, window_size=(-1, -1),
                  cu_seqlens=None, block_mask=None, *, bidirectional: bool = False) -> list[ForwardStep]:
    """What `rank` does at each of the G steps of `forward` under the mask: the block of rank
    rank - s is held at step s while s <= its forward hops and goes on while s < them; the
    block of rank rank + s likewise with its backward hops (`kv_hops`)."""
    size = part.size
    mask = (part, causal, window_size, cu_seqlens, block_mask, bidirectional)

    def hops(owner: int) -> tuple[int, int]:
        return kv_hops(owner % size, *mask)

    return [ForwardStep((rank - s) % size, s < hops(rank - s)[0], s <= hops(rank - s)[0],
                        (rank + s) % size, 1 <= s <= hops(rank + s)[1], s < hops(rank + s)[1])
            for s in range(size)]


def backward_steps(rank: int, part: Partition, causal: bool = False, window_size=(-1, -1),
                   cu_seqlens=None, block_mask=None) -> list[BackwardStep]:
    """What `rank` does at each of the steps 0..G-1 of `backward` under the mask (step G only
    brings the last dQ home)."""
    size = part.size
    d = _direction(part, causal, window_size, cu_seqlens, block_mask)
    out = []
    for s in range(size):
        j = (rank - d * s) % size
        hops = _bundle_hops(j, part, causal, window_size, cu_seqlens, block_mask)
        out.append(BackwardStep(j, s <= hops, s < hops, s < hops or s == hops >= 1))
    return out


def forward_sends(rank: int, size: int, seqlen_local: int, layout: str | Partition = "contiguous",
                  causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None,
                  *, bidirectional: bool = False) -> int:
    """How many K/V blocks `rank` passes on in `forward`, one message each, either way: G-1
    without a mask (bidirectional too: ceil((G-1)/2) forwards, floor backwards); with causal
    over contiguous shards rank r < G-1 sends r+1 (the blocks of ranks 0..r) and the last rank
    none, G(G-1)/2 in all; zigzag needs every hop; a window that needs keys from both sides only
    the hops to the ranks it reaches, each way (a window of at most a shard each side over
    contiguous shards: one block to each neighbour); documents each inside one rank's shard:
    none."""
    part = as_partition(layout, size, seqlen_local)
    mask = mask_key(causal, window_size, cu_seqlens, block_mask)
    return sum(step.sends + step.sends_back
               for step in forward_steps(rank, part, *mask, bidirectional=bidirectional))


def forward_rows(rank: int, part: Partition, causal: bool = False, window_size=(-1, -1),
                 cu_seqlens=None, block_mask=None, *, bidirectional: bool = False) -> int:
    """Rows of the K/V blocks `rank` passes on in `forward`, either way (each block at its
    owner's length): (G-1) * S for equal shards without a mask."""
    steps = forward_steps(rank, part, causal, window_size, cu_seqlens, block_mask,
                          bidirectional=bidirectional)
    return sum(part.lengths[step.source] * step.sends + part.lengths[step.back_source] * step.sends_back
               for step in steps)


def backward_direction(layout: str | Partition, size: int, seqlen_local: int, causal: bool,
                       window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """Which way the backward bundles go: +1 to the next rank, -1 to the previous one — the way
    with fewer bundle hops in all under this mask (the same on every rank); on a tie, back under
    causal (causal queries see earlier keys, which contiguous shards put on earlier ranks)."""
    return _direction(as_partition(layout, size, seqlen_local),
                      *mask_key(causal, window_size, cu_seqlens, block_mask))


def bundle_hops(owner: int, layout: str | Partition, size: int, seqlen_local: int, causal: bool,
                window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """How far `owner`'s backward bundle travels: the last step at which a rank it visits (in
    `backward_direction`) needs it, 0 when no other rank does."""
    return _bundle_hops(owner, as_partition(layout, size, seqlen_local),
                        *mask_key(causal, window_size, cu_seqlens, block_mask))


def backward_counts(rank: int, size: int, seqlen_local: int, layout: str | Partition = "contiguous",
                    causal: bool = False, window_size=(-1, -1),
                    cu_seqlens=None, block_mask=None) -> tuple[int, int, int]:
    """(bundles, dqs, messages) `rank` sends in `backward`: bundles it passes on, dQ
    accumulators it passes on or sends home, messages in all. Without a mask every bundle goes
    G-1 hops: (G-1, G, G+1); causal over contiguous shards, rank r >= 1 passes on G - r
    bundles (those of r..G-1, which visit it on their way down to 0) and rank 0 none: half the
    ring's bundles."""
    steps = backward_steps(rank, as_partition(layout, size, seqlen_local),
                           *mask_key(causal, window_size, cu_seqlens, block_mask))
    bundles = sum(step.passes_on for step in steps)
    dqs = sum(step.sends_dq for step in steps)
    returns = dqs - bundles
    # messages to the next holder: a step that passes a bundle on or the dQ behind one
    to_next = sum(steps[s].passes_on or (s >= 1 and steps[s - 1].passes_on) for s in range(size))
    return bundles, dqs, to_next + returns


def backward_rows(rank: int, part: Partition, causal: bool = False, window_size=(-1, -1),
                  cu_seqlens=None, block_mask=None) -> tuple[int, int]:
    """(bundle rows, dQ rows) `rank` sends in `backward`, each bundle at its owner's length:
    (G-1) * S and G * S for equal shards without a mask."""
    steps = backward_steps(rank, part, causal, window_size, cu_seqlens, block_mask)
    return (sum(part.lengths[step.bundle] for step in steps if step.passes_on),
            sum(part.lengths[step.bundle] for step in steps if step.sends_dq))


def bundle_row_bytes(q) -> int:
    """Bytes of one row of a backward bundle of queries shaped like q (B, S, H, D): q and dout
    in q's dtype, delta and lse in the accumulation dtype."""
    b, _, h, d = q.shape
    return b * h * (2 * d * q.dtype.itemsize + 2 * accum_dtype(q.dtype).itemsize)


def dq_row_bytes(q) -> int:
    """Bytes of one row of a dQ accumulator for queries shaped like q (B, S, H, D)."""
    b, _, h, d = q.shape
    return b * h * d * accum_dtype(q.dtype).itemsize


# ----------------------------------------------------------------------------------------------
# what one rank sends (the strategy interface, `burstcu.engine`): the ring skips what no rank
# needs, so every figure depends on the rank and the mask

def forward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                  causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The rows of the K/V blocks `rank` passes on either way (`forward_rows`) x a row of K
    and V."""
    return _forward_bytes(size, q, k, v, rank, layout, (causal, window_size, cu_seqlens, block_mask))


def _forward_bytes(size: int, q, k, v, rank: int, layout, mask: tuple, bidirectional: bool = False) -> int:
    """`forward_bytes` under this tie rule (`kv_hops`); mask: (causal, window_size, cu_seqlens,
    block_mask)."""
    part = as_partition(layout, size, q.shape[1])
    return forward_rows(rank, part, *mask_key(*mask), bidirectional=bidirectional) * kv_row_bytes(k, v)


def backward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                   causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The bundle rows and dQ rows `rank` sends (`backward_rows`) x their row bytes."""
    part = as_partition(layout, size, q.shape[1])
    bundle_rows, dq_rows = backward_rows(rank, part, *mask_key(causal, window_size, cu_seqlens, block_mask))
    return bundle_rows * bundle_row_bytes(q) + dq_rows * dq_row_bytes(q)


def forward_messages(size: int, q, k, v, *, rank: int = 0,
                     layout: str | Partition = "contiguous", causal: bool = False,
                     window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """One message a block `rank` passes on, either way (`forward_sends`)."""
    return forward_sends(rank, size, q.shape[1], layout, causal, window_size, cu_seqlens, block_mask)


def backward_messages(size: int, q, k, v, *, rank: int = 0,
                      layout: str | Partition = "contiguous", causal: bool = False,
                      window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The messages of `backward_counts`: G + 1 a rank without a mask (G > 1)."""
    return backward_counts(rank, size, q.shape[1], layout, causal, window_size, cu_seqlens, block_mask)[2]


class BurstAttention:
    """burst with its option bound: `bidirectional` (see `kv_hops`) passed to `forward` and the
    forward counts; the backward is the module's. `burstcu.engine.get("burst", bidirectional=
    True)` makes one (`with_options`); the same interface as the module."""

    def __init__(self, bidirectional: bool = False):
        if not isinstance(bidirectional, (bool, np.bool_)):
            raise TypeError(f"bidirectional must be True or False, not {bidirectional!r}")
        self.bidirectional = bool(bidirectional)

    def forward(self, *args, **kw):
        return forward(*args, bidirectional=self.bidirectional, **kw)

    def forward_bytes(self, size: int, q, k, v, *, rank: int = 0,
                      layout: str | Partition = "contiguous", causal: bool = False,
                      window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
        """`forward_bytes` of this schedule."""
        return _forward_bytes(size, q, k, v, rank, layout, (causal, window_size, cu_seqlens, block_mask),
                              self.bidirectional)

    def forward_messages(self, size: int, q, k, v, *, rank: int = 0,
                         layout: str | Partition = "contiguous", causal: bool = False,
                         window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
        """`forward_messages` of this schedule."""
        return forward_sends(rank, size, q.shape[1], layout, causal, window_size, cu_seqlens,
                             block_mask, bidirectional=self.bidirectional)

    backward = staticmethod(backward)
    backward_bytes = staticmethod(backward_bytes)
    backward_messages = staticmethod(backward_messages)


OPTIONS = ("bidirectional",)   # `burstcu.engine.get`: the options it takes,
with_options = BurstAttention   # and what makes the strategy with them
