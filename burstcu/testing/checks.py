"""Everything one device can check about the kernel path: `python -m burstcu.selftest --full`.

Each check returns records {"name", "passed", "detail"}; `passed` is None when the check cannot
run here (e.g. NCCL without a GPU). On "cupy" (a GPU) the checks run at sizes that exercise every
tile path; on "emulated" (the same .cu sources on the CPU emulator, as CI runs them) at toy sizes,
so that a GPU run finds no Python mistakes.

1. variants      every kernel variant of every tile table the device fits is compiled and loaded;
                 registers, local memory (0 in the tables sized on the device's arch, listed in
                 the others: `check_variants`) and dynamic shared memory recorded
2. kernels       forward and backward against float64 (FlashAttention's rule: at most 2x / 3x the
                 error of a naive same-dtype implementation): fp16/bf16, head dims 32-256 (80 runs
                 the 96 kernel zero-padded), causal and not, GQA, lengths no tile divides, atomic
                 and deterministic dQ
3. ring steps    every rectangle the G-rank ring issues (step_blocks, G = 2..4, both layouts,
                 causal and not), folded in ring order on one device, against float64
4. nccl          bootstrap of a world of one, a send/recv to itself through NCCLTransport's
                 streams and events, its allgather
5. determinism   deterministic mode bitwise equal over two runs; 100 calls grow no memory pool
6. loopback      G = 2..4 ranks of the real engine as threads sharing the device
                 (burstcu.transport.loopback), forward and backward against float64, exact bytes

Inputs are N(0, 1) drawn afresh per case; references are computed on the host in float64
(`burstcu.testing.reference`), never by the code under test.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import numpy as np

from ..layout import Block, shard_slices, step_blocks
from ..group import on_gpu
from ..ops.base import as_dtype
from .reference import (attention_backward_ref, attention_ref, keep_from_blocks, max_err,
                        softmax_stats_ref, step_backward_ref)

FWD_FACTOR, BWD_FACTOR = 2.0, 3.0


def _dtypes() -> dict:
    return {name: as_dtype(name) for name in ("float16", "bfloat16")}


def record(name: str, passed: bool | None, detail: Any) -> dict:
    return {"name": name, "passed": None if passed is None else bool(passed), "detail": detail}


def guarded(name: str, fn: Callable[[], list[dict]]) -> list[dict]:
    """fn()'s records, or one failed record carrying the exception (a check never aborts the
    others)."""
    t0 = time.perf_counter()
    try:
        records = fn()
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        return [record(name, False, f"{type(exc).__name__}: {exc}")]
    for r in records:
        r.setdefault("seconds", round(time.perf_counter() - t0, 3))
    return records


def _rule(got, ref, naive, factor: float) -> tuple[bool, str]:
    """err(got) <= factor * err(naive) + 1e-5 * max|ref| (all against float64); no NaN."""
    got = np.asarray(got, np.float64)
    err, naive_err = max_err(got, ref), max_err(naive, ref)
    atol = 1e-5 * max(1.0, float(np.abs(ref[np.isfinite(ref)]).max(initial=0.0)))
    ok = bool(np.isfinite(got).all()) and err <= factor * naive_err + atol
    return ok, f"err {err:.2e} vs naive {naive_err:.2e} (bound {factor * naive_err + atol:.2e})"


# ------------------------------------------------------------------------------------------------
# 1. variants

def check_variants(backend: str, quick: bool) -> list[dict]:
    """Compile and load every variant (emulated/quick: the head-dim-64 and any-head-dim variants
    of the sm_80 table only, which the emulator builds in seconds). Local memory fails the
    tables sized on this device's arch (named after its compute capability: sm_XY, and sm_90a on
    a cc 9.0 device); any other table's kernels compile for this device's arch, not the one their
    tiles were sized on, so their local memory is listed, not failed: an sm_80 table on an H100
    holds kernels at 254 registers that spill a few bytes there, and the sm_90 table a B200 runs
    by default (`table_arch_for`) holds six that spill 16-84 bytes built for sm_100 (NVRTC
    13.0: its list forward at head dims 128 and 256, the dQ kernel at 96)."""
    from ..build import all_variants
    from ..build.compile import compute_capability
    from ..build.variants import ARCHS, CAREFUL_SUFFIX
    from ..ops.cuda import KernelOps

    out = []
    archs = ARCHS if on_gpu(backend) and not quick else ("sm_80",)
    cc = compute_capability() if on_gpu(backend) else None
    own_tables = None if cc is None else {f"sm_{cc}", f"sm_{cc}a"}
    if on_gpu(backend) and cc != 90:
        archs = tuple(a for a in archs if a != "sm_90a")  # sm_90a code runs on cc 9.0 only
    for arch in archs:
        ops = KernelOps(backend, arch=arch)
        chosen = [v for v in all_variants(arch)
                  if on_gpu(backend) and not quick or v.headdim in (0, 64)]
        fits = [v for v in chosen if ops.smem_limit is None or v.launch.smem_bytes <= ops.smem_limit]
        if on_gpu(backend):
            _compile_in_parallel(fits)
        rows, failures = [], []
        for v in fits:
            try:
                fn = ops.function(v.name)
            except Exception as exc:  # noqa: BLE001 - one record per table below
                failures.append(f"{v.name}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                continue
            rows.append(_kernel_attributes(v, fn))
        # careful variants run only where Inf/NaN meets masked pairs: local memory allowed there
        careful = {v.name for v in fits if v.family.endswith(CAREFUL_SUFFIX)}
        spills = [r["name"] for r in rows if r.get("local_bytes") and r["name"] not in careful]
        own = own_tables is None or arch in own_tables
        out.append(record(f"variants/{arch}", not failures and not (own and spills) and rows,
                          {"loaded": len(rows), "skipped_smem": len(chosen) - len(fits),
                           "failures": failures, "local_memory": spills, "own_arch": own,
                           "kernels": rows}))
    return out


def _compile_in_parallel(variants) -> None:
    """Fill the CUBIN cache for the current device with one NVRTC compile per variant, on a
    thread pool (NVRTC releases the GIL); loading then only reads the cache."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    from ..build.compile import cached_cubin, device_arch

    arch = device_arch()
    with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1))) as pool:
        list(pool.map(lambda v: cached_cubin(v.source, [v.name], v.target or arch), variants))


