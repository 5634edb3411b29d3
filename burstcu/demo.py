"""The main job: exact attention over a sequence split across `mpiexec -n G` ranks.

    mpiexec -n 4 python -m burstcu.demo [--seqlen 4096] [--heads 8] [--kv-heads 8] [--headdim 64]
                                        [--causal] [--layout zigzag] [--backend auto]

Every rank builds the same global Q, K, V, dO from a seed, keeps its shard, runs the forward and
backward passes through the ring, and checks its rows against a float64 reference (plain
softmax attention, one block of query rows at a time, computed by this program — not by
burstcu). Rank 0 prints per rank: max error of out and dq/dk/dv, wall time, and bytes/messages
sent, beside the byte formula of `burstcu.engine.burst`. The times are of a second forward and backward
pass: one untimed warm-up pass runs first, so they exclude the kernel backends' one-time
compiles (NVRTC, or g++ for the emulator) and other first-call costs.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import burstcu
from burstcu.layout import global_positions
from burstcu.transport.base import CommTimeoutError, deadline_after, poll_until
from burstcu.engine import burst


def reference_rows(q, k, v, dout, rows, causal, scale, block=256):
    """float64 out and dq for query `rows`, and their contribution to dk, dv over all keys.

    q, dout: (B, N, H, D); k, v: (B, N, Hkv, D). Returns out, dq (B, len(rows), H, D) and
    dk, dv (B, N, Hkv, D) restricted to the gradient flowing from these query rows.
    """
    b, n, h, d = q.shape
    g = h // k.shape[2]
    k64 = np.repeat(k.astype(np.float64), g, axis=2)
    v64 = np.repeat(v.astype(np.float64), g, axis=2)
    out = np.empty((b, len(rows), h, d))
    dq = np.empty_like(out)
    dk, dv = np.zeros_like(k64), np.zeros_like(v64)
    for i in range(0, len(rows), block):
        r = rows[i:i + block]
        qr, dor = q[:, r].astype(np.float64), dout[:, r].astype(np.float64)
        s = np.einsum("bihd,bjhd->bhij", qr, k64) * scale
        if causal:
            s = np.where(np.asarray(r)[:, None] >= np.arange(n)[None, :], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        o = np.einsum("bhij,bjhd->bihd", p, v64)
        dp = np.einsum("bihd,bjhd->bhij", dor, v64)
        ds = p * (dp - np.einsum("bihd,bihd->bhi", dor, o)[..., None])
        out[:, i:i + block] = o
        dq[:, i:i + block] = np.einsum("bhij,bjhd->bihd", ds, k64) * scale
        dk += np.einsum("bhij,bihd->bjhd", ds, qr) * scale
        dv += np.einsum("bhij,bihd->bjhd", p, dor)
    fold = lambda x: x.reshape(b, n, h // g, g, d).sum(axis=3)  # noqa: E731 - per kv head
    return out, dq, fold(dk), fold(dv)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=4096, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    p.add_argument("--dtype", default=None, choices=["float32", "float64", "float16", "bfloat16"],
                   help="default: float32 on the NumPy backend, float16 on the CUDA-kernel backends")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "emulated", "cupy"])
    p.add_argument("--no-check", action="store_true", help="skip the float64 reference")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    group = burstcu.init(backend=args.backend)
    rank, size = group.rank, group.size
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
    if args.dtype is None:  # the kernels take half precision; NumPy computes any float
        args.dtype = "float32" if "float32" in group.ops.dtypes else "float16"
    dtype = np.dtype(args.dtype)
    xp = group.ops.xp
    hkv = args.kv_heads or args.heads
    rng = np.random.default_rng(0)
    shape_q = (args.batch, args.seqlen, args.heads, args.headdim)
    shape_kv = (args.batch, args.seqlen, hkv, args.headdim)
    q, dout = (rng.standard_normal(shape_q).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal(shape_kv).astype(dtype) for _ in range(2))
    ql, kl, vl, dol = (xp.asarray(burstcu.shard(x, group, args.layout)) for x in (q, k, v, dout))

    _passes(group, args, ql, kl, vl, dol)  # warm-up, untimed: compiles every kernel it needs
    row = {"rank": rank}
    out, _, (dq, dk, dv) = _passes(group, args, ql, kl, vl, dol, timings=row)
    if not args.no_check:
        if rank == 0:
            print(f"burstcu demo: passes done; checking against a float64 reference of "
                  f"{args.seqlen} tokens (--no-check skips it)...", file=sys.stderr, flush=True)
        rows = global_positions(args.layout, rank, size, args.seqlen // size)
        ref_out, ref_dq, ref_dk_part, ref_dv_part = reference_rows(
            q, k, v, dout, rows, args.causal, 1 / np.sqrt(args.headdim))
        # dk, dv need every rank's query rows: sum the partial references over ranks
        ref_dk = _allreduce(group, ref_dk_part)[:, rows]
        ref_dv = _allreduce(group, ref_dv_part)[:, rows]
        for name, got, ref in (("out", out, ref_out), ("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
            got = got.get() if hasattr(got, "get") else got  # CuPy -> NumPy
            row[f"err_{name}"] = float(np.abs(got.astype(np.float64) - ref).max())
    rows_all = group.transport.allgather_object(row)
    if rank == 0:
        _report(args, size, group.backend, rows_all, ql, kl)
    group.close()
    return 0


def _passes(group, args, ql, kl, vl, dol, timings=None):
    """One forward and one backward pass over this rank's shards: (out, lse, (dq, dk, dv)).

    Stores into `timings` (a dict, if given) each pass's wall time (synchronized with the
    device) and this rank's bytes and messages sent: fwd_s, fwd_bytes, fwd_msgs, bwd_s, ...
    """
    timings = {} if timings is None else timings
    group.barrier()
    group.stats.reset()
    t0 = time.perf_counter()
    out, lse = burstcu.attention(ql, kl, vl, group, causal=args.causal, layout=args.layout, return_lse=True)
    group.ops.sync()
    timings["fwd_s"] = time.perf_counter() - t0
    _take_stats(group, timings, "fwd")
    t0 = time.perf_counter()
    grads = burstcu.attention_backward(dol, ql, kl, vl, out, lse, group, causal=args.causal, layout=args.layout)
    group.ops.sync()
    timings["bwd_s"] = time.perf_counter() - t0
    _take_stats(group, timings, "bwd")
    return out, lse, grads


def _take_stats(group, timings: dict, prefix: str) -> None:
    stats = group.stats.as_dict()
    timings[f"{prefix}_bytes"], timings[f"{prefix}_msgs"] = stats["bytes_sent"], stats["messages"]
    group.stats.reset()


def _allreduce(group, x):
    """The sum of every rank's float64 reference part (host arrays, over MPI whatever the
    backend's transport)."""
    if group.size == 1:
        return x
    from mpi4py import MPI

    total = np.ascontiguousarray(x, np.float64)
    request = group.comm.Iallreduce(MPI.IN_PLACE, [total, MPI.DOUBLE], op=MPI.SUM)
    poll_until(request.Test, deadline_after(group.timeout), lambda: CommTimeoutError(
        f"rank {group.rank} waited {group.timeout:g} s for every rank's reference part"))
    return total


