"""Tile-size search for the CUDA kernels: per kernel family, dtype and head dim, which legal tiles
around the current table run fastest on this GPU, each checked and timed against the table's own.

    python bench/gpu/tiles.py --dry-run                  # candidates and plan: no compile, no GPU
    python bench/gpu/tiles.py --gate --candidates F      # CPU: compile, drop failures, write F
    python bench/gpu/tiles.py --candidates F [--json F]  # one CUDA GPU: check and time each one

Families, tiles BLOCK_M x BLOCK_N x warps: forward (flash_fwd_step), bwd_dkdv (atomic dQ), bwd_dq
(the deterministic dQ kernel), forward_sm90 (--tile-table sm_90a: the Hopper kernel, 128 x BLOCK_N
x STAGES). Legal: the kernels' static_asserts, 64-1024 threads, smem within the table's limit.
--gate drops those NVRTC/ptxas fail, spill or give over 255 registers. A GPU run times one full
block of (B, S, H, d) = (tokens/S, S, width/d, d) per candidate (CUDA events, median of
--repeats), checks it against the table's tiles (TOLERANCE), starts nothing new past --budget and
rewrites --json after every group.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from bench.gpu.ptxas_report import occupancy  # noqa: E402

T_START = time.monotonic()
FAMILIES = ("forward", "bwd_dkdv", "bwd_dq", "forward_sm90")
MMA_SYNC_FAMILIES = FAMILIES[:3]    # the default run: the mma.sync tables' families
FORWARD_FAMILIES = ("forward", "forward_sm90")
FAMILY_SOURCE = {"forward": "flash_fwd.cu", "bwd_dkdv": "flash_bwd.cu", "bwd_dq": "flash_bwd.cu",
                 "forward_sm90": "flash_fwd_sm90.cu"}
FWD_NWARPS, FWD_BLOCK_N = (4, 8), (32, 64, 128)
SM90_BLOCK_N, SM90_STAGES = (64, 128), (2, 3, 4)   # 256 keys: S alone would take 128 registers
BWD_BM, BWD_BN, BWD_WARPS_D = (16, 32, 64, 128), (32, 64, 128), (1, 2)
MIN_THREADS, MAX_THREADS = 64, 1024   # one-warp blocks (bwd_dq, BM = 16, WARPS_D = 1) left out
TOLERANCE = {"float16": 2e-2, "bfloat16": 4e-2}
FLOP_FACTOR = {"forward": 1.0, "bwd_dkdv": 2.5, "bwd_dq": 1.5, "forward_sm90": 1.0}
# the runtime estimate: TFLOP/s of a typical candidate (below the H100 tables' 140-220 forward,
# 95-140 backward) times a slack; seconds a kernel compile takes on one core; fixed overheads
EST_TFLOPS = {"forward": 110.0, "bwd_dkdv": 80.0, "bwd_dq": 70.0, "forward_sm90": 300.0}
EST_SLACK, EST_COMPILE_S, EST_STARTUP_S = 1.3, 0.8, 15.0
EST_PER_MEASUREMENT_S, EST_PER_GROUP_S, EST_GPU_JOBS = 0.15, 1.0, 16
GATE_KEYS = ("registers", "spill_stores", "spill_loads", "stack_bytes", "static_smem_bytes",
             "smem_bytes", "compile_seconds", "error")


def default_candidates_path(tile_table: str = "sm_90") -> str:
    known = {"sm_90": "results/h100/tile_candidates.json",
             "sm_90a": "results/h200/tile_candidates_sm90a.json"}
    return str(C.ROOT / "bench" / known.get(tile_table, f"out/tile_candidates_{tile_table}.json"))


# ------------------------------------------------------------------------------------------------
# variants and candidates

def make_variant(family: str, dtype: str, d: int, tiles):
    """The KernelVariant of `family` with tiles (BLOCK_M, BLOCK_N, warps); forward_sm90's are
    (128, BLOCK_N, STAGES)."""
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
    """(BLOCK_M, BLOCK_N, warps) of a variant; (BLOCK_M, BLOCK_N, STAGES) of a Hopper one."""
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


def cells(r: dict, **extra) -> dict:
    """A candidate or timing record as a table row: tiles as text, * for the table's own tiles,
    smem in KB, occupancy in percent."""
    return {**r, "tiles": r["tiles"] if isinstance(r["tiles"], str) else tiles_str(r["tiles"]),
            "cur": "*" if r["current"] else "",
            "smem_KB": (r.get("smem_bytes") or r.get("dynamic_smem_bytes") or 0) / 1024,
            "occ": None if r.get("occupancy") is None else f"{r['occupancy']:.0%}", **extra}


def group_key(c: dict) -> tuple:
    return (c["family"], c["dtype"], int(c["headdim"]))


def candidate_record(variant, tiles, current: bool) -> dict:
    return {"family": variant.family, "dtype": variant.dtype, "headdim": variant.headdim,
            "tiles": list(tiles), "name": variant.name, "current": bool(current),
            "threads": variant.launch.threads, "dynamic_smem_bytes": variant.launch.smem_bytes}


def enumerate_candidates(tile_table: str, families, dtypes, headdims,
                         max_per_group: int = 0) -> list[dict]:
    """Legal candidates per (family, dtype, d), the table's tiles first; `max_per_group` > 0
    keeps the first that many of each group."""
    from burstcu.build.compile import ARCH_LIMITS

    smem_limit = ARCH_LIMITS[tile_table]["smem_per_block"]
    out = []
    for family in families:
        if family == "forward_sm90":
            grid = [(128, bn, st) for bn in SM90_BLOCK_N for st in SM90_STAGES]
        elif family == "forward":
            grid = [(16 * nw, bn, nw) for nw in FWD_NWARPS for bn in FWD_BLOCK_N]
        else:
            grid = [(bm, bn, wd) for wd in BWD_WARPS_D for bm in BWD_BM for bn in BWD_BN]
        for dtype in dtypes:
            for d in headdims:
                current = tiles_of(table_variant(tile_table, family, dtype, d))
                group = []
                for tiles in dict.fromkeys([current, *grid]):
                    try:
                        v = make_variant(family, dtype, d, tiles)
                    except ValueError:
                        continue
                    legal = MIN_THREADS <= v.launch.threads <= MAX_THREADS or tiles == current
                    if legal and v.launch.smem_bytes <= smem_limit:
                        group.append(candidate_record(v, tiles, current=(tiles == current)))
                out += group[:max_per_group] if max_per_group > 0 else group
    return out


def source_digests(families=FAMILIES) -> dict:
    """{kernel source: digest (headers included)} of the sources `families` compile."""
    from burstcu.build.compile import source_digest

    return {s: source_digest(s) for s in sorted({FAMILY_SOURCE[f] for f in families})}


def nvrtc_version() -> str | None:
    try:
        from cuda.bindings import nvrtc
        return ".".join(map(str, nvrtc.nvrtcVersion()[1:]))
    except Exception:  # noqa: BLE001 - only informative
        return None


def first_line(text, limit: int = 240) -> str:
    """An NVRTC log's first "error:" line (or the first line): what a table cell can hold."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error:" in ln.lower()]
    return (errs or lines or [""])[0][:limit]