def _kernel_attributes(variant, fn) -> dict:
    row = {"name": variant.name, "threads": variant.launch.threads,
           "dynamic_smem": variant.launch.smem_bytes}
    for key, attr in (("registers", "num_regs"), ("local_bytes", "local_size_bytes"),
                      ("static_smem", "shared_size_bytes")):
        value = getattr(fn, attr, None)
        if value is not None:
            row[key] = int(value)
    return row


# ------------------------------------------------------------------------------------------------
# 2. kernels

def _inputs(rng, dtype, b, sq, sk, h, hkv, d):
    t = _dtypes()[dtype]
    return (rng.standard_normal((b, sq, h, d)).astype(t), rng.standard_normal((b, sk, hkv, d)).astype(t),
            rng.standard_normal((b, sk, hkv, d)).astype(t), rng.standard_normal((b, sq, h, d)).astype(t))


def kernel_case(ops, rng, dtype: str, d: int, causal: bool, shape: tuple) -> tuple[bool, dict]:
    """One forward + one backward of a single Block on `ops` (a HostArrays op) vs float64."""
    b, sq, sk, h, hkv = shape
    q, k, v, dout = _inputs(rng, dtype, b, sq, sk, h, hkv, d)
    blocks = [Block(0, sq, 0, sk, max(sk - sq, 0), 0, causal)]  # causal: bottom-right diagonal
    scale = 1.0 / math.sqrt(d)
    keep = keep_from_blocks(blocks, sq, sk)
    state = ops.forward_init(q, scale)
    ops.forward_step(state, k, v, blocks)
    out, lse = ops.forward_finalize(state, q.dtype)
    ref, _ = attention_ref(q, k, v, softmax_scale=scale, keep=keep)
    naive, _ = attention_ref(q, k, v, softmax_scale=scale, keep=keep, dtype=np.float32,
                             round_to=q.dtype, unnormalized_p=True)
    results = {"out": _rule(out, ref, naive, FWD_FACTOR)}
    ref_lse, delta = softmax_stats_ref(q, k, v, dout, keep, scale)
    lse32, delta32 = ref_lse.astype(np.float32), delta.astype(np.float32)
    results["lse"] = (bool(np.abs(lse - ref_lse).max() < 1e-3), f"max |lse - ref| {np.abs(lse - ref_lse).max():.1e}")
    ctx = ops.backward_init(k, v, scale)
    dq = np.zeros((b, sq, h, d), np.float32)
    ops.backward_step(ctx, q, dout, lse32, delta32, dq, blocks)
    dk, dv = ops.backward_finalize(ctx, np.float32)
    refs = step_backward_ref(q, k, v, dout, lse32, delta32, keep, scale)
    naives = step_backward_ref(q, k, v, dout, lse32, delta32, keep, scale, dtype=np.float32,
                               round_to=q.dtype)
    for name, got, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, naives):
        results[name] = _rule(got, r, n, BWD_FACTOR)
    return all(ok for ok, _ in results.values()), {k_: why for k_, (_, why) in results.items()}


