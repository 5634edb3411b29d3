"""Tile-size search for the CUDA kernels: for each kernel family and head dim, which legal tiles
around the current table run fastest on this GPU, measured against the table's own choice.

    python bench/gpu/tiles.py --dry-run                      # candidates and plan: no compile, no GPU
    python bench/gpu/tiles.py --gate --candidates F          # CPU: compile, drop failures, write F
    python bench/gpu/tiles.py --candidates F [--json F]      # one CUDA GPU: check and time each one

    options: [--families forward bwd_dkdv bwd_dq | forward_sm90] [--dtypes float16 [bfloat16]]
             [--headdims 64 128 256] [--seqlens 4096 16384] [--tokens 16384] [--width 2048]
             [--tile-table sm_90 | sm_90a] [--max-candidates N] [--warmup 2] [--repeats 10]
             [--budget 200] [--jobs N] [--table F]

Families: ``forward`` is ``flash_fwd_step<T, D, BLOCK_M, BLOCK_N, NWARPS>`` (BLOCK_M = 16 NWARPS);
``bwd_dkdv`` is ``flash_bwd_dkdv<T, D, BM, BN, WARPS_D, true>`` (dK, dV and atomic dQ: the default
backward); ``bwd_dq`` is ``flash_bwd_dq<T, D, BM, BN, WARPS_D>`` (the deterministic mode's dQ
kernel). Tiles are written BLOCK_M x BLOCK_N x warps, warps being NWARPS in the forward and
WARPS_D in the backward. ``forward_sm90`` (``--tile-table sm_90a``, its default family there) is
the Hopper kernel ``flash_fwd_step_sm90<T, D, BLOCK_N, STAGES>``: its warps are fixed (a producer
and two consumer warpgroups, BLOCK_M = 128), so its tiles are written 128 x BLOCK_N x STAGES, with
BLOCK_N in {64, 128} and STAGES (K/V tiles in flight) in {2, 3, 4}; the gate also reads its SASS
(HGMMA present, no local memory).

Candidates, per family, dtype and head dim: forward NWARPS in {4, 8} x BLOCK_N in {32, 64, 128};
backward BM in {16, 32, 64, 128} x BN in {32, 64, 128} x WARPS_D in {1, 2}; those the kernels'
static_asserts accept, with 64 to 1024 threads (two warps at least) and a dynamic smem (the formulas of
`burstcu.build.fwd_variants` / `bwd_variants`) within the tile table's per-block limit (227 KB
for sm_90); the table's own tiles are always candidate number one.

``--gate`` compiles each candidate with the project's NVRTC path and the ptxas report for the
table's arch (no GPU), drops those that fail to compile, spill, pass 255 registers or the smem
limit, prints registers, smem and the occupancy they allow (computed with the rules of
bench/gpu/ptxas_report.py, not measured) and writes the survivors to ``--candidates``.

Default mode (one CUDA GPU): reads ``--candidates`` (gating first what the file lacks, or all of
it when the kernel sources changed since), compiles every candidate for the device in parallel
processes into the kernel cache, then for each seqlen S, dtype and head dim d runs the problem
(B, S, H, d) = (tokens / S, S, width / d, d) with one full non-causal Block (S queries x S keys)
through a KernelOps whose variant lookup returns the candidate:

* ``forward``: one ``forward_step`` is timed (init and finalize are not); checked: out;
* ``bwd_dkdv``: one ``backward_step`` in atomic mode; checked: dq, dk, dv;
* ``bwd_dq``: one ``backward_step`` in deterministic mode with the dK/dV kernel skipped; checked: dq.

The check compares with the table's choice on the same inputs: max |x - ref| / max |ref| must
stay below 2e-2 (float16) or 4e-2 (bfloat16) and be finite; a candidate that fails is flagged,
never fatal, and so is one that raises. Time: CUDA events around each call after --warmup calls,
median of --repeats. TFLOP/s: forward 4 B H S^2 d; bwd_dkdv 2.5x that (five matmuls); bwd_dq 1.5x
(its three). Runs start no new measurement once --budget seconds have passed since start (the
rest are listed as skipped), and rewrite --json after every group, so a killed run still leaves
what it measured. Progress goes to stderr; tables and the summary to stdout.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench._common import array_dtype, call_seconds, clean, progress, table, write_json  # noqa: E402
from bench.gpu.ptxas_report import occupancy  # noqa: E402

T_START = time.monotonic()

FAMILIES = ("forward", "bwd_dkdv", "bwd_dq", "forward_sm90")
MMA_SYNC_FAMILIES = FAMILIES[:3]    # the default run: the mma.sync tables' families
FAMILY_SOURCE = {"forward": "flash_fwd.cu", "bwd_dkdv": "flash_bwd.cu", "bwd_dq": "flash_bwd.cu",
                 "forward_sm90": "flash_fwd_sm90.cu"}
SOURCES = tuple(dict.fromkeys(FAMILY_SOURCE.values()))
FWD_NWARPS = (4, 8)
FWD_BLOCK_N = (32, 64, 128)
SM90_BLOCK_N = (64, 128)            # 256 keys: S alone would take 128 registers a thread
SM90_STAGES = (2, 3, 4)
BWD_BM = (16, 32, 64, 128)
BWD_BN = (32, 64, 128)
BWD_WARPS_D = (1, 2)
MAX_THREADS = 1024
MIN_THREADS = 64  # one-warp blocks (bwd_dq with BM = 16, WARPS_D = 1) are left out
TOLERANCE = {"float16": 2e-2, "bfloat16": 4e-2}
FLOP_FACTOR = {"forward": 1.0, "bwd_dkdv": 2.5, "bwd_dq": 1.5, "forward_sm90": 1.0}
CHECKED = {"forward": ("out",), "bwd_dkdv": ("dq", "dk", "dv"), "bwd_dq": ("dq",),
           "forward_sm90": ("out",)}
FORWARD_FAMILIES = ("forward", "forward_sm90")

# The runtime estimate: TFLOP/s assumed for a typical candidate, below what the current tables
# measured on an H100 (forward 140-220, backward step ~95-140 TFLOP/s at S >= 4096), times a
# slack for the slow candidates; seconds to compile one kernel on one core; fixed overheads.
EST_TFLOPS = {"forward": 110.0, "bwd_dkdv": 80.0, "bwd_dq": 70.0, "forward_sm90": 300.0}
EST_SLACK = 1.3
EST_COMPILE_S = 0.8
EST_STARTUP_S = 15.0
EST_PER_MEASUREMENT_S = 0.15
EST_PER_GROUP_S = 1.0
EST_GPU_JOBS = 16  # CPU cores of the GPU machine, for the parallel compile


def default_candidates_path(tile_table: str = "sm_90") -> str:
    """Where --gate writes by default: the H100 result folder for the sm_90 table, the H200 one
    for the Hopper kernel's (sm_90a)."""
    bench = Path(__file__).resolve().parents[1]
    if tile_table == "sm_90":
        return str(bench / "results" / "h100" / "tile_candidates.json")
    if tile_table == "sm_90a":
        return str(bench / "results" / "h200" / "tile_candidates_sm90a.json")
    return str(bench / "out" / f"tile_candidates_{tile_table}.json")


