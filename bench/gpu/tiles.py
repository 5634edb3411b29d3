"""Tile-size search for the CUDA kernels: per kernel family, dtype and head dim, which legal tiles
around the current table run fastest on this GPU, each checked and timed against the table's own.

    python bench/gpu/tiles.py --dry-run                  # candidates and plan: no compile, no GPU
    python bench/gpu/tiles.py --gate --candidates F      # CPU: compile, drop failures, write F
    python bench/gpu/tiles.py --candidates F [--json F]  # one CUDA GPU: check and time each one

Families, tiles BLOCK_M x BLOCK_N x warps (the backward's: x WARPS_D, its warps along d): forward
(flash_fwd_step), bwd_dkdv (atomic dQ), bwd_dq (the deterministic dQ kernel), forward_sm90
(--tile-table sm_90a: the Hopper kernel, 128 x BLOCK_N x STAGES). Legal: the kernels'
static_asserts, 64-1024 threads, smem within the table's limit. --gate drops those NVRTC/ptxas
fail, spill or give over 255 registers. A GPU run times one full block of (B, S, H, d) =
(tokens/S, S, width/d, d) per candidate (CUDA events, median of --repeats), checks it against the
table's tiles (TOLERANCE), starts nothing new past --budget and rewrites --json after every group.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from itertools import product
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402
from burstcu.build import all_variants, bwd_variants, fwd_variants  # noqa: E402
from burstcu.build.compile import (ARCH_LIMITS, cached_cubin, device_arch, gate_variant,  # noqa: E402
                                   source_digest)
from burstcu.layout import Block  # noqa: E402
from burstcu.ops.cuda.kernel_ops import KernelOps  # noqa: E402
from burstcu.transport.bootstrap import device_count  # noqa: E402

T_START = time.monotonic()
FAMILIES = ("forward", "bwd_dkdv", "bwd_dq", "forward_sm90")
MMA_SYNC_FAMILIES = FAMILIES[:3]    # the default run: the mma.sync tables' families
FAMILY_SOURCE = {"forward": "flash_fwd.cu", "bwd_dkdv": "flash_bwd.cu", "bwd_dq": "flash_bwd.cu",
                 "forward_sm90": "flash_fwd_sm90.cu"}
# the tiles tried: forward (16 * NWARPS, BLOCK_N, NWARPS), backward (BLOCK_M, BLOCK_N, WARPS_D),
# forward_sm90 (128, BLOCK_N, STAGES; no 256 keys: S alone would take 128 registers)
BWD_GRID = [(bm, bn, wd) for wd in (1, 2) for bm in (16, 32, 64, 128) for bn in (32, 64, 128)]
TILE_GRID = {"forward": [(16 * nw, bn, nw) for nw in (4, 8) for bn in (32, 64, 128)],
             "bwd_dkdv": BWD_GRID, "bwd_dq": BWD_GRID,
             "forward_sm90": [(128, bn, st) for bn in (64, 128) for st in (2, 3, 4)]}
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


def make_variant(family: str, dtype: str, d: int, tiles):
    """The KernelVariant of `family` with tiles (BLOCK_M, BLOCK_N, warps); forward_sm90's are
    (128, BLOCK_N, STAGES). ValueError for tiles the kernel does not take."""
    bm, bn, w = (int(x) for x in tiles)
    if family == "forward_sm90" and bm == fwd_variants.SM90_BLOCK_M:
        return fwd_variants.sm90_variant_for_tiles(dtype, d, bn, w)
    if family == "forward" and bm == 16 * w:
        return fwd_variants.step_variant_for_tiles(dtype, d, w, bn)
    if family == "bwd_dkdv":
        return bwd_variants.dkdv_variant_for_tiles(dtype, d, bm, bn, w, with_dq=True)
    if family == "bwd_dq":
        return bwd_variants.dq_variant_for_tiles(dtype, d, bm, bn, w)
    rule = {"forward": "BLOCK_M must be 16 * NWARPS",
            "forward_sm90": f"BLOCK_M is {fwd_variants.SM90_BLOCK_M}"}.get(family, f"no family of {FAMILIES}")
    raise ValueError(f"{family} tiles {tiles}: {rule}")


def table_variant(tile_table: str, family: str, dtype: str, d: int):
    """The variant the table `tile_table` launches for (family, dtype, native head dim d)."""
    found = [v for v in all_variants(tile_table) if (v.family, v.dtype, v.headdim) == (family, dtype, d)]
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
    if variant.family in ("bwd_dkdv", "bwd_dkdv_nodq", "bwd_dq"):   # WARPS_D: warps a 16-row slice
        return cfg.block_m, cfg.block_n, warps // ((cfg.block_m if variant.family == "bwd_dq"
                                                    else cfg.block_n) // 16)
    raise ValueError(f"no tiles for family {variant.family!r}")


def tiles_str(tiles) -> str:
    return "x".join(str(int(t)) for t in tiles)


def group_key(c: dict) -> tuple:
    return (c["family"], c["dtype"], int(c["headdim"]))


def by_group(records: list[dict]) -> dict:
    """{(family, dtype, headdim): [its records]}, the groups in the order they first appear."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault(group_key(r), []).append(r)
    return groups


