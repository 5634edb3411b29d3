"""Starting a rank: which launcher started this process, its MPI world, its GPU, and the NCCL
communicator over every rank.

* `launcher_world_size` / `world_comm`: the MPI world, refusing to run N copies of a one-process
  job when a launcher (mpirun, srun, torchrun) started N ranks that MPI does not join;
* `select_device` / `device_count` / `gpu_usable`: the GPU this rank owns (node-local rank, or
  device 0 under launch/bind-gpu's per-rank CUDA_VISIBLE_DEVICES);
* `bootstrap`: every rank checks it can start, the ranks agree (a `BackendUnavailable` on every
  rank otherwise), rank 0's NCCL unique id is sent to every rank, each rank creates its
  communicator.

The host side of a bootstrap (the "host": agreement rounds, the unique id, aborting) is an
mpi4py communicator, or a transport that agrees by itself (`TorchDistTransport`, when the
program joins torch.distributed), or None for one process: `host_gather`, `host_rank_size`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from contextlib import contextmanager
from typing import Any

from ..build.compile import compute_capability
from ..build.variants import MIN_COMPUTE_CAPABILITY
from .base import DEFAULT_TIMEOUT, MAX_WAIT_S, Transport, resolve_timeout
from .mpi import gather_plain
from .nccl import CupyDevice, NCCLTransport

def gpu_usable() -> bool:
    """True when CuPy imports and sees at least one CUDA device with a working driver."""
    try:
        import cupy
        return bool(cupy.cuda.is_available())
    except Exception:  # ImportError, or a driver/runtime mismatch surfacing at import
        return False


_NO_MPI_WARNED: list = []


# world-size variables the common launchers set in every rank's environment
_LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_SLURM_BATCH_STEP = 4294967290  # step ids from here up are Slurm's batch/extern/interactive steps


def launcher_world_size() -> tuple[str, int] | None:
    """(variable, ranks) when an MPI launcher (Open MPI's mpirun, MPICH/Hydra and Intel MPI,
    MVAPICH), Slurm's srun (any --mpi plugin, PMIx included) or torchrun (TORCHELASTIC_RUN_ID
    and WORLD_SIZE) started this process, else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("WORLD_SIZE", "").isdigit():
        return "WORLD_SIZE", int(os.environ["WORLD_SIZE"])
    for var in _LAUNCHER_SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return var, int(value)
    step, tasks = os.environ.get("SLURM_STEP_ID", ""), os.environ.get("SLURM_STEP_NUM_TASKS", "")
    if step.isdigit() and int(step) < _SLURM_BATCH_STEP and tasks.isdigit():
        return "SLURM_STEP_NUM_TASKS", int(tasks)
    return None


def launched_as_mpi_ranks() -> bool:
    """Whether an MPI launcher (or srun), not torchrun, started this process as one of several
    ranks (`launcher_world_size`)."""
    launched = launcher_world_size()
    return launched is not None and launched[0] != "WORLD_SIZE" and launched[1] >= 2


def world_comm(comm=None, timeout: float | None = None):
    """`comm`, else `MPI.COMM_WORLD`, else None (one process) when mpi4py is missing or cannot
    load an MPI library (mpi4py 4 raises RuntimeError "cannot load MPI library" then; warned
    once). If a launcher started this process as one of several ranks (`launcher_world_size`),
    a missing mpi4py or MPI library, or an MPI world of another size (torchrun's processes, or
    a launcher of another MPI than mpi4py's: each process then a world of one), raises
    RuntimeError instead, on every process alike: the ranks would otherwise each run the whole
    problem alone, as unrelated single processes. MPI's start waits for every rank of the
    launch: one that takes longer than `timeout` (`_watching_mpi_start`) ends this process."""
    if comm is not None:
        if _is_comm_null(comm):
            raise ValueError("burstcu.init: comm is MPI.COMM_NULL: this rank is not a member of the "
                             "communicator (a Split with MPI.UNDEFINED gives it, and a freed "
                             "communicator is it): call init only on the ranks a live communicator "
                             "holds")
        return comm
    try:
        with _watching_mpi_start(timeout):
            from mpi4py import MPI
    except ImportError as exc:
        _refuse_under_a_launcher(exc, "mpi4py is not installed", "Install the 'mpi' extra (pip "
                                 "install 'burstcu[mpi]') in the Python that mpiexec starts")
        return None
    except RuntimeError as exc:
        _refuse_under_a_launcher(exc, "mpi4py cannot load an MPI library", "Install the 'mpi' "
                                 "extra and use its mpiexec, or point MPI4PY_LIBMPI at the MPI "
                                 "library of the launcher you use")
        if not _NO_MPI_WARNED:
            _NO_MPI_WARNED.append(True)
            warnings.warn(f"burstcu: mpi4py cannot load an MPI library ({exc}); running as one "
                          f"process (install the 'mpi' extra for mpiexec)", stacklevel=3)
        return None
    _refuse_a_world_of_another_size(MPI.COMM_WORLD.Get_size())
    return MPI.COMM_WORLD


