"""burstcu.decode and burstcu.KVCache (issue: sequence-sharded KV-cache decode): decode against
float64 at G = 1..4 under real mpiexec (GQA, uneven cache rows across ranks and batch rows, NaN
past cache_seqlens, a batch row with no row anywhere), bytes per rank independent of the cache
length, bad input and disagreeing ranks refused on every rank, the cache's balanced appends and
capacity error, a paged cache (pages taken as rows arrive, read through the page table, given
back by clear) on the NumPy and emulated-kernel backends, and prefill + greedy decode giving
the tokens of one process. Bad cache input changes nothing: rows that are not real numbers,
a store that fails (its pages given back), clear of rows that are not batch rows (on every
rank), page table entries under the valid rows that name no page."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import burstcu
from burstcu.engine.decode import decode_bytes
from burstcu.ops import decode as decode_xp
from burstcu.ops.decode import PagedRows
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
@pytest.mark.parametrize("world", [1, 2])   # one rank: the split kernel and the finish, no merge
def test_decode_on_the_emulated_backend(world):
    run_mpi(world, "decode_bodies:decode_matches_reference", backend="emulated", dtype="float16")


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
@pytest.mark.parametrize("world,page_size", [(1, 4), (3, 1), (3, 4)])
def test_paged_kv_cache(world, page_size):
    for result in run_mpi(world, "decode_bodies:kv_cache_appends_balance_and_decode",
                          page_size=page_size):
        assert "KVCache is full" in result["full"]


@pytest.mark.mpi
@pytest.mark.emulated
@pytest.mark.parametrize("world", [1, 2])
def test_paged_kv_cache_on_the_emulated_backend(world):
    run_mpi(world, "decode_bodies:kv_cache_appends_balance_and_decode", page_size=2,
            backend="emulated", dtype="float16")


def test_a_paged_pool_smaller_than_the_batch_needs_is_full_in_time():
    """num_pages below batch x pages a row: the append that needs one page too many raises
    (before storing anything); clear gives a sequence's pages back for the next one."""
    cache = burstcu.KVCache(None, 2, 8, 1, 4, np.float64, page_size=4, num_pages=3)
    rows = np.ones((2, 4, 1, 4))
    cache.append(rows, rows)                                  # a page each
    with pytest.raises(ValueError, match="KVCache is full"):
        cache.append(rows[:, :1], rows[:, :1])                # would take four pages
    assert cache.seqlens.tolist() == [4, 4]
    cache.clear([0])                                          # batch row 0 ends
    cache.append(2 * rows[:, :1], 3 * rows[:, :1])            # row 0 anew, row 1 a second page
    assert cache.seqlens.tolist() == [1, 5] and sorted(cache.page_table[cache.page_table >= 0]) == [0, 1, 2]
    out = cache.decode(np.ones((2, 1, 2, 4)))
    w = np.exp(np.array([2.0] * 4 + [4.0]))                   # scores 1.0.k / sqrt(4) of row 1
    assert np.allclose(out[0], 3) and np.allclose(out[1], (w[:4].sum() + 3 * w[4]) / w.sum())


@pytest.mark.mpi
@pytest.mark.parametrize("kind,text", [("q_shape", "q shape"), ("seqlens_range", "lie in [0, 5]"),
                                       ("seqlens_dtype", "integers"), ("heads", "does not fit"),
                                       ("no_token", "has an empty axis"),
                                       ("q_dtype", "q has dtype int32"),
                                       ("cache_counts", "the KV cache's rows (every rank appends and "
                                                        "clears the same rows): rank 0 '2 rows, "),
                                       ("q_values", "q's values on rank 2 differ from rank 0's by more "
                                                    "than rounding")])
def test_bad_decode_input_raises_on_every_rank(kind, text):
    for rank, result in enumerate(run_mpi(3, "decode_bodies:decode_bad_input_raises_everywhere",
                                          kind=kind)):
        assert result["raised"] and text in result["raised"], (rank, result)


@pytest.mark.mpi
def test_q_off_by_rounding_on_one_rank_is_the_same_token():
    """q computed on each rank may differ in its last bits (another BLAS path): the ranks agree
    on q's values within a few ulps, so that decodes."""
    for result in run_mpi(3, "decode_bodies:decode_bad_input_raises_everywhere", kind="q_rounding"):
        assert result["raised"] is None, result


