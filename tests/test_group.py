"""init's choice of backend (`burstcu.group`): backend="auto" picks NumPy quietly when no rank has
a usable GPU, the GPU backend when every rank has one, and says so when only some ranks do."""

from __future__ import annotations

import warnings

import pytest

import burstcu
from burstcu import group


def test_auto_on_a_machine_without_a_gpu_says_nothing(monkeypatch):
    """backend='auto' picks NumPy quietly when no rank has a GPU (the usual CPU machine), and
    warns only when some rank has one that cannot be used everywhere."""
    monkeypatch.setattr(group, "gpu_usable", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with burstcu.init() as g:
            assert g.backend == "numpy"
    assert not [w for w in caught if "burstcu" in str(w.message)], [str(w.message) for w in caught]
    alone = group._settings("auto", None, "thread", None)
    assert group._resolve_backend("auto", [alone]) == ("numpy", False)


def test_auto_with_a_gpu_on_some_ranks_only_is_told(monkeypatch):
    class TwoRanks:   # rank 0 of two
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

    monkeypatch.setattr(group, "gpu_usable", lambda: True)
    mine = group._settings("auto", None, "thread", None)
    assert mine["gpu"] is True
    assert group._resolve_backend("auto", [mine, dict(mine, gpu=False)]) == ("numpy", True)
    assert group._resolve_backend("auto", [mine, mine]) == ("cupy", True)
    with pytest.warns(UserWarning, match="runs the NumPy CPU backend"):
        group._warn_cpu_fallback(TwoRanks(), "some ranks have a usable GPU, not every rank")


def test_a_loopback_world_names_an_unknown_op_option():
    """run_ranks' groups are made like init's: a misspelt option is refused by name."""
    from burstcu.testing.world import RankFailed, run_ranks
    with pytest.raises(RankFailed, match="unknown option 'determinstic': it takes"):
        run_ranks(2, lambda group: None, backend="numpy", determinstic=True)
    assert run_ranks(2, lambda group: group.ops.deterministic, deterministic=True) == [True, True]


def test_a_second_thread_in_init_over_the_same_communicator_is_refused(monkeypatch):
    """Two threads of a rank in init over one communicator at once: their start-up collectives
    interleaved, each rank pairing them its own way (garbage lengths, groups of mixed threads,
    or a hang). The second is refused at once; another communicator, or the same one once the
    first init has returned, is not."""
    import threading

    from mpi4py import MPI

    inside, release = threading.Event(), threading.Event()
    made = group._init_over

    def held(*args):   # alpha's init waits inside until released
        if threading.current_thread().name == "alpha":
            inside.set()
            assert release.wait(30)
        return made(*args)

    monkeypatch.setattr(group, "_init_over", held)
    first = {}
    thread = threading.Thread(target=lambda: first.update(g=burstcu.init(MPI.COMM_SELF, "numpy")),
                              name="alpha")
    thread.start()
    assert inside.wait(30)
    try:
        with pytest.raises(RuntimeError, match="thread 'alpha' is inside burstcu.init over the "
                                               "same communicator on this rank"):
            burstcu.init(MPI.COMM_SELF, "numpy")
        other = MPI.COMM_SELF.Dup()
        burstcu.init(other, "numpy").close()   # while alpha is still inside
        assert thread.is_alive()
    finally:
        release.set()
        thread.join(30)
    first["g"].close()
    burstcu.init(MPI.COMM_SELF, "numpy").close()
    other.Free()
