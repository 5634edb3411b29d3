"""strategy="auto": a cost model of every strategy, and the choice it makes.

`plan(q_shape, k_shape, group, causal=..., layout=..., dtype=...)` predicts the time of one
forward and one backward pass of every strategy that can take the shapes (burst, ring,
allgather, ulysses, and usp for every Ulysses degree u > 1 that works and fits a node) on a
`Machine`, and picks the one with the smallest predicted forward + backward time (forward only
with backward=False); ties go to the earlier candidate, burst first. The result prints as a table.
Every figure is a PREDICTION of this model, not a measurement (bench/plan_check.py compares the
pick with the measured best on the CPU).

The model (per rank; B batch, H / Hkv heads, D head dim, S local rows, N = G S, it / acc the input
and accumulation itemsizes; bytes are the engines' exact formulas, `burstcu.engine`):
    compute   t(flops) = step_overhead + flops / machine.flops per call of the local op (the
              overhead: host work and launches, which dominate small blocks on a CPU); one ring
              step of full blocks is 4 B H S^2 D
              flops forward, 10 B H S^2 D backward (S^2 recomputed, dV, dP, dQ, dK). Causal
              keeps half; the ring's critical path is the busiest rank of each step: every step
              half (zigzag) or G - 1/2 full steps over G (contiguous: the last rank works every
              step). Ulysses attends over all N rows in position order: half of N^2 for H/G heads.
    messages  t(bytes) = latency + bytes / bandwidth for each ring exchange and for each
              all-to-all (its messages go out together), with the intra-node bandwidth when the
              ranks that talk share a node (machine.ranks_per_node), else the inter-node one.
    burst     (G-1) steps of max(compute, transfer) (the transfer hides behind the step's
              compute) + the last step's compute (+ dQ's hop home in the backward);
              ring: the same with its messages and bytes; allgather: gather, then all compute
              (no overlap; backward adds the reduce-scatter); ulysses: all-to-all in + compute
              over the whole sequence + all-to-all out (no overlap); usp(u): the all-to-alls inside
              groups of u (intra-node) around a burst ring over the G/u groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import engine
from .ops.base import accum_dtype


@dataclass(frozen=True)
class Machine:
    """What the model assumes of the hardware. flops: attention flop/s the local op sustains;
    intra_bw / inter_bw: bytes/s one way per rank inside / across nodes; latency: seconds per
    exchange; ranks_per_node: ranks that share the fast links; step_overhead: seconds of fixed
    cost per call of the local op (forward or backward step)."""

    name: str
    flops: float
    intra_bw: float
    inter_bw: float
    latency: float
    ranks_per_node: int
    source: str
    step_overhead: float = 0.0


MACHINES = {
    # ASSUMED round figures for the NumPy backend on a few cores with shared-memory MPI; measure
    # them for a real choice (bench/plan_check.py does)
    "cpu": Machine("cpu", 2e10, 2e9, 2e9, 2e-4, 1 << 30, "ASSUMED: NumPy/BLAS on a few cores, "
                   "MPI over shared memory", step_overhead=8e-4),
    # vendor peaks (H100 SXM5: 989 TF dense BF16; NVLink 4: 450 GB/s each way; NDR InfiniBand:
    # 50 GB/s each way a GPU) times ASSUMED efficiencies: 40% of peak, 80% of the links
    "h100": Machine("h100", 989e12 * 0.4, 450e9 * 0.8, 50e9 * 0.8, 1e-5, 8,
                    "H100 SXM5 + NVLink 4 + NDR InfiniBand datasheets; ASSUMED 40% MFU, 80% links, "
                    "10 us a message, 20 us a step", step_overhead=2e-5),
}


@dataclass(frozen=True)
class Candidate:
    """One strategy's PREDICTED seconds for one forward and one backward pass, and the bytes one
    rank sends in each."""

    strategy: str
    options: dict
    forward_s: float
    backward_s: float
    forward_bytes: int
    backward_bytes: int

    @property
    def label(self) -> str:
        return self.strategy + "".join(f" {k}={v}" for k, v in self.options.items())


@dataclass
class Plan:
    """The candidates, best first by the rule, and the choice (`strategy`, `options`)."""

    candidates: list[Candidate]
    machine: Machine
    backward: bool
    shape: tuple = field(default=())

    @property
    def choice(self) -> Candidate:
        return self.candidates[0]

    @property
    def strategy(self) -> str:
        return self.choice.strategy

    @property
    def options(self) -> dict:
        return dict(self.choice.options)

    def __str__(self) -> str:
        g, b, s, h, hkv, d = self.shape
        lines = [f"PREDICTION ({self.machine.name}: {self.machine.source}) for G={g} B={b} S={s} "
                 f"a rank, H={h}/{hkv} D={d}; choice: {self.choice.label} "
                 f"(smallest forward{' + backward' if self.backward else ''})",
                 f"{'strategy':24s} {'forward':>10s} {'backward':>10s} {'fwd bytes':>12s} {'bwd bytes':>12s}"]
        for c in self.candidates:
            lines.append(f"{c.label:24s} {c.forward_s * 1e3:8.3f}ms {c.backward_s * 1e3:8.3f}ms "
                         f"{c.forward_bytes:12d} {c.backward_bytes:12d}")
        return "\n".join(lines)


class _Spec:
    """Shape, dtype and nbytes of an array, for the engines' byte formulas."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape))
        self.nbytes = self.size * self.dtype.itemsize


