"""bench/local_cpu.py for two versions of burstcu, in alternating processes: this tree ("after")
and another checkout ("before"), so that the comparison, and each against torch, comes from one
stretch of time on one machine.

    python bench/local_cpu_ab.py --before-tree DIR [--runs 4] [--out PREFIX]
                                 [--idle 0.95] [-- ARGS for local_cpu.py, e.g. --repeats 7]

DIR: a checkout of the version to compare with (`git worktree add DIR REV`); each of its runs
executes DIR's own bench/local_cpu.py with DIR first on PYTHONPATH and DIR as the working
directory (relative paths in ARGS resolve there). Needs torch (the cells are ratios to its
SDPA). Runs come in pairs, before then after, after then before, and so on; each starts once
the machine has been idle (the aggregate CPU line of /proc/stat at least --idle idle over
6 s; at most 120 s of waiting, then it starts anyway and says so; --idle 0: no waiting).
Every run's output is kept verbatim, and each tree's commit (with "+changes" when its work
tree differs from it) is recorded.

Writes PREFIX.txt (the summary table, then every run verbatim), PREFIX.json (command, summary,
runs, before_runs: each run's own JSON) and PREFIX.png (each configuration's burstcu / torch
time, after against before). Summary cells: burstcu time / torch time of the same run (the
`time_vs_torch` column of local_cpu.py); median, min, max over the runs of this tree;
before_median over the other's; floor_median, this tree's median `floor_vs_torch` (its own
matmuls and exps alone against torch's time); after_s, before_s: the median of each tree's burstcu seconds
(runs alternate, so these compare the two trees directly). Progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from _common import ROOT, median, progress, table, write_json  # noqa: I001 - sets sys.path

KEY = ("threads", "seqlen", "mask", "pass")


def cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs so far (/proc/stat)."""
    with open("/proc/stat") as fh:
        fields = [int(x) for x in fh.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)   # idle + iowait


def wait_until_idle(share: float, window: float = 6.0, limit: float = 120.0) -> bool:
    """Wait until the CPUs were idle at least `share` of a `window`-second span; False if that
    did not happen within `limit` seconds (the run then starts anyway)."""
    if share <= 0 or not os.path.exists("/proc/stat"):
        return True
    start = time.monotonic()
    while time.monotonic() - start < limit:
        idle0, total0 = cpu_times()
        time.sleep(window)
        idle1, total1 = cpu_times()
        if total1 > total0 and (idle1 - idle0) / (total1 - total0) >= share:
            return True
    return False