def check_kernels(backend: str, quick: bool) -> list[dict]:
    from .host_arrays import HostArrays
    from ..ops.cuda import KernelOps

    rng = np.random.default_rng(20261122)
    if quick:
        grid = [("float16", 32, c, m) for c in (False, True) for m in ("atomic", "deterministic")]
        grid += [("bfloat16", 32, True, "atomic"), ("float16", 80, True, "deterministic")]
        shape = (1, 40, 56, 2, 1)
    else:
        grid = [(dt, d, c, m) for dt in _dtypes() for d in (32, 64, 80, 96, 128, 256)
                for c in (False, True) for m in ("atomic", "deterministic")]
        shape = (2, 333, 411, 4, 2)  # GQA 2:1, lengths no tile divides, more keys than queries
    ops = {m: HostArrays(KernelOps(backend, deterministic=(m == "deterministic")))
           for m in ("atomic", "deterministic")}
    out = []
    for dtype, d, causal, mode in grid:
        ok, detail = kernel_case(ops[mode], rng, dtype, d, causal, shape)
        out.append(record(f"kernels/{dtype}/d{d}/{'causal' if causal else 'full'}/{mode}", ok, detail))
    return out


# ------------------------------------------------------------------------------------------------
# 3. ring steps, folded in ring order on one device

def ring_case(ops, rng, size: int, layout: str, causal: bool, seqlen_local: int, d: int,
              dtype: str) -> tuple[bool, dict]:
    """Forward of every rank's queries and backward of every rank's keys, each step's blocks
    exactly as the G-rank ring issues them (`step_blocks`), against float64 over the whole
    sequence."""
    n = seqlen_local * size
    q, k, v, dout = _inputs(rng, dtype, 1, n, n, 4, 2, d)
    rows = [np.concatenate([np.arange(sl.start, sl.stop) for sl in shard_slices(layout, r, size, n)])
            for r in range(size)]
    part = lambda x, r: np.ascontiguousarray(x[:, rows[r]])  # noqa: E731
    ref_out, ref_lse = attention_ref(q, k, v, causal)
    naive_out, _ = attention_ref(q, k, v, causal, dtype=np.float32, round_to=q.dtype)
    out = np.zeros(q.shape, np.float64)
    for r in range(size):
        state = ops.forward_init(part(q, r), None)
        for s in range(size):
            src = (r - s) % size
            blocks = step_blocks(layout, r, src, size, seqlen_local, causal)
            if blocks:
                ops.forward_step(state, part(k, src), part(v, src), blocks)
        out[:, rows[r]] = ops.forward_finalize(state, q.dtype)[0].astype(np.float64)
    results = {"out": _rule(out, ref_out, naive_out, FWD_FACTOR)}
    delta = np.einsum("bihd,bihd->bhi", dout.astype(np.float64), ref_out).astype(np.float32)
    lse = ref_lse.astype(np.float32)
    grads = [np.zeros(q.shape, np.float64), np.zeros(k.shape, np.float64), np.zeros(k.shape, np.float64)]
    dq_parts = [np.zeros(part(q, r).shape, np.float32) for r in range(size)]
    for r in range(size):  # the keys of rank r stay; every rank's queries visit
        ctx = ops.backward_init(part(k, r), part(v, r), 1.0 / math.sqrt(d))
        for s in range(size):
            src = (r - s) % size
            blocks = step_blocks(layout, src, r, size, seqlen_local, causal)
            if blocks:
                ops.backward_step(ctx, part(q, src), part(dout, src), lse[:, :, rows[src]],
                                  delta[:, :, rows[src]], dq_parts[src], blocks)
        dk, dv = ops.backward_finalize(ctx, np.float32)
        grads[1][:, rows[r]], grads[2][:, rows[r]] = dk, dv
    for r in range(size):
        grads[0][:, rows[r]] = dq_parts[r]
    refs = attention_backward_ref(dout, q, k, v, causal)
    naives = attention_backward_ref(dout, q, k, v, causal, dtype=np.float32, round_to=q.dtype)
    for name, got, want, plain in zip(("dq", "dk", "dv"), grads, refs, naives):
        results[name] = _rule(got, want, plain, BWD_FACTOR)
    return all(ok for ok, _ in results.values()), {k_: why for k_, (_, why) in results.items()}


