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

from ..layout import step_blocks
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import Trace, post_exchange, post_messages, timed, timed_wait

# ----------------------------------------------------------------------------------------------
# forward

def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, softmax_scale: float,
            layout: str, trace: Trace | None = None, window=(-1, -1), docs=None):
    """Exact attention of this rank's queries over every rank's keys.

    q: (B, S, H, D); k, v: (B, S, Hkv, D) — this rank's shard under `layout`.
    Returns out (B, S, H, D) in q's dtype and lse (B, H, S) in the accumulation dtype.
    """
    size, rank = transport.size, transport.rank
    seqlen = q.shape[1]
    kv_fields = [("k", k.shape, k.dtype), ("v", v.shape, v.dtype)]
    buffers = ops.double_buffer(kv_fields)
    ops.copy_(buffers[0]["k"], k)
    ops.copy_(buffers[0]["v"], v)
    state = ops.forward_init(q, softmax_scale)

    mask = (layout, size, seqlen, causal, window, docs)
    for s in range(size):
        cur, nxt = buffers[s % 2], buffers[(s + 1) % 2]
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
        blocks = step_blocks(layout, rank, source, size, seqlen, causal, window, docs)
        compute_s = 0.0
        if blocks:
            compute_s = timed(ops, f"fwd {s} compute", ops.forward_step, state, cur["k"], cur["v"], blocks)
        wait_s = timed_wait(ops, transport, f"fwd {s} wait") if exchanging else 0.0
        if trace is not None:
            trace.add("forward", s, source, len(blocks), compute_s, wait_s)
    return ops.forward_finalize(state, q.dtype)


@lru_cache(maxsize=4096)  # varlen batches bring new docs each call: keep only recent ones
def needs(layout: str, q_rank: int, kv_rank: int, size: int, seqlen_local: int, causal: bool,
          window=(-1, -1), docs=None) -> bool:
    """Whether `q_rank`'s queries see any key of `kv_rank`'s block."""
    return bool(step_blocks(layout, q_rank, kv_rank, size, seqlen_local, causal, window, docs))


def travels(holder: int, step: int, layout: str, size: int, seqlen_local: int, causal: bool,
            window=(-1, -1), docs=None) -> bool:
    """Whether the K/V block `holder` has at forward step `step` (that of rank holder - step)
    goes on to holder + 1: some rank it would still reach, holder + 1 .. holder + G-1-step,
    needs it."""
    block = (holder - step) % size
    return any(needs(layout, (holder + t) % size, block, size, seqlen_local, causal, window, docs)
               for t in range(1, size - step))


def forward_sends(rank: int, size: int, seqlen_local: int, layout: str = "contiguous",
                  causal: bool = False, window=(-1, -1), docs=None) -> int:
    """How many of the G-1 forward steps `rank` sends its K, V on: G-1 without a mask; with
    causal over contiguous shards rank r < G-1 sends r+1 (the blocks of ranks 0..r) and the last
    rank none, G(G-1)/2 in all; zigzag needs every hop; documents each inside one rank's shard:
    none."""
    return sum(travels(rank, s, layout, size, seqlen_local, causal, window, docs)
               for s in range(size - 1))


def forward_bytes(size: int, k, v, sends: int | None = None) -> int:
    """Bytes one rank sends in `forward`: `sends` (default G-1, no mask) x (|K| + |V|)."""
    return (size - 1 if sends is None else sends) * (k.nbytes + v.nbytes)


# ----------------------------------------------------------------------------------------------
# backward

def _bundle_fields(q, lse, row_sums: bool = False):
    b, s, h, d = q.shape
    acc = accum_dtype(q.dtype)
    # dq (and psum) first: each step's message is then one contiguous span (prefix, suffix or
    # all), and the large fields stay 16-byte aligned for vector loads (psum is followed by the
    # bytes that bring q back to a 16-byte boundary; they travel only inside a whole bundle).
    sums = []
    if row_sums:
        ends = (int(np.prod(q.shape)) + b * h * s) * acc.itemsize
        sums = [("psum", (b, h, s), acc), ("psum_pad", ((-ends) % 16,), np.uint8)]
    return [("dq", q.shape, acc), *sums, ("q", q.shape, q.dtype), ("dout", q.shape, q.dtype),
            ("delta", (b, h, s), acc), ("lse", (b, h, s), acc)]