def _q_nudged(q, ulps):
    """q with each element moved by up to `ulps` units in its last place (random directions)."""
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[q.dtype.itemsize]
    raw = q.copy().view(bits)   # one ulp is one step of the bit pattern, away from zero or towards it
    steps = np.random.default_rng(1).integers(-ulps, ulps + 1, size=q.shape)
    away = np.where(np.signbit(q.astype(np.float64)), -steps, steps)
    return (raw.astype(np.int64) + away).astype(bits).view(q.dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_q_that_differs_on_one_rank_by_more_than_rounding_is_refused(dtype):
    """The same-q check works head by head: one element of one head moved, NaN in another place,
    another token are refused on both ranks, naming where; q moved by 4 ulps an element on one
    rank decodes, on both ranks alike."""
    from burstcu.ops.base import as_dtype
    from burstcu.testing.world import RankFailed, run_ranks
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 16, 64)).astype(as_dtype(dtype))
    k, v = rng.standard_normal((2, 2, 2, 8, 4, 64)).astype(as_dtype(dtype))   # (k or v, rank, B, S, Hkv, D)
    head_halved, element, nan, nan_moved = q.copy(), q.copy(), q.copy(), q.copy()
    head_halved[1, 0, 9] /= 2
    element[1, 1, 3, 7] += 8
    nan[0, 0, 0, 0] = nan_moved[0, 0, 0, 1] = np.nan
    stale = rng.standard_normal(q.shape).astype(q.dtype)
    for mine, other, text in ((q, head_halved, "at batch row 1, token 0, head 9"),
                              (q, element, "at batch row 1, token 1, head 3"),
                              (q, nan, "q's NaN and inf on rank 1 are not where rank 0's are"),
                              (nan, nan_moved, "q's NaN and inf on rank 1 are not where rank 0's are"),
                              (q, stale, "differ from rank 0's by more than rounding")):
        def body(group, mine=mine, other=other):
            with pytest.raises(ValueError, match="ranks disagree in decode") as raised:
                burstcu.decode(mine if group.rank == 0 else other, k[group.rank], v[group.rank], group)
            return str(raised.value)
        assert all(text in said for said in run_ranks(2, body, timeout=60)), text
    nudged = _q_nudged(q, 4)
    assert not np.array_equal(nudged, q)
    outs = run_ranks(2, lambda g: burstcu.decode(q if g.rank == 0 else nudged, k[g.rank], v[g.rank], g))
    np.testing.assert_array_equal(outs[0], outs[1])
    if dtype in ("float32", "float64"):   # a token that correlates 0.999 with q's is another token
        near = (0.999 * q + 0.045 * rng.standard_normal(q.shape)).astype(q.dtype)
        with pytest.raises(RankFailed, match="differ from rank 0's by more than rounding"):
            run_ranks(2, lambda g: burstcu.decode(q if g.rank == 0 else near, k[g.rank], v[g.rank], g))


def test_q_near_the_largest_float64_is_compared_too():
    """Sums of q near 1e308 overflowed to inf, inf - inf is NaN, and NaN > bound is False: a
    negated q was taken for the same."""
    from burstcu.validate import q_summary, q_values_problem
    q = np.random.default_rng(0).uniform(1e307, 1.7e308, (1, 1, 4, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert q_values_problem([q_summary(q), q_summary(q.copy())]) is None
        assert "more than rounding at batch row 0, token 0, head 0" in q_values_problem([q_summary(q),
                                                                                       q_summary(-q)])


def test_q_of_one_token_computed_two_ways_decodes():
    """float32 q = h @ W on one rank, the same product by einsum on the other: elements differ by
    far more than their own ulps where the sum cancels, which a check of 4 ulps of each head's
    summed |q| refused; q is the same token, so it decodes."""
    from burstcu.testing.world import run_ranks
    rng = np.random.default_rng(0)
    h = rng.standard_normal((2, 1, 8192)).astype(np.float32)
    w = (rng.standard_normal((8192, 16 * 128)) / np.sqrt(8192)).astype(np.float32)
    by_blas, by_einsum = (h @ w).reshape(2, 1, 16, 128), np.einsum("btk,kn->btn", h, w).reshape(2, 1, 16, 128)
    assert np.abs(by_blas - by_einsum).max() > 0
    k, v = rng.standard_normal((2, 2, 2, 8, 4, 128)).astype(np.float32)
    outs = run_ranks(2, lambda g: burstcu.decode(by_blas if g.rank == 0 else by_einsum, k[g.rank],
                                                 v[g.rank], g))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_nan_past_the_valid_rows_is_inert():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 1, 2, 8)), rng.standard_normal((1, 9, 2, 8)), rng.standard_normal((1, 9, 2, 8))
    k[:, 4:], v[:, 4:] = np.nan, np.inf
    out = burstcu.decode(q, k, v, cache_seqlens=[4])
    assert np.abs(out - attention_ref(q, k[:, :4], v[:, :4])[0]).max() < 1e-12


def test_a_nan_in_a_valid_row_reaches_the_rows_that_see_it():
    """A NaN in a valid K row, or in one head of q, makes out and lse NaN where the math reads it
    (that batch row; that head), not the out 0 / lse -inf of a row with no valid key, which stays
    for the batch row of length 0 only (docs/numerics.md: a row that sees one gets NaN/Inf)."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, 1, 4, 8)), rng.standard_normal((3, 9, 2, 8)), rng.standard_normal((3, 9, 2, 8))
    k[0, 2] = np.nan                       # valid in batch row 0 (length 5)
    q[1, :, 0] = np.nan                    # head 0 of batch row 1
    out, lse = burstcu.decode(q, k, v, cache_seqlens=[5, 9, 0], return_lse=True)
    assert np.isnan(out[0]).all() and np.isnan(lse[0]).all()
    assert np.isnan(out[1, :, 0]).all() and np.isnan(lse[1, 0]).all()
    finite_q = np.nan_to_num(q[1:2])                                   # heads 1..3 of row 1
    ref_out, ref_lse = attention_ref(finite_q, k[1:2], v[1:2])
    assert np.abs(out[1:2, :, 1:] - ref_out[:, :, 1:]).max() < 1e-12
    assert np.abs(lse[1:2, 1:] - ref_lse[:, 1:]).max() < 1e-12
    assert not out[2].any() and np.isneginf(lse[2]).all()


@pytest.mark.parametrize("backend,dtype", [("numpy", "float32"),
                                           pytest.param("emulated", "float16", marks=pytest.mark.emulated)])
def test_a_nan_in_v_and_scores_all_minus_inf_as_documented(backend, dtype):
    """docs/decode.md: a NaN in a valid row of V makes NaN only the out columns it reaches (no
    score reads V: lse and the other columns as without it); a query whose scores over the valid
    rows are all -inf (an Inf key against a q of the other sign) gets out 0, lse -inf, as a batch
    row with no valid row does. Batch row 0: the NaN; row 1: one valid key, k = +inf in a column
    where q < 0. One rank, the op's finish (emulated: the split kernel and flash_decode_finish)."""
    rng = np.random.default_rng(5)
    dt, d = np.dtype(dtype), 64
    q = rng.standard_normal((2, 1, 2, d)).astype(dt)
    k, v = (rng.standard_normal((2, 8, 1, d)).astype(dt) for _ in range(2))
    q[1, :, :, 3], k[1, 0, 0, 3] = -1.0, np.inf
    clean = v.copy()
    v[0, 2, 0, 5] = np.nan
    g = burstcu.init(backend=backend)
    try:
        got = burstcu.decode(q, k, v, g, cache_seqlens=[6, 1], return_lse=True)
        without = burstcu.decode(q, k, clean, g, cache_seqlens=[6, 1], return_lse=True)
        out, lse, out_clean, lse_clean = (np.asarray(x, np.float64) for x in (*got, *without))
    finally:
        g.close()
    assert np.isnan(out[0, ..., 5]).all(), out[0, ..., 5]
    rest = np.delete(np.arange(d), 5)
    np.testing.assert_array_equal(out[0][..., rest], out_clean[0][..., rest])
    np.testing.assert_array_equal(lse[0], lse_clean[0])
    ref_out, ref_lse = attention_ref(q[:1].astype(np.float64), k[:1, :6].astype(np.float64),
                                     clean[:1, :6].astype(np.float64))
    assert np.abs(lse[0] - ref_lse[0]).max() < 1e-2 and np.abs(out_clean[0] - ref_out[0]).max() < 1e-2
    assert not out[1].any() and np.isneginf(lse[1]).all(), (out[1], lse[1])


