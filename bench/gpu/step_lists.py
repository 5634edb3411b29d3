"""A ring step's rectangles in one launch, packed into the kernels' tiles (burstcu/ops/cuda/packing.py)
and a tile a rectangle, against one launch a rectangle, every (rank, step) of a causal ring under
per-document zigzag, "documents" (the short ones whole) and contiguous (bench/README.md); CUDA
events on a GPU, median of --repeats; --backend emulated: host seconds, never GPU figures.
--dry-run also counts the tiles each way would run (the packing model's count, no kernel runs).

    python bench/gpu/step_lists.py [--ranks 4] [--seqlen 65536] [--docs 241] [--arch sm_90]
                                   [--passes fwd bwd] [--json F]
    python bench/gpu/step_lists.py --dry-run           # the plan only, anywhere
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench._common import (call_seconds, clean, document_mix, emit, median, no_gpu, normal,  # noqa: E402
                           progress, table, write_json)

# a step's rectangles in one step call (packed where that pays, or a tile a rectangle), or a step
# call each
WAYS = ("packed", "list", "per_rect")
STEP_KERNELS = {"fwd": ("flash_fwd_step",), "bwd": ("flash_bwd_dkdv", "flash_bwd_dq")}


def exact_mix(tokens: int, documents: int) -> tuple[int, ...]:
    """cu_seqlens of exactly `documents` documents over `tokens`: `document_mix`'s long-tailed
    lengths (its median lowered until it draws enough), the last document running to the end."""
    median = tokens / documents
    while len(mix := document_mix(tokens, seed=0, median=median)) <= documents:
        median /= 1.5
    return mix[:documents] + (tokens,)


def measure(args, ops, layout_name: str, docs, passes: str) -> dict:
    """The row of one layout's (rank, step)s launched both ways, forward ("fwd") or backward ("bwd")."""
    from burstcu import layout

    xp, cuda, function = ops.xp, ops.device == "cuda", ops.function
    part = layout.partition(layout_name, args.ranks, args.seqlen, docs)
    seeds = iter(range(1 << 30))                 # the inputs, drawn where they live (on the GPU)
    row = {"pass": passes, "layout": layout_name, "docs": 0 if docs is None else len(docs) - 1,
           "rectangles": 0, "kept_pairs": 0} | {f"{key}_{way}": 0 for way in WAYS
                                                 for key in ("ms", "launches")}
    now = {"way": "list", "launches": 0}
    kernels: dict[str, set] = {way: set() for way in WAYS}   # the step kernels each way ran

    def counted(name):
        now["launches"] += 1
        if name.startswith(STEP_KERNELS[passes]):
            kernels[now["way"]].add(name.split("<")[0])
        return function(name)
    ops.function = counted
    try:
        for qr in range(args.ranks):
            shape = (1, part.lengths[qr], args.heads, args.headdim)
            q, dout = normal(xp, [shape] * 2, args.dtype, next(seeds))
            # the forward's row statistics as a backward step reads them (lse of the scores' order)
            stats = (1, args.heads, part.lengths[qr])
            lse, delta = normal(xp, [stats] * 2, "float32", next(seeds))
            lse += 4
            for step in range(args.ranks):
                kr = (qr - step) % args.ranks
                blocks = layout.blocks(part, qr, kr, True, (-1, -1), docs)
                if not blocks:
                    continue
                kv = (1, part.lengths[kr], args.heads, args.headdim)
                k, v = normal(xp, [kv] * 2, args.dtype, next(seeds))
                if passes == "fwd":             # run(rects): the step over those rectangles
                    run = partial(ops.forward_step, ops.forward_init(q), k, v)
                else:
                    ctx = ops.backward_init(k, v, args.headdim ** -0.5)
                    run = partial(ops.backward_step, ctx, q, dout, lse, delta, xp.zeros(q.shape, np.float32))
                ways = {"packed": lambda: run(blocks), "list": lambda: run(blocks),
                        "per_rect": lambda: [run([b]) for b in blocks]}
                for way, fn in ways.items():
                    now["way"] = way
                    ops.pack_lists = way == "packed"
                    fn()                                   # compiles, and a warm-up
                    now["launches"] = 0
                    fn()
                    row[f"launches_{way}"] += now["launches"]
                    seconds = call_seconds(fn, args.repeats, 0, cuda=cuda, after=None if cuda else ops.sync)
                    row[f"ms_{way}"] += median(seconds) * 1e3
                row["rectangles"] += len(blocks)
                row["kept_pairs"] += layout.kept_pairs(blocks)
            progress(f"{layout_name}: rank {qr + 1}/{args.ranks}")
    finally:
        ops.function = function
        ops.pack_lists = True
    row.update({f"kernels_{way}": " + ".join(sorted(kernels[way])) for way in WAYS})
    return row | {f"ns_per_pair_{way}": row[f"ms_{way}"] * 1e6 / max(row["kept_pairs"], 1) for way in WAYS}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cupy", choices=["cupy", "emulated"])
    for flag, default in (("--ranks", 4), ("--seqlen", 65536), ("--docs", 241), ("--heads", 16),
                          ("--headdim", 128)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--dtype", default="float16", choices=["float16"])
    p.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--arch", default=None,
                   help="the kernel table (e.g. sm_90 for the mma.sync family on an H100, whose "
                        "own table sm_90a folds a rectangle a launch with the Hopper kernel); "
                        "default: the device's own")
    p.add_argument("--mma-list", action="store_true",
                   help="on the sm_90a table, the mma.sync list kernels (flash_fwd_steps, "
                        "flash_bwd_dkdv_steps) rather than the Hopper ones (flash_fwd_steps_sm90, "
                        "flash_bwd_dkdv_steps_sm90): KernelOps.sm90_lists False")
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None)
    p.add_argument("--dry-run", action="store_true", help="print the plan; no kernel runs")
    args = p.parse_args(argv)
    docs = exact_mix(args.seqlen, args.docs)
    if args.dry_run:
        from burstcu import layout
        from burstcu.ops.cuda import packing
        from burstcu.ops.cuda.params import _group_list, _rect_columns, packed_list

        for name, cut in (("zigzag", docs), ("documents", docs), ("contiguous", None)):
            part = layout.partition(name, args.ranks, args.seqlen, cut)
            steps = [layout.blocks(part, qr, kr, True, (-1, -1), cut)
                     for qr in range(args.ranks) for kr in range(args.ranks)]
            listed = sum(packing.list_tiles(_rect_columns(b), 128) for b in steps if b)
            packs = [(b, packed_list(b, "query", 128)) for b in steps if b]
            packed = sum(p.work if p else packing.list_tiles(_rect_columns(b), 128) for b, p in packs)
            states = sum(p.tiles if p else _group_list(b, "query", 128)[2] for b, p in packs)
            print(f"plan: {' and '.join(args.passes)}, {name}, {0 if cut is None else len(cut) - 1} "
                  f"documents over {args.seqlen} tokens on {args.ranks} ranks: "
                  f"{sum(map(len, steps))} rectangles in {len(steps)} (rank, step) pairs, each timed "
                  f"{len(WAYS)} ways; query tiles of 128 x 128 keys (model): {listed} a rectangle "
                  f"each, {packed} packed where that pays, from {states} tiles of 128 query rows "
                  f"(each a read and a write of its rows' running state)")
        return 0
    if args.backend == "cupy" and (status := no_gpu("step_lists.py")) is not None:
        return status
    from burstcu.ops.cuda import KernelOps

    ops = KernelOps(args.backend, arch=args.arch)
    ops.sm90_lists = not args.mma_list
    rows = []
    for passes in args.passes:
        measured = []
        for name, cut in (("zigzag", docs), ("documents", docs), ("contiguous", None)):
            measured.append(measure(args, ops, name, cut, passes) | {"arch": ops.arch})
            report(args, ops, rows + measured, final=False)   # a step cut short keeps its rows
        for row in measured:
            row["vs_contiguous_per_pair"] = row["ns_per_pair_packed"] / measured[-1]["ns_per_pair_packed"]
        rows += measured
    report(args, ops, rows)
    return 0