# ------------------------------------------------------------------------------------------------
# variants and candidates

def make_variant(family: str, dtype: str, d: int, tiles):
    """The KernelVariant of `family` with tiles (BLOCK_M, BLOCK_N, warps); forward_sm90's are
    (BLOCK_M = 128, BLOCK_N, STAGES): its warps are fixed (a producer and two consumer
    warpgroups), its K/V pipeline depth is what varies."""
    from burstcu.build import bwd_variants, fwd_variants

    bm, bn, w = (int(x) for x in tiles)
    if family == "forward_sm90":
        if bm != fwd_variants.SM90_BLOCK_M:
            raise ValueError(f"forward_sm90 tiles {tiles}: BLOCK_M is {fwd_variants.SM90_BLOCK_M}")
        return fwd_variants.sm90_variant_for_tiles(dtype, d, bn, w)
    if family == "forward":
        if bm != 16 * w:
            raise ValueError(f"forward tiles {tiles}: BLOCK_M must be 16 * NWARPS")
        return fwd_variants.step_variant_for_tiles(dtype, d, w, bn)
    if family == "bwd_dkdv":
        return bwd_variants.dkdv_variant_for_tiles(dtype, d, bm, bn, w, with_dq=True)
    if family == "bwd_dq":
        return bwd_variants.dq_variant_for_tiles(dtype, d, bm, bn, w)
    raise ValueError(f"unknown family {family!r}: choose from {FAMILIES}")


def table_variant(tile_table: str, family: str, dtype: str, d: int):
    """The variant the table `tile_table` launches for (family, dtype, native head dim d)."""
    from burstcu.build import all_variants

    found = [v for v in all_variants(tile_table)
             if v.family == family and v.dtype == dtype and v.headdim == d]
    if len(found) != 1:
        raise ValueError(f"table {tile_table} has {len(found)} {family} variants for {dtype} d={d}")
    return found[0]


