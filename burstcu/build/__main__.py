"""Command line of the kernel package.

    python -m burstcu.build check [--arch sm_80,sm_86,sm_90,sm_90a] [--json FILE] [--md FILE]
        [--family forward,...] [--dtype float16,...]
    python -m burstcu.build warm --device sm_90 [--tables sm_90a,sm_80] [--family forward,...] [--jobs N]

`check` is the compile gate: it compiles every variant of `all_variants(arch)` (forward and
backward families; one process a CPU) with NVRTC and the ptxas report, prints one table row per
variant and writes the records (see `compile.gate_variant`) as a JSON list, and with --md the
occupancy table: registers, shared memory and the blocks and warps per SM they allow (COMPUTED by
the CUDA occupancy rules, `compile.occupancy`, not measured). It exits 1 if any
variant fails to compile, spills (careful variants excepted: their spills are recorded), uses
more than 255 registers or more shared memory than the arch allows per block, or, compiled for
sm_90a, when its SASS cannot be read (nvdisasm, from the nvidia-cuda-nvdisasm wheel, missing) or,
for a Hopper family (name containing "sm90"), holds no HGMMA or uses local memory; 2 if there
is nothing to check; and 3, with one line naming the extra to install (`compiler_problem`), when
NVRTC cannot run here (cuda-python missing: ``pip install 'burstcu[cuda13]'``). No GPU is needed.

`warm` fills the kernel cache (`compile.cache_dir`: $BURSTCU_CACHE_DIR) with every kernel a GPU of
that arch will load: the variants of its tile table (`table_arch_for`), each compiled for the
device's arch or its own target (sm_90a), as the first launch on that GPU would compile it. Run it
on a machine without a GPU (a login node, a build step) with the NVRTC the GPU machines have (the
cache key holds NVRTC's version), then point $BURSTCU_CACHE_DIR there (or copy the folder): no rank
compiles at its first call. `--tables` names the tile tables to warm instead (a benchmark that
times another table's kernels on that GPU, e.g. `kernel_speed.py --archs sm_90a sm_80`, loads them
too); each kernel still compiles for the device's arch or its own target. Prints one line a
kernel compiled or failed, skips those already cached; exit 1 if any failed, 3 as `check` when
NVRTC cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

from .compile import ARCH_LIMITS, compiler_problem, gate_variant
from . import all_variants
from .variants import ARCHS

COLUMNS = (("arch", 6), ("family", 16), ("dtype", 8), ("headdim", 4), ("threads", 4),
           ("registers", 4), ("spill_stores", 5), ("spill_loads", 5), ("stack_bytes", 5),
           ("smem_bytes", 7), ("local_bytes", 5), ("sass_hgmma", 5), ("compile_seconds", 6))
HEADERS = {"headdim": "d", "threads": "thr", "registers": "regs", "spill_stores": "spSt",
           "spill_loads": "spLd", "stack_bytes": "stack", "smem_bytes": "smem", "local_bytes": "local",
           "sass_hgmma": "hgmma", "compile_seconds": "sec"}
NO_COMPILER = 3  # the exit status when NVRTC cannot run here (`compiler_problem`)


def run_check(archs: list[str], families: list[str] | None = None, out=None,
              jobs: int | None = None, dtypes: list[str] | None = None) -> list[dict]:
    """Compile every variant of every arch (of `families` and `dtypes` where given; `jobs`
    processes at once, default one per CPU this process may run on); print a row per variant in
    table order to `out` (default: sys.stdout as it is at the call); return the records in order."""
    out = out or sys.stdout
    todo = [(variant, arch) for arch in archs for variant in gated_variants(arch)
            if (not families or variant.family in families) and (not dtypes or variant.dtype in dtypes)]
    print(_row({c: HEADERS.get(c, c) for c, _ in COLUMNS}) + "  name", file=out)
    jobs = max(1, min(jobs or len(os.sched_getaffinity(0)), len(todo)))
    records = []
    with ProcessPoolExecutor(jobs) as pool:
        for (variant, _), record in zip(todo, pool.map(_gate, todo)):
            records.append(record)
            status = "" if record["error"] is None else "  FAIL: " + record["error"].splitlines()[0]
            print(_row(record) + f"  {variant.name}{status}", file=out, flush=True)
    return records


def gated_variants(arch: str) -> list:
    """The variants `check` gates for `arch`: its table's, but for "sm_90a" only those built for
    that target (the table's others are the sm_90 table's, compiled for the device's own arch at
    run time: the sm_90 rows gate them)."""
    return [v for v in all_variants(arch) if arch != "sm_90a" or v.target]


def _gate(job) -> dict:
    return gate_variant(*job)


def warm_tables(device: str, tables: list[str] | None = None) -> list[str]:
    """The tile tables to warm for a GPU of arch `device`: `tables`, or the one it loads."""
    from ..ops.cuda.kernel_ops import table_arch_for

    return tables or [table_arch_for(int(device.removeprefix("sm_")))]


def warm_jobs(device: str, families: list[str] | None = None,
              tables: list[str] | None = None) -> list[tuple[str, str, str]]:
    """(source, name expression, compile arch) of every kernel a GPU of arch `device` ("sm_90")
    loads from the tile tables `warm_tables(device, tables)`, each once (of `families` only, when
    given)."""
    jobs = {(v.source, v.name, v.target or device): None for table in warm_tables(device, tables)
            for v in all_variants(table) if not families or v.family in families}
    return list(jobs)


def _families(device: str, tables: list[str] | None = None) -> set[str]:
    """The families of the kernels `warm_jobs` compiles."""
    return {v.family for table in warm_tables(device, tables) for v in all_variants(table)}


def _warm(job) -> tuple[float, bool, str | None]:
    """Compile one job into the cache: (seconds, whether it was compiled now, the error or None).
    Never raises: one kernel that fails to build is reported, the others still build."""
    import time

    from .compile import cubin_entry

    source, name, arch = job
    t0 = time.perf_counter()
    try:
        built = cubin_entry(source, [name], arch)[2]   # not a build another process made
    except Exception as exc:  # noqa: BLE001 - reported with the kernel's name
        return time.perf_counter() - t0, False, f"{type(exc).__name__}: {exc}"
    return time.perf_counter() - t0, built, None


def run_warm(device: str, families: list[str] | None = None, out=None,
             jobs: int | None = None, tables: list[str] | None = None) -> tuple[int, int, int]:
    """Fill the kernel cache for a GPU of arch `device` (from `tables`, default the one it loads),
    a line a kernel to `out` (default: sys.stdout as it is at the call); (kernels compiled,
    kernels already there, kernels that failed to build)."""
    out = out or sys.stdout
    todo = warm_jobs(device, families, tables)
    jobs = max(1, min(jobs or len(os.sched_getaffinity(0)), len(todo) or 1))
    compiled = failed = 0
    with ProcessPoolExecutor(jobs) as pool:
        for (_, name, arch), (seconds, fresh, error) in zip(todo, pool.map(_warm, todo)):
            if error:   # the whole message: NVRTC's log follows its first line
                failed += 1
                print(f"{arch:7} FAILED  {name}: {error}".replace("\n", "\n    "), file=out, flush=True)
            elif fresh:
                compiled += 1
                print(f"{arch:7} {seconds:6.2f} s  {name}", file=out, flush=True)
    return compiled, len(todo) - compiled - failed, failed


def occupancy_table(records: list[dict]) -> str:
    """The records that compiled as a markdown table of their resources and occupancy, and
    whether each passes the gate."""
    head = ("arch", "GPU", "family", "dtype", "d", "threads", "regs", "smem KB", "blocks/SM", "warps/SM",
            "occupancy", "limited by", "gate", "variant")
    rows = [(r["arch"], ARCH_LIMITS[r["arch"]]["gpu"], r["family"], r["dtype"], r["headdim"], r["threads"],
             r["registers"], f"{r['smem_bytes'] / 1024:.1f}", r["blocks_per_sm"], r["warps_per_sm"],
             f"{r['occupancy']:.0%}", r["limited_by"], "ok" if r["error"] is None else "FAILS",
             f"`{r['name']}`") for r in records if "occupancy" in r]
    lines = [head, ("---",) * len(head), *rows]
    return ("".join(f"| {' | '.join(map(str, cells))} |\n" for cells in lines)
            + "\nTheoretical occupancy computed from the ptxas resource report (registers, smem) with "
              "the CUDA occupancy rules; not measured on a GPU.\n")


def _row(record: dict) -> str:
    return " ".join(str(record.get(col, "-")).rjust(width) for col, width in COLUMNS)


def _listed(parser, option: str, value: str | None) -> list[str] | None:
    """The comma-separated names `option` gave, or None (all) where it was left out; given but
    naming none (an empty string), a usage error rather than all."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        parser.error(f"{option} {value!r} names none: leave it out for all")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m burstcu.build")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="compile every kernel variant and check its resources")
    check.add_argument("--arch", default=",".join(ARCHS), help="comma-separated, e.g. sm_80,sm_86,sm_90,sm_90a")
    check.add_argument("--family", help="only these families (comma-separated)")
    check.add_argument("--dtype", help="only these dtypes (comma-separated)")
    check.add_argument("--json", dest="json_path", help="write the records to this file")
    check.add_argument("--md", dest="md_path", help="write the occupancy table (markdown) to this file")
    warm = sub.add_parser("warm", help="compile every kernel a GPU of this arch loads into the cache")
    warm.add_argument("--device", required=True, help="the GPU's arch, e.g. sm_80, sm_86, sm_90")
    warm.add_argument("--tables",
                      help="the tile tables to warm, comma-separated (default: the one the device loads)")
    warm.add_argument("--family", help="only these families (comma-separated)")
    warm.add_argument("--jobs", type=int, default=None, help="compile processes (default: one a CPU)")
    args = parser.parse_args(argv)
    if args.command == "warm":
        return _main_warm(warm, args)
    return _main_check(check, args)