def cells(r: dict, **extra) -> dict:
    """A candidate or timing record as a table row: tiles as text, * the table's, smem KB, occupancy %."""
    return {**r, "tiles": r["tiles"] if isinstance(r["tiles"], str) else tiles_str(r["tiles"]),
            "cur": "*" if r["current"] else "",
            "smem_KB": (r.get("smem_bytes") or r.get("dynamic_smem_bytes") or 0) / 1024,
            "occ": None if r.get("occupancy") is None else f"{r['occupancy']:.0%}", **extra}


def candidate_record(variant, tiles, current: bool) -> dict:
    return {"family": variant.family, "dtype": variant.dtype, "headdim": variant.headdim,
            "tiles": list(tiles), "name": variant.name, "current": bool(current),
            "threads": variant.launch.threads, "dynamic_smem_bytes": variant.launch.smem_bytes}


def enumerate_candidates(tile_table: str, families, dtypes, headdims, max_per_group: int = 0) -> list[dict]:
    """Legal candidates per (family, dtype, d), the table's tiles first; `max_per_group` > 0
    keeps the first that many of each group."""
    out = []
    for family, dtype, d in product(families, dtypes, headdims):
        current, group = tiles_of(table_variant(tile_table, family, dtype, d)), []
        for tiles in dict.fromkeys([current, *TILE_GRID[family]]):
            try:
                v = make_variant(family, dtype, d, tiles)
            except ValueError:
                continue
            legal = MIN_THREADS <= v.launch.threads <= MAX_THREADS or tiles == current
            if legal and v.launch.smem_bytes <= ARCH_LIMITS[tile_table]["smem_per_block"]:
                group.append(candidate_record(v, tiles, current=(tiles == current)))
        out += group[:max_per_group] if max_per_group > 0 else group
    return out


def source_digests(families=FAMILIES) -> dict:
    """{kernel source: digest (headers included)} of the sources `families` compile."""
    return {s: source_digest(s) for s in sorted({FAMILY_SOURCE[f] for f in families})}


