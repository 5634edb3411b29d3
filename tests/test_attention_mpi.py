"""The distributed algorithm, for real: `mpiexec -n {1,2,3,4}` ranks of the CPU backend against
the float64 reference (long double for float64 input), forward and backward, every rank checked,
plus the exact bytes and messages each rank put on the wire."""

import itertools

import pytest

from tests.mpi_run import run_mpi

pytestmark = pytest.mark.mpi

# (heads, kv heads, head dim): MHA, GQA 2:1, MQA 3:1 with an odd head dim, large head dim
HEADS = [(4, 2, 32), (2, 2, 64), (3, 1, 80), (2, 1, 128)]
CASES = [dict(b=2, h=h, hkv=hkv, d=d, causal=causal, layout=layout)
         for (h, hkv, d), causal, layout in itertools.product(HEADS, (False, True), ("contiguous", "zigzag"))]


@pytest.mark.parametrize("world,dtype", [
    pytest.param(w, dt, marks=[pytest.mark.slow] if (w > 2 and dt == "float64") else [])
    for dt in ("float32", "float64") for w in (1, 2, 3, 4)])
def test_forward_backward_match_reference(world, dtype):
    """Every world size in float32; float64 on 1 and 2 ranks (on 3 and 4 only with -m slow)."""
    # 38 local rows with 16 x 32 tiles: ragged last tiles, and zigzag halves of 19 rows
    results = run_mpi(world, "attention_matches_reference", dtype=dtype, cases=CASES,
                      seqlen_local=38, options={"tile_q": 16, "tile_k": 32})
    for rank, summary in enumerate(results):
        assert len(summary) == len(CASES), f"rank {rank} ran {len(summary)} cases"


@pytest.mark.parametrize("world", [2, 3])
def test_default_tiles_and_long_local_sequence(world):
    """Default tile sizes (256 x 512) with a local length that is not a multiple of either."""
    cases = [dict(b=1, h=2, hkv=1, d=64, causal=c, layout=l)
             for c, l in itertools.product((False, True), ("contiguous", "zigzag"))]
    results = run_mpi(world, "attention_matches_reference", dtype="float32", cases=cases,
                      seqlen_local=600)
    assert all(len(r) == len(cases) for r in results)


@pytest.mark.parametrize("world", [2, 4])
def test_low_precision_storage(world):
    """float16 / bfloat16 inputs, computed in float32."""
    cases = [dict(b=1, h=2, hkv=1, d=64, causal=True, layout="zigzag")]
    for dtype in ("float16", "bfloat16"):
        run_mpi(world, "attention_matches_reference", dtype=dtype, cases=cases, seqlen_local=40)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_unshard_roundtrip(world, layout):
    results = run_mpi(world, "shard_roundtrip", layout=layout)
    rows = sorted(r for res in results for r in res["rows"])
    assert rows == list(range(4 * world)), "the shards must partition the sequence"


@pytest.mark.emulated
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("world", [2, 3])
def test_emulated_kernels_on_the_ring(world, dtype):
    """The whole distributed algorithm running the real .cu kernels (CPU emulator) as its LAO:
    forward and backward vs float64, tolerance against a naive same-dtype implementation."""
    cases = [dict(b=1, h=4, hkv=2, d=64, causal=True, layout="zigzag"),
             dict(b=2, h=2, hkv=2, d=80, causal=False, layout="contiguous")]
    run_mpi(world, "attention_matches_reference", backend="emulated", dtype=dtype, cases=cases,
            seqlen_local=48, timeout=600)


@pytest.mark.emulated
@pytest.mark.parametrize("world", [1, 2, 4])
def test_emulated_hopper_kernels_on_the_ring(world):
    """The ring with the Hopper kernels (kernels/flash_fwd_sm90.cu and flash_bwd_sm90.cu,
    arch="sm_90a": wgmma, TMA, mbarriers in the emulator) as the local op of every step, zigzag
    causal (steps with and without masked pairs) and a full contiguous case, forward and backward
    (dK/dV with atomic dQ) vs float64; 288
    rows a rank, so blocks span several 128-key tiles and the pipelines run their steady state.
    One rank: a pass of one fold (the Hopper kernel starts from an unread state and writes out
    and lse); contiguous full on 2 and 4: the first and last folds do so by halves."""
    cases = [dict(b=1, h=4, hkv=2, d=64, causal=True, layout="zigzag"),
             dict(b=1, h=2, hkv=2, d=128, causal=False, layout="contiguous")]
    run_mpi(world, "attention_matches_reference", backend="emulated", dtype="bfloat16",
            cases=cases, seqlen_local=288, options={"arch": "sm_90a"}, timeout=600)



@pytest.mark.emulated
@pytest.mark.parametrize("strategy,world", [("ring", 2), ("usp", 4)])
def test_emulated_hopper_kernels_under_ring_and_usp(strategy, world):
    """The Hopper kernels (arch="sm_90a": flash_fwd_sm90.cu, flash_bwd_sm90.cu) as the local op of
    the ring strategy (K/V and their gradients travel) and of USP (Ulysses inside pairs of ranks,
    the ring across them), zigzag causal and contiguous full, forward and backward vs float64."""
    cases = [dict(b=1, h=4, hkv=2, d=64, causal=True, layout="zigzag"),
             dict(b=1, h=2, hkv=2, d=128, causal=False, layout="contiguous")]
    run_mpi(world, "attention_matches_reference", backend="emulated", dtype="bfloat16",
            cases=cases, seqlen_local=160, options={"arch": "sm_90a"}, strategy=strategy,
            ulysses_degree=2 if strategy == "usp" else None, timeout=600)

def test_unshard_rejects_mismatched_shapes():
    for rank, result in enumerate(run_mpi(3, "unshard_rejects_mismatched_shapes")):
        assert result["other_axis"] and "same shape" in result["other_axis"], (rank, result)
        assert result["zigzag_lengths"] and "(4, 5, 6)" in result["zigzag_lengths"] \
            and "layout='zigzag'" in result["zigzag_lengths"], (rank, result)
        assert "uneven=True" in result["uneven_not_declared"], (rank, result)
