"""The MPI transport's waits: a rank waiting for a late peer uses little CPU."""

from __future__ import annotations

import pytest

from tests.mpi_run import run_mpi


@pytest.mark.mpi
def test_waiting_for_a_late_peer_burns_no_core():
    """Rank 0 posts each of 20 ring exchanges 15 ms late. The others' progress threads wait
    those 15 ms: they used to poll back to back for the first 20 ms of every wait (a third of
    a core here, measured); now they sleep between polls."""
    for r in run_mpi(2, "transport_bodies:waiting_for_a_late_peer", timeout=60):
        assert r["cpu_s"] < 0.2 * r["wall_s"], r

