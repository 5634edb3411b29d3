"""`burstcu.init`: pick a transport and a local op for this process and wrap them in a `Group`.

backend        local op                            transport
"numpy"        NumpyOps (BLAS tiles)                MPI (mpi4py), or none for one process
"emulated"     KernelOps: the CUDA .cu source run   MPI
               on the CPU by kernels/emu
"cupy"         KernelOps: CUDA kernels via RawModule NCCL on a dedicated stream, bootstrapped
                                                     over MPI
"auto"         "cupy" when a GPU is usable, else "numpy"

`init(comm=<a torch.distributed ProcessGroup>)` puts torch.distributed where MPI stands above
(`burstcu.transport.torch_dist`): gloo carries the CPU backends' data and every backend's
agreement rounds and NCCL bootstrap.
"""

from __future__ import annotations

import atexit
import inspect
import numbers
import os
import sys
import threading
import warnings
import weakref
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .build.compile import atomic_write, build_timeout, cache_dir
from .build.variants import kernel_dir, kernel_sources_digest
from .ops.base import LocalOps
from .ops.cuda import KernelOps
from .ops.numpy import NumpyOps
from .transport.base import (BY_CLOSE, DEFAULT_TIMEOUT, RAISED, CommStats, SelfTransport, Transport,
                             resolve_timeout)
from .transport.link import Link
from .transport.loopback import CupyCopyDevice, HostDevice, LoopbackTransport
from .transport.mpi import PROGRESS, MPITransport
from .transport.bootstrap import (BackendUnavailable, bootstrap, gpu_usable, host_gather,
                                  host_rank_size, world_comm)
from .transport.torch_dist import TorchDistTransport, torch_process_group
from .validate import InputError, agree

BACKENDS = ("auto", "numpy", "cupy", "emulated")
DEVICE_OF = {"numpy": "cpu", "emulated": "cpu", "cupy": "cuda"}   # where each backend computes


def on_gpu(backend: str) -> bool:
    """Whether `backend` ("numpy", "emulated", "cupy") computes on a GPU: the one question about a
    backend's name that code outside this module asks (the verification harness, which runs a
    named backend); the library itself asks its local op's capabilities (`LocalOps.device`)."""
    return DEVICE_OF[backend] == "cuda"