def check_ring_steps(backend: str, quick: bool) -> list[dict]:
    from .host_arrays import HostArrays
    from ..ops.cuda import KernelOps

    rng = np.random.default_rng(7)
    ops = HostArrays(KernelOps(backend))
    grid = ([(2, "zigzag", True), (3, "contiguous", False)] if quick else
            [(g, lay, c) for g in (2, 3, 4) for lay in ("contiguous", "zigzag") for c in (False, True)])
    seqlen_local, d, dtype = (32, 32, "float16") if quick else (192, 64, "float16")
    out = []
    for size, layout, causal in grid:
        ok, detail = ring_case(ops, rng, size, layout, causal, seqlen_local, d, dtype)
        out.append(record(f"ring_steps/G{size}/{layout}/{'causal' if causal else 'full'}", ok, detail))
    return out


# ------------------------------------------------------------------------------------------------
# 4. NCCL, world of one

def check_nccl(backend: str, quick: bool) -> list[dict]:
    if not on_gpu(backend):
        return [record("nccl", None, "skipped: needs a GPU")]
    import cupy

    from ..transport.bootstrap import bootstrap
    transport, device_id = bootstrap(None)
    try:
        send = cupy.arange(1 << 20, dtype=cupy.float32)
        recv = cupy.zeros_like(send)
        transport._post([(send, recv, 0, 0)])  # a rank may send to itself inside one NCCL group
        transport._wait()
        self_ok = bool((recv == send).all())
        gathered = cupy.zeros((1, 1000), dtype=cupy.float16)
        transport.allgather(send[:1000].astype(cupy.float16), gathered)
        gather_ok = bool((gathered[0] == send[:1000].astype(cupy.float16)).all())
    finally:
        transport.close()
    return [record("nccl/self_send_recv", self_ok, f"4 MiB through the comm stream on GPU {device_id}"),
            record("nccl/allgather", gather_ok, "world of one")]


# ------------------------------------------------------------------------------------------------
# 5. determinism and memory

