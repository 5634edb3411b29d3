"""LASP-2 (Sun et al. 2025): linear attention over a sharded sequence with ONE all-gather of the
D x D states per pass, posted before and waited after the local work so the two overlap.

Linear attention, chunkwise local compute and shapes: `burstcu.ops.linear`. A rank's rows are
one or two runs of global positions (`burstcu.layout.segments`: contiguous, zigzag, or
"documents", which without documents is zigzag); each run is a chunk t with state
M_t = K_t^T V_t (B, Hkv, D, D) in the accumulation dtype.

Forward:
    states = [M_t for my runs]                      (nruns, B, Hkv, D, D), nruns = 1 or 2
    post: send states to every other rank, receive theirs       (the all-gather, one commit)
    causal: out_t = forward_run(run t, no prefix)   (intra-chunk work, overlaps the gather)
    wait
    causal: out_t += Q_t P_t, P_t = sum of the states of every chunk before t in global order
    non-causal: out = Q M, M = sum of every chunk's state (in global chunk order: the same bits
                on every rank)
Backward (the API keeps no state between calls, so M travels again, beside dM):
    states = [(M_t, dM_t) for my runs], dM_t = sum over a kv head's query heads of Q_t^T dO_t
    post the all-gather; causal: backward_run(run t, no prefix, no suffix); wait
    causal: dq_t += dO_t P_t^T, dk_t += V_t S_t^T, dv_t += K_t S_t, S_t = sum of the dM of every
            chunk after t;   non-causal: dq = dO M^T, dk = V dM^T, dv = K dM over the sums
Bytes sent per rank (G > 1), itemsize that of the accumulation dtype:
    forward  (G-1) * nruns * B*Hkv*D*D * itemsize       in G-1 messages
    backward (G-1) * 2 * nruns * B*Hkv*D*D * itemsize   in G-1 messages
independent of the sequence length.
"""

from __future__ import annotations

from ..layout import Partition, segments
from ..ops.base import LocalOps, accum_dtype
from ..transport.base import Transport
from .steps import Trace, now, post_pairwise, timed_wait


def runs(layout: str | Partition, rank: int, size: int, seqlen_local: int):
    """This rank's runs of rows (layout.Segment) and, for each, its chunk's place in global
    order among all G * nruns chunks."""
    order = sorted((seg.pos, r, i) for r in range(size)
                   for i, seg in enumerate(segments(layout, r, size, seqlen_local)))
    place = {(r, i): n for n, (_, r, i) in enumerate(order)}
    mine = segments(layout, rank, size, seqlen_local)
    return mine, [place[(rank, i)] for i in range(len(mine))], place


def my_runs(layout: str | Partition, transport: Transport, q) -> tuple:
    """(size, rank, this rank's runs, their places, every chunk's place) of q's rows (`runs`)."""
    size, rank = transport.size, transport.rank
    return (size, rank) + runs(layout, rank, size, q.shape[1])


def rows(x, seg):
    return x[:, seg.local:seg.local + seg.length]


def outputs(ops: LocalOps, q, causal: bool, segs, local, prefixes, total, acc):
    """out (B,S,H,D) in acc from this rank's runs: causal, each run's own part `local[i]` plus
    its queries against `prefixes[i]`, the state of every earlier chunk; non-causal, every
    row's queries against `total`, the state of the whole sequence."""
    out = ops.zeros(q.shape, acc)
    if causal:
        for seg, part, prefix in zip(segs, local, prefixes):
            out[:, seg.local:seg.local + seg.length] = part + ops.linear_forward_full(
                rows(q, seg), prefix, acc)
    else:
        out[...] = ops.linear_forward_full(q, total, acc)
    return out


def stacked(ops: LocalOps, arrays: list, acc):
    """A new contiguous (len(arrays), *shape) array in acc holding `arrays` (one shape)."""
    out = ops.zeros((len(arrays),) + tuple(arrays[0].shape), acc)
    for i, x in enumerate(arrays):
        ops.copy_(out[i], x)
    return out


def state_bytes(q, k) -> int:
    """Bytes of one chunk's state: B * Hkv * D * D in the accumulation dtype."""
    b, _, hkv, d = k.shape
    return b * hkv * d * d * accum_dtype(q.dtype).itemsize


def _gather(ops: LocalOps, transport: Transport, mine, label: str):
    """(size, *mine.shape) holding every rank's `mine`, the exchange posted, not waited."""
    gathered = ops.zeros((transport.size,) + tuple(mine.shape), mine.dtype)
    ops.copy_(gathered[transport.rank], mine)
    peers = [p for p in range(transport.size) if p != transport.rank]
    if peers:
        post_pairwise(ops, transport, label, [(mine, gathered[p], p) for p in peers])
    return gathered, bool(peers)


def _chunk_states(gathered, place, size: int, nruns: int):
    """The gathered states as a list in global chunk order."""
    ordered = [None] * (size * nruns)
    for (r, i), n in place.items():
        ordered[n] = gathered[r, i]
    return ordered


