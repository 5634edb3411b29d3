"""MPI bodies of tests/test_decode.py (any world size): decode against a sharded KV cache."""

from __future__ import annotations

import numpy as np

import burstcu
from burstcu.engine.decode import decode_bytes
from burstcu.ops.base import as_dtype
from burstcu.testing.reference import attention_ref
from tests.mpi.bodies import NAIVE, _check


def _spread(rng, total: int, size: int) -> np.ndarray:
    """Uneven row counts per rank adding up to `total` (some ranks may get none)."""
    cuts = np.sort(rng.integers(0, total + 1, size - 1))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def decode_matches_reference(dtype="float32", backend="numpy", b=3, t=2, h=4, hkv=2, d=16):
    """The global cache of each batch row (its own length, one row empty) is dealt to the ranks
    in a random order and uneven counts; rows past each rank's count hold NaN. decode's out and
    lse equal float64 attention over the whole cache within FlashAttention's rule, bitwise the
    same on every rank, and each rank sends decode_bytes."""
    group = burstcu.init(backend=backend)
    rank, size = group.rank, group.size
    rng = np.random.default_rng(5)
    totals = [37, 0, 11][:b]                       # batch row 1 has no cache row anywhere
    q = rng.standard_normal((b, t, h, d)).astype(as_dtype(dtype))
    whole_k = [rng.standard_normal((n, hkv, d)).astype(as_dtype(dtype)) for n in totals]
    whole_v = [rng.standard_normal((n, hkv, d)).astype(as_dtype(dtype)) for n in totals]
    counts = np.stack([_spread(rng, n, size) for n in totals])          # (B, G)
    orders = [rng.permutation(n) for n in totals]                       # any order
    cap = int(counts.max()) + 3
    k = np.full((b, cap, hkv, d), np.nan, as_dtype(dtype))
    v = np.full((b, cap, hkv, d), np.nan, as_dtype(dtype))
    for bi in range(b):
        start = int(counts[bi, :rank].sum())
        mine = orders[bi][start:start + counts[bi, rank]]
        k[bi, :len(mine)], v[bi, :len(mine)] = whole_k[bi][mine], whole_v[bi][mine]
    seqlens = counts[:, rank].astype(np.int32)
    group.stats.reset()
    out, lse = burstcu.decode(q, k, v, group, cache_seqlens=seqlens, return_lse=True)
    assert group.stats.bytes_sent == decode_bytes(size, q), (group.stats, decode_bytes(size, q))
    assert group.stats.messages == size - 1, group.stats   # one all-gather: a piece to each peer
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (b, h, t)
    every = group.transport.allgather_object((out.tobytes(), lse.tobytes()), "results")
    assert all(e == every[0] for e in every), "ranks hold different results"
    for bi, n in enumerate(totals):
        if n == 0:   # nothing to attend to anywhere: out 0, lse -inf
            assert not out[bi].any() and np.isneginf(lse[bi]).all()
            continue
        ref_out, ref_lse = attention_ref(q[bi:bi + 1], whole_k[bi][None], whole_v[bi][None])
        naive_out, naive_lse = attention_ref(q[bi:bi + 1], whole_k[bi][None], whole_v[bi][None],
                                             dtype=NAIVE[dtype])
        _check("out", out[bi:bi + 1].astype(np.float64), ref_out, naive_out, dtype)
        _check("lse", lse[bi:bi + 1], ref_lse, naive_lse, dtype)
    group.close()
    return {"bytes": group.stats.bytes_sent}


