"""Merge one GPU run's outputs into bench/results/gpu_<device>.json and a Markdown table: the
selftest's checks by group, the kernels' speed against PyTorch's flash (and cuDNN) backend per
(pass, family, dtype, head dim, causal), causal sliding windows, and the overlap runs with their
per-step tables. Every figure is copied from the inputs: nothing is estimated here.

    python bench/gpu/report.py --selftest S.json --kernels K.json [K2.json ...] [--overlap O.json ...]
                               --out bench/results/gpu_h100

S.json: `python -m burstcu.selftest --full --json`; K.json: `bench/gpu/kernel_speed.py --json` (several:
their rows together, e.g. a forward run and a fwd+bwd run);
O.json: `bench/gpu/overlap_gpu.py --json`. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench.gpu.overlap_gpu import per_step  # noqa: E402


def md_table(head: list, rows: list) -> list[str]:
    """A Markdown table's lines: the header, its rule, one line per row of cells."""
    return ["| " + " | ".join(map(str, r)) + " |" for r in [head, ["---"] * len(head), *rows]]


def cell(v) -> str:
    """A table cell: `v` to two decimal places, "-" for None."""
    return "-" if v is None else f"{v:.2f}"


def row_key(r: dict, last: str) -> tuple:
    """A kernels row's key: pass, family ("-" where the run had none; a backward row's dQ mode
    beside it, "sm90 deterministic", and "(own dQ pass)" where the atomic mode ran one), dtype,
    head dim, `last`."""
    family = r.get("family") or "-"
    if "bwd" in r["pass"] and r.get("dq"):
        own = r["dq"] == "atomic" and r.get("dq_pass") == "own"
        family += f" {r['dq']}" + (" (own dQ pass)" if own else "")
    return (r["pass"], family, r["dtype"], r["headdim"], r[last])


def speed_cell(r) -> str:
    """TFLOP/s and (in brackets) the ratio to torch flash, then to cuDNN where the run timed it."""
    if r is None:
        return "-"
    flash = f"{r['vs_torch']:.2f}x" if r.get("vs_torch") else "-"
    if not r.get("cudnn_tflops"):
        return f"{r['tflops']:.0f} TF" + (f" ({flash})" if r.get("vs_torch") else "")
    return f"{r['tflops']:.0f} TF ({flash} / {r['tflops'] / r['cudnn_tflops']:.2f}x)"


def speed_tables(rows: list[dict]) -> tuple[list[str], list[str]]:
    """The kernels' cells per (pass, family, dtype, d, causal) and seqlen; per (pass, family,
    dtype, d, S) their ms under plain causal and each causal window (W, 0) (none: no lines)."""
    ours = [r for r in rows if r.get("impl") == "kernels" and r.get("ms")]
    plain = [r for r in ours if r.get("window") is None]
    seqlens = sorted({r["seqlen"] for r in plain})
    at = {(row_key(r, "causal"), r["seqlen"]): r for r in reversed(plain)}   # the first row wins
    speed = md_table(["pass", "family", "dtype", "d", "causal", *(f"S={s}" for s in seqlens)],
                     [[*key, *(speed_cell(at.get((key, s))) for s in seqlens)]
                      for key in sorted({row_key(r, "causal") for r in plain})])
    causal = [r for r in ours if r.get("causal")]
    windows, lines = sorted({r["window"] for r in causal if r.get("window") is not None}), []
    for key in sorted({row_key(r, "seqlen") for r in causal}) if windows else []:
        at = {r.get("window"): r for r in causal if row_key(r, "seqlen") == key}
        if None in at:
            lines.append([*key, cell(at[None]["ms"]), *(f"{at[w]['ms']:.2f} ({at[w]['tflops']:.0f})"
                                                      if w in at else "-" for w in windows)])
    return speed, md_table(["pass", "family", "dtype", "d", "S", "causal ms",
                            *(f"window {w} ms (TFLOP/s)" for w in windows)], lines) if windows else []


def mask_text(args: dict) -> str:
    """How an overlap run masked: "full", "causal zigzag", "causal contiguous, window (4096, 0)"."""
    text = f"causal {args.get('layout', 'zigzag')}" if args.get("causal") == "True" else "full"
    window = args.get("window")
    return text if window in (None, "[-1, -1]") else f"{text}, window {window}"