# ------------------------------------------------------------------------------------------------
# the compile gate (CPU) and the parallel compile (GPU run)

def _gate_one(family: str, dtype: str, d: int, tiles, arch: str) -> dict:
    """One gate record; runs in a worker process. Never raises."""
    try:
        from burstcu.build.compile import gate_variant
        return gate_variant(make_variant(family, dtype, d, tiles), arch)
    except Exception as exc:  # noqa: BLE001 - reported as the candidate's failure
        return {"error": f"{exc.__class__.__name__}: {exc}"}


def _compile_one(source: str, name: str, arch: str) -> str | None:
    """Compile one instantiation into the kernel cache (a worker process); the error or None."""
    try:
        from burstcu.build.compile import cached_cubin
        cached_cubin(source, [name], arch)
        return None
    except Exception as exc:  # noqa: BLE001 - the timed run reports it again
        return f"{exc.__class__.__name__}: {first_line(exc)}"


def in_processes(fn, args: list, jobs: int, label) -> list:
    """fn(*a) for every a of `args` in `jobs` spawned processes (spawn: CUDA may be initialised
    here), in this process where there is one job or no pool; progress via label(i, result)."""
    results = {}
    jobs = max(1, min(jobs, len(args)))
    if jobs > 1:
        try:
            import multiprocessing as mp
            with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
                futures = {ex.submit(fn, *a): i for i, a in enumerate(args)}
                for fut in as_completed(futures):
                    results[futures[fut]] = fut.result()
                    label(futures[fut], results[futures[fut]])
        except Exception as exc:  # noqa: BLE001 - no worker processes here: one by one
            C.progress(f"process pool unavailable ({exc.__class__.__name__}: {exc}): one by one")
    for i, a in enumerate(args):
        if i not in results:
            results[i] = fn(*a)
            label(i, results[i])
    return [results[i] for i in range(len(args))]


