"""burstcu.plan (strategy="auto"): the candidates it considers, the rule it picks by, and that
"auto" runs what it picked, on every rank alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import burstcu
from burstcu.plan import MACHINES, Machine, candidates, plan, predict
from tests.mpi_run import run_mpi


class _Group:
    def __init__(self, size, backend="numpy"):
        self.size = size
        self.ops = type("Ops", (), {"backend": backend})()


def test_candidates_are_what_can_take_the_shapes():
    names = [c[0] for c in candidates((1, 64, 8, 16), (1, 64, 8, 16), 4)]
    assert names[:3] == ["burst", "ring", "allgather"] and "ulysses" in names
    assert ("usp", {"ulysses_degree": 2}) in candidates((1, 64, 8, 16), (1, 64, 8, 16), 4)
    # 6 heads do not split over 4 ranks: no ulysses; usp only with u = 2
    six = candidates((1, 64, 6, 16), (1, 64, 6, 16), 4)
    assert "ulysses" not in [c[0] for c in six] and ("usp", {"ulysses_degree": 2}) in six
    assert candidates((1, 64, 8, 16), (1, 64, 8, 16), 1) == [("burst", {}), ("ring", {}), ("allgather", {})]


@pytest.mark.parametrize("machine", sorted(MACHINES))
@pytest.mark.parametrize("size,shape", [(4, (1, 256, 8, 64, 8)), (8, (2, 4096, 32, 128, 8)),
                                        (16, (1, 16384, 32, 128, 4)), (2, (1, 64, 2, 32, 1))])
@pytest.mark.parametrize("backward", [True, False])
def test_the_choice_is_the_smallest_predicted_time(machine, size, shape, backward):
    b, s, h, d, hkv = shape
    p = plan((b, s, h, d), (b, s, hkv, d), _Group(size), causal=True, layout="zigzag",
             machine=machine, backward=backward)
    total = [c.forward_s + (c.backward_s if backward else 0.0) for c in p.candidates]
    assert total == sorted(total) and p.choice is p.candidates[0]
    assert {c.strategy for c in p.candidates} >= {"burst", "ring", "allgather"}
    text = str(p)
    assert text.startswith("PREDICTION") and f"choice: {p.choice.label}" in text


def test_the_model_moves_the_way_it_should():
    """Slow links favour the strategy that sends least; free links and no overhead make the
    balanced ring and Ulysses equal in compute, and ties go to burst."""
    q, k = (1, 1024, 16, 64), (1, 1024, 16, 64)
    slow = Machine("slow", 1e15, 1e6, 1e6, 0.0, 64, "test")
    p = plan(q, k, _Group(8), causal=True, layout="zigzag", machine=slow)
    sent = {c.label: c.forward_bytes + c.backward_bytes for c in p.candidates}
    assert sent[p.choice.label] == min(sent.values())
    free = Machine("free", 1e12, 1e18, 1e18, 0.0, 64, "test")
    burst = predict("burst", {}, q, k, 8, causal=False, layout="zigzag", dtype="float16", machine=free)
    ring = predict("ring", {}, q, k, 8, causal=False, layout="zigzag", dtype="float16", machine=free)
    assert burst.forward_s == pytest.approx(ring.forward_s)
    assert plan(q, k, _Group(8), causal=False, machine=free).strategy == "burst"
    # contiguous causal: the last rank works every step, zigzag halves it
    contiguous = predict("burst", {}, q, k, 8, causal=True, layout="contiguous", dtype="float16", machine=free)
    zigzag = predict("burst", {}, q, k, 8, causal=True, layout="zigzag", dtype="float16", machine=free)
    assert contiguous.forward_s > 1.8 * zigzag.forward_s
    with_overhead = dataclasses.replace(free, step_overhead=1.0)
    assert predict("ulysses", {}, q, k, 8, causal=True, layout="zigzag", dtype="float16",
                   machine=with_overhead).forward_s < 2.0          # one local call, not eight


def test_auto_refuses_a_degree():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 2, 8))
    with pytest.raises(ValueError, match="ulysses_degree is an option of strategy='usp'"):
        burstcu.attention(q, q, q, strategy="auto", ulysses_degree=2)


def test_auto_in_one_process():
    """One rank: "auto" runs plan's choice, bit for bit as that strategy named."""
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 32, 2, 8)) for _ in range(4))
    choice = plan(q.shape, k.shape, None, causal=True, dtype=q.dtype)
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True, strategy="auto")
    out2, lse2 = burstcu.attention(q, k, v, causal=True, return_lse=True, strategy=choice.strategy)
    assert np.array_equal(out, out2) and np.array_equal(lse, lse2)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, strategy="auto")
    grads2 = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, strategy=choice.strategy)
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads2))


@pytest.mark.mpi
@pytest.mark.parametrize("world,h,hkv", [(2, 8, 2), (4, 8, 2), (3, 6, 6)])
def test_auto_runs_the_planned_strategy(world, h, hkv):
    results = run_mpi(world, "strategy_bodies:auto_runs_the_planned_strategy", h=h, hkv=hkv)
    assert len({r["choice"] for r in results}) == 1
