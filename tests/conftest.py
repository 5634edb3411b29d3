"""Fixtures shared by the test modules."""

import pytest


@pytest.fixture
def count_calls(monkeypatch):
    """count_calls(module, name) -> a list that grows by one entry per call of module.name, which
    still runs as before (undone at the end of the test)."""
    def count(module, name: str) -> list:
        calls, fn = [], getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
        return calls
    return count