def gate(cands: list[dict], arch: str, jobs: int) -> list[dict]:
    """Every candidate compiled for `arch` with the ptxas report: the gate's fields, occupancy
    and `error` (None when it passes) added."""
    args = [(c["family"], c["dtype"], int(c["headdim"]), tuple(c["tiles"]), arch) for c in cands]
    results = in_processes(_gate_one, args, jobs, lambda i, r: C.progress(
        f"gate {cands[i]['name']}: {'FAIL' if r.get('error') else 'ok'}"))
    out = []
    for c, r in zip(cands, results):
        rec = {**c, **{key: r.get(key) for key in GATE_KEYS}, "arch": arch}
        if rec["error"] is not None:
            rec["error"] = first_line(rec["error"])
        else:
            occ = occupancy(rec)
            rec.update(blocks_per_sm=occ["blocks_per_sm"], warps_per_sm=occ["warps_per_sm"],
                       occupancy=round(occ["occupancy"], 4), limited_by=occ["limited_by"])
        out.append(rec)
    return out


def run_gate(args, cands: list[dict]) -> list[dict]:
    t = time.monotonic()
    C.progress(f"gating {len(cands)} candidates for {args.tile_table} in {args.jobs} processes")
    records = gate(cands, args.tile_table, args.jobs)
    args.gate_seconds = time.monotonic() - t
    shown = [cells(r, spill=None if r.get("spill_stores") is None else r["spill_stores"] + r["spill_loads"],
                   status="ok" if r["error"] is None else "DROP: " + r["error"][:70]) for r in records]
    print(C.table(shown, ["family", "dtype", "headdim", "tiles", "cur", "threads", "registers",
                          "spill", "smem_KB", "blocks_per_sm", "warps_per_sm", "occ", "limited_by",
                          "status"]))
    kept = sum(1 for r in records if r["error"] is None)
    print(f"# gate: {kept}/{len(records)} candidates kept for {args.tile_table} in "
          f"{args.gate_seconds:.1f} s ({args.jobs} processes on {os.cpu_count()} CPUs; registers "
          f"from ptxas, occupancy computed, not measured)", flush=True)
    return records


# ------------------------------------------------------------------------------------------------
# plan and estimate

def gflop(family: str, b: int, s: int, h: int, d: int) -> float:
    return 4.0 * b * h * s * s * d * FLOP_FACTOR[family] / 1e9


def plan(cands: list[dict], args) -> list[dict]:
    """One row per (seqlen, candidate), in the order they run (smaller seqlens first)."""
    rows = []
    for s in args.seqlens:
        for key in [(f, dt, d) for f in args.families for dt in args.dtypes for d in args.headdims]:
            b, _, h, _ = C.gpu_shape(args.tokens, args.width, s, key[2])
            rows += [{**c, "seqlen": s, "batch": b, "heads": h, "gflop": gflop(key[0], b, s, h, key[2])}
                     for c in cands if group_key(c) == key]
    return rows