def one_run(tree: Path, extra: list[str], idle: float) -> tuple[str, dict, str]:
    """(stdout, its JSON, start time) of one local_cpu.py run from `tree`."""
    quiet = wait_until_idle(idle)
    started = datetime.now().isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(tree)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
        proc = subprocess.run([sys.executable, str(tree / "bench" / "local_cpu.py"), *extra,
                               "--json", str(out)], env=env, cwd=tree, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            sys.exit(f"local_cpu.py in {tree} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    if not burstcu_column(result, "time_vs_torch"):
        sys.exit("local_cpu.py measured no torch SDPA (torch not installed?): nothing to compare")
    if not quiet:
        started += " (the machine was not idle when it started)"
    return proc.stdout, result, started


def burstcu_column(run: dict, name: str) -> dict:
    """{(threads, seqlen, mask, pass): burstcu's `name`} of one run's JSON, where it has one:
    time_vs_torch (the ratio to torch), seconds, floor_vs_torch (none from a local_cpu.py that
    did not measure floors)."""
    return {tuple(r[k] for k in KEY): r[name] for r in run["results"]
            if r["impl"] == "burstcu" and r.get(name) is not None}


def summarize(after: list[dict], before: list[dict]) -> list[dict]:
    """One row per configuration the runs share: median / min / max of this tree's ratios, the
    other's median, this tree's median floor_vs_torch (None without floors), and each tree's
    median burstcu seconds."""
    rows = []
    col = {name: [burstcu_column(r, name) for r in after] for name in ("time_vs_torch", "seconds", "floor_vs_torch")}
    theirs_col = {name: [burstcu_column(r, name) for r in before] for name in ("time_vs_torch", "seconds")}
    keys = [key for key in col["time_vs_torch"][0]
            if all(key in c for c in col["time_vs_torch"] + theirs_col["time_vs_torch"])]
    for key in keys:
        mine, theirs = [c[key] for c in col["time_vs_torch"]], [c[key] for c in theirs_col["time_vs_torch"]]
        floor = [c[key] for c in col["floor_vs_torch"] if key in c]
        rows.append({**dict(zip(KEY, key)), "median": median(mine), "min": min(mine),
                     "max": max(mine), "before_median": median(theirs),
                     "floor_median": median(floor) if floor else None,
                     "after_s": median([c[key] for c in col["seconds"]]),
                     "before_s": median([c[key] for c in theirs_col["seconds"]]),
                     "runs": " ".join(f"{x:.2f}" for x in mine),
                     "before_runs": " ".join(f"{x:.2f}" for x in theirs)})
    return rows


def revision(tree: Path) -> str:
    """The tree's commit, with "+changes" when its tracked files differ from it ("?" outside git)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "?"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+changes" if dirty else "")


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = [f"{r['threads']}t {r['seqlen']} {r['mask']} {'fwd' if r['pass'] == 'forward' else 'bwd'}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(rows)), 4))
    ax.plot(xs, [r["before_median"] for r in rows], "o", color="0.6", label="before (median)")
    ax.errorbar(xs, [r["median"] for r in rows],
                yerr=[[r["median"] - r["min"] for r in rows], [r["max"] - r["median"] for r in rows]],
                fmt="s", color="C0", capsize=3, label="after (median, min-max)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("burstcu time / torch SDPA time")
    ax.set_title("one rank on the CPU, float32 (runs alternating after / before)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description="local_cpu.py for this tree and another, alternating")
    p.add_argument("--before-tree", required=True, type=Path)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--idle", type=float, default=0.95)
    p.add_argument("--out", default="bench/out/local_cpu_ab")
    args = p.parse_args(own)
    trees = {"after": ROOT, "before": args.before_tree.resolve()}
    if not (trees["before"] / "bench" / "local_cpu.py").exists():
        p.error(f"{trees['before']} has no bench/local_cpu.py")
    got: dict[str, list] = {"after": [], "before": []}
    for i in range(args.runs):
        for label in ("before", "after") if i % 2 == 0 else ("after", "before"):
            progress(f"run {i + 1} of {args.runs}, {label} ({trees[label]})")
            got[label].append(one_run(trees[label], extra, args.idle))
    rows = summarize([r for _, r, _ in got["after"]], [r for _, r, _ in got["before"]])
    command = "python bench/local_cpu.py " + " ".join(extra)
    revs = {label: revision(tree) for label, tree in trees.items()}
    head = [f"# each run: {command}",
            f"# {args.runs} runs of each tree in alternating pairs; after = {trees['after']} "
            f"({revs['after']}), before = {trees['before']} ({revs['before']})",
            "# cells: burstcu time / torch time of the same run; median, min, max over this "
            "tree's runs, before_median over the other's; floor_median: this tree's floor_vs_torch "
            "(its matmuls and exps alone against torch's time); after_s, before_s: median burstcu seconds",
            "", table(rows, ["threads", "seqlen", "mask", "pass", "median", "min", "max",
                             "before_median", "floor_median", "after_s", "before_s", "runs", "before_runs"])]
    lines = head + [""]
    for label, name in (("after", "this tree"), ("before", "the tree before")):
        for i, (stdout, _, started) in enumerate(got[label]):
            lines += [f"# run {i + 1} of {args.runs}, {name} ({started}), verbatim:", stdout]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".txt").write_text("\n".join(lines))
    write_json(args.out + ".json", {"command": command, "revisions": revs, "summary": rows,
                                    "runs": [r for _, r, _ in got["after"]],
                                    "before_runs": [r for _, r, _ in got["before"]]})
    plot(rows, args.out + ".png")
    print("\n".join(head))
    print(f"wrote {args.out}.txt, .json, .png")


if __name__ == "__main__":
    main()
