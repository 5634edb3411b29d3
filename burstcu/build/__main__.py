"""Command line of the kernel package.

    python -m burstcu.build check [--arch sm_80,sm_86,sm_90,sm_90a] [--json FILE] [--family forward,...]

`check` is the compile gate: it compiles every variant of `all_variants(arch)` (forward and
backward families; one process a CPU) with NVRTC and the ptxas report, prints one table row per
variant and writes the records (see `compile.gate_variant`) as a JSON list. It exits 1 if any
variant fails to compile, spills (careful variants excepted: their spills are recorded), uses
more than 255 registers or more shared memory than the arch allows per block, or, compiled for
sm_90a, when its SASS cannot be read (nvdisasm, from the nvidia-cuda-nvdisasm wheel, missing) or,
for a Hopper family (name containing "sm90"), holds no HGMMA or uses local memory; 2 if there
is nothing to check; and 3, with one line naming the extra to install (`compiler_problem`), when
NVRTC cannot run here (cuda-python missing: ``pip install 'burstcu[cuda13]'``). No GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from .compile import compiler_problem, gate_variant
from . import all_variants
from .variants import ARCHS

COLUMNS = (("arch", 6), ("family", 16), ("dtype", 8), ("headdim", 4), ("threads", 4),
           ("registers", 4), ("spill_stores", 5), ("spill_loads", 5), ("stack_bytes", 5),
           ("smem_bytes", 7), ("local_bytes", 5), ("sass_hgmma", 5), ("compile_seconds", 6))
HEADERS = {"headdim": "d", "threads": "thr", "registers": "regs", "spill_stores": "spSt",
           "spill_loads": "spLd", "stack_bytes": "stack", "smem_bytes": "smem", "local_bytes": "local",
           "sass_hgmma": "hgmma", "compile_seconds": "sec"}
NO_COMPILER = 3  # the exit status when NVRTC cannot run here (`compiler_problem`)


def run_check(archs: list[str], families: list[str] | None = None, out=sys.stdout,
              jobs: int | None = None) -> list[dict]:
    """Compile every variant of every arch (`jobs` processes at once, default one per CPU this
    process may run on); print a row per variant in table order; return the records in order."""
    # the "sm_90a" table's other variants are the sm_90 table's, compiled for the device's own
    # arch at run time: the sm_90 rows gate them
    todo = [(variant, arch) for arch in archs for variant in all_variants(arch)
            if (not families or variant.family in families) and (arch != "sm_90a" or variant.target)]
    print(_row({c: HEADERS.get(c, c) for c, _ in COLUMNS}) + "  name", file=out)
    jobs = max(1, min(jobs or len(os.sched_getaffinity(0)), len(todo)))
    records = []
    with ProcessPoolExecutor(jobs) as pool:
        for (variant, _), record in zip(todo, pool.map(_gate, todo)):
            records.append(record)
            status = "" if record["error"] is None else "  FAIL: " + record["error"].splitlines()[0]
            print(_row(record) + f"  {variant.name}{status}", file=out, flush=True)
    return records


def _gate(job) -> dict:
    return gate_variant(*job)


def _row(record: dict) -> str:
    return " ".join(str(record.get(col, "-")).rjust(width) for col, width in COLUMNS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m burstcu.build")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="compile every kernel variant and check its resources")
    check.add_argument("--arch", default=",".join(ARCHS), help="comma-separated, e.g. sm_80,sm_86,sm_90,sm_90a")
    check.add_argument("--family", default="", help="only these families (comma-separated)")
    check.add_argument("--json", dest="json_path", help="write the records to this file")
    args = parser.parse_args(argv)

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        parser.error(f"unknown arch {bad}: choose from {ARCHS}")
    families = [f.strip() for f in args.family.split(",") if f.strip()] or None
    known = sorted({v.family for arch in archs for v in all_variants(arch)})
    unknown = [f for f in families or () if f not in known]
    if unknown:
        parser.error(f"unknown family {unknown}: choose from {', '.join(known)}")
    problem = compiler_problem()
    if problem:
        print(f"{parser.prog} check: {problem}", file=sys.stderr)
        return NO_COMPILER
    records = run_check(archs, families)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(records, f, indent=1)
    failed = [r for r in records if r["error"] is not None]
    print(f"{len(records)} variants, {len(failed)} failed", flush=True)
    for r in failed:
        print(f"--- {r['arch']} {r['name']}\n{r['error']}", file=sys.stderr)
    if not records:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
