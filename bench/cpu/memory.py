"""Activation memory per rank: the peak bytes a forward and a backward pass allocate on top of
what was live before the call, per strategy, beside the paper's formula.

    mpiexec -n G python bench/cpu/memory.py [--seqlen N] [--heads H] [--headdim D] [--json FILE]

Measured: on the CPU, `tracemalloc` (NumPy reports its data buffers to it) — peak traced bytes
during the call minus traced bytes before it; inputs, and for the backward pass out and lse, are
live before and so not counted. MPI's own buffers (MPICH shared memory) are not Python
allocations and are not counted. On a GPU (backend cupy), the CuPy memory pool's total bytes
after the call with the pool emptied before (the pool keeps freed blocks, so this is its high
water mark); guarded, never imported on the CPU.

The paper's activation memory per device (BurstAttention, Table "memory overhead") is

    4 B Z N d / G  +  B Z N^2 / ((M/4d)^2 G^2)  +  B N H / G          (elements)

Q, K, V, O of the local shard; one SRAM tile of scores per head (tile side M/4d); the rest of
the layer's hidden activations (H = hidden size, outside attention: not part of this call, left
out). Here the tile is the NumPy backend's (tile_q x tile_k) score tile in the accumulation dtype,
so the second term is B H tile_q tile_k. The paper's table has no term for the double buffers
(its text notes they double the K/V memory during the ring) nor for the all-gather's whole-
sequence K, V; they are listed as the strategy's buffer term, and the sum of the three is the
"formula" column. Measured exceeds it by the implementation's working copies (heads-major K/V in
fp32, a scaled copy of Q, the fp32 output accumulator, dQ/dK/dV accumulators), each O(S d).
"""

from __future__ import annotations

import argparse
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import burstcu  # noqa: E402
from burstcu.ops.base import accum_dtype  # noqa: E402


class PeakMeter:
    """Context manager: `.peak` = bytes allocated at the high-water mark above the start."""

    def __init__(self, backend: str):
        self.backend, self.peak = backend, 0

    def __enter__(self):
        if self.backend == "cupy":
            import cupy
            self.pool = cupy.get_default_memory_pool()
            cupy.cuda.Device().synchronize()
            self.pool.free_all_blocks()
            self.base = self.pool.total_bytes()
        else:
            if not tracemalloc.is_tracing():
                tracemalloc.start()
            tracemalloc.reset_peak()
            self.base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc):
        if self.backend == "cupy":
            import cupy
            cupy.cuda.Device().synchronize()
            self.peak = self.pool.total_bytes() - self.base
        else:
            self.peak = tracemalloc.get_traced_memory()[1] - self.base
        return False


def formula(strategy: str, *, G, B, S, H, Hkv, D, it, acc, tile_q, tile_k) -> dict:
    """The paper's terms in bytes for this rank (see the module docstring)."""
    qkvo = (2 * B * S * H * D + 2 * B * S * Hkv * D) * it
    tile = B * H * min(tile_q, S) * min(tile_k, S) * acc
    kv = 2 * B * S * Hkv * D * it
    if strategy == "allgather":
        buffers = G * kv                  # every rank's K and V at once
    else:
        buffers = 2 * kv                  # double buffer: the block in use + the one arriving
    return {"qkvo_4BZNd/G": qkvo, "tile_BZ(M/4d)^2": tile, "buffers": buffers,
            "total": qkvo + tile + buffers}