@dataclass
class Group:
    """The ranks that share one sequence. `stats` counts this rank's payload bytes and messages.

    A context manager: `with burstcu.init() as group: ...` closes it on the way out. `close()`
    frees the message buffers kept between calls and the transport's communicator; calling it
    again does nothing. `release_buffers()` frees only the buffers (the ring keeps two message
    buffers per recent problem shape, about 4 x (|K| + |V|) forward and 4 x (|Q| + |dO|) + 4 x
    |dQ fp32| backward, for the 4 most recent shapes, so repeated calls allocate nothing).
    """

    rank: int
    size: int
    backend: str
    transport: Transport = field(repr=False)
    ops: LocalOps = field(repr=False)
    comm: Any = field(default=None, repr=False)
    trace: Any = field(default=None, repr=False)  # a burstcu.engine.Trace to record step timings into
    closed: bool = field(default=False, repr=False)
    counted: bool = field(default=False, repr=False)  # in the rank's state (`RankState`)
    left_open: Any = field(default=None, repr=False, compare=False)  # `_left_open`'s finalizer
    # (thread id, call name) of the call running on this group, or None (`Call`, `close`)
    calling: Any = field(default=None, repr=False, compare=False)
    entry: Any = field(default_factory=threading.Lock, repr=False, compare=False)
    turn: Any = field(default_factory=threading.RLock, repr=False, compare=False)  # one rank's calls
    # a GPU group of one, whose calls take no turn: thread id -> its calls running now
    sharers: Any = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.transport.compiles_kernels = self.ops.compiles_on_first_use

    @property
    def stats(self) -> CommStats:
        return self.transport.stats

    @property
    def link(self) -> Link | None:
        """The emulated link this group's messages are paced to (`burstcu.init(link=...)`), or
        None. Figures that depend on it say so: `str(group.link)` is "emulated link X Gb/s, Y us"."""
        return self.transport.link

    @property
    def timeout(self) -> float:
        """Seconds a rank waits for a peer inside a burstcu call before CommTimeoutError."""
        return self.transport.timeout

    def barrier(self) -> None:
        """Wait until every rank of the group is here (bounded by `timeout`, like every call)."""
        with Call(self, "barrier") as call, call.raising_together():
            self.transport.barrier()

    def release_buffers(self) -> None:
        """Free the message buffers kept for reuse between calls (they are re-made on demand)."""
        self.ops.release_buffers()

    def close(self) -> None:
        """Free buffers, worker threads and the communicator. Idempotent; the group is unusable
        afterwards. RuntimeError while another thread is inside a call on it."""
        with self.entry:
            if self.closed:
                return
            me = threading.get_ident()
            running = self.calling
            if running is None and any(thread != me for thread in self.sharers):
                running = (None, "a call")
            if running is not None and running[0] != me:
                raise RuntimeError(f"close() while another thread is inside {running[1]} on this "
                                   f"group: close it once its calls have returned")
            self.closed = True
        passing = sys.exc_info()[1]
        UNCAUGHT.left(self, passing)   # closed by `with` or `finally` as it passes
        if passing is not None and not getattr(passing, "burstcu_agreed", False):
            # raised (the job ends on it, `UncaughtEndsTheJob`, or the caller handles it and goes
            # on) or being handled: a peer inside a call this rank will not make hears it at once
            said = exception_text(type(passing), passing)
            self.transport.left_why = f"{BY_CLOSE}, {RAISED}" + \
                (said if len(said) <= 300 else said[:300] + "...")
        if self.counted:
            RANK_STATE.change(-1)
        if self.left_open is not None:
            self.left_open.detach()   # the transport's close says it has left
        self.ops.close()
        self.transport.close()

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RankState:
    """What launch/rank-guard learns when this rank's process ends, in the file `path` (from
    $BURSTCU_RANK_STATE, which rank-guard sets and this module takes out of the environment on
    import, so that no child process writes it; None: nothing is written): "open N" while N
    groups made by `init` are open, "exit N" once the interpreter has exited normally. Only the
    process that imported burstcu writes (a forked child that exits does not). A process that
    ends with "open N", N > 0 (os._exit, a C library's exit(), with a group open) left while its
    peers may be inside a call: rank-guard names it and fails the job."""

    ENV = "BURSTCU_RANK_STATE"

    def __init__(self, path: str | None):
        self.path, self.pid = path, os.getpid()
        self.open, self.lock, self.watching = 0, threading.Lock(), False

    def change(self, by: int) -> None:
        if not self.path:
            return
        with self.lock:
            self.open += by
            if not self.watching:
                self.watching = True
                atexit.register(self._write, "exit")
            self._write("open")

    def _write(self, word: str) -> None:
        if os.getpid() != self.pid:
            return
        try:
            atomic_write(Path(self.path), f"{word} {self.open}\n".encode())
        except OSError:
            pass   # rank-guard's folder is gone: nobody is left to read it


RANK_STATE = RankState(os.environ.pop(RankState.ENV, None))


def _counted(group: Group) -> Group:
    """`group`, counted among this rank's open groups (`RankState`), and watched for an exception
    that would end this rank's program while it is open (`UNCAUGHT`)."""
    RANK_STATE.change(+1)
    group.counted = True
    UNCAUGHT.watch(group)
    group.left_open = weakref.finalize(group, _left_open, group.transport, os.getpid())
    return group


def _left_open(transport: Transport, pid: int) -> None:
    """A group still open when its program ends, or dropped (garbage-collected) without a
    close: its peers are told this rank has left (`Transport.say_left`), so that one inside a
    call this rank never made fails at once instead of at its timeout. Not from a forked child."""
    if os.getpid() == pid:
        with suppress(Exception):   # MPI may be gone already; nothing here may stop the exit
            transport.say_left("its program ended, or dropped the group, with the group open")


