"""BurstAttention (GAO): the ring of this library — forward and backward schedules with double
buffers, K and V in one message, the backward bundle (Q, dO, delta, lse) travelling with dQ.

Written once against two small interfaces: a `Transport` (burstcu.transport.base) that moves
bytes, and a `LocalOps` (burstcu.ops.base) that computes one step. The same loops therefore run
NumPy tiles over MPI, CUDA kernels over NCCL, or the emulated kernels over MPI.

G ranks; rank r's neighbours are next = (r+1) % G and prev = (r-1) % G. At step s (0 <= s < G)
rank r works on the data that originated at rank (r - s) % G.

Forward (Algorithm 1 of the paper): K and V travel *together* as one message per step.
    buffers A, B each hold (k, v) in one contiguous byte buffer
    for s in 0..G-1:
        if s < G-1: send cur -> next, receive nxt <- prev          (posted, not waited)
        fold attention(q, cur.k, cur.v) into the running state     (overlaps the transfer)
        wait; swap
    A block goes on only while a rank it would still reach needs it (`travels`: causal or a
    window can end its trip early; the receiver skips the same receive), so
    Bytes sent per rank = sends * 2*B*S*Hkv*D*itemsize, messages = sends, with sends
    (`forward_sends`) = G-1 without a mask; under causal over contiguous shards r+1 for rank
    r < G-1 and 0 for the last (G(G-1)/2 block-hops in all, half the ring's); G-1 under causal
    zigzag (every rank needs every block); for a narrow window only the hops to ranks it reaches;
    for documents (cu_seqlens) only the hops to ranks holding part of a document the block holds.

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
    Bytes sent per rank (G > 1) = bundles * bundle + dqs * dq (`backward_counts`), where
        bundle = B*S*H*D*itemsize*2 (q, dout) + B*H*S*acc_itemsize*2 (delta, lse)
        dq     = B*S*H*D*acc_itemsize          (fp32 accumulator; fp64 for fp64 input)
    and without a mask bundles = G-1, dqs = G, messages = G + 1.

On one rank nothing travels in either pass: the forward's one step reads K and V where they
are, the backward's Q, dO, lse and delta (`_backward_alone`), with no message buffers.

With `row_sums` (attention_backward(check=True)) each rank also adds its keys' share of every
visiting row's sum of P into a (B, H, S) accumulator that rides right behind dQ, exactly as dQ
does (one step behind, home with it as a second message); the check is that every row's total
is 1. Byte counts above are without it.

Masks change what a step computes (`layout.step_blocks`) and how far each K/V block (forward)
and each bundle (backward) travels. All accumulation state stays in the accumulation dtype.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..layout import Partition, as_partition, blocks as mask_blocks
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import Trace, laid_out, post_exchange, post_messages, prefix, timed, timed_wait

# ----------------------------------------------------------------------------------------------
# forward

def _kv_fields(k, v, rows: int):
    """The fields of a forward message holding a K/V block of `rows` rows."""
    b, _, hkv, d = k.shape
    return [("k", (b, rows, hkv, d), k.dtype), ("v", (b, rows, hkv, d), v.dtype)]


def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, softmax_scale: float,
            layout: str | Partition, trace: Trace | None = None, window=(-1, -1), docs=None):
    """Exact attention of this rank's queries over every rank's keys.

    q: (B, S, H, D); k, v: (B, S, Hkv, D) — this rank's shard under `layout` (a layout name:
    every rank holds S rows; or a `burstcu.layout.Partition`: rank j holds S_j rows, and the
    buffers, sized for the longest shard, hold each block at its own length).
    Returns out (B, S, H, D) in q's dtype and lse (B, H, S) in the accumulation dtype.
    """
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    lengths = part.lengths
    assert lengths[rank] == q.shape[1], f"rank {rank} holds {q.shape[1]} rows, not {lengths[rank]}"
    if size == 1:   # nothing travels: the one step reads K and V where they are (strided or not)
        own = {"k": k, "v": v}

        def holding(step: int):
            return own
    else:
        buffers = ops.double_buffer(_kv_fields(k, v, max(lengths)))

        def holding(step: int):  # the buffer of `step`, laid out for the block it holds then
            return laid_out(buffers[step % 2], _kv_fields(k, v, lengths[(rank - step) % size]))

        first = holding(0)
        ops.copy_(first["k"], k)
        ops.copy_(first["v"], v)
    state = ops.forward_init(q, softmax_scale)

    mask = (part, causal, window, docs)
    for s in range(size):
        cur, nxt = holding(s), holding(s + 1)
        # a block goes on only while some later holder still needs it (sender and receiver
        # decide alike); a rank never has to send what it did not receive (`travels`)
        sending = s < size - 1 and travels(rank, s, *mask)
        receiving = s < size - 1 and travels(transport.prev_rank, s, *mask)
        exchanging = sending or receiving
        if exchanging:
            post_exchange(ops, transport, f"fwd {s} send/recv kv",
                          [(cur.span("k", "v") if sending else None,
                            nxt.span("k", "v") if receiving else None)])
        source = (rank - s) % size
        blocks = mask_blocks(part, rank, source, causal, window, docs)
        compute_s = 0.0
        if blocks:
            compute_s = timed(ops, f"fwd {s} compute", ops.forward_step, state, cur["k"], cur["v"], blocks)
        wait_s = timed_wait(ops, transport, f"fwd {s} wait") if exchanging else 0.0
        if trace is not None:
            trace.add("forward", s, source, len(blocks), compute_s, wait_s)
    return ops.forward_finalize(state, q.dtype)


@lru_cache(maxsize=4096)  # varlen batches bring new docs each call: keep only recent ones
def needs(part: Partition, q_rank: int, kv_rank: int, causal: bool, window=(-1, -1),
          docs=None) -> bool:
    """Whether `q_rank`'s queries see any key of `kv_rank`'s block."""
    return bool(mask_blocks(part, q_rank, kv_rank, causal, window, docs))


def travels(holder: int, step: int, part: Partition, causal: bool, window=(-1, -1),
            docs=None) -> bool:
    """Whether the K/V block `holder` has at forward step `step` (that of rank holder - step)
    goes on to holder + 1: some rank it would still reach, holder + 1 .. holder + G-1-step,
    needs it."""
    size = part.size
    block = (holder - step) % size
    return any(needs(part, (holder + t) % size, block, causal, window, docs)
               for t in range(1, size - step))


def forward_sends(rank: int, size: int, seqlen_local: int, layout: str | Partition = "contiguous",
                  causal: bool = False, window=(-1, -1), docs=None) -> int:
    """How many of the G-1 forward steps `rank` sends its K, V on: G-1 without a mask; with
    causal over contiguous shards rank r < G-1 sends r+1 (the blocks of ranks 0..r) and the last
    rank none, G(G-1)/2 in all; zigzag needs every hop; documents each inside one rank's shard:
    none."""
    part = as_partition(layout, size, seqlen_local)
    return sum(travels(rank, s, part, causal, window, docs) for s in range(size - 1))


def forward_rows(rank: int, part: Partition, causal: bool = False, window=(-1, -1),
                 docs=None) -> int:
    """Rows of the K/V blocks `rank` sends in `forward` (each block at its owner's length):
    (G-1) * S for equal shards without a mask."""
    size = part.size
    return sum(part.lengths[(rank - s) % size] for s in range(size - 1)
               if travels(rank, s, part, causal, window, docs))


def forward_bytes(size: int, k, v, sends: int | None = None) -> int:
    """Bytes one rank sends in `forward` over equal shards: `sends` (default G-1, no mask) x
    (|K| + |V|). Uneven shards: `forward_rows` x the bytes of a row of K and V."""
    return (size - 1 if sends is None else sends) * (k.nbytes + v.nbytes)


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
             row_sums=None, delta=None, grad_dtype=None, window=(-1, -1), docs=None):
    """Gradients of `forward` for this rank's shard.

    dout, q, out: (B, S, H, D); k, v: (B, S, Hkv, D); lse: (B, H, S) from `forward`; layout
    as in `forward` (with uneven shards each bundle and dQ travel at their owner's length).
    Returns dq (B, S, H, D) and dk, dv (B, S, Hkv, D), in the inputs' dtype.
    row_sums: None, or (B, H, S) in the accumulation dtype, contiguous: receives each of this
    rank's rows' sum of the recomputed P over every rank's keys (1 when lse is right).
    delta: rowsum(dout * out) (B, H, S) when the caller has it already (then `out` is unused).
    grad_dtype: the dtype of the returned gradients (default: the inputs'; USP asks for the
    accumulation dtype, to sum the shares of a kv head before rounding).
    Schedule (module docstring): bundles go round in `backward_direction(causal)`, each only
    as far as the last rank that needs it (`bundle_hops`), its dQ one step behind, then home.
    """
    size, rank = transport.size, transport.rank
    part = as_partition(layout, size, q.shape[1])
    lengths = part.lengths
    assert lengths[rank] == q.shape[1], f"rank {rank} holds {q.shape[1]} rows, not {lengths[rank]}"
    acc = accum_dtype(q.dtype)
    sums = row_sums is not None
    if size == 1:
        return _backward_alone(dout, q, k, v, out, lse, ops, part, causal=causal,
                               softmax_scale=softmax_scale, trace=trace, row_sums=row_sums,
                               delta=delta, grad_dtype=grad_dtype, window=window, docs=docs)
    longest = max(lengths)
    # allocated for the longest shard in both places (plus slack for the psum padding, which
    # a shorter dQ may need more of)
    buffers = ops.double_buffer(_bundle_fields(q, acc, longest, longest, sums)
                                + ([("slack", (16,), np.uint8)] if sums else []))

    mask = (part, causal, window, docs)
    d = _direction(*mask)
    to_next, from_prev = (rank + d) % size, (rank - d) % size

    def bundle(step: int) -> int:       # whose bundle this rank holds at `step`
        return (rank - d * step) % size

    def holding(step: int):  # the buffer of `step`: dQ of bundle(step - 1), bundle(step)
        return laid_out(buffers[step % 2], _bundle_fields(
            q, acc, lengths[bundle(step - 1)], lengths[bundle(step)], sums))

    def hops(j: int) -> int:
        return _bundle_hops(j, *mask)

    first = holding(0)
    ops.copy_(first["q"], q)
    ops.copy_(first["dout"], dout)
    ops.copy_(first["delta"], ops.backward_delta(dout, out) if delta is None else delta)
    ops.copy_(first["lse"], lse)
    ctx = ops.backward_init(k, v, softmax_scale)
    b, _, h, hd = q.shape
    dq_flat = ops.zeros((b * longest * h * hd,), acc)        # the dQ part of the bundle held
    psum_flat = ops.zeros((b * h * longest,), acc) if sums else None
    dq = ops.zeros(q.shape, acc)                             # our dQ, once it is home

    dq_only = ("dq", "psum") if sums else ("dq", "dq")
    home_parts = (("dq", dq),) + ((("psum", row_sums),) if sums else ())
    own_hops = hops(rank)
    for s in range(size + 1):                                   # step `size`: the last returns
        cur, nxt = holding(s), holding(s + 1)
        messages = []                                            # (send, recv, dst, src)
        send_bundle = s < hops(bundle(s))                       # it goes on from here
        send_dq = s >= 1 and s - 1 < hops(bundle(s - 1))         # ... one step behind
        span = _span(send_bundle, send_dq, dq_only)
        if span:
            messages.append((cur.span(*span), None, to_next, to_next))
        if s >= 1 and s - 1 == hops(bundle(s - 1)) >= 1:         # it ended here: dQ goes home
            messages += [(cur[name], None, bundle(s - 1), bundle(s - 1)) for name, _ in home_parts]
        recv_span = _span(s < size and s < hops(bundle(s + 1)),    # prev sends it on
                          1 <= s <= hops(bundle(s)), dq_only)
        if recv_span:
            messages.append((None, nxt.span(*recv_span), from_prev, from_prev))
        if s >= 1 and s - 1 == own_hops >= 1:                     # our dQ comes home
            holder = (rank + d * own_hops) % size
            messages += [(None, mine, holder, holder) for _, mine in home_parts]
        if messages:
            shown = span or recv_span
            label = f"bwd {s} send/recv {shown[0]}..{shown[1]}" if shown else f"bwd {s} dq home"
            post_messages(ops, transport, label, messages)
        compute_s = 0.0
        held = s < size and s <= hops(bundle(s))
        blocks = mask_blocks(part, bundle(s), rank, causal, window, docs) if held else []
        adds = held and (bool(blocks) or s == 0)    # a bundle passing through adds nothing
        if adds:
            rows = lengths[bundle(s)]
            dq_part = prefix(dq_flat, (b, rows, h, hd))
            psum_part = prefix(psum_flat, (b, h, rows)) if sums else None
            ops.copy_(dq_part, 0)
            if sums:
                ops.copy_(psum_part, 0)
            if blocks:
                compute_s = timed(ops, f"bwd {s} compute", ops.backward_step, ctx, cur["q"],
                                   cur["dout"], cur["lse"], cur["delta"], dq_part, blocks,
                                   *([psum_part] if sums else []))
        wait_s = timed_wait(ops, transport, f"bwd {s} wait") if messages else 0.0
        if adds:  # nxt.dq holds the dQ of the bundle just used so far (received), or nothing at s 0
            for name, part_ in (("dq", dq_part), ("psum", psum_part)) if sums else (("dq", dq_part),):
                (ops.copy_ if s == 0 else ops.add_)(nxt[name], part_)
            if s == 0 and own_hops == 0:                           # it never left: home already
                for name, mine in home_parts:
                    ops.copy_(mine, nxt[name])
        if trace is not None and (held or messages):
            trace.add("backward", s, bundle(s) if s < size else rank, len(blocks), compute_s,
                      wait_s)
    dk, dv = ops.backward_finalize(ctx, k.dtype if grad_dtype is None else grad_dtype)
    dq_out = ops.zeros(q.shape, q.dtype if grad_dtype is None else grad_dtype)
    ops.copy_(dq_out, dq)
    return dq_out, dk, dv


def _backward_alone(dout, q, k, v, out, lse, ops: LocalOps, part: Partition, *, causal: bool,
                    softmax_scale: float, trace: Trace | None, row_sums, delta, grad_dtype,
                    window, docs):
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
    blocks = mask_blocks(part, 0, 0, causal, window, docs)
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
    dq_out = ops.zeros(q.shape, dq_dtype)
    ops.copy_(dq_out, dq)
    return dq_out, dk, dv


def _span(bundle: bool, dq: bool, dq_only: tuple[str, str]) -> tuple[str, str] | None:
    """The fields of a message carrying a bundle and/or the dQ (and row sums) riding behind."""
    if bundle and dq:
        return ("dq", "lse")
    if bundle:
        return ("q", "lse")
    return dq_only if dq else None


def _hops(d: int, owner: int, part: Partition, causal: bool, window, docs) -> int:
    """The last step at which a rank on `owner`'s way in direction d needs its bundle (0: none)."""
    size = part.size
    return max([0] + [t for t in range(1, size)
                      if needs(part, owner, (owner + d * t) % size, causal, window, docs)])


@lru_cache(maxsize=4096)
def _direction(part: Partition, causal: bool, window=(-1, -1), docs=None) -> int:
    mask = (part, causal, window, docs)
    forwards, backwards = (sum(_hops(d, j, *mask) for j in range(part.size)) for d in (1, -1))
    if forwards != backwards:
        return 1 if forwards < backwards else -1
    return -1 if causal else 1


def backward_direction(layout: str | Partition, size: int, seqlen_local: int, causal: bool,
                       window=(-1, -1), docs=None) -> int:
    """Which way the backward bundles go: +1 to the next rank, -1 to the previous one — the way
    with fewer bundle hops in all under this mask (the same on every rank); on a tie, back under
    causal (causal queries see earlier keys, which contiguous shards put on earlier ranks)."""
    return _direction(as_partition(layout, size, seqlen_local), causal, window, docs)


@lru_cache(maxsize=4096)
def _bundle_hops(owner: int, part: Partition, causal: bool, window=(-1, -1), docs=None) -> int:
    mask = (part, causal, window, docs)
    return _hops(_direction(*mask), owner, *mask)


def bundle_hops(owner: int, layout: str | Partition, size: int, seqlen_local: int, causal: bool,
                window=(-1, -1), docs=None) -> int:
    """How far `owner`'s backward bundle travels: the last step at which a rank it visits (in
    `backward_direction`) needs it, 0 when no other rank does."""
    return _bundle_hops(owner, as_partition(layout, size, seqlen_local), causal, window, docs)


def _sent(rank: int, part: Partition, causal: bool, window, docs):
    """Per step s of `backward` on `rank`: (whose bundle it holds, whether it passes the bundle
    on, whether it sends that bundle's dQ on or home at step s + 1)."""
    size = part.size
    d = _direction(part, causal, window, docs)
    out = []
    for s in range(size):
        j = (rank - d * s) % size
        hops = _bundle_hops(j, part, causal, window, docs)
        out.append((j, s < hops, s < hops or s == hops >= 1))
    return out


def backward_counts(rank: int, size: int, seqlen_local: int, layout: str | Partition = "contiguous",
                    causal: bool = False, window=(-1, -1), docs=None) -> tuple[int, int, int]:
    """(bundles, dqs, messages) `rank` sends in `backward`: bundles it passes on, dQ
    accumulators it passes on or sends home, messages in all. Without a mask every bundle goes
    G-1 hops: (G-1, G, G+1); causal over contiguous shards, rank r passes on r bundles (the
    bundles of r..G-1 visit it on their way down to 0) and so on: half the ring's bundles."""
    sent = _sent(rank, as_partition(layout, size, seqlen_local), causal, window, docs)
    bundles = sum(on for _, on, _ in sent)
    dqs = sum(dq for _, _, dq in sent)
    returns = dqs - bundles
    # messages to the next holder: a step that passes a bundle on or the dQ behind one
    to_next = sum(sent[s][1] or (s >= 1 and sent[s - 1][1]) for s in range(size))
    return bundles, dqs, to_next + returns


def backward_rows(rank: int, part: Partition, causal: bool = False, window=(-1, -1),
                  docs=None) -> tuple[int, int]:
    """(bundle rows, dQ rows) `rank` sends in `backward`, each bundle at its owner's length:
    (G-1) * S and G * S for equal shards without a mask."""
    sent = _sent(rank, part, causal, window, docs)
    return (sum(part.lengths[j] for j, on, _ in sent if on),
            sum(part.lengths[j] for j, _, dq in sent if dq))


def backward_bytes(size: int, q, counts: tuple[int, int, int] | None = None) -> int:
    """Bytes one rank sends in `backward` over equal shards (module docstring): counts from
    `backward_counts` (default: no mask, every bundle all the way round)."""
    if size == 1:
        return 0
    bundles, dqs, _ = (size - 1, size, size + 1) if counts is None else counts
    s = q.shape[1]
    return _backward_row_bytes(q, (bundles * s, dqs * s))


def _backward_row_bytes(q, rows: tuple[int, int]) -> int:
    """Bytes of `rows` = (bundle rows, dQ rows) of queries shaped like q (B, _, H, D)."""
    b, _, h, d = q.shape
    acc = accum_dtype(q.dtype).itemsize
    bundle = b * h * (2 * d * q.dtype.itemsize + 2 * acc)       # q, dout; delta, lse
    return rows[0] * bundle + rows[1] * b * h * d * acc


def backward_messages(size: int, counts: tuple[int, int, int] | None = None) -> int:
    if size == 1:
        return 0
    return size + 1 if counts is None else counts[2]


def forward_messages(size: int) -> int:
    return size - 1


class BurstAttention:
    """This module behind the strategy interface (K and V together; Q, dO, delta, lse, dQ
    travel in the backward pass)."""

    name = "burst"
    forward = staticmethod(forward)
    backward = staticmethod(backward)

    @staticmethod
    def forward_bytes(size: int, q, k, v, **mask) -> int:
        """mask: rank, layout (a name or a Partition), causal, window, docs (`forward_rows`);
        none: every hop."""
        part, flags = _mask(size, q, mask)
        rows = forward_rows(mask.get("rank", 0), part, *flags)
        return rows * (k.nbytes + v.nbytes) // k.shape[1]

    @staticmethod
    def backward_bytes(size: int, q, k, v, **mask) -> int:
        """mask as in forward_bytes (`backward_rows`); none: every bundle all the way round."""
        if size == 1:
            return 0
        part, flags = _mask(size, q, mask)
        return _backward_row_bytes(q, backward_rows(mask.get("rank", 0), part, *flags))

    @staticmethod
    def forward_messages(size: int, q=None, **mask) -> int:
        if _unmasked_count(q, mask):
            return forward_messages(size)
        part, flags = _mask(size, q, mask)
        return sum(travels(mask.get("rank", 0), s, part, *flags) for s in range(size - 1))

    @staticmethod
    def backward_messages(size: int, q=None, **mask) -> int:
        if _unmasked_count(q, mask):
            return backward_messages(size)
        part, flags = _mask(size, q, mask)
        return backward_messages(size, backward_counts(mask.get("rank", 0), size, q.shape[1],
                                                       part, *flags))


def _unmasked_count(q, mask: dict) -> bool:
    """Whether a message-count call without q takes the unmasked formula (with a mask but no
    q: TypeError, since the count then depends on the local sequence length)."""
    if q is None and masked(mask):
        raise TypeError("a mask changes the message count: pass q too (its local seqlen)")
    return q is None


def mask_flags(mask: dict) -> tuple:
    """(causal, window, docs) of a formula's mask (rank, layout, causal, window, docs)."""
    return (bool(mask.get("causal", False)), tuple(mask.get("window", (-1, -1))), mask.get("docs"))


def _mask(size: int, q, mask: dict):
    """(partition, (causal, window, docs)) of a strategy-level formula call."""
    return as_partition(mask.get("layout", "contiguous"), size, q.shape[1]), mask_flags(mask)


def masked(mask: dict) -> bool:
    """Whether a formula's mask (rank, layout, causal, window, docs) can skip a forward hop, or
    its layout is a Partition (whose shards may differ in length)."""
    return bool(mask.get("causal")) or tuple(mask.get("window", (-1, -1))) != (-1, -1) \
        or mask.get("docs") is not None or isinstance(mask.get("layout"), Partition)
