"""The decode kernels (kernels/flash_decode.cu, `burstcu.ops.cuda.decode`) against float64
attention over each batch row's valid cache rows: float16, bfloat16 and float32; head dims that
are and are not multiples of 32; more query rows than a block holds (row groups); many splits;
batch rows with no valid row; NaN/Inf past the valid rows (never read); T = 1..8 new tokens at
GQA ratios 1..8; many splits (a device of many SMs); a paged cache read through a shuffled page
table (pages no batch row holds are NaN); head dims whose rows are not 16-byte units (the
element-wise loads). The tensor-core twin (flash_decode_split_mma) in fp16/bf16 at head dims
that are multiples of 16, any G x T rows a kv head (1 and 4 in a block of 16, 16, 32, 64 and two
row groups; contiguous, paged and unaligned caches; NaN in K and V past the lengths; no padding
row written), the CUDA-core kernel elsewhere and under `decode_mma_min_rows`, and the rule that
chooses between them. On the CPU emulator by default, on a GPU with
BURSTCU_KERNEL_TEST_BACKEND=cupy. Also the split heuristic and the blocks an SM holds, the kept
buffers (a partial outlives the next call of any plan; the workspace holds the splits a shape
can take, one at a large batch), the page table and lengths the kernels refuse, and the host
mirrors of the decode parameter structs against g++'s layout."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from burstcu.ops.cuda import decode as kernel_decode
from burstcu.ops.cuda.params import data_ptr
from burstcu.ops.decode import PagedRows
from burstcu.testing.reference import attention_ref, within_fa_rule
from tests.kernels.backend import BACKEND

pytestmark = pytest.mark.emulated

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}


def _ops():
    from burstcu.ops.cuda.kernel_ops import KernelOps
    if BACKEND == "cupy":
        from burstcu.transport.bootstrap import gpu_usable
        if not gpu_usable():
            pytest.skip("BURSTCU_KERNEL_TEST_BACKEND=cupy needs a CUDA GPU")
    return KernelOps(backend=BACKEND)


def _run(ops, q, k, v, lengths, scale, page_table=None):
    if BACKEND == "cupy" and q.dtype == ml_dtypes.bfloat16:
        pytest.skip("CuPy has no bfloat16 arrays")
    xp = ops.xp
    k, v = xp.asarray(k), xp.asarray(v)
    if page_table is not None:
        table = xp.asarray(page_table)
        k, v = PagedRows(k, table, page_table), PagedRows(v, table, page_table)
    acc, m, l = kernel_decode.partial(ops, xp.asarray(q), k, v, np.asarray(lengths), scale)
    return _host(acc), _host(m), _host(l)


def _host(x):
    """A NumPy copy of x."""
    return x.get() if BACKEND == "cupy" else np.array(x)


def _check(q, k, v, lengths, scale, dtype, acc, m, l):
    """acc, m, l (the kernel's partial) against float64 attention over each batch row's first
    lengths[b] rows of the contiguous k, v (B, S, Hkv, D), by FlashAttention's rule."""
    b, t, h, d = q.shape
    assert acc.shape == (b, t, h, d) and m.shape == l.shape == (b, h, t)
    for bi, n in enumerate(lengths):
        if n == 0:
            assert not acc[bi].any() and not l[bi].any() and np.isneginf(m[bi]).all()
            continue
        kb, vb = k[bi:bi + 1, :n], v[bi:bi + 1, :n]
        ref_out, ref_lse = attention_ref(q[bi:bi + 1], kb, vb, softmax_scale=scale)
        naive_out, naive_lse = attention_ref(q[bi:bi + 1], kb, vb, softmax_scale=scale,
                                             dtype=np.float32, round_to=DTYPES[dtype])
        out = (acc[bi] / l[bi].transpose(1, 0)[..., None])[None].astype(np.float64)
        lse = (m[bi] + np.log(l[bi]))[None].astype(np.float64)
        for name, got, ref, naive in (("out", out, ref_out, naive_out), ("lse", lse, ref_lse, naive_lse)):
            ok, err, bound = within_fa_rule(got, ref, naive, 2.0**-23)
            assert ok, f"{name}: {err:.3e} > {bound:.3e}"


def _inputs(seed, b, t, h, hkv, d, s, lengths, dtype):
    """q (B,T,H,D), k, v (B,S,Hkv,D) standard normal in dtype, NaN/Inf past each valid length."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, d)).astype(DTYPES[dtype])
    k, v = (rng.standard_normal((b, s, hkv, d)).astype(DTYPES[dtype]) for _ in range(2))
    for bi, n in enumerate(lengths):        # what lies past the valid rows must never be read
        k[bi, n:], v[bi, n:] = np.nan, np.inf
    return q, k, v


CASES = [  # (B, T, H, Hkv, D, cache rows, lengths)
    (2, 1, 8, 2, 64, 300, (300, 0)),        # GQA 4, a batch row with nothing
    (1, 3, 16, 2, 128, 1500, (1500,)),      # 24 query rows a kv head: two row groups; many splits
    (2, 2, 4, 4, 40, 97, (97, 13)),         # head dim 40 (not a multiple of 32)
    (1, 1, 2, 1, 256, 700, (650,)),         # the largest head dim, rows past 650 hold NaN/Inf
    (3, 1, 4, 2, 32, 5, (5, 1, 3)),         # fewer keys than warps
]


# (head dim, dtype) of the runs only -m slow takes: each builds a kernel of its own, and the
# default run has every case (d 128 in float32, d 256 in float16, d 32 in float16 and bfloat16)
# and every dtype in four cases or more
SLOW_DECODE = {(128, "float16"), (128, "bfloat16"), (256, "bfloat16"), (256, "float32"), (32, "float32")}


@pytest.mark.parametrize("case,dtype", [
    pytest.param(c, dtype, id=f"B{c[0]}T{c[1]}H{c[2]}/{c[3]}d{c[4]}-{dtype}",
                 marks=[pytest.mark.slow] if (c[4], dtype) in SLOW_DECODE else [])
    for dtype in DTYPES for c in CASES])
def test_decode_kernels_match_float64(case, dtype):
    b, t, h, hkv, d, s, lengths = case
    q, k, v = _inputs(10 * CASES.index(case) + list(DTYPES).index(dtype), *case[:6], lengths, dtype)
    scale = 1.0 / np.sqrt(d)
    _check(q, k, v, lengths, scale, dtype, *_run(_ops(), q, k, v, lengths, scale))


@pytest.mark.parametrize("t,ratio", [(1, 1), (2, 8), (5, 3), (8, 4), (8, 8)])
def test_new_tokens_and_gqa_ratios(t, ratio):
    """T new tokens x GQA ratio rows a kv head: 1 to 64 (the tensor-core twin: blocks of 16, 32 and
    64 rows, zero rows under 16), a whole key tile and a partial one."""
    lengths = (45, 7)
    q, k, v = _inputs(t * 10 + ratio, 2, t, 2 * ratio, 2, 64, 50, lengths, "float16")
    _check(q, k, v, lengths, 0.125, "float16", *_run(_ops(), q, k, v, lengths, 0.125))


def test_many_splits():
    """A device of 200 SMs: the heuristic cuts 1000 keys into many splits of whole tiles, one
    of them partial and most past the shorter batch row's end."""
    ops = _ops()
    ops.sm_count = 200
    lengths = (1000, 70)
    chunk, splits = kernel_decode.splits_for(1000, 2 * 2, 200)   # 200 block slots at least
    assert splits >= 7 and chunk % kernel_decode.BK == 0, (chunk, splits)
    q, k, v = _inputs(3, 2, 1, 4, 2, 32, 1001, lengths, "bfloat16")
    _check(q, k, v, lengths, 0.3, "bfloat16", *_run(ops, q, k, v, lengths, 0.3))


def _paged(k, v, lengths, page_size, seed):
    """k, v (B, S, Hkv, D) as pages of page_size rows in a shuffled table: pages no batch row
    holds and rows past a batch row's length are NaN, table entries past it -1."""
    b, s = k.shape[:2]
    per_row = -(-s // page_size)
    table = np.random.default_rng(seed).permutation(b * per_row + 3)[:b * per_row]
    table = table.reshape(b, per_row).astype(np.int32)
    pages_k = np.full((b * per_row + 3, page_size) + k.shape[2:], np.nan, k.dtype)
    pages_v = pages_k.copy()
    for bi, n in enumerate(lengths):
        for i in range(-(-n // page_size)):
            rows = slice(i * page_size, min((i + 1) * page_size, n))
            pages_k[table[bi, i], :rows.stop - rows.start] = k[bi, rows]
            pages_v[table[bi, i], :rows.stop - rows.start] = v[bi, rows]
        table[bi, -(-n // page_size):] = -1
    return pages_k, pages_v, table


@pytest.mark.parametrize("page_size,d,dtype", [(16, 64, "float16"), (7, 40, "bfloat16"),
                                               (32, 128, "float32")])
def test_paged_cache(page_size, d, dtype):
    """The rows live in pages named by a shuffled table; pages no batch row holds and the rows
    of a page past a batch row's length are NaN, table entries past it -1: never read."""
    b, t, h, hkv = 3, 2, 4, 2
    lengths = (100, 0, 33)
    q, k, v = _inputs(page_size, b, t, h, hkv, d, 100, lengths, dtype)
    pages_k, pages_v, table = _paged(k, v, lengths, page_size, 7)
    scale = 1.0 / np.sqrt(d)
    _check(q, k, v, lengths, scale, dtype, *_run(_ops(), q, pages_k, pages_v, lengths, scale, table))


def test_rows_not_on_16_bytes():
    """Head dim 20 in float16 (40-byte rows): the element-wise loads give the same answer."""
    lengths = (37,)
    q, k, v = _inputs(4, 1, 3, 4, 1, 20, 40, lengths, "float16")
    _check(q, k, v, lengths, 0.2, "float16", *_run(_ops(), q, k, v, lengths, 0.2))


def test_the_kept_buffers_hold_a_partial_through_the_next_call():
    """Calls of one shape reuse the op's two buffers in turn: a partial stays valid through the
    next call, the call after reuses its memory, and release_buffers frees them."""
    ops = _ops()
    xp = ops.xp
    lengths = np.array([9])
    q, k, v = (xp.asarray(x) for x in _inputs(5, 1, 1, 2, 1, 32, 9, lengths, "float16"))
    first = kernel_decode.partial(ops, q, k, v, lengths, 0.5)
    kept = [_host(x) for x in first]
    second = kernel_decode.partial(ops, q * 2, k, v, lengths, 0.5)
    assert all(np.array_equal(_host(x), y) for x, y in zip(first, kept))
    assert not np.array_equal(_host(second[0]), kept[0])
    third = kernel_decode.partial(ops, q, k, v, lengths, 0.5)
    assert data_ptr(third[0]) == data_ptr(first[0]) != data_ptr(second[0])
    assert len(ops.__dict__["_double_buffers"]) == 1
    ops.release_buffers()
    assert "_double_buffers" not in ops.__dict__


def test_split_heuristic():
    """FlashAttention's rule: one split when the blocks fill the device; else whole-ish waves,
    each split at least MIN_KEYS keys in whole tiles, never over MAX_SPLITS."""
    assert kernel_decode.splits_for(1 << 20, 132 * 2, 264) == (1 << 20, 1)   # 264 slots
    chunk, splits = kernel_decode.splits_for(1 << 20, 8, 264)       # H100, B = 1, Hkv = 8
    assert 0.85 <= 8 * splits / 264 <= 1 and chunk % kernel_decode.BK == 0      # 264 slots
    assert chunk * splits >= 1 << 20
    chunk, splits = kernel_decode.splits_for(4096, 8, 264)          # 32 key blocks at most
    assert splits <= 32 and chunk >= kernel_decode.MIN_KEYS
    assert kernel_decode.splits_for(100, 1, 6)[1] == 1               # under MIN_KEYS: one split
    assert kernel_decode.splits_for(0, 4, 6) == (kernel_decode.BK, 1)
    splits = kernel_decode.splits_for(1 << 24, 1, 2000)[1]          # one block, 2000 slots
    assert 0.85 * kernel_decode.MAX_SPLITS <= splits <= kernel_decode.MAX_SPLITS
    # the workspace's bound: no length up to a cache's rows takes more splits than most_splits
    for rows, blocks, slots in ((3000, 1, 12), (3000, 5, 12), (50000, 3, 264), (1 << 20, 8, 400)):
        taken = max(kernel_decode.splits_for(n, blocks, slots)[1]
                    for n in range(0, rows + 1, max(1, rows // 997)))
        assert taken <= kernel_decode.most_splits(rows, blocks, slots), (rows, blocks, slots)
    assert kernel_decode.most_splits(1 << 20, 96, 108) == 1          # 96 blocks fill 108 slots
    assert kernel_decode.most_splits(1000, 1, 12) == 8               # 1000 keys: 8 key blocks
    assert kernel_decode.most_splits(1 << 20, 1, 2000) == kernel_decode.MAX_SPLITS


def test_partials_of_plans_sharing_a_buffer_layout_stay_distinct():
    """Calls that differ only in the scale (other plans, one buffer layout), more of them than
    the op keeps plans: each partial stays as it was through the next call, and each is the
    attention at its own scale."""
    ops = _ops()
    xp = ops.xp
    lengths = np.array([9, 4])
    q, k, v = _inputs(6, 2, 1, 2, 1, 32, 9, lengths, "float16")
    qd, kd, vd = (xp.asarray(x) for x in (q, k, v))
    scales = [0.5 / (i + 1) for i in range(kernel_decode.PLANS_KEPT + 2)]
    before = kernel_decode.partial(ops, qd, kd, vd, lengths, scales[0])
    kept = [_host(x) for x in before]
    for scale in scales[1:]:
        now = kernel_decode.partial(ops, qd, kd, vd, lengths, scale)
        assert all(np.array_equal(_host(x), y) for x, y in zip(before, kept)), scale
        _check(q, k, v, lengths, scale, "float16", *(_host(x) for x in now))
        before, kept = now, [_host(x) for x in now]


# The emulated device: sm_80's tile table, so an A100's 164 KB of shared memory an SM; float16 at
# head dim 64 takes 4 stages x 2 x 32 x (128 + 16) + 32 x 64 x 4 + 32 x 32 x 4 = 49152 bytes
# a block, + 1 KB reserved: 3 blocks an SM. With 4 SMs: 12 block slots.
@pytest.mark.parametrize("b,s,lengths,splits", [
    (16, 300, (5,) * 16, 1),      # 16 blocks a split >= 80% of 12 slots: one split, whatever the rows
    (1, 2000, (1500,), 12),       # 1 block: min(128 splits, 12 slots, 2000 rows / 128 = 16 key blocks)
])
def test_workspace_holds_the_splits_the_shape_can_take(b, s, lengths, splits):
    if BACKEND == "cupy":
        pytest.skip("the block slots of the emulated device")
    ops = _ops()
    ops.sm_count = 4
    ops.decode_mma_min_rows = 16    # the CUDA-core kernel, whose block slots are counted above
    h, d = 2, 64
    q, k, v = _inputs(8, b, 1, h, 1, d, s, lengths, "float16")
    _check(q, k, v, lengths, 0.125, "float16", *_run(ops, q, k, v, lengths, 0.125))
    (pair,) = ops.__dict__["_double_buffers"].values()
    rows = b * h                  # B x H x T query rows, fp32 (m, l, acc) of D + 2 values each
    want = (rows * splits + rows) * (d + 2) * 4     # the workspace's splits, then the partial
    assert [m.flat.nbytes for m in pair] == [want, want]


def test_lengths_past_the_cache_rows_are_refused():
    ops = _ops()
    q, k, v = _inputs(9, 1, 1, 2, 1, 32, 40, (40,), "float16")
    with pytest.raises(ValueError, match="over a cache of 40 rows"):
        _run(ops, q, k, v, np.array([41]), 0.2)


@pytest.mark.parametrize("table,error,text", [
    (lambda t: t.astype(np.int64), TypeError, "int32"),
    (lambda t: t.tolist(), TypeError, "array"),
    (lambda t: t[:1], ValueError, "batch=2"),
])
def test_the_kernels_take_an_int32_table_of_the_ops_module(table, error, text):
    """What the kernel would read wrongly (int64 entries as int32 pairs), could not read (a
    list) or read past (too few batch rows): refused before the launch."""
    ops = _ops()
    xp = ops.xp
    q, k, v = _inputs(11, 2, 1, 2, 1, 32, 8, (8, 8), "float16")
    host = np.array([[0, 1], [2, 3]], np.int32)
    pages = [xp.asarray(x.reshape(4, 4, 1, 32)) for x in (k, v)]
    bad = table(xp.asarray(host))
    k_rows, v_rows = (PagedRows(p, bad, host) for p in pages)
    with pytest.raises(error, match=text):
        kernel_decode.partial(ops, xp.asarray(q), k_rows, v_rows, np.array([8, 8]), 0.2)
    good = [PagedRows(p, xp.asarray(host), host) for p in pages]        # the same, well formed
    _check(q, k, v, (8, 8), 0.2, "float16",
           *(_host(x) for x in kernel_decode.partial(ops, xp.asarray(q), *good, np.array([8, 8]), 0.2)))


def test_blocks_an_sm_holds():
    """Shared memory (each block + 1 KB reserved), then registers (a warp's in units of 256),
    against values worked by hand; and the split count follows the slots they give."""
    bps = kernel_decode.blocks_per_sm
    assert bps(86016, 167936) == 1            # fp16 D = 256 on an A100: 167936 // 87040
    assert bps(86016, 233472) == 2            # ... on an H100
    assert bps(72704, 167936) == 2            # fp16 D = 128: 167936 // 73728
    assert bps(72704, 233472) == 3            # ... on an H100: 233472 // 73728
    assert bps(28672, 233472) == 7            # fp16 D = 32: 233472 // 29696
    assert bps(28672, 233472, 128, 111) == 4  # 111 regs: 3584 a warp, 14336 a block
    assert bps(72704, 233472, 128, 255) == 2  # 255 regs: 8192 a warp, 32768 a block
    assert bps(200000, 167936) == 1           # never under one
    # B x Hkv = 96 blocks a split at D = 256 on an A100 (108 SMs): 108 slots, 96 >= 86.4, one
    # split; counting 2 blocks an SM (216 slots) would cut the keys in 2 (96 x 2 / 216 = 0.89)
    assert kernel_decode.splits_for(65536, 96, 108) == (65536, 1)
    assert kernel_decode.splits_for(65536, 96, 216) == (32768, 2)


def _gathered_partials(xp, q, k, v, rank_lengths, scale, laid_out: bool, reverse: bool = False):
    """Every rank's partial (`burstcu.ops.decode.partial`, float32) of the cache k, v (B, S, Hkv,
    D) cut into len(rank_lengths) contiguous shards of S / G rows, rank r's batch row b valid
    for its first rank_lengths[r][b] rows, as xp arrays; laid_out: in one (G, floats) buffer as
    the all-gather of burstcu.engine.decode lays them (rank r's acc, m, l at rank 0's + r
    strides; reverse: rank r's at row G - 1 - r), else as separate arrays."""
    from burstcu.ops.decode import partial

    size, s = len(rank_lengths), k.shape[1] // len(rank_lengths)
    parts = [partial(np, q, k[:, r * s:(r + 1) * s], v[:, r * s:(r + 1) * s], n, scale,
                     np.dtype(np.float32)) for r, n in enumerate(rank_lengths)]
    if not laid_out:
        return [tuple(xp.asarray(x) for x in part) for part in parts]
    rows = list(range(size))[::-1] if reverse else list(range(size))   # rank r's buffer row
    gathered = xp.asarray(np.stack([np.concatenate([x.reshape(-1) for x in parts[rows.index(i)]])
                                    for i in range(size)]))
    sizes = [x.size for x in parts[0]]
    return [tuple(gathered[rows[r], at:at + n].reshape(x.shape)
                  for x, n, at in zip(parts[0], sizes, np.cumsum([0] + sizes[:-1])))
            for r in range(size)]


@pytest.mark.parametrize("size,out_dtype,d,q_scale", [
    (1, "float16", 64, 1.0), (2, "bfloat16", 160, 1.0), (3, "float32", 64, 40.0), (4, "float16", 288, 1.0)])
def test_the_ranks_partials_merge_in_one_launch(size, out_dtype, d, q_scale):
    """G ranks' partials laid out as the all-gather leaves them merge in one flash_decode_merge
    launch into out (in the output dtype) and lse within FlashAttention's rule of float64
    attention over every rank's valid rows: head dims past 128 and past the split kernels' 256,
    and scores large enough (q x 40: row maxima near 100) that exp(m) overflows float32 unless
    the ranks' maximum is taken out first. A batch row no rank holds a row of gets out 0 and lse
    -inf; a rank with no row of a batch row adds nothing. Partials not laid out so (the ranks in
    reverse order) take the array merge: the same values within an output rounding, no launch."""
    from burstcu.ops.decode import merge as array_merge

    if BACKEND == "cupy" and out_dtype == "bfloat16":
        pytest.skip("CuPy has no bfloat16 arrays")
    ops = _ops()
    launched = _launches(ops)
    rng = np.random.default_rng(size)
    b, t, h, hkv, s = 3, 2, 4, 2, 24 * size
    q = (q_scale * rng.standard_normal((b, t, h, d))).astype(np.float16)
    k, v = (rng.standard_normal((b, s, hkv, d)).astype(np.float16) for _ in range(2))
    rank_lengths = [[int(rng.integers(1, 25)), 0 if r == size - 1 else 24, 0] for r in range(size)]
    scale = d ** -0.5
    parts = _gathered_partials(ops.xp, q, k, v, rank_lengths, scale, laid_out=True)
    if q_scale > 1:
        assert max(float(_host(m).max()) for _, m, _ in parts) > 89   # exp(89) > float32's max
    out, lse = (_host(x) for x in ops.decode_merge(parts, DTYPES[out_dtype]))
    assert launched == {"flash_decode_merge": 1} and out.dtype == DTYPES[out_dtype]
    naive_out, naive_lse = array_merge(np, [tuple(_host(x) for x in p) for p in parts], DTYPES[out_dtype])
    for bi in range(b):
        rows = np.concatenate([np.arange(r * 24, r * 24 + n[bi]) for r, n in enumerate(rank_lengths)])
        if rows.size == 0:
            assert not out[bi].astype(np.float32).any() and np.isneginf(lse[bi]).all()
            continue
        ref_out, ref_lse = attention_ref(q[bi:bi + 1], k[bi:bi + 1, rows], v[bi:bi + 1, rows],
                                         softmax_scale=scale)
        for name, got, ref, naive, eps in (
                ("out", out[bi:bi + 1], ref_out, naive_out[bi:bi + 1], EPS[out_dtype]),
                ("lse", lse[bi:bi + 1], ref_lse, naive_lse[bi:bi + 1], 2.0**-23)):
            ok, err, bound = within_fa_rule(got.astype(np.float64), ref, naive.astype(np.float64), eps)
            assert ok, f"{name}, batch row {bi}: {err:.3e} > {bound:.3e}"
    if size > 1:   # rank r's partial at row G - 1 - r of the buffer: no single forward stride
        launched.clear()
        reversed_rows = _gathered_partials(ops.xp, q, k, v, rank_lengths, scale, laid_out=True, reverse=True)
        apart = _gathered_partials(ops.xp, q, k, v, rank_lengths, scale, laid_out=False)
        assert all(np.array_equal(_host(x), _host(y)) for p, r in zip(apart, reversed_rows)
                   for x, y in zip(p, r))
        out2, lse2 = (_host(x) for x in ops.decode_merge(reversed_rows, DTYPES[out_dtype]))
        assert launched == {}     # the array merge: no kernel ran
        assert np.allclose(out2.astype(np.float32), out.astype(np.float32), rtol=EPS[out_dtype], atol=1e-6)
        assert np.allclose(lse2, lse, rtol=1e-6, atol=0)


def test_a_nan_in_a_valid_row_is_nan_not_an_empty_row():
    """The finish (one rank) and the merge (two ranks' partials) with a NaN in a valid K row of
    batch row 0: out and lse NaN there, as the math reads it, not the out 0 / lse -inf of a row
    with no valid key (which batch row 2, of length 0, still gets); batch row 1 untouched."""
    ops = _ops()
    rng = np.random.default_rng(7)
    b, t, h, hkv, d, s = 3, 1, 4, 2, 64, 32
    q = rng.standard_normal((b, t, h, d)).astype(np.float16)
    k, v = (rng.standard_normal((b, s, hkv, d)).astype(np.float16) for _ in range(2))
    k[0, 3] = np.nan
    scale = d ** -0.5
    xp = ops.xp
    whole = ops.decode_whole(xp.asarray(q), xp.asarray(k), xp.asarray(v), np.array([20, 32, 0]),
                             scale, np.float16)   # (lengths on the host, as _run passes them)
    parts = _gathered_partials(ops.xp, q, k, v, [[20, 16, 0], [0, 16, 0]], scale, laid_out=True)
    merged = ops.decode_merge(parts, np.float16)
    for out, lse in (whole, merged):
        out, lse = _host(out), _host(lse)
        assert np.isnan(out[0].astype(np.float32)).all() and np.isnan(lse[0]).all()
        assert np.isfinite(out[1].astype(np.float32)).all() and np.isfinite(lse[1]).all()
        assert not out[2].astype(np.float32).any() and np.isneginf(lse[2]).all()


def test_a_merge_shape_launches_from_its_kept_struct():
    """The merge keeps a shape's kernel and static fields after its first call and writes each
    call's addresses: calls on partials in other buffers, of 2 and 3 ranks, 1 and 2 new tokens,
    float16 and float32 out, on one op, then the first again, each equal the array merge of
    their own partials; one kernel lookup a shape."""
    from burstcu.ops.decode import merge as array_merge

    ops = _ops()
    looked_up = []
    function = ops.function
    ops.function = lambda name: looked_up.append(name) or function(name)
    rng = np.random.default_rng(7)
    b, h, hkv, d = 2, 4, 2, 64
    q1, q2 = (rng.standard_normal((b, t, h, d)).astype(np.float16) for t in (1, 2))
    k, v = (rng.standard_normal((b, 72, hkv, d)).astype(np.float16) for _ in range(2))
    calls = [(q1, [[5, 24, 0], [24, 3, 0]], np.float16), (q1, [[17, 1, 9], [2, 24, 24]], np.float16),
             (q1, [[3, 0, 24], [1, 2, 3], [24, 24, 0]], np.float32),
             (q2, [[9, 9, 9], [0, 1, 24]], np.float16)]
    sets = [(_gathered_partials(ops.xp, q, k, v, lengths, 0.125, laid_out=True), dtype)
            for q, lengths, dtype in calls]
    for parts, dtype in sets + sets[:1]:
        out, lse = (_host(x) for x in ops.decode_merge(parts, dtype))
        want_out, want_lse = array_merge(np, [tuple(_host(x) for x in p) for p in parts], dtype)
        assert np.allclose(out.astype(np.float32), want_out.astype(np.float32), rtol=EPS["float16"],
                           atol=1e-6)
        assert np.allclose(lse, want_lse, rtol=1e-6, atol=0)
    # three shapes (the first two calls share one): a lookup each, none for a later call
    assert len(looked_up) == len(ops.__dict__["_decode_merges"]) == 3, looked_up


# ------------------------------------------------------------------------------------------------
# the tensor-core twin (flash_decode_split_mma): fp16/bf16, head dims multiple of 16

def _ops_randomized():
    """_ops with the emulator's shuffled block and thread order (a race on the ring, the merge
    scratch or the workspace shows); plain _ops on a GPU."""
    if BACKEND == "cupy":
        return _ops()
    from burstcu.ops.cuda.kernel_ops import KernelOps
    return KernelOps(backend=BACKEND, randomize=True)


def _launches(ops, given: dict | None = None):
    """Count the kernel launches of `ops` by kernel name (the template's name before '<'): a
    decode plan looks its kernels up once, so the functions `function` returns are wrapped.
    given: filled with each kernel's latest parameter struct (its one argument)."""
    counts: dict = {}
    function = ops.function

    def counted(name):
        fn, kernel = function(name), name.split("<")[0]

        def launch(*args, **kwargs):
            counts[kernel] = counts.get(kernel, 0) + 1
            if given is not None:
                given[kernel] = args[2][0]
            return fn(*args, **kwargs)
        launch.num_regs = getattr(fn, "num_regs", 0)     # what the GPU's block slots read
        return launch
    ops.function = counted
    return counts


MMA_CASES = {  # name: (B, T, H, Hkv, D, cache rows, lengths, dtype, cache layout, SMs)
    "R1 bf16 d64 paged": (2, 1, 2, 2, 64, 300, (300, 0), "bfloat16", "paged", 64),
    "R1 fp16 d128 contiguous": (1, 1, 4, 4, 128, 400, (400,), "float16", "contiguous", 64),
    "R4 fp16 d128 contiguous": (2, 1, 8, 2, 128, 500, (500, 37), "float16", "contiguous", 64),
    "R16 fp16 d64 contiguous": (3, 2, 16, 2, 64, 1000, (1000, 0, 77), "float16", "contiguous", 200),
    "R32 bf16 d128 paged": (3, 4, 16, 2, 128, 260, (260, 0, 33), "bfloat16", "paged", 64),
    "R64 fp16 d128 paged": (2, 8, 16, 2, 128, 200, (0, 200), "float16", "paged", 64),
    "R80 bf16 d64 strided": (2, 8, 10, 1, 64, 400, (400, 129), "bfloat16", "strided", 64),
    "R16 bf16 d256 contiguous": (1, 2, 8, 1, 256, 300, (300,), "bfloat16", "contiguous", 64),
    "R32 fp16 d256 paged": (2, 8, 8, 2, 256, 160, (160, 0), "float16", "paged", 64),
}
SLOW_MMA = {"R16 bf16 d256 contiguous"}   # the default run has d 256 (q fragments from smem) once


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_MMA else [])
                                  for c in MMA_CASES])
def test_tensor_core_twin_matches_float64(case):
    """G x T = R query rows a kv head (1 and 4: a block of 16 with zero rows; 16, 32, 64, and 80:
    two row groups of 64) in fp16/bf16 run flash_decode_split_mma, once, within
    FlashAttention's rule of float64 attention: batch rows of different lengths (one of 0), NaN
    in K and V past each length (never read: inert), a contiguous cache, a paged one (a shuffled
    table, odd page sizes) and one whose rows are not 16-byte units (the element-wise loads),
    many splits (a device of many SMs: the key tiles of 64 cut into splits whole)."""
    b, t, h, hkv, d, s, lengths, dtype, layout, sms = MMA_CASES[case]
    if BACKEND == "cupy" and dtype == "bfloat16":
        pytest.skip("CuPy has no bfloat16 arrays")
    q, k, v = _inputs(list(MMA_CASES).index(case), b, t, h, hkv, d, s, lengths, dtype)
    for bi, n in enumerate(lengths):
        v[bi, n:] = np.nan
    ops = _ops_randomized()
    ops.sm_count = sms
    given: dict = {}
    counts = _launches(ops, given)
    scale = 1.0 / np.sqrt(d)
    if layout == "paged":
        pages_k, pages_v, table = _paged(k, v, lengths, 7 if d == 128 else 16, len(case))
        got = _run(ops, q, pages_k, pages_v, lengths, scale, table)
    elif layout == "strided":     # rows d + 1 elements apart (views on the op's device): not on 16 bytes
        wide_k, wide_v = (np.full(x.shape[:3] + (d + 1,), np.nan, x.dtype) for x in (k, v))
        wide_k[..., :d], wide_v[..., :d] = k, v
        got = _run(ops, q, ops.xp.asarray(wide_k)[..., :d], ops.xp.asarray(wide_v)[..., :d], lengths, scale)
    else:
        got = _run(ops, q, k, v, lengths, scale)
    _check(q, k, v, lengths, scale, dtype, *got)
    assert counts == {"flash_decode_split_mma": 1, "flash_decode_combine": 1}, counts
    (plan,) = ops.__dict__["_decode_plans"].values()
    rows = h // hkv * t
    _, _, block_rows, block_keys, _, _ = plan.name.split("<")[1].rstrip(">").split(", ")
    assert int(block_rows) == min(-(-rows // 16) * 16, 64) and plan.groups == -(-rows // 64)
    assert int(block_keys) == plan.tile in (32, 64)
    split = given["flash_decode_split_mma"]                      # what the kernel was given
    assert (layout == "strided") == (split["vec"] == 0)
    assert split["chunk"] % plan.tile == 0 and split["chunk"] * split["splits"] >= max(lengths)
    if case == "R16 fp16 d64 contiguous":
        assert split["splits"] >= 6, split                        # many, the 0-length row's all empty


@pytest.mark.parametrize("t,h,hkv,d,dtype,min_rows", [
    (2, 8, 2, 64, "float16", 16),     # R = 8 under decode_mma_min_rows = 16
    (2, 8, 1, 64, "float32", None),   # R = 16 in float32: the CUDA cores
    (4, 8, 2, 40, "float16", None),   # head dim 40: not a multiple of 16
    (8, 8, 1, 40, "float16", None),   # ... at R = 64: two row groups of the CUDA-core kernel's 32
])
def test_the_cuda_core_kernel_runs_where_the_twin_does_not(t, h, hkv, d, dtype, min_rows):
    """Float32, a head dim not a multiple of 16 (one of them with more rows than a block of the
    CUDA-core kernel holds), or fewer rows a kv head than the op's decode_mma_min_rows:
    flash_decode_split."""
    lengths = (90, 3)
    q, k, v = _inputs(t + d, 2, t, h, hkv, d, 90, lengths, dtype)
    ops = _ops()
    if min_rows is not None:
        ops.decode_mma_min_rows = min_rows
    counts = _launches(ops)
    _check(q, k, v, lengths, 0.2, dtype, *_run(ops, q, k, v, lengths, 0.2))
    assert counts == {"flash_decode_split": 1, "flash_decode_combine": 1}, counts


@pytest.mark.parametrize("arch,t,h,hkv,d", [
    pytest.param("sm_80", 4, 10, 1, 48, id="R40-d48"),
    pytest.param("sm_86", 2, 8, 1, 256, id="sm86-R16-d256", marks=pytest.mark.slow),
])
def test_tensor_core_twin_with_idle_row_tiles_and_a_narrower_head_dim(arch, t, h, hkv, d):
    """Blocks whose row tiles are not all used (R = 40 in a block of 64 rows; on the sm_86 table R
    = 16 at head dim 256 in a block of 32, whose key slices still merge) and a head dim under the
    kernel's (48 run at 64: zero columns, none written), shuffled order: float64 within
    FlashAttention's rule, one launch of the twin."""
    from burstcu.ops.cuda.kernel_ops import KernelOps

    lengths = (150, 0, 41)
    q, k, v = _inputs(t * h + d, 3, t, h, hkv, d, 150, lengths, "float16")
    ops = KernelOps(backend=BACKEND, arch=arch, **({"randomize": True} if BACKEND == "emulated" else {}))
    counts = _launches(ops)
    scale = 1.0 / np.sqrt(d)
    _check(q, k, v, lengths, scale, "float16", *_run(ops, q, k, v, lengths, scale))
    assert counts == {"flash_decode_split_mma": 1, "flash_decode_combine": 1}, counts


def test_the_split_kernel_choice():
    """The dispatch rule, table by table (no kernel is built): the twin with the fewest rows a
    block >= min(R rounded up to 16, 64) that the table has, else the CUDA-core kernel."""
    from burstcu.ops.cuda.kernel_ops import KernelOps

    def choice(arch, dtype, rows, d, min_rows=None):
        ops = KernelOps(backend="emulated", arch=arch)
        if min_rows is not None:
            ops.decode_mma_min_rows = min_rows
        v = kernel_decode.choose_split_variant(ops, dtype, rows, d)
        return v.family, v.headdim
    assert choice("sm_80", "float16", 1, 64) == ("decode_mma16", 64)
    assert choice("sm_80", "float16", 4, 128) == ("decode_mma16", 128)
    assert choice("sm_80", "float16", 15, 64, min_rows=16) == ("decode", 64)
    assert choice("sm_80", "float16", 16, 64, min_rows=16) == ("decode_mma16", 64)
    assert choice("sm_80", "float16", 16, 64) == ("decode_mma16", 64)
    assert choice("sm_80", "bfloat16", 17, 48) == ("decode_mma32", 64)      # d 48: padded to 64
    assert choice("sm_80", "float16", 64, 128) == ("decode_mma64", 128)
    assert choice("sm_80", "float16", 200, 128) == ("decode_mma64", 128)    # 4 row groups
    assert choice("sm_80", "float16", 16, 256) == ("decode_mma16", 256)
    assert choice("sm_86", "float16", 16, 256) == ("decode_mma32", 256)     # over sm_86's smem
    assert choice("sm_90", "bfloat16", 40, 16) == ("decode_mma64", 32)
    assert choice("sm_80", "float32", 64, 128) == ("decode", 128)
    assert choice("sm_80", "float16", 64, 72) == ("decode", 128)            # not a multiple of 16


def test_the_twin_writes_no_padding_row():
    """R = 24 (a block of 32 rows, 8 of them padding) and R = 72 (a second row group of 8 rows
    and three tiles of padding): the workspace past the B x H x T x splits entries the kernel
    owns (the tail the padding rows of the last kv head would reach) keeps what it held."""
    ops = _ops_randomized()
    ops.sm_count = 16
    for t, h in ((3, 16), (9, 16)):
        b, hkv, d, lengths = 1, 2, 64, (70,)
        q, k, v = _inputs(t, b, t, h, hkv, d, 2000, lengths, "float16")
        _run(ops, q, k, v, lengths, 0.125)            # makes the plan and its buffers
        plan = next(reversed(ops.__dict__["_decode_plans"].values()))
        assert "split_mma" in plan.name and plan.max_splits > 1
        pair = ops.__dict__["_double_buffers"][next(reversed(ops.__dict__["_double_buffers"]))]
        for message in pair:
            for name in ("decode_m", "decode_l", "decode_acc"):
                message[name][...] = 7.0
        _check(q, k, v, lengths, 0.125, "float16", *_run(ops, q, k, v, lengths, 0.125))
        used = b * h * t * kernel_decode.splits_for(max(lengths), plan.split_grid[1] * b, plan.slots,
                                                    plan.tile)[1]
        for message in pair:
            for name, width in (("decode_m", 1), ("decode_l", 1), ("decode_acc", d)):
                assert used * width < message[name].size, (t, name)   # a tail to watch
                assert (_host(message[name])[used * width:] == 7.0).all(), (t, name)


# ------------------------------------------------------------------------------------------------
# one rank's decode (`KernelOps.decode_whole`): the split kernel and flash_decode_finish

WHOLE_CASES = {  # name: (B, T, H, Hkv, D, cache rows, lengths, dtype, out dtype, layout, SMs)
    "twin R4 fp16, a row with nothing": (2, 1, 8, 2, 64, 300, (300, 0), "float16", "float16",
                                         "contiguous", 64),
    "twin R32 bf16 paged, many splits": (2, 2, 16, 1, 128, 900, (900, 77), "bfloat16", "bfloat16",
                                         "paged", 200),
    "CUDA cores fp32 d40, fp32 out": (2, 2, 4, 4, 40, 97, (97, 13), "float32", "float32",
                                      "contiguous", 64),
}


def _same_bits(got, want) -> bool:
    return got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("case", list(WHOLE_CASES))
def test_one_ranks_decode_ends_in_the_finish_kernel(case):
    """A decode whose cache rows all lie on one rank runs two kernels, the split kernel and
    flash_decode_finish, where decode_partial + decode_merge run three (split, combine, merge),
    and gives their out and lse bit for bit (on a GPU too: the SASS of both ends in the same
    instructions); within FlashAttention's rule of float64 attention over each
    batch row's valid rows (NaN past them: inert), a row with no valid row out 0, lse -inf. The
    tensor-core twin and the CUDA-core kernel, contiguous and paged, one and many splits, every
    output dtype."""
    b, t, h, hkv, d, s, lengths, dtype, out_dtype, layout, sms = WHOLE_CASES[case]
    if BACKEND == "cupy" and "bfloat16" in (dtype, out_dtype):
        pytest.skip("CuPy has no bfloat16 arrays")
    q, k, v = _inputs(list(WHOLE_CASES).index(case), b, t, h, hkv, d, s, lengths, dtype)
    ops = _ops_randomized()
    ops.sm_count = sms
    given: dict = {}
    counts = _launches(ops, given)
    xp, scale = ops.xp, 1.0 / np.sqrt(d)
    if layout == "paged":
        pages_k, pages_v, table = _paged(k, v, lengths, 16, 3)
        device_table = xp.asarray(table)
        cache = (PagedRows(xp.asarray(pages_k), device_table, table),
                 PagedRows(xp.asarray(pages_v), device_table, table))
    else:
        cache = (xp.asarray(k), xp.asarray(v))
    call = (xp.asarray(q), *cache, np.asarray(lengths), scale)
    out, lse = (_host(x) for x in ops.decode_whole(*call, DTYPES[out_dtype]))
    split = "flash_decode_split_mma" if dtype != "float32" else "flash_decode_split"
    assert counts == {split: 1, "flash_decode_finish": 1}, counts
    if case.endswith("many splits"):
        assert given[split]["splits"] >= 4, given[split]["splits"]
    counts.clear()
    partial = tuple(x.copy() for x in ops.decode_partial(*call))   # the op's kept buffers
    want_out, want_lse = (_host(x) for x in ops.decode_merge([partial], DTYPES[out_dtype]))
    assert counts == {split: 1, "flash_decode_combine": 1, "flash_decode_merge": 1}, counts
    assert out.dtype == DTYPES[out_dtype] and out.shape == q.shape and lse.shape == (b, h, t)
    assert _same_bits(out, want_out) and _same_bits(lse, want_lse)
    for bi, n in enumerate(lengths):
        if n == 0:
            assert not out[bi].astype(np.float32).any() and np.isneginf(lse[bi]).all()
            continue
        kb, vb = k[bi:bi + 1, :n], v[bi:bi + 1, :n]
        ref_out, ref_lse = attention_ref(q[bi:bi + 1], kb, vb, softmax_scale=scale)
        naive_out, naive_lse = attention_ref(q[bi:bi + 1], kb, vb, softmax_scale=scale,
                                             dtype=np.float32, round_to=DTYPES[dtype])
        for name, got, ref, naive, eps in (
                ("out", out[bi:bi + 1], ref_out, naive_out.astype(DTYPES[out_dtype]), EPS[out_dtype]),
                ("lse", lse[bi:bi + 1], ref_lse, naive_lse, 2.0**-23)):
            ok, err, bound = within_fa_rule(got.astype(np.float64), ref, naive.astype(np.float64), eps)
            assert ok, f"{name}, batch row {bi}: {err:.3e} > {bound:.3e}"


def test_one_ranks_decode_without_the_finish_kernel():
    """Where the finish cannot run, decode_whole is decode_merge of decode_partial: an output
    dtype the kernels lack (float64: split and combine, then the array merge) and a head dim no
    split variant runs (288: the array partial, then the merge kernel); the same bits as those
    two calls."""
    ops = _ops()
    counts = _launches(ops)
    for d, out_dtype, launched in ((64, np.float64, {"flash_decode_split_mma": 1, "flash_decode_combine": 1}),
                                   (288, np.float16, {"flash_decode_merge": 1})):
        q, k, v = _inputs(d, 2, 1, 4, 2, d, 40, (40, 9), "float16")
        call = (ops.xp.asarray(q), ops.xp.asarray(k), ops.xp.asarray(v), np.asarray((40, 9)), d ** -0.5)
        counts.clear()
        out, lse = (_host(x) for x in ops.decode_whole(*call, out_dtype))
        assert counts == launched, (d, counts)
        partial = tuple(x.copy() for x in ops.decode_partial(*call))
        want_out, want_lse = (_host(x) for x in ops.decode_merge([partial], out_dtype))
        assert out.dtype == want_out.dtype == out_dtype
        assert np.array_equal(out, want_out) and np.array_equal(lse, want_lse), d


def test_a_partial_stays_valid_through_a_whole_decode_and_the_next_partial():
    """decode_whole and a decode_partial into given arrays write only the workspace, in the kept
    buffer the next call takes: a partial the op returned before is unchanged by them and by the
    next decode_partial."""
    ops = _ops()
    xp = ops.xp
    q, k, v = _inputs(11, 2, 1, 4, 2, 64, 90, (90, 31), "float16")
    call = (xp.asarray(q), xp.asarray(k), xp.asarray(v), np.asarray((90, 31)), 0.125)
    kept = ops.decode_partial(*call)
    before = [_host(x).copy() for x in kept]
    other = (xp.asarray(q[:, :, ::-1].copy()), *call[1:])
    ops.decode_whole(*other, np.float16)
    ops.decode_partial(*other, out=tuple(xp.empty(x.shape, np.float32) for x in kept))
    ops.decode_partial(*other)
    assert all(_same_bits(_host(x), y) for x, y in zip(kept, before))


def test_a_partial_written_where_it_is_sent():
    """decode_partial(..., out=(acc, m, l)) has the combine kernel write the given arrays (the
    engine's all-gather buffer: no copy) and returns them, with the bits of a partial in the
    op's kept buffers; arrays the kernel cannot write are refused; the array path (a head dim
    without a split variant) copies into them."""
    ops = _ops()
    counts = _launches(ops)
    xp = ops.xp
    for d, launched in ((64, {"flash_decode_split_mma": 1, "flash_decode_combine": 1}), (288, {})):
        q, k, v = _inputs(d, 2, 2, 4, 2, d, 50, (50, 0), "float16")
        call = (xp.asarray(q), xp.asarray(k), xp.asarray(v), np.asarray((50, 0)), d ** -0.5)
        want = [_host(x).copy() for x in ops.decode_partial(*call)]
        out = (xp.full((2, 2, 4, d), np.nan, np.float32), xp.full((2, 4, 2), np.nan, np.float32),
               xp.full((2, 4, 2), np.nan, np.float32))
        counts.clear()
        got = ops.decode_partial(*call, out=out)
        assert counts == launched, (d, counts)
        assert all(x is y for x, y in zip(got, out))
        assert all(_same_bits(_host(x), y) for x, y in zip(out, want)), d
    q, k, v = _inputs(3, 1, 1, 4, 2, 64, 20, (20,), "float16")
    call = (xp.asarray(q), xp.asarray(k), xp.asarray(v), np.asarray((20,)), 0.125)
    good = [xp.zeros(shape, np.float32) for shape in ((1, 1, 4, 64), (1, 4, 1), (1, 4, 1))]
    for bad in ([xp.zeros((1, 1, 4, 64), np.float64)] + good[1:],                 # not float32
                [xp.zeros((1, 1, 4, 128), np.float32)[..., ::2]] + good[1:],      # not contiguous
                good[:2] + [xp.zeros((1, 1, 4), np.float32)]):                     # l of q's order
        with pytest.raises(ValueError, match="C-contiguous float32"):
            ops.decode_partial(*call, out=tuple(bad))


def test_decode_at_one_rank_runs_the_split_kernel_and_the_finish():
    """burstcu.decode on a group of one rank launches two kernels a call (no combine, no merge)
    and allocates no partial: out and lse equal the op's decode_whole of the same call."""
    import burstcu

    if BACKEND == "cupy":
        pytest.skip("the group's op here is the emulator's")
    with burstcu.init(backend="emulated") as group:
        assert group.size == 1
        counts = _launches(group.ops)
        q, k, v = _inputs(5, 2, 1, 8, 2, 64, 70, (70, 12), "float16")
        lengths = np.asarray((70, 12), np.int32)
        out, lse = burstcu.decode(q, k, v, group, cache_seqlens=lengths, return_lse=True)
        assert counts == {"flash_decode_split_mma": 1, "flash_decode_finish": 1}, counts
        want = group.ops.decode_whole(q, k, v, lengths, 64 ** -0.5, q.dtype)
        assert _same_bits(np.asarray(out), _host(want[0])) and _same_bits(np.asarray(lse), _host(want[1]))


def test_two_threads_decoding_on_one_op_get_their_own_results():
    """A GPU group of one runs several threads' calls as they come: each thread's decode keeps
    its own plan and workspace (`KernelOps.stream_key` names the thread), so a split launch of
    one thread landing between another's split and finish does not hand it the wrong rows."""
    import threading

    ops = _ops()
    xp = ops.xp
    b, s = 2, 64
    q = xp.full((b, 1, 4, 32), 0.1, np.float16)
    k = xp.asarray(np.random.default_rng(0).standard_normal((b, s, 1, 32)).astype(np.float16))
    values = {name: xp.full((b, s, 1, 32), value, np.float16) for name, value in (("a", 1), ("b", 2))}
    lengths = np.full(b, s)
    kernel_decode.whole(ops, q, k, values["a"], lengths, 0.1, np.float16)   # compiles the kernels
    split = kernel_decode.split_kernel(ops)
    launch, both_split = ops.function(split), threading.Barrier(2)

    def split_then_wait(*args, **kwargs):
        launch(*args, **kwargs)
        both_split.wait(timeout=60)     # each finish comes after both threads' split launches
    ops._functions[split] = split_then_wait
    got = {}

    def run(name):
        out, _ = kernel_decode.whole(ops, q, k, values[name], lengths, 0.1, np.float16)
        got[name] = _host(out)
    threads = [threading.Thread(target=run, args=(name,)) for name in values]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert np.all(got["a"] == 1) and np.all(got["b"] == 2)


def test_a_plan_dropped_waits_for_its_pinned_copies():
    """The ninth shape drops the op's oldest plan: its pinned lengths may still be in an
    asynchronous copy, so its events are waited on before its memory returns to the pool."""
    ops = _ops()
    waited = []

    class _Event:
        def __init__(self, i):
            self.i = i

        def synchronize(self):
            waited.append(self.i)

    for n in range(kernel_decode.PLANS_KEPT + 1):
        plan = kernel_decode._kept(ops, "_test_plans", n, lambda: kernel_decode._Plan(
            *([None] * 17), events=[_Event(n), _Event(-n)]))
        assert plan.events[0].i == n
    assert waited == [0, 0]
    assert list(ops.__dict__["_test_plans"]) == list(range(1, kernel_decode.PLANS_KEPT + 1))


@pytest.mark.parametrize("q_shape, k_shape, fits, text", [
    ((65536, 1, 1, 32), (65536, 4, 1, 32), (65535, 1, 1, 32),
     r"batch 65536: the CUDA decode kernels take at most 65535 batch rows"),
    ((1, 32768, 128, 64), (1, 4, 128, 64), (1, 32704, 128, 64),
     r"128 heads x 32768 new tokens: .* 65536 blocks in y, past CUDA's 65535"),
])
def test_decode_grids_past_cudas_limits_are_refused(q_shape, k_shape, fits, text):
    """The split kernel's grid holds B in z and Hkv x row groups (of 64 query rows here) in y,
    at most 65535 each: a decode past them is refused by the op before any launch (on every
    rank, `check_decode_call`); a batch row or a row group less fits; the array path (float64)
    has no such limit."""
    ops = _ops()
    assert ops.decode_problem(q_shape, k_shape, "float64") is None
    assert ops.decode_problem(fits, (fits[0],) + k_shape[1:], "float16") is None
    assert re.search(text, ops.decode_problem(q_shape, k_shape, "float16"))
