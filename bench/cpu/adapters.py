"""What the autodiff adapters cost: one process, a training step's attention (forward +
backward) through `burstcu.torch.attention` / `burstcu.jax.attention` (eager and under jax.jit)
against the plain API on the backend's own arrays, and torch's SDPA beside them, in one run.

    python bench/cpu/adapters.py [--seqlen 1024 4096] [--heads 8] [--headdim 64] [--dtype float32]
        [--repeats 5] [--json F] [--table F]                        # CPU: the NumPy backend
    python bench/cpu/adapters.py --device cuda [--dtype float16] ...     # GPU: the CUDA kernels

Rows: "api" = burstcu.attention + attention_backward on NumPy (CPU) or CuPy (GPU) arrays;
"torch" = burstcu.torch.attention, loss.backward(); "jax" / "jax.jit" = jax.grad through
burstcu.jax.attention, eager and under jax.jit; "sdpa" = torch.nn.functional.scaled_dot_product_attention
forward + backward (causal). Median wall time over repeats after one warm-up; on the GPU the
device is synchronized around each step. The adapters' overhead is their time over "api"'s.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402


def _steps(shape, dtype: str, device: str) -> dict:
    """name -> a function running one forward + backward of causal attention on (B, S, H, D)
    inputs (the same values for every row of the table)."""
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]
    steps = {}
    try:
        import torch
    except ImportError:
        torch = None
    if device == "cuda":
        import cupy
        q, k, v, dout = (cupy.asarray(x).astype(dtype) for x in host)
    else:
        q, k, v, dout = (x.astype(C.array_dtype(dtype)) for x in host)

    def api():
        out, lse = burstcu.attention(q, k, v, causal=True, return_lse=True)
        burstcu.attention_backward(dout, q, k, v, out, lse, causal=True)
    steps["api"] = api
    if torch is not None:
        t = [torch.from_numpy(x).to(device=device, dtype=getattr(torch, dtype)) for x in host]
        leaves = [x.clone().requires_grad_() for x in t[:3]]

        def through_torch():
            out = burstcu.torch.attention(*leaves, causal=True)
            out.backward(t[3])
        steps["torch"] = through_torch
        heads_first = [x.transpose(1, 2).detach().requires_grad_() for x in t[:3]]

        def sdpa():
            out = torch.nn.functional.scaled_dot_product_attention(*heads_first, is_causal=True)
            out.backward(t[3].transpose(1, 2))
        steps["sdpa"] = sdpa
    steps.update(_jax_steps(host, dtype, device))
    return steps


def _jax_steps(host, dtype: str, device: str) -> dict:
    try:
        import jax
        where = jax.devices("gpu" if device == "cuda" else "cpu")[0]
    except (ImportError, RuntimeError):   # no JAX, or none for this device
        return {}
    jnp = jax.numpy
    q, k, v, dout = (jax.device_put(jnp.asarray(x, getattr(jnp, dtype)), where) for x in host)

    def loss(q, k, v):
        return (burstcu.jax.attention(q, k, v, causal=True) * dout).sum()
    grad = jax.grad(loss, argnums=(0, 1, 2))
    jitted = jax.jit(grad)
    return {"jax": lambda: jax.block_until_ready(grad(q, k, v)),
            "jax.jit": lambda: jax.block_until_ready(jitted(q, k, v))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--headdim", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default float32 (cpu), float16 (cuda)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--table")
    args = parser.parse_args(argv)
    dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    sync = None
    if args.device == "cuda":
        import cupy
        sync = cupy.cuda.Device().synchronize
    rows = []
    for seqlen in args.seqlen:
        shape = (args.batch, seqlen, args.heads, args.headdim)
        steps = _steps(shape, dtype, args.device)
        times = {}
        for name, step in steps.items():
            C.progress(f"S={seqlen} {name}")
            times[name] = C.median(C.call_seconds(step, args.repeats, after=sync))
        for name, seconds in times.items():
            rows.append({"seqlen": seqlen, "path": name, "time_ms": seconds * 1e3,
                         "vs_api": seconds / times["api"]})
    env = C.environment(None, synchronized=args.device == "cuda", device_asked=args.device,
                        dtype=dtype, shape="(B, S, H, D) = "
                        f"({args.batch}, S, {args.heads}, {args.headdim}), causal, forward+backward")
    if args.device == "cuda":   # group=None: the CUDA kernels through CuPy
        env.update(device="GPU (wall time around each step, device synchronized)", backend="cupy")
    text = C.measured_on(env) + "\n" + C.table(rows, ["seqlen", "path", "time_ms", "vs_api"])
    print(text)
    if args.table:
        Path(args.table).write_text(text + "\n")
    if args.json:
        C.write_json(args.json, {"environment": env, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
