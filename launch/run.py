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
The command: `python ...`, `/path/to/python3 ...` or `env NAME=VALUE ... python ...`; any other
runs as given, without mpi_first.py, and burstcu-run says so. A bare `python` (`python3`,
`python3.X`) becomes the one beside the Python running burstcu-run when that is a venv's with
mpi4py (under mpiexec: when the mpiexec is that venv's), `.venv/bin/python` in a batch script
for the repository's .venv.

Options belong to one mode: -n, --cpu, --mpi, --mpiexec and --dry-run to mpiexec runs; --time
and --partition to --slurm, where --hosts is the job's nodelist. Options the mode would ignore,
or that contradict each other (--nodes other than the count of --hosts; without --slurm, --nodes
above 1 with no --hosts to name them), are usage errors.

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
import importlib.util
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
SLURM_TIME = "00:30:00"   # the batch script's wall time unless --time


# ----------------------------------------------------------------------------------------------
# pure functions (what the tests check)

def rank_env(cpu: bool, user_env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """The variables to pass to every rank: defaults the user has not set, then --env ones."""
    wanted = dict(DEFAULT_ENV, **(CPU_ENV if cpu else {}))
    env = {k: v for k, v in wanted.items() if k not in user_env}
    env.update(extra)
    return env


_PYTHON_OPTIONS_WITH_VALUE = ("-X", "-W", "-Q")
SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")   # a variable name sh, srun and mpiexec take
_BARE_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


def python_at(command: list[str]) -> int | None:
    """Where the Python interpreter stands in `command`: 0 for `python ...` or
    `/path/to/python3 ...`, after the assignments of `env NAME=VALUE ... python ...`; None when
    the command runs no Python interpreter there."""
    i = 0
    if command and Path(command[0]).name == "env":
        i = 1
        while i < len(command) and "=" in command[i] and SHELL_NAME.fullmatch(command[i].split("=")[0]):
            i += 1
    return i if i < len(command) and Path(command[i]).name.startswith("python") else None


def with_mpi_first(command: list[str], root: Path | str = HERE) -> list[str]:
    """`python [options] X ...` (or `python [options] -m mpi4py X ...`, either after `env
    NAME=VALUE ...`) as `python [options] ROOT/mpi_first.py X ...`: `python -m mpi4py`, with MPI
    initialised before X runs, so that an uncaught exception anywhere on one rank — before
    burstcu.init too — prints its traceback and aborts every rank (MPI_Abort) instead of leaving
    the others waiting. The interpreter's own options (-u, -O, -X dev, -W error, ...) stay
    first. Another command is kept (`mpi_first_note` says what that costs)."""
    start = python_at(command)
    if start is None:
        return list(command)
    i = start + 1
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c", "-"):
        i += 2 if command[i] in _PYTHON_OPTIONS_WITH_VALUE else 1
    program = command[i + 2:] if command[i:i + 2] == ["-m", "mpi4py"] else command[i:]
    return [*command[:i], str(Path(root) / MPI_FIRST.name), *program]


def mpi_first_note(command: list[str]) -> str | None:
    """What a command that runs no Python interpreter where `with_mpi_first` looks for one
    costs (None: it runs one)."""
    if python_at(command) is not None:
        return None
    return ("burstcu-run: note: the command does not start with a Python interpreter (`python "
            "...`, `/path/to/python3 ...`, `env NAME=VALUE ... python ...`): its ranks run without "
            "launch/mpi_first.py, so one that fails before MPI starts leaves the others waiting in "
            "MPI_Init until burstcu.init's timeout instead of ending the job")


def with_python(command: list[str], folder: Path | str) -> list[str]:
    """The command with a bare `python`, `python3` or `python3.X` (where `python_at` finds it)
    as that name in `folder`."""
    i = python_at(command)
    if i is None or not _BARE_PYTHON.fullmatch(command[i]):
        return list(command)
    return [*command[:i], str(Path(folder) / command[i]), *command[i + 1:]]


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
    --map-by ppr; each host given per_node slots, else its share of nprocs rounded up). per_node:
    ranks per node (None: let MPI fill)."""
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
            slots = per_node or -(-nprocs // len(hosts))   # each host's share, rounded up
            argv += ["--host", ",".join(f"{h}:{slots}" for h in hosts)]
        if per_node:
            argv += ["--map-by", f"ppr:{per_node}:node"]
        for key, value in sorted(env.items()):
            argv += ["-x", f"{key}={value}"]
    return argv + rank_program(command, bind)


def render_sbatch(*, nodes: int, gpus_per_node: int, command: list[str], time: str = SLURM_TIME,
                  job_name: str = "burstcu", partition: str | None = None, bind: str = "local-rank",
                  env: dict[str, str] | None = None, nodelist: list[str] | None = None) -> str:
    """A SLURM batch script: one task per GPU, started by `srun --mpi=pmix`. `env`: variables
    set for the ranks, over the job's environment (as --env does under mpiexec), each value
    quoted; NCCL_DEBUG=WARN unless the job sets it. `nodelist`: the nodes to run on. Running it
    with BURSTCU_DRY_RUN=1 (any value but 0, false or no) prints the srun line instead of
    running it."""
    bad = [key for key in env or {} if not SHELL_NAME.fullmatch(key)]
    if bad:
        raise ValueError(f"environment variable names must be shell names, not {bad}")
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={job_name}",
             f"#SBATCH --nodes={nodes}"]
    if nodelist:
        lines.append(f"#SBATCH --nodelist={','.join(nodelist)}")
    lines += [
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
    for key, value in sorted(DEFAULT_ENV.items()):
        if key not in (env or {}):
            lines.append(f'export {key}="${{{key}:-{value}}}"')
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted((env or {}).items())]
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


def _venv_has(command: list[str]) -> bool:
    """Whether the folder of this Python holds the bare python name of `command`."""
    i = python_at(command)
    return i is not None and (Path(sys.executable).parent / command[i]).exists()


def ranks_python(command: list[str], mpiexec: str) -> list[str]:
    """The command with a bare `python`, `python3` or `python3.X` (after `env NAME=VALUE ...`
    too) as that name beside this Python when the mpiexec is the one beside it (a venv with the
    mpich wheel): the ranks then run the interpreter that has mpi4py and burstcu, as they would
    with the venv activated. A path, another name, or a name the venv lacks is kept."""
    venv_bin = Path(sys.executable).parent
    found = shutil.which(mpiexec)
    same = found is not None and Path(found).parent.resolve() == venv_bin.resolve()
    return with_python(command, venv_bin) if same and _venv_has(command) else list(command)


def sbatch_python(command: list[str], root: Path | str = HERE.parent) -> list[str]:
    """The command of a batch script with a bare `python`, `python3` or `python3.X` (after `env
    NAME=VALUE ...` too) as that name beside this Python when that is a virtual environment's
    with mpi4py, as `ranks_python` maps it under mpiexec: `.venv/bin/python` when it is ROOT's
    .venv (relative to the submit directory, as the script's launch/ paths), else its absolute
    path. Otherwise the command is kept (the job's PATH finds python)."""
    venv_bin = Path(sys.executable).parent
    if sys.prefix == sys.base_prefix or importlib.util.find_spec("mpi4py") is None \
            or not _venv_has(command):
        return list(command)
    own = venv_bin.resolve() == (Path(root) / ".venv" / "bin").resolve()
    return with_python(command, Path(".venv", "bin") if own else venv_bin)


# ----------------------------------------------------------------------------------------------
# the CLI

def parse(argv: list[str]) -> argparse.Namespace:
    """The options, with --hosts as a list and --env as a dict; options that contradict each
    other, or that this mode would ignore, are usage errors (`option_problem`)."""
    p = argparse.ArgumentParser(prog="burstcu-run", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("-n", "--nprocs", type=int,
                   help="total ranks (default: nodes x GPUs per node; with --cpu: required)")
    p.add_argument("--gpus-per-node", type=int, help="ranks per node (default: nvidia-smi -L)")
    p.add_argument("--hosts", default="",
                   help="comma-separated node names (default: this node; with --slurm: the nodelist)")
    p.add_argument("--nodes", type=int, help="node count (for --slurm; else len(--hosts) or 1)")
    p.add_argument("--cpu", action="store_true", help="CPU backend: no GPU binding, 1 BLAS thread per rank")
    p.add_argument("--bind", choices=("local-rank", "visible"), default="local-rank")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="a variable for every rank, over the environment's")
    p.add_argument("--mpiexec", help="the mpiexec to use (default: beside python, else on PATH)")
    p.add_argument("--mpi", choices=("mpich", "openmpi"), help="MPI flavour (default: detected)")
    p.add_argument("--slurm", action="store_true", help="print a SLURM batch script instead")
    p.add_argument("--time", help=f"--slurm wall time (default {SLURM_TIME})")
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
    args.hosts = [h for h in args.hosts.split(",") if h]
    env = {}
    for pair in args.env:
        key, sep, value = pair.partition("=")
        if not sep or not SHELL_NAME.fullmatch(key):
            p.error(f"--env {pair!r}: KEY=VALUE, KEY a variable name (letters, digits and _, "
                    f"not starting with a digit)")
        env[key] = value
    args.env = env
    problem = option_problem(args)
    if problem:
        p.error(problem)
    return args


def option_problem(args: argparse.Namespace) -> str | None:
    """Why these options cannot run as given (contradictory, or ignored in this mode), or None."""
    if args.nodes is not None and args.hosts and args.nodes != len(args.hosts):
        return f"--nodes {args.nodes} but --hosts names {len(args.hosts)} node(s)"
    if args.slurm:
        srun = "srun starts the batch script's ranks"
        ignored = [("-n", args.nprocs is not None,
                    "the batch script runs one rank per GPU, --nodes x --gpus-per-node ranks"),
                   ("--cpu", args.cpu, "the batch script runs one rank per GPU (for CPU ranks, "
                                       "write the srun line yourself)"),
                   ("--mpi", args.mpi is not None, srun), ("--mpiexec", args.mpiexec is not None, srun),
                   ("--dry-run", args.dry_run, "--slurm prints the script and runs nothing "
                                               "(BURSTCU_DRY_RUN=1 bash job.sbatch prints its srun line)")]
        for option, given, why in ignored:
            if given:
                return f"--slurm: {option} does not apply: {why}"
        return None if args.gpus_per_node else "--slurm: pass --gpus-per-node"
    option = "--time" if args.time is not None else "--partition" if args.partition is not None else None
    if option:
        return f"{option} applies to --slurm only"
    if args.nodes is not None and args.nodes > 1 and not args.hosts:
        return (f"--nodes {args.nodes} without --slurm: name the nodes with --hosts (mpiexec "
                f"starts every rank on this node otherwise)")
    if args.cpu:
        if args.gpus_per_node is not None:
            return "--cpu: --gpus-per-node does not apply (give the total of CPU ranks with -n)"
        if args.bind == "visible":
            return "--bind visible needs GPUs; drop it with --cpu"
        if args.nprocs is None:
            return "--cpu: pass -n N"
    return None


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
    note = mpi_first_note(args.command)
    if note:
        print(note, file=sys.stderr)
    if args.slurm:
        print(render_sbatch(nodes=args.nodes or max(len(args.hosts), 1), gpus_per_node=args.gpus_per_node,
                            command=sbatch_python(args.command), time=args.time or SLURM_TIME,
                            partition=args.partition, bind=args.bind, env=args.env,
                            nodelist=args.hosts), end="")
        return 0
    per_node = _per_node(args)
    nodes = max(len(args.hosts), 1)
    nprocs = args.nprocs or per_node * nodes
    if per_node and nprocs > per_node * nodes:
        raise SystemExit(f"burstcu-run: {nprocs} ranks on {nodes} node(s) x {per_node} GPUs: "
                         "NCCL needs one GPU per rank")
    mpiexec = args.mpiexec or find_mpiexec()
    flavour = args.mpi or detect_flavour(mpiexec)
    env = rank_env(args.cpu, os.environ, args.env)
    argv_ = mpi_command(mpiexec=mpiexec, flavour=flavour, nprocs=nprocs, per_node=per_node,
                        hosts=args.hosts, env=env, bind=args.bind,
                        command=ranks_python(args.command, mpiexec))
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