class UncaughtEndsTheJob:
    """While a group of several MPI ranks made by `init` is open, an exception that no code
    catches (the program's end on this rank: a bug between calls, Ctrl-C) ends every rank, as
    `python -m mpi4py` does: the traceback first (the hook that was there prints it), then
    `Transport.fail` (a line naming the rank, MPI_Abort). Under a plain `mpiexec python
    program.py` this rank would otherwise sit in MPI's finalize while its peers wait inside their
    next call until the timeout. So does an exception that closed such a group on its way out
    (a `with` block, `finally: group.close()`), or one raised from or while handling it: it is
    marked `burstcu_left_group`. `sys.excepthook` is set once, at the first such group; putting
    the previous hook back turns this off for good. Left alone: an error burstcu raised on every
    rank alike inside a call (`burstcu_agreed`: bad input, ranks that disagree; each rank ends on
    its own), a program run by mpi4py's runner (`-m mpi4py`, launch/: it aborts itself, with its
    status), an interactive session (the prompt returns), a forked child of the rank, and an
    exception ending a thread other than the main one (`threading.excepthook`)."""

    def __init__(self):
        self.groups: list[weakref.ref] = []   # (a Group compares by value: no WeakSet)
        self.previous, self.pid, self.installed = None, os.getpid(), False
        self.lock = threading.Lock()

    @staticmethod
    def _watched(group: Group) -> bool:
        return group.size > 1 and group.transport.abort_ends_every_rank

    def watch(self, group: Group) -> None:
        if not self._watched(group):
            return
        with self.lock:
            self.pid = os.getpid()   # a forked child's exception is not this rank's end
            self.groups = [ref for ref in self.groups if self._open(ref)] + [weakref.ref(group)]
            if not self.installed:
                self.installed, self.previous, sys.excepthook = True, sys.excepthook, self.hook

    def left(self, group: Group, exc: BaseException | None) -> None:
        """`group` is closing while `exc` passes (None: none does)."""
        if exc is not None and self._watched(group) and not getattr(exc, "burstcu_agreed", False):
            with suppress(AttributeError):
                exc.burstcu_left_group = group

    @staticmethod
    def _open(ref: weakref.ref) -> bool:
        group = ref()
        return group is not None and not group.closed

    def hook(self, kind, exc, tb) -> None:
        try:
            (self.previous or sys.__excepthook__)(kind, exc, tb)
        finally:   # a hook that fails must not keep the peers waiting
            group = next((ref() for ref in self.groups if self._open(ref)), None) or _left_group(exc)
            if group is not None and self._ends_the_job(exc):
                group.transport.fail(f"rank {group.rank} stops on an uncaught "
                                     f"{exception_text(kind, exc)} (outside any burstcu call, "
                                     f"its group {'closed by it' if group.closed else 'open'})")

    def _ends_the_job(self, exc: BaseException | None) -> bool:
        interactive = (sys.flags.interactive or sys.flags.inspect or os.environ.get("PYTHONINSPECT")
                       or hasattr(sys, "ps1"))
        return not (getattr(exc, "burstcu_agreed", False) or interactive
                    or "mpi4py.run" in sys.modules or os.getpid() != self.pid)


def _left_group(exc: BaseException | None) -> Group | None:
    """The group `exc`, or one it was raised from or while handling, closed on its way out."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if getattr(exc, "burstcu_left_group", None) is not None:
            return exc.burstcu_left_group
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def exception_text(kind: type[BaseException], exc: BaseException | None) -> str:
    """"ValueError: its message" for failure lines; an interrupt's empty message said in words."""
    try:
        said = str(exc) if exc is not None else ""
    except Exception:   # a message that cannot be made must not stop the failure line
        said = "(its message raised)"
    if not said:
        said = "interrupted (Ctrl-C or SIGINT)" if issubclass(kind, KeyboardInterrupt) else "no message"
    return f"{kind.__name__}: {said}"


UNCAUGHT = UncaughtEndsTheJob()


CLOSED = "this group is closed: make a new one with burstcu.init()"   # what a call on a closed group raises