def estimate_seconds(rows: list[dict], args, gate_count: int = 0) -> dict:
    """A pessimistic runtime estimate on one H100 (see EST_*)."""
    def secs(family, g):
        return g / (EST_TFLOPS[family] * 1e3) * EST_SLACK

    calls = 1 + args.warmup + args.repeats
    measure = sum(calls * secs(r["family"], r["gflop"]) + EST_PER_MEASUREMENT_S for r in rows)
    # per group the reference run (the table's tiles); per (S, dtype, d) with a backward family
    # the forward that makes out, lse
    groups = {(r["seqlen"], r["dtype"], r["headdim"], r["family"]): r for r in rows}
    refs = sum(EST_PER_GROUP_S + secs(r["family"], r["gflop"]) for r in groups.values())
    fwd = {(r["seqlen"], r["dtype"], r["headdim"]) for r in rows if r["family"] != "forward"}
    fwd_refs = sum(secs("forward", gflop("forward", *C.gpu_shape(args.tokens, args.width, s, d)[:3], d))
                   for s, _, d in fwd)
    kernels = len({r["name"] for r in rows})
    compile_s = 3.0 + EST_COMPILE_S * math.ceil((kernels + 3 * len(groups)) / EST_GPU_JOBS)
    gate_s = 3.0 + EST_COMPILE_S * math.ceil(gate_count / EST_GPU_JOBS) if gate_count else 0.0
    total = EST_STARTUP_S + gate_s + compile_s + measure + refs + fwd_refs
    return {"startup_s": EST_STARTUP_S, "gate_s": round(gate_s, 1), "compile_s": round(compile_s, 1),
            "measure_s": round(measure + refs + fwd_refs, 1), "total_s": round(total, 1),
            "measurements": len(rows), "kernels": kernels}


def print_plan(rows: list[dict], args, est: dict) -> None:
    print(f"# estimate on one H100: ~{est['total_s']:.0f} s = startup {est['startup_s']:.0f} "
          f"+ gate {est['gate_s']:.0f} + compile {est['compile_s']:.0f} ({est['kernels']} kernels, "
          f"{EST_GPU_JOBS} processes) + measure {est['measure_s']:.0f} ({est['measurements']} "
          f"measurements x {1 + args.warmup + args.repeats} calls); budget {args.budget:.0f} s")
    cols = ["seqlen", "family", "dtype", "headdim", "batch", "heads", "gflop"]
    counts: dict[tuple, int] = {}
    for r in rows:
        key = tuple(round(r[c], 1) if c == "gflop" else r[c] for c in cols)
        counts[key] = counts.get(key, 0) + 1
    print(C.table([dict(zip(cols + ["candidates"], (*k, n))) for k, n in counts.items()],
                  cols + ["candidates"]), flush=True)


# ------------------------------------------------------------------------------------------------
# the GPU run

def make_ops(tile_table: str, backend: str = "cupy"):
    """A KernelOps (CuPy, or the CPU emulator to test this script) whose variant lookup returns
    a pinned candidate (`pin`) and whose kernels of the `skip` families do nothing."""
    from burstcu.ops.cuda.kernel_ops import KernelOps

    class TileOps(KernelOps):
        def __init__(self):
            super().__init__(backend, arch=tile_table)
            # a candidate failing the Hopper first-use check must not be timed as its fallback
            self.first_use_check = False
            self.pinned, self.skip, self.extra, self.extra_fns = {}, set(), {}, {}

        def pin(self, variant) -> None:
            if variant.name not in self._variants:
                self.extra[variant.name] = variant
            self.pinned[(variant.family, variant.dtype, variant.headdim)] = variant

        def unpin(self) -> None:
            self.pinned.clear()

        def variant(self, family, dtype, headdim):
            base = super().variant(family, dtype, headdim)
            return self.pinned.get((base.family, base.dtype, base.headdim), base)

        def function(self, name):
            v = self._variants.get(name) or self.extra.get(name)
            if v is not None and v.family in self.skip:
                return lambda *a, **k: None
            if name in self._variants:
                return super().function(name)
            if name not in self.extra_fns:
                if v is None:
                    raise KeyError(f"{name!r} was never pinned")
                if self.backend == "cupy":
                    from burstcu.build.compile import get_function
                    fn = get_function(v.source, name, smem_bytes=v.launch.smem_bytes, target=v.target)
                else:
                    from burstcu.build import emulate
                    from burstcu.build.variants import kernel_dir
                    fn = emulate.build_module([str(kernel_dir() / v.source)], [name]).get_function(name)
                self.extra_fns[name] = fn
            return self.extra_fns[name]

    return TileOps()


class Inputs:
    """q, k, v, dout (B, S, H, d) random normal, one full non-causal block; out, lse, delta by
    the table's kernels, made once (`backward_inputs`)."""

    def __init__(self, ops, dtype: str, b: int, s: int, h: int, d: int, seed: int = 0):
        from burstcu.layout import Block

        self.q, self.k, self.v, self.dout = C.normal(ops.xp, [(b, s, h, d)] * 4, dtype, seed)
        self.scale, self.ops, self._bwd = 1.0 / math.sqrt(d), ops, None
        self.blocks = [Block(0, s, 0, s, 0, 0, False)]

    def backward_inputs(self):
        if self._bwd is None:
            out = forward_once(self.ops, self)["out"]
            self._bwd = (out, self.lse, self.ops.backward_delta(self.dout, out))
        return self._bwd