@pytest.mark.parametrize("backend,dtype", [("numpy", "float32"),
                                           pytest.param("emulated", "float16", marks=pytest.mark.emulated)])
@pytest.mark.parametrize("case", ["one key far above the rest", "a rank with no valid rows"])
def test_the_merge_shifts_by_the_largest_max_of_any_rank(backend, dtype, case):
    """Decode over 2 ranks (threads on the loopback) with logits of 100-150: the merge of the
    ranks' partials must shift by the largest max of all ranks. Shifting by one rank's (rank 0's
    keys score 0, or it holds no valid row) overflows: out NaN, lse inf."""
    from burstcu.testing.reference import within_fa_rule
    from burstcu.testing.world import run_ranks
    dt, d = np.dtype(dtype), 8
    if case == "one key far above the rest":     # rank 0's keys score 0, rank 1's 150: out = v1 = 1
        q = np.zeros((1, 1, 2, d), dt)
        q[..., 0] = 30.0
        ks = [np.zeros((1, 2, 1, d), dt) for _ in range(2)]
        vs = [np.full((1, 2, 1, d), x, dt) for x in (-1, 1)]
        ks[0][..., 1], ks[1][..., 0] = 1.0, 5.0
        lengths = [None, None]
    else:                                        # rank 0 holds no valid row; logits of order 100
        rng = np.random.default_rng(3)
        q = (rng.standard_normal((1, 1, 2, d)) * 40).astype(dt)
        ks = [rng.standard_normal((1, 4, 1, d)).astype(dt) for _ in range(2)]
        vs = [rng.standard_normal((1, 4, 1, d)).astype(dt) for _ in range(2)]
        lengths = [[0], [4]]

    def body(group):
        r = group.rank
        out, lse = burstcu.decode(q, ks[r], vs[r], group, softmax_scale=1.0, return_lse=True,
                                  cache_seqlens=lengths[r])
        return np.asarray(out, np.float64), np.asarray(lse, np.float64)

    rows = [slice(None) if n is None else slice(0, n[0]) for n in lengths]   # each rank's valid rows
    k_all, v_all = (np.concatenate([x[:, r] for x, r in zip(xs, rows)], axis=1) for xs in (ks, vs))
    ref_out, ref_lse = attention_ref(q, k_all, v_all, softmax_scale=1.0)
    naive_out, naive_lse = attention_ref(q, k_all, v_all, softmax_scale=1.0, dtype=np.float32, round_to=dt)
    eps = float(np.finfo(dt).eps)
    for out, lse in run_ranks(2, body, backend=backend):
        assert np.isfinite(out).all() and np.isfinite(lse).all(), (out, lse)
        for got, ref, naive in ((out, ref_out, naive_out), (lse, ref_lse, naive_lse)):
            ok, err, bound = within_fa_rule(got, ref, naive, eps)
            assert ok, (err, bound)


def test_a_paged_prefill_leaves_its_pages_taken():
    """A paged cache filled by from_prefill (whole pages), then appended to: the append takes a
    free page, never one the prefill holds, and decode reads prefill and appended rows."""
    rng = np.random.default_rng(4)
    b, n, page = 2, 4, 4
    cache = burstcu.KVCache(None, b, 16, 1, 8, np.float64, page_size=page)
    k, v = rng.standard_normal((b, n, 1, 8)), rng.standard_normal((b, n, 1, 8))
    cache.from_prefill(k, v)
    k1, v1 = rng.standard_normal((b, 1, 1, 8)), rng.standard_normal((b, 1, 1, 8))
    cache.append(k1, v1)
    used = cache.page_table[:, :2]
    assert len(set(used.ravel().tolist())) == used.size, cache.page_table
    q = rng.standard_normal((b, 1, 2, 8))
    ref, _ = attention_ref(q, np.concatenate([k, k1], 1), np.concatenate([v, v1], 1))
    assert np.abs(cache.decode(q) - ref).max() < 1e-12


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