def _is_comm_null(comm) -> bool:
    """Whether `comm` is mpi4py's MPI.COMM_NULL (an mpi4py object compared without importing it
    for anything else)."""
    if not type(comm).__module__.startswith("mpi4py"):
        return False
    from mpi4py import MPI
    return comm == MPI.COMM_NULL


def agreed_arguments(parse, argv, what: str, ignore: tuple = ()) -> tuple:
    """(args, None) or (None, exit status) of a command every rank runs (burstcu.demo, the
    self-test): MPI is started first, then each rank parses its argv (`parse`, argparse's
    usage errors and --help caught) and one bounded round compares them. A rank whose
    arguments were refused (argparse said why there), or ranks given different arguments
    (`ignore`: names allowed to differ), give status 2 on every rank, each printing what
    differs; --help on every rank gives 0. Before, a rank that stopped at parsing left the
    others blocked in MPI's start, and ranks given other arguments ran other problems."""
    comm = world_comm()
    try:
        args, status = parse(argv), None
    except SystemExit as exc:   # argparse printed its message (or the help) on this rank
        args, status = None, exc.code if isinstance(exc.code, int) else 2
    except Exception as exc:  # noqa: BLE001 - whatever stops this rank must reach the others
        print(f"{what}: {type(exc).__name__}: {exc}", file=sys.stderr)
        args, status = None, 2
    try:
        timeout = resolve_timeout(None)
    except ValueError as exc:   # $BURSTCU_TIMEOUT unreadable: refused here, agreed as the rest
        print(f"{what}: {exc}", file=sys.stderr)
        args, status, timeout = None, 2, DEFAULT_TIMEOUT
    mine = (status, None if args is None else
            sorted((k, v) for k, v in vars(args).items() if k not in ignore))
    every = [mine] if comm is None or comm.Get_size() == 1 else \
        gather_plain(comm, mine, timeout, what)
    statuses = {s for s, _ in every}
    if statuses == {0}:
        return None, 0
    refused = [r for r, (s, _) in enumerate(every) if s is not None]
    if refused:
        if status is None:
            print(f"{what}: rank(s) {refused} stopped at their arguments (see the message there)",
                  file=sys.stderr)
        return None, 2
    differ = [f"rank {r}: " + ", ".join(f"--{k.replace('_', '-')} {b!r} (rank 0: {a!r})"
                                        for (k, a), (_, b) in zip(every[0][1], theirs) if a != b)
              for r, (_, theirs) in enumerate(every) if theirs != every[0][1]]
    if differ:
        print(f"{what}: the ranks were given different arguments ({'; '.join(differ)}); give "
              f"every rank the same", file=sys.stderr)
        return None, 2
    return args, None


def _refuse_a_world_of_another_size(size: int) -> None:
    """RuntimeError when a launcher started this process as one of N > 1 ranks and MPI's world
    has another size: each process would run alone (or the ranks split) on the whole problem."""
    launched = launcher_world_size()
    if launched is None or launched[1] <= 1 or launched[1] == size:
        return
    var, n = launched
    if var == "WORLD_SIZE":
        why = "torchrun starts processes that MPI does not join"
        remedy = ("Start the job with `mpiexec -n N python -m mpi4py program.py` (or "
                  "launch/burstcu-run), or join torch.distributed: "
                  "`torch.distributed.init_process_group()` then "
                  "`burstcu.init(comm=torch.distributed.group.WORLD)` (group.WORLD is None, "
                  "so comm is left out, until init_process_group has run)")
    else:
        why = "the launcher's MPI is not the one mpi4py loaded"
        remedy = ("Use the mpiexec of the 'mpi' extra (beside this Python), or point "
                  "MPI4PY_LIBMPI at the MPI library of the launcher you use")
    raise RuntimeError(f"burstcu: this process is one of {n} ranks ({var}={n}) but MPI's world has "
                       f"{size} rank(s): {why}, and every process would run alone on the whole "
                       f"problem. {remedy}; pass comm=MPI.COMM_SELF for a one-process group on "
                       f"purpose")


