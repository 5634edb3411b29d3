"""Ulysses (strategy="ulysses"): all-to-all to head shards, local attention over the whole
sequence, all-to-all back — against the float64 reference and its byte formula (written out in
tests/mpi/bodies.py::expected_traffic) under real `mpiexec -n 1..4`, over causal x layout x GQA
(kv heads split over the ranks, or shared by several) x dtypes; bad head counts refused on every
rank; check=True through it."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from burstcu.engine import ulysses
from tests.mpi_run import run_mpi

pytestmark = pytest.mark.mpi


def cases(world: int) -> list[dict]:
    """Head counts that split over `world` ranks: no GQA, kv heads split, kv heads shared."""
    shared = {1: 1, 2: 1, 3: 1, 4: 2}[world]          # G % Hkv == 0: G/Hkv ranks share a kv head
    split = {1: 3, 2: 2, 3: 3, 4: 4}[world]           # Hkv % G == 0: each rank its own kv heads
    h = 12
    return [
        {"b": 1, "h": h, "hkv": h, "d": 8, "causal": False, "layout": "contiguous"},
        {"b": 2, "h": h, "hkv": split, "d": 16, "causal": True, "layout": "contiguous"},
        {"b": 1, "h": h, "hkv": shared, "d": 8, "causal": True, "layout": "zigzag"},
        {"b": 1, "h": h, "hkv": split, "d": 8, "causal": False, "layout": "zigzag"},
    ]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ulysses_matches_reference(world):
    results = run_mpi(world, "strategy_bodies:strategy_matches_reference", timeout=240,
                      strategy="ulysses", dtype="float32", cases=cases(world), seqlen_local=16)
    assert len(results) == world and all(len(r) == 4 for r in results)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_ulysses_dtypes(dtype):
    run_mpi(2, "strategy_bodies:strategy_matches_reference", timeout=240, strategy="ulysses",
            dtype=dtype, cases=cases(2)[1:3], seqlen_local=16)


@pytest.mark.emulated
def test_ulysses_on_the_emulated_kernels():
    """The CUDA kernels (CPU emulator) as the local op: one block over the whole sequence."""
    run_mpi(2, "attention_matches_reference", timeout=600, backend="emulated", dtype="float16",
            strategy="ulysses", cases=cases(2)[1:3], seqlen_local=32)


@pytest.mark.parametrize("world,h,hkv", [(2, 3, 3), (2, 6, 3), (4, 12, 3)])
def test_bad_head_counts_are_refused_on_every_rank(world, h, hkv):
    results = run_mpi(world, "strategy_bodies:ulysses_refuses_bad_head_counts", h=h, hkv=hkv)
    messages = {r["error"] for r in results}
    assert len(messages) == 1 and "strategy 'ulysses'" in messages.pop()


def test_the_uneven_kv_head_split_is_described_as_it_is():
    """Query heads a kv head serves, split over ranks unevenly: the refusal names the kv heads
    two ranks would share (it said each rank would need a fraction of a kv head, which none
    does) and what takes the heads instead."""
    said = ulysses.heads_problem(6, 3, 2, "ulysses")
    assert "rank 0's kv heads 0-1, rank 1's kv heads 1-2" in said, said
    assert "fraction" not in said and "strategy='burst' or 'auto' takes any heads" in said, said
    said = ulysses.heads_problem(6, 2, 3, "ulysses")
    assert "rank 0's kv head 0, rank 1's kv heads 0-1" in said, said
    assert ulysses.heads_problem(6, 3, 3, "ulysses") is None       # each rank its own kv head


@pytest.mark.parametrize("world", [1, 2, 4])
def test_check_through_ulysses(world):
    results = run_mpi(world, "backward_check_catches_wrong_lse", strategy="ulysses")
    assert all(len(r["raised"]) == 4 for r in results)


def test_head_assignment():
    """kv heads per rank: split when Hkv % G == 0, else the one head a rank's queries share."""
    assert [ulysses.kv_heads(r, 4, 8, 8) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [ulysses.kv_heads(r, 4, 8, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [ulysses.kv_heads(r, 3, 12, 1) for r in range(3)] == [(0, 1)] * 3
    assert ulysses.input_problem((1, 8, 6, 8), (1, 8, 3, 8), 2) is not None
    assert ulysses.input_problem((1, 8, 6, 8), (1, 8, 3, 8), 3) is None


def test_single_process_equals_burst():
    rng = np.random.default_rng(0)
    q, dout = (rng.standard_normal((1, 40, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 40, 2, 8)) for _ in range(2))
    out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True, strategy="ulysses")
    ref_out, ref_lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-13)
    grads = burstcu.attention_backward(dout, q, k, v, out, lse, causal=True, strategy="ulysses")
    ref = burstcu.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    for a, b in zip(grads, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


# -- USP: Ulysses inside groups of u ranks, the burst ring across them ----------------------------

USP_CASES = [
    {"b": 1, "h": 4, "hkv": 2, "d": 8, "causal": True, "layout": "zigzag"},
    {"b": 2, "h": 4, "hkv": 4, "d": 16, "causal": True, "layout": "contiguous"},
    {"b": 1, "h": 4, "hkv": 1, "d": 8, "causal": False, "layout": "zigzag"},
]


@pytest.mark.parametrize("world,u", [(4, 2), (4, 1), (4, 4), (2, 2), (3, 1)])
def test_usp_matches_reference(world, u):
    """USP 2 x 2 at four ranks (and its ends: u = 1 is the ring, u = G is Ulysses)."""
    results = run_mpi(world, "strategy_bodies:strategy_matches_reference", timeout=240,
                      strategy="usp", ulysses_degree=u, dtype="float32", cases=USP_CASES,
                      seqlen_local=16)
    assert len(results) == world and all(len(r) == len(USP_CASES) for r in results)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_usp_dtypes(dtype):
    """Own kv heads (4 on 2 ranks) and one kv head shared by both ranks of a group, whose dk, dv
    shares are summed at home before rounding."""
    run_mpi(4, "strategy_bodies:strategy_matches_reference", timeout=240, strategy="usp",
            ulysses_degree=2, dtype=dtype, cases=[USP_CASES[1], USP_CASES[2]], seqlen_local=16)


@pytest.mark.emulated
def test_usp_on_the_emulated_kernels():
    run_mpi(4, "attention_matches_reference", timeout=600, backend="emulated", dtype="float16",
            strategy="usp", ulysses_degree=2, cases=USP_CASES[:2], seqlen_local=32)


def test_usp_bad_degrees_are_refused_on_every_rank():
    results = run_mpi(4, "strategy_bodies:usp_refuses_bad_degrees")
    assert all(r["errors"] == results[0]["errors"] for r in results)
    assert "must divide" in results[0]["errors"]["degree 3"]


def test_usp_degree_choice():
    """None picks the largest u <= 8 dividing G whose split of the heads works."""
    from burstcu.engine.usp import USPAttention
    assert USPAttention.choose_degree(16, 32, 8) == 8
    assert USPAttention.choose_degree(12, 12, 12) == 6
    assert USPAttention.choose_degree(4, 6, 6) == 2       # 4 does not divide 6 heads
    assert USPAttention.choose_degree(8, 8, 2) == 8         # 4 ranks share each kv head
    assert USPAttention.choose_degree(3, 4, 4) == 1


@pytest.mark.parametrize("degree", [2, 4])
def test_check_through_usp(degree):
    """u = 2 at four ranks: the row sums travel through the ring of two groups as well."""
    results = run_mpi(4, "backward_check_catches_wrong_lse", strategy="usp", ulysses_degree=degree)
    assert all(len(r["raised"]) == 4 for r in results)
