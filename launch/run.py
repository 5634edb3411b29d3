#!/usr/bin/env python3
"""Start a burstcu job with mpiexec (one node or many), or render a SLURM batch script.

    launch/burstcu-run --gpus-per-node 8 -- python train.py            # this node, 8 ranks
    launch/burstcu-run --hosts a,b --gpus-per-node 8 -- python train.py # 2 nodes, 16 ranks
    launch/burstcu-run --cpu -n 4 -- python -m burstcu.selftest         # CPU backend, 4 ranks
    launch/burstcu-run --slurm --nodes 2 --gpus-per-node 8 -- python train.py > job.sbatch
    add --dry-run to print the exact command and environment instead of running it.

Every rank runs as `launch/rank-guard [launch/bind-gpu] python launch/mpi_first.py ...`:
`python -m mpi4py` with MPI initialised before the program starts, so an uncaught exception on
one rank, wherever it is raised, aborts all of them (no rank waits forever for a peer that
died). rank-guard names a rank that dies of a signal (MPICH reports only its PID) or exits
with an error, and fails the job when a rank leaves with a burstcu group open without the
interpreter's exit (os._exit, a C library's exit()): its peers may be waiting for it.

One rank per GPU. NCCL refuses two ranks on one GPU, so a node runs at most as many ranks as it
has GPUs. Two ways to give each rank its GPU:
  --bind local-rank (default): every rank sees every GPU; burstcu's bootstrap picks device
      <node-local rank> (MPI_COMM_TYPE_SHARED split). Nothing per-rank to set.
  --bind visible: each rank runs through launch/bind-gpu, which sets CUDA_VISIBLE_DEVICES to the
      rank's own GPU (from the launcher's local-rank variable) and BURSTCU_GPU_BOUND=1. Use it
      when other libraries in the process would otherwise initialise contexts on every GPU.

Environment set for the ranks (only where not already set by the user):
  NCCL_DEBUG=WARN              NCCL prints warnings and errors only (INFO to debug topology).
  OMP_NUM_THREADS=1 (and OPENBLAS_/MKL_NUM_THREADS) for --cpu runs: one BLAS thread per rank,
                               or the ranks' thread pools fight over the cores.
NCCL hints, pass with --env KEY=VALUE when needed (not set by default):
  NCCL_P2P_DISABLE=1           when GPU peer-to-peer over PCIe is broken (some VMs, ACS enabled).
  NCCL_P2P_LEVEL=NVL           use P2P only over NVLink.
  NCCL_IB_DISABLE=1            no InfiniBand/RoCE: fall back to TCP sockets between nodes.
  NCCL_IB_HCA=mlx5_0,mlx5_1    which HCAs to use; NCCL_SOCKET_IFNAME=eth0 which NIC for bootstrap.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIND_GPU = HERE / "bind-gpu"
RANK_GUARD = HERE / "rank-guard"
MPI_FIRST = HERE / "mpi_first.py"
DEFAULT_ENV = {"NCCL_DEBUG": "WARN"}
CPU_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------------------------
# pure functions (what the tests check)

def rank_env(cpu: bool, user_env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """The variables to pass to every rank: defaults the user has not set, then --env ones."""
    wanted = dict(DEFAULT_ENV, **(CPU_ENV if cpu else {}))
    env = {k: v for k, v in wanted.items() if k not in user_env}
    env.update(extra)
    return env


_PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")


def with_mpi_first(command: list[str], root: Path | str = HERE) -> list[str]:
    """`python [options] X ...` (or `python [options] -m mpi4py X ...`) as `python [options]
    ROOT/mpi_first.py X ...`: `python -m mpi4py`, with MPI initialised before X runs, so that an
    uncaught exception anywhere on one rank — before burstcu.init too — prints its traceback
    and aborts every rank (MPI_Abort) instead of leaving the others waiting. The interpreter's
    own options (-u, -O, -X dev, -W error, ...) stay first."""
    if not command or not Path(command[0]).name.startswith("python"):
        return list(command)
    i = 1
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c", "-"):
        i += 2 if command[i] in _PYTHON_OPTIONS_WITH_VALUE else 1
    program = command[i + 2:] if command[i:i + 2] == ["-m", "mpi4py"] else command[i:]
    return [*command[:i], str(Path(root) / MPI_FIRST.name), *program]


def rank_program(command: list[str], bind: str, root: Path | str = HERE) -> list[str]:
    """What each rank runs: launch/rank-guard (names a rank that dies of a signal, exits with
    an error, or leaves with a burstcu group open), then launch/bind-gpu with --bind visible,
    then the command through launch/mpi_first.py."""
    root = Path(root)
    wrap = [str(root / RANK_GUARD.name)] + ([str(root / BIND_GPU.name)] if bind == "visible" else [])
    return wrap + with_mpi_first(command, root)


def mpi_command(*, mpiexec: str, flavour: str, nprocs: int, per_node: int | None,
                hosts: list[str], env: dict[str, str], bind: str, command: list[str]) -> list[str]:
    """The mpiexec argv. flavour: "mpich" (Hydra: -genv, -hosts, -ppn) or "openmpi" (-x, --host,
    --map-by ppr). per_node: ranks per node (None: let MPI fill)."""
    if flavour not in ("mpich", "openmpi"):
        raise ValueError(f"flavour must be 'mpich' or 'openmpi', not {flavour!r}")
    argv = [mpiexec, "-n", str(nprocs)]
    if flavour == "mpich":
        if hosts:
            argv += ["-hosts", ",".join(hosts)]
        if per_node:
            argv += ["-ppn", str(per_node)]
        for key, value in sorted(env.items()):
            argv += ["-genv", key, value]
    else:
        if hosts:
            argv += ["--host", ",".join(f"{h}:{per_node or 1}" for h in hosts)]
        if per_node:
            argv += ["--map-by", f"ppr:{per_node}:node"]
        for key, value in sorted(env.items()):
            argv += ["-x", f"{key}={value}"]
    return argv + rank_program(command, bind)


def render_sbatch(*, nodes: int, gpus_per_node: int, command: list[str], time: str = "00:30:00",
                  job_name: str = "burstcu", partition: str | None = None, bind: str = "local-rank",
                  env: dict[str, str] | None = None) -> str:
    """A SLURM batch script: one task per GPU, started by `srun --mpi=pmix`. Running it with
    BURSTCU_DRY_RUN=1 (any value but 0, false or no) prints the srun line instead of running
    it."""
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={gpus_per_node}   # one rank per GPU (NCCL: never two on one)",
             f"#SBATCH --gpus-per-node={gpus_per_node}",
             "#SBATCH --cpus-per-task=4",
             f"#SBATCH --time={time}"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["",
              "# Rendered by launch/run.py --slurm. BURSTCU_DRY_RUN=1 bash this-file prints the command.",
              "set -euo pipefail",
              'cd "${SLURM_SUBMIT_DIR:-.}"']
    for key, value in sorted(dict(DEFAULT_ENV, **(env or {})).items()):
        lines.append(f'export {key}="${{{key}:-{value}}}"')
    lines.append('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"')
    srun = ["srun", "--mpi=pmix", "--cpu-bind=cores"]
    program = rank_program(command, bind, root="launch")  # relative to the submit directory
    lines += ["", 'case "${BURSTCU_DRY_RUN:-0}" in 0|false|no) dry="" ;; *) dry=echo ;; esac',
              "${dry} " + shlex.join(srun + program), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# probing this machine (skipped when the options say everything)

def detect_flavour(mpiexec: str) -> str:
    """"openmpi" or "mpich" from `mpiexec --version`."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "mpich"
    return "openmpi" if "Open MPI" in text or "OpenRTE" in text else "mpich"