class Call:
    """One public call on one rank (attention, unshard, barrier, ...), and what happens when it
    fails (docs/troubleshooting.md). Any exception leaving the call ends the whole group
    (`Transport.fail`: print the rank, the call, the step and the cause; abort every rank), since
    peers may be waiting for this rank; except errors raised inside `raising_together()`, which
    every rank raises alike (the agreement on the inputs), or `raising_alike()` (checks every
    rank makes alone on what it should hold alike). In a group of one the exception just
    rises."""

    def __init__(self, group: "Group", name: str):
        if not isinstance(group, Group):
            raise TypeError(not_a_group(group))
        if group.closed:
            raise ValueError(CLOSED)
        self.group, self.transport, self.name, self.together = group, group.transport, name, False
        self.owner = self.turn = self.shared = False
        self.outer = (None, "between calls")

    def __enter__(self) -> "Call":
        self.owner = self._enter()
        t = self.transport   # a call inside another's gets that one's name back on its way out
        self.outer = (getattr(t, "call", None), getattr(t, "where", "between calls"))
        self.transport.call, self.transport.where = self.name, "agreement on the inputs"
        return self

    def _enter(self) -> bool:
        """Take the group for this call: True, or False for a call inside this thread's own.
        On a group of several ranks a call from another thread while one runs is fatal: the
        calls' messages would pair with other calls' on the other ranks (the same tags, one
        communicator), and a group runs its calls one at a time, in the same order on every
        rank, as a communicator's collectives do; nothing could tell a wrong pairing from a
        right one. A group of one rank has no peer to pair with: on the host its calls wait
        their turn; on a GPU they run as they come (the device orders their work; a call
        waiting for a turn there could wait on a jitted program whose callback holds it)."""
        group, me = self.group, threading.get_ident()
        if group.size == 1 and group.ops.device == "cuda":
            with group.entry:
                if group.closed:
                    raise ValueError(CLOSED)
                group.sharers[me] = group.sharers.get(me, 0) + 1
            self.shared = True
            return False
        if group.size == 1:
            group.turn.acquire()
            self.turn = True
        with group.entry:
            if group.closed:      # closed while this call waited for its turn
                if self.turn:
                    self.turn = False
                    group.turn.release()
                raise ValueError(CLOSED)
            if group.calling is None:
                group.calling = (me, self.name)
                return True
            thread, running = group.calling
        if thread == me:
            return False
        reason = (f"rank {group.rank}: {self.name} was called from another thread while {running} "
                  f"runs on the same group. A group runs one call at a time, in the same order on "
                  f"every rank: give each thread its own group (another burstcu.init over the "
                  f"same ranks: comm=comm.Dup() for MPI, the same ProcessGroup for "
                  f"torch.distributed), or make the calls from one thread")
        self.transport.fail(reason)
        raise RuntimeError(reason)

    @contextmanager
    def raising_together(self):
        """Errors raised inside are raised on every rank alike: they end only this call. So are
        warnings made errors (`-W error`): what warns after an agreement warns on every rank."""
        try:
            yield
        except (ValueError, TypeError, Warning) as exc:
            self.together = True
            if not getattr(exc, "burstcu_peer_left", False):   # (the rank that left does not
                with suppress(AttributeError):   # raise it) for `UncaughtEndsTheJob`: every rank
                    exc.burstcu_agreed = True    # raises it
            raise
        except MemoryError as exc:   # only one every rank raised (`InputError.exception`)
            self.together = getattr(exc, "burstcu_agreed", False)
            raise
        self.transport.where = "after the agreement"

    @contextmanager
    def raising_alike(self):
        """Errors raised inside end only this call, as `raising_together`'s, but come from checks
        made without a message (KVCache.append, clear): every rank given the same arguments
        raises them, yet no rank knows the others did, so one left uncaught still ends the job
        (`UncaughtEndsTheJob`), where the peers would otherwise wait until the timeout."""
        try:
            yield
        except (ValueError, TypeError, MemoryError):
            self.together = True
            raise

    def __exit__(self, kind, exc, tb):
        t = self.transport
        try:
            if exc is not None and not self.together:
                t.fail(f"rank {t.rank} failed in {t.doing()}: {exception_text(kind, exc)}")
        finally:
            group, me = self.group, threading.get_ident()
            with group.entry:
                if self.owner:
                    group.calling = None
                if self.shared:
                    group.sharers[me] -= 1
                    if not group.sharers[me]:
                        del group.sharers[me]
                nested = (not self.owner and not self.shared) or group.sharers.get(me)
                idle = group.calling is None and not group.sharers
            if nested or not idle:   # inside this thread's own call (or, on a GPU group of one,
                t.call, t.where = self.outer   # beside another thread's): its name again
            else:
                t.call, t.where = None, "between calls"
            if self.turn:
                group.turn.release()
        return False


