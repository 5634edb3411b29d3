"""Linear attention (LASP-2, LASP-1) on a real GPU: CuPy arrays through NCCL in a world of one,
and G = 3 ranks sharing the GPU through the loopback transport (device-to-device messages ordered
by events), against the quadratic float64 form within FlashAttention's rule.

Skipped unless `cupy.cuda.is_available()`."""

from __future__ import annotations

import numpy as np
import pytest

from burstcu.transport.bootstrap import gpu_usable
from burstcu.testing.reference import linear_attention_ref, within_fa_rule


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_usable(), reason="needs a CUDA GPU")]

EPS = {"float16": 2.0**-10, "float32": 2.0**-23}


def _inputs(seed, n, dtype, b=2, h=4, hkv=2, d=32):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((b, n, h, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((b, n, hkv, d)).astype(dtype) for _ in range(2))
    return q, k, v, dout


def _check(name, got, ref, naive, dtype, factor):
    ok, err, bound = within_fa_rule(np.asarray(got, np.float64), ref, naive, EPS[dtype], factor)
    assert ok, f"{name}: {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("strategy", ["lasp2", "lasp1"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_world_of_one_over_nccl(strategy, causal, dtype):
    import cupy
    import burstcu
    q, k, v, dout = _inputs(1, 300, dtype)
    with burstcu.init(backend="cupy") as group:
        assert group.transport.name == "nccl"
        dev = [cupy.asarray(x) for x in (q, k, v, dout)]
        kw = dict(causal=causal, strategy=strategy)
        out = burstcu.linear_attention(*dev[:3], group, **kw)
        grads = burstcu.linear_attention_backward(dev[3], *dev[:3], group, **kw)
        assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype
    ref_out, ref_grads = linear_attention_ref(q, k, v, causal, dout=dout)
    naive_out, naive_grads = linear_attention_ref(q, k, v, causal, np.float32, dout=dout)
    _check("out", cupy.asnumpy(out), ref_out, naive_out, dtype, 2.0)
    for name, got, ref, naive in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        _check(name, cupy.asnumpy(got), ref, naive, dtype, 3.0)


@pytest.mark.parametrize("strategy", ["lasp2", "lasp1"])
@pytest.mark.parametrize("causal,layout", [(True, "zigzag"), (True, "contiguous"), (False, "zigzag")])
def test_three_ranks_on_one_gpu(strategy, causal, layout):
    import cupy
    import burstcu
    from burstcu.layout import global_positions
    from burstcu.testing.world import run_ranks
    size, local = 3, 64
    q, k, v, dout = _inputs(2, size * local, "float32")
    kw = dict(causal=causal, layout=layout, strategy=strategy)

    def body(group):
        rows = global_positions(layout, group.rank, size, local)
        dev = [cupy.asarray(np.ascontiguousarray(x[:, rows])) for x in (q, k, v, dout)]
        out = burstcu.linear_attention(*dev[:3], group, **kw)
        grads = burstcu.linear_attention_backward(dev[3], *dev[:3], group, **kw)
        return rows, [cupy.asnumpy(x) for x in (out, *grads)]

    ref_out, ref_grads = linear_attention_ref(q, k, v, causal, dout=dout)
    naive_out, naive_grads = linear_attention_ref(q, k, v, causal, np.float32, dout=dout)
    for rows, got in run_ranks(size, body, backend="cupy"):
        for name, g, ref, naive, factor in zip(("out", "dq", "dk", "dv"), got,
                                               (ref_out, *ref_grads), (naive_out, *naive_grads),
                                               (2.0, 3.0, 3.0, 3.0)):
            _check(name, g, ref[:, rows], naive[:, rows], "float32", factor)