def test_decode_example_refuses_an_unwritable_json_before_running(tmp_path, monkeypatch):
    """`--json /nonexistent/x.json` failed only after the whole run: a usage error at once; an
    existing writable file in a folder this user cannot write to is taken."""
    for path in ("/nonexistent/x.json", str(tmp_path)):
        proc = subprocess.run([sys.executable, str(ROOT / "examples" / "decode_numpy.py"), "--json", path],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and "generated" not in proc.stdout, proc.stdout + proc.stderr
        assert f"--json {path}: not a file in a folder this user can write to" in proc.stderr
    # a file that exists and can be written, in a folder that cannot (/dev/null for a user
    # who is not root; every folder refused here): taken
    spec = importlib.util.spec_from_file_location("decode_numpy", ROOT / "examples" / "decode_numpy.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: not os.path.isdir(p) and real_access(p, mode))
    written = tmp_path / "x.json"
    written.write_text("")
    assert example.writable_file(str(written)) and example.writable_file("/dev/null")
    assert not example.writable_file(str(tmp_path / "new.json"))


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


def _paged_cache(pool=None):
    """A one-process paged cache, batch 2, 8 rows a batch row in pages of 2, 2 rows appended."""
    cache = burstcu.KVCache(None, 2, 8, 1, 4, np.float64, page_size=2, num_pages=pool)
    rows = np.arange(16.0).reshape(2, 2, 1, 4)
    cache.append(rows, rows)
    return cache


def _state(cache):
    return cache.page_table.copy(), list(cache._free), cache.counts.copy()


def _same_state(cache, state):
    table, free, counts = state
    return (np.array_equal(cache.page_table, table) and sorted(cache._free) == sorted(free)
            and np.array_equal(cache.counts, counts))


@pytest.mark.parametrize("bad", [np.full((2, 3, 1, 4), "x"), np.ones((2, 3, 1, 4), np.complex128),
                                 np.ones((2, 3, 1, 4), object)], ids=["str", "complex", "object"])
def test_append_of_rows_the_cache_cannot_hold_changes_nothing(bad):
    """Strings, complex numbers, objects: refused before any page is taken (three rows a batch
    row would take a page more each), and the cache takes real rows after."""
    cache = _paged_cache()
    state = _state(cache)
    with pytest.raises(TypeError, match="real numbers"):
        cache.append(bad, np.ones((2, 3, 1, 4)))
    assert _same_state(cache, state)
    cache.append(np.ones((2, 3, 1, 4), np.float16), np.ones((2, 3, 1, 4), np.int32))
    assert cache.seqlens.tolist() == [5, 5] and (cache.page_table >= 0).sum() == 6


def test_append_of_a_ranks_own_rows_is_refused_on_every_rank():
    """Each rank's shard of a prefill given to append (whose rows are the same on every rank,
    each stored on one rank) kept half the rows, silently (decode off by 0.7): refused on every
    rank, the cache unchanged; the same rows taken by from_prefill decode right."""
    from burstcu.testing.world import run_ranks

    rng = np.random.default_rng(0)
    K, V = (rng.standard_normal((1, 12, 2, 8)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 1, 4, 8)).astype(np.float32)

    def body(group):
        cache = burstcu.KVCache(group, 1, 12, 2, 8, np.float32)
        k_local, v_local = burstcu.shard(K, group), burstcu.shard(V, group)
        with pytest.raises(ValueError) as refused:
            cache.append(k_local, v_local)
        kept = cache.seqlens.tolist()
        cache.from_prefill(k_local, v_local)
        return str(refused.value), kept, cache.decode(q)
    want = attention_ref(q, K, V)[0]
    for said, kept, out in run_ranks(2, body):
        assert said.startswith("KVCache.append: k_new is one rank's shard of 2 (as burstcu.shard "
                               "cut it), but append takes rows that are the same on every rank"), said
        assert kept == [0]
        assert np.abs(out - want).max() < 1e-5


@pytest.mark.parametrize("paged", [False, True])
def test_rows_appended_otherwise_on_one_rank_are_refused_at_the_next_decode(paged):
    """Append sends nothing, so rows given otherwise on one rank (a new token's keys computed
    from that rank's own state) were stored as they came, each on one rank, and decoded silently
    wrong. The next decode compares the rows every rank appended since the last one (beyond
    rounding, as q): a ValueError on every rank naming the append and the position, again at
    every decode while the cache holds them (a decode refused for another reason compares them
    later all the same), none once the batch row is cleared. Rows one rounding apart, and
    integer rows, decode."""
    from burstcu.testing.world import run_ranks

    rng = np.random.default_rng(1)
    K, V = (rng.standard_normal((2, 6, 2, 8)).astype(np.float32) for _ in range(2))
    new = [rng.standard_normal((2, 1, 2, 8)).astype(np.float32) for _ in range(4)]
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)
    pages = {"page_size": 2} if paged else {}

    def body(group):
        cache = burstcu.KVCache(group, 2, 12, 2, 8, np.float32, **pages)
        cache.from_prefill(burstcu.shard(K, group), burstcu.shard(V, group))
        cache.append(new[0], new[1])
        k_new = new[2].copy()
        if group.rank == 1:
            k_new[1, 0, 1, 3] += 0.5                     # batch row 1, kv head 1: another token's
        cache.append(k_new, new[3])
        with pytest.raises(ValueError, match="softmax_scale"):
            cache.decode(q, softmax_scale=float("nan"))  # refused first for what it is
        said = []
        for _ in range(2):                               # the rows are still there: again
            with pytest.raises(ValueError) as refused:
                cache.decode(q)
            said.append(str(refused.value))
        cache.clear(1)
        cleared = cache.decode(q)
        close = np.nextafter(new[0], np.inf) if group.rank == 1 else new[0]   # a rounding apart
        cache.append(close, new[1])
        cache.append(np.ones((2, 1, 2, 8), np.int8), np.zeros((2, 1, 2, 8), bool))
        return said, cleared, cache.decode(q)
    for said, cleared, out in run_ranks(2, body):
        for text in said:
            assert ("ranks disagree in decode: the rows KVCache.append took since the last decode "
                    "differ on rank 1 from rank 0's by more than rounding at k_new of call 2, batch "
                    "row 1, token 0, kv head 1: every rank must append the same rows") in text, text
        assert np.isfinite(cleared).all() and np.isfinite(out).all()


def test_appended_rows_summarised_in_runs_name_the_run():
    """Past 1,024 rows x heads the summary takes heads in runs (as q's): the refusal names the
    first and the last place of the run that moved. 64 one-token calls, 16 batch rows, one kv
    head: runs of 2, a token's k_new and v_new; v_new of call 11, batch row 5 moved."""
    from burstcu.validate import appended_rows, appended_rows_problem, q_summary

    rng = np.random.default_rng(2)
    calls = [(rng.standard_normal((16, 1, 1, 8)), rng.standard_normal((16, 1, 1, 8)), range(1))
             for _ in range(64)]
    moved = [(k, v.copy(), t) for k, v, t in calls]
    moved[10][1][5, 0, 0, 2] += 1.0
    summaries = [(q_summary(rows), tokens) for rows, tokens in map(appended_rows, (calls, moved))]
    assert summaries[0][0][1] == 2                       # runs of 2 heads
    said = appended_rows_problem(summaries)
    assert ("at k_new of call 11, batch row 5, token 0, kv head 0 or a row up to v_new of call 11, "
            "batch row 5, token 0, kv head 0 (by batch row, call, token, k_new then v_new)") in said, said
    assert appended_rows_problem([summaries[0], summaries[0]]) is None


def test_a_caches_own_arrays_without_its_row_counts_are_refused_until_full():
    """decode(q, cache.k, cache.v, group) without cache_seqlens reads every row of the buffers:
    with rows not filled yet it was off by 1.4, silently; now a ValueError on every rank saying
    what to pass. A paged cache's pool is refused with its counts too (a pool shaped as the
    rows, read as batch rows, was off by 1.3). Once every row is filled the call is right and
    runs; cache_seqlens=cache.seqlens runs at any fill, and arrays the cache no longer holds
    are arrays like any other."""
    from burstcu.testing.world import run_ranks

    rng = np.random.default_rng(0)
    K, V = (rng.standard_normal((1, 8, 2, 8)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 1, 4, 8)).astype(np.float32)

    def body(group):
        cache = burstcu.KVCache(group, 1, 4, 2, 8, np.float32)
        paged = burstcu.KVCache(group, 1, 4, 2, 8, np.float32, page_size=2)
        cache.append(K[:, :6], V[:, :6])
        paged.append(K[:, :6], V[:, :6])
        said = []
        for c, counts in ((cache, None), (paged, None), (paged, paged.seqlens)):
            with pytest.raises(ValueError) as refused:
                burstcu.decode(q, c.k, c.v, group, cache_seqlens=counts)
            said.append(str(refused.value))
        part = burstcu.decode(q, cache.k, cache.v, group, cache_seqlens=cache.seqlens)
        cache.append(K[:, 6:], V[:, 6:])
        full = burstcu.decode(q, cache.k, cache.v, group)
        k_old, v_old = cache.k, cache.v
        cache.k, cache.v = cache.k.copy(), cache.v.copy()
        cache.clear(0)
        gone = burstcu.decode(q, k_old, v_old, group)   # full rows the cache no longer holds
        return said, part, full, gone
    pool = ("k_cache is a paged KVCache's page pool, which decode would read as batch rows: pass "
            "the cache itself, decode(q, cache)")
    for said, part, full, gone in run_ranks(2, body):
        assert said == ["k_cache is a KVCache's own array, which decode reads whole without "
                        "cache_seqlens, its rows not filled yet too: pass the cache itself, "
                        "decode(q, cache), or cache_seqlens=cache.seqlens", pool, pool]
        assert np.abs(part - attention_ref(q, K[:, :6], V[:, :6])[0]).max() < 1e-5
        assert np.abs(full - attention_ref(q, K, V)[0]).max() < 1e-5
        assert np.array_equal(gone, full)


def test_a_view_of_a_caches_whole_array_is_refused_as_the_array_is():
    """The cache's arrays given as views of their whole memory (`cache.k[:]`, a torch tensor over
    them, to the plain API and through burstcu.torch) without cache_seqlens: refused as the
    arrays themselves are (every row read as valid: a torch user's from_numpy views were off
    silently); a view of the filled rows alone, or a copy, is arrays like any other."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    K, V = (rng.standard_normal((1, 5, 2, 8)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 1, 4, 8)).astype(np.float32)
    cache = burstcu.KVCache(None, 1, 8, 2, 8, np.float32)
    cache.append(K, V)
    want = attention_ref(q, K, V)[0]
    views = [(cache.k[:], cache.v[:]), (torch.from_numpy(cache.k), torch.from_numpy(cache.v)),
             tuple(t.as_strided(t.shape, (7,) + t.stride()[1:])    # batch 1: any stride steps nowhere
                   for t in (torch.from_numpy(cache.k), torch.from_numpy(cache.v)))]
    for k, v in views:
        with pytest.raises(ValueError, match="k_cache is a KVCache's own array"):
            burstcu.decode(q, k, v)
    with pytest.raises(ValueError, match="k_cache is a KVCache's own array"):
        burstcu.torch.decode(torch.from_numpy(q), *views[1])
    got = burstcu.torch.decode(torch.from_numpy(q), *views[1], cache_seqlens=cache.seqlens)
    assert np.abs(got.numpy() - want).max() < 1e-5
    for k, v in ((cache.k[:, :5], cache.v[:, :5]), (cache.k.copy()[:, :5], cache.v.copy()[:, :5])):
        assert np.abs(burstcu.decode(q, k, v) - want).max() < 1e-5


def test_rows_of_a_caches_array_some_unfilled_are_refused_on_every_rank():
    """cache.k[:, :n] sliced as a cache that is not sharded would be (n tokens appended), given
    without cache_seqlens: each of 2 ranks holds n/2 of the rows, so the slice reads unfilled
    rows as keys (off silently); now a ValueError on every rank naming the rows. Rows that are
    all filled run and give attention over every token; so does the slice with its counts."""
    torch = pytest.importorskip("torch")
    from burstcu.testing.world import run_ranks
    from burstcu.validate import cache_rows_of

    rng = np.random.default_rng(2)
    K, V = (rng.standard_normal((2, 6, 2, 8)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((2, 1, 4, 8)).astype(np.float32)

    def body(group):
        cache = burstcu.KVCache(group, 2, 8, 2, 8, np.float32)
        cache.append(K, V)                                   # 3 rows a rank of each batch row
        said = []
        for k, v in ((cache.k[:, :6], cache.v[:, :6]), (cache.k[1:], cache.v[1:]),
                     (torch.from_numpy(cache.k)[:, 2:5], torch.from_numpy(cache.v)[:, 2:5])):
            with pytest.raises(ValueError) as refused:
                burstcu.decode(q[:k.shape[0]], k, v, group)
            said.append(str(refused.value))
        tk, tv = (torch.from_numpy(x)[:, :6] for x in (cache.k, cache.v))   # copied on the way in
        with pytest.raises(ValueError) as refused:
            burstcu.torch.decode(torch.from_numpy(q), tk, tv, group)
        said.append(str(refused.value))
        assert cache_rows_of(cache.k[:, 3:3]) is None                  # no rows: none read
        filled = burstcu.decode(q, cache.k[:, :3], cache.v[:, :3], group)
        counted = burstcu.decode(q, cache.k[:, :6], cache.v[:, :6], group,
                                 cache_seqlens=cache.seqlens)
        return said, filled, counted
    want = attention_ref(q, K, V)[0]
    for said, filled, counted in run_ranks(2, body, timeout=20):
        assert said[0].startswith("k_cache holds rows 0..5 of batch rows 0..1 of a KVCache's array")
        assert said[1].startswith("k_cache holds rows 0..7 of batch rows 1..1")
        assert said[2].startswith("k_cache holds rows 2..4 of batch rows 0..1")
        assert said[3] == said[0]
        assert all("filled only 3 row(s)" in s for s in said), said
        for got in (filled, counted):
            assert np.abs(got - want).max() < 1e-5


def test_rows_of_a_cache_made_where_dropped_caches_were_are_found():
    """A cache whose arrays are mapped over dropped caches' memory (glibc maps arrays over 32 MiB
    and puts a new mapping over the freed ones) is found for rows past their first bytes too:
    a dropped cache's span left inside a live array hid it, and decode read unfilled rows of
    big.k[1:2, :100] silently. No span starts inside another live array's."""
    from burstcu import validate

    rows = 40 << 14                      # 40 MiB of (1 kv head, 16 float32) rows
    keep = [burstcu.KVCache(None, 1, 8, 1, 16, np.float32) for _ in range(20)]
    dropped = [burstcu.KVCache(None, 1, rows, 1, 16, np.float32) for _ in range(2)]
    del dropped
    big = burstcu.KVCache(None, 2, rows, 1, 16, np.float32)
    big.append(np.ones((2, 1, 1, 16), np.float32), np.ones((2, 1, 1, 16), np.float32))
    q = np.ones((1, 1, 1, 16), np.float32)
    for b in (0, 1):
        with pytest.raises(ValueError, match=f"rows 0..99 of batch rows {b}..{b} of a KVCache"):
            burstcu.decode(q, big.k[b:b + 1, :100], big.v[b:b + 1, :100])
    starts, spans = validate._SPANS
    live = [(start, span[0]) for start, span in zip(starts, spans) if span[1][0]() is not None]
    for (kind, first), end in live:
        assert not [s for s in starts if s[0] == kind and first < s[1] < end]
    assert len(keep) == 20