def not_a_group(group) -> str:
    """Why `group` is refused where a burstcu group goes (an mpi4py communicator, a rank
    number, ...)."""
    kind = f"{type(group).__module__}.{type(group).__qualname__}"
    hint = (" (an MPI communicator: make the group of its ranks with burstcu.init(comm=...))"
            if hasattr(group, "Get_rank") else "")
    return (f"group must be a burstcu group from burstcu.init() (or a burstcu.Sharding); got "
            f"{kind}{hint}")


def says_ranks(group, names: tuple = ("rank", "size")) -> bool:
    """Whether `group` has ints for `names` (its rank and size): what `shard` and `plan`, which
    send nothing, take (a Group, or any such object; `plan` needs only the size)."""
    values = [getattr(group, name, None) for name in names]
    return all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values)


def _host_transport(comm, progress: str, timeout: float | None, link: Link | None) -> Transport:
    """The data transport of the CPU backends over the host `comm`: itself when it is a
    transport (torch.distributed), else MPI (none for one process)."""
    if isinstance(comm, Transport):
        comm.timeout = timeout
        return comm
    if comm is None or comm.Get_size() == 1:
        transport = SelfTransport(timeout)
        transport.link = link  # nothing is sent, so nothing to pace; kept for the labels
        return transport
    return MPITransport(comm, progress=progress, timeout=timeout, link=link)


def _check_link(link, backend: str, comm=None) -> None:
    """TypeError unless `link` is a Link or None; ValueError when `backend` (given, or picked
    by "auto" alike on every rank) or the host `comm` (torch.distributed) does not run over MPI."""
    if link is None:
        return
    if not isinstance(link, Link):
        raise TypeError(f"link must be a burstcu.Link(gbps=..., latency_us=...) or None, not "
                        f"{type(link).__name__}")
    if isinstance(comm, TorchDistTransport):
        raise ValueError(f"link={link!r} emulates a network on the MPI transport; a group over "
                         f"torch.distributed moves data over gloo: leave link out, or start the "
                         f"job under mpiexec")
    if backend == "cupy":
        raise ValueError(f"link={link!r} emulates a network on the MPI transport (backends "
                         f"'numpy' and 'emulated'); backend {backend!r} moves data over NCCL, "
                         f"whose links are real: leave link out")


def _settings(backend: str, timeout, progress: str, link) -> dict:
    """This rank's init arguments and environment, checked (raises ValueError/TypeError) and
    as plain values the ranks compare: what every rank must have alike, and `gpu` (whether a
    GPU is usable here, for "auto"), which may differ."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if progress not in PROGRESS:
        raise ValueError(f"progress must be one of {PROGRESS}, not {progress!r}")
    _check_link(link, backend)
    gpu = gpu_usable() if backend == "auto" else None
    kernels = None
    if backend in ("emulated", "cupy") or gpu:   # kernels are built: $BURSTCU_BUILD_TIMEOUT,
        build_timeout()                         # and kept in a folder that must pass its trust
        try:                                    # rule here, not inside the first call (the
            if backend == "emulated":           # emulator's folder under it, and it, checked)
                from .build import emulate
                emulate.cache_dir()
            else:
                cache_dir()
        except RuntimeError as exc:             # a setting, as the others: every rank hears it
            raise ValueError(str(exc)) from exc
        kernels = (kernel_sources_digest(), str(kernel_dir()))
    return {"backend": backend, "timeout": resolve_timeout(timeout), "progress": progress,
            "link": None if link is None else (float(link.gbps), float(link.latency_us)),
            "gpu": gpu, "kernels": kernels}


def _check_same_kernels(every: list) -> None:
    """ValueError when ranks that will build kernels read different kernel sources (another
    $BURSTCU_KERNEL_DIR, another burstcu on another node): each would run its own kernels and
    the ranks' results would differ without a word. Compared only when every rank builds them
    (under "auto" a rank without a GPU makes the whole group NumPy)."""
    kernels = [settings["kernels"] for settings in every]
    if None in kernels or len({digest for digest, _ in kernels}) == 1:
        return
    ranks = ", ".join(f"rank {r} {folder} (sha256 {digest[:12]})"
                      for r, (digest, folder) in enumerate(kernels))
    raise ValueError(f"burstcu.init: ranks read different kernel sources: {ranks}; each would run "
                     f"its own kernels. Give every rank the same burstcu and the same "
                     f"$BURSTCU_KERNEL_DIR (or none)")


def _agreed_settings(comm, backend: str, timeout, progress: str, link) -> tuple[dict, list]:
    """(this rank's settings, every rank's) once every rank has checked its own: any rank's
    error, or ranks that differ, raise on every rank alike (nothing raises on one rank alone
    while the others wait in a collective). Bounded by this rank's timeout, else the default."""
    try:
        mine, error = _settings(backend, timeout, progress, link), None
    except Exception as exc:  # noqa: BLE001 - every rank hears of it in the round below
        mine, error = None, InputError(type(exc), f"burstcu.init: {exc}")
    if host_rank_size(comm)[1] == 1:
        if error:
            raise error.exception()
        return mine, [mine]
    reports = host_gather(comm, (error.plain() if error else None, mine), _wait_for_init(timeout),
                          "burstcu.init (every rank must call it)")
    failed = [(r, InputError.from_plain(e)) for r, (e, _) in enumerate(reports) if e is not None]
    if failed:
        rank, first = failed[0]
        raise first.exception(rank=rank)
    every = [settings for _, settings in reports]
    for key in ("backend", "timeout", "progress", "link"):
        values = [settings[key] for settings in every]
        if len(set(values)) > 1:
            differ = ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values) if v != values[0])
            raise ValueError(f"burstcu.init: ranks disagree on {key}: rank 0 {values[0]!r}, "
                             f"{differ}; every rank must pass the same arguments and environment "
                             f"(timeout: also $BURSTCU_TIMEOUT)")
    _check_same_kernels(every)
    return mine, every


