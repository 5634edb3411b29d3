"""Activation memory per rank and strategy: the peak bytes a forward and a backward call allocate
beside the paper's formula (bench/README.md); tracemalloc (MPI's buffers not counted) or CuPy's pool.

    mpiexec -n G python bench/cpu/memory.py [--seqlen N] [--heads H] [--causal] [--json F]
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


def peak_bytes(group, fn):
    """(fn(), the bytes allocated at its high-water mark above what was live before it, `group`'s
    kept buffers released first): the CuPy pool's (emptied, the device synchronized) or tracemalloc's."""
    group.release_buffers()   # buffers kept from earlier calls would count as this call's
    if group.backend == "cupy":
        import cupy
        pool = cupy.get_default_memory_pool()
        cupy.cuda.Device().synchronize()
        pool.free_all_blocks()
        base = pool.total_bytes()
        result = fn()
        cupy.cuda.Device().synchronize()
        return result, pool.total_bytes() - base
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    result = fn()
    return result, tracemalloc.get_traced_memory()[1] - base


def formula(strategy: str, *, G, B, S, H, Hkv, D, it, acc, tile_q, tile_k) -> dict:
    """The paper's terms in bytes for this rank (bench/README.md, "cpu/memory.py"): Q, K, V, O of
    the shard, one score tile per head and the strategy's K/V buffers (G blocks for allgather)."""
    qkvo = (2 * B * S * H * D + 2 * B * S * Hkv * D) * it
    tile = B * H * min(tile_q, S) * min(tile_k, S) * acc
    buffers = (G if strategy == "allgather" else 2) * 2 * B * S * Hkv * D * it
    return {"qkvo_4BZNd/G": qkvo, "tile_BZ(M/4d)^2": tile, "buffers": buffers, "total": qkvo + tile + buffers}


def measure(group, strategy: str, inputs, causal: bool) -> dict:
    """Peaks of one forward and one backward call, and the totals with the call's live arguments
    added (forward: q, k, v; backward: also dout, out, lse), what the paper's 4BZNd/G counts."""
    q, k, v, dout = inputs
    kw = dict(causal=causal, strategy=strategy)
    (out, lse), fwd = peak_bytes(group, lambda: burstcu.attention(q, k, v, group, return_lse=True, **kw))
    _, bwd = peak_bytes(group, lambda: burstcu.attention_backward(dout, q, k, v, out, lse, group, **kw))
    live_fwd = q.nbytes + k.nbytes + v.nbytes
    live_bwd = live_fwd + dout.nbytes + out.nbytes + lse.nbytes
    return {"forward_peak": fwd, "backward_peak": bwd,
            "forward_total": live_fwd + fwd, "backward_total": live_bwd + bwd}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    C.add_problem_args(p, seqlen=2048, dtype="float32")
    p.add_argument("--backend", default="numpy", choices=["numpy", "cupy"])
    args = p.parse_args(argv)
    if args.backend == "cupy" and (status := C.no_gpu("memory.py", dry_run=False)) is not None:
        sys.exit(status)
    group = burstcu.init(backend=args.backend)
    inputs = C.local_inputs(group, args)
    (B, S, H, D), Hkv, dtype = inputs[0].shape, inputs[1].shape[2], inputs[0].dtype
    dims = dict(G=group.size, B=B, S=S, H=H, Hkv=Hkv, D=D, it=dtype.itemsize, acc=accum_dtype(dtype).itemsize,
                tile_q=getattr(group.ops, "tile_q", 128), tile_k=getattr(group.ops, "tile_k", 128))
    rows = []
    for strategy in args.strategies:
        C.progress(f"memory: {strategy}", group.rank)
        measure(group, strategy, inputs, args.causal)  # warm-up: first-call caches are not activations
        got, f = measure(group, strategy, inputs, args.causal), formula(strategy, **dims)
        rows.append({"strategy": strategy, **got, "formula": f,
                     "forward_over_formula": got["forward_total"] / f["total"],
                     "backward_over_formula": got["backward_total"] / f["total"]})
    tracemalloc.stop()
    per_rank = C.gather(group, rows)
    meter = "cupy pool" if args.backend == "cupy" else "tracemalloc"
    env = C.environment_on_rank0(group, meter=meter)
    if env is None:
        return None
    print(C.measured_on(env))
    print(f"# per rank: *_peak = peak bytes allocated during the call above what was live before it; "
          f"*_total = peak + the call's live arguments; G={group.size} N={args.seqlen} B={B} H={H} "
          f"Hkv={Hkv} D={D} {args.dtype}; meter: {meter}\n# formula = 4BZNd/G (QKVO) + one "
          f"score tile per head + strategy buffers (paper); ratios are *_total / formula")
    b = C.fmt_bytes
    show = [{"rank": i, "strategy": r["strategy"], "fwd_peak": b(r["forward_peak"]),
             "fwd_total": b(r["forward_total"]), "bwd_peak": b(r["backward_peak"]),
             "bwd_total": b(r["backward_total"]), "QKVO": b(r["formula"]["qkvo_4BZNd/G"]),
             "tile": b(r["formula"]["tile_BZ(M/4d)^2"]), "buffers": b(r["formula"]["buffers"]),
             "formula": b(r["formula"]["total"]), "fwd/formula": r["forward_over_formula"],
             "bwd/formula": r["backward_over_formula"]} for i, rows_ in enumerate(per_rank) for r in rows_]
    return C.emit(C.table(show, list(show[0])), {
        "benchmark": "memory", "environment": env, "args": vars(args), "dims": dims,
        "ranks": [{"rank": i, "rows": rows_} for i, rows_ in enumerate(per_rank)]}, args)


if __name__ == "__main__":
    main()
