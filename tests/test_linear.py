"""Linear attention (LASP-2 and the LASP-1 ring baseline) under real `mpiexec -n 1..4`: out, dq,
dk, dv against the quadratic float64 form over every layout, causal and not, GQA, float32 and
float64; bytes and messages per rank asserted (LASP-2's independent of the sequence length);
bad input on one rank raised on every rank (tests/mpi/strategy_bodies.py)."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from burstcu.engine import lasp1, lasp2
from burstcu.ops import linear
from burstcu.testing.reference import linear_attention_ref
from tests.mpi_run import run_mpi

CASES = [{"causal": c, "layout": lay} for c in (True, False) for lay in ("contiguous", "zigzag")]


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("strategy", ["lasp2", "lasp1"])
def test_linear_attention_matches_reference(world, strategy):
    run_mpi(world, "strategy_bodies:linear_matches_reference", timeout=240, strategy=strategy,
            cases=CASES)


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", ["lasp2", "lasp1"])
def test_linear_attention_in_float64_and_bfloat16(strategy):
    for dtype in ("float64", "bfloat16"):
        run_mpi(3, "strategy_bodies:linear_matches_reference", timeout=240, strategy=strategy,
                dtype=dtype, cases=CASES)


@pytest.mark.mpi
@pytest.mark.emulated
def test_linear_attention_on_the_kernel_backend():
    """The CUDA backend's array path (here its CPU emulation: NumPy arrays, the same code CuPy
    runs) in half precision."""
    run_mpi(2, "strategy_bodies:linear_matches_reference", timeout=240, backend="emulated",
            dtype="float16", cases=CASES[:2])


@pytest.mark.mpi
def test_linear_bad_input_on_one_rank_fails_on_every_rank():
    run_mpi(3, "strategy_bodies:linear_bad_input_on_one_rank", timeout=120)


def test_lasp2_bytes_do_not_depend_on_the_sequence_length():
    for s in (16, 4096, 1 << 20):
        q = np.zeros((1, s, 8, 64), np.float16)
        k = np.zeros((1, s, 2, 64), np.float16)
        assert lasp2.forward_bytes(8, q, k, k) == 7 * 2 * 64 * 64 * 4
        assert lasp2.backward_bytes(8, q, k, k) == 2 * 7 * 2 * 64 * 64 * 4


def test_lasp1_sends_one_state_a_hop_along_the_chain():
    """Contiguous: the causal forward chain 0 -> 1 -> .. -> G-1; the non-causal one adds the
    total's chain G-1 -> 0 -> 1 -> .. -> G-2. Zigzag (chunks 0..2G-1 held by 0, 1, .., G-1,
    G-1, .., 0): ranks 1..G-2 send twice (once a direction), ranks 0 and G-1 once."""
    g = 4
    assert [lasp1.forward_sends(r, g, 8) for r in range(g)] == [1, 1, 1, 0]
    assert [lasp1.forward_sends(r, g, 8, causal=False) for r in range(g)] == [2, 2, 1, 1]
    assert [lasp1.backward_sends(r, g, 8) for r in range(g)] == [1, 2, 2, 1]
    assert [lasp1.forward_sends(r, g, 8, "zigzag") for r in range(g)] == [1, 2, 2, 1]


@pytest.mark.parametrize("causal", [True, False])
def test_chunkwise_tiles_match_the_quadratic_form(causal, monkeypatch):
    """burstcu.ops.linear over several tile sizes (including ones that do not divide the run),
    spans of a few tiles at once (the state carried between spans, the last one padded), and a
    run split in two with the state of the first handed to the second, float64."""
    rng = np.random.default_rng(3)
    q, dout = (rng.standard_normal((2, 77, 6, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 77, 3, 8)) for _ in range(2))
    ref_out, ref_grads = linear_attention_ref(q, k, v, causal, dout=dout)
    acc = np.float64
    if causal:
        for tile, at_once in ((1, 64), (16, 64), (16, 2), (7, 3), (77, 64), (200, 64)):
            monkeypatch.setattr(linear, "TILES_AT_ONCE", at_once)
            np.testing.assert_allclose(linear.forward_run(np, q, k, v, None, acc, tile), ref_out,
                                       rtol=1e-12, atol=1e-10)
            got = linear.backward_run(np, dout, q, k, v, None, None, acc, tile)
            for g, r in zip(got, ref_grads):
                np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-10)
        c = 30
        prefix = linear.kv_state(np, k[:, :c], v[:, :c], acc)
        suffix = linear.grad_state(np, q[:, c:], dout[:, c:], 3, acc)
        second = linear.forward_run(np, q[:, c:], k[:, c:], v[:, c:], prefix, acc, 16)
        np.testing.assert_allclose(second, ref_out[:, c:], rtol=1e-12, atol=1e-10)
        first = linear.backward_run(np, dout[:, :c], q[:, :c], k[:, :c], v[:, :c], None, suffix, acc, 16)
        for g, r in zip(first, ref_grads):
            np.testing.assert_allclose(g, r[:, :c], rtol=1e-12, atol=1e-10)
    else:
        total = linear.kv_state(np, k, v, acc)
        np.testing.assert_allclose(linear.forward_full(np, q, total, acc), ref_out, rtol=1e-12, atol=1e-10)
        grads = linear.backward_full(np, dout, k, v, total, linear.grad_state(np, q, dout, 3, acc), acc)
        for g, r in zip(grads, ref_grads):
            np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("kwargs,kind,message", [
    ({"strategy": "lasp3"}, ValueError, "strategy must be one of"),
    ({"causal": "yes"}, TypeError, "causal must be True or False"),
    ({"layout": "spiral"}, ValueError, "layout must be one of"),
])
def test_bad_linear_options_are_refused(kwargs, kind, message):
    q = np.zeros((1, 8, 2, 4))
    with pytest.raises(kind, match=message):
        burstcu.linear_attention(q, q, q, **kwargs)


@pytest.mark.parametrize("dout,kind,message", [
    (np.zeros((1, 8, 2, 5)), ValueError, "q's shape"), (np.zeros((1, 8, 2, 4), np.float32), TypeError,
                                                       "q's dtype"),
    (None, TypeError, "array like q"), ([[0.0]], TypeError, "array like q")])
def test_bad_dout_is_refused(dout, kind, message):
    q = np.zeros((1, 8, 2, 4))
    with pytest.raises(kind, match=message):
        burstcu.linear_attention_backward(dout, q, q, q)


def _inert_cases(strategies, layouts):
    """Each input poisoned once, at a position inside a tile of some run (not its first row)."""
    values = {"q": np.nan, "k": np.inf, "v": -np.inf, "dout": np.nan}
    spots = {"q": 0.3, "k": 0.55, "v": 0.2, "dout": 0.8}
    return [{"strategy": s, "layout": lay, "name": name, "at": spots[name], "value": values[name]}
            for s in strategies for lay in layouts for name in values]


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 3])
def test_linear_masked_positions_are_inert(world):
    """A NaN / Inf at one position reaches exactly the entries that depend on it, on every rank,
    both strategies and layouts (docs/numerics.md: masked positions are inert)."""
    run_mpi(world, "strategy_bodies:linear_masked_positions_are_inert", timeout=240,
            cases=_inert_cases(("lasp2", "lasp1"), ("contiguous", "zigzag")))


@pytest.mark.parametrize("tile,at_once", [(16, 2), (16, 64), (7, 3)])
def test_chunkwise_tiles_keep_masked_positions_inert(tile, at_once, monkeypatch):
    """burstcu.ops.linear's causal runs with a NaN / Inf at positions inside tiles, at a tile's
    first and last row, and with a prefix and suffix state handed in: exactly the entries that
    depend on the value are non-finite (tests/mpi/strategy_bodies.py, LINEAR_REACH), the others
    equal the float64 quadratic form of the inputs with a 0 there, and bit for bit what the
    same run gives with a 0 there (a tile holding the value was computed row by row whole,
    rounding the rows that cannot see it otherwise)."""
    from tests.mpi.strategy_bodies import LINEAR_REACH, linear_poisoned, linear_reached
    monkeypatch.setattr(linear, "TILES_AT_ONCE", at_once)
    rng = np.random.default_rng(5)
    n, c, acc = 77, 30, np.float64
    clean = {"q": rng.standard_normal((2, n, 6, 8)), "k": rng.standard_normal((2, n, 3, 8)),
             "v": rng.standard_normal((2, n, 3, 8)), "dout": rng.standard_normal((2, n, 6, 8))}
    for name in LINEAR_REACH:
        for p, value in ((40, np.nan), (c + 2 * tile - 1, np.inf), (c + tile, -np.inf), (5, np.nan)):
            poisoned, zeroed = linear_poisoned(clean, name, p, value)
            x, z = poisoned, zeroed
            ref_out, ref_grads = linear_attention_ref(z["q"], z["k"], z["v"], True, dout=z["dout"])
            # rows c.. as a run with the prefix of rows ..c; rows ..c with the suffix of rows c..
            prefix = linear.kv_state(np, x["k"][:, :c], x["v"][:, :c], acc)
            suffix = linear.grad_state(np, x["q"][:, c:], x["dout"][:, c:], 3, acc)
            late = {"out": linear.forward_run(np, x["q"][:, c:], x["k"][:, c:], x["v"][:, c:],
                                              prefix, acc, tile)}
            early = dict(zip(("dq", "dk", "dv"), linear.backward_run(
                np, x["dout"][:, :c], x["q"][:, :c], x["k"][:, :c], x["v"][:, :c], None, suffix,
                acc, tile)))
            whole, zero_whole = {}, {}     # the poisoned inputs' results, and with a 0 there
            for inputs, into in ((x, whole), (z, zero_whole)):
                into.update(zip(("dq", "dk", "dv"), linear.backward_run(
                    np, inputs["dout"], inputs["q"], inputs["k"], inputs["v"], None, None, acc, tile)))
                into["out"] = linear.forward_run(np, inputs["q"], inputs["k"], inputs["v"], None, acc,
                                                 tile)
            refs = {"out": ref_out, **dict(zip(("dq", "dk", "dv"), ref_grads))}
            for got, rows in ((late, slice(c, n)), (early, slice(0, c)), (whole, slice(0, n))):
                for key, value_got in got.items():
                    reached = linear_reached(n, p, LINEAR_REACH[name][key])[rows]
                    nonfinite = ~np.isfinite(value_got).all(axis=(0, 2, 3))
                    assert np.array_equal(nonfinite, reached), (name, p, key, rows)
                    np.testing.assert_allclose(value_got[:, ~reached], refs[key][:, rows][:, ~reached],
                                               rtol=1e-12, atol=1e-10)
                    if got is whole:
                        assert np.array_equal(value_got[:, ~reached], zero_whole[key][:, ~reached]), \
                            (name, p, key)


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_linear_attention_on_lengths_the_ranks_do_not_divide(world):
    """The shards `burstcu.shard` cuts of any N (near-equal contiguous runs, zigzag chunks whose
    two halves differ; down to one row a rank, one a piece) run like equal ones; zigzag with N
    under 2 G (a rank short of a piece) is a ValueError on every rank."""
    cases = [{"causal": c, "layout": lay, "strategy": s} for c in (True, False)
             for lay in ("contiguous", "zigzag") for s in ("lasp2", "lasp1")]
    run_mpi(world, "strategy_bodies:linear_any_length", timeout=240,
            lengths=(61, 6 * world + 5, 2 * world), cases=cases)