def detect_gpus() -> int | None:
    """GPUs on this node from `nvidia-smi -L`, or None when unknown."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def find_mpiexec() -> str:
    """mpiexec beside this Python (a venv with the mpich wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    return shutil.which("mpiexec") or shutil.which("mpirun") or "mpiexec"


def ranks_python(command: list[str], mpiexec: str) -> list[str]:
    """The command with a bare `python`, `python3` or `python3.X` as that name beside this Python
    when the mpiexec is the one beside it (a venv with the mpich wheel): the ranks then run the
    interpreter that has mpi4py and burstcu, as they would with the venv activated. A path,
    another name, or a name the venv lacks is kept."""
    if not command or not re.fullmatch(r"python(\d+(\.\d+)?)?", command[0]):
        return list(command)
    venv_bin = Path(sys.executable).parent
    found = shutil.which(mpiexec)
    same = found is not None and Path(found).parent.resolve() == venv_bin.resolve()
    named = venv_bin / command[0]
    return [str(named), *command[1:]] if same and named.exists() else list(command)


# ----------------------------------------------------------------------------------------------
# the CLI

def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="burstcu-run", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("-n", "--nprocs", type=int, help="total ranks (default: nodes x GPUs per node)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: nvidia-smi -L)")
    p.add_argument("--hosts", default="", help="comma-separated node names (default: this node)")
    p.add_argument("--nodes", type=int, help="node count (for --slurm; else len(--hosts) or 1)")
    p.add_argument("--cpu", action="store_true", help="CPU backend: no GPU binding, 1 BLAS thread per rank")
    p.add_argument("--bind", choices=("local-rank", "visible"), default="local-rank")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra rank env")
    p.add_argument("--mpiexec", help="the mpiexec to use (default: beside python, else on PATH)")
    p.add_argument("--mpi", choices=("mpich", "openmpi"), help="MPI flavour (default: detected)")
    p.add_argument("--slurm", action="store_true", help="print a SLURM batch script instead")
    p.add_argument("--time", default="00:30:00", help="--slurm wall time")
    p.add_argument("--partition", help="--slurm partition")
    p.add_argument("--dry-run", action="store_true", help="print the command; run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")
    args = p.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        p.error("give the program to run after --")
    for option, value in (("-n", args.nprocs), ("--gpus-per-node", args.gpus_per_node),
                          ("--nodes", args.nodes)):
        if value is not None and value < 1:
            p.error(f"{option} {value}: at least 1")
    return args


def _extra_env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"burstcu-run: --env wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _per_node(args) -> int | None:
    if args.cpu:
        return None
    gpus = args.gpus_per_node or detect_gpus()
    if not gpus:
        raise SystemExit("burstcu-run: no GPU found on this node (nvidia-smi -L); pass "
                         "--gpus-per-node N, or --cpu -n N for the CPU backend")
    return gpus


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    extra = _extra_env(args.env)
    hosts = [h for h in args.hosts.split(",") if h]
    if args.slurm:
        if args.cpu or args.nprocs is not None:
            raise SystemExit(f"burstcu-run --slurm: {'--cpu' if args.cpu else '-n'} does not apply: "
                             f"the batch script runs one rank per GPU, --nodes x --gpus-per-node "
                             f"ranks (for CPU ranks, write the srun line yourself)")
        if not args.gpus_per_node:
            raise SystemExit("burstcu-run --slurm: pass --gpus-per-node")
        print(render_sbatch(nodes=args.nodes or max(len(hosts), 1), gpus_per_node=args.gpus_per_node,
                            command=args.command, time=args.time, partition=args.partition,
                            bind=args.bind, env=extra), end="")
        return 0
    per_node = _per_node(args)
    nodes = max(len(hosts), 1)
    nprocs = args.nprocs or (per_node or 0) * nodes
    if not nprocs:
        raise SystemExit("burstcu-run --cpu: pass -n N")
    if per_node and nprocs > per_node * nodes:
        raise SystemExit(f"burstcu-run: {nprocs} ranks on {nodes} node(s) x {per_node} GPUs: "
                         "NCCL needs one GPU per rank")
    mpiexec = args.mpiexec or find_mpiexec()
    flavour = args.mpi or detect_flavour(mpiexec)
    env = rank_env(args.cpu, os.environ, extra)
    if args.cpu and args.bind == "visible":
        raise SystemExit("burstcu-run: --bind visible needs GPUs; drop it with --cpu")
    argv_ = mpi_command(mpiexec=mpiexec, flavour=flavour, nprocs=nprocs, per_node=per_node,
                        hosts=hosts, env=env, bind=args.bind, command=ranks_python(args.command, mpiexec))
    found = shutil.which(argv_[0]) is not None
    if args.dry_run:
        print(shlex.join(argv_))
        if not found:
            print(f"burstcu-run: (no mpiexec found: {argv_[0]!r} is not a program here)", file=sys.stderr)
        return 0
    if not found:
        raise SystemExit(f"burstcu-run: no mpiexec found ({argv_[0]!r} is not a program here): "
                         f"install the 'mpi' extra into the Python that runs this (pip install -e "
                         f"'.[mpi]' puts the mpich wheel's mpiexec beside it), run burstcu-run with "
                         f"PYTHON=.venv/bin/python, or pass --mpiexec PATH")
    os.execvpe(argv_[0], argv_, dict(os.environ, **env))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
