"""Uneven lengths: any global length with either layout, contiguous shards of any lengths the
ranks hold, zigzag with documents (each document cut into 2G near-equal pieces), on every
strategy under real `mpiexec -n 1..4`: out, lse, dq, dk, dv against a float64 reference over an
explicit dense mask (tests/mpi/strategy_bodies.py::window_matches_reference), bytes per rank
asserted against counts spelled out there (each block and bundle at its owner's length), and
unshard gives the global array back. Then a new user's case, N = 3001 on 3 ranks."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from burstcu.layout import partition
from tests.mpi_run import run_mpi

MIX = [1, 7, 5, 13, 2, 11]
# per world size: contiguous shard lengths with a 1-row shard, and shards far apart
LENGTHS = {"1": [23], "2": [5, 19], "3": [1, 20, 9], "4": [13, 2, 7, 11]}
CASES = [
    {"causal": True, "layout": "contiguous", "n": 37},
    {"causal": False, "layout": "zigzag", "n": 37},
    {"causal": True, "layout": "zigzag", "n": 41},
    {"causal": True, "layout": "contiguous", "lengths": LENGTHS},
    {"causal": False, "layout": "contiguous", "lengths": LENGTHS, "window": (3, 2)},
    {"causal": True, "layout": "contiguous", "lengths": LENGTHS, "doc_lengths": MIX},
    {"causal": True, "layout": "zigzag", "n": 45, "doc_lengths": MIX},
    {"causal": False, "layout": "zigzag", "n": 40, "doc_lengths": [17, 3, 20], "window": (4, 1)},
    {"causal": True, "layout": "zigzag", "n": 43, "doc_lengths": [29, 1], "window": (6, 0)},
]


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["burst", "ring", "allgather"])
def test_uneven_shards_match_reference(world, strategy):
    run_mpi(world, "strategy_bodies:window_matches_reference", timeout=240, strategy=strategy,
            cases=CASES)


@pytest.mark.mpi
@pytest.mark.parametrize("world,strategy,degree", [(2, "ulysses", None), (4, "ulysses", None),
                                                   (4, "usp", 2)])
def test_uneven_shards_through_the_all_to_all_strategies(world, strategy, degree):
    run_mpi(world, "strategy_bodies:window_matches_reference", timeout=240, strategy=strategy,
            ulysses_degree=degree, cases=CASES)


@pytest.mark.mpi
@pytest.mark.parametrize("world", [3, 4])
def test_auto_picks_alike_on_uneven_shards_and_documents(world):
    """strategy="auto" plans from the agreed partition and mask: every rank runs the same
    strategy (a rank picking another would hang the job into its timeout)."""
    run_mpi(world, "strategy_bodies:window_matches_reference", timeout=240, strategy="auto",
            cases=CASES)


@pytest.mark.mpi
def test_uneven_shards_in_float64_and_float16():
    for dtype in ("float64", "float16"):
        run_mpi(3, "strategy_bodies:window_matches_reference", timeout=240, dtype=dtype,
                cases=CASES[2:4] + CASES[6:7])


@pytest.mark.mpi
@pytest.mark.emulated
def test_uneven_shards_on_the_emulated_kernels():
    """Blocks of other lengths than this rank's reach the CUDA kernels (CPU emulator)."""
    run_mpi(3, "strategy_bodies:window_matches_reference", timeout=600, backend="emulated",
            dtype="float16", cases=[CASES[0], CASES[3], CASES[6]])


@pytest.mark.mpi
def test_a_length_no_rank_count_divides():
    """N = 3001 on 3 ranks: shard, attention (causal), backward and unshard, both layouts,
    equal one process's attention over the whole sequence."""
    for rank, result in enumerate(run_mpi(3, "strategy_bodies:prime_length_matches_one_process",
                                          timeout=240)):
        assert result["lengths"] == {"contiguous": [1001, 1000, 1000], "zigzag": [1001, 1000, 1000]}, \
            (rank, result)


def test_zigzag_pieces_balance_causal_work():
    """Each document in 2G pieces: the causal pairs per rank are within 10% of the mean on a
    realistic mix of lengths (a few long documents among many short ones), where contiguous
    shards leave the last rank with far more."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(50, 400, 40), rng.integers(2000, 6000, 4)])
    docs = tuple(int(b) for b in np.concatenate([[0], np.cumsum(lengths)]))
    n = docs[-1]
    for size in (2, 4, 8):
        spread = {}
        for layout in ("zigzag", "contiguous"):
            part = partition(layout, size, n, docs if layout == "zigzag" else None)
            work = []
            for r in range(size):
                pos = np.asarray(part.positions(r))
                start = np.asarray(docs)[np.searchsorted(docs, pos, side="right") - 1]
                work.append(int((pos - start + 1).sum()))    # causal keys each query sees
            spread[layout] = max(work) / np.mean(work) - 1
        assert spread["zigzag"] <= 0.10, (size, spread)
        assert spread["contiguous"] > spread["zigzag"], (size, spread)


def test_partition_refuses_what_cannot_be_split():
    with pytest.raises(ValueError, match="at least one row"):
        partition("contiguous", 4, 3)
    with pytest.raises(ValueError, match="zigzag fixes every rank's length"):
        partition("zigzag", 2, 10, lengths=(4, 6))
    q = np.zeros((1, 3, 2, 8))
    with pytest.raises(ValueError, match="at least one row"):
        burstcu.shard(q, _Rank(0, 4), "contiguous")


class _Rank:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size