def first_line(text, limit: int = 240) -> str:
    """An NVRTC log's first "error:" line (or the first line): what a table cell can hold."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return ([ln for ln in lines if "error:" in ln.lower()] or lines or [""])[0][:limit]


def _compile(variant, arch: str, gate: bool) -> dict:
    """In a worker: the gate record of `variant` for the table `arch` (gate), or {} once its CUBIN for
    `arch` is in the kernel cache; never raises: {"error": ...}."""
    try:
        if gate:
            return gate_variant(variant, arch)
        cached_cubin(variant.source, [variant.name], arch)
        return {}
    except Exception as exc:  # noqa: BLE001 - reported as the candidate's failure
        return {"error": f"{exc.__class__.__name__}: {exc}"}


def in_processes(fn, args: list, jobs: int, label) -> list:
    """[fn(*a) for a in args] in `jobs` spawned processes (spawn: CUDA may be initialised here), in
    this process with one job or where no pool starts; label(i, result) as each ends."""
    results, jobs = {}, min(jobs, len(args))
    if jobs > 1:
        try:
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
                futures = {ex.submit(fn, *a): i for i, a in enumerate(args)}
                for fut in as_completed(futures):
                    label(futures[fut], results.setdefault(futures[fut], fut.result()))
        except Exception as exc:  # noqa: BLE001 - no worker processes here: one by one
            C.progress(f"process pool unavailable ({exc.__class__.__name__}: {exc}): one by one")
    for i, a in enumerate(args):
        if i not in results:
            label(i, results.setdefault(i, fn(*a)))
    return [results[i] for i in range(len(args))]


def run_gate(cands: list[dict], args) -> list[dict]:
    """Each candidate compiled for the tile table with the ptxas report, shown as a table: the
    gate's fields, occupancy and `error` (None when it passes) added."""
    t = time.monotonic()
    C.progress(f"gating {len(cands)} candidates for {args.tile_table} in {args.jobs} processes")
    jobs = [(make_variant(*group_key(c), c["tiles"]), args.tile_table, True) for c in cands]
    results = in_processes(_compile, jobs, args.jobs, lambda i, r: C.progress(
        f"gate {cands[i]['name']}: {'FAIL' if r.get('error') else 'ok'}"))
    records = []
    for c, r in zip(cands, results):
        rec = {**c, **{k: r.get(k) for k in GATE_KEYS}, "arch": args.tile_table}
        if rec["error"] is not None:
            rec["error"] = first_line(rec["error"])
        else:   # the gate's occupancy (`compile.occupancy`)
            rec.update(blocks_per_sm=r["blocks_per_sm"], warps_per_sm=r["warps_per_sm"],
                       occupancy=round(r["occupancy"], 4), limited_by=r["limited_by"])
        records.append(rec)
    args.gate_seconds = time.monotonic() - t
    shown = [cells(r, spill=None if r.get("spill_stores") is None else r["spill_stores"] + r["spill_loads"],
                   status="ok" if r["error"] is None else "DROP: " + r["error"][:70]) for r in records]
    print(C.table(shown, ["family", "dtype", "headdim", "tiles", "cur", "threads", "registers", "spill",
                          "smem_KB", "blocks_per_sm", "warps_per_sm", "occ", "limited_by", "status"]))
    print(f"# gate: {sum(r['error'] is None for r in records)}/{len(records)} candidates kept for "
          f"{args.tile_table} in {args.gate_seconds:.1f} s ({args.jobs} processes on {os.cpu_count()} "
          f"CPUs; registers from ptxas, occupancy computed, not measured)", flush=True)
    return records


def gflop(family: str, b: int, s: int, h: int, d: int) -> float:
    return 4.0 * b * h * s * s * d * FLOP_FACTOR[family] / 1e9


def plan(cands: list[dict], args) -> list[dict]:
    """One row per (seqlen, candidate), in the order they run (smaller seqlens first)."""
    rows = []
    for s, family, dtype, d in product(args.seqlens, args.families, args.dtypes, args.headdims):
        b, _, h, _ = C.gpu_shape(args.tokens, args.width, s, d)
        rows += [{**c, "seqlen": s, "batch": b, "heads": h, "gflop": gflop(family, b, s, h, d)}
                 for c in cands if group_key(c) == (family, dtype, d)]
    return rows


def estimate_seconds(rows: list[dict], args, gate_count: int = 0) -> dict:
    """A pessimistic runtime estimate on one H100 (see EST_*)."""
    secs = lambda family, g: g / (EST_TFLOPS[family] * 1e3) * EST_SLACK  # noqa: E731
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


def make_ops(tile_table: str, backend: str = "cupy"):
    """A KernelOps (CuPy, or the CPU emulator to test this script) whose variant lookup returns
    the candidate `pin`ned for its (family, dtype, headdim), whose `skip` families' kernels do nothing."""

    class TileOps(KernelOps):
        def __init__(self):
            super().__init__(backend, arch=tile_table)
            # no first-use check: a candidate failing it must not be timed as its fallback
            self.first_use_check, self.pinned, self.skip = False, {}, set()

        def pin(self, variant) -> None:   # added after the table's own, which the lookup still finds
            self._variants.setdefault(variant.name, variant)
            self.pinned[(variant.family, variant.dtype, variant.headdim)] = variant

        def variant(self, family, dtype, headdim):
            base = super().variant(family, dtype, headdim)
            return self.pinned.get((base.family, base.dtype, base.headdim), base)

        def function(self, name):
            skipped = getattr(self._variants.get(name), "family", None) in self.skip
            return (lambda *a, **k: None) if skipped else super().function(name)

    return TileOps()


