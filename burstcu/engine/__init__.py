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
               ring across the G/u groups (`ulysses_degree=u`)

Linear attention (`get_linear(name)`, `burstcu.linear_attention`):
    lasp2      LASP-2 (`lasp2`): one all-gather of the D x D states a pass
    lasp1      LASP-1 (`lasp1`): the states passed rank to rank along the sequence
with forward(q, k, v, ops, transport, *, causal, layout, trace) -> out and backward(dout, q, k,
v, ops, transport, *, causal, layout, trace) -> (dq, dk, dv).

`get(name)` returns an object with

    forward(q, k, v, ops, transport, *, causal, softmax_scale, layout, trace) -> (out, lse)
    backward(dout, q, k, v, out, lse, ops, transport, *, causal, softmax_scale, layout, trace,
             row_sums=None) -> (dq, dk, dv)
    input_problem(q_shape, k_shape, size) -> str | None   (what this strategy cannot take;
                                                          only strategies with limits have it)

plus the byte and message formulas of what one rank sends (`forward_bytes(size, q, k, v,
**mask)`, `backward_bytes(size, q, k, v, **mask)`, `forward_messages(size, q=None, **mask)`,
`backward_messages(size, q=None, **mask)`), which the tests check against `transport.stats`;
mask = rank, layout, causal, window, docs, for the strategies that skip what no rank needs
(burst and usp, forward and backward; the others take it and send the same). Every strategy's forward and backward take `window` and `docs` (document boundaries)
keyword arguments, passed on to `burstcu.layout.step_blocks`.

Shapes (B batch, S local sequence length, H query heads, Hkv key/value heads, D head dim):
q, dout, out, dq: (B, S, H, D); k, v, dk, dv: (B, S, Hkv, D); lse: (B, H, S) in the accumulation
dtype (float32; float64 for float64 input). Masking follows `burstcu.layout`: causal over
*global* positions, whatever the layout. G ranks, next = (r+1) % G, prev = (r-1) % G.
Trace entries (`steps.Trace`): per step, host seconds in compute and in `wait`.
"""

from __future__ import annotations

from .allgather import AllGatherAttention
from .burst import BurstAttention
from .lasp1 import LASP1
from .lasp2 import LASP2
from .ring import RingAttention
from .steps import StepTrace, Trace
from .ulysses import UlyssesAttention
from .usp import USPAttention

_STRATEGIES = {"burst": BurstAttention, "ring": RingAttention, "allgather": AllGatherAttention,
               "ulysses": UlyssesAttention, "usp": USPAttention}
NAMES = tuple(_STRATEGIES)
_LINEAR = {"lasp2": LASP2, "lasp1": LASP1}
LINEAR_NAMES = tuple(_LINEAR)


def get(name: str, **options):
    """The strategy object called `name` (one of NAMES), made with `options` (only "usp" has
    one: ulysses_degree)."""
    if name not in _STRATEGIES:
        raise ValueError(f"strategy must be one of {NAMES}, not {name!r}")
    return _STRATEGIES[name](**options)


def get_linear(name: str):
    """The linear-attention strategy called `name` (one of LINEAR_NAMES)."""
    if name not in _LINEAR:
        raise ValueError(f"strategy must be one of {LINEAR_NAMES}, not {name!r}")
    return _LINEAR[name]()


__all__ = ["get", "get_linear", "NAMES", "LINEAR_NAMES", "Trace", "StepTrace"]
