"""Strong scaling on the CPU: the same global problem on 1 rank and on P ranks, one BLAS thread
per rank, and the strong-scaling efficiency T_1 / (P * T_P).

    python bench/cpu/scaling.py [--ranks 1 2] [--seqlen 4096] [--heads 4] [--headdim 64] [--causal]
        [--strategies burst] [--repeats 3] [--json FILE]

The driver launches, for each rank count P, `mpiexec -n P python bench/cpu/scaling.py --worker ...`
with OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = MKL_NUM_THREADS = 1, so the comparison is one
core's BLAS against P cores' (the two commands it runs are printed). Times: wall seconds of
attention() and attention()+attention_backward(), the slowest rank, median over repeats after one
warm-up. On a machine with fewer cores than P + progress threads, ranks share cores and the
efficiency says so; it is a CPU + MPI figure, never a GPU one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file
from bench import _common as C  # noqa: E402


def worker(args) -> None:
    """Runs under mpiexec: time the passes, write rank 0's result to args.out."""
    import burstcu

    group = burstcu.init(backend="numpy", progress=args.progress)
    q, k, v, dout = C.make_local_inputs(group.rank, group.size, batch=args.batch, seqlen=args.seqlen,
                                        heads=args.heads, kv_heads=args.heads, headdim=args.headdim,
                                        dtype=args.dtype, layout=args.layout)
    result = {}
    for strategy in args.strategies:
        fwd, both = [], []
        for r in range(1 + args.repeats):
            group.barrier()
            t0 = time.perf_counter()
            out, lse = burstcu.attention(q, k, v, group, causal=args.causal, layout=args.layout,
                                         return_lse=True, strategy=strategy)
            t1 = time.perf_counter()
            burstcu.attention_backward(dout, q, k, v, out, lse, group, causal=args.causal,
                                       layout=args.layout, strategy=strategy)
            t2 = time.perf_counter()
            times = group.transport.allgather_object((t1 - t0, t2 - t0))
            if r > 0:  # the first run warms caches and BLAS
                fwd.append(max(t[0] for t in times))
                both.append(max(t[1] for t in times))
        result[strategy] = {"forward_s": C.median(fwd), "fwd_bwd_s": C.median(both),
                            "forward_all": fwd, "fwd_bwd_all": both}
    env = C.environment(group)
    group.close()
    if group.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"ranks": group.size, "env": env, "times": result}, f)


def launch(args, nprocs: int, out: str) -> tuple[list, dict]:
    """Run the worker on `nprocs` ranks; returns (command, its result)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(nprocs), sys.executable,
           str(Path(__file__).resolve()), "--worker", "--out", out, "--seqlen", str(args.seqlen),
           "--batch", str(args.batch), "--heads", str(args.heads), "--headdim", str(args.headdim),
           "--dtype", args.dtype, "--layout", args.layout, "--repeats", str(args.repeats),
           "--progress", args.progress, "--strategies", *args.strategies]
    if args.causal:
        cmd.append("--causal")
    C.progress(f"scaling: {nprocs} rank(s): OMP_NUM_THREADS=1 {' '.join(cmd)}")
    subprocess.run(cmd, check=True, env=C.blas_threads_env(1), timeout=args.timeout)
    with open(out) as f:
        return cmd, json.load(f)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--progress", default="thread", choices=["thread", "inline"])
    p.add_argument("--strategies", nargs="+", default=["burst"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    if args.worker:
        return worker(args)
    runs, commands = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            commands[n], runs[n] = launch(args, n, os.path.join(tmp, f"scaling_{n}.json"))
    base = min(args.ranks)
    rows = []
    for strategy in args.strategies:
        for n in args.ranks:
            t = runs[n]["times"][strategy]
            row = {"strategy": strategy, "ranks": n}
            for key in ("forward_s", "fwd_bwd_s"):
                t_base = runs[base]["times"][strategy][key]
                speedup = t_base / t[key]
                row[key] = t[key]
                row[f"{key[:-2]}_speedup"] = speedup
                row[f"{key[:-2]}_efficiency"] = speedup * base / n
            rows.append(row)
    env = runs[base]["env"]
    print(f"# measured on CPU: {env['cpus']} cores, one BLAS thread per rank, MPI {env['mpi']}, "
          f"progress={args.progress}; CPU figures, not GPU figures")
    print(f"# global seqlen={args.seqlen} B={args.batch} H={args.heads} D={args.headdim} {args.dtype} "
          f"{'causal ' + args.layout if args.causal else 'full'}; efficiency = T_{base} * {base} / (P * T_P)")
    show = [{k: (C.fmt_s(v) if k.endswith("_s") else v) for k, v in r.items()} for r in rows]
    print(C.table(show, list(show[0])))
    result = {"benchmark": "scaling", "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
              "commands": {str(n): c for n, c in commands.items()}, "environment": env, "rows": rows,
              "runs": {str(n): r["times"] for n, r in runs.items()}}
    return C.finish(result, args.json)


if __name__ == "__main__":
    main()