def test_an_object_that_cannot_say_where_its_elements_lie_is_refused_on_every_rank():
    """decode's look for a cache's memory (a view of its whole array) reads no odd object's
    interface into an error of its own: a malformed __array_interface__ or a sparse tensor on one
    rank is the TypeError every rank raises (it raised on that rank alone, the others waiting)."""
    torch = pytest.importorskip("torch")
    from burstcu.testing.world import run_ranks

    class NoData:
        __array_interface__ = {"shape": (1, 4, 2, 8), "typestr": "<f4", "version": 3}

    odd = [NoData(), torch.zeros(1, 4, 2, 8).to_sparse()]
    q, k = np.ones((1, 1, 2, 8), np.float32), np.ones((1, 4, 2, 8), np.float32)

    def body(group, thing):
        burstcu.KVCache(group, 1, 4, 2, 8, np.float32)     # a cache alive: the look runs
        with pytest.raises(TypeError) as refused:
            burstcu.decode(q, thing if group.rank == 0 else k, k, group)
        return str(refused.value)
    for thing in odd:
        said = run_ranks(2, lambda group: body(group, thing), timeout=10)
        assert said[0] == said[1] and re.match(r"rank 0: (k_cache must|cannot take these inputs)", said[0])


@pytest.mark.parametrize("bad", [None, 1.0], ids=["None", "a number"])
def test_rows_that_are_not_arrays_are_named_by_type(bad):
    """None or a number read as a shape problem, 'got () and ()'."""
    cache = _paged_cache()
    state = _state(cache)
    with pytest.raises(TypeError, match=f"takes k, v arrays .*; k is {type(bad).__name__}"):
        cache.append(bad, bad)
    with pytest.raises(TypeError, match=f"takes k, v arrays .*; v is {type(bad).__name__}"):
        cache.from_prefill(np.ones((2, 3, 1, 4)), bad)
    assert _same_state(cache, state)