def kv_cache_appends_balance_and_decode(capacity=6, page_size=None, backend="numpy",
                                        dtype="float64"):
    """KVCache: rows appended on every rank land on one rank each, balanced (counts differ by
    at most one), decode over them equals attention over everything appended; a full cache
    raises on every rank and changes nothing; then from_prefill adopts uneven shards. With
    page_size, the rows live in pages (the kernels read them through the page table)."""
    group = burstcu.init(backend=backend)
    rank, size = group.rank, group.size
    rng = np.random.default_rng(2)
    b, h, hkv, d = 2, 4, 2, 8
    cache = burstcu.KVCache(group, b, capacity, hkv, d, as_dtype(dtype), page_size=page_size)
    tol = 1e-12 if dtype == "float64" else 2e-2
    rows_k, rows_v = [], []
    for step in range(3):
        t = 1 + step % 2
        kn, vn = (rng.standard_normal((b, t, hkv, d)).astype(as_dtype(dtype)) for _ in "kv")
        cache.append(kn, vn)
        rows_k.append(kn)
        rows_v.append(vn)
    total = sum(x.shape[1] for x in rows_k)
    assert cache.counts.sum(axis=0).tolist() == [total] * b
    assert (cache.counts.max(axis=0) - cache.counts.min(axis=0) <= 1).all(), cache.counts
    if page_size is not None:       # this rank's rows take whole pages of their own
        used = cache.page_table >= 0
        assert used.sum(axis=1).tolist() == (-(-cache.seqlens // page_size)).tolist()
        assert len(set(cache.page_table[used].tolist())) == used.sum()
    q = rng.standard_normal((b, 1, h, d)).astype(as_dtype(dtype))
    got = cache.decode(q)
    assert np.array_equal(burstcu.decode(q, cache), got)          # the same call
    want = attention_ref(q, np.concatenate(rows_k, axis=1), np.concatenate(rows_v, axis=1))[0]
    assert np.abs(got - want).max() < tol, np.abs(got - want).max()
    room = capacity * size - total
    try:
        cache.append(np.zeros((b, room + 1, hkv, d)), np.zeros((b, room + 1, hkv, d)))
    except ValueError as exc:
        full = str(exc)
    else:
        full = None
    assert full and "KVCache is full" in full, full
    assert cache.counts.sum(axis=0).tolist() == [total] * b          # nothing stored
    # prefill shards of different lengths (as uneven contiguous shards are)
    mine = 1 + rank % 3
    kp, vp = (rng.standard_normal((b, mine, hkv, d)).astype(as_dtype(dtype)) for _ in "kv")
    cache.from_prefill(kp, vp)
    every = group.transport.allgather_object((kp.astype(np.float64).tolist(),
                                              vp.astype(np.float64).tolist()), "prefill")
    all_k = np.concatenate([np.asarray(e[0]) for e in every], axis=1)
    all_v = np.concatenate([np.asarray(e[1]) for e in every], axis=1)
    got = cache.decode(q)
    want = attention_ref(q, all_k, all_v)[0]
    assert np.abs(got - want).max() < tol
    if page_size is not None:       # a finished sequence gives its pages back
        cache.clear([0])
        assert (cache.page_table[0] < 0).all() and cache.counts[:, 0].sum() == 0
        assert not cache.decode(q)[0].any()
    group.close()
    return {"full": full}


def decode_bad_input_raises_everywhere(kind: str):
    """The last rank's input is bad (or disagrees): every rank raises ValueError/TypeError, no
    hang; the group stays usable."""
    group = burstcu.init(backend="numpy")
    rank, size = group.rank, group.size
    last = rank == size - 1
    q, k = np.zeros((2, 1, 4, 8)), np.zeros((2, 5, 2, 8))
    seqlens = np.array([5, 3], np.int32)
    cache = burstcu.KVCache(group, 2, 4, 2, 8, np.float64)
    call = lambda: burstcu.decode(q, k, k, group, cache_seqlens=seqlens)   # noqa: E731
    if last and kind == "q_shape":
        q = np.zeros((2, 1, 2, 8))
    elif last and kind == "seqlens_range":
        seqlens = np.array([6, 3], np.int32)
    elif last and kind == "seqlens_dtype":
        seqlens = np.array([1.5, 3.0])
    elif last and kind == "heads":
        k = np.zeros((2, 5, 3, 8))
    elif last and kind == "no_token":             # T = 0 new tokens
        q = np.zeros((2, 0, 4, 8))
    elif last and kind == "q_dtype":
        q = np.zeros((2, 1, 4, 8), np.int32)
    elif last and kind == "q_values":             # the same shape, another token
        q = np.full((2, 1, 4, 8), 0.5)
    elif kind == "q_rounding":                    # every rank's token, off by rounding on the last
        q = np.random.default_rng(3).standard_normal((2, 1, 4, 8))
        if last:
            q = np.nextafter(q, np.inf) * (1 + 2 * np.finfo(np.float64).eps)
    elif kind == "cache_counts":               # a rank whose appends went elsewhere
        cache.append(np.zeros((2, 1, 2, 8)), np.zeros((2, 1, 2, 8)))
        if last:
            cache.counts[:, 0] = 0
            cache.counts[rank, 0] = 1
        call = lambda: cache.decode(np.zeros((2, 1, 4, 8)))   # noqa: E731
    try:
        call()
    except (ValueError, TypeError) as exc:
        raised = f"{type(exc).__name__}: {exc}"
    else:
        raised = None
    ok = np.zeros((2, 1, 4, 8))
    assert np.isfinite(burstcu.decode(ok, np.ones((2, 3, 2, 8)), np.ones((2, 3, 2, 8)), group)).all()
    group.close()
    return {"raised": raised}


def kv_cache_bad_rows_raise_everywhere():
    """A paged cache given a batch row out of range to clear, then rows of complex numbers to
    append: every rank raises alike, nothing changes, and the cache and the group keep working."""
    group = burstcu.init(backend="numpy")
    cache = burstcu.KVCache(group, 2, 4, 1, 4, np.float64, page_size=2)
    rows = np.ones((2, 3, 1, 4))
    cache.append(rows, rows)
    before = (cache.page_table.copy(), list(cache._free), cache.counts.copy())
    raised = {}
    for name, call in (("clear", lambda: cache.clear([1, 2])),
                       ("append", lambda: cache.append(rows * 1j, rows))):
        try:
            call()
        except (ValueError, TypeError) as exc:
            raised[name] = f"{type(exc).__name__}: {exc}"
        else:
            raised[name] = None
    assert np.array_equal(cache.page_table, before[0]) and cache._free == before[1]
    assert np.array_equal(cache.counts, before[2])
    cache.append(rows[:, :1], rows[:, :1])
    assert cache.counts.sum(axis=0).tolist() == [4, 4]
    assert np.allclose(cache.decode(np.ones((2, 1, 2, 4))), 1.0)
    group.close()
    return raised
