"""strategy="auto": a cost model of every strategy, and the choice it makes.

`plan(q_shape, k_shape, group, causal=..., layout=..., dtype=...)` predicts the time of one
forward and one backward pass of every strategy that can take the shapes (burst, ring,
allgather, ulysses, and usp for every Ulysses degree u > 1 that works and fits a node) on a
`Machine`, and picks the one with the smallest predicted forward + backward time (forward only
with backward=False); ties go to the earlier candidate, burst first. The result prints as a table.
Every figure is a PREDICTION of this model, not a measurement (bench/plan_check.py compares the
pick with the measured best on the CPU).

The model (per rank; B batch, H / Hkv heads, D head dim, it / acc the input and accumulation
itemsizes; bytes are the engines' exact formulas, `burstcu.engine`):
    compute   t = step_overhead * calls + 4 B H D * pairs / machine.flops for one step of the
              local op forward (2.5 times the flops backward: S^2 recomputed, dV, dP, dQ, dK),
              where pairs are the (query, key) pairs the mask keeps and calls the rectangles
              (`burstcu.layout.blocks`, counted exactly per rank and step: causal, windows,
              documents and uneven shards all show), the overhead being host work and launches.
    messages  t(bytes) = latency + bytes / bandwidth for each ring exchange and for each
              all-to-all (its messages go out together), with the intra-node bandwidth when the
              ranks that talk share a node (machine.ranks_per_node), else the inter-node one.
    burst     per step, the busiest rank's max(compute, transfer) (the transfer hides behind
              the step's compute), summed over the steps (+ dQ's hop home in the backward);
              blocks and bundles that stop early (`burst.travels`, `bundle_hops`) send nothing;
              ring: the same with its messages and no skipping; allgather: gather, then the
              busiest rank's compute (no overlap; backward adds the reduce-scatter); ulysses:
              all-to-all in + compute over the whole sequence for H/G heads + all-to-all out;
              usp(u): the all-to-alls inside groups of u (intra-node) around a burst ring over
              the G/u groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from . import engine
from .layout import Partition, as_partition, blocks, grouped, partition
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


def _kept_pairs(block) -> int:
    """(query, key) pairs of a `burstcu.layout.Block` that its mask keeps, counted exactly."""
    if not block.masked:
        return block.q_len * block.k_len
    q = block.q_pos + np.arange(block.q_len, dtype=np.int64)
    upper = np.full(q.shape, block.k_pos + block.k_len - 1, np.int64)
    lower = np.full(q.shape, block.k_pos, np.int64)
    if block.causal:
        upper = np.minimum(upper, q)
    if block.right >= 0:
        upper = np.minimum(upper, q + block.right)
    if block.left >= 0:
        lower = np.maximum(lower, q - block.left)
    return int(np.maximum(upper - lower + 1, 0).sum())


@lru_cache(maxsize=64)
def _work(part: Partition, causal: bool, window, docs) -> tuple[np.ndarray, np.ndarray]:
    """(pairs, calls), each (G, G): kept (query, key) pairs of rank i's queries over rank j's
    keys, and the rectangles (local-op calls) they take."""
    g = part.size
    pairs, calls = np.zeros((g, g), np.int64), np.zeros((g, g), np.int64)
    for i in range(g):
        for j in range(g):
            rects = blocks(part, i, j, causal, window, docs)
            pairs[i, j] = sum(_kept_pairs(r) for r in rects)
            calls[i, j] = len(rects)
    return pairs, calls


def _transfer(machine: Machine, nbytes: float, local: bool) -> float:
    """One exchange (or one all-to-all, whose messages go out together)."""
    bw = machine.intra_bw if local else machine.inter_bw
    return machine.latency + nbytes / bw


def predict(strategy: str, options: dict, q_shape, k_shape, size: int, *, causal: bool,
            layout: str | Partition, dtype, machine: Machine, rank: int = 0,
            window=(-1, -1), docs=None) -> Candidate:
    """PREDICTED forward and backward seconds of `strategy` (see the module docstring); bytes
    are those `rank` sends (burst and usp skip hops under some masks). layout: a name (every
    rank holding q_shape's S rows) or a `burstcu.layout.Partition`; window and docs (document
    boundaries) as `burstcu.attention` takes them."""
    b, s, h, d = (int(n) for n in q_shape)
    hkv = int(k_shape[2])
    q, k = _Spec(q_shape, dtype), _Spec(k_shape, dtype)
    part = as_partition(layout, size, s)
    mask = (bool(causal), tuple(int(w) for w in window), docs)
    run = engine.get(strategy, **options)
    formula = dict(rank=rank, layout=part, causal=mask[0], window=mask[1], docs=docs)
    fwd_bytes = run.forward_bytes(size, q, k, k, **formula)
    bwd_bytes = run.backward_bytes(size, q, k, k, **formula)
    it, acc = q.dtype.itemsize, accum_dtype(q.dtype).itemsize
    node = size <= machine.ranks_per_node
    step = machine.step_overhead
    flop_s = 4 * b * d / machine.flops          # seconds per kept pair and query head, forward

    def compute(pairs, calls, heads: int, factor: float = 1.0):
        """Seconds of the local op for these pairs and calls (0 where there is nothing)."""
        return np.where(calls > 0, step * calls + factor * flop_s * heads * pairs, 0.0)

    def ring(p: Partition, heads: int, kv_heads: int, local: bool, skipping: bool = True,
             messages: str = "burst") -> tuple[float, float]:
        """(forward, backward) of a ring over p's ranks: per step the busiest rank's
        max(compute, transfer) (the transfer hides behind the step's compute)."""
        g, lengths = p.size, p.lengths
        pairs, calls = _work(p, *mask)
        fwd = bwd = 0.0
        if messages == "burst":
            d_ = engine.burst._direction(p, *mask)
        for t in range(g):
            tf, tb = [], []
            for r in range(g):
                src = (r - t) % g
                sends = t < g - 1 and (not skipping or engine.burst.travels(r, t, p, *mask))
                kv = 2 * b * lengths[src] * kv_heads * d * it
                if messages == "burst":
                    tm = _transfer(machine, kv, local) if sends else 0.0
                    j = (r - d_ * t) % g                         # the bundle held backward
                    hops = engine.burst._bundle_hops(j, p, *mask)
                    rows = lengths[j]
                    held_b = t <= hops
                    bundle = 2 * b * rows * heads * (d * it + acc) + b * rows * heads * d * acc
                    tmb = _transfer(machine, bundle, local) if t < hops else 0.0
                    cb = compute(pairs[j, r], calls[j, r], heads, 2.5) if held_b else 0.0
                else:                                            # ring: two messages a pass
                    tm = _transfer(machine, kv, local) + machine.latency if sends else 0.0
                    tmb = (_transfer(machine, kv + 2 * b * lengths[src] * kv_heads * d * acc, local)
                           + 3 * machine.latency) if t < g - 1 else 0.0
                    cb = compute(pairs[r, src], calls[r, src], heads, 2.5)
                tf.append(max(float(compute(pairs[r, src], calls[r, src], heads)), tm))
                tb.append(max(float(cb), tmb))
            fwd, bwd = fwd + max(tf), bwd + max(tb)
        if g > 1:                                                # the last dQ / dK, dV home
            home = b * max(lengths) * (heads * d if messages == "burst" else 2 * kv_heads * d) * acc
            bwd += _transfer(machine, home, local)
        return fwd, bwd

    if strategy in ("burst", "ring"):
        fwd, bwd = ring(part, h, hkv, node, skipping=strategy == "burst", messages=strategy)
    elif strategy == "allgather":
        pairs, calls = _work(part, *mask)
        gather = (size - 1) * _transfer(machine, 2 * b * max(part.lengths) * hkv * d * it, node)
        scatter = (size - 1) * _transfer(machine, 2 * b * max(part.lengths) * hkv * d * acc, node)
        fwd = gather + float(compute(pairs, calls, h).sum(axis=1).max())
        bwd = gather + float(compute(pairs, calls, h, 2.5).sum(axis=1).max()) + scatter
    elif strategy == "ulysses":
        whole = as_partition("contiguous", 1, part.total)
        pairs, calls = _work(whole, *mask)
        hg = h // size
        # the busiest rank's bytes (the same figure on every rank, so every rank picks alike)
        most_f, most_b = (max(f(size, q, k, k, **(formula | {"rank": r})) for r in range(size))
                          for f in (run.forward_bytes, run.backward_bytes))
        fwd = 2 * _transfer(machine, most_f / 2, node) + float(compute(pairs, calls, hg)[0, 0])
        bwd = 2 * _transfer(machine, most_b / 2, node) + float(compute(pairs, calls, hg, 2.5)[0, 0])
    elif strategy == "usp":
        u = run.degree(size, h, hkv)
        hg, hk = h // u, engine.ulysses.kv_heads(0, u, h, hkv)[1]
        a2a_f = (u - 1) * b * s * ((hg + 2 * hk) * d * it + hg * (acc + d * it))
        a2a_b = (u - 1) * b * s * (hg * (2 * acc + 2 * d * it) + 2 * hk * d * it + (hg + 2 * hk) * d * it)
        ring_f, ring_b = ring(grouped(part, u), hg, hk, node)
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


def plan(q_shape, k_shape, group=None, *, causal: bool = False,
         layout: str | Partition = "contiguous", dtype="float16", backward: bool = True,
         machine: Machine | str | None = None, window_size=(-1, -1), cu_seqlens=None) -> Plan:
    """The PREDICTED best strategy for attention of q (B, S, H, D) over k, v (B, S, Hkv, D) —
    each rank's shard — on `group` (None: one rank), and the predictions it was chosen from.
    The mask (causal, window_size, cu_seqlens: document boundaries) counts exactly what each
    rank computes at each step and what burst's ring skips; layout may be a
    `burstcu.layout.Partition` (uneven shards).

    machine: a Machine, a name in MACHINES, or None for the backend's default ("h100" for CuPy,
    "cpu" otherwise). Deterministic in its arguments, so every rank makes the same choice.
    """
    size = 1 if group is None else group.size
    if machine is None:
        machine = "h100" if group is not None and getattr(group.ops, "backend", "") == "cupy" else "cpu"
    if isinstance(machine, str):
        machine = MACHINES[machine]
    rank = getattr(group, "rank", 0)
    docs = None if cu_seqlens is None else tuple(int(x) for x in cu_seqlens)
    if layout == "zigzag" and docs is not None:     # every document in 2G pieces, as shard cuts
        layout = partition("zigzag", size, docs[-1], docs)
    preds = [predict(name, opts, q_shape, k_shape, size, causal=causal, layout=layout,
                     dtype=dtype, machine=machine, rank=rank, window=window_size, docs=docs)
             for name, opts in candidates(q_shape, k_shape, size)]
    order = sorted(range(len(preds)), key=lambda i: (preds[i].forward_s
                                                      + (preds[i].backward_s if backward else 0.0), i))
    b, s, h, d = (int(n) for n in q_shape)
    return Plan([preds[i] for i in order], machine, backward, (size, b, s, h, int(k_shape[2]), d))


__all__ = ["Machine", "MACHINES", "Candidate", "Plan", "plan", "predict", "candidates"]
