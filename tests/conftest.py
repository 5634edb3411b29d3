"""Fixtures shared by the test modules."""

import pytest

from tests import mpi_run


@pytest.fixture(autouse=True)
def _mpi_marked(request):
    """Tells tests/mpi_run.py whether the running test carries the `mpi` marker: one that starts
    mpiexec without it fails there, so that `-m "not mpi"` leaves out every test that does."""
    mpi_run.MARKED = request.node.get_closest_marker("mpi") is not None
    yield
    mpi_run.MARKED = None


@pytest.fixture
def count_calls(monkeypatch):
    """count_calls(module, name) -> a list that grows by one entry per call of module.name, which
    still runs as before (undone at the end of the test)."""
    def count(module, name: str) -> list:
        calls, fn = [], getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
        return calls
    return count