def _resolve_backend(backend: str, every: list) -> tuple[str, bool]:
    """(backend, whether some rank has a usable GPU): "auto" is decided from every rank's
    settings alike, since ranks picking different backends would wait on each other forever."""
    if backend != "auto":
        return backend, False
    usable = [settings["gpu"] for settings in every]
    return ("cupy" if all(usable) else "numpy"), any(usable)


def _wait_for_init(timeout) -> float:
    """The bound on init's own waits: `timeout` when valid (else the default: a bad timeout is
    reported in the agreement, not raised on one rank)."""
    try:
        return resolve_timeout(timeout)
    except Exception:  # noqa: BLE001 - reported with the rest of this rank's settings
        return DEFAULT_TIMEOUT


def _warn_cpu_fallback(comm, why: str) -> None:
    if host_rank_size(comm)[0] == 0:
        warnings.warn(f"burstcu: backend 'auto' runs the NumPy CPU backend ({why})", stacklevel=3)


def init(comm=None, backend: str = "auto", *, timeout: float | None = None,
         progress: str = "thread", link: Link | None = None, **options) -> Group:
    """Create the group of all ranks of `comm` (default `MPI.COMM_WORLD`; without mpi4py, a
    group of one process).

    comm: an mpi4py communicator, or a torch.distributed ProcessGroup (e.g.
        `torch.distributed.group.WORLD` after `init_process_group`, under torchrun): its ranks
        are the group's, in its order. burstcu makes a private gloo group of them that carries
        the "numpy"/"emulated" backends' messages and, for "cupy", the NCCL bootstrap (unique id,
        agreement; the GPU is cuda:LOCAL_RANK) and metadata; any torch backend will do for
        `comm` itself ("nccl" too). No `link` there, and `progress` changes nothing (gloo moves
        messages on its own threads). A failure on one rank ends that process (torchrun stops
        the others).

    backend: "numpy", "emulated", "cupy" or "auto" (see the module docstring).
    timeout: seconds a rank may wait for a peer inside any burstcu call (agreement, exchange,
        collective) before it raises `burstcu.CommTimeoutError` naming the call, the step and the
        peer(s), and ends the job; default $BURSTCU_TIMEOUT, else 600. `math.inf` (or
        $BURSTCU_TIMEOUT=inf) waits forever. Waiting does not spin. It also bounds MPI's start,
        init's first step under an MPI launcher (at least 60 s there): a rank still waiting for
        the launch's other ranks then says so and ends its process (a rank that spends longer
        than that before its init keeps the others waiting past it: raise the timeout).
    progress: MPI transfers on a communication thread ("thread", overlapping compute) or on the
        caller's thread ("inline": the data moves only inside the engine's waits, so nothing
        overlaps; over a `link` each exchange's link time starts at its wait).
    link: a `burstcu.Link(gbps=..., latency_us=...)` to pace every MPI message to, as a network
        of that speed would (`burstcu.transport.link`): to measure overlap on one machine, whose
        shared memory is far faster than any network. The same on every rank. MPI transport
        only: refused with the "cupy" backend (and "auto" when it picks "cupy").
    deterministic (an option, on every backend): True makes two runs of the backward give the
        same bits. The CUDA kernels ("cupy", "emulated") then launch dK/dV and dQ kernels
        without atomics instead of adding dQ with fp32 atomics (`KernelOps(deterministic=True)`;
        ~7/5 of the backward's flops); the NumPy op is deterministic at any thread count
        already and ignores it.
    options: passed to the local op: deterministic on every backend; tile_q, tile_k, threads
        for "numpy" (`NumpyOps`); arch, randomize for "cupy" and "emulated" (`KernelOps`). An
        option the backend's op does not take is a TypeError that names those it does. Those
        that change the bits computed (`LocalOps.agreed_options`) the same on every rank.
    Collective over `comm`: every rank must call it. MPI is initialised first, so that under
    `python -m mpi4py` anything init raises on one rank ends the job; then every rank checks
    its arguments and environment, and one bounded agreement raises the same error on every
    rank if any rank's are bad or the ranks' differ. Close the group when done (`close()`, or
    use it as a context manager). While a group of several MPI ranks is open, an exception no
    code catches on one rank ends every rank, as under `-m mpi4py` (`UncaughtEndsTheJob`).
    """
    if comm is not None and not (torch_process_group(comm) or hasattr(comm, "Get_rank")):
        mesh = " (a DeviceMesh: pass mesh.get_group())" if hasattr(comm, "get_group") else ""
        raise TypeError(f"burstcu.init: comm must be an mpi4py communicator or a "
                        f"torch.distributed ProcessGroup{mesh}, not a {type(comm).__name__}")
    users_comm = comm = world_comm(comm, timeout)
    with _one_init_at_a_time(users_comm):
        if torch_process_group(comm):
            comm = TorchDistTransport(comm, _wait_for_init(timeout))
            comm.call, comm.where = "burstcu.init", "the agreement on its arguments"
        try:
            return _init_over(comm, users_comm, backend, timeout, progress, link, options)
        except BaseException:
            if isinstance(comm, TorchDistTransport):
                comm.close()   # idempotent: a transport that took it over may have closed it
            raise