def measure(group, strategy: str, inputs, causal: bool) -> dict:
    """Transient peaks of one forward and one backward call, and the totals with the call's
    live arguments added (forward: q, k, v; backward: also dout, out, lse), which is what the
    paper's formula counts (its 4BZNd/G term is Q, K, V, O)."""
    q, k, v, dout = inputs
    group.release_buffers()   # buffers kept from earlier calls count as this call's
    with PeakMeter(group.backend) as fwd:
        out, lse = burstcu.attention(q, k, v, group, causal=causal, return_lse=True, strategy=strategy)
    group.release_buffers()
    with PeakMeter(group.backend) as bwd:
        burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=causal, strategy=strategy)
    live_fwd = q.nbytes + k.nbytes + v.nbytes
    live_bwd = live_fwd + dout.nbytes + out.nbytes + lse.nbytes
    return {"forward_peak": fwd.peak, "backward_peak": bwd.peak,
            "forward_total": live_fwd + fwd.peak, "backward_total": live_bwd + bwd.peak}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_problem_args(p, seqlen=2048, dtype="float32")
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    group = burstcu.init(backend=args.backend)
    inputs = C.make_local_inputs(group.rank, group.size, batch=args.batch, seqlen=args.seqlen,
                                 heads=args.heads, kv_heads=args.kv_heads or args.heads,
                                 headdim=args.headdim, dtype=args.dtype)
    if args.backend == "cupy":
        import cupy
        inputs = [cupy.asarray(x) for x in inputs]
    q, k = inputs[0], inputs[1]
    B, S, H, D = q.shape
    dims = dict(G=group.size, B=B, S=S, H=H, Hkv=k.shape[2], D=D, it=q.dtype.itemsize,
                acc=accum_dtype(q.dtype).itemsize, tile_q=getattr(group.ops, "tile_q", 128),
                tile_k=getattr(group.ops, "tile_k", 128))
    rows = []
    for strategy in args.strategies:
        C.progress(f"memory: {strategy}", group.rank)
        measure(group, strategy, inputs, args.causal)  # warm-up: first-call caches are not activations
        got = measure(group, strategy, inputs, args.causal)
        f = formula(strategy, **dims)
        rows.append({"strategy": strategy, **got, "formula": f,
                     "forward_over_formula": got["forward_total"] / f["total"],
                     "backward_over_formula": got["backward_total"] / f["total"]})
    tracemalloc.stop()
    per_rank = group.comm.gather(rows, root=0) if group.comm is not None and group.size > 1 else [rows]
    env = C.environment(group, meter="cupy pool" if args.backend == "cupy" else "tracemalloc")
    group.close()
    if group.rank != 0:
        return None
    print(C.measured_on(env))
    print(f"# per rank: *_peak = peak bytes allocated during the call above what was live before it; "
          f"*_total = peak + the call's live arguments; G={group.size} N={args.seqlen} B={B} H={H} "
          f"Hkv={dims['Hkv']} D={D} {args.dtype}; meter: {env['meter']}\n"
          f"# formula = 4BZNd/G (QKVO) + one score tile per head + strategy buffers (paper, see --help); "
          f"ratios are *_total / formula")
    show = []
    for i, rows_ in enumerate(per_rank):
        for r in rows_:
            show.append({"rank": i, "strategy": r["strategy"], "fwd_peak": C.fmt_bytes(r["forward_peak"]),
                         "fwd_total": C.fmt_bytes(r["forward_total"]),
                         "bwd_peak": C.fmt_bytes(r["backward_peak"]),
                         "bwd_total": C.fmt_bytes(r["backward_total"]),
                         "QKVO": C.fmt_bytes(r["formula"]["qkvo_4BZNd/G"]),
                         "tile": C.fmt_bytes(r["formula"]["tile_BZ(M/4d)^2"]),
                         "buffers": C.fmt_bytes(r["formula"]["buffers"]),
                         "formula": C.fmt_bytes(r["formula"]["total"]),
                         "fwd/formula": r["forward_over_formula"], "bwd/formula": r["backward_over_formula"]})
    print(C.table(show, list(show[0])))
    result = {"benchmark": "memory", "environment": env, "args": vars(args), "dims": dims,
              "ranks": [{"rank": i, "rows": rows_} for i, rows_ in enumerate(per_rank)]}
    return C.finish(result, args.json)


if __name__ == "__main__":
    main()
