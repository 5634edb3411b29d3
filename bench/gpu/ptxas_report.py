"""Registers, shared memory and the theoretical occupancy they allow, per kernel variant: runs the
compile gate (NVRTC + ptxas -v, no GPU) or reads a gate JSON (`python -m burstcu.build check
--json`) and applies the CUDA occupancy rules (64K registers an SM allocated per warp in units of
256, the arch's shared memory an SM with 1 KB reserved a block, its threads and blocks an SM;
`burstcu.build.compile.ARCH_LIMITS`). COMPUTED from the ptxas report, not measured.

    python bench/gpu/ptxas_report.py [--arch sm_80,sm_86,sm_90] [--family forward,...]
        [--from-json gate.json] [--json OUT] [--md OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from burstcu.build.compile import ARCH_LIMITS  # noqa: E402

COLUMNS = ("arch", "family", "dtype", "headdim", "threads", "registers", "smem KB", "blocks/SM",
           "warps/SM", "occupancy", "limited by", "name")


def occupancy(record: dict, arch: str | None = None) -> dict:
    """Blocks per SM each resource allows, the binding one and the warp occupancy of a gate
    record (registers, threads, smem_bytes) on `arch` (default: the record's)."""
    lim = ARCH_LIMITS[arch or record["arch"]]
    warps = -(-record["threads"] // 32)
    regs_per_warp = -(-record["registers"] * 32 // 256) * 256
    by = {"regs": (lim["regs_per_sm"] // regs_per_warp) // warps if regs_per_warp else lim["blocks_per_sm"],
          "smem": lim["smem_per_sm"] // (record["smem_bytes"] + 1024),
          "threads": lim["threads_per_sm"] // record["threads"], "blocks": lim["blocks_per_sm"]}
    blocks = min(by.values())
    return {"blocks_per_sm": blocks, "limited_by": min(by, key=by.get), "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps / (lim["threads_per_sm"] // 32), "by_resource": by}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_80,sm_86,sm_90")
    p.add_argument("--family", default="", help="only these families (comma-separated)")
    p.add_argument("--from-json", help="a gate JSON to read instead of compiling")
    p.add_argument("--json", default="bench/out/ptxas_report.json")
    p.add_argument("--md", default="bench/out/ptxas_report.md")
    args = p.parse_args(argv)
    archs, families = [a for a in args.arch.split(",") if a], [f for f in args.family.split(",") if f]
    if args.from_json:
        records = [r for r in json.loads(Path(args.from_json).read_text())
                   if r["arch"] in archs and (not families or r["family"] in families)]
    else:
        import io
        from burstcu.build.__main__ import run_check
        records = run_check(archs, families or None, out=io.StringIO())
    bad = [r for r in records if r.get("error")]
    if bad:
        raise SystemExit(f"{len(bad)} variants fail the gate, e.g. {bad[0]['arch']} {bad[0]['name']}: "
                         f"{bad[0]['error'][:400]}")
    rows = [{**r, **occupancy(r)} for r in records]
    cells = [(r["arch"], r["family"], r["dtype"], r["headdim"], r["threads"], r["registers"],
              f"{r['smem_bytes'] / 1024:.1f}", r["blocks_per_sm"], r["warps_per_sm"],
              f"{r['occupancy']:.0%}", r["limited_by"], f"`{r['name']}`") for r in rows]
    print("theoretical occupancy from ptxas (not measured)")
    print("\n".join(" ".join(str(c) for c in row) for row in cells))
    md = ("| GPU | " + " | ".join(COLUMNS) + " |\n|" + "---|" * (len(COLUMNS) + 1) + "\n"
          + "".join(f"| {ARCH_LIMITS[row[0]]['gpu']} | " + " | ".join(map(str, row)) + " |\n"
                    for row in cells)
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
