"""Sliding windows (`window_size=(left, right)`, flash-attn's convention) on every strategy under
real `mpiexec -n 1..4`, both layouts, with and without causal, against a float64 reference over
an explicit dense mask (tests/mpi/strategy_bodies.py::window_matches_reference); which ring
steps a window lets the engine skip; bad windows refused on every rank."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from burstcu.layout import step_blocks
from tests.mpi_run import run_mpi

CASES = [
    {"causal": True, "layout": "zigzag", "window": (5, 0)},
    {"causal": True, "layout": "contiguous", "window": (13, -1)},
    {"causal": False, "layout": "zigzag", "window": (3, 7)},
    {"causal": False, "layout": "contiguous", "window": (-1, 2)},
    {"causal": False, "layout": "contiguous", "window": (0, 0)},   # each row sees itself only
]


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["burst", "ring", "allgather"])
def test_window_matches_reference(world, strategy):
    run_mpi(world, "strategy_bodies:window_matches_reference", timeout=240, strategy=strategy,
            cases=CASES)


@pytest.mark.mpi
@pytest.mark.parametrize("world,strategy,degree", [(2, "ulysses", None), (4, "ulysses", None),
                                                   (4, "usp", 2)])
def test_window_through_the_all_to_all_strategies(world, strategy, degree):
    run_mpi(world, "strategy_bodies:window_matches_reference", timeout=240, strategy=strategy,
            ulysses_degree=degree, cases=CASES)


@pytest.mark.mpi
def test_window_in_float64_and_float16():
    for dtype in ("float64", "float16"):
        run_mpi(3, "strategy_bodies:window_matches_reference", timeout=240, dtype=dtype,
                cases=CASES[:3])


def test_a_narrow_window_computes_only_neighbouring_steps():
    """Contiguous shards of 16 rows, window (4, 0): a rank's queries see only its own keys and
    the last 4 of its left neighbour's; every other step has no block (nothing computed)."""
    for q_rank in range(4):
        sources = [s for s in range(4) if step_blocks("contiguous", q_rank, s, 4, 16, True, (4, 0))]
        assert sources == ([q_rank - 1, q_rank] if q_rank else [0])
    (block,) = step_blocks("contiguous", 2, 1, 4, 16, True, (4, 0))
    assert (block.causal, block.left, block.right) == (False, 4, -1)


@pytest.mark.parametrize("window,causal,message", [
    ((3, 2), True, "right bound is the diagonal"), ((-2, 0), False, "int >= -1"),
    ((3,), False, "must be \\(left, right\\)"), ((1.5, 0), False, "int >= -1")])
def test_bad_windows_are_refused(window, causal, message):
    q = np.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match=message):
        burstcu.attention(q, q, q, causal=causal, window_size=window)


@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.parametrize("world,dtype", [(2, "float16"), (3, "bfloat16")])
def test_window_on_the_emulated_kernels(world, dtype):
    """The CUDA kernels' key bounds on a real ring, through the CPU emulator."""
    run_mpi(world, "strategy_bodies:window_matches_reference", timeout=600, backend="emulated",
            dtype=dtype, seqlen_local=32, cases=CASES)
