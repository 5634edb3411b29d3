"""The strategies for exact attention over a sequence sharded across ranks, one module each, all
written against the same two interfaces — a `Transport` (burstcu.transport.base) that moves bytes
and a `LocalOps` (burstcu.ops.base) that computes one step — so a benchmark compares schedules,
never attention kernels.

    burst      BurstAttention, this library's ring (`burst`): K and V in ONE message per step,
               double-buffered; backward moves (Q, dO, delta, lse) + a dQ accumulator, K, V stay
    ring       Ring Attention as Liu et al. / ring-flash-attention run it (`ring`): K and V as two
               messages; backward moves K, V and the dK, dV accumulators
    allgather  Megatron context parallelism (`allgather`): all-gather K, V; reduce-scatter dK, dV
    ulysses    DeepSpeed-Ulysses (`ulysses`): all-to-all from sequence- to head-sharded, local
               attention over the whole sequence for H/G heads, all-to-all back
    usp        USP / long-context-attention (`usp`): Ulysses inside groups of u ranks, the burst
               ring across the G/u groups (`USPAttention(ulysses_degree=u)`)

`get(name, **options)` returns the strategy: the module itself, or for "usp" (which has an
option) a `usp.USPAttention`, or for "burst" with its option (bidirectional) a
`burst.BurstAttention`. Either way it has

    forward(q, k, v, ops, transport, *, causal, softmax_scale, layout, trace=None,
            window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> (out, lse)
    backward(dout, q, k, v, out, lse, ops, transport, *, causal, softmax_scale, layout,
             trace=None, row_sums=None, window_size=(-1, -1), cu_seqlens=None,
             block_mask=None) -> (dq, dk, dv)
    input_problem(q_shape, k_shape, size) -> str | None   (what this strategy cannot take;
                                                          only strategies with limits have it)

layout: a layout name (every rank holding S rows) or a `burstcu.layout.Partition`; window_size
(left, right), cu_seqlens (document boundaries, a tuple of ints or None) and block_mask (a
`burstcu.BlockMask` or None; alone, without causal, window or documents) as `burstcu.attention`
takes them, passed on to `burstcu.layout.blocks`.

Linear attention (`get_linear(name)`, `burstcu.linear_attention`), modules both:
    lasp2      LASP-2 (`lasp2`): one all-gather of the D x D states a pass
    lasp1      LASP-1 (`lasp1`): the states passed rank to rank along the sequence
with forward(q, k, v, ops, transport, *, causal, layout, trace=None) -> out and backward(dout, q,
k, v, ops, transport, *, causal, layout, trace=None) -> (dq, dk, dv).

Decode against a sequence-sharded KV cache (`burstcu.decode`), a module of its own:
    decode     one partial attention a rank, ONE all-gather of the partials, the same merge on
               every rank: decode(q, k_cache, v_cache, lengths, softmax_scale, ops, transport)
               -> (out, lse); `decode_bytes(size, q)`

Every strategy, linear ones included, also counts what one rank sends, with one signature:

    forward_bytes(size, q, k, v, *, rank=0, layout="contiguous", causal=False,
                  window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> int
    backward_bytes(...), forward_messages(...), backward_messages(...)   the same arguments

size: G; q, k, v: this rank's arrays, or anything with their `shape`, `dtype`, `size` and
`nbytes` (only those are read); the keywords describe the call as `forward` takes them, for the
rank `rank`. The tests check the counts against `transport.stats`. burst, and usp's ring of
groups, skip what no rank needs, so their counts depend on the rank and the whole mask; the
others send the same under any window or documents (the linear strategies take none), and their
counts depend on the layout's shard lengths, causal (lasp1) and the rank's place. The counts
leave out the row sums of attention_backward(check=True).

Shapes (B batch, S local sequence length, H query heads, Hkv key/value heads, D head dim):
q, dout, out, dq: (B, S, H, D); k, v, dk, dv: (B, S, Hkv, D); lse: (B, H, S) in the accumulation
dtype (float32; float64 for float64 input). Masking follows `burstcu.layout`: causal over
*global* positions, whatever the layout. G ranks, next = (r+1) % G, prev = (r-1) % G.
Trace entries (`steps.Trace`): per step, host seconds in compute and in `wait`.
"""

from __future__ import annotations

from . import allgather, burst, lasp1, lasp2, ring, ulysses
from .steps import StepTrace, Trace
from .usp import USPAttention

_STRATEGIES = {"burst": burst, "ring": ring, "allgather": allgather, "ulysses": ulysses,
               "usp": USPAttention}
NAMES = tuple(_STRATEGIES)
_LINEAR = {"lasp2": lasp2, "lasp1": lasp1}
LINEAR_NAMES = tuple(_LINEAR)


def get(name: str, **options):
    """The strategy called `name` (one of NAMES): its module, or one made with `options`
    ("usp": ulysses_degree; "burst": bidirectional)."""
    if name not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {NAMES}, not {name!r}")
    strategy = _STRATEGIES[name]
    if isinstance(strategy, type):
        return strategy(**options)
    if options:
        unknown = sorted(set(options) - set(getattr(strategy, "OPTIONS", ())))
        if unknown:
            raise TypeError(f"strategy {name!r} takes no options {unknown} (its options: "
                            f"{list(getattr(strategy, 'OPTIONS', ()))})")
        return strategy.with_options(**options)
    return strategy


def get_linear(name: str):
    """The linear-attention strategy (its module) called `name` (one of LINEAR_NAMES)."""
    if name not in _LINEAR:
        raise ValueError(f"strategy must be one of {LINEAR_NAMES}, not {name!r}")
    return _LINEAR[name]


__all__ = ["get", "get_linear", "NAMES", "LINEAR_NAMES", "Trace", "StepTrace"]