def _critical_fraction(causal: bool, layout: str, size: int) -> float:
    """Average share of a full block the busiest rank computes per ring step."""
    if not causal:
        return 1.0
    return 0.5 if layout == "zigzag" or size == 1 else (size - 0.5) / size


def _transfer(machine: Machine, nbytes: float, local: bool) -> float:
    """One exchange (or one all-to-all, whose messages go out together)."""
    bw = machine.intra_bw if local else machine.inter_bw
    return machine.latency + nbytes / bw


def predict(strategy: str, options: dict, q_shape, k_shape, size: int, *, causal: bool,
            layout: str, dtype, machine: Machine, rank: int = 0) -> Candidate:
    """PREDICTED forward and backward seconds of `strategy` (see the module docstring); bytes
    are those `rank` sends (burst and usp skip hops under some masks)."""
    b, s, h, d = (int(n) for n in q_shape)
    hkv = int(k_shape[2])
    q, k = _Spec(q_shape, dtype), _Spec(k_shape, dtype)
    run = engine.get(strategy, **options)
    fwd_bytes = run.forward_bytes(size, q, k, k, rank=rank, layout=layout, causal=causal)
    bwd_bytes = run.backward_bytes(size, q, k, k, rank=rank, layout=layout, causal=causal)
    it, acc = q.dtype.itemsize, accum_dtype(q.dtype).itemsize
    node = size <= machine.ranks_per_node
    step = machine.step_overhead

    def ring(g: int, rows: int, heads: int, kv_heads: int, local: bool) -> tuple[float, float]:
        """(forward, backward) of the burst ring over g ranks of `rows` rows each."""
        frac = _critical_fraction(causal, layout, g)
        block = 4 * b * heads * rows * rows * d / machine.flops
        kv_bytes = 2 * b * rows * kv_heads * d * it
        bundle = 2 * b * rows * heads * d * it + 2 * b * heads * rows * acc
        dq = b * rows * heads * d * acc
        tc_f, tc_b = step + frac * block, step + 2.5 * frac * block
        if g == 1:
            return tc_f, tc_b
        tm_f = _transfer(machine, kv_bytes, local)
        tm_b = _transfer(machine, bundle + dq, local)
        return ((g - 1) * max(tc_f, tm_f) + tc_f,
                (g - 1) * max(tc_b, tm_b) + tc_b + _transfer(machine, dq, local))

    if strategy == "burst":
        fwd, bwd = ring(size, s, h, hkv, node)
    elif strategy == "ring":
        frac = _critical_fraction(causal, layout, size)
        block = 4 * b * h * s * s * d / machine.flops
        kv = b * s * hkv * d
        tc_f, tc_b = step + frac * block, step + 2.5 * frac * block
        tm_f = _transfer(machine, 2 * kv * it, node) + machine.latency        # two messages
        tm_b = _transfer(machine, 2 * kv * it + 2 * kv * acc, node) + 3 * machine.latency
        fwd = (size - 1) * max(tc_f, tm_f) + tc_f
        bwd = (size - 1) * max(tc_b, tm_b) + tc_b + (_transfer(machine, 2 * kv * acc, node)
                                                     if size > 1 else 0.0)
    elif strategy == "allgather":
        frac = _critical_fraction(causal, layout, size)
        block = 4 * b * h * s * s * d / machine.flops
        kv = b * s * hkv * d
        gather = (size - 1) * _transfer(machine, 2 * kv * it, node)
        fwd = gather + size * (step + frac * block)
        bwd = gather + size * (step + 2.5 * frac * block) + (size - 1) * _transfer(machine, 2 * kv * acc, node)
    elif strategy == "ulysses":
        n, hg = size * s, h // size
        full = (0.5 if causal else 1.0) * 4 * b * hg * n * n * d / machine.flops
        fwd = 2 * _transfer(machine, fwd_bytes / 2, node) + step + full
        bwd = 2 * _transfer(machine, bwd_bytes / 2, node) + step + 2.5 * full
    elif strategy == "usp":
        u = run.degree(size, h, hkv)
        r = size // u
        hg, hk = h // u, engine.ulysses.kv_heads(0, u, h, hkv)[1]
        a2a_f = (u - 1) * b * s * ((hg + 2 * hk) * d * it + hg * (acc + d * it))
        a2a_b = (u - 1) * b * s * (hg * (2 * acc + 2 * d * it) + 2 * hk * d * it + (hg + 2 * hk) * d * it)
        ring_f, ring_b = ring(r, u * s, hg, hk, node)
        within = u <= machine.ranks_per_node
        fwd = 2 * _transfer(machine, a2a_f / 2, within) + ring_f
        bwd = 2 * _transfer(machine, a2a_b / 2, within) + ring_b
    else:
        raise ValueError(f"no model for strategy {strategy!r}")
    return Candidate(strategy, dict(options), fwd, bwd, fwd_bytes, bwd_bytes)