def forward_once(ops, inp: Inputs) -> dict:
    st = ops.forward_init(inp.q, inp.scale)
    ops.forward_step(st, inp.k, inp.v, inp.blocks)
    out, inp.lse = ops.forward_finalize(st, inp.q.dtype)
    return {"out": out}


def step_of(ops, family: str, inp: Inputs):
    """(the family's one step as a callable, a callable returning what a check compares). bwd_dq
    runs the deterministic backward with its dK/dV kernel skipped; the rest atomic."""
    ops.deterministic = family == "bwd_dq"
    ops.skip = {"bwd_dkdv_nodq"} if family == "bwd_dq" else set()
    if family in FORWARD_FAMILIES:
        st = ops.forward_init(inp.q, inp.scale)
        return (lambda: ops.forward_step(st, inp.k, inp.v, inp.blocks),
                lambda: {"out": ops.forward_finalize(st, inp.q.dtype)[0]})
    _, lse, delta = inp.backward_inputs()
    ctx = ops.backward_init(inp.k, inp.v, inp.scale)
    dq = ops.xp.zeros(inp.q.shape, dtype=np.float32)
    return (lambda: ops.backward_step(ctx, inp.q, inp.dout, lse, delta, dq, inp.blocks),
            lambda: {"dq": dq} if family == "bwd_dq" else {"dq": dq, "dk": ctx.dk, "dv": ctx.dv})


def run_family(ops, family: str, inp: Inputs) -> dict:
    """One step of `family` and what it wrote, as float32: {tensor: array}."""
    fn, outputs = step_of(ops, family, inp)
    fn()
    result = {k: x.astype(np.float32) for k, x in outputs().items()}
    ops.sync()
    return result


def rel_diffs(xp, result: dict, ref: dict) -> dict:
    """{tensor: max |x - ref| / max |ref|} (NaN when either is not finite)."""
    out = {}
    for key, r in ref.items():
        num, den = float(xp.max(xp.abs(result[key] - r))), float(xp.max(xp.abs(r)))
        out[key] = num / den if den > 0 else num
    return out


def measure_group(ops, key, seqlen: int, cands: list[dict], inp: Inputs | None, args,
                  deadline: float) -> list[dict]:
    """Check and time every candidate of one (family, dtype, d) at one seqlen; never raises."""
    family, dtype, d = key
    b, s, h, _ = C.gpu_shape(args.tokens, args.width, seqlen, d)
    tol = TOLERANCE.get(dtype, 2e-2)
    ref, ref_error = None, "no inputs"
    if inp is not None and time.monotonic() <= deadline:
        try:   # the table's own tiles, no pin: the reference every candidate is compared with
            ops.unpin()
            ref = run_family(ops, family, inp)
        except Exception as exc:  # noqa: BLE001
            ref_error = f"{exc.__class__.__name__}: {first_line(exc)}"
            C.progress(f"  reference FAILED: {ref_error}")
    rows = []
    for c in cands:
        row = {"family": family, "dtype": dtype, "headdim": d, "seqlen": s, "batch": b, "heads": h,
               "tiles": tiles_str(c["tiles"]), "current": bool(c["current"]), "name": c["name"],
               "threads": c["threads"], "registers": c.get("registers"),
               "smem_bytes": c.get("smem_bytes") or c.get("dynamic_smem_bytes"),
               "occupancy": c.get("occupancy"), "ms": None, "tflops": None, "check": None,
               "status": "ok"}
        rows.append(row)
        if time.monotonic() > deadline:
            row["status"] = "skipped (budget)"
            continue
        if inp is None:
            row["status"] = "error: no inputs"
            continue
        try:
            ops.pin(make_variant(family, dtype, d, c["tiles"]))
            result = run_family(ops, family, inp)
            if ref is None:
                row["check"] = f"unchecked (no reference: {ref_error})"
            else:
                row["max_rel_diff"] = diffs = rel_diffs(ops.xp, result, ref)
                row["max_rel"] = max(diffs.values())
                bad = [k for k, v in diffs.items() if not v <= tol]
                row["check"] = "ok" if not bad else f"MISMATCH {','.join(bad)} > {tol:g}"
            times = [t * 1e3 for t in C.call_seconds(step_of(ops, family, inp)[0], args.repeats,
                                                     args.warmup, cuda=ops.backend == "cupy")]
            ms = float(np.median(times))
            row.update(ms=ms, ms_min=min(times), ms_max=max(times),
                       tflops=gflop(family, b, s, h, d) / ms)
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not stop the rest
            row["status"] = f"error: {exc.__class__.__name__}: {first_line(exc, 160)}"
        finally:
            ops.unpin()
            ops.deterministic, ops.skip = False, set()
        C.progress(f"  {family} {dtype} d={d} S={s} {row['tiles']:>10}{' *' if c['current'] else ''}"
                   f" {row['ms'] or 0:.3g} ms {row['check'] or ''} {row['status']}")
    cur = next((r for r in rows if r["current"] and r["ms"]), None)
    for r in rows:
        if cur and r["ms"]:
            r["vs_current"] = cur["ms"] / r["ms"]
    return rows