def forward(q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, layout: str | Partition,
            trace: Trace | None = None):
    """q: (B,S,H,D); k, v: (B,S,Hkv,D). Returns out (B,S,H,D) in q's dtype."""
    acc = accum_dtype(q.dtype)
    size, rank, mine_runs, places, place = my_runs(layout, transport, q)
    states = stacked(ops, [ops.linear_kv_state(rows(k, s), rows(v, s), acc) for s in mine_runs], acc)
    gathered, posted = _gather(ops, transport, states, "lasp2 fwd all-gather states")
    t0 = now()
    local = ([ops.linear_forward_run(rows(q, s), rows(k, s), rows(v, s), None, acc)
              for s in mine_runs] if causal else None)
    compute_s = now() - t0
    wait_s = timed_wait(ops, transport, "lasp2 fwd wait") if posted else 0.0
    ordered = _chunk_states(gathered, place, size, len(mine_runs))
    d = q.shape[-1]
    prefixes = [_total(ops, ordered[:n], acc, k.shape, d) for n in places] if causal else None
    out = outputs(ops, q, causal, mine_runs, local, prefixes,
                  None if causal else _total(ops, ordered, acc, k.shape, d), acc)
    if trace is not None:
        trace.add("forward", 0, rank, len(mine_runs), compute_s, wait_s)
    return out.astype(q.dtype)


def backward(dout, q, k, v, ops: LocalOps, transport: Transport, *, causal: bool, layout: str | Partition,
             trace: Trace | None = None):
    """Gradients of `forward`: dq (B,S,H,D), dk, dv (B,S,Hkv,D) in the inputs' dtype."""
    acc, hkv = accum_dtype(q.dtype), k.shape[2]
    size, rank, mine_runs, places, place = my_runs(layout, transport, q)
    states = stacked(ops, [stacked(ops, [ops.linear_kv_state(rows(k, s), rows(v, s), acc),
                                         ops.linear_grad_state(rows(q, s), rows(dout, s), hkv, acc)],
                                   acc) for s in mine_runs], acc)   # (nruns, 2, B, Hkv, D, D)
    gathered, posted = _gather(ops, transport, states, "lasp2 bwd all-gather states")
    t0 = now()
    local = ([ops.linear_backward_run(rows(dout, s), rows(q, s), rows(k, s), rows(v, s),
                                  None, None, acc) for s in mine_runs] if causal else None)
    compute_s = now() - t0
    wait_s = timed_wait(ops, transport, "lasp2 bwd wait") if posted else 0.0
    ordered = _chunk_states(gathered, place, size, len(mine_runs))
    kv_states, grad_states = [s[0] for s in ordered], [s[1] for s in ordered]
    dq, dk, dv = ops.zeros(q.shape, acc), ops.zeros(k.shape, acc), ops.zeros(v.shape, acc)
    d = q.shape[-1]
    if causal:
        for seg, n, (dq_t, dk_t, dv_t) in zip(mine_runs, places, local):
            prefix = _total(ops, kv_states[:n], acc, k.shape, d)
            suffix = _total(ops, grad_states[n + 1:], acc, k.shape, d)
            cq, ck, cv = ops.linear_backward_full(rows(dout, seg), rows(k, seg), rows(v, seg),
                                              prefix, suffix, acc)
            sl = slice(seg.local, seg.local + seg.length)
            dq[:, sl], dk[:, sl], dv[:, sl] = dq_t + cq, dk_t + ck, dv_t + cv
    else:
        total, grad_total = (_total(ops, kv_states, acc, k.shape, d),
                             _total(ops, grad_states, acc, k.shape, d))
        dq[...], dk[...], dv[...] = ops.linear_backward_full(dout, k, v, total, grad_total, acc)
    if trace is not None:
        trace.add("backward", 0, rank, len(mine_runs), compute_s, wait_s)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _total(ops: LocalOps, states, acc, k_shape, d: int):
    """The sum of `states` (each (B, Hkv, D, D)) in list order; zeros when there are none."""
    out = ops.zeros((k_shape[0], k_shape[2], d, d), acc)
    for s in states:
        ops.add_(out, s)
    return out


# ----------------------------------------------------------------------------------------------
# what one rank sends (the strategy interface, `burstcu.engine`): linear attention takes no
# window or documents (the keywords are there for the one signature); of the mask only the
# layout matters (how many runs, so states, a rank holds)

def forward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                  causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """This rank's chunk states to each of the G-1 others."""
    return (size - 1) * len(segments(layout, 0, size, q.shape[1])) * state_bytes(q, k)


def backward_bytes(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                   causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """The forward's states again, beside the gradient states: twice the forward."""
    return 2 * forward_bytes(size, q, k, v, layout=layout)


def forward_messages(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                     causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """One all-gather: a message to each other rank."""
    return size - 1


def backward_messages(size: int, q, k, v, *, rank: int = 0, layout: str | Partition = "contiguous",
                      causal: bool = False, window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int:
    """One all-gather: a message to each other rank."""
    return size - 1
