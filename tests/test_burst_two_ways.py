"""burst's K/V both ways round the ring (`burstcu.engine.burst.kv_hops`) on a real
`mpiexec -n 1..4`: a window needing keys from both sides sends one block to each neighbour, and
full attention with bidirectional=True halves the exchanges; results against float64 and bytes
against the counts spelled out in tests/mpi/strategy_bodies.py."""

from __future__ import annotations

import pytest

from tests.mpi_run import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_kv_both_ways_matches_the_reference(world):
    results = run_mpi(world, "strategy_bodies:kv_both_ways_matches_reference", timeout=240)
    assert [r["bidirectional"] for r in results] == [world - 1] * world
    if world == 4:   # a non-causal window of half a shard: 2x a rank's K+V at most, not 3x
        assert [r["window"] for r in results] == [1, 2, 2, 1]