def tiles_of(variant) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of a forward / bwd_dkdv / bwd_dq variant; (BLOCK_M, BLOCK_N,
    STAGES) of a forward_sm90 one."""
    cfg, warps = variant.launch, variant.launch.threads // 32
    if variant.family.startswith("forward_sm90"):   # its careful twin too
        return cfg.block_m, cfg.block_n, cfg.stages
    if variant.family == "forward":
        return cfg.block_m, cfg.block_n, warps
    if variant.family in ("bwd_dkdv", "bwd_dkdv_nodq"):
        return cfg.block_m, cfg.block_n, warps // (cfg.block_n // 16)
    if variant.family == "bwd_dq":
        return cfg.block_m, cfg.block_n, warps // (cfg.block_m // 16)
    raise ValueError(f"no tiles for family {variant.family!r}")


def tiles_str(tiles) -> str:
    return "x".join(str(int(t)) for t in tiles)


def _grid(family: str, d: int):
    if family == "forward_sm90":
        return [(128, bn, st) for bn in SM90_BLOCK_N for st in SM90_STAGES]
    if family == "forward":
        return [(16 * nw, bn, nw) for nw in FWD_NWARPS for bn in FWD_BLOCK_N]
    return [(bm, bn, wd) for wd in BWD_WARPS_D for bm in BWD_BM for bn in BWD_BN]


def enumerate_candidates(tile_table: str, families, dtypes, headdims,
                         max_per_group: int = 0) -> list[dict]:
    """Legal candidates per (family, dtype, d), the table's tiles first, as JSON-ready dicts.

    Legal: the kernels' static_asserts (`make_variant` raises otherwise), at most MAX_THREADS
    threads, dynamic smem within the table arch's per-block limit. `max_per_group` > 0 keeps the
    first that many of each group (the table's tiles included).
    """
    from burstcu.build.compile import ARCH_LIMITS

    smem_limit = ARCH_LIMITS[tile_table]["smem_per_block"]
    out = []
    for family in families:
        for dtype in dtypes:
            for d in headdims:
                current = tiles_of(table_variant(tile_table, family, dtype, d))
                group, seen = [], set()
                for tiles in [current, *_grid(family, d)]:
                    if tiles in seen:
                        continue
                    seen.add(tiles)
                    try:
                        v = make_variant(family, dtype, d, tiles)
                    except ValueError:
                        continue
                    if not (MIN_THREADS <= v.launch.threads <= MAX_THREADS or tiles == current):
                        continue
                    if v.launch.smem_bytes > smem_limit:
                        continue
                    group.append(candidate_record(v, tiles, current=(tiles == current)))
                if max_per_group > 0:
                    group = group[:max_per_group]
                out += group
    return out


def candidate_record(variant, tiles, current: bool) -> dict:
    return {"family": variant.family, "dtype": variant.dtype, "headdim": variant.headdim,
            "tiles": list(tiles), "name": variant.name, "current": bool(current),
            "threads": variant.launch.threads, "dynamic_smem_bytes": variant.launch.smem_bytes}


def group_key(c: dict) -> tuple:
    return (c["family"], c["dtype"], int(c["headdim"]))


def source_digests(families=FAMILIES) -> dict:
    """{kernel source: digest (its headers included)} of the sources `families` compile: what a
    candidate file records, so that an edit elsewhere leaves it fresh."""
    from burstcu.build.compile import source_digest

    return {s: source_digest(s) for s in sorted({FAMILY_SOURCE[f] for f in families})}


def nvrtc_version() -> str | None:
    try:
        from cuda.bindings import nvrtc
        return ".".join(map(str, nvrtc.nvrtcVersion()[1:]))
    except Exception:  # noqa: BLE001 - only informative
        return None


# ------------------------------------------------------------------------------------------------
# the compile gate (CPU)

def _gate_one(family: str, dtype: str, d: int, tiles, arch: str) -> dict:
    """One gate record; runs in a worker process. Never raises."""
    try:
        from burstcu.build.compile import gate_variant

        return gate_variant(make_variant(family, dtype, d, tiles), arch)
    except Exception as exc:  # noqa: BLE001 - reported as the candidate's failure
        return {"error": f"{exc.__class__.__name__}: {exc}"}


def _pool(jobs: int) -> ProcessPoolExecutor:
    import multiprocessing as mp

    # spawn, not fork: the GPU run starts the pool after CUDA is initialized in this process
    return ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"))


def gate(cands: list[dict], arch: str, jobs: int) -> list[dict]:
    """Compile every candidate for `arch` with the ptxas report (in `jobs` processes); returns the
    candidates with the gate's fields, occupancy and `error` (None when it passes)."""
    results: list[dict | None] = [None] * len(cands)
    args = [(c["family"], c["dtype"], int(c["headdim"]), tuple(c["tiles"]), arch) for c in cands]
    jobs = max(1, min(jobs, len(cands)))
    done = 0
    try:
        if jobs == 1:
            raise RuntimeError("one job: compile in this process")
        with _pool(jobs) as ex:
            futures = {ex.submit(_gate_one, *a): i for i, a in enumerate(args)}
            for fut in as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                done += 1
                progress(f"gate [{done}/{len(cands)}] {cands[i]['name']}: "
                         f"{results[i].get('error') and 'FAIL' or 'ok'}")
    except Exception as exc:  # noqa: BLE001 - no worker processes here: compile one by one
        if jobs > 1:
            progress(f"gate: process pool unavailable ({exc.__class__.__name__}: {exc}); "
                     f"compiling in this process")
    for i, a in enumerate(args):
        if results[i] is None:
            results[i] = _gate_one(*a)
            done += 1
            progress(f"gate [{done}/{len(cands)}] {cands[i]['name']}: "
                     f"{results[i].get('error') and 'FAIL' or 'ok'}")
    out = []
    for c, r in zip(cands, results):
        rec = dict(c)
        for key in ("registers", "spill_stores", "spill_loads", "stack_bytes", "static_smem_bytes",
                    "smem_bytes", "compile_seconds", "error"):
            rec[key] = r.get(key)
        rec["arch"] = arch
        if rec["error"] is None:
            try:
                occ = occupancy({"arch": arch, "registers": rec["registers"],
                                 "threads": rec["threads"], "smem_bytes": rec["smem_bytes"]})
                rec.update(blocks_per_sm=occ["blocks_per_sm"], warps_per_sm=occ["warps_per_sm"],
                           occupancy=round(occ["occupancy"], 4), limited_by=occ["limited_by"])
            except Exception as exc:  # noqa: BLE001 - occupancy is informative only
                rec["occupancy_error"] = str(exc)
        else:
            rec["error"] = _first_line(rec["error"])
        out.append(rec)
    return out


def _first_line(text, limit: int = 240) -> str:
    text = str(text).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    # an NVRTC failure: the log's first "error:" line says more than the header line
    errs = [ln for ln in lines if "error:" in ln.lower()]
    pick = errs[0] if errs else (lines[0] if lines else "")
    return pick[:limit]


GATE_COLUMNS = ["family", "dtype", "headdim", "tiles", "cur", "threads", "registers", "spill",
                "smem_KB", "blocks_per_sm", "warps_per_sm", "occ", "limited_by", "status"]


def gate_rows(records: list[dict]) -> list[dict]:
    rows = []
    for r in records:
        rows.append({**r, "tiles": tiles_str(r["tiles"]), "cur": "*" if r["current"] else "",
                     "spill": (None if r.get("spill_stores") is None
                               else r["spill_stores"] + r["spill_loads"]),
                     "smem_KB": (r.get("smem_bytes") or r["dynamic_smem_bytes"]) / 1024,
                     "occ": None if r.get("occupancy") is None else f"{r['occupancy']:.0%}",
                     "status": "ok" if r.get("error") is None else "DROP: " + r["error"][:70]})
    return rows


def write_candidates(path: str, records: list[dict], args, seconds: float) -> None:
    kept = [r for r in records if r.get("error") is None]
    write_json(path, {
        "note": ("tile candidates that compile for the arch without spills and fit its smem "
                 "(bench/gpu/tiles.py --gate; registers from ptxas, occupancy computed, not measured)"),
        "tile_table": args.tile_table, "arch": args.tile_table, "nvrtc": nvrtc_version(),
        "source_digests": source_digests({r["family"] for r in records}), "gate_seconds": round(seconds, 1),
        "jobs": args.jobs, "host_cpus": os.cpu_count(),
        "enumeration": {"forward": {"nwarps": FWD_NWARPS, "block_n": FWD_BLOCK_N},
                        "backward": {"bm": BWD_BM, "bn": BWD_BN, "warps_d": BWD_WARPS_D}},
        "candidates": kept,
        "dropped": [r for r in records if r.get("error") is not None],
    })


def load_candidates(path: str) -> dict:
    import json

    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------------------------------------
# plan and estimate

def shape(args, seqlen: int, d: int) -> tuple[int, int, int, int]:
    """(B, S, H, D): --tokens tokens and --width = H * D per configuration."""
    return max(1, args.tokens // seqlen), seqlen, max(1, args.width // d), d


def gflop(family: str, b: int, s: int, h: int, d: int) -> float:
    return 4.0 * b * h * s * s * d * FLOP_FACTOR[family] / 1e9


def shape_gflop(args, seqlen: int, d: int) -> float:
    b, s, h, _ = shape(args, seqlen, d)
    return gflop("forward", b, s, h, d)


def plan(cands: list[dict], args) -> list[dict]:
    """One row per (seqlen, candidate), in the order they run (smaller seqlens first)."""
    rows = []
    for s in args.seqlens:
        for family in args.families:
            for dtype in args.dtypes:
                for d in args.headdims:
                    for c in cands:
                        if group_key(c) != (family, dtype, d):
                            continue
                        b, _, h, _ = shape(args, s, d)
                        rows.append({**c, "seqlen": s, "batch": b, "heads": h,
                                     "gflop": gflop(family, b, s, h, d)})
    return rows


def estimate_seconds(rows: list[dict], args, gate_count: int = 0) -> dict:
    """A pessimistic runtime estimate on one H100 (see EST_*)."""
    calls = 1 + args.warmup + args.repeats
    measure = sum(calls * r["gflop"] / (EST_TFLOPS[r["family"]] * 1e3) * EST_SLACK
                  + EST_PER_MEASUREMENT_S for r in rows)
    # per group: inputs and the reference run (the table's tiles, unpinned); per (S, dtype, d)
    # with a backward family: the forward and delta that make out, lse, delta
    groups = {(r["seqlen"], r["dtype"], r["headdim"], r["family"]): r for r in rows}
    refs = sum(EST_PER_GROUP_S + r["gflop"] / (EST_TFLOPS[r["family"]] * 1e3) * EST_SLACK
               for r in groups.values())
    fwd_refs = sum(shape_gflop(args, s, d) / (EST_TFLOPS["forward"] * 1e3) * EST_SLACK
                   for s, dt, d in {(r["seqlen"], r["dtype"], r["headdim"]) for r in rows
                                    if r["family"] != "forward"})
    names = {r["name"] for r in rows}
    jobs = EST_GPU_JOBS
    compile_s = 3.0 + EST_COMPILE_S * math.ceil((len(names) + 3 * len(groups)) / jobs)
    gate_s = 3.0 + EST_COMPILE_S * math.ceil(gate_count / jobs) if gate_count else 0.0
    total = EST_STARTUP_S + gate_s + compile_s + measure + refs + fwd_refs
    return {"startup_s": EST_STARTUP_S, "gate_s": round(gate_s, 1), "compile_s": round(compile_s, 1),
            "measure_s": round(measure + refs + fwd_refs, 1), "total_s": round(total, 1),
            "measurements": len(rows), "kernels": len(names)}


def print_plan(rows: list[dict], args, est: dict) -> None:
    """The runtime estimate, then one line per (seqlen, family, dtype, d) with its candidates."""
    print(f"# estimate on one H100: ~{est['total_s']:.0f} s = startup {est['startup_s']:.0f} "
          f"+ gate {est['gate_s']:.0f} + compile {est['compile_s']:.0f} ({est['kernels']} kernels, "
          f"{EST_GPU_JOBS} processes) + measure {est['measure_s']:.0f} ({est['measurements']} "
          f"measurements x {1 + args.warmup + args.repeats} calls); budget {args.budget:.0f} s",
          flush=True)
    counts: dict[tuple, int] = {}
    for r in rows:
        key = (r["seqlen"], r["family"], r["dtype"], r["headdim"], r["batch"], r["heads"],
               round(r["gflop"], 1))
        counts[key] = counts.get(key, 0) + 1
    cols = ["seqlen", "family", "dtype", "headdim", "batch", "heads", "gflop", "candidates"]
    print(table([dict(zip(cols, (*k, n))) for k, n in counts.items()], cols), flush=True)


# ------------------------------------------------------------------------------------------------
# the GPU run

def make_ops(tile_table: str, backend: str = "cupy"):
    """A KernelOps (CuPy, or the CPU emulator for testing this script) whose variant lookup
    returns a pinned candidate (`pin`) and whose kernels of the `skip` families do nothing."""
    from burstcu.ops.cuda.kernel_ops import KernelOps

    class TileOps(KernelOps):
        def __init__(self):
            super().__init__(backend, arch=tile_table)
            # a candidate that fails the Hopper first-use check must not be timed as its fallback:
            # the run's own check against the table's choice judges it
            self.first_use_check = False
            self.pinned: dict[tuple, object] = {}
            self.skip: set[str] = set()
            self.extra: dict[str, object] = {}      # candidates that are not in the table
            self.extra_fns: dict[str, object] = {}

        def pin(self, variant) -> None:
            if variant.name not in self._variants:
                self.extra[variant.name] = variant
            self.pinned[(variant.family, variant.dtype, variant.headdim)] = variant

        def unpin(self) -> None:
            self.pinned.clear()

        def variant(self, family, dtype, headdim):
            base = super().variant(family, dtype, headdim)
            return self.pinned.get((base.family, base.dtype, base.headdim), base)

        def function(self, name_expression):
            v = self._variants.get(name_expression) or self.extra.get(name_expression)
            if v is not None and v.family in self.skip:
                return _noop
            if name_expression in self._variants:
                return super().function(name_expression)
            fn = self.extra_fns.get(name_expression)
            if fn is None:
                if v is None:
                    raise KeyError(f"{name_expression!r} was never pinned")
                if self.backend == "cupy":
                    from burstcu.build.compile import get_function

                    fn = get_function(v.source, name_expression, smem_bytes=v.launch.smem_bytes,
                                      target=v.target)
                else:
                    from burstcu.build import emulate
                    from burstcu.build.variants import kernel_dir

                    module = emulate.build_module([str(kernel_dir() / v.source)], [name_expression])
                    fn = module.get_function(name_expression)
                self.extra_fns[name_expression] = fn
            return fn

    return TileOps()


def _noop(*args, **kwargs) -> None:
    return None


def _compile_one(source: str, name: str, arch: str) -> tuple[str, float, str | None]:
    """Compile one instantiation into the kernel cache (a worker process). Never raises."""
    t = time.perf_counter()
    try:
        from burstcu.build.compile import cached_cubin

        cached_cubin(source, [name], arch)
        return name, time.perf_counter() - t, None
    except Exception as exc:  # noqa: BLE001 - the timed run reports it again
        return name, time.perf_counter() - t, f"{exc.__class__.__name__}: {_first_line(exc)}"


def precompile(variants, arch: str, jobs: int) -> dict[str, str]:
    """Fill the kernel cache for every variant in parallel; {name: error} of those that failed."""
    todo = {v.name: v for v in variants}
    errors: dict[str, str] = {}
    if not todo:
        return errors
    jobs = max(1, min(jobs, len(todo)))
    t = time.monotonic()
    try:
        with _pool(jobs) as ex:
            futures = [ex.submit(_compile_one, v.source, v.name, v.target or arch) for v in todo.values()]
            for i, fut in enumerate(as_completed(futures)):
                name, sec, err = fut.result()
                if err:
                    errors[name] = err
                    progress(f"  compile FAILED {name}: {err}")
        progress(f"compiled {len(todo)} kernels for {arch} in {time.monotonic() - t:.1f} s "
                 f"({jobs} processes, {len(errors)} failed)")
    except Exception as exc:  # noqa: BLE001 - they compile lazily instead, one by one
        progress(f"parallel compile unavailable ({exc.__class__.__name__}: {exc}); "
                 f"kernels compile when first launched")
    return errors


class Inputs:
    """q, k, v, dout (B, S, H, d) random normal; out, lse, delta from the table's kernels."""

    def __init__(self, ops, dtype: str, b: int, s: int, h: int, d: int, seed: int = 0):
        from burstcu.layout import Block

        dt = array_dtype(dtype)
        if ops.backend == "cupy":
            import cupy

            rng = cupy.random.default_rng(seed)
            self.q, self.k, self.v, self.dout = (
                rng.standard_normal((b, s, h, d), dtype=np.float32).astype(dt) for _ in range(4))
        else:
            rng = np.random.default_rng(seed)
            self.q, self.k, self.v, self.dout = (
                rng.standard_normal((b, s, h, d), dtype=np.float32).astype(dt) for _ in range(4))
        self.scale = 1.0 / math.sqrt(d)
        self.blocks = [Block(0, s, 0, s, 0, 0, False)]
        self.ops = ops
        self._bwd = None

    def backward_inputs(self):
        """(out, lse, delta) by the table's forward and delta kernels, made once."""
        if self._bwd is None:
            st = self.ops.forward_init(self.q, self.scale)
            self.ops.forward_step(st, self.k, self.v, self.blocks)
            out, lse = self.ops.forward_finalize(st, self.q.dtype)
            self._bwd = (out, lse, self.ops.backward_delta(self.dout, out))
        return self._bwd


def forward_once(ops, inp: Inputs) -> dict:
    st = ops.forward_init(inp.q, inp.scale)
    ops.forward_step(st, inp.k, inp.v, inp.blocks)
    out, _ = ops.forward_finalize(st, inp.q.dtype)
    return {"out": out}


def forward_timer(ops, inp: Inputs):
    st = ops.forward_init(inp.q, inp.scale)
    return lambda: ops.forward_step(st, inp.k, inp.v, inp.blocks)


def backward_once(ops, inp: Inputs, family: str) -> dict:
    out, lse, delta = inp.backward_inputs()
    ctx = ops.backward_init(inp.k, inp.v, inp.scale)
    dq = ops.xp.zeros(inp.q.shape, dtype=np.float32)
    ops.backward_step(ctx, inp.q, inp.dout, lse, delta, dq, inp.blocks)
    return {"dq": dq} if family == "bwd_dq" else {"dq": dq, "dk": ctx.dk, "dv": ctx.dv}


def backward_timer(ops, inp: Inputs):
    out, lse, delta = inp.backward_inputs()
    ctx = ops.backward_init(inp.k, inp.v, inp.scale)
    dq = ops.xp.zeros(inp.q.shape, dtype=np.float32)
    return lambda: ops.backward_step(ctx, inp.q, inp.dout, lse, delta, dq, inp.blocks)


def set_mode(ops, family: str) -> None:
    """bwd_dq runs the deterministic backward with its dK/dV kernel skipped; the rest atomic."""
    ops.deterministic = family == "bwd_dq"
    ops.skip = {"bwd_dkdv_nodq"} if family == "bwd_dq" else set()


def run_family(ops, family: str, inp: Inputs) -> dict:
    set_mode(ops, family)
    result = forward_once(ops, inp) if family in FORWARD_FAMILIES else backward_once(ops, inp, family)
    ops.sync()
    return result


def timer_for(ops, family: str, inp: Inputs):
    set_mode(ops, family)
    return forward_timer(ops, inp) if family in FORWARD_FAMILIES else backward_timer(ops, inp)


def rel_diffs(xp, result: dict, ref: dict) -> dict:
    """{tensor: max |x - ref| / max |ref|} (NaN when either is not finite)."""
    out = {}
    for key, r in ref.items():
        x = result[key].astype(np.float32)
        r32 = r.astype(np.float32)
        num = float(xp.max(xp.abs(x - r32)))
        den = float(xp.max(xp.abs(r32)))
        out[key] = num / den if den > 0 else num
    return out


def measure_group(ops, family: str, dtype: str, d: int, seqlen: int, cands: list[dict],
                  inp: Inputs, args, deadline: float) -> list[dict]:
    """Check and time every candidate of one (family, dtype, d) at one seqlen; never raises."""
    xp = ops.xp
    b, s, h, _ = shape(args, seqlen, d)
    base = {"family": family, "dtype": dtype, "headdim": d, "seqlen": s, "batch": b, "heads": h}
    flop = gflop(family, b, s, h, d) * 1e9
    tol = TOLERANCE.get(dtype, 2e-2)
    ref, ref_error = None, None
    try:  # the table's own tiles, no pin: the reference every candidate is compared with
        ops.unpin()
        ref = run_family(ops, family, inp)
    except Exception as exc:  # noqa: BLE001
        ref_error = f"{exc.__class__.__name__}: {_first_line(exc)}"
        progress(f"  reference FAILED: {ref_error}")
    rows = []
    for c in cands:
        row = {**base, "tiles": tiles_str(c["tiles"]), "current": bool(c["current"]),
               "name": c["name"], "threads": c["threads"], "registers": c.get("registers"),
               "smem_bytes": c.get("smem_bytes") or c.get("dynamic_smem_bytes"),
               "occupancy": c.get("occupancy"), "ms": None, "tflops": None, "check": None,
               "status": "ok"}
        rows.append(row)
        if time.monotonic() > deadline:
            row["status"] = "skipped (budget)"
            continue
        t = time.monotonic()
        try:
            variant = make_variant(family, dtype, d, c["tiles"])
            ops.pin(variant)
            result = run_family(ops, family, inp)
            if ref is None:
                row["check"] = f"unchecked (no reference: {ref_error})"
            else:
                diffs = rel_diffs(xp, result, ref)
                row["max_rel_diff"] = diffs
                worst = max(diffs.values())
                row["max_rel"] = worst
                bad = [k for k, v in diffs.items() if not v <= tol]
                row["check"] = "ok" if not bad else f"MISMATCH {','.join(bad)} > {tol:g}"
            del result
            times = [t * 1e3 for t in call_seconds(timer_for(ops, family, inp), args.repeats,
                                                   args.warmup, cuda=ops.backend == "cupy")]
            ms = float(np.median(times))
            row.update(ms=ms, ms_min=min(times), ms_max=max(times), tflops=flop / (ms * 1e-3) / 1e12)
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not stop the rest
            row["status"] = f"error: {exc.__class__.__name__}: {_first_line(exc, 160)}"
        finally:
            ops.unpin()
            set_mode(ops, "forward")
        progress(f"  {family} {dtype} d={d} S={s} {row['tiles']:>10}{' *' if c['current'] else '  '}"
                 f" {_fmt(row['ms'], 'ms')} {_fmt(row['tflops'], 'TFLOP/s')} "
                 f"{row['check'] or ''} {'' if row['status'] == 'ok' else row['status']}"
                 f" ({time.monotonic() - t:.1f} s)")
    cur = next((r for r in rows if r["current"] and r["ms"]), None)
    for r in rows:
        if cur and r["ms"]:
            r["vs_current"] = cur["ms"] / r["ms"]
    del ref
    return rows


def _fmt(x, unit: str) -> str:
    return "-" if x is None else f"{x:.3g} {unit}"


RESULT_COLUMNS = ["rank", "tiles", "cur", "threads", "registers", "occ", "ms", "tflops",
                  "vs_current", "max_rel", "check", "status"]


def group_table(rows: list[dict]) -> str:
    timed = sorted((r for r in rows if r["ms"]), key=lambda r: r["ms"])
    rest = [r for r in rows if not r["ms"]]
    shown = []
    for i, r in enumerate(timed + rest):
        shown.append({**r, "rank": i + 1 if r["ms"] else "-", "cur": "*" if r["current"] else "",
                      "occ": None if r.get("occupancy") is None else f"{r['occupancy']:.0%}",
                      "check": r["check"] or "-", "status": r["status"][:60]})
    head = rows[0]
    title = (f"## {head['family']} {head['dtype']} d={head['headdim']} S={head['seqlen']} "
             f"(B={head['batch']}, H={head['heads']}; tiles BLOCK_M x BLOCK_N x "
             f"{'NWARPS' if head['family'] == 'forward' else 'WARPS_D'}; * = current table)")
    return title + "\n" + table(shown, RESULT_COLUMNS)


def best_summary(rows: list[dict], seqlens) -> list[dict]:
    """Per (family, dtype, d): the candidate with the best geometric-mean speedup over the
    current tiles across the seqlens where both were measured and it passed the check."""
    out = []
    keys = sorted({(r["family"], r["dtype"], r["headdim"]) for r in rows},
                  key=lambda k: (FAMILIES.index(k[0]) if k[0] in FAMILIES else 9, k[1], k[2]))
    for key in keys:
        grp = [r for r in rows if (r["family"], r["dtype"], r["headdim"]) == key]
        current = next((r["tiles"] for r in grp if r["current"]), None)
        scores = {}
        for tiles in {r["tiles"] for r in grp}:
            per_s = {r["seqlen"]: r.get("vs_current") for r in grp
                     if r["tiles"] == tiles and r.get("vs_current") and r["check"] == "ok"}
            if per_s:
                scores[tiles] = (math.exp(sum(math.log(v) for v in per_s.values()) / len(per_s)),
                                 per_s)
        if not scores:
            out.append({"family": key[0], "dtype": key[1], "headdim": key[2], "current": current,
                        "best": None})
            continue
        full = max(len(v[1]) for v in scores.values())
        best = max((t for t in scores if len(scores[t][1]) == full), key=lambda t: scores[t][0])
        out.append({"family": key[0], "dtype": key[1], "headdim": key[2], "current": current,
                    "best": best, "speedup": scores[best][0],
                    "per_seqlen": {str(s): scores[best][1].get(s) for s in seqlens}})
    return out


def summary_text(best: list[dict], seqlens) -> str:
    lines = ["## best tiles per family and head dim (geometric mean over seqlens of "
             "time(current) / time(candidate); only candidates that passed the check)"]
    for b in best:
        if not b["best"]:
            lines.append(f"{b['family']:9} {b['dtype']:8} d={b['headdim']:<3} current "
                         f"{b['current']}: no measurement")
            continue
        per = ", ".join(f"S={s} {v:.2f}x" for s, v in b["per_seqlen"].items() if v)
        same = " (the current tiles)" if b["best"] == b["current"] else ""
        lines.append(f"{b['family']:9} {b['dtype']:8} d={b['headdim']:<3} current {b['current']:>10}"
                     f" -> best {b['best']:>10}{same}: {b['speedup']:.2f}x [{per}]")
    return "\n".join(lines)


def versions(backend: str) -> dict:
    out = {"python": sys.version.split()[0], "numpy": np.__version__, "nvrtc": nvrtc_version(),
           "backend": backend}
    if backend != "cupy":
        out["device"] = "CPU (kernel emulator): times are NOT GPU figures"
        return out
    try:
        import cupy
        out["cupy"] = cupy.__version__
        out["driver"] = cupy.cuda.runtime.driverGetVersion()
        out["runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        out["device"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception as exc:  # noqa: BLE001
        out["device"] = f"unavailable ({exc.__class__.__name__}: {exc})"
    return out


def support_variants(ops, args) -> list:
    """The table's kernels a run launches besides the candidates: references, finalize, delta."""
    from burstcu.build.bwd_variants import delta_variant

    out = []
    for dtype in args.dtypes:
        for d in args.headdims:
            for family in ("forward", *[f for f in args.families if f != "forward"]):
                out.append(table_variant(args.tile_table, family, dtype, d))
        out += [v for v in ops._variants.values()
                if v.family == "forward_finalize" and v.dtype == dtype]
        out.append(delta_variant(dtype))
    return out


def _skipped_rows(grp, family, dtype, d, s, b, h, status: str) -> list[dict]:
    return [{"family": family, "dtype": dtype, "headdim": d, "seqlen": s, "batch": b, "heads": h,
             "tiles": tiles_str(c["tiles"]), "current": bool(c["current"]), "name": c["name"],
             "threads": c["threads"], "registers": c.get("registers"),
             "occupancy": c.get("occupancy"), "ms": None, "tflops": None, "check": None,
             "status": status} for c in grp]


def run_measure(cands: list[dict], args, meta: dict) -> int:
    """Check and time every candidate (see the module docstring); writes --json and --table."""
    backend = args.backend
    env = versions(backend)
    ops = make_ops(args.tile_table, backend)
    if backend == "cupy":
        import cupy

        from burstcu.build.compile import device_arch
        from burstcu.ops.cuda.kernel_ops import table_arch_for

        arch = device_arch()
        device_table = table_arch_for(int(arch.split("_")[1]))
        progress(f"device {env.get('device')} ({arch}, table {device_table}), cupy "
                 f"{env.get('cupy')}, nvrtc {env.get('nvrtc')}")
        if device_table != args.tile_table:
            progress(f"WARNING: this device's table is {device_table}, the candidates are for "
                     f"{args.tile_table}")
        # every kernel the run launches, compiled in parallel into the kernel cache first
        variants = {}
        for c in cands:
            try:
                v = make_variant(c["family"], c["dtype"], int(c["headdim"]), c["tiles"])
                variants[v.name] = v
            except Exception as exc:  # noqa: BLE001 - reported again when measured
                progress(f"  bad candidate {c.get('name')}: {exc}")
        for v in support_variants(ops, args):
            variants[v.name] = v
        precompile(list(variants.values()), arch, args.jobs)

    deadline = T_START + args.budget
    rows: list[dict] = []
    texts: list[str] = []
    out_meta = {"versions": env, "args": clean(vars(args)), "estimate": meta.get("estimate"),
                "candidates_file": meta.get("candidates_file"), "tile_table": args.tile_table,
                "note": (f"{'CUDA events' if backend == 'cupy' else 'wall clock, CPU emulator'}, "
                         f"median of {args.repeats} after {args.warmup} warm-up calls; "
                         f"max_rel_diff: max|x - table| / max|table|")}

    def dump(final: bool = False) -> None:
        if args.json:
            write_json(args.json, {**out_meta, "complete": final,
                                   "elapsed_s": round(time.monotonic() - T_START, 1),
                                   "best": best_summary(rows, args.seqlens), "rows": rows})

    # seqlens outermost (a run cut short by --budget loses the longest ones), families next (the
    # deterministic dq kernel, the least used, comes last); inputs are shared by the families
    for s in args.seqlens:
        inputs: dict[tuple, Inputs | None] = {}
        for family in args.families:
            for dtype in args.dtypes:
                for d in args.headdims:
                    grp = [c for c in cands if group_key(c) == (family, dtype, d)]
                    if not grp:
                        continue
                    b, _, h, _ = shape(args, s, d)
                    progress(f"{family} {dtype} d={d} S={s}: B={b} H={h}, {len(grp)} candidates "
                             f"({time.monotonic() - T_START:.0f} s of {args.budget:.0f})")
                    if time.monotonic() > deadline:
                        grp_rows = _skipped_rows(grp, family, dtype, d, s, b, h, "skipped (budget)")
                    else:
                        if (dtype, d) not in inputs:
                            try:
                                inputs[(dtype, d)] = Inputs(ops, dtype, b, s, h, d)
                            except Exception as exc:  # noqa: BLE001
                                progress(f"  inputs FAILED: {exc.__class__.__name__}: {exc}")
                                inputs[(dtype, d)] = None
                        inp = inputs[(dtype, d)]
                        if inp is None:
                            grp_rows = _skipped_rows(grp, family, dtype, d, s, b, h, "error: no inputs")
                        else:
                            grp_rows = measure_group(ops, family, dtype, d, s, grp, inp, args,
                                                     deadline)
                    rows.extend(grp_rows)
                    texts.append(group_table(grp_rows))
                    print(texts[-1] + "\n", flush=True)
                    dump()
        inputs.clear()
        if backend == "cupy":
            try:
                ops.sync()
                cupy.get_default_memory_pool().free_all_blocks()
            except Exception:  # noqa: BLE001
                pass
    summary = summary_text(best_summary(rows, args.seqlens), args.seqlens)
    elapsed = time.monotonic() - T_START
    tail = (f"# {env.get('device')}: median of {args.repeats}; "
            f"{sum(1 for r in rows if r['ms'])}/{len(rows)} measured, "
            f"{sum(1 for r in rows if r['status'].startswith('skipped'))} skipped, "
            f"{sum(1 for r in rows if r['status'].startswith('error'))} errors, "
            f"{sum(1 for r in rows if (r['check'] or '').startswith('MISMATCH'))} mismatches; "
            f"{elapsed:.0f} s (estimate {meta.get('estimate', {}).get('total_s')} s)")
    print(summary + "\n" + tail, flush=True)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text("\n\n".join(texts) + "\n\n" + summary + "\n" + tail + "\n")
    dump(final=True)
    return 0


# ------------------------------------------------------------------------------------------------

def refresh_current(cands: list[dict], args) -> list[dict]:
    """Mark the tiles the table holds now (it may have changed since the gate) and make sure each
    group has them, ungated if need be (the table's own tiles pass the project's compile gate)."""
    out, groups = [], {}
    for c in cands:
        groups.setdefault(group_key(c), []).append(c)
    for key, grp in groups.items():
        family, dtype, d = key
        try:
            v = table_variant(args.tile_table, family, dtype, d)
        except Exception:  # noqa: BLE001 - a family/head dim the table does not have
            out += grp
            continue
        cur = list(tiles_of(v))
        grp = [{**c, "current": [int(t) for t in c["tiles"]] == cur} for c in grp]
        if not any(c["current"] for c in grp):
            grp.insert(0, candidate_record(v, cur, current=True))
        out += grp
    return out


def select(cands: list[dict], args) -> list[dict]:
    """Candidates of the requested families, dtypes and head dims; --max-candidates per group
    (the table's tiles first)."""
    out, per_group = [], {}
    keep = [c for c in cands if c["family"] in args.families and c["dtype"] in args.dtypes
            and int(c["headdim"]) in args.headdims]
    keep.sort(key=lambda c: not c["current"])  # stable: the current tiles lead their group
    for c in keep:
        n = per_group.get(group_key(c), 0)
        if args.max_candidates and n >= args.max_candidates:
            continue
        per_group[group_key(c)] = n + 1
        out.append(c)
    order = {k: i for i, k in enumerate(dict.fromkeys(group_key(c) for c in cands))}
    out.sort(key=lambda c: order[group_key(c)])
    return out


def run_gate(args, cands: list[dict]) -> list[dict]:
    t = time.monotonic()
    progress(f"gating {len(cands)} candidates for {args.tile_table} in {args.jobs} processes")
    records = gate(cands, args.tile_table, args.jobs)
    seconds = time.monotonic() - t
    print(table(gate_rows(records), GATE_COLUMNS))
    kept = sum(1 for r in records if r.get("error") is None)
    print(f"# gate: {kept}/{len(records)} candidates kept for {args.tile_table} in {seconds:.1f} s "
          f"({args.jobs} processes on {os.cpu_count()} CPUs; registers from ptxas, occupancy "
          f"computed, not measured)", flush=True)
    args._gate_seconds = seconds
    return records


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print candidates and plan; no compile")
    p.add_argument("--gate", action="store_true", help="compile-check on the CPU, write --candidates")
    p.add_argument("--candidates", help="candidate JSON: written by --gate, read by a GPU run "
                   f"(default for --gate: {default_candidates_path()})")
    p.add_argument("--families", nargs="+", default=None, choices=FAMILIES,
                   help=f"default: {' '.join(MMA_SYNC_FAMILIES)}; forward_sm90 with --tile-table "
                        f"sm_90a (its default there)")
    p.add_argument("--dtypes", nargs="+", default=["float16"], choices=["float16", "bfloat16"])
    p.add_argument("--headdims", nargs="+", type=int, default=[64, 128, 256],
                   choices=[32, 64, 96, 128, 256])
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="B x S per configuration")
    p.add_argument("--width", type=int, default=2048, help="H x d per configuration")
    p.add_argument("--tile-table", default="sm_90", choices=["sm_80", "sm_86", "sm_90", "sm_90a"],
                   help="the table compared against; also the gate's arch and smem limit")
    p.add_argument("--max-candidates", type=int, default=0, help="per group; 0: all")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--budget", type=float, default=200.0,
                   help="seconds after start past which no new measurement starts")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    p.add_argument("--regate", action="store_true", help="gate again even if --candidates is fresh")
    p.add_argument("--json", help="GPU run: write the rows here (rewritten after every group)")
    p.add_argument("--table", help="GPU run: also write the text tables here")
    p.add_argument("--backend", default="cupy", choices=["cupy", "emulated"],
                   help="emulated: the CPU emulator, to test this script without a GPU (tiny "
                        "sizes only; its times are not GPU figures)")
    return p


def parse(argv=None) -> argparse.Namespace:
    """The arguments, --families resolved for the tile table (forward_sm90 needs sm_90a)."""
    p = parser()
    args = p.parse_args(argv)
    if args.families is None:
        args.families = ["forward_sm90"] if args.tile_table == "sm_90a" else list(MMA_SYNC_FAMILIES)
    if "forward_sm90" in args.families and args.tile_table != "sm_90a":
        p.error("--families forward_sm90 (the Hopper kernel) needs --tile-table sm_90a")
    return args


def main(argv=None) -> int:
    args = parse(argv)

    enumerated = enumerate_candidates(args.tile_table, args.families, args.dtypes, args.headdims,
                                      args.max_candidates)
    if args.gate:
        records = run_gate(args, enumerated)
        path = args.candidates or default_candidates_path(args.tile_table)
        write_candidates(path, records, args, args._gate_seconds)
        print(f"wrote {path}")
        return 0

    # candidates: from the file where it has them and is fresh, gated here otherwise
    meta: dict = {"candidates_file": args.candidates}
    cands, missing, stale = [], list(enumerated), False
    if args.candidates and Path(args.candidates).exists():
        data = load_candidates(args.candidates)
        gated = {c["family"] for c in (*data["candidates"], *data.get("dropped", []))}
        stale = data.get("source_digests") != source_digests(gated) or data.get("tile_table") != args.tile_table
        if stale:
            progress(f"{args.candidates} was gated for other kernel sources or another table: "
                     f"gating again")
        elif not args.regate:
            have = {group_key(c) for c in data["candidates"]} | {
                group_key(c) for c in data.get("dropped", [])}
            cands = [c for c in data["candidates"]]
            missing = [c for c in enumerated if group_key(c) not in have]
            if data.get("nvrtc") and data.get("nvrtc") != nvrtc_version():
                progress(f"note: gated with NVRTC {data.get('nvrtc')}, this is {nvrtc_version()}")
    elif args.candidates:
        progress(f"{args.candidates} does not exist: gating here")
    cands = select(refresh_current(cands, args), args) if cands else []
    missing = select(missing, args) if missing else []

    rows = plan(cands + missing, args)
    est = estimate_seconds(rows, args, gate_count=len(missing))
    meta["estimate"] = est
    if args.dry_run:
        shown = cands + missing
        print(table([{**c, "tiles": tiles_str(c["tiles"]), "cur": "*" if c["current"] else "",
                      "smem_KB": (c.get("smem_bytes") or c["dynamic_smem_bytes"]) / 1024,
                      "gated": "yes" if c in cands else "no"} for c in shown],
                    ["family", "dtype", "headdim", "tiles", "cur", "threads", "registers",
                     "smem_KB", "gated", "name"]))
        print(f"# {len(shown)} candidates ({len(cands)} from {args.candidates}, {len(missing)} "
              f"to gate)")
        print_plan(rows, args, est)
        print("# dry run: nothing compiled, nothing timed")
        return 0

    print_plan(rows, args, est)
    if args.backend == "cupy":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as exc:  # noqa: BLE001
            print(f"# no GPU here ({exc.__class__.__name__}: {exc}): use --dry-run, --gate, or "
                  f"--backend emulated at tiny sizes", flush=True)
            return 2
    if est["total_s"] > args.budget + 30:
        progress(f"WARNING: the estimate ({est['total_s']:.0f} s) exceeds the budget "
                 f"({args.budget:.0f} s): the last measurements will be skipped")
    if missing:
        records = run_gate(args, missing)
        cands = select(cands + [r for r in records if r.get("error") is None], args)
    return run_measure(cands, args, meta)


if __name__ == "__main__":
    sys.exit(main())