# MPI_Init returns once every rank of the launch has called it, and waits holding the
# interpreter's lock, so no Python thread or signal handler runs meanwhile: a rank that ended
# before starting MPI (an exception before burstcu.init, a Python without mpi4py) would leave the
# others there for good. A watcher process ends such a wait; it never waits less than this.
MPI_START_MIN_S = 60.0
_MPI_START_WATCH = """
import os, select, signal, sys, time
parent, seconds, said = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
if select.select([sys.stdin], [], [], seconds)[0]:
    sys.exit(0)     # MPI started (the pipe was closed), or the rank ended
sys.stderr.write(said + "\\n")
sys.stderr.flush()
for sig in (signal.SIGTERM, signal.SIGKILL):
    if os.getppid() != parent:
        break       # the rank is gone
    os.kill(parent, sig)
    for _ in range(50):
        if os.getppid() != parent:
            break
        time.sleep(0.1)
"""


@contextmanager
def _watching_mpi_start(timeout: float | None):
    """Around MPI's start in a process an MPI launcher started as one of several ranks (and
    whose MPI has not started yet): a watcher process that, past `timeout` (`resolve_timeout`;
    at least MPI_START_MIN_S), says why on stderr and ends this process (SIGTERM, then SIGKILL),
    so that the launcher ends the job. Elsewhere, or where no process starts, nothing."""
    launched = launcher_world_size()
    try:
        seconds = max(resolve_timeout(timeout), MPI_START_MIN_S)
    except Exception:  # noqa: BLE001 - a bad timeout: burstcu.init says so on every rank, once MPI runs
        seconds = max(DEFAULT_TIMEOUT, MPI_START_MIN_S)
    if "mpi4py.MPI" in sys.modules or not launched_as_mpi_ranks() or seconds >= MAX_WAIT_S:
        # math.inf too: no deadline
        yield
        return
    rank = next((os.environ[v] for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK",
                                         "SLURM_PROCID")
                 if v in os.environ), "?")
    said = (f"burstcu: rank {rank} waited {seconds:g} s for MPI to start, which waits for every "
            f"rank of the launch ({launched[0]}={launched[1]}): a rank may have ended before "
            f"starting MPI (an exception before burstcu.init, a Python without mpi4py or with "
            f"another MPI's). Ending this rank (timeout: burstcu.init(timeout=...) or "
            f"$BURSTCU_TIMEOUT, at least {MPI_START_MIN_S:g} s here); launch/burstcu-run starts "
            f"MPI before the program and names such a rank")
    try:
        watch = subprocess.Popen([sys.executable, "-I", "-S", "-c", _MPI_START_WATCH,
                                  str(os.getpid()), repr(seconds), said],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        watch.stdin.close()
        try:
            watch.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watch.kill()


def _refuse_under_a_launcher(exc: Exception, what: str, remedy: str) -> None:
    """RuntimeError when a launcher started this process as one of several ranks and MPI is
    not usable (`what`): each rank would otherwise run the whole problem alone."""
    launched = launcher_world_size()
    if launched is not None and launched[1] > 1:
        raise RuntimeError(
            f"burstcu: this process is one of {launched[1]} ranks ({launched[0]}={launched[1]}) "
            f"but {what} ({exc}): every rank would run alone on the whole problem. {remedy}") from exc



class BackendUnavailable(RuntimeError):
    """The "cupy" backend cannot start on this set of ranks (raised on every rank)."""


BOUND_ENV = "BURSTCU_GPU_BOUND"  # set to 1 by launch/bind-gpu: each rank sees only its own GPU


def select_device(local_rank: int, local_size: int, n_devices: int, bound: bool = False) -> int:
    """The CUDA device index this rank uses.

    local_rank, local_size: this rank's position among the ranks of its node.
    n_devices: CUDA devices this process sees.
    bound: the launcher gave every rank its own CUDA_VISIBLE_DEVICES, so device 0 is ours.
    Raises ValueError (a message for the user) when there is no device or fewer devices than ranks.
    """
    if not 0 <= local_rank < local_size:
        raise ValueError(f"node-local rank {local_rank} is outside 0..{local_size - 1}")
    if n_devices <= 0:
        raise ValueError("no usable CUDA GPU on this node (backend='cupy' needs one GPU per rank; "
                         "use backend='numpy' or 'auto' on CPU-only machines)")
    if bound:
        return 0
    if local_size > n_devices:
        raise ValueError(f"{local_size} ranks on this node but only {n_devices} GPU(s): NCCL needs "
                         f"one GPU per rank, start at most {n_devices} rank(s) per node")
    return local_rank


def device_count() -> tuple[int, str | None]:
    """(CUDA devices visible, None) or (0, why not), without raising."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - any import failure means no GPU backend
        return 0, f"cupy is not importable ({exc}); install burstcu[cuda13]"
    try:
        return int(cupy.cuda.runtime.getDeviceCount()), None
    except Exception as exc:  # CUDARuntimeError without a driver
        return 0, str(exc).splitlines()[0]


def _nccl_problem() -> str | None:
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception as exc:
        return f"cupy.cuda.nccl is unavailable ({exc}); install nvidia-nccl-cu13"
    return None


def host_rank_size(host: Any) -> tuple[int, int]:
    """(this rank, ranks) of a host: an mpi4py communicator, a transport, or None (0, 1)."""
    if host is None:
        return 0, 1
    if isinstance(host, Transport):
        return host.rank, host.size
    return host.Get_rank(), host.Get_size()


def host_gather(host: Any, obj: Any, timeout: float, what: str) -> list:
    """Every rank's `obj` (plain values, `wire`) in rank order, over a host (see the module
    docstring) before any data transport exists, each wait bounded by `timeout` seconds;
    `what` names the round (ranks in different rounds raise ValueError on every rank)."""
    if host is None:
        return [obj]
    if isinstance(host, Transport):
        kept, host.timeout = host.timeout, timeout
        try:
            return host.allgather_object(obj, what)
        finally:
            host.timeout = kept
    return gather_plain(host, obj, timeout, what)


def _local_rank(comm: Any) -> tuple[int, int]:
    """(node-local rank, ranks on this node): from a shared-memory split of an mpi4py `comm`;
    over a transport (torch.distributed), torch's own LOCAL_RANK and LOCAL_WORLD_SIZE where the
    launcher set them (torch's tensors live on cuda:LOCAL_RANK), else the ranks' host names."""
    if comm is None:
        return 0, 1
    if isinstance(comm, Transport):
        local = os.environ.get("LOCAL_RANK", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
        if all(v.isdigit() for v in local):
            return int(local[0]), int(local[1])
        names = host_gather(comm, socket.gethostname(), comm.timeout, "the node-local ranks")
        mine = [r for r, name in enumerate(names) if name == names[comm.rank]]
        return mine.index(comm.rank), len(mine)
    from mpi4py import MPI
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _local_problem(comm: Any) -> tuple[int, str | None]:
    """(device index, None) or (-1, what stops this rank), with no collective after the split."""
    local_rank, local_size = _local_rank(comm)
    n, why = device_count()
    if n == 0 and why:
        return -1, f"no usable CUDA GPU ({why}); backend='cupy' needs one GPU per rank"
    try:
        device_id = select_device(local_rank, local_size, n, bound=os.environ.get(BOUND_ENV) == "1")
    except ValueError as exc:
        return -1, str(exc)
    return device_id, _arch_problem(device_id) or _nccl_problem()


def host_identity() -> str:
    """This machine as NCCL tells machines apart: NCCL_HOSTID where set, else the host name and
    this boot's id (containers started with one --hostname, or cloned machines, share a name)."""
    if os.environ.get("NCCL_HOSTID"):
        return os.environ["NCCL_HOSTID"]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        return socket.gethostname()
    return f"{socket.gethostname()} boot {boot}"


def gpu_place(device_id: int) -> str | None:
    """Where CUDA device `device_id` of this process sits: "HOST, PCI bus 0000:1b:00.0" (HOST:
    `host_identity`), read without making it current (no CUDA context is created), or None where
    it cannot be read. Two ranks at one place share a GPU, which NCCL refuses (MIG slices of one
    GPU too)."""
    try:
        import cupy
        bus = str(cupy.cuda.runtime.deviceGetPCIBusId(device_id)).lower()
    except Exception:  # noqa: BLE001 - no place, no check
        return None
    return f"{host_identity()}, PCI bus {bus}"


def shared_gpu_problem(places: list) -> str | None:
    """Which ranks would share a GPU, given every rank's `gpu_place` (None: unknown), or None."""
    ranks_at: dict[str, list[int]] = {}
    for rank, place in enumerate(places):
        if place is not None:
            ranks_at.setdefault(place, []).append(rank)
    shared = [(place, ranks) for place, ranks in ranks_at.items() if len(ranks) > 1]
    if not shared:
        return None
    place, ranks = shared[0]
    return (f"ranks {', '.join(map(str, ranks))} would share one GPU ({place}): NCCL needs a GPU "
            f"of its own for every rank; check CUDA_VISIBLE_DEVICES and the launcher's GPU binding "
            f"(docs/launching.md)")




def _arch_problem(device_id: int) -> str | None:
    """Why the kernels cannot run on this device (older than sm_80), or None. Checked before
    the agreement round, so every rank falls back (backend="auto") or fails together. Reads the
    compute capability without making `device_id` current (no CUDA context is created there)."""
    try:
        cc = compute_capability(device_id)
    except Exception as exc:  # noqa: BLE001 - reported, not raised, before the agreement
        return f"cannot query GPU {device_id}: {exc}"
    if cc < MIN_COMPUTE_CAPABILITY:
        return (f"GPU {device_id} has compute capability {cc // 10}.{cc % 10}; the burstcu kernels "
                f"need 8.0 or newer (cp.async, bf16 tensor cores)")
    return None


def agree_or_raise(comm: Any, problem: str | None, timeout: float | None = None,
                   place: str | None = None) -> None:
    """Gather every rank's problem and GPU `place` (`gpu_place`) and raise the same
    BackendUnavailable on every rank if any rank has a problem or two ranks would share a GPU,
    so no rank enters a collective alone. Bounded by `timeout` (default `resolve_timeout(None)`)."""
    gathered = host_gather(comm, (problem, place), resolve_timeout(timeout),
                           "the NCCL bootstrap's checks")
    bad = [(r, p) for r, (p, _) in enumerate(gathered) if p is not None]
    if bad:
        ranks = ", ".join(str(r) for r, _ in bad)
        raise BackendUnavailable(f"burstcu backend 'cupy' cannot start (rank(s) {ranks}): {bad[0][1]}")
    shared = shared_gpu_problem([p for _, p in gathered])
    if shared:
        raise BackendUnavailable(f"burstcu backend 'cupy' cannot start: {shared}")


def unique_id(comm: Any, timeout: float | None = None) -> bytes:
    """The NCCL unique id made on rank 0 and sent to every rank over the host `comm` (128 bytes
    on every rank), bounded by `timeout` (default `resolve_timeout(None)`)."""
    from cupy.cuda import nccl
    uid = nccl.get_unique_id() if host_rank_size(comm)[0] == 0 else None
    return host_gather(comm, uid, resolve_timeout(timeout), "the NCCL unique id's broadcast")[0]


def bootstrap(comm: Any, timeout: float | None = None) -> tuple[NCCLTransport, int]:
    """(NCCLTransport over all ranks of `comm`, this rank's device id). Collective over `comm`.

    comm: the host (module docstring): an mpi4py communicator (duplicated for the transport's
    metadata), a transport that agrees by itself (the transport then owns it), or None for a
    single process. The node-local rank picks the GPU; every rank checks it can start, the
    ranks agree, then rank 0's NCCL unique id is broadcast and each rank creates its
    communicator. Raises BackendUnavailable on every rank when any rank lacks a GPU, has to
    share one (more ranks than GPUs on a node, or two ranks bound to one GPU), or lacks NCCL.
    """
    device_id, problem = _local_problem(comm)
    agree_or_raise(comm, problem, timeout, None if problem else gpu_place(device_id))
    uid = unique_id(comm, timeout)
    rank, size = host_rank_size(comm)
    nccl_comm = create_communicator(comm, size, uid, rank, device_id)

    def connect(sub_host: Transport):
        """The NCCL communicator of a sub-group (`Transport.split`), bootstrapped over its host
        transport on this rank's device (collective over `sub_host`)."""
        return create_communicator(sub_host, sub_host.size, unique_id(sub_host, timeout),
                                   sub_host.rank, device_id)
    transport = NCCLTransport(rank, size, CupyDevice(nccl_comm), comm, timeout, connect)
    return transport, device_id


def create_communicator(comm: Any, size: int, uid: bytes, rank: int, device_id: int) -> Any:
    """ncclCommInitRank on `device_id`. Every other rank is inside the same blocking init, so a
    failure here cannot be agreed on: the world is aborted with the reason rather than left
    hanging."""
    import cupy
    from cupy.cuda import nccl
    try:
        cupy.cuda.Device(device_id).use()
        return nccl.NcclCommunicator(size, uid, rank)
    except Exception as exc:
        if comm is None or size == 1:
            raise BackendUnavailable(f"NCCL initialisation failed on device {device_id}: {exc}") from exc
        import sys
        reason = (f"rank {rank}: NCCL initialisation failed on device {device_id}: {exc}; "
                  f"aborting the world (the other ranks are blocked in the same init)")
        sys.stderr.write(f"burstcu: {reason}\n")
        sys.stderr.flush()
        if isinstance(comm, Transport):
            comm._abort(reason)
        else:
            comm.Abort(1)
        raise  # not reached