def backward(dout, q, k, v, out, lse, ops: LocalOps, transport: Transport, *, causal: bool,
             softmax_scale: float, layout: str, trace: Trace | None = None, row_sums=None,
             delta=None, grad_dtype=None, window=(-1, -1), docs=None):
    """Gradients of `forward` for this rank's shard.

    dout, q, out: (B, S, H, D); k, v: (B, S, Hkv, D); lse: (B, H, S) from `forward`.
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
    seqlen = q.shape[1]
    acc = accum_dtype(q.dtype)
    sums = row_sums is not None
    fields = _bundle_fields(q, lse, sums)
    buffers = ops.double_buffer(fields)
    first = buffers[0]
    ops.copy_(first["q"], q)
    ops.copy_(first["dout"], dout)
    ops.copy_(first["delta"], ops.backward_delta(dout, out) if delta is None else delta)
    ops.copy_(first["lse"], lse)
    ctx = ops.backward_init(k, v, softmax_scale)
    dq_part = ops.zeros(q.shape, acc)
    psum_part = ops.zeros(lse.shape, acc) if sums else None
    dq = ops.zeros(q.shape, acc)                             # our dQ, once it is home

    mask = (layout, size, seqlen, causal, window, docs)
    d = backward_direction(*mask)
    to_next, from_prev = (rank + d) % size, (rank - d) % size

    def bundle(step: int) -> int:       # whose bundle this rank holds at `step`
        return (rank - d * step) % size

    def hops(j: int) -> int:
        return bundle_hops(j, *mask)

    dq_only = ("dq", "psum") if sums else ("dq", "dq")
    home_parts = (("dq", dq),) + ((("psum", row_sums),) if sums else ())
    own_hops = hops(rank)
    for s in range(size + 1):                                   # step `size`: the last returns
        cur, nxt = buffers[s % 2], buffers[(s + 1) % 2]
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
        blocks = step_blocks(layout, bundle(s), rank, size, seqlen, causal, window, docs) \
            if held else []
        adds = held and (bool(blocks) or s == 0)    # a bundle passing through adds nothing
        if adds:
            ops.copy_(dq_part, 0)
            if sums:
                ops.copy_(psum_part, 0)
            if blocks:
                compute_s = timed(ops, f"bwd {s} compute", ops.backward_step, ctx, cur["q"],
                                   cur["dout"], cur["lse"], cur["delta"], dq_part, blocks,
                                   *([psum_part] if sums else []))
        wait_s = timed_wait(ops, transport, f"bwd {s} wait") if messages else 0.0
        if adds:  # nxt.dq holds the dQ of the bundle just used so far (received), or nothing at s 0
            for name, part in (("dq", dq_part), ("psum", psum_part)) if sums else (("dq", dq_part),):
                (ops.copy_ if s == 0 else ops.add_)(nxt[name], part)
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


def _span(bundle: bool, dq: bool, dq_only: tuple[str, str]) -> tuple[str, str] | None:
    """The fields of a message carrying a bundle and/or the dQ (and row sums) riding behind."""
    if bundle and dq:
        return ("dq", "lse")
    if bundle:
        return ("q", "lse")
    return dq_only if dq else None


def _hops(d: int, owner: int, layout: str, size: int, seqlen_local: int, causal: bool, window,
          docs) -> int:
    """The last step at which a rank on `owner`'s way in direction d needs its bundle (0: none)."""
    return max([0] + [t for t in range(1, size)
                      if needs(layout, owner, (owner + d * t) % size, size, seqlen_local, causal,
                               window, docs)])


@lru_cache(maxsize=4096)
def backward_direction(layout: str, size: int, seqlen_local: int, causal: bool,
                       window=(-1, -1), docs=None) -> int:
    """Which way the backward bundles go: +1 to the next rank, -1 to the previous one — the way
    with fewer bundle hops in all under this mask (the same on every rank); on a tie, back under
    causal (causal queries see earlier keys, which contiguous shards put on earlier ranks)."""
    mask = (layout, size, seqlen_local, causal, window, docs)
    forwards, backwards = (sum(_hops(d, j, *mask) for j in range(size)) for d in (1, -1))
    if forwards != backwards:
        return 1 if forwards < backwards else -1
    return -1 if causal else 1


