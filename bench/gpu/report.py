"""Merge one GPU run's outputs into bench/results/gpu_<device>.json and a Markdown table.

    python bench/gpu/report.py --selftest S.json --kernels K.json [--overlap O.json ...]
                               --out bench/results/gpu_h100

S.json: `python -m burstcu.selftest --full --json` (device, versions, checks); K.json:
`bench/gpu/kernel_speed.py --json` (speed rows); O.json: `bench/gpu/overlap_gpu.py --json`. The JSON written
holds `device`, `versions`, `checks` and `speed` (the kernels rows), plus `overlap` when given;
the .md file is the tables a reader wants: checks by group, and per (pass, dtype, head dim) the
speed against PyTorch's flash backend. Every figure is copied from the inputs: nothing is
estimated here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench.gpu.overlap_gpu import per_step  # noqa: E402


def load(path):
    return json.loads(Path(path).read_text())


def checks_table(checks: list[dict]) -> list[str]:
    groups: dict[str, list] = defaultdict(list)
    for c in checks:
        groups[c["name"].split("/")[0]].append(c["passed"])
    lines = ["| check | passed | failed | skipped |", "| --- | --- | --- | --- |"]
    for name, results in groups.items():
        lines.append(f"| {name} | {results.count(True)} | {results.count(False)} | "
                     f"{results.count(None)} |")
    return lines


def row_key(r: dict, last: str) -> tuple:
    """A kernels row's table key: pass, family ("-" where the run had none), dtype, head dim, and
    `last` ("causal" for the speed table, "seqlen" for the window table)."""
    return (r["pass"], r.get("family") or "-", r["dtype"], r["headdim"], r[last])


def speed_table(rows: list[dict]) -> list[str]:
    """Per (pass, dtype, head dim, causal): burstcu kernels' TFLOP/s and ratio to torch flash
    at each seqlen."""
    ours = [r for r in rows if r.get("impl") == "kernels" and r.get("ms") and r.get("window") is None]
    seqlens = sorted({r["seqlen"] for r in ours})
    lines = ["| pass | family | dtype | d | causal | " + " | ".join(f"S={s}" for s in seqlens) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in seqlens) + " |"]

    def cell(r) -> str:
        if r is None:
            return "-"
        flash = f"{r['vs_torch']:.2f}x" if r.get("vs_torch") else "-"
        if not r.get("cudnn_tflops"):
            return f"{r['tflops']:.0f} TF" + (f" ({flash})" if r.get("vs_torch") else "")
        return f"{r['tflops']:.0f} TF ({flash} / {r['tflops'] / r['cudnn_tflops']:.2f}x)"

    for key in sorted({row_key(r, "causal") for r in ours}):
        cells = [cell(next((x for x in ours if row_key(x, "causal") == key and x["seqlen"] == s), None)) for s in seqlens]
        lines.append("| " + " | ".join(str(k) for k in key) + " | " + " | ".join(cells) + " |")
    return lines


def window_table(rows: list[dict]) -> list[str]:
    """Per (pass, dtype, head dim, seqlen): the kernels' ms under plain causal and each causal
    sliding window (W, 0) of the run (bench/gpu/kernel_speed.py --windows), TFLOP/s over visible pairs."""
    ours = [r for r in rows if r.get("impl") == "kernels" and r.get("ms") and r.get("causal")]
    windows = sorted({r["window"] for r in ours if r.get("window") is not None})
    if not windows:
        return []
    lines = ["| pass | family | dtype | d | S | causal ms | "
             + " | ".join(f"window {w} ms (TFLOP/s)" for w in windows)
             + " |", "| --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in windows) + " |"]

    for key in sorted({row_key(r, "seqlen") for r in ours}):
        at = {r.get("window"): r for r in ours if row_key(r, "seqlen") == key}
        if None not in at:
            continue
        cells = [f"{at[w]['ms']:.2f} ({at[w]['tflops']:.0f})" if w in at else "-" for w in windows]
        lines.append(f"| {' | '.join(str(x) for x in key)} | {at[None]['ms']:.2f} | " + " | ".join(cells) + " |")
    return lines


def _mask(args: dict) -> str:
    """How an overlap run masked: "full", "causal zigzag", "causal contiguous, window (4096, 0)"."""
    text = f"causal {args.get('layout', 'zigzag')}" if args.get("causal") == "True" else "full"
    window = args.get("window")
    return text if window in (None, "[-1, -1]") else f"{text}, window {window}"


def overlap_table(runs: list[dict]) -> list[str]:
    lines = ["| mask | ranks | seqlen | strategy | fwd ms (compute / comm / both) | fwd eff | "
             "bwd ms (compute / comm / both) | bwd eff | both - compute, fwd+bwd | copies ms | hidden |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        mask = _mask(run.get("args", {}))
        for r in run["rows"]:
            f = " / ".join(f"{r[f'forward_{m}_ms']:.2f}" for m in ("compute", "comm", "overlapped"))
            b = " / ".join(f"{r[f'backward_{m}_ms']:.2f}" for m in ("compute", "comm", "overlapped"))
            eff = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            extra = sum(r[f"{p}_overlapped_ms"] - r[f"{p}_compute_ms"] for p in ("forward", "backward"))
            base = r["forward_compute_ms"] + r["backward_compute_ms"]
            copies = r.get("copy_ms")
            if copies is None and r.get("timeline"):  # older runs: from the recorded intervals
                copies = sorted(sum(x[-1] - x[-2] for x in tl if x[0] == "comm")
                                for tl in r["timeline"])[len(r["timeline"]) // 2]
            lines.append(f"| {mask} | {r['ranks']} | {r['seqlen']} | {r['strategy']} | {f} | "
                         f"{eff(r['forward_efficiency'])} | {b} | {eff(r['backward_efficiency'])} | "
                         f"{extra:+.2f} ({100 * extra / base:+.0f}%) | {eff(copies)} | "
                         f"{eff(r['hidden'])} |")
    return lines


def step_tables(runs: list[dict]) -> list[str]:
    """Per ring step of the largest burst configuration of each run, from its recorded
    intervals (bench/gpu/overlap_gpu.py's per-step medians over ranks)."""
    lines = []
    for run in runs:
        burst = [r for r in run["rows"] if r["strategy"] == "burst" and r.get("timeline")]
        if not burst or len(burst[0]["timeline"][0][0]) != 4:  # older runs carry no labels
            continue
        big = max(burst, key=lambda r: (r["ranks"], r["seqlen"]))
        lines += [f"Per step, burst, {big['ranks']} ranks, S = {big['seqlen']}, "
                  f"{_mask(run.get('args', {}))} (median over ranks):", "",
                  "| step | compute ms | copy ms | hidden |", "| --- | --- | --- | --- |"]
        for row in per_step(big["timeline"]):
            hidden = "-" if row["hidden"] is None else f"{row['hidden']:.2f}"
            lines.append(f"| {row['step']} | {row['compute_ms']:.2f} | {row['copy_ms']:.2f} | {hidden} |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--selftest", required=True)
    p.add_argument("--kernels", required=True)
    p.add_argument("--overlap", nargs="*", default=[])
    p.add_argument("--out", required=True, help="path without suffix: writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    selftest, kernels = load(args.selftest), load(args.kernels)
    overlap = [load(o) for o in args.overlap]
    versions = {**kernels.get("versions", {}), **{k: v for k, v in selftest["versions"].items()
                                                  if v is not None}}
    report = {"device": selftest["device"], "versions": versions,
              "summary": selftest["summary"], "checks": selftest["checks"],
              "speed": kernels["rows"], "speed_args": kernels.get("args"),
              "overlap": [{"args": o.get("args"), "rows": [{k: v for k, v in r.items()
                                                            if k != "timeline"} for r in o["rows"]]}
                          for o in overlap]}
    md_overlap = overlap_table(overlap) if overlap else []
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    v = versions
    md = [f"# burstcu on {selftest['device']} (measured)", "",
          f"CuPy {v.get('cupy')}, NVRTC {v.get('nvrtc')}, NCCL {v.get('nccl')}, driver "
          f"{v.get('driver')}, CUDA runtime {v.get('cuda_runtime')}, PyTorch {v.get('torch')}.", "",
          f"## `python -m burstcu.selftest --full`: {selftest['summary']}", "",
          *checks_table(selftest["checks"]), "",
          "## Speed, one GPU, one rank (`bench/gpu/kernel_speed.py`): burstcu's step kernels, TFLOP/s and "
          "(in brackets) speed relative to `scaled_dot_product_attention`'s flash backend, then to its "
          "cuDNN backend where the run timed it; family: sm90 = the Hopper kernel "
          "(kernels/flash_fwd_sm90.cu), sm80 = the mma.sync one; CUDA events, same run", "", *speed_table(kernels["rows"]), ""]
    windowed = window_table(kernels["rows"])
    if windowed:
        md += ["## Causal sliding windows (`bench/gpu/kernel_speed.py --windows`): the same kernels skip the "
               "key tiles outside the window; TFLOP/s counts the visible pairs only", "", *windowed, ""]
    if overlap:
        md += ["## Overlap on ONE GPU shared by G ranks (`bench/gpu/overlap_gpu.py`, loopback "
               "transport: copies through HBM, not NVLink; read as schedule behaviour, not scaling)",
               "", "`eff` is near 1 by construction when copies are cheap (see overlap_gpu.py); "
               "`both - compute` is what running the copies added to the compute-only passes, "
               "`copies ms` their device time, `hidden` the fraction of it during which the same "
               "rank's kernels ran.", "", *md_overlap, "", *step_tables(overlap)]
    Path(args.out + ".md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
