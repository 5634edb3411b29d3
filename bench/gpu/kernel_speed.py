"""One GPU, one rank: burstcu's CUDA kernels against PyTorch's scaled_dot_product_attention on
the same device and memory (DLPack views, no copy), in the same run. Implementations: `kernels`
(the step kernels alone through KernelOps, one step over every key: what a ring step costs; once
per kernel table of --archs and dQ mode of --dq-modes, each row naming the forward and backward
families that ran, sm90 or sm80), `api`
(burstcu.attention / attention_backward, group=None), `torch-flash`, `torch-cudnn`. Shapes (B, S,
H, D) = (tokens/S, S, width/D, D); CUDA events around each call, median of --repeats after
--warmup; FLOPs 4BHS^2D forward, 2.5x that backward, halved when causal; host_ms: a call's host
seconds alone. --windows W adds causal sliding-window rows (burstcu only, FLOPs of the visible
pairs). --dry-run prints the plan without a GPU.

    python bench/gpu/kernel_speed.py [--dtypes float16 bfloat16] [--headdims 64 128 256]
        [--seqlens 1024 ... 16384] [--passes fwd fwd+bwd] [--impls ...] [--archs sm_90a sm_80]
        [--windows 512 ...] [--dq-modes atomic deterministic] [--repeats 10] [--json F] [--table F]
        [--plot F] [--dry-run]
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench._common import (call_seconds, clean, gpu_shape, gpu_versions, normal,  # noqa: E402
                           progress, pyplot, save, table, write_json)

IMPLS = ("kernels", "api", "torch-flash", "torch-cudnn")
PASSES = ("fwd", "fwd+bwd")


def visible_pairs(s: int, left: int) -> int:
    """(query, key) pairs a causal window (left, 0) keeps over S positions: query i sees keys
    max(0, i - left) .. i."""
    if left < 0 or left >= s - 1:
        return s * (s + 1) // 2
    return (left + 1) * s - left * (left + 1) // 2


def flops(b, s, h, d, causal: bool, pass_: str, window: int | None = None) -> float:
    if window is None:
        fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    else:
        fwd = 4.0 * b * h * visible_pairs(s, window) * d
    return fwd * (3.5 if pass_ == "fwd+bwd" else 1.0)


def plan(args) -> list[dict]:
    rows = []
    for dtype in args.dtypes:
        for d in args.headdims:
            for s in args.seqlens:
                masks = [(False, None), (True, None)] + [(True, w) for w in args.windows if w < s]
                for causal, window in masks:
                    for pass_ in args.passes:
                        b, _, h, _ = gpu_shape(args.tokens, args.width, s, d)
                        rows.append({"dtype": dtype, "headdim": d, "seqlen": s, "causal": causal,
                                     "window": window, "pass": pass_, "batch": b, "heads": h,
                                     "gflop": flops(b, s, h, d, causal, pass_, window) / 1e9})
    return rows


# ------------------------------------------------------------------------------------------------
# the timed callables

def burstcu_kernels(ops, q, k, v, dout, causal: bool, pass_: str, window: int | None = None):
    """The step kernels alone: one full (or causal, or causal-windowed) block over every key."""
    from burstcu.layout import Block

    s = q.shape[1]
    blocks = [Block(0, s, 0, s, 0, 0, causal, left=-1 if window is None else window)]
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        state = ops.forward_init(q, scale)
        ops.forward_step(state, k, v, blocks)
        out, lse = ops.forward_finalize(state, q.dtype)
        if pass_ == "fwd":
            return
        delta = ops.backward_delta(dout, out)
        ctx = ops.backward_init(k, v, scale)
        dq = ops.xp.zeros(q.shape, dtype=np.float32)
        ops.backward_step(ctx, q, dout, lse, delta, dq, blocks)
        ops.backward_finalize(ctx, q.dtype)
        dq.astype(q.dtype)
    return run


def burstcu_api(q, k, v, dout, causal: bool, pass_: str, window: int | None = None):
    import burstcu

    mask = {"causal": causal, "window_size": (-1 if window is None else window, -1 if not causal else 0)}

    def run():
        out, lse = burstcu.attention(q, k, v, return_lse=True, **mask)
        if pass_ == "fwd+bwd":
            burstcu.attention_backward(dout, q, k, v, out, lse, **mask)
    return run


def torch_sdpa(backend: str, q, k, v, dout, causal: bool, pass_: str):
    """SDPA on the same memory as (B, H, S, D) views; None when torch is missing or the backend
    refuses the shape."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as exc:
        progress(f"  {backend} skipped: {exc}")
        return None

    which = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, dout))
    if pass_ == "fwd+bwd":
        tq, tk, tv = (t.detach().requires_grad_(True) for t in (tq, tk, tv))

    def run():
        with sdpa_kernel([which]), (torch.no_grad() if pass_ == "fwd" else nullcontext()):
            out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            if pass_ == "fwd+bwd":
                torch.autograd.grad(out, (tq, tk, tv), tdo)
    try:
        run()
    except RuntimeError as exc:  # e.g. the flash backend has no kernel for this head dim
        progress(f"  {backend} refused: {str(exc).splitlines()[0][:120]}")
        return None
    return run


