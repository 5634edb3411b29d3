"""burstcu.decode and burstcu.KVCache (issue: sequence-sharded KV-cache decode): decode against
float64 at G = 1..4 under real mpiexec (GQA, uneven cache rows across ranks and batch rows, NaN
past cache_seqlens, a batch row with no row anywhere), bytes per rank independent of the cache
length, bad input and disagreeing ranks refused on every rank, the cache's balanced appends and
capacity error, and prefill + greedy decode giving the tokens of one process."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import burstcu
from burstcu.engine.decode import decode_bytes
from burstcu.testing.reference import attention_ref
from tests.mpi_run import ROOT, mpiexec, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_decode_matches_reference(world):
    results = run_mpi(world, "decode_bodies:decode_matches_reference")
    assert len({r["bytes"] for r in results}) == 1


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_decode_in_every_dtype(dtype):
    run_mpi(3, "decode_bodies:decode_matches_reference", dtype=dtype)


@pytest.mark.mpi
@pytest.mark.emulated
def test_decode_on_the_emulated_backend():
    run_mpi(2, "decode_bodies:decode_matches_reference", backend="emulated", dtype="float16")


def test_bytes_do_not_grow_with_the_cache():
    q = np.zeros((2, 1, 8, 64), np.float16)
    assert decode_bytes(4, q) == 3 * 2 * 1 * 8 * 66 * 4
    assert decode_bytes(1, q) == 0


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 3])
def test_kv_cache_balances_and_refuses_when_full(world):
    for result in run_mpi(world, "decode_bodies:kv_cache_appends_balance_and_decode"):
        assert "KVCache is full" in result["full"]


@pytest.mark.mpi
@pytest.mark.parametrize("kind,text", [("q_shape", "q shape"), ("seqlens_range", "lie in [0, 5]"),
                                       ("seqlens_dtype", "integers"), ("heads", "does not fit"),
                                       ("cache_counts", "kv_cache_counts")])
def test_bad_decode_input_raises_on_every_rank(kind, text):
    for rank, result in enumerate(run_mpi(3, "decode_bodies:decode_bad_input_raises_everywhere",
                                          kind=kind)):
        assert result["raised"] and text in result["raised"], (rank, result)


def test_nan_past_the_valid_rows_is_inert():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 1, 2, 8)), rng.standard_normal((1, 9, 2, 8)), rng.standard_normal((1, 9, 2, 8))
    k[:, 4:], v[:, 4:] = np.nan, np.inf
    out = burstcu.decode(q, k, v, cache_seqlens=[4])
    assert np.abs(out - attention_ref(q, k[:, :4], v[:, :4])[0]).max() < 1e-12


def test_a_long_cache_is_reduced_in_chunks():
    """More keys than one chunk (burstcu.ops.decode.CHUNK): the online softmax across chunks."""
    from burstcu.ops.decode import CHUNK
    rng = np.random.default_rng(1)
    n = CHUNK * 2 + 5
    q, k, v = rng.standard_normal((1, 2, 2, 8)) * 3, rng.standard_normal((1, n, 1, 8)), rng.standard_normal((1, n, 1, 8))
    out, lse = burstcu.decode(q, k, v, return_lse=True)
    ref_out, ref_lse = attention_ref(q, k, v)
    assert np.abs(out - ref_out).max() < 1e-12 and np.abs(lse - ref_lse).max() < 1e-12


def _generate(world: int, prompt: int, tmp_path) -> list[int]:
    out = tmp_path / f"tokens_{world}.json"
    cmd = [sys.executable, str(ROOT / "examples" / "decode_numpy.py"), "--prompt", str(prompt),
           "--new", "10", "--json", str(out)]
    if world > 1:
        cmd = [mpiexec(), "-n", str(world)] + cmd
    subprocess.run(cmd, check=True, timeout=120, cwd=ROOT, capture_output=True)
    return json.loads(out.read_text())["tokens"]


@pytest.mark.mpi
def test_prefill_then_greedy_decode_gives_the_reference_tokens(tmp_path):
    """examples/decode_numpy.py: zigzag prefill over G ranks, then decode through KVCache; the
    tokens equal the example's plain-NumPy generation (no burstcu: full attention recomputed at
    every step) at G = 1, 2, 3 (prompt lengths that no G divides) — and that reference is
    sensitive: dropping half of the cache changes its tokens."""
    sys.path.insert(0, str(ROOT / "examples"))
    import decode_numpy as ex

    for prompt in (37, 40):
        tokens = np.random.default_rng(1).integers(0, ex.VOCAB, prompt)
        want = ex.reference_generate(tokens, 10)
        assert len(set(want)) > 4, want                       # not a short cycle
        # a cache missing its first half (or its second) gives other tokens
        for drop in (lambda n: np.arange(n // 2), lambda n: np.arange(n // 2, n)):
            assert ex.reference_generate(tokens, 10, keep=drop) != want
        for world in (1, 2, 3):
            assert _generate(world, prompt, tmp_path) == want, (prompt, world)
