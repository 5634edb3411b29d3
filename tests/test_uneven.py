"""Uneven lengths: a new user's case, N = 3001 on 3 ranks, sharded, run and unsharded as one
process computes it; zigzag pieces of documents balance causal work; a partition that cannot give
every rank a row is refused. Uneven shards on every strategy against the float64 reference:
tests/test_mask_kinds.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import burstcu
from burstcu.layout import partition
from tests.mpi_run import run_mpi


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
        burstcu.shard(q, SimpleNamespace(rank=0, size=4), "contiguous")


def test_contiguous_lengths_of_zero_are_refused():
    """Every rank holds a row at least: a partition with an empty rank is a ValueError."""
    with pytest.raises(ValueError, match="at least one row"):
        partition("contiguous", 3, 10, lengths=(5, 0, 5))