class Inputs:
    """q, k, v, dout (B, S, H, d) random normal on `ops`, one full non-causal block; out, lse and
    delta (B, S, H) of the backward made once by the forward."""

    def __init__(self, ops, dtype: str, b: int, s: int, h: int, d: int, seed: int = 0):
        self.q, self.k, self.v, self.dout = C.normal(ops.xp, [(b, s, h, d)] * 4, dtype, seed)
        self.scale, self.ops, self._bwd = 1.0 / math.sqrt(d), ops, None
        self.blocks = [Block(0, s, 0, s, 0, 0, False)]

    def step(self, family: str):
        """(one step of `family` as a callable, a callable returning what a check compares): bwd_dq
        runs the deterministic backward with its dK/dV kernel skipped, the rest atomic."""
        ops = self.ops
        ops.deterministic = family == "bwd_dq"
        ops.skip = {"bwd_dkdv_nodq"} if family == "bwd_dq" else set()
        if family in ("forward", "forward_sm90"):
            st = ops.forward_init(self.q, self.scale)
            return (lambda: ops.forward_step(st, self.k, self.v, self.blocks),
                    lambda: {"out": ops.forward_finalize(st, self.q.dtype)[0]})
        if self._bwd is None:
            st = ops.forward_init(self.q, self.scale)
            ops.forward_step(st, self.k, self.v, self.blocks)
            out, lse = ops.forward_finalize(st, self.q.dtype)
            self._bwd = (lse, ops.backward_delta(self.dout, out))
        (lse, delta), ctx = self._bwd, ops.backward_init(self.k, self.v, self.scale)
        dq = ops.xp.zeros(self.q.shape, dtype=np.float32)
        return (lambda: ops.backward_step(ctx, self.q, self.dout, lse, delta, dq, self.blocks),
                lambda: {"dq": dq} if family == "bwd_dq" else {"dq": dq, "dk": ctx.dk, "dv": ctx.dv})


def measure_group(ops, key, seqlen: int, cands: list[dict], inp: Inputs | None, args,
                  deadline: float) -> list[dict]:
    """Check and time every candidate of one (family, dtype, d) at one seqlen; never raises."""
    family, dtype, d = key
    b, s, h, _ = C.gpu_shape(args.tokens, args.width, seqlen, d)
    tol, xp = TOLERANCE.get(dtype, 2e-2), ops.xp

    def run() -> dict:   # one step of the family: {tensor: what it wrote, as float32}
        fn, outputs = inp.step(family)
        fn()
        result = {k: x.astype(np.float32) for k, x in outputs().items()}
        ops.sync()
        return result

    ref, ref_error = None, "no inputs"
    if inp is not None and time.monotonic() <= deadline:
        try:   # the table's own tiles, no pin: the reference every candidate is compared with
            ref = run()
        except Exception as exc:  # noqa: BLE001
            ref_error = f"{exc.__class__.__name__}: {first_line(exc)}"
            C.progress(f"  reference FAILED: {ref_error}")
    rows = []
    for c in cands:
        rows.append(row := {
            "family": family, "dtype": dtype, "headdim": d, "seqlen": s, "batch": b, "heads": h,
            "tiles": tiles_str(c["tiles"]), "current": bool(c["current"]), "name": c["name"],
            "threads": c["threads"], "registers": c.get("registers"),
            "smem_bytes": c.get("smem_bytes") or c.get("dynamic_smem_bytes"), "occupancy": c.get("occupancy"),
            "ms": None, "tflops": None, "check": None, "status": "skipped (budget)"
            if time.monotonic() > deadline else "error: no inputs" if inp is None else "ok"})
        if row["status"] != "ok":
            continue
        try:
            ops.pin(make_variant(family, dtype, d, c["tiles"]))
            result = run()
            if ref is None:
                row["check"] = f"unchecked (no reference: {ref_error})"
            else:   # max |x - table| / max |table| per tensor
                diffs = {}
                for name, want in ref.items():
                    num, den = float(xp.max(xp.abs(result[name] - want))), float(xp.max(xp.abs(want)))
                    diffs[name] = num / den if den > 0 else num
                row["max_rel_diff"], row["max_rel"] = diffs, max(diffs.values())
                bad = [k for k, v in diffs.items() if not v <= tol]
                row["check"] = "ok" if not bad else f"MISMATCH {','.join(bad)} > {tol:g}"
            times = [t * 1e3 for t in C.call_seconds(inp.step(family)[0], args.repeats, args.warmup,
                                                     cuda=ops.backend == "cupy")]
            ms = float(np.median(times))
            row.update(ms=ms, ms_min=min(times), ms_max=max(times), tflops=gflop(family, b, s, h, d) / ms)
        except Exception as exc:  # noqa: BLE001 - one failing candidate must not stop the rest
            row["status"] = f"error: {exc.__class__.__name__}: {first_line(exc, 160)}"
        finally:
            ops.pinned.clear()
        C.progress(f"  {family} {dtype} d={d} S={s} {row['tiles']:>10}{' *' if c['current'] else ''}"
                   f" {row['ms'] or 0:.3g} ms {row['check'] or ''} {row['status']}")
    cur = next((r["ms"] for r in rows if r["current"] and r["ms"]), None)
    for r in rows:
        if cur and r["ms"]:
            r["vs_current"] = cur / r["ms"]
    return rows


