"""strategy="auto": a cost model of every strategy, and the choice it makes.

`plan(q_shape, k_shape, group, causal=..., layout=..., dtype=...)` predicts the time of one
forward and one backward pass of every strategy that can take the shapes (burst, ring,
allgather, ulysses, and usp for every Ulysses degree 1 < u < G, u <= 8 (a node's GPUs), that works) on a
`Machine`, and picks the one with the smallest predicted forward + backward time (forward only
with backward=False); ties go to the earlier candidate, burst first. The result prints as a table.
Every figure is a PREDICTION of this model, not a measurement (bench/model/plan_check.py compares the
pick with the measured best on the CPU).

The model (per rank; B batch, H / Hkv heads, D head dim, it / acc the input and accumulation
itemsizes; bytes are the engines' exact formulas, `burstcu.engine`):
    compute   t = step_overhead * calls + 4 B H D * pairs / machine.flops for one step of the
              local op forward (2.5 times the flops backward: S^2 recomputed, dV, dP, dQ, dK),
              where pairs are the (query, key) pairs the mask keeps and calls the rectangles
              (`burstcu.layout.blocks`, counted exactly per rank and step: causal, windows,
              documents and uneven shards all show), the overhead being host work and launches;
              on a machine whose kernels take a step's rectangles in one call (step_lists: the
              GPU presets, the CUDA backends' list kernels) the forward counts one call a step
              of more than LISTED_ABOVE rectangles, the backward one a step of more than one.
    messages  t(bytes) = latency + bytes / bandwidth for each ring exchange and for each
              all-to-all (its messages go out together; one latency more for each further
              message of an exchange), with the intra-node bandwidth when the ranks that talk
              share a node (machine.ranks_per_node), else the inter-node one.
    burst     per step, the busiest rank's max(compute, transfer) (the transfer hides behind
              the step's compute), summed over the steps (+ dQ's hop home in the backward);
              blocks and bundles that stop early send nothing (the strategy's own schedule,
              `burst.forward_steps` / `backward_steps`, says which rank sends what at each step);
              burst bidirectional=True (its K/V blocks split both ways round where the
              cheapest trips tie: `burst.kv_hops`; fewer steps, two messages a step through
              the one port) is a candidate only where it is predicted faster forward than burst;
              ring: the same with its messages and no skipping; allgather: gather, then the
              busiest rank's compute (no overlap; backward adds the reduce-scatter); ulysses:
              all-to-all in + compute over the whole sequence for H/G heads + all-to-all out;
              usp(u): the all-to-alls inside groups of u (intra-node) around a burst ring over
              the G/u groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from . import engine
from .engine import burst, steps, ulysses
from .engine.decode import decode_bytes
from .group import not_a_group, says_ranks
from .layout import Partition, as_partition, blocks, grouped, kept_pairs, partition
from .ops.base import as_dtype
from .validate import (check_block_mask, check_block_mask_extent, check_docs_total, check_flags,
                       check_window, parse_cu_seqlens, sharding_keywords)


BACKWARD_FLOPS = 2.5  # the backward's flops over the forward's: S recomputed, dV, dP, dQ, dK
# a forward step of at most this many rectangles runs them a launch each on an H100/H200 (the
# Hopper kernel: burstcu.ops.cuda.kernel_ops.SM90_MAX_RECTS), a longer one as one list
LISTED_ABOVE = 4


@dataclass(frozen=True)
class Machine:
    """What the model assumes of the hardware. flops: attention flop/s the local op sustains;
    intra_bw / inter_bw: bytes/s one way per rank inside / across nodes; latency: seconds per
    exchange; ranks_per_node: ranks that share the fast links; step_overhead: seconds of fixed
    cost per call of the local op (forward or backward step); memory_bw: bytes/s the local op
    reads from its memory (decode's bound); step_lists: the forward takes a step of more than
    LISTED_ABOVE rectangles in one call (the CUDA backends' rectangle-list kernel), so such a step
    costs one step_overhead forward however many documents cut it (a step of fewer: one a
    rectangle, as the Hopper kernel runs them), and the backward any step of more than one
    rectangle (flash_bwd_dkdv_steps / flash_bwd_dq_steps)."""

    name: str
    flops: float
    intra_bw: float
    inter_bw: float
    latency: float
    ranks_per_node: int
    source: str
    step_overhead: float = 0.0
    memory_bw: float = 0.0
    step_lists: bool = False


MACHINES = {
    # ASSUMED round figures for the NumPy backend on a few cores with shared-memory MPI; measure
    # them for a real choice (bench/model/plan_check.py does)
    "cpu": Machine("cpu", 2e10, 2e9, 2e9, 2e-4, 1 << 30, "ASSUMED: NumPy/BLAS on a few cores, "
                   "MPI over shared memory", step_overhead=8e-4, memory_bw=2e10),
    # vendor peaks (H100 SXM5: 989 TF dense BF16; NVLink 4: 450 GB/s each way; NDR InfiniBand:
    # 50 GB/s each way a GPU) times ASSUMED efficiencies: 40% of peak, 80% of the links
    "h100": Machine("h100", 989e12 * 0.4, 450e9 * 0.8, 50e9 * 0.8, 1e-5, 8,
                    "H100 SXM5 + NVLink 4 + NDR InfiniBand datasheets; ASSUMED 40% MFU, 80% links, "
                    "10 us a message, 20 us a step; HBM3 3.35 TB/s at 80%", step_overhead=2e-5,
                    memory_bw=3350e9 * 0.8, step_lists=True),
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
    rank: int = 0   # whose bytes the candidates count (the ranks send different amounts)

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
                 f"{'strategy':24s} {'forward':>10s} {'backward':>10s} {'fwd bytes':>12s} {'bwd bytes':>12s}"
                 f"  (bytes rank {self.rank} sends)"]
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


@lru_cache(maxsize=16)   # keyed by partitions: a few (`layout.PARTITIONS_KEPT`)
def _work(part: Partition, causal: bool, window_size, cu_seqlens,
          block_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """(pairs, calls), each (G, G): kept (query, key) pairs of rank i's queries over rank j's
    keys, and the rectangles (local-op calls) they take."""
    g = part.size
    pairs, calls = np.zeros((g, g), np.int64), np.zeros((g, g), np.int64)
    for i in range(g):
        for j in range(g):
            rects = blocks(part, i, j, causal, window_size, cu_seqlens, block_mask)
            pairs[i, j] = kept_pairs(rects)
            calls[i, j] = len(rects)
    return pairs, calls


@dataclass(frozen=True)
class _Problem:
    """What one prediction is for: this rank's q and k (`_Spec`s, (B, S, H, D) and
    (B, S, Hkv, D)) on `size` ranks, the mask (causal, window_size, cu_seqlens, block_mask as
    `engine.steps.mask_key` gives it), the machine; and what a step of it costs there."""

    q: _Spec
    k: _Spec
    size: int
    rank: int
    mask: tuple
    machine: Machine

    @property
    def node(self) -> bool:
        """Whether all ranks share a node (the intra-node links)."""
        return self.size <= self.machine.ranks_per_node

    def spec(self, heads: int, rows: int | None = None) -> _Spec:
        """q's shape and dtype with `heads` heads (a group's heads: usp; kv heads: for k), and
        `rows` rows (another rank's shard) in place of this rank's."""
        b, s, _, d = self.q.shape
        return _Spec((b, s if rows is None else rows, heads, d), self.q.dtype)

    def formula(self, layout) -> dict:
        """The keywords of the strategies' byte and message counts for this rank and mask."""
        causal, window_size, cu_seqlens, block_mask = self.mask
        return dict(rank=self.rank, layout=layout, causal=causal, window_size=window_size,
                    cu_seqlens=cu_seqlens, block_mask=block_mask)

    def compute(self, pairs, calls, heads: int, backward: bool = False):
        """Seconds of the local op for these kept pairs and calls (rectangles) of `heads` query
        heads (0 where there is nothing): a fixed cost a call (on a machine with step_lists:
        one a step of more than LISTED_ABOVE forward, of more than one backward), and 4 B D
        flops a pair and head forward (2.5 times that backward)."""
        b, _, _, d = self.q.shape
        flop_s = 4 * b * d / self.machine.flops      # seconds per kept pair and query head
        if self.machine.step_lists:
            calls = np.where(calls > (1 if backward else LISTED_ABOVE), 1, calls)
        factor = BACKWARD_FLOPS if backward else 1.0
        return np.where(calls > 0, self.machine.step_overhead * calls
                        + factor * flop_s * heads * pairs, 0.0)

    def transfer(self, nbytes: float, local: bool, messages: int = 1) -> float:
        """Seconds of `messages` messages of `nbytes` in all, posted together (an exchange, or
        an all-to-all): a latency each, and the bytes at the intra- or inter-node bandwidth."""
        machine = self.machine
        bw = machine.intra_bw if local else machine.inter_bw
        return machine.latency + nbytes / bw + (messages - 1) * machine.latency


def _ring_seconds(problem: _Problem, part: Partition, forward_step, backward_step,
                  home_bytes: int, local: bool) -> tuple[float, float]:
    """(forward, backward) seconds of a ring schedule over part's ranks (burst's or the classic
    ring's): per step the busiest rank's seconds, summed over the steps, then the last
    gradients' hop home. forward_step(r, t), backward_step(r, t): rank r's seconds at step t,
    max(compute, transfer) (the transfer hides behind the step's compute)."""
    g = part.size
    fwd = bwd = 0.0
    for t in range(g):
        fwd += max(forward_step(r, t) for r in range(g))
        bwd += max(backward_step(r, t) for r in range(g))
    if g > 1:
        bwd += problem.transfer(home_bytes, local)
    return fwd, bwd


def _burst_seconds(problem: _Problem, part: Partition, heads: int, kv_heads: int,
                   local: bool, bidirectional: bool = False) -> tuple[float, float]:
    """burst's ring over part's ranks with these heads: each step's K/V blocks (the one that
    came forwards, the one that came backwards: `burst.kv_hops` under this tie rule) and
    backward bundle (with its dQ) sent only where the schedule (`burst.forward_steps`,
    `backward_steps`) passes them on; a step's messages leave through one port, one after the
    other (as the emulated link paces them)."""
    pairs, calls = _work(part, *problem.mask)
    q, k = problem.spec(heads), problem.spec(kv_heads)
    lengths = part.lengths
    kv_row = steps.kv_row_bytes(k, k)
    bundle_row = burst.bundle_row_bytes(q) + burst.dq_row_bytes(q)
    forward_steps = [burst.forward_steps(r, part, *problem.mask, bidirectional=bidirectional)
                     for r in range(part.size)]
    backward_steps = [burst.backward_steps(r, part, *problem.mask) for r in range(part.size)]

    def forward_step(r: int, t: int) -> float:
        step = forward_steps[r][t]
        held = [j for j, h in ((step.source, step.held), (step.back_source, step.back_held)) if h]
        sent = [j for j, s in ((step.source, step.sends), (step.back_source, step.sends_back)) if s]
        work = sum(float(problem.compute(pairs[r, j], calls[r, j], heads)) for j in held)
        rows = sum(lengths[j] for j in sent)
        return max(work, problem.transfer(rows * kv_row, local, len(sent)) if sent else 0.0)

    def backward_step(r: int, t: int) -> float:
        step = backward_steps[r][t]
        j = step.bundle
        sent = problem.transfer(lengths[j] * bundle_row, local) if step.passes_on else 0.0
        work = problem.compute(pairs[j, r], calls[j, r], heads, backward=True) if step.held else 0.0
        return max(float(work), sent)

    home = max(lengths) * burst.dq_row_bytes(q)
    return _ring_seconds(problem, part, forward_step, backward_step, home, local)


def _burst_model(problem: _Problem, run, part: Partition) -> tuple[float, float]:
    """burst: the ring over every rank, all heads (its K/V both ways round when `run` is
    bidirectional)."""
    return _burst_seconds(problem, part, problem.q.shape[2], problem.k.shape[2], problem.node,
                          getattr(run, "bidirectional", False))


def _ring_model(problem: _Problem, run, part: Partition) -> tuple[float, float]:
    """Ring Attention: every block goes all the way round, K and V as two messages, and backward
    K, V and dK, dV as four."""
    pairs, calls = _work(part, *problem.mask)
    h, hkv, g, lengths = problem.q.shape[2], problem.k.shape[2], part.size, part.lengths
    k = problem.spec(hkv)
    kv_row, grad_row = steps.kv_row_bytes(k, k), steps.grad_row_bytes(k, k)

    def forward_step(r: int, t: int) -> float:
        src = (r - t) % g
        sent = problem.transfer(lengths[src] * kv_row, problem.node, 2) if t < g - 1 else 0.0
        return max(float(problem.compute(pairs[r, src], calls[r, src], h)), sent)

    def backward_step(r: int, t: int) -> float:
        src = (r - t) % g
        sent = (problem.transfer(lengths[src] * (kv_row + grad_row), problem.node, 4)
                if t < g - 1 else 0.0)
        return max(float(problem.compute(pairs[r, src], calls[r, src], h, backward=True)), sent)

    home = max(lengths) * grad_row
    return _ring_seconds(problem, part, forward_step, backward_step, home, problem.node)


def _allgather_model(problem: _Problem, run, part: Partition) -> tuple[float, float]:
    """allgather: the gather, then the busiest rank's compute (no overlap); backward adds the
    reduce-scatter."""
    pairs, calls = _work(part, *problem.mask)
    h, size, longest = problem.q.shape[2], problem.size, max(part.lengths)
    k = problem.spec(problem.k.shape[2])
    gather = (size - 1) * problem.transfer(longest * steps.kv_row_bytes(k, k), problem.node)
    scatter = (size - 1) * problem.transfer(longest * steps.grad_row_bytes(k, k), problem.node)
    fwd = gather + float(problem.compute(pairs, calls, h).sum(axis=1).max())
    bwd = gather + float(problem.compute(pairs, calls, h, backward=True).sum(axis=1).max()) + scatter
    return fwd, bwd


def _all_to_all_bytes(problem: _Problem, part: Partition, u: int) -> tuple[int, int]:
    """The most bytes a rank sends in its group's Ulysses all-to-alls, (forward, backward): groups
    of u consecutive ranks of `part`, each member with its own shard's rows (the same figure on
    every rank, so every rank picks alike)."""
    h, hkv = problem.q.shape[2], problem.k.shape[2]
    most_f = most_b = 0
    for first in range(0, part.size, u):
        members = Partition(part.layout, part.runs[first:first + u])
        for j, rows in enumerate(members.lengths):
            q, k = problem.spec(h, rows), problem.spec(hkv, rows)
            most_f = max(most_f, ulysses.forward_bytes(u, q, k, k, rank=j, layout=members))
            most_b = max(most_b, ulysses.backward_bytes(u, q, k, k, rank=j, layout=members))
    return most_f, most_b


def _ulysses_model(problem: _Problem, run, part: Partition) -> tuple[float, float]:
    """ulysses: all-to-all in + compute over the whole sequence for H/G heads + all-to-all out,
    at the busiest rank's bytes."""
    whole = as_partition("contiguous", 1, part.total)
    pairs, calls = _work(whole, *problem.mask)
    hg = problem.q.shape[2] // problem.size
    most_f, most_b = _all_to_all_bytes(problem, part, problem.size)
    fwd = (2 * problem.transfer(most_f / 2, problem.node)
           + float(problem.compute(pairs, calls, hg)[0, 0]))
    bwd = (2 * problem.transfer(most_b / 2, problem.node)
           + float(problem.compute(pairs, calls, hg, backward=True)[0, 0]))
    return fwd, bwd


def _usp_model(problem: _Problem, run, part: Partition) -> tuple[float, float]:
    """usp(u): the all-to-alls inside groups of u (intra-node when a group fits a node) around
    burst's ring over the G/u groups."""
    h, hkv = problem.q.shape[2], problem.k.shape[2]
    u = run.degree(problem.size, h, hkv)
    hg, hk = h // u, ulysses.kv_heads(0, u, h, hkv)[1]
    # backward: lse, delta, q, dO, k, v in; dq, dk, dv back in the accumulation dtype
    a2a_f, a2a_b = _all_to_all_bytes(problem, part, u)
    ring_f, ring_b = _burst_seconds(problem, grouped(part, u), hg, hk, problem.node)
    within = u <= problem.machine.ranks_per_node
    fwd = 2 * problem.transfer(a2a_f / 2, within) + ring_f
    bwd = 2 * problem.transfer(a2a_b / 2, within) + ring_b
    return fwd, bwd


_MODELS = {"burst": _burst_model, "ring": _ring_model, "allgather": _allgather_model,
           "ulysses": _ulysses_model, "usp": _usp_model}


def predict(strategy: str, options: dict, q_shape, k_shape, size: int, *, causal: bool,
            layout: str | Partition, dtype, machine: Machine, rank: int = 0,
            window_size=(-1, -1), cu_seqlens=None, block_mask=None) -> Candidate:
    """PREDICTED forward and backward seconds of `strategy` (see the module docstring); bytes
    are those `rank` sends (burst and usp skip hops under some masks). layout: a name (every
    rank holding q_shape's S rows) or a `burstcu.layout.Partition`; window_size, cu_seqlens
    (document boundaries) and block_mask as `burstcu.attention` takes them."""
    run = engine.get(strategy, **options)
    if strategy not in _MODELS:
        raise ValueError(f"no model for strategy {strategy!r}")
    q, k = _Spec(q_shape, dtype), _Spec(k_shape, dtype)
    problem = _Problem(q, k, size, rank,
                       steps.mask_key(causal, window_size, cu_seqlens, block_mask), machine)
    part = as_partition(layout, size, q.shape[1])
    formula = problem.formula(part)
    fwd, bwd = _MODELS[strategy](problem, run, part)
    return Candidate(strategy, dict(options), fwd, bwd, run.forward_bytes(size, q, k, k, **formula),
                     run.backward_bytes(size, q, k, k, **formula))


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


def _shapes_problem(q_shape, k_shape) -> str | None:
    """What `attention` would refuse of q (B, S, H, D) and k (B, S, Hkv, D) shapes, or None."""
    (b, s, h, d), (bk, sk, hkv, dk) = q_shape, k_shape
    if min(b, s, h, d, bk, sk, hkv, dk) < 1:
        return f"empty dimension in q {q_shape} or k {k_shape}"
    if (bk, sk, dk) != (b, s, d):
        return f"q {q_shape} and k {k_shape} differ in batch, length or head dim"
    if h % hkv:
        return f"q has {h} heads, k has {hkv}: nheads must be a multiple of nheads_kv"
    return None


def plan(q_shape, k_shape, group=None, *, causal: bool = False,
         layout: str | Partition | None = None, dtype="float16", backward: bool = True,
         machine: Machine | str | None = None, window_size=(-1, -1), cu_seqlens=None,
         block_mask=None, seqlen: int | None = None) -> Plan:
    """The PREDICTED best strategy for attention of q (B, S, H, D) over k, v (B, S, Hkv, D) —
    each rank's shard — on `group` (None: one rank), and the predictions it was chosen from.
    The mask (causal, window_size, cu_seqlens: document boundaries; or a `burstcu.BlockMask`,
    block_mask) counts exactly what each
    rank computes at each step and what burst's ring skips; layout may be a
    `burstcu.layout.Partition` (uneven shards). group may be a `burstcu.Sharding`, which then
    supplies layout, cu_seqlens and uneven lengths. Packed shapes (T, H, D) count as batch 1.

    seqlen: the global number of positions N, for a layout name whose shards differ in length
    (N not a multiple of G: near-equal shards); this rank's S must be what the layout gives it.
    Without it (and without documents, lengths or a Partition, which give N) each rank models
    G x its own S, or, where that cannot hold the block mask, the mask's extent if the layout's
    split of it gives this rank S rows. Nothing is sent: ranks holding different S may then
    predict a little differently (pass seqlen), and a mask or seqlen that no split of N allows
    may be refused on some ranks only (the ranks whose S shows it, saying what to pass; shards
    of other lengths, such as `shard(..., block_mask=mask)` cuts, need their lengths: a
    Sharding or a Partition). Documents, a window and a
    block mask are checked as `attention` checks them: what it refuses, plan refuses.

    machine: a Machine, a name in MACHINES, or None for the backend's default ("h100" for CuPy,
    "cpu" otherwise). Deterministic in its arguments, so every rank given the same arguments
    and the same split makes the same choice.
    """
    problem = (None if len(q_shape) == len(k_shape) in (3, 4) else
               f"q and k shapes must both be (B, S, H, D) or packed (T, H, D), got {tuple(q_shape)} "
               f"and {tuple(k_shape)}")
    q_shape, k_shape = ((1,) + tuple(x) if len(x) == 3 else tuple(x) for x in (q_shape, k_shape))
    problem = problem or _shapes_problem(q_shape, k_shape)
    if problem is not None:
        raise ValueError(f"plan: {problem}")
    given = dtype
    try:
        dtype = None if dtype is None else as_dtype(dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"plan: dtype must be float16, bfloat16, float32 or float64 (a name or a "
                        f"NumPy dtype), got {given!r}")
    group, layout, cu_seqlens, _, lengths, conflict = sharding_keywords(group, layout, cu_seqlens,
                                                                        None, block_mask)
    if conflict is not None:
        raise ValueError(f"plan(..., sharding) takes its layout and cu_seqlens from the Sharding: "
                         f"pass them only through it ({conflict})")
    if group is not None and not says_ranks(group, ("size",)):
        raise TypeError(f"plan: {not_a_group(group)}")
    flags = check_flags(causal=causal, backward=backward)
    if flags is not None:
        raise flags.exception()
    if lengths is not None:
        layout = partition("contiguous", group.size, sum(lengths), lengths=lengths)
    size = 1 if group is None else group.size
    if machine is None:
        machine = "h100" if getattr(getattr(group, "ops", None), "device", None) == "cuda" else "cpu"
    if isinstance(machine, str):
        if machine not in MACHINES:
            raise ValueError(f"plan: machine must be a Machine or one of {', '.join(MACHINES)}, "
                             f"not {machine!r}")
        machine = MACHINES[machine]
    rank = getattr(group, "rank", 0)
    err, cu_seqlens = parse_cu_seqlens(cu_seqlens)   # what attention refuses, plan refuses
    err = (err or check_window(window_size, causal, True)
           or check_block_mask(block_mask, causal, window_size, cu_seqlens, True))
    if err is not None:
        raise err.exception()
    named = not isinstance(layout, Partition)   # a Partition's S is the caller's (auto: the mean)
    if layout in ("zigzag", "documents") and cu_seqlens is not None:  # as shard cuts them
        layout = partition(layout, size, cu_seqlens[-1], cu_seqlens)
    if seqlen is not None and (isinstance(seqlen, bool) or not isinstance(seqlen, (int, np.integer))):
        raise TypeError(f"plan: seqlen must be an int (the global number of positions), got {seqlen!r}")
    if seqlen is not None and cu_seqlens is not None and seqlen != cu_seqlens[-1]:
        raise ValueError(f"plan: seqlen={seqlen} but cu_seqlens ends at {cu_seqlens[-1]}")
    if not isinstance(layout, Partition) and cu_seqlens is not None and \
            int(q_shape[1]) > cu_seqlens[-1] - (size - 1):   # what no split of N can give a rank
        raise ValueError(f"plan: cu_seqlens ends at N = {cu_seqlens[-1]}, but q has "
                         f"{int(q_shape[1])} rows on rank {rank}: no split of N over {size} ranks "
                         f"gives a rank more than N - {size - 1} (cu_seqlens holds the global "
                         f"documents' ends, as attention takes them, not this rank's)")
    if not isinstance(layout, Partition):
        layout = _modelled_split(layout, size, rank, int(q_shape[1]), seqlen,
                                 None if cu_seqlens is None else cu_seqlens[-1], block_mask)
    elif layout.size != size:
        raise ValueError(f"plan: the layout is a split over {layout.size} ranks, but the "
                         f"{'group' if group is not None else 'call (group=None)'} has {size}")
    elif seqlen is not None and seqlen != layout.total:
        raise ValueError(f"plan: seqlen={seqlen} but the split holds {layout.total} positions")
    if named and layout.lengths[rank] != int(q_shape[1]):
        raise ValueError(f"plan: the split of N = {layout.total} over {size} ranks gives rank "
                         f"{rank} {layout.lengths[rank]} rows, but q has {int(q_shape[1])}")
    # documents whose N a layout name's split of it cannot give this rank S: the call's shards
    # may be uneven on purpose (attention(..., uneven=True)), so plan models G x S and says nothing
    err = ((check_docs_total(cu_seqlens, layout.total) if not named or seqlen is not None else None)
           or check_block_mask_extent(block_mask, layout.total))
    if err is not None and named and seqlen is None and block_mask is not None \
            and block_mask.extent > layout.total:       # plan's own model of N, not the caller's
        raise ValueError(
            f"plan: block_mask reaches position {block_mask.extent - 1}, but plan models the "
            f"sequence as {size} x this rank's {int(q_shape[1])} rows = {layout.total} positions "
            f"(it sends nothing, so it knows no other rank's rows). " + (
                f"For contiguous shards of other lengths (burstcu.shard(x, group, "
                f"block_mask=mask) cuts them), pass the lengths: group=burstcu.Sharding(group, "
                f"lengths=mask.balanced_lengths({size}, N)) or a layout=burstcu.layout.Partition; "
                f"for near-equal shards, seqlen=N" if layout.layout == "contiguous" else
                f"For {layout.layout} shards of N positions, pass seqlen=N"))
    if err is not None:
        raise err.exception()
    how = dict(causal=causal, layout=layout, dtype=dtype, machine=machine, rank=rank,
               window_size=window_size, cu_seqlens=cu_seqlens, block_mask=block_mask)
    preds = [predict(name, opts, q_shape, k_shape, size, **how)
             for name, opts in candidates(q_shape, k_shape, size)]
    if size > 2:   # burst's K/V split both ways round: offered where the model says it wins
        both = predict("burst", {"bidirectional": True}, q_shape, k_shape, size, **how)
        one_way = next(p for p in preds if p.strategy == "burst" and not p.options)
        if both.forward_s < one_way.forward_s:
            preds.insert(1, both)
    order = sorted(range(len(preds)), key=lambda i: (preds[i].forward_s
                                                      + (preds[i].backward_s if backward else 0.0), i))
    b, s, h, d = (int(n) for n in q_shape)
    return Plan([preds[i] for i in order], machine, backward, (size, b, s, h, int(k_shape[2]), d), rank)


def _modelled_split(layout: str, size: int, rank: int, s: int, seqlen: int | None,
                    documents_end: int | None, block_mask) -> Partition:
    """The Partition `plan` models for a layout name and this rank's S rows: of `seqlen` when
    given (ValueError unless it gives this rank S rows); else of the documents' end (N itself)
    or, where G x S cannot hold the block mask, of the mask's extent, when that split gives this
    rank S rows; else of G x S. (Near-equal shards of an N that G does not divide: no rank can
    tell N from its S alone, and one of the shorter shards would model fewer positions than the
    mask reaches; contiguous shards of N may come in any order, so a rank whose S is another
    near-equal shard's models that one in its place.)"""
    if seqlen is not None:
        if seqlen < size:
            raise ValueError(f"plan: seqlen={seqlen} positions cannot be split over {size} ranks")
        part = partition(layout, size, int(seqlen))
        if part.lengths[rank] != s:
            raise ValueError(f"plan: the {layout} split of seqlen={seqlen} over {size} ranks gives "
                             f"rank {rank} {part.lengths[rank]} rows, but q has {s}")
        return part
    extent = 0 if block_mask is None else block_mask.extent
    n = documents_end if documents_end is not None else extent if extent > size * s else None
    if n is not None and n >= size:
        part = partition(layout, size, n)
        if part.lengths[rank] == s:
            return part
        if layout == "contiguous" and s in part.lengths:   # near-equal, this rank a shorter one
            lengths = list(part.lengths)                    # (or a longer one): any order runs
            j = lengths.index(s)
            lengths[rank], lengths[j] = lengths[j], lengths[rank]
            return partition(layout, size, n, lengths=tuple(lengths))
    return as_partition(layout, size, s)


# -- linear attention and decode ----------------------------------------------------------------

def linear_flops(b: int, c: int, h: int, hkv: int, d: int, tile: int = 128) -> tuple[float, float]:
    """(intra, inter) flops of one causal chunkwise linear-attention forward of c rows: the
    masked tile products (2 matmuls of c x tile x d, half of each kept) and the state products
    (Q M, K^T V)."""
    t = min(tile, c)
    intra = 2 * 2 * b * h * c * t * d * 0.5
    inter = 2 * b * h * c * d * d + 2 * b * hkv * c * d * d
    return intra, inter


def predict_linear(machine: Machine, size: int, seqlen: int, b: int, h: int, hkv: int, d: int,
                   itemsize: int) -> dict:
    """PREDICTED seconds of one causal linear-attention layer, forward + backward, per rank, on
    `size` ranks of `machine` for a global `seqlen`: LASP-2 (one all-gather of the D x D states a
    pass, overlapping the intra-chunk work), LASP-1 (the states passed rank to rank) and a ring
    of K, V as the baseline. The backward's compute counts twice the forward's; fp32 states."""
    bw = machine.inter_bw if size > machine.ranks_per_node else machine.intra_bw
    c = seqlen // size
    intra, inter = linear_flops(b, c, h, hkv, d)
    intra_s = intra / machine.flops
    compute = 3 * (intra + inter) / machine.flops
    state = b * hkv * d * d * 4
    rounds = machine.latency * max(1, (size - 1).bit_length())   # ceil(log2 G) latencies

    def gather(states: int) -> float:
        return rounds + (size - 1) * states * state / bw

    lasp2 = (compute + max(0.0, gather(1) - intra_s) + max(0.0, gather(2) - 2 * intra_s)
             + machine.step_overhead * 2)
    lasp1 = compute + 3 * (size - 1) * (machine.latency + state / bw) + machine.step_overhead * 2
    kv = 2 * b * hkv * c * d * itemsize
    per_step = compute / size
    ring = sum(max(per_step, machine.latency + kv / bw) for _ in range(size - 1)) * 2 + per_step * 2
    return {"lasp2_s": lasp2, "lasp1_s": lasp1, "ring_s": ring}


def predict_decode(machine: Machine, size: int, cache_len: int, b: int, h: int, hkv: int, d: int,
                   itemsize: int) -> dict:
    """PREDICTED seconds of one decode token on `size` ranks of `machine` over a cache of
    `cache_len` rows in all: each rank reads its K, V share at memory_bw, then the partials'
    all-gather (`engine.decode.decode_bytes`, ceil(log2 G) latencies). read_s, gather_s,
    token_s; bytes: what one rank sends."""
    bw = machine.inter_bw if size > machine.ranks_per_node else machine.intra_bw
    read = 2 * b * math.ceil(cache_len / size) * hkv * d * itemsize / machine.memory_bw
    sent = decode_bytes(size, np.empty((b, 1, h, d), np.float64 if itemsize == 8 else np.float16))
    gather = 0.0 if size == 1 else machine.latency * math.ceil(math.log2(size)) + sent / bw
    return {"read_s": read, "gather_s": gather, "token_s": read + gather, "bytes": sent}


__all__ = ["Machine", "MACHINES", "Candidate", "Plan", "plan", "predict", "candidates",
           "predict_linear", "predict_decode"]
