"""The ring with the Hopper forward kernel on a real GPU: 4 ranks sharing one compute capability
9.0 device through the loopback transport (device-to-device messages ordered by events), every
step's forward on kernels/flash_fwd_sm90.cu (arch="sm_90a"), against float64 within
FlashAttention's rule, and against the same ring on the mma.sync kernels (arch="sm_80").

Skipped unless a compute capability 9.0 GPU is usable."""

from __future__ import annotations

import numpy as np
import pytest

from burstcu.transport.bootstrap import gpu_usable
from burstcu.testing.reference import attention_ref, within_fa_rule


def _hopper() -> bool:
    if not gpu_usable():
        return False
    from burstcu.build.compile import compute_capability
    return compute_capability() == 90


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _hopper(), reason="needs a compute capability 9.0 GPU")]

EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}


def _inputs(seed, n, dtype, b=1, h=8, hkv=2, d=128):
    import ml_dtypes
    cast = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n, h, d)).astype(cast)
    k, v = (rng.standard_normal((b, n, hkv, d)).astype(cast) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("causal,layout", [(True, "zigzag"), (False, "contiguous")])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_four_ranks_on_the_hopper_kernel(dtype, causal, layout):
    import cupy
    import burstcu
    from burstcu.testing.world import run_ranks

    size, n = 4, 2048
    q, k, v = _inputs(7, n, dtype)

    def body(group):
        assert group.ops.arch == group_arch[0]
        shards = [burstcu.shard(cupy.asarray(x), group, layout) for x in (q, k, v)]
        out = burstcu.attention(*shards, group, causal=causal, layout=layout)
        # the first-use check passed: the Hopper kernel ran, not the mma.sync fallback
        family = group.ops.forward_variant(dtype, 128).family
        assert family == ("forward_sm90" if group_arch[0] == "sm_90a" else "forward"), family
        return cupy.asnumpy(burstcu.unshard(out, group, layout)).astype(np.float64)

    ref, _ = attention_ref(q, k, v, causal)
    naive, _ = attention_ref(q, k, v, causal, dtype=np.float32, round_to=q.dtype)
    outs = {}
    for arch in ("sm_90a", "sm_80"):
        group_arch = [arch]
        outs[arch] = run_ranks(size, body, backend="cupy", arch=arch)
        for rank, got in enumerate(outs[arch]):
            ok, err, bound = within_fa_rule(got, ref, naive, EPS[dtype], 2.0)
            assert ok, f"{arch} rank {rank}: {err:.3e} > {bound:.3e}"
    # the two kernel families agree with each other as two correct kernels do
    diff = np.abs(outs["sm_90a"][0] - outs["sm_80"][0]).max()
    assert diff <= 4 * EPS[dtype] * np.abs(ref).max(), diff


@pytest.mark.parametrize("causal,layout,docs", [(True, "zigzag", None), (False, "contiguous", None),
                                                (True, "zigzag", (0, 300, 301, 1100, 1536, 2048))])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_four_ranks_forward_and_backward_on_the_hopper_kernels(dtype, causal, layout, docs):
    """The ring's backward on 4 ranks with arch="sm_90a": every step's dK/dV on a Hopper kernel
    (kernels/flash_bwd_sm90.cu; the documents' small rectangles take its rectangle-list kernel),
    dq, dk and dv against float64 within FlashAttention's rule, on every rank."""
    import cupy
    import burstcu
    from burstcu.build.bwd_variants import LIST_SUFFIX
    from burstcu.build.variants import CAREFUL_SUFFIX
    from burstcu.testing.reference import attention_backward_ref, document_mask
    from burstcu.testing.world import run_ranks

    size, n = 4, 2048
    q, k, v = _inputs(11, n, dtype)
    dout = _inputs(12, n, dtype)[0]

    def body(group):
        x = [burstcu.shard(cupy.asarray(a), group, layout, cu_seqlens=docs) for a in (q, k, v, dout)]

        def forward_and_backward():
            out, lse = burstcu.attention(*x[:3], group, causal=causal, layout=layout,
                                         cu_seqlens=docs, return_lse=True)
            return burstcu.attention_backward(x[3], *x[:3], out, lse, group, causal=causal,
                                              layout=layout, cu_seqlens=docs)
        forward_and_backward()   # the first-use checks run here, with the mma.sync kernels beside
        launched = []
        function = group.ops.function
        group.ops.function = lambda name: launched.append(name) or function(name)
        grads = forward_and_backward()
        careful = {group.ops.variant(family + CAREFUL_SUFFIX, dtype, 128).name
                   for family in ("bwd_dkdv", "bwd_dkdv" + LIST_SUFFIX)}
        dkdv = {name for name in launched if name.startswith("flash_bwd_dkdv") and name not in careful}
        return dkdv, [cupy.asnumpy(burstcu.unshard(g, group, layout, cu_seqlens=docs)).astype(np.float64)
                      for g in grads]

    keep = document_mask(n, causal, docs)
    ref = attention_backward_ref(dout, q, k, v, keep=keep)
    naive = attention_backward_ref(dout, q, k, v, dtype=np.float32, round_to=q.dtype, keep=keep,
                                   out_dtype=q.dtype)
    for rank, (dkdv, grads) in enumerate(run_ranks(size, body, backend="cupy", arch="sm_90a")):
        # the first-use checks passed: every dK/dV step ran a Hopper kernel (the mma.sync careful
        # twin beside it on masked Blocks runs only where a non-finite input sets its flag)
        assert dkdv and all("_sm90" in name for name in dkdv), (rank, dkdv)
        for name, got, want, low in zip("dq dk dv".split(), grads, ref, naive):
            ok, err, bound = within_fa_rule(got, want, low, EPS[dtype], 2.0)
            assert ok, f"rank {rank} {name}: {err:.3e} > {bound:.3e}"