def best_summary(rows: list[dict], seqlens) -> list[dict]:
    """Per (family, dtype, d): the candidate with the best geometric-mean speedup over the
    current tiles across the seqlens where both were measured and it passed the check."""
    out, groups = [], by_group(rows)
    for key in sorted(groups, key=lambda k: (FAMILIES.index(k[0]), k[1:])):
        rec = {"family": key[0], "dtype": key[1], "headdim": key[2], "best": None,
               "current": next((r["tiles"] for r in groups[key] if r["current"]), None)}
        per_tiles: dict[str, dict] = {}   # tiles: {seqlen: speedup}
        for r in groups[key]:
            if r.get("vs_current") and r["check"] == "ok":
                per_tiles.setdefault(r["tiles"], {})[r["seqlen"]] = r["vs_current"]
        score = {t: math.exp(sum(map(math.log, p.values())) / len(p)) for t, p in per_tiles.items()}
        if score:
            full = max(map(len, per_tiles.values()))
            best = max((t for t in score if len(per_tiles[t]) == full), key=score.get)
            rec.update(best=best, speedup=score[best],
                       per_seqlen={str(s): per_tiles[best].get(s) for s in seqlens})
        out.append(rec)
    return out


def run_measure(cands: list[dict], args, meta: dict) -> int:
    """Check and time every candidate (module docstring); writes --json and --table."""
    env = C.gpu_versions(args.backend)
    ops = make_ops(args.tile_table, args.backend)
    if args.backend == "cupy":   # every kernel the run launches, compiled in parallel first
        arch = device_arch()
        C.progress(f"device {env['device']} ({arch}), cupy {env.get('cupy')}, nvrtc {env.get('nvrtc')}")
        variants = {}
        for dtype in args.dtypes:   # the table's besides the candidates: references, finalize, delta
            variants.update((v.name, v) for v in [
                *(table_variant(args.tile_table, f, dtype, d) for d in args.headdims
                  for f in dict.fromkeys(("forward", *args.families))),
                *(v for v in ops._variants.values() if v.family == "forward_finalize" and v.dtype == dtype),
                bwd_variants.delta_variant(dtype)])
        for c in cands:
            try:
                v = make_variant(*group_key(c), c["tiles"])
                variants[v.name] = v
            except Exception as exc:  # noqa: BLE001 - reported again when measured
                C.progress(f"  bad candidate {c.get('name')}: {exc}")
        todo = list(variants.values())
        failed = in_processes(_compile, [(v, v.target or arch, False) for v in todo], args.jobs,
                              lambda i, r: r and C.progress(f"  compile FAILED {todo[i].name}: "
                                                            f"{first_line(r['error'])}"))
        C.progress(f"compiled {len(todo)} kernels, {sum(map(bool, failed))} failed")
    deadline, groups = T_START + args.budget, by_group(cands)
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
        for key in product(args.families, args.dtypes, args.headdims):
            if not (grp := groups.get(key)):
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
            ranked = sorted(grp_rows, key=lambda r: (not r["ms"], r["ms"] or 0))   # unmeasured last
            texts.append(f"## {key[0]} {key[1]} d={key[2]} S={s} (B={b}, H={h}; tiles BLOCK_M x BLOCK_N x "
                         f"{'NWARPS' if key[0] == 'forward' else 'WARPS_D'}; * = current table)\n" + C.table(
                             [cells(r, rank=i + 1 if r["ms"] else "-", check=r["check"] or "-",
                                    status=r["status"][:60]) for i, r in enumerate(ranked)],
                             ["rank", "tiles", "cur", "threads", "registers", "occ", "ms", "tflops",
                              "vs_current", "max_rel", "check", "status"]))
            print(texts[-1] + "\n", flush=True)
            dump()
        inputs.clear()
        if args.backend == "cupy":
            import cupy
            ops.sync()
            cupy.get_default_memory_pool().free_all_blocks()
    summary = ["## best tiles per family and head dim (geometric mean over seqlens of "
               "time(current) / time(candidate); only candidates that passed the check)"]
    for b in best_summary(rows, args.seqlens):
        per = ", ".join(f"S={s} {v:.2f}x" for s, v in (b.get("per_seqlen") or {}).items() if v)
        same = " (the current tiles)" if b["best"] == b["current"] else ""
        summary.append(f"{b['family']:9} {b['dtype']:8} d={b['headdim']:<3} current {b['current']}"
                       + (f" -> best {b['best']}{same}: {b['speedup']:.2f}x [{per}]" if b["best"]
                          else ": no measurement"))
    count = lambda f: sum(1 for r in rows if f(r))  # noqa: E731
    summary = "\n".join(summary + [
        f"# {env['device']}: median of {args.repeats}; {count(lambda r: r['ms'])}/{len(rows)} measured, "
        f"{count(lambda r: r['status'].startswith('skipped'))} skipped, "
        f"{count(lambda r: r['status'].startswith('error'))} errors, "
        f"{count(lambda r: (r['check'] or '').startswith('MISMATCH'))} mismatches; "
        f"{time.monotonic() - T_START:.0f} s (estimate {meta['estimate']['total_s']} s)"])
    print(summary, flush=True)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text("\n\n".join(texts) + "\n\n" + summary + "\n")
    dump(final=True)
    return 0


