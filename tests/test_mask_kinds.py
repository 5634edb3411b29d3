"""Sliding windows, documents, uneven shards and block masks (the four kinds of mask) on every
strategy under
real `mpiexec -n 1..4`: out, lse, dq, dk, dv against a float64 reference over an explicit dense
mask within FlashAttention's tolerance rule, bytes per rank against counts written out in the
body, and unshard giving the global array back
(tests/mpi/strategy_bodies.py::masked_attention_matches_reference).

Each kind is a table of cases (`MASK_KINDS`); every test below runs that one body over the kinds
it names. What is particular to a kind (its rectangles, its partition, the inputs it refuses) is
tested in tests/test_window.py, tests/test_documents.py and tests/test_uneven.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.mpi_run import run_mpi

BODY = "strategy_bodies:masked_attention_matches_reference"

# document lengths cycled until the sequence is full: with shards of 12 rows, lengths 1, 7, 5,
# 13 (> a shard), 2, 11 put boundaries anywhere
MIX = [1, 7, 5, 13, 2, 11]
# per world size: contiguous shard lengths with a 1-row shard, and shards far apart
LENGTHS = {"1": [23], "2": [5, 19], "3": [1, 20, 9], "4": [13, 2, 7, 11]}


@dataclass(frozen=True)
class MaskKind:
    """The cases of one kind of mask, and which of them each run takes.

    cases: every strategy runs all of them (the body's case dicts: causal, layout, window,
    doc_lengths, n, lengths). in_other_dtypes: the ones run again in float64 and float16 on 3
    ranks. emulated: (world, dtype) runs on the CUDA kernels through the CPU emulator, over
    emulated_cases with the body options emulated_options. auto_worlds: world sizes that run
    strategy="auto" over every case."""

    cases: list
    in_other_dtypes: list
    emulated: list
    emulated_cases: list
    emulated_options: dict = field(default_factory=dict)
    auto_worlds: tuple = ()


WINDOWS = [
    {"causal": True, "layout": "zigzag", "window": (5, 0)},
    {"causal": True, "layout": "contiguous", "window": (13, -1)},
    {"causal": False, "layout": "zigzag", "window": (3, 7)},
    {"causal": False, "layout": "contiguous", "window": (-1, 2)},
    {"causal": False, "layout": "contiguous", "window": (0, 0)},   # each row sees itself only
]
DOCUMENTS = [
    {"causal": True, "layout": "contiguous", "doc_lengths": MIX},
    {"causal": False, "layout": "contiguous", "doc_lengths": MIX},
    {"causal": True, "layout": "contiguous", "doc_lengths": [3, 17], "window": (4, 0)},
    {"causal": False, "layout": "contiguous", "doc_lengths": [29, 1], "window": (2, 5)},
    {"causal": True, "layout": "contiguous", "doc_lengths": [1]},          # every row alone
    {"causal": True, "layout": "contiguous", "doc_lengths": [1000]},       # one document
]
# any global length with any layout, contiguous shards of any lengths the ranks hold, zigzag
# with documents (each document cut into 2G near-equal pieces), "documents" (the short ones whole)
UNEVEN = [
    {"causal": True, "layout": "contiguous", "n": 37},
    {"causal": False, "layout": "zigzag", "n": 37},
    {"causal": True, "layout": "zigzag", "n": 41},
    {"causal": True, "layout": "contiguous", "lengths": LENGTHS},
    {"causal": False, "layout": "contiguous", "lengths": LENGTHS, "window": (3, 2)},
    {"causal": True, "layout": "contiguous", "lengths": LENGTHS, "doc_lengths": MIX},
    {"causal": True, "layout": "zigzag", "n": 45, "doc_lengths": MIX},
    {"causal": False, "layout": "zigzag", "n": 40, "doc_lengths": [17, 3, 20], "window": (4, 1)},
    {"causal": True, "layout": "zigzag", "n": 43, "doc_lengths": [29, 1], "window": (6, 0)},
    # zigzag with the short documents whole (documents of 2-7 rows are, on 2 to 4 ranks)
    {"causal": True, "layout": "documents", "n": 96, "doc_lengths": MIX},
    {"causal": False, "layout": "documents", "n": 120, "doc_lengths": MIX, "window": (4, 1)},
]

# block masks (burstcu.BlockMask, tests/mpi/strategy_bodies.py::mask_rects): rectangles of all
# four kinds over global positions, on even, uneven and zigzag shards
BLOCKS = [
    {"causal": False, "layout": "contiguous", "block_mask": "question_answers"},
    {"causal": False, "layout": "zigzag", "block_mask": "question_answers"},
    {"causal": False, "layout": "contiguous", "n": 37, "block_mask": "four_kinds"},
    {"causal": False, "layout": "zigzag", "block_mask": "four_kinds"},
    {"causal": False, "layout": "contiguous", "lengths": LENGTHS, "block_mask": "sparse"},
]

MASK_KINDS = {
    # the kernels' key bounds on a real ring
    "windows": MaskKind(cases=WINDOWS, in_other_dtypes=WINDOWS[:3],
                        emulated=[(2, "float16"), (3, "bfloat16")], emulated_cases=WINDOWS,
                        emulated_options={"seqlen_local": 32}),
    # documents reach the kernels as more rectangles
    "documents": MaskKind(cases=DOCUMENTS, in_other_dtypes=DOCUMENTS[:3],
                          emulated=[(2, "float16"), (3, "bfloat16")], emulated_cases=DOCUMENTS[:4],
                          emulated_options={"seqlen_local": 32}),
    # blocks of other lengths than this rank's reach the kernels; "auto" plans from the agreed
    # partition and mask, so every rank must pick the same strategy (else the job hangs)
    "uneven": MaskKind(cases=UNEVEN, in_other_dtypes=UNEVEN[2:4] + UNEVEN[6:7] + UNEVEN[9:10],
                       emulated=[(3, "float16")], emulated_cases=[UNEVEN[0], UNEVEN[3], UNEVEN[6]],
                       auto_worlds=(3, 4)),
    # rectangles of every kind reach the kernels as Blocks with shifted diagonals
    "block masks": MaskKind(cases=BLOCKS, in_other_dtypes=BLOCKS[2:4],
                            emulated=[(3, "float16")], emulated_cases=BLOCKS[1:4],
                            emulated_options={"seqlen_local": 16}, auto_worlds=(4,)),
}

EMULATED_RUNS = [(kind, world, dtype) for kind, spec in MASK_KINDS.items()
                 for world, dtype in spec.emulated]
AUTO_RUNS = [(kind, world) for kind, spec in MASK_KINDS.items() for world in spec.auto_worlds]


# (world, strategy) of the runs only -m slow takes: ring and all-gather on 1 and 2 ranks. The
# default run has every strategy on 3 and 4 ranks (the longest rings, uneven shards on 3) and
# burst on 1 to 4 ranks.
SLOW_RINGS = {(w, s) for w in (1, 2) for s in ("ring", "allgather")}


@pytest.mark.mpi
@pytest.mark.parametrize("world,strategy", [
    pytest.param(w, s, marks=[pytest.mark.slow] if (w, s) in SLOW_RINGS else [])
    for w in (1, 2, 3, 4) for s in ("burst", "ring", "allgather")])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_every_ring_strategy_matches_the_reference(kind, world, strategy):
    """Every case of the kind on 1 to 4 ranks, float32 on the NumPy backend."""
    run_mpi(world, BODY, timeout=240, strategy=strategy, cases=MASK_KINDS[kind].cases)


@pytest.mark.mpi
@pytest.mark.parametrize("world,strategy,degree", [(2, "ulysses", None), (4, "ulysses", None),
                                                   (4, "usp", 2)])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_the_all_to_all_strategies_match_the_reference(kind, world, strategy, degree):
    """Ulysses over 2 and 4 ranks, USP as 2 x 2: the mask crosses the all-to-all exchanges."""
    run_mpi(world, BODY, timeout=240, strategy=strategy, ulysses_degree=degree,
            cases=MASK_KINDS[kind].cases)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float64", "float16"])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_float64_and_float16_match_the_reference(kind, dtype):
    """Some cases of the kind again on 3 ranks, in float64 and in float16."""
    run_mpi(3, BODY, timeout=240, dtype=dtype, cases=MASK_KINDS[kind].in_other_dtypes)


@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.parametrize("kind,world,dtype", EMULATED_RUNS)
def test_the_emulated_kernels_match_the_reference(kind, world, dtype):
    """The CUDA kernels (through the CPU emulator) on a real ring: windows bound their keys,
    documents add rectangles, uneven shards give blocks of other lengths than this rank's."""
    spec = MASK_KINDS[kind]
    run_mpi(world, BODY, timeout=600, backend="emulated", dtype=dtype, cases=spec.emulated_cases,
            **spec.emulated_options)