# ------------------------------------------------------------------------------------------------

def family(ops, dtype: str, headdim: int) -> str:
    """Which forward family `ops` runs for (dtype, head dim): "sm90" or "sm80"."""
    return "sm90" if ops.forward_variant(dtype, headdim).family.startswith("forward_sm90") else "sm80"


def bwd_family(ops, cfg: dict) -> str:
    """Which dK/dV family `ops` runs for the configuration's one Block: "sm90" (the Hopper
    kernel, KernelOps.hopper_backward) or "sm80"."""
    from burstcu.layout import Block

    s, d = cfg["seqlen"], cfg["headdim"]
    blocks = [Block(0, s, 0, s, 0, 0, cfg["causal"])]
    dkdv = "bwd_dkdv_nodq" if ops.deterministic else "bwd_dkdv"
    shape = (cfg["batch"], s, cfg["heads"], d)
    hopper = ops.hopper_backward(dkdv, cfg["dtype"], d, blocks, shape, 1.0 / math.sqrt(d))
    return "sm80" if hopper is None else "sm90"


def run_config(cfg, args, ops_by_arch) -> list[dict]:
    import cupy
    device_synchronize = cupy.cuda.runtime.deviceSynchronize   # every stream: CuPy's and torch's
    q, k, v, dout = normal(cupy, [tuple(cfg[k] for k in ("batch", "seqlen", "heads", "headdim"))] * 4,
                           cfg["dtype"], 0)
    gflop = cfg["gflop"]
    rows = []
    runs = [(impl, key) for impl in args.impls
            for key in (ops_by_arch if impl == "kernels" else [None])]
    for impl, key in runs:
        tags = {}
        if impl == "kernels":
            ops = ops_by_arch[key]
            tags = {"arch": key[0], "dq": key[1], "family": family(ops, cfg["dtype"], cfg["headdim"])}
            if cfg["pass"] == "fwd+bwd":
                tags["bwd_family"] = bwd_family(ops, cfg)
            fn = burstcu_kernels(ops, q, k, v, dout, cfg["causal"], cfg["pass"], cfg["window"])
        elif impl == "api":
            fn = burstcu_api(q, k, v, dout, cfg["causal"], cfg["pass"], cfg["window"])
        elif cfg["window"] is not None:
            continue                                    # SDPA has no sliding window
        else:
            fn = torch_sdpa(impl, q, k, v, dout, cfg["causal"], cfg["pass"])
        # torch issues on its own stream: for every implementation alike the device is
        # synchronized inside the timed region
        ms = None if fn is None else 1e3 * float(np.median(
            call_seconds(fn, args.repeats, args.warmup, cuda=True, sync_inside=True)))
        # the host's part: a call's own seconds, the device idle at its start, nothing waited for
        host_ms = None if fn is None else 1e3 * float(np.median(
            call_seconds(fn, args.repeats, 0, before=device_synchronize)))
        device_synchronize()
        rows.append({**{key: cfg[key] for key in ("pass", "dtype", "headdim", "seqlen", "causal",
                                                  "window", "batch", "heads")},
                     "impl": impl, **tags, "ms": ms, "host_ms": host_ms,
                     "tflops": None if ms is None else gflop / ms})
    torch_row = next((r for r in rows if r["impl"] == "torch-flash"), None)    # None if windowed
    cudnn_row = next((r for r in rows if r["impl"] == "torch-cudnn"), None)
    for r in rows:
        if torch_row and r["impl"] in ("kernels", "api"):
            r["torch_ms"], r["torch_tflops"] = torch_row["ms"], torch_row["tflops"]
            if r["ms"] and torch_row["ms"]:
                r["vs_torch"] = torch_row["ms"] / r["ms"]
        if cudnn_row and r["impl"] in ("kernels", "api"):
            r["cudnn_tflops"] = cudnn_row["tflops"]
    return rows


