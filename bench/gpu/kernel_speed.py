"""One GPU, one rank: burstcu's CUDA kernels against PyTorch's scaled_dot_product_attention on the
same device and memory (DLPack views, no copy), in the same run. Implementations: `kernels` (the
step kernels alone through KernelOps, one step over every key said to be the pass's last: what
one rank's call runs, one kernel that neither reads the state nor leaves the finalize to its own
kernel, the Hopper step or flash_fwd_pass; `step` the same with KernelOps.whole_pass False: the
state zeroed, read, written and finalized, what a ring's middle step costs beside init and
finalize), each once per kernel table of --archs, dQ mode of --dq-modes, head group of --sm90-head-group and atomic dQ adds
of --dq-adds (the Hopper backward's: two floats an atomic add, one, or bulk reductions), each row
naming the forward and backward families that ran, sm90 or sm80), `api` (burstcu.attention /
attention_backward, group=None), `torch-flash`, `torch-cudnn`. Shapes (B, S, H, D) = (--tokens/S,
S, --width/D, D); CUDA events around each call, calls back to back (`--sync-inside`: the device
synced around each), median of --rounds x --repeats, the rounds taking the implementations in turn
(`spread`: how far two rounds' medians differ); FLOPs
4BHS^2D forward, 2.5x that backward, halved when causal; host_ms: a call's host seconds alone.
--windows W adds causal sliding-window rows (burstcu only, FLOPs of the visible pairs). --dry-run
prints the plan without a GPU.

    python bench/gpu/kernel_speed.py [--dtypes float16 bfloat16] [--headdims 64 128 256]
        [--seqlens 1024 ... 16384] [--passes fwd fwd+bwd] [--impls ...] [--archs sm_90a sm_80]
        [--windows 512 ...] [--dq-modes atomic deterministic] [--sm90-head-group 0 8 ...]
        [--dq-adds pairs singles bulk]
        [--repeats 10] [--rounds 3] [--sync-inside] [--profile-timed] [--json F] [--table F] [--plot F]
        [--dry-run]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench._common import (call_seconds, clean, gpu_shape, gpu_versions, median, no_gpu,  # noqa: E402
                           normal, progress, pyplot, rounds_of_calls, save, table, torch_shares_cupy_stream,
                           write_json)
from burstcu.build.bwd_variants import SM90_DQ_ADDS  # noqa: E402

IMPLS = ("kernels", "step", "api", "torch-flash", "torch-cudnn")
KERNEL_IMPLS = ("kernels", "step")   # through KernelOps: a row a kernel table x dQ mode x ...
PASSES = ("fwd", "fwd+bwd")
SHAPE = ("pass", "dtype", "headdim", "seqlen", "causal", "window", "batch", "heads")
COLUMNS = ["impl", "family", "bwd_family", "dq", "dq_pass", "dq_adds", "head_group", *SHAPE, "ms", "spread",
           "host_ms", "host_bound", "tflops", "vs_torch", "cudnn_tflops"]


def plan(args) -> list[dict]:
    """A configuration a (dtype, head dim, seqlen, mask, pass): its shape and GFLOP, 4 B H D a
    (query, key) pair forward and 3.5x that forward + backward, the pairs S^2 (half causal) or
    under a causal window (W, 0) query i's keys max(0, i - W) .. i."""
    rows = []
    for dtype, d, s in itertools.product(args.dtypes, args.headdims, args.seqlens):
        masks = [(False, None), (True, None)] + [(True, w) for w in args.windows if w < s]
        for (causal, window), pass_ in itertools.product(masks, args.passes):
            b, _, h, _ = gpu_shape(args.tokens, args.width, s, d)
            if window is None:
                fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
            else:
                pairs = (s * (s + 1) // 2 if window < 0 or window >= s - 1
                         else (window + 1) * s - window * (window + 1) // 2)
                fwd = 4.0 * b * h * pairs * d
            rows.append({"dtype": dtype, "headdim": d, "seqlen": s, "causal": causal, "window": window,
                         "pass": pass_, "batch": b, "heads": h,
                         "gflop": fwd * (3.5 if pass_ == "fwd+bwd" else 1.0) / 1e9})
    return rows


def attention_call(impl: str, ops, cfg: dict, q, k, v, dout):
    """fn() running `impl` once (forward, or forward + backward) on q, k, v, dout (B, S, H, D)
    under the configuration's mask: `kernels` and `step` the step kernels alone, one block over
    every key (`step`: KernelOps.whole_pass off); `api` burstcu.attention; torch's SDPA on the same memory as (B, H, S, D) views, None when
    torch is missing or the backend refuses the shape."""
    causal, window, bwd = cfg["causal"], cfg["window"], cfg["pass"] == "fwd+bwd"
    if impl in KERNEL_IMPLS:
        from burstcu.layout import Block

        s, scale = q.shape[1], 1.0 / math.sqrt(q.shape[-1])
        blocks = [Block(0, s, 0, s, 0, 0, causal, left=-1 if window is None else window)]

        def run():
            ops.whole_pass = impl == "kernels"
            state = ops.forward_init(q, scale)
            ops.forward_step(state, k, v, blocks, True)
            out, lse = ops.forward_finalize(state, q.dtype)
            if bwd:
                delta, ctx = ops.backward_delta(dout, out), ops.backward_init(k, v, scale)
                dq = ops.xp.zeros(q.shape, dtype=np.float32)
                ops.backward_step(ctx, q, dout, lse, delta, dq, blocks)
                ops.backward_finalize(ctx, q.dtype)
                dq.astype(q.dtype)
        return run
    if impl == "api":
        import burstcu

        mask = {"causal": causal, "window_size": (-1 if window is None else window, -1 if not causal else 0)}

        def run():
            out, lse = burstcu.attention(q, k, v, return_lse=True, **mask)
            if bwd:
                burstcu.attention_backward(dout, q, k, v, out, lse, **mask)
        return run
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        progress(f"  {impl} skipped: {exc}")
        return None
    which = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
    if bwd:
        tq, tk, tv = (t.detach().requires_grad_(True) for t in (tq, tk, tv))

    def run():
        with sdpa_kernel([which]), torch.set_grad_enabled(bwd):
            out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            if bwd:
                torch.autograd.grad(out, (tq, tk, tv), tdo)
    try:
        run()
    except RuntimeError as exc:  # e.g. the flash backend has no kernel for this head dim
        progress(f"  {impl} refused: {str(exc).splitlines()[0][:120]}")
        return None
    return run


def families(ops, cfg: dict) -> dict:
    """The families `ops` runs for the configuration's one Block, "sm90" (the Hopper kernels) or
    "sm80": {"family": the forward's} and, fwd+bwd, {"bwd_family": dK/dV's (KernelOps.hopper_backward),
    "dq_pass": "atomic" (dQ added inside the dK/dV kernel), "bulk" (the same by the Hopper bulk
    family's tensor reductions) or "own" (flash_bwd_dq after it, KernelOps.dq_own_pass: the
    deterministic mode, and the Hopper backward at head dim 256), "dq_adds": how the Hopper
    kernel added dQ ("pairs", "singles" or "bulk"; None where it did not: the forward, the
    mma.sync kernels, dQ in its own pass)}."""
    from burstcu.layout import Block
    from burstcu.ops.cuda.backward import DQ_ADDS_NAMES, dq_adds_of, step_kernels

    s, d = cfg["seqlen"], cfg["headdim"]
    fwd = ops.forward_variant(cfg["dtype"], d).family.startswith("forward_sm90")
    tags = {"family": "sm90" if fwd else "sm80", "dq_adds": None}
    if cfg["pass"] == "fwd+bwd":
        families, hopper = step_kernels(ops, cfg["dtype"], d, [Block(0, s, 0, s, 0, 0, cfg["causal"])],
                                        (cfg["batch"], s, cfg["heads"], d), 1.0 / math.sqrt(d))
        tags.update(bwd_family="sm80" if hopper is None else "sm90",
                    dq_pass="own" if len(families) > 1 else
                    "bulk" if hopper is not None and "bulk" in hopper.family else "atomic")
        if hopper is not None and len(families) == 1:   # the arrays here sit on 16 bytes
            tags["dq_adds"] = DQ_ADDS_NAMES[dq_adds_of(ops, hopper, aligned=True)]
    return tags


def profiled(on: bool):
    """A context in which the CUDA profiler runs (`ncu --profile-from-start off` profiles only
    the kernels launched inside: the timed calls, not the first-use checks and warm-up before
    them), or a context that does nothing."""
    import contextlib

    import cupy

    @contextlib.contextmanager
    def inside():
        cupy.cuda.runtime.deviceSynchronize()
        cupy.cuda.profiler.start()
        try:
            yield
        finally:
            cupy.cuda.runtime.deviceSynchronize()
            cupy.cuda.profiler.stop()
    return inside() if on else contextlib.nullcontext()


def run_config(cfg, args, ops_by_arch) -> list[dict]:
    """A row an implementation (and kernel table x dQ mode x ...) of one configuration, each
    timed in --rounds rounds that take the implementations in turn (a drift of the device's
    clocks spreads over all of them): ms is the median of every call, spread the largest
    difference between two rounds' medians as a fraction of ms, host_bound whether host_ms is
    at least 0.8 of ms (then ms is the host's time, not the kernels'); each round warms a call up
    first (at least --warmup calls and 25 ms, each call waited for)."""
    import cupy
    device_synchronize = cupy.cuda.runtime.deviceSynchronize   # every stream: CuPy's and torch's
    q, k, v, dout = normal(cupy, [tuple(cfg[k] for k in ("batch", "seqlen", "heads", "headdim"))] * 4,
                           cfg["dtype"], 0)
    calls = []   # (row, fn): fn None where the implementation cannot run the configuration
    for impl, key in ((i, key) for i in args.impls for key in (ops_by_arch if i in KERNEL_IMPLS else [None])):
        if impl.startswith("torch") and cfg["window"] is not None:
            continue                                    # SDPA has no sliding window
        ops = ops_by_arch.get(key)
        tags = ({"arch": key[0], "dq": key[1], "head_group": key[2], "dq_adds": key[3], **families(ops, cfg)}
                if impl in KERNEL_IMPLS else {})
        calls.append(({**{f: cfg[f] for f in SHAPE}, "impl": impl, **tags},
                      attention_call(impl, ops, cfg, q, k, v, dout)))
    timed = rounds_of_calls([fn for _, fn in calls], args.rounds, args.repeats, args.warmup, 0.025,
                            lambda: profiled(args.profile_timed), cuda=True, **timing_of(args))
    rows = []
    for (row, fn), (got, per_round) in zip(calls, timed):
        ms = 1e3 * median(got) if got else None
        # host_ms: a call's own seconds, the device idle at its start
        host_ms = 1e3 * median(call_seconds(fn, args.repeats, 0, before=device_synchronize)) if fn else None
        device_synchronize()
        rows.append({**row, "ms": ms, "host_ms": host_ms, "tflops": None if ms is None else cfg["gflop"] / ms,
                     "round_ms": [1e3 * t for t in per_round],
                     "spread": (max(per_round) - min(per_round)) * 1e3 / ms if ms else None,
                     # calls back to back: where the host path is most of a call, ms is the host's
                     "host_bound": host_ms >= 0.8 * ms if ms else None})
    flash, cudnn = (next((r for r in rows if r["impl"] == n), None) for n in ("torch-flash", "torch-cudnn"))
    for r in (r for r in rows if r["impl"] in (*KERNEL_IMPLS, "api")):
        if flash:                                       # None if windowed
            r["torch_ms"], r["torch_tflops"] = flash["ms"], flash["tflops"]
            if r["ms"] and flash["ms"]:
                r["vs_torch"] = flash["ms"] / r["ms"]
        if cudnn:
            r["cudnn_tflops"] = cudnn["tflops"]
    return rows


def timing_of(args) -> dict:
    """call_seconds' CUDA timing, the same for every implementation: calls back to back, an
    event pair each ("pipelined"), where every implementation launches on CuPy's stream (torch
    does by default; without torch rows, only ours); else, or with --sync-inside, the device
    synced around each call ("synced"). Decided once, kept in args.timing."""
    if args.timing is None:
        shared = not args.sync_inside
        if shared and any(impl.startswith("torch") for impl in args.impls):
            try:
                shared = torch_shares_cupy_stream()
            except Exception as exc:  # noqa: BLE001 - torch without CUDA: its rows fail on their own
                progress(f"  torch's stream unknown ({exc.__class__.__name__}: {exc}): timing synced")
                shared = False
        args.timing = "pipelined" if shared else "synced"
    return {"pipelined": True} if args.timing == "pipelined" else {"sync_inside": True}


def plot(rows, path) -> None:
    """TFLOP/s against seqlen, a panel a (pass, dtype, head dim), a line an implementation and mask."""
    plt = pyplot()
    keys = sorted({(r["pass"], r["dtype"], r["headdim"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4), squeeze=False)

    def line(r):
        return (r["impl"], r.get("family") or "", r.get("dq") or "", r.get("head_group") or 0,
                r.get("dq_adds") or "")
    for ax, (pass_, dtype, d) in zip(axes[0], keys):
        for (impl, fam, dq, group, adds), (causal, style) in itertools.product(
                sorted({line(r) for r in rows}), ((False, "-"), (True, "--"))):
            pts = [(r["seqlen"], r["tflops"]) for r in rows if line(r) == (impl, fam, dq, group, adds)
                   and r["tflops"]
                   and (r["pass"], r["dtype"], r["headdim"], r["causal"]) == (pass_, dtype, d, causal)]
            if pts:
                name = " ".join(part for part in (impl, fam, dq if dq == "deterministic" else "",
                                                  f"G={group}" if group else "",
                                                  f"dQ {adds}" if adds not in ("", "pairs") else "") if part)
                ax.plot(*zip(*sorted(pts)), style, marker="o", ms=3,
                        label=f"{name}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{pass_} {dtype} d={d}", fontsize=9)
        ax.set(xlabel="seqlen", ylabel="TFLOP/s")
    axes[0][0].legend(fontsize=6)
    save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    p.add_argument("--headdims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    for flag, default, text in (("--tokens", 16384, "batch x seqlen per configuration"),
                                ("--width", 2048, "heads x headdim"),
                                ("--warmup", 2, "calls before each round's timing (and 25 ms at least)"),
                                ("--repeats", 10, "calls timed a round"),
                                ("--rounds", 3, "rounds, each timing every implementation in turn")):
        p.add_argument(flag, type=int, default=default, help=text)
    for flag, text in (("--json", None), ("--table", "also write the text table here"), ("--plot", None)):
        p.add_argument(flag, help=text)
    p.add_argument("--windows", nargs="*", type=int, default=[], help="causal sliding windows (W, 0)")
    p.add_argument("--archs", nargs="*", default=[], help="kernel tables (default: the device's)")
    p.add_argument("--sm90-head-group", type=int, nargs="+", default=[0],
                   help="(batch, head) pairs whose tiles the Hopper kernel's grid takes together "
                        "(KernelOps.sm90_head_group; 0: all, the default); several: a kernels row "
                        "each, timed one after another in the same run")
    p.add_argument("--dq-modes", nargs="+", default=["atomic"], choices=["atomic", "deterministic"],
                   help="the backward's dQ: fp32 atomics, and/or KernelOps(deterministic=True)")
    p.add_argument("--dq-adds", nargs="+", default=["pairs"], choices=SM90_DQ_ADDS,
                   help="how the Hopper backward adds dQ (KernelOps.sm90_dq_adds): two floats an "
                        "atomic add, one, or bulk tensor reductions; several: a kernels row each")
    p.add_argument("--sync-inside", action="store_true",
                   help="sync the device around each timed call (default: calls back to back where "
                        "torch shares CuPy's stream, each call's device time)")
    p.add_argument("--profile-timed", action="store_true",
                   help="run the CUDA profiler around the timed calls only (ncu --profile-from-start off)")
    p.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = p.parse_args(argv)
    args.timing = None
    configs = plan(args)
    if args.dry_run:
        print(table(configs, [*SHAPE, "gflop"]))
        print(f"# {len(configs)} configurations x {len(args.impls)} implementations "
              f"({', '.join(args.impls)}); dry run: nothing timed")
        return 0
    if (status := no_gpu("kernel_speed.py")) is not None:
        return status

    from burstcu.ops.cuda.kernel_ops import KernelOps
    ops_by_arch = {}   # (kernel table, dQ mode, head group, dQ adds) -> KernelOps
    for dq, arch, group, adds in itertools.product(args.dq_modes, args.archs or [None],
                                                   args.sm90_head_group, args.dq_adds):
        ops = KernelOps("cupy", arch=arch, deterministic=dq == "deterministic")
        ops.sm90_head_group, ops.sm90_dq_adds = group or None, adds
        ops_by_arch[ops.arch, dq, group, adds] = ops
    env = gpu_versions()
    progress(f"device {env.get('device')}, cupy {env.get('cupy')}, torch {env.get('torch')}")
    rows = []
    for i, cfg in enumerate(configs):
        progress(f"[{i + 1}/{len(configs)}] {cfg['pass']} {cfg['dtype']} d={cfg['headdim']} "
                 f"S={cfg['seqlen']} causal={cfg['causal']} window={cfg['window']}")
        try:
            rows += run_config(cfg, args, ops_by_arch)
        except Exception as exc:  # one failing configuration must not lose the others
            progress(f"  FAILED: {exc.__class__.__name__}: {exc}")
            rows.append({**cfg, "impl": "error", "error": f"{exc.__class__.__name__}: {exc}"})
        for ops in ops_by_arch.values():
            ops.release_buffers()
        if args.json:  # rewritten after every configuration: a run cut short keeps what it timed
            write_json(args.json, {"versions": env, "args": clean(vars(args)), "timing": args.timing,
                                   "rows": rows, "complete": i + 1 == len(configs)})
    text = table(rows, COLUMNS)
    print(text, flush=True)
    if args.table:
        Path(args.table).write_text(f"# {env.get('device')}: measured, CUDA events ({args.timing}), "
                                    f"median of {args.rounds} x {args.repeats} calls\n{text}\n")
    if args.plot:
        plot([r for r in rows if r.get("tflops") and r.get("window") is None], args.plot)
    failed = sum(r["impl"] == "error" for r in rows)
    if failed:
        progress(f"{failed} of {len(configs)} configurations raised (their rows say why)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
