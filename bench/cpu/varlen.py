"""The host side of a varlen ring schedule, one process: medians over --repeats builds of the
per-document zigzag partition (or --layout documents: the short documents whole) of --docs
documents (a seeded long-tailed mix) over --ranks ranks and of each causal ring step's
rectangles, with the kernels' lists too, packed where that pays (burstcu/ops/cuda/packing.py)
and not (bench/README.md).

    python bench/cpu/varlen.py --schedule [--ranks 8] [--docs 1000] [--layout zigzag] [--repeats 20]
                               [--json F] [--table F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402

import numpy as np  # noqa: E402

from burstcu.layout import (Partition, StepBlocks, _document_bounds, _rank_pieces, partition,  # noqa: E402
                            rectangles)
from burstcu.ops.cuda.params import step_group_lists  # noqa: E402

LISTS = ([("query", 64)], [("key", 64), ("query", 64)])   # a step's forward and backward lists


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", action="store_true", help="(the only mode; kept for the command lines)")
    for name, default in (("--ranks", 8), ("--docs", 1000), ("--repeats", 20)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--layout", default="zigzag", choices=["zigzag", "documents"])
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None)
    args = p.parse_args(argv)
    g = args.ranks
    cu = C.document_mix(64 * args.docs * 8)[:args.docs + 1]
    n, build = cu[-1], rectangles.__wrapped__

    def ms(f) -> float:   # median milliseconds of a call
        return 1e3 * C.median(C.call_seconds(f, args.repeats, warmup=0))

    def cold(q: int, steps, lists: bool = False, pack: bool = False) -> None:
        _rank_pieces.cache_clear()   # rank q's steps, nothing of this partition computed before
        _document_bounds.cache_clear()
        for s in steps:
            step = StepBlocks(build(part, q, (q - s) % g, True, (-1, -1), cu))
            for groupings in LISTS if lists else ():   # both from the one step, as the ops do
                step_group_lists(np, step, groupings, pack)

    part = partition(args.layout, g, n, cu)
    fresh = lambda: Partition(part.layout, part.runs)   # noqa: E731 - nothing computed yet
    r = {"partition_ms": ms(lambda: partition.__wrapped__(args.layout, g, n, cu)),
         "arrays_ms": ms(lambda: fresh().arrays), "hash_ms": ms(lambda: hash(fresh())),
         "step_as_blocks_ms": ms(lambda: list(StepBlocks(build(part, 0, g - 1, True, (-1, -1), cu))))}
    steps = {(q, s): ms(lambda q=q, s=s: cold(q, [s])) for q in range(g) for s in range(g)}
    rects = [build(part, q, (q - s) % g, True, (-1, -1), cu).size for q, s in steps]
    r.update(step_ms_median=C.median(steps.values()), step_ms_max=max(steps.values()),
             rank_steps_ms_max=max(ms(lambda q=q: cold(q, range(g))) for q in range(g)),
             rank_steps_lists_ms_max=max(ms(lambda q=q: cold(q, range(g), True)) for q in range(g)),
             rank_steps_packed_ms_max=max(ms(lambda q=q: cold(q, range(g), True, True))
                                          for q in range(g)),
             all_steps_ms=ms(lambda: [cold(q, range(g)) for q in range(g)]),
             rectangles_per_step_median=C.median(rects), rectangles_max=max(rects))
    shown = [("partition (every rank's pieces)", "partition_ms"),
             ("its segments as arrays (once a partition)", "arrays_ms"),
             ("its hash, the cache key (once a partition)", "hash_ms"),
             ("one step's rectangle array, median", "step_ms_median"),
             ("one step's rectangle array, worst", "step_ms_max"),
             (f"one rank's {g} steps, worst rank", "rank_steps_ms_max"),
             (f"one rank's {g} steps with the kernels' lists, worst rank", "rank_steps_lists_ms_max"),
             ("the same, packed where that pays", "rank_steps_packed_ms_max"),
             (f"all {g}x{g} arrays", "all_steps_ms"),
             ("one step's array as Blocks (what the NumPy op iterates)", "step_as_blocks_ms")]
    what = "per-document zigzag" if args.layout == "zigzag" else "documents (short ones whole)"
    text = "\n".join([f"host schedule: {len(cu) - 1} documents, {n} tokens, {what} over {g} "
                      f"ranks, causal (medians of {args.repeats} builds; CPU)",
                      C.table([{"built": w, "ms": f"{r[k]:.3f}"} for w, k in shown], ["built", "ms"]),
                      f"rectangles a step: median {r['rectangles_per_step_median']:.0f}, most "
                      f"{r['rectangles_max']}"])
    return C.emit(text, {"benchmark": "varlen schedule", "args": C.clean(vars(args)), "ranks": g,
                         "documents": len(cu) - 1, "tokens": n, **r,
                         "environment": C.environment(None)}, args)


if __name__ == "__main__":
    main()