def check_determinism(backend: str, quick: bool) -> list[dict]:
    import burstcu
    from ..group import local_group

    rng = np.random.default_rng(11)
    n, d = (64, 32) if quick else (1024, 128)
    group = local_group(backend)
    xp = group.ops.xp
    q, k, v, dout = (xp.asarray(x) for x in _inputs(rng, "float16", 1, n, n, 4, 2, d))
    saved = group.ops.deterministic
    group.ops.deterministic = True
    try:
        runs = []
        for _ in range(2):
            out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
            grads = burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)
            runs.append([_host(x).view(np.uint16).copy() for x in (out, *grads)])
    finally:
        group.ops.deterministic = saved
    same = all(np.array_equal(a, b) for a, b in zip(*runs))
    out = [record("determinism/bitwise", same, "deterministic dQ: out, dq, dk, dv identical bits twice")]
    if on_gpu(backend):
        out.append(_pool_growth(group, q, k, v, dout))
    else:
        out.append(record("memory/pool_growth", None, "skipped: the CuPy pool exists on a GPU only"))
    return out


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _pool_growth(group, q, k, v, dout) -> dict:
    import cupy

    import burstcu
    pool = cupy.get_default_memory_pool()

    def call():
        out, lse = burstcu.attention(q, k, v, group, causal=True, return_lse=True)
        burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=True)

    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()
    used, total = pool.used_bytes(), pool.total_bytes()
    for _ in range(100):
        call()
    cupy.cuda.Device().synchronize()
    ok = pool.used_bytes() <= used and pool.total_bytes() <= total
    return record("memory/pool_growth", ok, {"used_before": used, "used_after": pool.used_bytes(),
                                             "total_before": total, "total_after": pool.total_bytes()})


# ------------------------------------------------------------------------------------------------
# 6. the real engine on G ranks sharing the device

def loopback_case(backend: str, size: int, layout: str, causal: bool, seqlen_local: int, d: int,
                  seed: int, n: int | None = None, doc_lengths=None) -> tuple[bool, dict]:
    """A world of `size` ranks in threads (`world.run_ranks`): shard, attention forward and
    backward, unshard, against float64 over the whole sequence, and each rank's bytes against
    the burst formulas. n: the global length (default seqlen_local * size; any n gives shards
    that differ by a row); doc_lengths: documents of these lengths, cycled (cu_seqlens; with
    zigzag each document is cut into 2G pieces, with "documents" the short ones held whole)."""
    import burstcu
    from ..engine import burst
    from ..layout import partition
    from .world import run_ranks
    from .reference import document_mask

    rng = np.random.default_rng(seed)
    n = seqlen_local * size if n is None else n
    docs = None
    if doc_lengths:
        docs = [0]
        while docs[-1] < n:
            docs.append(min(n, docs[-1] + doc_lengths[(len(docs) - 1) % len(doc_lengths)]))
    q, k, v, dout = _inputs(rng, "float16", 1, n, n, 4, 2, d)
    part = partition(layout, size, n, None if docs is None or layout == "contiguous" else tuple(docs))
    mask = dict(causal=causal, layout=layout, **({} if docs is None else {"cu_seqlens": docs}))

    def body(group):
        xp = group.ops.xp
        local = [xp.asarray(burstcu.shard(x, group, layout, cu_seqlens=docs)) for x in (q, k, v, dout)]
        group.stats.reset()
        out, lse = burstcu.attention(*local[:3], group, return_lse=True, **mask)
        fwd_bytes = group.stats.bytes_sent
        grads = burstcu.attention_backward(local[3], *local[:3], out, lse, group, **mask)
        bwd_bytes = group.stats.bytes_sent - fwd_bytes
        whole = [_host(burstcu.unshard(x, group, layout, cu_seqlens=docs)) for x in (out, *grads)]
        formula = dict(rank=group.rank, layout=part, causal=causal, cu_seqlens=docs)
        expected = (burst.forward_bytes(size, *local[:3], **formula),
                    burst.backward_bytes(size, *local[:3], **formula))
        return whole, (fwd_bytes, bwd_bytes) == expected

    results = run_ranks(size, body, backend=backend)
    keep = document_mask(n, causal, docs)
    refs = [attention_ref(q, k, v, keep=keep)[0], *attention_backward_ref(dout, q, k, v, keep=keep)]
    naives = [attention_ref(q, k, v, keep=keep, dtype=np.float32, round_to=q.dtype)[0],
              *attention_backward_ref(dout, q, k, v, keep=keep, dtype=np.float32, round_to=q.dtype,
                                      out_dtype=q.dtype)]
    detail, ok = {}, True
    for rank, (whole, bytes_ok) in enumerate(results):
        for name, got, want, plain, factor in zip(("out", "dq", "dk", "dv"), whole, refs, naives,
                                                  (FWD_FACTOR,) + (BWD_FACTOR,) * 3):
            good, why = _rule(got, want, plain, factor)
            ok &= good
            if rank == 0 or not good:
                detail[f"rank{rank}/{name}"] = why
        ok &= bytes_ok
        if not bytes_ok:
            detail[f"rank{rank}/bytes"] = "bytes sent differ from the burst formulas"
    return ok, detail


