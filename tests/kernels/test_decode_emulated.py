"""The decode kernels (kernels/flash_decode.cu, `burstcu.ops.cuda.decode`) against float64
attention over each batch row's valid cache rows: float16, bfloat16 and float32; head dims that
are and are not multiples of 32; more query rows than a block holds (row groups); many splits;
batch rows with no valid row; NaN/Inf past the valid rows (never read). On the CPU emulator by
default, on a GPU with BURSTCU_KERNEL_TEST_BACKEND=cupy. Also the host mirrors of the decode
parameter structs against g++'s layout."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from burstcu.ops.cuda import decode as kernel_decode
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


def _run(ops, q, k, v, lengths, scale):
    xp = ops.xp
    acc, m, l = kernel_decode.partial(ops, xp.asarray(q), xp.asarray(k), xp.asarray(v),
                                      np.asarray(lengths), scale)
    host = (lambda x: x.get()) if BACKEND == "cupy" else np.asarray
    return host(acc), host(m), host(l)


CASES = [  # (B, T, H, Hkv, D, cache rows, lengths)
    (2, 1, 8, 2, 64, 300, (300, 0)),        # GQA 4, a batch row with nothing
    (1, 3, 16, 2, 128, 1500, (1500,)),      # 24 query rows a kv head: two row groups; many splits
    (2, 2, 4, 4, 40, 97, (97, 13)),         # head dim 40 (not a multiple of 32)
    (1, 1, 2, 1, 256, 700, (650,)),         # the largest head dim, rows past 650 hold NaN/Inf
    (3, 1, 4, 2, 32, 5, (5, 1, 3)),         # fewer keys than warps
]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}T{c[1]}H{c[2]}/{c[3]}d{c[4]}" for c in CASES])
def test_decode_kernels_match_float64(case, dtype):
    b, t, h, hkv, d, s, lengths = case
    rng = np.random.default_rng(10 * CASES.index(case) + list(DTYPES).index(dtype))
    q = rng.standard_normal((b, t, h, d)).astype(DTYPES[dtype])
    k, v = (rng.standard_normal((b, s, hkv, d)).astype(DTYPES[dtype]) for _ in range(2))
    for bi, n in enumerate(lengths):        # what lies past the valid rows must never be read
        k[bi, n:], v[bi, n:] = np.nan, np.inf
    scale = 1.0 / np.sqrt(d)
    acc, m, l = _run(_ops(), q, k, v, lengths, scale)
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


def test_splits_fill_the_device_and_keep_a_minimum():
    chunk, splits = kernel_decode.splits_for(1 << 20, 16)
    assert splits * 16 >= kernel_decode.TARGET_BLOCKS // 2 and chunk * splits >= 1 << 20
    chunk, splits = kernel_decode.splits_for(100, 1)
    assert chunk >= kernel_decode.MIN_CHUNK and splits == 2
    assert kernel_decode.splits_for(0, 4) == (kernel_decode.MIN_CHUNK, 1)


@pytest.mark.parametrize("st", kernel_decode.DECODE_STRUCTS, ids=lambda st: st.name)
def test_decode_struct_layout_matches_gxx(st):
    from burstcu.build.emulate import struct_layout
    kind = {"ptr": "p", "i64": "i", "i32": "i", "f32": "f"}
    names = [f"{st.name}<{t}>" for t in ("__half", "__nv_bfloat16", "float")] if st.templated else [st.name]
    for cxx in names:
        members = st.layout()
        got = struct_layout("flash_decode.cu", cxx, [m for m, *_ in members])
        assert (got["size"], got["align"]) == (st.dtype.itemsize, st.dtype.alignment), cxx
        assert got["count"] == len(st.fields), cxx
        for path, offset, size, typ in members:
            assert got["members"][path] == (offset, size, kind[typ]), f"{cxx}.{path}"