def group_table(rows: list[dict]) -> str:
    timed = sorted((r for r in rows if r["ms"]), key=lambda r: r["ms"])
    shown = [cells(r, rank=i + 1 if r["ms"] else "-", check=r["check"] or "-", status=r["status"][:60])
             for i, r in enumerate(timed + [r for r in rows if not r["ms"]])]
    r = rows[0]
    return (f"## {r['family']} {r['dtype']} d={r['headdim']} S={r['seqlen']} (B={r['batch']}, "
            f"H={r['heads']}; tiles BLOCK_M x BLOCK_N x "
            f"{'NWARPS' if r['family'] == 'forward' else 'WARPS_D'}; * = current table)\n"
            + C.table(shown, ["rank", "tiles", "cur", "threads", "registers", "occ", "ms", "tflops",
                              "vs_current", "max_rel", "check", "status"]))


def best_summary(rows: list[dict], seqlens) -> list[dict]:
    """Per (family, dtype, d): the candidate with the best geometric-mean speedup over the
    current tiles across the seqlens where both were measured and it passed the check."""
    out = []
    for key in sorted({group_key(r) for r in rows}, key=lambda k: (FAMILIES.index(k[0]), k[1:])):
        grp = [r for r in rows if group_key(r) == key]
        rec = {"family": key[0], "dtype": key[1], "headdim": key[2], "best": None,
               "current": next((r["tiles"] for r in grp if r["current"]), None)}
        scores = {}
        for tiles in {r["tiles"] for r in grp}:
            per_s = {r["seqlen"]: r["vs_current"] for r in grp
                     if r["tiles"] == tiles and r.get("vs_current") and r["check"] == "ok"}
            if per_s:
                scores[tiles] = (math.exp(sum(map(math.log, per_s.values())) / len(per_s)), per_s)
        if scores:
            full = max(len(v[1]) for v in scores.values())
            best = max((t for t in scores if len(scores[t][1]) == full), key=lambda t: scores[t][0])
            rec.update(best=best, speedup=scores[best][0],
                       per_seqlen={str(s): scores[best][1].get(s) for s in seqlens})
        out.append(rec)
    return out


def summary_text(best: list[dict]) -> str:
    lines = ["## best tiles per family and head dim (geometric mean over seqlens of "
             "time(current) / time(candidate); only candidates that passed the check)"]
    for b in best:
        per = ", ".join(f"S={s} {v:.2f}x" for s, v in (b.get("per_seqlen") or {}).items() if v)
        same = " (the current tiles)" if b["best"] == b["current"] else ""
        lines.append(f"{b['family']:9} {b['dtype']:8} d={b['headdim']:<3} current {b['current']}"
                     + (f" -> best {b['best']}{same}: {b['speedup']:.2f}x [{per}]" if b["best"]
                        else ": no measurement"))
    return "\n".join(lines)


def support_variants(ops, args) -> list:
    """The table's kernels a run launches besides the candidates: references, finalize, delta."""
    from burstcu.build.bwd_variants import delta_variant

    out = []
    for dtype in args.dtypes:
        for d in args.headdims:
            out += [table_variant(args.tile_table, f, dtype, d)
                    for f in ("forward", *[f for f in args.families if f != "forward"])]
        out += [v for v in ops._variants.values()
                if v.family == "forward_finalize" and v.dtype == dtype]
        out.append(delta_variant(dtype))
    return out