_INITS: dict[Any, tuple] = {}   # a communicator inside `init` on this rank -> (thread id, name)
_INITS_LOCK = threading.Lock()


@contextmanager
def _one_init_at_a_time(comm):
    """RuntimeError where another thread of this rank is inside `init` over the same
    communicator (an mpi4py one by handle; a ProcessGroup by identity): the start-up
    collectives of the two would interleave, and each rank would pair them differently."""
    if comm is None:
        yield
        return
    key = comm.py2f() if hasattr(comm, "py2f") else id(comm)
    me = (threading.get_ident(), threading.current_thread().name)
    with _INITS_LOCK:
        other = _INITS.setdefault(key, me)
    if other != me:
        raise RuntimeError(f"burstcu.init: thread {other[1]!r} is inside burstcu.init over the same "
                           f"communicator on this rank: their start-up collectives would "
                           f"interleave, paired differently on each rank. Make the groups one "
                           f"after another from one thread, in the same order on every rank, then "
                           f"give each thread its own")
    try:
        yield
    finally:
        with _INITS_LOCK:
            del _INITS[key]


def _init_over(comm, users_comm, backend: str, timeout, progress: str, link, options) -> Group:
    """`init` over the host `comm` (an mpi4py communicator, a TorchDistTransport, or None)."""
    mine, every = _agreed_settings(comm, backend, timeout, progress, link)
    timeout = mine["timeout"]
    asked = backend
    backend, some_gpu = _resolve_backend(backend, every)
    _check_link(link, backend, comm)
    if asked == "auto" and backend == "numpy" and some_gpu:   # a CPU-only machine is no surprise
        _warn_cpu_fallback(comm, "some ranks have a usable GPU, not every rank")
    if backend == "cupy":
        try:
            transport, _device = bootstrap(comm, timeout)   # makes the node-local GPU current
        except BackendUnavailable as exc:  # raised on every rank alike, so all fall back together
            if asked != "auto":
                raise
            _warn_cpu_fallback(comm, str(exc))
            backend = "numpy"
    if backend != "cupy":
        transport = _host_transport(comm, progress, timeout, link)
    if isinstance(comm, Transport):
        comm.call, comm.where = None, "between calls"
    ops = _agreed_ops(transport, backend, options)
    return _counted(Group(transport.rank, transport.size, backend, transport, ops, users_comm))