def overlap_tables(runs: list[dict]) -> list[str]:
    """A row a configuration of every run, then per ring step of each run's largest burst
    configuration (overlap_gpu.py's `per_step`)."""
    lines, steps = [], []
    for run in runs:
        mask = mask_text(run.get("args", {}))
        for r in run["rows"]:
            times = {p: " / ".join(cell(r[f"{p}_{m}_ms"]) for m in ("compute", "comm", "overlapped"))
                     for p in ("forward", "backward")}
            extra = sum(r[f"{p}_overlapped_ms"] - r[f"{p}_compute_ms"] for p in ("forward", "backward"))
            base = r["forward_compute_ms"] + r["backward_compute_ms"]
            lines.append([mask, r["ranks"], r["seqlen"], r["strategy"], times["forward"],
                          cell(r["forward_efficiency"]), times["backward"], cell(r["backward_efficiency"]),
                          f"{extra:+.2f} ({100 * extra / base:+.0f}%)", cell(r["copy_ms"]),
                          cell(r["hidden"])])
        burst = [r for r in run["rows"] if r["strategy"] == "burst" and r.get("timeline")]
        if burst:
            big = max(burst, key=lambda r: (r["ranks"], r["seqlen"]))
            by_step = [[s["step"], cell(s["compute_ms"]), cell(s["copy_ms"]), cell(s["hidden"])]
                       for s in per_step(big["timeline"])]
            title = f"Per step, burst, {big['ranks']} ranks, S = {big['seqlen']}, {mask} (median over ranks):"
            steps += [title, "", *md_table(["step", "compute ms", "copy ms", "hidden"], by_step), ""]
    return md_table(["mask", "ranks", "seqlen", "strategy", "fwd ms (compute / comm / both)", "fwd eff",
                     "bwd ms (compute / comm / both)", "bwd eff", "both - compute, fwd+bwd",
                     "copies ms", "hidden"], lines) + ["", *steps]


def checks_table(checks: list[dict]) -> list[str]:
    groups: dict[str, list] = defaultdict(list)
    for c in checks:
        groups[c["name"].split("/")[0]].append(c["passed"])
    return md_table(["check", "passed", "failed", "skipped"],
                    [[name, r.count(True), r.count(False), r.count(None)] for name, r in groups.items()])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--selftest", required=True)
    p.add_argument("--kernels", required=True, nargs="+")
    p.add_argument("--overlap", nargs="*", default=[])
    p.add_argument("--out", required=True, help="path without suffix: writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    selftest = json.loads(Path(args.selftest).read_text())
    runs_of_kernels = [json.loads(Path(f).read_text()) for f in args.kernels]
    kernels = {"versions": {k: x for run in runs_of_kernels for k, x in run.get("versions", {}).items()},
               "rows": [r for run in runs_of_kernels for r in run["rows"]],
               "args": [run.get("args") for run in runs_of_kernels]}
    overlap = [json.loads(Path(f).read_text()) for f in args.overlap]
    v = {**kernels.get("versions", {}), **{k: x for k, x in selftest["versions"].items() if x is not None}}
    runs = [{"args": o.get("args"), "rows": [{k: x for k, x in r.items() if k != "timeline"}
                                             for r in o["rows"]]} for o in overlap]
    Path(args.out + ".json").write_text(json.dumps({
        "device": selftest["device"], "versions": v, "summary": selftest["summary"],
        "checks": selftest["checks"], "speed": kernels["rows"], "speed_args": kernels.get("args"),
        "overlap": runs}, indent=1) + "\n")
    speed, windowed = speed_tables(kernels["rows"])
    md = [f"# burstcu on {selftest['device']} (measured)", "",
          f"CuPy {v.get('cupy')}, NVRTC {v.get('nvrtc')}, NCCL {v.get('nccl')}, driver "
          f"{v.get('driver')}, CUDA runtime {v.get('cuda_runtime')}, PyTorch {v.get('torch')}.", "",
          f"## `python -m burstcu.selftest --full`: {selftest['summary']}", "",
          *checks_table(selftest["checks"]), "",
          "## Speed, one GPU, one rank (`bench/gpu/kernel_speed.py`): burstcu's step kernels, TFLOP/s and "
          "(in brackets) speed relative to `scaled_dot_product_attention`'s flash backend, then to its "
          "cuDNN backend where the run timed it; family: sm90 = the Hopper kernel "
          "(kernels/flash_fwd_sm90.cu; in fwd+bwd rows also kernels/flash_bwd_sm90.cu's dK/dV, beside the "
          "dQ mode), sm80 = the mma.sync one; CUDA events, same run", "", *speed, ""]
    if windowed:
        md += ["## Causal sliding windows (`bench/gpu/kernel_speed.py --windows`): the same kernels skip the "
               "key tiles outside the window; TFLOP/s counts the visible pairs only", "", *windowed, ""]
    if overlap:
        md += ["## Overlap on ONE GPU shared by G ranks (`bench/gpu/overlap_gpu.py`, loopback "
               "transport: copies through HBM, not NVLink; read as schedule behaviour, not scaling)",
               "", "`eff` is near 1 by construction when copies are cheap (see overlap_gpu.py); "
               "`both - compute` is what running the copies added to the compute-only passes, "
               "`copies ms` their device time, `hidden` the fraction of it during which the same "
               "rank's kernels ran.", "", *overlap_tables(overlap)]
    Path(args.out + ".md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