@pytest.mark.mpi
@pytest.mark.parametrize("kind,world", AUTO_RUNS)
def test_auto_picks_the_same_strategy_on_every_rank(kind, world):
    """strategy="auto" plans from the agreed partition and mask: every rank runs the same
    strategy (a rank picking another would hang the job into its timeout)."""
    run_mpi(world, BODY, timeout=240, strategy="auto", cases=MASK_KINDS[kind].cases)


@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.parametrize("world", [2, 3])
def test_packed_documents_run_the_hopper_list_kernels_on_the_ring(world):
    """Packed documents (per-document zigzag, "documents" and contiguous shards, causal and not) on the
    Hopper kernel table (arch="sm_90a", head dim 64): a step's many rectangles go to the Hopper
    list kernels in one launch, forward (flash_fwd_steps_sm90) and dK/dV (flash_bwd_dkdv_steps_sm90,
    with atomic dQ), packed into the kernels' tiles where they are small (ops/cuda/packing.py),
    and out, lse, dq, dk, dv match float64 on every rank."""
    cases = [{"causal": True, "layout": "zigzag", "doc_lengths": MIX},
             {"causal": False, "layout": "contiguous", "doc_lengths": MIX},
             {"causal": True, "layout": "documents", "doc_lengths": MIX}]
    for rank, result in enumerate(run_mpi(world, BODY, timeout=600, backend="emulated",
                                          dtype="bfloat16", cases=cases, seqlen_local=48, headdim=64,
                                          options={"arch": "sm_90a"})):
        assert {"flash_fwd_steps_sm90", "flash_bwd_dkdv_steps_sm90"} <= set(result["kernels"]), \
            (rank, result)
        assert result["packed"] > 0, (rank, result)