def _agreed_ops(transport: Transport, backend: str, options: dict) -> LocalOps:
    """The local op of `backend` made with `options` on every rank, or the same error on every
    rank (one more agreement round: a bad option, one rank short of memory, or ops whose
    `agreed_options` differ between ranks (the NumPy op's tile sizes, the kernels'
    deterministic) raise everywhere, with the transport closed)."""
    ops = error = None
    try:
        ops = _local_op(backend, options)
    except Exception as exc:  # noqa: BLE001 - whatever fails here fails on every rank
        error = InputError(type(exc), f"burstcu.init: the {backend!r} local op: {exc}")
    taken = None if error else ((), (), ops.agreed_options())   # as a call's metadata
    try:
        agree(transport, error, taken, "burstcu.init (the local op)", sites=False)
    except BaseException:
        if ops is not None:
            ops.close()
        transport.close()
        raise
    return ops


def _local_op(backend: str, options: dict) -> LocalOps:
    """The local op of `backend` ("numpy", "emulated", "cupy") made with `options`; TypeError
    naming the options it takes for any other (not the constructor's own message)."""
    op_class = NumpyOps if backend == "numpy" else KernelOps
    takes = [name for name in inspect.signature(op_class).parameters if name != "backend"]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))}: it takes {', '.join(takes)}")
    return NumpyOps(**options) if backend == "numpy" else KernelOps(backend, **options)


def loopback_group(hub, rank: int, backend: str = "numpy", **options) -> Group:
    """Rank `rank` of a loopback world: ranks as threads of one process sharing one device
    (`burstcu.transport.loopback`). Call on the rank's own thread; on "cupy", with that thread's
    own compute stream current. `burstcu.testing.world.run_ranks` starts such a world."""
    if backend not in DEVICE_OF:
        raise ValueError(f"backend must be 'numpy', 'emulated' or 'cupy', not {backend!r}")
    ops = _local_op(backend, options)
    device = CupyCopyDevice() if on_gpu(backend) else HostDevice()
    transport = LoopbackTransport(rank, hub, device)
    return Group(rank, hub.size, backend, transport, ops)


_LOCAL: dict[tuple, Group] = {}   # (backend, CUDA device or None) -> its group of one


def _fresh_turns_in_a_child() -> None:
    """A forked child's cached groups of one with their locks free (a thread of the parent,
    absent in the child, may have held one at the fork: the child's first call would wait on it
    forever)."""
    me = threading.get_ident()
    for group in _LOCAL.values():
        if group.calling is not None and group.calling[0] == me:
            continue   # forked inside a call: this thread, in the child too, still holds it
        group.entry, group.turn, group.calling = threading.Lock(), threading.RLock(), None
        group.sharers = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_turns_in_a_child)


def local_group(backend: str = "numpy") -> Group:
    """The cached group of one process used when `group=None`; on "cupy", CuPy's current
    device's (an op is bound to the device it was made on: `KernelOps.current_device`)."""
    key = (backend, _current_cuda_device() if on_gpu(backend) else None)
    if key not in _LOCAL:
        if backend == "numpy":
            ops: LocalOps = NumpyOps()
        else:
            ops = KernelOps(backend)
        _LOCAL[key] = Group(0, 1, backend, SelfTransport(), ops)
    return _LOCAL[key]


def _current_cuda_device() -> int:
    import cupy
    return int(cupy.cuda.runtime.getDevice())
