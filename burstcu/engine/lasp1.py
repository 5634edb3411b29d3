"""LASP-1 (Sun et al. 2024), the ring baseline of LASP-2: the D x D states travel rank to rank
along the chunks' global order, one point-to-point message a hop, each hop waiting for the one
before it (the sequential chain LASP-2 replaces by one all-gather).

Chunks (runs of rows, `burstcu.engine.lasp2.runs`) in global order t = 0 .. T-1, T = G * nruns;
a hop t -> t+1 is a message only where another rank holds chunk t+1. Local compute and shapes:
`burstcu.ops.linear`.

Forward, causal: for each of my chunks t in order: post the receive of P_t (the state of chunks
    < t) from the holder of t-1, compute the intra-chunk output meanwhile, wait, out_t += Q_t P_t,
    send P_t + M_t on to the holder of t+1.
Forward, non-causal: the same chain without outputs brings the total M to the holder of chunk
    T-1, then a second chain carries M from there to the holders of chunks 0, 1, .., T-2 in
    that order (`total_hops`: a hop T-1 -> 0 first, none to a rank that has it); every rank then
    computes out = Q M.
Backward, causal: the forward's chain of P_t again (the API keeps no state), then a reverse chain
    of the gradient states S_t = sum of dM over chunks > t, from chunk T-1 down to 0.
Backward, non-causal: the two forward chains carrying (M, dM) together.
Messages per rank: one a hop it sends (see `forward_sends`, `backward_sends`), each one chunk's
state, B*Hkv*D*D in the accumulation dtype (two of them in the non-causal backward).
"""

from __future__ import annotations

from ..layout import Partition
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .lasp2 import my_runs, outputs, rows, runs, stacked, state_bytes
from .steps import Trace, now, timed_wait


class _Chain:
    """Hops between chunk holders: owner[t] is the rank holding chunk t."""

    def __init__(self, ops: LocalOps, transport: Transport, owner: list[int]):
        self.ops, self.transport, self.owner = ops, transport, owner
        self.wait_s = 0.0

    def receive(self, buf, src: int, label: str) -> None:
        """Post the receive of `buf` from rank `src` (not waited)."""
        with self.ops.annotate(label):
            self.transport.send_recv(None, buf, src, src)
            self.transport.commit()

    def wait(self, label: str) -> None:
        self.wait_s += timed_wait(self.ops, self.transport, label)

    def send(self, buf, dst: int, label: str) -> None:
        """Send `buf` to rank `dst`, waited (the next hop needs this one's data anyway)."""
        with self.ops.annotate(label):
            self.transport.send_recv(buf, None, dst, dst)
            self.transport.commit()
        self.wait(label)


def owners(layout: str | Partition, size: int, seqlen_local: int) -> list[int]:
    """The rank holding each chunk, in global order."""
    _, _, place = runs(layout, 0, size, seqlen_local)
    owner = [0] * len(place)
    for (r, _), n in place.items():
        owner[n] = r
    return owner


def total_hops(owner: list[int]) -> list[tuple[int, int]]:
    """(src, dst) rank messages carrying the total from the last chunk's holder to every other
    rank, in chunk order: chunk t's holder gets it from the holder of chunk t-1 (chunk 0's from
    the last chunk's), unless it has it already."""
    last = len(owner) - 1
    has, hops = {owner[last]}, []
    for t in range(last):
        if owner[t] not in has:
            hops.append((owner[last if t == 0 else t - 1], owner[t]))
            has.add(owner[t])
    return hops


def _prefix_chain(chain: _Chain, places, local_states, shape, acc, label: str,
                  on_chunk=None):
    """Walk my chunks (global places, ascending) in order: receive the running sum of the states
    before each from the previous chunk's holder (or carry it from my own previous chunk), call
    on_chunk(i) before waiting so the two overlap, then pass prefix + my state on to the next
    chunk's holder. Returns each of my chunks' prefix, and the running sum after my last one."""
    rank, owner = chain.transport.rank, chain.owner
    prefixes, carried = [], None
    for i, n in enumerate(places):
        if n > 0 and owner[n - 1] == rank:
            prefix, posted = carried, False
        else:
            prefix, posted = chain.ops.zeros(shape, acc), n > 0
            if posted:
                chain.receive(prefix, owner[n - 1], f"{label} recv {n}")
        if on_chunk is not None:
            on_chunk(i)
        if posted:
            chain.wait(f"{label} wait {n}")
        prefixes.append(prefix)
        carried = chain.ops.zeros(shape, acc)
        chain.ops.copy_(carried, prefix)
        chain.ops.add_(carried, local_states[i])
        if n + 1 < len(owner) and owner[n + 1] != rank:
            chain.send(carried, owner[n + 1], f"{label} send {n + 1}")
    return prefixes, carried


def _total_chain(chain: _Chain, total, shape, acc, label: str):
    """The total, held by the last chunk's holder, brought to every rank (`total_hops`)."""
    rank = chain.transport.rank
    have = total if chain.owner[-1] == rank else None
    for n, (src, dst) in enumerate(total_hops(chain.owner)):
        if dst == rank:
            have = chain.ops.zeros(shape, acc)
            chain.receive(have, src, f"{label} recv {n}")
            chain.wait(f"{label} wait {n}")
        elif src == rank:
            chain.send(have, dst, f"{label} send {n}")
    return have