# uneven shards and documents: (size, layout, causal, n, document lengths)
UNEVEN = [(3, "contiguous", True, 3 * 256 + 1, None), (3, "zigzag", True, 3 * 256 + 5, None),
          (4, "zigzag", True, 4 * 256 - 3, (1, 200, 37, 513, 64)),
          (2, "contiguous", False, 2 * 256 + 1, (300, 7, 90)),
          (4, "documents", True, 4 * 256 - 3, (1, 200, 37, 513, 64))]   # the short ones whole


def check_loopback(backend: str, quick: bool) -> list[dict]:
    grid = ([(2, "zigzag", True), (3, "contiguous", False)] if quick else
            [(g, lay, c) for g in (2, 3, 4) for lay in ("contiguous", "zigzag") for c in (False, True)])
    seqlen_local, d = (32, 32) if quick else (256, 64)
    out = []
    for i, (size, layout, causal) in enumerate(grid):
        ok, detail = loopback_case(backend, size, layout, causal, seqlen_local, d, seed=100 + i)
        out.append(record(f"loopback/G{size}/{layout}/{'causal' if causal else 'full'}", ok, detail))
    for i, (size, layout, causal, n, docs) in enumerate(UNEVEN[:1] if quick else UNEVEN):
        n = n if not quick else n // 8
        ok, detail = loopback_case(backend, size, layout, causal, seqlen_local, d, seed=200 + i,
                                   n=n, doc_lengths=docs)
        out.append(record(f"loopback/G{size}/{layout}/{'causal' if causal else 'full'}/N{n}"
                          + ("/docs" if docs else ""), ok, detail))
    return out


def versions() -> dict:
    """Versions of what the checks ran on (None where a package is missing)."""
    import sys

    out: dict = {"python": sys.version.split()[0], "numpy": np.__version__}
    for name in ("cupy", "torch", "ml_dtypes", "mpi4py"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - optional
            out[name] = None
    try:
        from ..build.compile import nvrtc_version
        out["nvrtc"] = ".".join(str(x) for x in nvrtc_version())
    except Exception:  # noqa: BLE001
        out["nvrtc"] = None
    try:
        from cupy.cuda import nccl
        v = int(nccl.get_version())  # e.g. 22809 = 2.28.9
        out["nccl"] = f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    except Exception:  # noqa: BLE001
        out["nccl"] = None
    try:
        import cupy
        cuda = lambda v: f"{v // 1000}.{v % 1000 // 10}" if v else None  # noqa: E731 - 13000: 13.0
        out["driver"] = cuda(cupy.cuda.runtime.driverGetVersion())  # newest CUDA it supports
        out["cuda_runtime"] = cuda(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:  # noqa: BLE001 - no driver on a CPU-only machine
        out["driver"] = None
    return out


def device_name(backend: str) -> str:
    if not on_gpu(backend):
        return "CPU (CUDA kernels on the emulator)"
    import cupy
    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    return f"{props['name'].decode()} (sm_{props['major']}{props['minor']})"


CHECKS = {"variants": check_variants, "kernels": check_kernels, "ring_steps": check_ring_steps,
          "nccl": check_nccl, "determinism": check_determinism, "loopback": check_loopback}


def run_all(backend: str, quick: bool, only: list[str] | None = None,
            progress: Callable[[str], None] | None = None) -> list[dict]:
    """Every check (or those named in `only`) on `backend` ("cupy" or "emulated")."""
    records = []
    for name, fn in CHECKS.items():
        if only and name not in only:
            continue
        if progress:
            progress(f"check {name} on {backend}{' (quick)' if quick else ''}")
        records += guarded(name, lambda fn=fn: fn(backend, quick))
    return records