def run_measure(cands: list[dict], args, meta: dict) -> int:
    """Check and time every candidate (module docstring); writes --json and --table."""
    env = C.gpu_versions(args.backend)
    ops = make_ops(args.tile_table, args.backend)
    if args.backend == "cupy":   # every kernel the run launches, compiled in parallel first
        from burstcu.build.compile import device_arch
        arch = device_arch()
        C.progress(f"device {env['device']} ({arch}), cupy {env.get('cupy')}, nvrtc {env.get('nvrtc')}")
        variants = {v.name: v for v in support_variants(ops, args)}
        for c in cands:
            try:
                v = make_variant(c["family"], c["dtype"], int(c["headdim"]), c["tiles"])
                variants[v.name] = v
            except Exception as exc:  # noqa: BLE001 - reported again when measured
                C.progress(f"  bad candidate {c.get('name')}: {exc}")
        todo = list(variants.values())
        jobs = [(v.source, v.name, v.target or arch) for v in todo]
        errors = in_processes(_compile_one, jobs, args.jobs,
                              lambda i, e: e and C.progress(f"  compile FAILED {todo[i].name}: {e}"))
        C.progress(f"compiled {len(todo)} kernels, {sum(map(bool, errors))} failed")
    deadline = T_START + args.budget
    rows, texts = [], []
    head = {"versions": env, "args": C.clean(vars(args)), "estimate": meta.get("estimate"),
            "candidates_file": meta.get("candidates_file"), "tile_table": args.tile_table,
            "note": (f"{'CUDA events' if args.backend == 'cupy' else 'wall clock, CPU emulator'}, "
                     f"median of {args.repeats} after {args.warmup} warm-up calls; "
                     f"max_rel_diff: max|x - table| / max|table|")}

    def dump(final: bool = False) -> None:
        if args.json:
            C.write_json(args.json, {**head, "complete": final,
                                     "elapsed_s": round(time.monotonic() - T_START, 1),
                                     "best": best_summary(rows, args.seqlens), "rows": rows})

    # seqlens outermost (a run cut short by --budget loses the longest), inputs shared by families
    for s in args.seqlens:
        inputs = {}
        for key in [(f, dt, d) for f in args.families for dt in args.dtypes for d in args.headdims]:
            grp = [c for c in cands if group_key(c) == key]
            if not grp:
                continue
            b, _, h, _ = C.gpu_shape(args.tokens, args.width, s, key[2])
            C.progress(f"{key[0]} {key[1]} d={key[2]} S={s}: B={b} H={h}, {len(grp)} candidates "
                       f"({time.monotonic() - T_START:.0f} s of {args.budget:.0f})")
            if key[1:] not in inputs and time.monotonic() <= deadline:
                try:
                    inputs[key[1:]] = Inputs(ops, key[1], b, s, h, key[2])
                except Exception as exc:  # noqa: BLE001
                    C.progress(f"  inputs FAILED: {exc.__class__.__name__}: {exc}")
            rows += (grp_rows := measure_group(ops, key, s, grp, inputs.get(key[1:]), args, deadline))
            texts.append(group_table(grp_rows))
            print(texts[-1] + "\n", flush=True)
            dump()
        inputs.clear()
        if args.backend == "cupy":
            import cupy
            ops.sync()
            cupy.get_default_memory_pool().free_all_blocks()
    count = lambda f: sum(1 for r in rows if f(r))  # noqa: E731
    tail = (f"# {env['device']}: median of {args.repeats}; {count(lambda r: r['ms'])}/{len(rows)} "
            f"measured, {count(lambda r: r['status'].startswith('skipped'))} skipped, "
            f"{count(lambda r: r['status'].startswith('error'))} errors, "
            f"{count(lambda r: (r['check'] or '').startswith('MISMATCH'))} mismatches; "
            f"{time.monotonic() - T_START:.0f} s (estimate {meta['estimate']['total_s']} s)")
    summary = summary_text(best_summary(rows, args.seqlens)) + "\n" + tail
    print(summary, flush=True)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text("\n\n".join(texts) + "\n\n" + summary + "\n")
    dump(final=True)
    return 0


# ------------------------------------------------------------------------------------------------

