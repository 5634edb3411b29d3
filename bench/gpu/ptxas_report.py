"""Registers, shared memory and the theoretical occupancy they allow, per kernel variant, from the
compile gate (NVRTC + ptxas -v, no GPU) or its JSON (`python -m burstcu.build check --json`) by the
CUDA occupancy rules: COMPUTED from the ptxas report, not measured.

    python bench/gpu/ptxas_report.py [--arch sm_80,sm_86,sm_90] [--family forward,...]
        [--from-json gate.json] [--json OUT] [--md OUT]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from burstcu.build.compile import ARCH_LIMITS  # noqa: E402

COLUMNS = ("GPU", "arch", "family", "dtype", "headdim", "threads", "registers", "smem KB", "blocks/SM",
           "warps/SM", "occupancy", "limited by", "name")


def occupancy(record: dict) -> dict:
    """Blocks per SM each resource allows a gate record (registers, threads, smem_bytes) on its arch
    (`ARCH_LIMITS`: registers allocated per warp in units of 256, 1 KB of shared memory reserved a
    block), the binding one and the warp occupancy."""
    lim, warps = ARCH_LIMITS[record["arch"]], -(-record["threads"] // 32)
    regs_per_warp = -(-record["registers"] * 32 // 256) * 256
    by = {"regs": (lim["regs_per_sm"] // regs_per_warp) // warps if regs_per_warp else lim["blocks_per_sm"],
          "smem": lim["smem_per_sm"] // (record["smem_bytes"] + 1024),
          "threads": lim["threads_per_sm"] // record["threads"], "blocks": lim["blocks_per_sm"]}
    blocks = min(by.values())
    return {"blocks_per_sm": blocks, "limited_by": min(by, key=by.get), "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps / (lim["threads_per_sm"] // 32), "by_resource": by}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default, text in (("--arch", "sm_80,sm_86,sm_90", "tile tables (comma-separated)"),
                                ("--family", "", "only these families (comma-separated)"),
                                ("--from-json", None, "a gate JSON to read instead of compiling"),
                                ("--json", "bench/out/ptxas_report.json", None),
                                ("--md", "bench/out/ptxas_report.md", None)):
        p.add_argument(flag, default=default, help=text)
    args = p.parse_args(argv)
    archs, families = [a for a in args.arch.split(",") if a], [f for f in args.family.split(",") if f]
    if args.from_json:
        records = [r for r in json.loads(Path(args.from_json).read_text())
                   if r["arch"] in archs and (not families or r["family"] in families)]
    else:
        from burstcu.build.__main__ import run_check
        records = run_check(archs, families or None, out=io.StringIO())
    if bad := [r for r in records if r.get("error")]:
        raise SystemExit(f"{len(bad)} variants fail the gate, e.g. {bad[0]['arch']} {bad[0]['name']}: "
                         f"{bad[0]['error'][:400]}")
    rows = [{**r, **occupancy(r)} for r in records]
    cells = [(ARCH_LIMITS[r["arch"]]["gpu"], r["arch"], r["family"], r["dtype"], r["headdim"], r["threads"],
              r["registers"], f"{r['smem_bytes'] / 1024:.1f}", r["blocks_per_sm"], r["warps_per_sm"],
              f"{r['occupancy']:.0%}", r["limited_by"], f"`{r['name']}`") for r in rows]
    print("theoretical occupancy from ptxas (not measured)")
    print("\n".join(" ".join(map(str, c[1:])) for c in cells))
    md = ("".join(f"| {' | '.join(map(str, c))} |\n" for c in [COLUMNS, ("---",) * len(COLUMNS), *cells])
          + "\nTheoretical occupancy computed from the ptxas resource report (registers, smem) with "
            "the CUDA occupancy rules; not measured on a GPU.\n")
    note = "theoretical occupancy computed from ptxas, not measured"
    for path, text in ((args.json, json.dumps({"note": note, "rows": rows}, indent=1)), (args.md, md)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