def _main_check(parser, args) -> int:
    """`check` (module docstring), its usage errors from `parser` (the subcommand's)."""
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS]
    if bad or not archs:
        parser.error(f"unknown arch {bad or repr(args.arch)}: choose from {ARCHS}")
    families = _listed(parser, "--family", args.family)
    known = sorted({v.family for arch in archs for v in gated_variants(arch)})
    unknown = [f for f in families or () if f not in known]
    if unknown:
        parser.error(f"unknown family {unknown}: choose from {', '.join(known)}")
    dtypes = _listed(parser, "--dtype", args.dtype)
    known = sorted({v.dtype for arch in archs for v in gated_variants(arch)})
    unknown = [d for d in dtypes or () if d not in known]
    if unknown:
        parser.error(f"unknown dtype {unknown}: choose from {', '.join(known)}")
    for option, path in (("--json", args.json_path), ("--md", args.md_path)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            parser.error(f"{option} {path}: {folder} is not a folder this user can write to")
        if path and os.path.isdir(path):
            parser.error(f"{option} {path}: a folder, not a file")
    problem = compiler_problem()
    if problem:
        print(f"{parser.prog}: {problem}", file=sys.stderr)
        return NO_COMPILER
    problem = _timeout_problem()
    if problem:
        print(f"{parser.prog}: {problem}", file=sys.stderr)
        return 1
    records = run_check(archs, families, dtypes=dtypes)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(records, f, indent=1)
    if args.md_path:
        with open(args.md_path, "w") as f:
            f.write(occupancy_table(records))
    failed = [r for r in records if r["error"] is not None]
    print(f"{len(records)} variants, {len(failed)} failed", flush=True)
    for r in failed:
        print(f"--- {r['arch']} {r['name']}\n{r['error']}", file=sys.stderr)
    if not records:
        return 2
    return 1 if failed else 0


def _timeout_problem() -> str | None:
    """$BURSTCU_BUILD_TIMEOUT's error, read once before any kernel (else one line a kernel)."""
    from .compile import build_timeout

    try:
        build_timeout()
    except ValueError as exc:
        return str(exc)
    return None


def _nvrtc_archs() -> list[int]:
    """The compute capabilities this NVRTC compiles for (e.g. 80, 86, 90), or [] if it cannot say."""
    try:
        from cuda.bindings import nvrtc
        err, archs = nvrtc.nvrtcGetSupportedArchs()
        return list(archs) if int(err) == 0 else []
    except Exception:  # noqa: BLE001 - an NVRTC without the query: its compile errors say it
        return []


def _main_warm(parser, args) -> int:
    """`warm` (module docstring), its usage errors from `parser` (the subcommand's)."""
    import re

    from .compile import cache_dir
    from .variants import MIN_COMPUTE_CAPABILITY

    m = re.fullmatch(r"sm_([1-9]\d+)", args.device)
    if m is None or int(m.group(1)) < MIN_COMPUTE_CAPABILITY:
        parser.error(f"--device {args.device!r}: a GPU arch sm_XY of compute capability 8.0 or newer "
                     f"(e.g. sm_80, sm_86, sm_90; the Hopper kernels' sm_90a comes with sm_90)")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: at least 1 compile process")
    tables = _listed(parser, "--tables", args.tables)
    bad = [t for t in tables or () if t not in ARCHS]
    if bad:
        parser.error(f"unknown tile table {bad}: choose from {', '.join(ARCHS)}")
    families = _listed(parser, "--family", args.family)
    known = sorted(_families(args.device, tables))
    unknown = sorted(set(families or ()) - set(known))
    if unknown:
        parser.error(f"unknown family {unknown} for {args.device}: choose from {', '.join(known)}")
    problem = compiler_problem()
    if problem:
        print(f"{parser.prog}: {problem}", file=sys.stderr)
        return NO_COMPILER
    known_archs = _nvrtc_archs()
    if known_archs and int(m.group(1)) not in known_archs:
        parser.error(f"--device {args.device!r}: this NVRTC compiles for "
                     f"{', '.join(f'sm_{a}' for a in known_archs if a >= MIN_COMPUTE_CAPABILITY)}")
    problem = _timeout_problem()
    if problem:
        print(f"{parser.prog}: {problem}", file=sys.stderr)
        return 1
    try:
        folder = cache_dir()   # once, before any worker: a folder that fails the trust rule
    except (RuntimeError, OSError) as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 1
    compiled, cached, failed = run_warm(args.device, families, jobs=args.jobs, tables=tables)
    print(f"{compiled} kernels compiled, {cached} already cached, {failed} failed, for {args.device} "
          f"(tile tables: {', '.join(warm_tables(args.device, tables))}) in {folder}", flush=True)
    return 1 if failed else 0 if compiled + cached else 2


if __name__ == "__main__":
    sys.exit(main())
