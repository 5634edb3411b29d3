"""Joining torch.distributed: `burstcu.init(comm=<ProcessGroup>)` on processes started by torchrun
(tests/mpi/torch_dist_bodies.py), against float64, with every failure on every rank."""

from __future__ import annotations

import time

import pytest

from tests.mpi_run import run_torchrun

pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("world, strategies", [(2, ("burst", "allgather", "ulysses", "usp")),
                                               (3, ("burst", "ring"))])
def test_attention_over_torch_matches_float64(world, strategies):
    """Per-document zigzag shards over a torch.distributed group (gloo carrying the ring), each
    strategy on a group of its own in one start of the world: out, lse, dq, dk, dv within
    FlashAttention's rule on every rank, the payload on the wire."""
    results = run_torchrun(world, "torch_dist_bodies:attention_over_torch", timeout=180,
                           strategies=strategies)
    for strategy in strategies:
        assert sum(r[strategy]["lengths"][r_i] for r_i, r in enumerate(results)) == 48, strategy
        for r in results:
            assert set(r[strategy]["errors"]) == {"out", "lse", "dq", "dk", "dv"}, strategy
            assert r[strategy]["sent"]["bytes"] > 0 and r[strategy]["sent"]["messages"] > 0, strategy


def test_an_all_gather_counts_as_waiting():
    """gloo's all-gather blocks the host: a peer 0.3 s late shows in stats.wait_seconds."""
    waits = run_torchrun(2, "torch_dist_bodies:allgather_blocks_over_torch", timeout=180)
    assert waits[1] >= 0.15, waits


def test_packed_varlen_over_torch():
    results = run_torchrun(2, "torch_dist_bodies:attention_over_torch", timeout=180, packed=True)
    assert all(r["burst"]["errors"]["out"] < 1e-5 for r in results)


@pytest.mark.parametrize("world", [3, 4])
def test_groups_the_program_makes_before_between_and_as_comm(world):
    """Groups of the program's own made before init (and only on some ranks), init twice over
    the same group, a group in reversed rank order, a pair of ranks as comm; usp's two real
    sub-groups on 4: every result equals the one-process run's, and each group's ranks are
    torch's order."""
    results = run_torchrun(world, "torch_dist_bodies:groups_the_program_makes", timeout=240)
    for rank, r in enumerate(results):
        report = r["report"]
        want = {f"world {s} {n}" for s in ("allgather", "burst") for n in (0, 1)}
        want |= {f"reversed {s} {n}" for s in ("allgather", "burst") for n in (0, 1)}
        if world == 4:
            want |= {f"world usp {n}" for n in (0, 1)}
        if rank < 2:
            want |= {f"pair {s} {n}" for s in ("allgather", "burst") for n in (0, 1)}
        assert set(report) == want, sorted(report)
        for label, (grank, gsize, err) in report.items():
            assert err < 1e-5, (label, err)
            expected = {"world": (rank, world), "reversed": (world - 1 - rank, world),
                        "pair": (rank, 2)}[label.split()[0]]
            assert (grank, gsize) == expected, label


def test_a_torch_group_passed_as_group_says_what_to_do():
    results = run_torchrun(2, "torch_dist_bodies:a_torch_group_is_not_a_burstcu_group", timeout=120)
    assert all("burstcu.init(comm=that_group)" in (r["said"] or "") for r in results), results


def test_bad_input_on_one_rank_is_an_error_on_every_rank():
    results = run_torchrun(2, "torch_dist_bodies:errors_reach_every_rank", timeout=120)
    for r in results:   # the offending rank's message, named by rank on the others
        assert r["said"] is not None and r["said"].endswith("k has shape (1, 8, 2, 16) but v has "
                                                            "(1, 8, 2, 8)"), r


def test_ranks_disagreeing_in_init_fail_together():
    results = run_torchrun(2, "torch_dist_bodies:init_disagreement", timeout=120)
    said = {r["said"] for r in results}
    assert len(said) == 1 and "ranks disagree on backend" in said.pop()


def test_a_rank_that_never_arrives_is_named_and_the_job_ends():
    start = time.monotonic()
    output = run_torchrun(2, "torch_dist_bodies:a_missing_rank_is_named", timeout=120,
                          expect_fail=True)
    assert time.monotonic() - start < 45, "the job outlived the 60 s sleep's purpose"
    assert "rank 0 waited 2 s for rank(s) [1] to reach the agreement round" in output, output
    assert "BURSTCU-RESULT" not in output          # neither rank returned


def test_an_interrupt_reaches_a_rank_waiting_for_a_busy_peer():
    start = time.monotonic()
    output = run_torchrun(2, "torch_dist_bodies:an_interrupt_reaches_a_waiting_rank", timeout=150,
                          expect_fail=True)
    assert time.monotonic() - start < 45, output
    assert "burstcu: rank 0 failed in attention forward at 'agreement on the inputs': " \
           "KeyboardInterrupt" in output, output
    assert "rank 0 ends its process (torchrun then stops the others" in output, output
    assert "BURSTCU-RESULT" not in output          # neither rank returned


def test_a_call_made_at_exit_runs(tmp_path):
    run_torchrun(2, "torch_dist_bodies:a_call_at_exit", timeout=150, folder=str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_dropped_groups_end_their_threads_and_an_allgather_last_exits_cleanly():
    for _ in range(3):   # the exit's abort came in about half the runs
        results = run_torchrun(2, "torch_dist_bodies:dropped_groups_and_an_allgather_last",
                               timeout=150)
        assert all(r == {"waiting_threads": 0, "shape": [1, 16, 2, 8]} for r in results), results


def test_init_without_a_peer_ends_the_job_with_why():
    start = time.monotonic()
    output = run_torchrun(2, "torch_dist_bodies:init_without_a_peer", timeout=120, expect_fail=True)
    assert time.monotonic() - start < 45
    assert "rank 0: connecting burstcu's gloo group '0/1' of 2 processes failed" in output, output
    assert "every process of the group must make it" in output
    assert "BURSTCU-RESULT" not in output          # neither rank returned


def test_the_cupy_bootstrap_runs_over_torch():
    """NCCL's unique id and the bootstrap's agreement over torch.distributed (a stand-in CuPy)."""
    results = run_torchrun(2, "torch_dist_bodies:cupy_bootstrap_over_torch", timeout=120)
    root_uid = (bytes([17, 0]) * 64).hex()                # what rank 0's stand-in makes first
    sub_root_uid = (bytes([18, 1]) * 64).hex()            # ... and rank 1's, second
    for rank, r in enumerate(results):
        assert r["device"] == r["local_rank"] == rank      # cuda:LOCAL_RANK
        assert r["made"][0] == [2, root_uid, rank]          # the world, with rank 0's id
        assert r["agreed"] == [0, 10]
        # the sub-group orders its ranks by key (reversed): world rank 1 is its rank 0
        assert r["sub"] == [1 - rank, 2] and r["sub_agreed"] == [1, 0]
        assert r["made"][1] == [2, sub_root_uid, 1 - rank]   # the sub-group's first rank's id