def report(args, ops, rows: list, final: bool = True) -> None:
    """The table and JSON of the rows measured so far (not final: the JSON, and the last row's
    layout and milliseconds on one line of progress)."""
    where = ("GPU (CUDA events around each step call)" if ops.device == "cuda"
             else "the CPU emulator (host seconds: NOT GPU figures)")
    text = (f"step calls of {args.ranks} ranks, {args.seqlen} tokens, causal, H={args.heads} "
            f"D={args.headdim} {args.dtype}, on {where}; sums over every (rank, step)\n"
            + table(rows, ["arch", "pass", "layout", "kernels_packed", "docs", "rectangles",
                           *(f"launches_{way}" for way in WAYS), *(f"ms_{way}" for way in WAYS),
                           "kept_pairs", "ns_per_pair_packed", "vs_contiguous_per_pair"]))
    result = {"benchmark": "step lists", "backend": args.backend, "args": clean(vars(args)), "rows": rows}
    if final:
        emit(text, result, args)
        return
    if args.json:
        write_json(args.json, result)
    last = rows[-1]
    print(f"measured {last['pass']} {last['layout']}: "
          + ", ".join(f"{way} {last[f'ms_{way}']:.3f} ms" for way in WAYS), flush=True)


if __name__ == "__main__":
    sys.exit(main())
