# one rank on the GPU with strided K and V views: the burst forward passes them to the kernels as given
import cupy as cp, numpy as np, burstcu
from burstcu.testing.reference import attention_ref
rng = cp.random.default_rng(0)
q = rng.standard_normal((1, 512, 4, 64), dtype=cp.float32).astype(cp.float16)
kv = rng.standard_normal((1, 512, 8, 64), dtype=cp.float32).astype(cp.float16)
k, v = kv[:, :, 0::2], kv[:, :, 1::2]
print("k contiguous:", k.flags.c_contiguous)
out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
ref, ref_lse = attention_ref(*(cp.asnumpy(x).astype(np.float64) for x in (q, k, v)), True, dtype=np.float64)
naive, _ = attention_ref(*(cp.asnumpy(x) for x in (q, k, v)), True, dtype=np.float16)
err = float(np.abs(cp.asnumpy(out).astype(np.float64) - ref).max()); nerr = float(np.abs(naive.astype(np.float64) - ref).max())
print(f"max |out - ref| {err:.3e}, naive fp16 {nerr:.3e}, lse err {float(np.abs(cp.asnumpy(lse) - ref_lse).max()):.3e}")
assert err <= 2 * nerr + 1e-5, (err, nerr)
print("PASSED")