@pytest.mark.parametrize("dtype, big", [("float16", 65520.0), ("float16", np.int32(70000)),
                                        ("bfloat16", 1e39), ("float32", 1e39)],
                         ids=["float16", "float16-int32", "bfloat16", "float32"])
def test_rows_beyond_the_cache_dtypes_range_are_refused(dtype, big):
    """A finite value that would be stored as inf (65520 rounds past float16's 65504) is a
    ValueError naming it, in append and in from_prefill, before anything is stored; the
    largest value that fits, and inf or NaN given as such, are stored as they are."""
    cache = burstcu.KVCache(None, 2, 8, 1, 4, dtype)
    rows = np.zeros((2, 3, 1, 4), np.asarray(big).dtype)
    rows[1, 2, 0, 3] = big
    for name, call in (("append", lambda: cache.append(np.zeros_like(rows), rows)),
                       ("from_prefill", lambda: cache.from_prefill(rows, np.zeros_like(rows)))):
        with pytest.raises(ValueError, match=rf"KVCache.{name}.*beyond {dtype}'s range .*"
                                             rf"up to {re.escape(str(big))};"):
            call()
        assert cache.counts.tolist() == [[0, 0]] and not np.asarray(cache.k, np.float64).any()
    fits = float(np.finfo(np.float16).max) if dtype == "float16" else 3.0e38
    special = np.array([fits, -fits, np.inf, np.nan])[None, None, None, :].repeat(2, 0)
    cache.append(special, special)
    stored = np.asarray(cache.k, np.float64)[:, 0, 0]
    assert np.array_equal(stored[:, :3], np.array([[fits, -fits, np.inf]] * 2).astype(dtype)
                          .astype(np.float64)) and np.isnan(stored[:, 3]).all()