def refresh_current(cands: list[dict], args) -> list[dict]:
    """Mark the tiles the table holds now and make sure each group has them (ungated if need be:
    the table's own tiles pass the project's compile gate)."""
    out, groups = [], {}
    for c in cands:
        groups.setdefault(group_key(c), []).append(c)
    for key, grp in groups.items():
        try:
            v = table_variant(args.tile_table, *key)
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
    (the table's tiles first), in the order of their groups in `cands`."""
    out, per_group = [], {}
    keep = [c for c in cands if c["family"] in args.families and c["dtype"] in args.dtypes
            and int(c["headdim"]) in args.headdims]
    for c in sorted(keep, key=lambda c: not c["current"]):   # stable: current tiles lead
        n = per_group.get(group_key(c), 0)
        if not args.max_candidates or n < args.max_candidates:
            per_group[group_key(c)] = n + 1
            out.append(c)
    order = {k: i for i, k in enumerate(dict.fromkeys(group_key(c) for c in cands))}
    return sorted(out, key=lambda c: order[group_key(c)])


def parse(argv=None) -> argparse.Namespace:
    """The arguments, --families resolved for the tile table (forward_sm90 needs sm_90a)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print candidates and plan; no compile")
    p.add_argument("--gate", action="store_true", help="compile-check on the CPU, write --candidates")
    p.add_argument("--candidates", help="candidate JSON: written by --gate, read by a GPU run")
    p.add_argument("--families", nargs="+", default=None, choices=FAMILIES,
                   help="default: the mma.sync ones; forward_sm90 with --tile-table sm_90a")
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
    p.add_argument("--json", help="GPU run: the rows (rewritten after every group)")
    p.add_argument("--table", help="GPU run: the text tables")
    p.add_argument("--backend", default="cupy", choices=["cupy", "emulated"],
                   help="emulated: the CPU emulator, to test this script (tiny sizes; not GPU figures)")
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
        path = args.candidates or default_candidates_path(args.tile_table)
        records = run_gate(args, enumerated)
        C.write_json(path, {
            "note": "tile candidates that compile for the arch without spills and fit its smem "
                    "(bench/gpu/tiles.py --gate; registers from ptxas, occupancy computed, not measured)",
            "tile_table": args.tile_table, "arch": args.tile_table, "nvrtc": nvrtc_version(),
            "source_digests": source_digests({r["family"] for r in records}),
            "gate_seconds": round(args.gate_seconds, 1), "jobs": args.jobs, "host_cpus": os.cpu_count(),
            "candidates": [r for r in records if r["error"] is None],
            "dropped": [r for r in records if r["error"] is not None]})
        print(f"wrote {path}")
        return 0
    # candidates: from the file where it has them and is fresh, gated here otherwise
    cands, missing = [], enumerated
    if args.candidates and Path(args.candidates).exists():
        data = json.loads(Path(args.candidates).read_text())
        gated = [*data["candidates"], *data.get("dropped", [])]
        if (data.get("source_digests") != source_digests({c["family"] for c in gated})
                or data.get("tile_table") != args.tile_table):
            C.progress(f"{args.candidates} was gated for other kernel sources or another table: "
                       f"gating again")
        else:
            have = {group_key(c) for c in gated}
            cands = data["candidates"]
            missing = [c for c in enumerated if group_key(c) not in have]
    elif args.candidates:
        C.progress(f"{args.candidates} does not exist: gating here")
    cands = select(refresh_current(cands, args), args) if cands else []
    missing = select(missing, args) if missing else []
    rows = plan(cands + missing, args)
    meta = {"candidates_file": args.candidates,
            "estimate": (est := estimate_seconds(rows, args, gate_count=len(missing)))}
    if args.dry_run:
        shown = [cells(c, gated="yes" if c in cands else "no") for c in cands + missing]
        print(C.table(shown, ["family", "dtype", "headdim", "tiles", "cur", "threads", "registers",
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
        C.progress(f"WARNING: the estimate ({est['total_s']:.0f} s) exceeds the budget "
                   f"({args.budget:.0f} s): the last measurements will be skipped")
    if missing:
        records = run_gate(args, missing)
        cands = select(cands + [r for r in records if r["error"] is None], args)
    return run_measure(cands, args, meta)


if __name__ == "__main__":
    sys.exit(main())