COLUMNS = ["impl", "family", "bwd_family", "dq", "pass", "dtype", "headdim", "seqlen", "causal",
           "window", "batch", "heads", "ms", "host_ms", "tflops", "vs_torch", "cudnn_tflops"]


def plot(rows, path) -> None:
    plt = pyplot()
    keys = sorted({(r["pass"], r["dtype"], r["headdim"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4), squeeze=False)
    for ax, (pass_, dtype, d) in zip(axes[0], keys):
        lines = sorted({(r["impl"], r.get("family") or "", r.get("dq") or "") for r in rows})
        for impl, fam, dq in lines:
            for causal, style in ((False, "-"), (True, "--")):
                pts = [(r["seqlen"], r["tflops"]) for r in rows
                       if (r["impl"], r.get("family") or "", r.get("dq") or "") == (impl, fam, dq)
                       and r["tflops"] and
                       (r["pass"], r["dtype"], r["headdim"], r["causal"]) == (pass_, dtype, d, causal)]
                if pts:
                    xs, ys = zip(*sorted(pts))
                    name = " ".join(part for part in (impl, fam, dq if dq == "deterministic" else "")
                                    if part)
                    ax.plot(xs, ys, style, marker="o", ms=3,
                            label=f"{name}{' causal' if causal else ''}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{pass_} {dtype} d={d}", fontsize=9)
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
    axes[0][0].legend(fontsize=6)
    save(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    p.add_argument("--headdims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--passes", nargs="+", default=list(PASSES), choices=PASSES)
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen per configuration")
    p.add_argument("--width", type=int, default=2048, help="heads x headdim")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--table", help="also write the text table here")
    p.add_argument("--plot")
    p.add_argument("--windows", nargs="*", type=int, default=[],
                   help="also causal sliding windows (W, 0), burstcu only")
    p.add_argument("--archs", nargs="*", default=[],
                   help="kernel tables for the kernels rows (e.g. sm_90a sm_80); default: the device's")
    p.add_argument("--sm90-head-group", type=int, default=None,
                   help="(batch, head) pairs whose tiles the Hopper kernel's grid takes together "
                        "(KernelOps.sm90_head_group; default: all)")
    p.add_argument("--dq-modes", nargs="+", default=["atomic"], choices=["atomic", "deterministic"],
                   help="the backward's dQ in the kernels rows: fp32 atomics, and/or the "
                        "deterministic kernels (KernelOps(deterministic=True))")
    p.add_argument("--dry-run", action="store_true", help="print the plan; needs no GPU")
    args = p.parse_args(argv)

    configs = plan(args)
    if args.dry_run:
        print(table(configs, ["pass", "dtype", "headdim", "seqlen", "causal", "window", "batch",
                              "heads", "gflop"]))
        print(f"# {len(configs)} configurations x {len(args.impls)} implementations "
              f"({', '.join(args.impls)}); dry run: nothing timed")
        return 0

    from burstcu.ops.cuda.kernel_ops import KernelOps
    # (the table the kernels run, dQ mode) -> KernelOps
    ops_by_arch = {(ops.arch, dq): ops for dq in args.dq_modes
                   for ops in [KernelOps("cupy", arch=arch, deterministic=dq == "deterministic")
                               for arch in args.archs or [None]]}
    for ops in ops_by_arch.values():
        ops.sm90_head_group = args.sm90_head_group
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
            write_json(args.json, {"versions": env, "args": clean(vars(args)), "rows": rows,
                                   "complete": i + 1 == len(configs)})
    text = table(rows, COLUMNS)
    print(text, flush=True)
    if args.table:
        with open(args.table, "w") as fh:
            fh.write(f"# {env.get('device')}: measured, CUDA events, median of {args.repeats}\n"
                     + text + "\n")
    if args.plot:
        plot([r for r in rows if r.get("tflops") and r.get("window") is None], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