def _report(args, size, backend, rows, ql, kl):
    print(f"burstcu demo: {size} ranks, backend {backend}, seqlen {args.seqlen} "
          f"(local {args.seqlen // size}), batch {args.batch}, heads {args.heads}/{args.kv_heads or args.heads}, "
          f"headdim {args.headdim}, {args.dtype}, causal={args.causal}, layout {args.layout}; "
          f"times of a second pass, after one untimed warm-up (compiles excluded)")
    errs = [k for k in rows[0] if k.startswith("err_")]
    head = f"{'rank':>4} " + "".join(f"{e:>11}" for e in errs) + f"{'fwd s':>8}{'bwd s':>8}{'fwd bytes':>13}{'msgs':>5}{'bwd bytes':>13}{'msgs':>5}"
    print(head)
    for r in rows:
        print(f"{r['rank']:>4} " + "".join(f"{r[e]:>11.2e}" for e in errs)
              + f"{r['fwd_s']:>8.3f}{r['bwd_s']:>8.3f}{r['fwd_bytes']:>13,}{r['fwd_msgs']:>5}{r['bwd_bytes']:>13,}{r['bwd_msgs']:>5}")
    mask = dict(layout=args.layout, causal=args.causal)
    fwd = [burst.forward_bytes(size, ql, kl, kl, rank=r, **mask) for r in range(size)]
    bwd = [burst.backward_bytes(size, ql, kl, kl, rank=r, **mask) for r in range(size)]
    print(f"formula per rank: forward sends*(|K|+|V|) = "
          f"{' / '.join(f'{n:,}' for n in fwd)} bytes (ranks 0..{size - 1}: a "
          f"block travels only while a rank it reaches needs it); backward bundles*(|Q|+|dO|+|D|+|lse|) "
          f"+ dqs*|dQ fp32| = {' / '.join(f'{n:,}' for n in bwd)}"
          f" bytes (a bundle goes only as far as the last rank that needs it)")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