@lru_cache(maxsize=4096)
def bundle_hops(owner: int, layout: str, size: int, seqlen_local: int, causal: bool,
                window=(-1, -1), docs=None) -> int:
    """How far `owner`'s backward bundle travels: the last step at which a rank it visits (in
    `backward_direction`) needs it, 0 when no other rank does."""
    mask = (layout, size, seqlen_local, causal, window, docs)
    return _hops(backward_direction(*mask), owner, *mask)


def backward_counts(rank: int, size: int, seqlen_local: int, layout: str = "contiguous",
                    causal: bool = False, window=(-1, -1), docs=None) -> tuple[int, int, int]:
    """(bundles, dqs, messages) `rank` sends in `backward`: bundles it passes on, dQ
    accumulators it passes on or sends home, messages in all. Without a mask every bundle goes
    G-1 hops: (G-1, G, G+1); causal over contiguous shards, rank r passes on r bundles (the
    bundles of r..G-1 visit it on their way down to 0) and so on: half the ring's bundles."""
    d = backward_direction(layout, size, seqlen_local, causal, window, docs)
    hops = [bundle_hops((rank - d * s) % size, layout, size, seqlen_local, causal, window, docs)
            for s in range(size)]
    bundles = sum(s < hops[s] for s in range(size))
    returns = sum(s == hops[s] >= 1 for s in range(size))
    to_next = sum(s < hops[s] or (s >= 1 and s - 1 < hops[s - 1]) for s in range(size))
    return bundles, bundles + returns, to_next + returns


def backward_bytes(size: int, q, counts: tuple[int, int, int] | None = None) -> int:
    """Bytes one rank sends in `backward` (module docstring): counts from `backward_counts`
    (default: no mask, every bundle all the way round)."""
    if size == 1:
        return 0
    bundles, dqs, _ = (size - 1, size, size + 1) if counts is None else counts
    b, s, h, d = q.shape
    acc = accum_dtype(q.dtype).itemsize
    bundle = 2 * q.nbytes + 2 * b * h * s * acc
    return bundles * bundle + dqs * b * s * h * d * acc


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
        """mask: rank, layout, causal, window, docs (forward_sends); none: every hop."""
        return forward_bytes(size, k, v, _sends(size, q, mask))

    @staticmethod
    def backward_bytes(size: int, q, k, v, **mask) -> int:
        """mask as in forward_bytes (backward_counts); none: every bundle all the way round."""
        return backward_bytes(size, q, _counts(size, q, mask))

    @staticmethod
    def forward_messages(size: int, q=None, **mask) -> int:
        if q is None and masked(mask):
            raise TypeError("a mask changes the message count: pass q too (its local seqlen)")
        sends = None if q is None else _sends(size, q, mask)
        return forward_messages(size) if sends is None else sends

    @staticmethod
    def backward_messages(size: int, q=None, **mask) -> int:
        return backward_messages(size, _counts(size, q, mask))


def _sends(size: int, q, mask: dict) -> int | None:
    """forward_sends for a strategy-level formula call (None: no mask given, every hop)."""
    if not masked(mask):
        return None
    return forward_sends(mask.get("rank", 0), size, q.shape[1], mask.get("layout", "contiguous"),
                         mask.get("causal", False), tuple(mask.get("window", (-1, -1))),
                         mask.get("docs"))


def _counts(size: int, q, mask: dict):
    """backward_counts for a strategy-level formula call (None: no mask given)."""
    if not masked(mask):
        return None
    if q is None:
        raise TypeError("a mask changes the message count: pass q too (its local seqlen)")
    return backward_counts(mask.get("rank", 0), size, q.shape[1], mask.get("layout", "contiguous"),
                           mask.get("causal", False), tuple(mask.get("window", (-1, -1))),
                           mask.get("docs"))


def masked(mask: dict) -> bool:
    """Whether a formula's mask (rank, layout, causal, window, docs) can skip a forward hop."""
    return bool(mask.get("causal")) or tuple(mask.get("window", (-1, -1))) != (-1, -1) \
        or mask.get("docs") is not None
