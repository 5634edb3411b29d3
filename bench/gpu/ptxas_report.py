"""Registers, shared memory and the theoretical occupancy they allow, per kernel variant.

    python bench/gpu/ptxas_report.py [--arch sm_80,sm_86,sm_90] [--family forward,...]
                                 [--from-json gate.json] [--json OUT] [--md OUT]

Runs the compile gate (NVRTC + ptxas -v, no GPU needed) or reads a gate JSON written by
``python -m burstcu.build check --json``, and reports for each variant the blocks per SM and the
occupancy (resident warps / the SM's maximum) that its registers, shared memory and block size
allow on an A100 (sm_80), an RTX 3090/4090 or L40S (the "sm_86" table: cc 8.6/8.9, also used for
cc 12.x) and an H100 (sm_90). These numbers are COMPUTED FROM THE PTXAS REPORT with the CUDA
occupancy rules; they are not measured, and occupancy is not throughput.

Rules (CUDA programming guide, compute capability 8.0 / 8.6 / 9.0): 64K 32-bit registers per SM,
allocated per warp in units of 256; shared memory per SM 164 KB (sm_80) / 100 KB (sm_86) / 228 KB
(sm_90) with 1 KB reserved per resident block; at most 2048 threads (64 warps) and 32 blocks per
SM on sm_80/sm_90, 1536 threads (48 warps) and 16 blocks on sm_86 (cc 8.9: 24 blocks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from burstcu.build.compile import ARCH_LIMITS  # noqa: E402

REG_ALLOC_UNIT = 256        # registers per warp are allocated in multiples of this
SMEM_RESERVED_PER_BLOCK = 1024


def occupancy(record: dict, arch: str | None = None) -> dict:
    """Blocks per SM allowed by each resource, the binding one, and the warp occupancy.

    record: a gate record (registers, threads, smem_bytes). arch: the limits to use (default:
    the record's own arch).
    """
    lim = ARCH_LIMITS[arch or record["arch"]]
    warps = -(-record["threads"] // 32)
    regs_per_warp = -(-record["registers"] * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by = {
        "regs": (lim["regs_per_sm"] // regs_per_warp) // warps if regs_per_warp else lim["blocks_per_sm"],
        "smem": (lim["smem_per_sm"] // (record["smem_bytes"] + SMEM_RESERVED_PER_BLOCK)),
        "threads": lim["threads_per_sm"] // record["threads"],
        "blocks": lim["blocks_per_sm"],
    }
    blocks = min(by.values())
    limiter = min(by, key=lambda k: by[k])
    return {"blocks_per_sm": blocks, "limited_by": limiter, "warps_per_sm": blocks * warps,
            "occupancy": blocks * warps / (lim["threads_per_sm"] // 32), "by_resource": by}


def gate_records(archs: list[str], families: list[str] | None, from_json: str | None) -> list[dict]:
    if from_json:
        records = json.loads(Path(from_json).read_text())
        records = [r for r in records if r["arch"] in archs and (not families or r["family"] in families)]
    else:
        import io

        from burstcu.build.__main__ import run_check

        records = run_check(archs, families, out=io.StringIO())
    bad = [r for r in records if r.get("error")]
    if bad:
        raise SystemExit(f"{len(bad)} variants fail the gate, e.g. {bad[0]['arch']} {bad[0]['name']}: "
                         f"{bad[0]['error'][:400]}")
    return records


def markdown(rows: list[dict]) -> str:
    head = ("| arch | GPU | family | dtype | d | threads | regs | smem KB | blocks/SM | warps/SM "
            "| occupancy | limited by | variant |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|\n")
    body = "".join(
        f"| {r['arch']} | {ARCH_LIMITS[r['arch']]['gpu']} | {r['family']} | {r['dtype']} | {r['headdim']} "
        f"| {r['threads']} | {r['registers']} | {r['smem_bytes'] / 1024:.1f} | {r['blocks_per_sm']} "
        f"| {r['warps_per_sm']} | {r['occupancy']:.0%} | {r['limited_by']} | `{r['name']}` |\n"
        for r in rows)
    note = ("\nTheoretical occupancy computed from the ptxas resource report (registers, smem) with "
            "the CUDA occupancy rules; not measured on a GPU.\n")
    return head + body + note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="sm_80,sm_86,sm_90")
    parser.add_argument("--family", default="", help="only these families (comma-separated)")
    parser.add_argument("--from-json", help="a gate JSON to read instead of compiling")
    parser.add_argument("--json", dest="json_out", default="bench/out/ptxas_report.json")
    parser.add_argument("--md", dest="md_out", default="bench/out/ptxas_report.md")
    args = parser.parse_args(argv)
    archs = [a for a in args.arch.split(",") if a]
    families = [f for f in args.family.split(",") if f] or None

    rows = [{**r, **occupancy(r)} for r in gate_records(archs, families, args.from_json)]
    print("theoretical occupancy from ptxas (not measured)")
    print(f"{'arch':5} {'family':16} {'dtype':8} {'d':>3} {'thr':>4} {'regs':>4} {'smemKB':>7} "
          f"{'blk/SM':>6} {'occ':>5} {'limit':7} name")
    for r in rows:
        print(f"{r['arch']:5} {r['family']:16} {r['dtype']:8} {r['headdim']:3} {r['threads']:4} "
              f"{r['registers']:4} {r['smem_bytes'] / 1024:7.1f} {r['blocks_per_sm']:6} "
              f"{r['occupancy']:5.0%} {r['limited_by']:7} {r['name']}")
    for path, text in ((args.json_out, json.dumps(
            {"note": "theoretical occupancy computed from ptxas, not measured", "rows": rows}, indent=1)),
            (args.md_out, markdown(rows))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