def test_a_store_that_raises_gives_its_pages_back(monkeypatch):
    """The third row's store fails (after two rows took a page each): the page table and the
    free pages are as before the append, so the pool fills exactly when the counts say."""
    cache = _paged_cache(pool=4)
    state = _state(cache)
    store, calls = cache._store, []

    def failing(*args):
        calls.append(args)
        if len(calls) == 3:
            raise RuntimeError("store failed")
        store(*args)

    monkeypatch.setattr(cache, "_store", failing)
    with pytest.raises(RuntimeError, match="store failed"):
        cache.append(np.ones((2, 2, 1, 4)), np.ones((2, 2, 1, 4)))
    assert _same_state(cache, state)
    monkeypatch.undo()
    cache.append(np.ones((2, 2, 1, 4)), np.ones((2, 2, 1, 4)))     # the last two pages
    assert not cache._free and cache.seqlens.tolist() == [4, 4]


@pytest.mark.parametrize("rows,error,text", [
    ([0, 2], ValueError, "batch row 2 is not in"), (-1, ValueError, "batch row -1"),
    ([1, -2], ValueError, "batch row -2"), (True, TypeError, "ints"),
    ([np.bool_(False)], TypeError, "ints"), (np.array([True, False]), TypeError, "ints"),
    ([0, 1.0], TypeError, "ints"), ("0", TypeError, "ints"),
])
def test_clear_refuses_rows_that_are_not_batch_rows(rows, error, text):
    """Every row is checked before any is cleared: the valid rows before a bad one stay."""
    cache = _paged_cache()
    state = _state(cache)
    with pytest.raises(error, match=text):
        cache.clear(rows)
    assert _same_state(cache, state)
    cache.clear(np.array([1]))
    cache.clear(np.int64(0))
    assert (cache.page_table < 0).all() and not cache.counts.any() and len(cache._free) == 8


def _paged_rows(table, pages):
    return PagedRows(pages, table, table)


@pytest.mark.parametrize("entry,text", [(-1, "names no page"), (6, "names no page")])
def test_a_table_entry_under_the_valid_rows_must_name_a_page(entry, text):
    """Batch row 1's second page (rows 2..3 of 3 valid) named -1 (NumPy would take the last
    page) or past the pool: refused; the same entry past the valid rows is never read."""
    rng = np.random.default_rng(3)
    q, pages = rng.standard_normal((2, 1, 2, 4)), rng.standard_normal((6, 2, 1, 4))
    table = np.array([[0, 1, -1], [2, entry, 4]], np.int32)
    kv = _paged_rows(table, pages)
    with pytest.raises(ValueError, match=text):
        decode_xp.partial(np, q, kv, kv, [2, 3], 0.5, np.dtype(np.float64))
    acc, m, l = decode_xp.partial(np, q, kv, kv, [2, 2], 0.5, np.dtype(np.float64))
    for b in range(2):                      # two valid rows each: page table[b, 0]
        ref = attention_ref(q[b:b + 1], pages[table[b, 0]][None], pages[table[b, 0]][None],
                            softmax_scale=0.5)[0]
        assert np.abs(acc[b] / l[b].T[..., None] - ref[0]).max() < 1e-12