def candidates(q_shape, k_shape, size: int) -> list[tuple[str, dict]]:
    """Every (strategy, options) that can take these shapes on `size` ranks, burst first."""
    out = [("burst", {}), ("ring", {}), ("allgather", {})]
    if engine.get("ulysses").input_problem(q_shape, k_shape, size) is None and size > 1:
        out.append(("ulysses", {}))
    for u in range(2, size):
        usp = engine.get("usp", ulysses_degree=u)
        if u <= 8 and usp.input_problem(q_shape, k_shape, size) is None:
            out.append(("usp", {"ulysses_degree": u}))
    return out


def plan(q_shape, k_shape, group=None, *, causal: bool = False, layout: str = "contiguous",
         dtype="float16", backward: bool = True, machine: Machine | str | None = None) -> Plan:
    """The PREDICTED best strategy for attention of q (B, S, H, D) over k, v (B, S, Hkv, D) —
    each rank's shard — on `group` (None: one rank), and the predictions it was chosen from.

    machine: a Machine, a name in MACHINES, or None for the backend's default ("h100" for CuPy,
    "cpu" otherwise). Deterministic in its arguments, so every rank makes the same choice.
    """
    size = 1 if group is None else group.size
    if machine is None:
        machine = "h100" if group is not None and getattr(group.ops, "backend", "") == "cupy" else "cpu"
    if isinstance(machine, str):
        machine = MACHINES[machine]
    rank = getattr(group, "rank", 0)
    preds = [predict(name, opts, q_shape, k_shape, size, causal=causal, layout=layout,
                     dtype=dtype, machine=machine, rank=rank)
             for name, opts in candidates(q_shape, k_shape, size)]
    order = sorted(range(len(preds)), key=lambda i: (preds[i].forward_s
                                                      + (preds[i].backward_s if backward else 0.0), i))
    b, s, h, d = (int(n) for n in q_shape)
    return Plan([preds[i] for i in order], machine, backward, (size, b, s, h, int(k_shape[2]), d))


__all__ = ["Machine", "MACHINES", "Candidate", "Plan", "plan", "predict", "candidates"]