def refresh_current(cands: list[dict], args) -> list[dict]:
    """The table's tiles now marked current, added ungated where missing (the project gates them)."""
    out = []
    for key, grp in by_group(cands).items():
        try:
            v = table_variant(args.tile_table, *key)
        except Exception:  # noqa: BLE001 - a family/head dim the table does not have
            out += grp
            continue
        cur = list(tiles_of(v))
        grp = [{**c, "current": [int(t) for t in c["tiles"]] == cur} for c in grp]
        out += grp if any(c["current"] for c in grp) else [candidate_record(v, cur, current=True), *grp]
    return out


def select(cands: list[dict], args) -> list[dict]:
    """The requested groups' candidates in their order, the table's tiles first, --max-candidates each."""
    out, n = [], args.max_candidates
    for (family, dtype, d), grp in by_group(cands).items():
        if family in args.families and dtype in args.dtypes and d in args.headdims:
            grp = sorted(grp, key=lambda c: not c["current"])   # stable: current tiles lead
            out += grp[:max(n, 0)] if n else grp
    return out


def parse(argv=None) -> argparse.Namespace:
    """The arguments, --families resolved for the tile table (forward_sm90 needs sm_90a)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print candidates and plan; no compile")
    p.add_argument("--gate", action="store_true", help="compile-check on the CPU, write --candidates")
    p.add_argument("--candidates", help="candidate JSON: written by --gate, read by a GPU run")
    p.add_argument("--families", nargs="+", default=None, choices=FAMILIES,
                   help="default: the mma.sync ones; forward_sm90 with --tile-table sm_90a")
    p.add_argument("--dtypes", nargs="+", default=["float16"], choices=["float16", "bfloat16"])
    p.add_argument("--headdims", nargs="+", type=int, default=[64, 128, 256], choices=[32, 64, 96, 128, 256])
    p.add_argument("--seqlens", nargs="+", type=int, default=[4096, 16384])
    for flag, default, what in (("--tokens", 16384, "B x S per configuration"),
                                ("--width", 2048, "H x d per configuration"),
                                ("--max-candidates", 0, "per group; 0: all"), ("--warmup", 2, None),
                                ("--repeats", 10, None),
                                ("--jobs", os.cpu_count() or 1, "compile processes")):
        p.add_argument(flag, type=int, default=default, help=what)
    p.add_argument("--tile-table", default="sm_90", choices=["sm_80", "sm_86", "sm_90", "sm_90a"],
                   help="the table compared against; also the gate's arch and smem limit")
    p.add_argument("--budget", type=float, default=200.0,
                   help="seconds after start past which no new measurement starts")
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
    if args.gate:   # without --candidates: the table's committed file
        committed = {"sm_90": "results/h100/tile_candidates.json",
                     "sm_90a": "results/h200/tile_candidates_sm90a.json"}
        path = args.candidates or str(C.ROOT / "bench" / committed.get(
            args.tile_table, f"out/tile_candidates_{args.tile_table}.json"))
        records = run_gate(enumerated, args)
        try:
            from cuda.bindings import nvrtc
            nvrtc_version = ".".join(map(str, nvrtc.nvrtcVersion()[1:]))
        except Exception:  # noqa: BLE001 - only informative
            nvrtc_version = None
        C.write_json(path, {
            "note": "tile candidates that compile for the arch without spills and fit its smem "
                    "(bench/gpu/tiles.py --gate; registers from ptxas, occupancy computed, not measured)",
            "tile_table": args.tile_table, "arch": args.tile_table, "nvrtc": nvrtc_version,
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
            C.progress(f"{args.candidates} was gated for other kernel sources or another table: gating again")
        else:
            cands, have = data["candidates"], {group_key(c) for c in gated}
            missing = [c for c in enumerated if group_key(c) not in have]
    elif args.candidates:
        C.progress(f"{args.candidates} does not exist: gating here")
    cands, missing = select(refresh_current(cands, args), args), select(missing, args)
    rows = plan(cands + missing, args)
    est = estimate_seconds(rows, args, gate_count=len(missing))
    if args.dry_run:
        shown = [cells(c, gated="yes" if c in cands else "no") for c in cands + missing]
        print(C.table(shown, ["family", "dtype", "headdim", "tiles", "cur", "threads", "registers",
                              "smem_KB", "gated", "name"]))
        print(f"# {len(shown)} candidates ({len(cands)} from {args.candidates}, {len(missing)} to gate)")
    print(f"# estimate on one H100: ~{est['total_s']:.0f} s = startup {est['startup_s']:.0f} "
          f"+ gate {est['gate_s']:.0f} + compile {est['compile_s']:.0f} ({est['kernels']} kernels, "
          f"{EST_GPU_JOBS} processes) + measure {est['measure_s']:.0f} ({est['measurements']} "
          f"measurements x {1 + args.warmup + args.repeats} calls); budget {args.budget:.0f} s")
    cols = ["seqlen", "family", "dtype", "headdim", "batch", "heads", "gflop"]
    counts = Counter(tuple(round(r[c], 1) if c == "gflop" else r[c] for c in cols) for r in rows)
    print(C.table([dict(zip(cols + ["candidates"], (*k, n))) for k, n in counts.items()],
                  cols + ["candidates"]), flush=True)
    if args.dry_run:
        print("# dry run: nothing compiled, nothing timed")
        return 0
    if args.backend == "cupy":
        if (found := device_count())[0] < 1:
            print(f"# no GPU here ({found[1] or 'no CUDA device'}): use --dry-run, --gate, or --backend "
                  f"emulated at tiny sizes", flush=True)
            return 2
    if est["total_s"] > args.budget + 30:
        C.progress(f"WARNING: the estimate ({est['total_s']:.0f} s) exceeds the budget "
                   f"({args.budget:.0f} s): the last measurements will be skipped")
    if missing:
        records = run_gate(missing, args)
        cands = select(cands + [r for r in records if r["error"] is None], args)
    return run_measure(cands, args, {"candidates_file": args.candidates, "estimate": est})


if __name__ == "__main__":
    sys.exit(main())