@pytest.mark.parametrize("table,error", [(np.zeros((2, 3), np.int64), TypeError),
                                         ([[0, 1, 2], [3, 4, 5]], TypeError)])
def test_the_array_path_takes_an_int32_host_table(table, error):
    q, pages = np.ones((2, 1, 2, 4)), np.ones((6, 2, 1, 4))
    kv = _paged_rows(table, pages)
    with pytest.raises(error, match="int32"):
        decode_xp.partial(np, q, kv, kv, [2, 2], 0.5, np.dtype(np.float64))


@pytest.mark.mpi
def test_bad_cache_rows_raise_on_every_rank():
    for rank, result in enumerate(run_mpi(2, "decode_bodies:kv_cache_bad_rows_raise_everywhere")):
        assert result["clear"] and "not in [0, 2)" in result["clear"], (rank, result)
        assert result["append"] and "real numbers" in result["append"], (rank, result)


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_])
def test_a_cache_of_a_dtype_decode_cannot_take_is_refused_when_made(dtype):
    with pytest.raises(TypeError, match="KVCache dtype must be one of float16, bfloat16, float32"):
        burstcu.KVCache(None, 1, 4, 1, 8, dtype)


def test_a_cache_dtype_of_none_is_refused_and_a_torch_dtype_taken_by_name():
    """dtype=None made a float64 cache (NumPy's default); a torch dtype was NumPy's bare
    "Cannot interpret" error."""
    with pytest.raises(TypeError, match="KVCache dtype must be one of float16, .*got None"):
        burstcu.KVCache(None, 1, 4, 1, 8, None)
    torch = pytest.importorskip("torch")
    for given, made in ((torch.float16, np.float16), (torch.bfloat16, "bfloat16"), (torch.float, np.float32),
                        ("float32", np.float32)):
        assert burstcu.KVCache(None, 1, 4, 1, 8, given).k.dtype == np.dtype(made)
    for silly in ("torch.float", "np.float64", "foo.float32"):   # names only of torch's own dtypes
        with pytest.raises(TypeError, match="KVCache dtype must be one of"):
            burstcu.KVCache(None, 1, 4, 1, 8, silly)


def test_kvcache_copies_torch_rows_on_torchs_stream(monkeypatch):
    """On a GPU cache, rows are stored under `arrays.torch_stream` of those rows (torch's current
    stream, where torch wrote them and where `burstcu.torch.decode` reads the cache), by append
    and by from_prefill alike; a host cache never asks for it."""
    import contextlib

    torch = pytest.importorskip("torch")

    from burstcu import kvcache

    entered = []

    def recording(tensors):
        entered.append(tuple(tensors))
        return contextlib.nullcontext()
    monkeypatch.setattr(kvcache, "torch_stream", recording)
    cache = burstcu.KVCache(None, 1, 8, 1, 4, np.float32)
    k, v = torch.ones(1, 2, 1, 4), torch.full((1, 2, 1, 4), 2.0)
    cache.from_prefill(k, v)
    assert entered == []
    monkeypatch.setattr(cache.group.ops, "device", "cuda")   # as a CuPy cache's op says
    cache.from_prefill(k, v)
    cache.append(k[:, :1], v[:, :1])
    assert [tuple(map(id, t)) for t in entered][0] == (id(k), id(v)) and len(entered) == 2
    assert cache.seqlens.tolist() == [3] and float(np.asarray(cache.v)[0, 2, 0, 0]) == 2.0


def test_a_cache_fills_to_exactly_its_capacity():
    """A cache of 4 rows takes 4; the fifth is "full"."""
    cache = burstcu.KVCache(None, 1, 4, 1, 4, np.float64)
    cache.append(np.ones((1, 4, 1, 4)), np.ones((1, 4, 1, 4)))
    assert cache.seqlens.tolist() == [4]
    with pytest.raises(ValueError, match="KVCache is full"):
        cache.append(np.ones((1, 1, 1, 4)), np.ones((1, 1, 1, 4)))


def test_a_prefill_may_fill_the_page_pool_exactly():
    """Two sequences of 4 rows in 4 pages of 2: the pool holds them exactly."""
    cache = burstcu.KVCache(None, 2, 8, 1, 4, np.float64, page_size=2, num_pages=4)
    cache.from_prefill(np.ones((2, 4, 1, 4)), np.ones((2, 4, 1, 4)))
    assert cache.seqlens.tolist() == [4, 4]


def test_appends_after_a_prefill_use_every_free_page():
    """A prefill takes pages 0 and 1; the appends after it take 2 and 3, none lost."""
    cache = burstcu.KVCache(None, 2, 8, 1, 4, np.float64, page_size=2, num_pages=4)
    cache.from_prefill(np.ones((2, 2, 1, 4)), np.ones((2, 2, 1, 4)))
    cache.append(np.ones((2, 2, 1, 4)), np.ones((2, 2, 1, 4)))
    assert sorted(cache.page_table[cache.page_table >= 0].tolist()) == [0, 1, 2, 3]