def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, layout: str | Partition,
            trace: Trace | None = None):
    """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype."""
    acc = accum_dtype(q.dtype)
    size, rank, segs, places, _ = my_runs(layout, transport, q)
    chain = _Chain(ops, transport, owners(layout, size, q.shape[1]))
    shape = (k.shape[0], k.shape[2], q.shape[-1], q.shape[-1])
    states = [ops.linear_kv_state(rows(k, s), rows(v, s), acc) for s in segs]
    t0, local = now(), {}

    def intra(i):
        s = segs[i]
        local[i] = ops.linear_forward_run(rows(q, s), rows(k, s), rows(v, s), None, acc)

    prefixes, carried = _prefix_chain(chain, places, states, shape, acc, "lasp1 fwd",
                                      intra if causal else None)
    total = None if causal else _total_chain(chain, carried, shape, acc, "lasp1 fwd total")
    out = outputs(ops, q, causal, segs, [local[i] for i in range(len(segs))] if causal else None,
                  prefixes, total, acc)
    if trace is not None:
        trace.add("forward", 0, rank, len(segs), now() - t0 - chain.wait_s, chain.wait_s)
    return out.astype(q.dtype)


def backward(dout, q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, layout: str | Partition,
             trace: Trace | None = None):
    """Gradients of `forward`: dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the inputs' dtype."""
    acc, hkv = accum_dtype(q.dtype), k.shape[2]
    size, rank, segs, places, _ = my_runs(layout, transport, q)
    owner = owners(layout, size, q.shape[1])
    chain = _Chain(ops, transport, owner)
    d = q.shape[-1]
    shape = (k.shape[0], hkv, d, d)
    kv = [ops.linear_kv_state(rows(k, s), rows(v, s), acc) for s in segs]
    grads = [ops.linear_grad_state(rows(q, s), rows(dout, s), hkv, acc) for s in segs]
    dq, dk, dv = ops.zeros(q.shape, acc), ops.zeros(k.shape, acc), ops.zeros(v.shape, acc)
    t0 = now()
    if causal:
        local = {}

        def intra(i):
            s = segs[i]
            local[i] = ops.linear_backward_run(rows(dout, s), rows(q, s), rows(k, s),
                                           rows(v, s), None, None, acc)

        prefixes, _ = _prefix_chain(chain, places, kv, shape, acc, "lasp1 bwd", intra)
        # the reverse chain: chunk order reversed, so its "prefix" is the suffix of dM
        rev = _Chain(ops, transport, owner[::-1])
        last = len(owner) - 1
        order = sorted(range(len(segs)), key=lambda i: -places[i])
        suffixes, _ = _prefix_chain(rev, [last - places[i] for i in order],
                                    [grads[i] for i in order], shape, acc, "lasp1 bwd rev")
        chain.wait_s += rev.wait_s
        suffix_of = {i: sfx for i, sfx in zip(order, suffixes)}
        for i, s in enumerate(segs):
            cq, ck, cv = ops.linear_backward_full(rows(dout, s), rows(k, s), rows(v, s),
                                              prefixes[i], suffix_of[i], acc)
            sl = slice(s.local, s.local + s.length)
            dq[:, sl], dk[:, sl], dv[:, sl] = local[i][0] + cq, local[i][1] + ck, local[i][2] + cv
    else:
        both = [stacked(ops, [m, g], acc) for m, g in zip(kv, grads)]
        _, carried = _prefix_chain(chain, places, both, (2,) + shape, acc, "lasp1 bwd")
        total = _total_chain(chain, carried, (2,) + shape, acc, "lasp1 bwd total")
        dq[...], dk[...], dv[...] = ops.linear_backward_full(dout, k, v, total[0], total[1], acc)
    if trace is not None:
        trace.add("backward", 0, rank, len(segs), now() - t0 - chain.wait_s, chain.wait_s)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

# ----------------------------------------------------------------------------------------------
# what one rank sends

def forward_sends(rank: int, size: int, seqlen_local: int, layout: str | Partition = "contiguous",
                  causal: bool = True) -> int:
    """Messages `rank` sends in `forward`: a hop t -> t+1 of the chain for each of its chunks
    t < T-1 whose successor another rank holds; non-causal adds the total's chain
    (`total_hops`)."""
    owner = owners(layout, size, seqlen_local)
    sends = sum(owner[t] == rank and owner[t + 1] != rank for t in range(len(owner) - 1))
    if not causal:
        sends += sum(src == rank for src, _ in total_hops(owner))
    return sends


def backward_sends(rank: int, size: int, seqlen_local: int, layout: str | Partition = "contiguous",
                   causal: bool = True) -> int:
    """Messages `rank` sends in `backward`: causal, the forward chain and the same chain
    reversed; non-causal, the forward's two chains (each message twice the size)."""
    owner = owners(layout, size, seqlen_local)
    last = len(owner) - 1
    fwd = forward_sends(rank, size, seqlen_local, layout, causal)
    if not causal:
        return fwd
    return fwd + sum(owner[t] == rank and owner[t - 1] != rank for t in range(last, 0, -1))


# the strategy interface (`burstcu.engine`): linear attention takes no window or documents (the
# keywords are there for the one signature)

def forward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                  causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """One chunk state a message (`forward_sends`)."""
    return forward_sends(rank, size, q.shape[1], layout, causal) * state_bytes(q, k)


def backward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                   causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """One chunk state a message (`backward_sends`), two (M and dM) when not causal."""
    per = state_bytes(q, k) * (1 if causal else 2)
    return backward_sends(rank, size, q.shape[1], layout, causal) * per


def forward_messages(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                     causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """`forward_sends`."""
    return forward_sends(rank, size, q.shape[1], layout, causal)


def backward_messages(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                      causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """`backward_sends`."""
    return backward_sends(rank, size, q.shape[1], layout, causal)
