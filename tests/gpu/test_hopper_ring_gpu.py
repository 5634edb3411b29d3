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
