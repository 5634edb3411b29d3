"""Bad input gets a clear ValueError/TypeError on every rank, before any communication that could
hang; and the group keeps working afterwards."""

import numpy as np
import pytest

import burstcu
from tests.mpi.bodies import BAD_INPUTS, bad_input_raises_everywhere
from tests.mpi_run import run_mpi


@pytest.mark.parametrize("kind", [k for k, (who, _, _) in BAD_INPUTS.items() if who == "all"])
def test_bad_input_one_process(kind):
    pytest.importorskip("mpi4py")
    result = bad_input_raises_everywhere(kind)
    assert result["raised"] is not None


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_every_rank(world):
    results = run_mpi(world, "every_bad_input_raises_everywhere", timeout=120)
    for rank, per_kind in enumerate(results):
        for kind, (who, err_type, text) in BAD_INPUTS.items():
            raised = per_kind[kind]["raised"]
            if who == "none":
                assert raised is None, (rank, kind, raised)
                continue
            assert raised is not None, f"rank {rank} did not raise for {kind}"
            assert raised[0] == err_type, (rank, kind, raised)
            # the bad rank names the problem; the others name the rank that had it
            bad_rank = who == "all" or rank == world - 1
            assert (text in raised[1]) if bad_rank else ("rank " in raised[1] or text in raised[1]), raised


def test_messages_are_specific():
    q = np.zeros((1, 8, 6, 16), np.float32)
    k = np.zeros((1, 8, 4, 16), np.float32)
    with pytest.raises(ValueError, match="q has 6 heads, k has 4: nheads must be a multiple of nheads_kv"):
        burstcu.attention(q, k, k)
    with pytest.raises(TypeError, match="int64"):
        burstcu.attention(q.astype(np.int64), k.astype(np.int64), k.astype(np.int64))
    with pytest.raises(ValueError, match="linear attention's zigzag layout needs an even local seqlen"):
        q3 = np.zeros((1, 7, 2, 16), np.float32)
        burstcu.linear_attention(q3, q3, q3, layout="zigzag")
    with pytest.raises(ValueError, match="strategy must be one of"):
        burstcu.attention(q[:, :, :4], k, k, strategy="psychic")
    with pytest.raises(ValueError, match="softmax_scale must be a finite number"):
        burstcu.attention(q[:, :, :4], k, k, softmax_scale=float("nan"))


def test_init_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        burstcu.init(backend="tpu")


@pytest.mark.parametrize("world", [2, 3])
def test_the_global_array_on_every_rank(world):
    """The warning points at the user's line and names its category, on every rank; with
    documents that cover one copy of the rows it is an error on every rank."""
    for rank, r in enumerate(run_mpi(world, "global_array_on_every_rank", timeout=120)):
        assert r["warned"] == 1 and r["file"] == "bodies.py" and r["line_ok"], (rank, r)
        assert f"{world} copies of the sequence" in r["message"], (rank, r)
        assert "burstcu.SameShardsWarning" in r["message"], (rank, r)
        assert r["docs_error"] and "each holds the whole sequence" in r["docs_error"], (rank, r)
        assert r["backward_warned"] == 0, (rank, r)   # q differs between ranks: no warning

