"""Transport over torch.distributed, for programs that already run it (torchrun, or their own
`init_process_group`): `burstcu.init(comm=<a torch.distributed ProcessGroup>)`.

It plays the part MPI plays elsewhere, on a private gloo group of the same processes, in the
same order (made from torch's default store under a key prefix of its own, like MPI's
duplicated communicator: its messages never match the program's own, and no group the program
makes or has made changes its name):

* the host side of every backend: the agreement rounds (`allgather_object`, gathered on rank 0
  by point-to-point messages and answered, so rank 0 names a rank that never arrives), the
  NCCL bootstrap of the "cupy" backend (unique id), sub-groups for USP;
* the data of the CPU backends ("numpy", "emulated"): each ring step's exchange as gloo sends
  and receives of the buffers' bytes (zero-copy views of the NumPy arrays). Gloo moves them on
  its own threads, so the exchange runs behind the step's compute with no progress thread of
  ours (`progress=` changes nothing here); on a GPU, the "cupy" backend's data goes over its
  own NCCL communicator instead.

Gloo reports a point-to-point message complete only inside `wait`, so every wait is gloo's
own blocking wait bounded by what is left of the transport's deadline (a timed-out wait raises
`CommTimeoutError` naming the peer). A failure inside a call ends this process with status 1
(`Transport.fail` prints why first): torchrun then stops the job's other processes, and a peer
waiting on this one sees its connection close and fails too, naming it.

No emulated link (`burstcu.Link`): it paces MPI messages only.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np

from . import wire
from .base import MAX_WAIT_S, PeerFailedError, Transport, agreed, answer_of, nbytes

_TAG_RING = 7          # a ring step's exchange
_TAG_LENGTH = 8        # an agreement message's length (int64), then
_TAG_MESSAGE = 9       # its bytes
PEER_GONE = "that rank may have died, exited or closed its burstcu group"   # a closed connection
_MADE: dict[str, int] = {}   # gloo groups made over each torch group so far (their key prefixes)


def torch_process_group(comm: Any) -> bool:
    """Whether `comm` is a torch.distributed ProcessGroup (torch is not imported to ask: a
    program holding one has imported it). A process outside the group it names holds torch's
    NON_GROUP_MEMBER instead: ValueError, saying so."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return False
    outside = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", object())
    if isinstance(comm, int) and comm == outside:
        raise ValueError("burstcu.init(comm=...): this process is not a member of that "
                         "torch.distributed group (torch gave it NON_GROUP_MEMBER); call "
                         "burstcu.init on the group's members only")
    return isinstance(comm, getattr(dist, "ProcessGroup", ()))


def _byte_tensor(buf: np.ndarray):
    """The bytes of a C-contiguous host array as a torch uint8 tensor sharing its memory."""
    import torch

    if not buf.flags.c_contiguous:
        raise ValueError("the torch.distributed transport needs C-contiguous buffers")
    return torch.from_numpy(buf.reshape(-1).view(np.uint8))


def _seconds(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=min(seconds, MAX_WAIT_S))


def _gloo(prefix: str, rank: int, size: int, timeout: float):
    """A gloo process group of `size` processes over torch's default store, under `prefix`
    (collective over them: each waits for the others to connect, at most `timeout` s). A rank
    that cannot connect ends its process, as the MPI transport aborts the world then: the
    processes that did arrive are blocked in the same connection, and a retry could not agree
    on the prefix (each process numbers the groups it made)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    store = dist.PrefixStore(f"burstcu/{prefix}/", distributed_c10d._get_default_store())
    try:
        return dist.ProcessGroupGloo(store, rank, size, _seconds(timeout))
    except Exception as exc:  # noqa: BLE001 - torch's store timeout, or a missing gloo
        sys.stderr.write(
            f"burstcu: rank {rank}: connecting burstcu's gloo group {prefix!r} of {size} "
            f"processes failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}) "
            f"within {timeout:g} s: every process of the group must make it (burstcu.init, or "
            f"the same burstcu call); a rank may have failed or exited before it, or passed "
            f"burstcu.init another ProcessGroup (every rank must pass the same one)\n"
            f"burstcu: rank {rank} ends its process\n")
        sys.stderr.flush()
        os._exit(1)


class _Waiter:
    """One daemon thread that runs the main thread's waits (`TorchDistTransport._late`): the
    main thread waits on an event meanwhile, which a signal interrupts. A daemon, and fed
    through a queue, so that a wait left behind by an interrupt never holds the interpreter's
    exit, and waits made in an `atexit` handler still run (an executor refuses them then)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="burstcu-gloo-wait").start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            self._run_one(*job)
            # nothing of a finished wait is held while idle: a daemon's frame outlives the
            # interpreter, and the transport's gloo group kept alive past it aborts the process
            del job

    @staticmethod
    def _run_one(fn, done: threading.Event, box: list) -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - raised again on the waiting thread
            box.append((False, exc))
        done.set()

    def run(self, fn):
        """fn() on the waiting thread: its result, or its exception raised here."""
        done, box = threading.Event(), []
        self.jobs.put((fn, done, box))
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self.jobs.put(None)   # the thread ends after the wait it is in, if any


class TorchDistTransport(Transport):
    """Ring exchange and agreement over a private gloo group of a torch.distributed group.

    group: the program's ProcessGroup (its ranks, in its order, are this transport's ranks).
    timeout: seconds a wait for a peer may take (`resolve_timeout`).
    Collective over `group`: every rank makes it (the private group's creation waits for every
    rank, bounded by `timeout`).
    """

    name = "torch.distributed"

    def __init__(self, group: Any, timeout: float | None = None, *, _prefix: str | None = None,
                 _rank: int | None = None, _size: int | None = None):
        import torch.distributed as dist

        if _prefix is None:
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            name = str(getattr(group, "group_name", "") or "world")
            _MADE[name] = _MADE.get(name, 0) + 1        # every member makes the same count
            # torchrun's store outlives a restart, which counts from 1 again: the attempt's own
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")   # keys, not the last's
            _prefix = f"{name}/{_MADE[name]}" if restart == "0" else \
                f"{name}/{_MADE[name]}.restart{restart}"
        else:
            rank, size = _rank, _size
        super().__init__(rank, size, timeout)
        if group is not None and _rank is None:
            try:   # the default group's ranks of this group's, for messages
                self.job_ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
            except Exception:  # noqa: BLE001 - an older torch: messages say group ranks alone
                pass
        self.prefix = _prefix
        self.group = _gloo(_prefix, rank, size, self.timeout)
        self._works: list[tuple[Any, str]] = []   # posted messages and the peer each waits on
        self._waiter: _Waiter | None = None   # the main thread's waits run there
        self._last_allgather: tuple = ()   # (see `allgather`)

    def _posted(self, post, peer: str):
        """post() -> a gloo Work; torch's own errors in posting (this rank's alone) raised as
        PeerFailedError, which ends the group (not an input error every rank shares)."""
        try:
            return post()
        except Exception as exc:  # noqa: BLE001
            raise PeerFailedError(f"rank {self.top_rank(self.rank)}: gloo refused a message to or "
                                  f"from {peer} during {self.doing()}: {type(exc).__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''} ({PEER_GONE})"
                                  ) from None

    def _send(self, tensor, dst: int, tag: int, peer: str):
        return self._posted(lambda: self.group.send([tensor], dst, tag), peer), peer

    def _recv(self, tensor, src: int, tag: int, peer: str):
        return self._posted(lambda: self.group.recv([tensor], src, tag), peer), peer

    # -- waiting ----------------------------------------------------------------------------------
    def _left(self, deadline: float) -> datetime.timedelta:
        """What is left until `deadline`, as gloo takes it (at least a millisecond: gloo reads
        zero as "its own default")."""
        return _seconds(max(1e-3, deadline - time.monotonic()))

    def _arrived(self, work, peer: str, deadline: float) -> bool:
        """Wait for one posted message until `deadline`: True when it completed, False past the
        deadline; a peer's failure raises PeerFailedError naming `peer`."""
        try:
            work.wait(self._left(deadline))
            return True
        except Exception as exc:  # noqa: BLE001 - gloo's RuntimeError: timeout or a lost peer
            if time.monotonic() < deadline and "imed out" not in str(exc):
                raise PeerFailedError(
                    f"rank {self.top_rank(self.rank)}: gloo failed while waiting for {peer} "
                    f"during {self.doing()}: {str(exc).splitlines()[0]} ({PEER_GONE})") from None
            return False

    def _late(self, works: list[tuple[Any, str]], deadline: float) -> list[str]:
        """The peers of `works` whose messages did not complete by `deadline` (`_arrived`). On
        the main thread the waits run on the transport's waiting thread, while this one waits
        in Python: gloo's wait holds the thread in C++ until it returns, and Python runs signal
        handlers (Ctrl-C's KeyboardInterrupt, a SIGTERM handler that saves a checkpoint) only
        on the main thread between its instructions, so a signal to a rank whose peer is stuck
        would wait for the deadline."""
        def wait() -> list[str]:
            return [peer for work, peer in works if not self._arrived(work, peer, deadline)]
        if threading.current_thread() is not threading.main_thread():
            return wait()
        if self._waiter is None:
            self._waiter = _Waiter()
            weakref.finalize(self, self._waiter.close)   # a group dropped unclosed: its thread ends
        return self._waiter.run(wait)

    def _finish(self, works: list[tuple[Any, str]], deadline: float, on_timeout) -> None:
        """Wait for every posted message until `deadline`; past it raise `on_timeout(peers)`
        naming the peers still awaited (those not in by then: each asked once more)."""
        late = self._late(works, deadline)
        if late:
            raise on_timeout(" and ".join(dict.fromkeys(late)))

    # -- the ring exchange ------------------------------------------------------------------------
    def _post(self, exchanges):
        for send_buf, recv_buf, dst, src in exchanges:
            if recv_buf is not None and nbytes(recv_buf):
                self._works.append(self._recv(_byte_tensor(recv_buf), src, _TAG_RING,
                                              f"rank {self.top_rank(src)}'s message"))
            if send_buf is not None and nbytes(send_buf):
                self._works.append(self._send(_byte_tensor(send_buf), dst, _TAG_RING,
                                              f"rank {self.top_rank(dst)} to take this rank's "
                                              f"message"))

    def _wait(self):
        works, self._works = self._works, []
        self._finish(works, self.deadline(), self.timed_out)

    # -- agreement and collectives ----------------------------------------------------------------
    def _send_message(self, payload: bytes, dst: int) -> list:
        import torch

        peer = f"rank {self.top_rank(dst)} to take this rank's agreement message"
        length = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [self._send(length, dst, _TAG_LENGTH, peer), self._send(data, dst, _TAG_MESSAGE, peer)]

    def _post_length(self, src: int):
        """(the int64 tensor, the posted receive) of `src`'s next agreement message length."""
        import torch

        length = torch.zeros(1, dtype=torch.int64)
        work, _ = self._recv(length, src, _TAG_LENGTH, f"rank {self.top_rank(src)}")
        return length, work

    def _take_message(self, src: int, length, deadline: float, limit: int, on_timeout) -> bytes:
        """`src`'s agreement message, whose `length` tensor has arrived. A length out of bounds
        is this rank's alone to see: PeerFailedError (it ends the group)."""
        import torch

        n = int(length[0])
        if not 0 < n <= limit:
            raise PeerFailedError(f"rank {self.top_rank(src)} sent an agreement message of {n} "
                                  f"bytes (at most {limit}). Are all ranks running the same "
                                  f"burstcu?")
        data = torch.zeros(n, dtype=torch.uint8)
        self._finish([self._recv(data, src, _TAG_MESSAGE, f"rank {self.top_rank(src)}'s "
                                                          f"agreement message")],
                     deadline, on_timeout)
        return data.numpy().tobytes()

    def allgather_object(self, obj, what: str = "metadata"):
        """Every rank's `obj` (plain values: `burstcu.transport.wire`) in rank order, gathered on
        rank 0 and sent back, as `MPITransport.allgather_object` does: rank 0 names the ranks
        that never arrive; ranks inside different calls raise ValueError on every rank."""
        mine = wire.labelled(what, obj)
        deadline = self.deadline()
        answer_limit = self.size * wire.MAX_BYTES
        if self.rank != 0:
            sends = self._send_message(mine, 0)
            length, work = self._post_length(0)
            answer_late = lambda _: self.timed_out(
                "rank 0's answer to the agreement round (rank 0, or a rank it waits for, may "
                "have failed or exited)")
            self._finish([(work, "rank 0's answer")], deadline + 2.0, answer_late)
            answer = self._take_message(0, length, deadline + 2.0, answer_limit, answer_late)
            self._finish(sends, deadline, self.timed_out)
            return agreed(wire.decode(answer, limit=answer_limit))
        lengths = {r: self._post_length(r) for r in range(1, self.size)}
        peers = {r: f"rank {self.top_rank(r)}" for r in lengths}
        late = self._late([(work, peers[r]) for r, (_, work) in lengths.items()], deadline)
        missing = [r for r in lengths if peers[r] in late]
        if missing:
            raise self.timed_out(f"rank(s) {[self.top_rank(r) for r in missing]} to reach the "
                                 f"agreement round (they may have failed, exited, or be inside "
                                 f"another call)")
        got = [wire.unlabelled(mine)] + [
            wire.unlabelled(self._take_message(r, lengths[r][0], deadline, wire.MAX_BYTES,
                                               self.timed_out)) for r in range(1, self.size)]
        payload = wire.encode(answer_of(got), limit=answer_limit)
        sends = [s for r in range(1, self.size) for s in self._send_message(payload, r)]
        self._finish(sends, deadline, self.timed_out)
        return agreed(wire.decode(payload, limit=answer_limit))

    def allgather(self, send_buf, recv_buf):
        """Counted as G-1 messages of send_buf's size each way (`CommStats`); recv_buf holds the
        ranks' pieces in this transport's rank order (the gloo group's). The host blocks until
        it completes: `stats.wait_seconds`."""
        pieces, send = list(_byte_tensor(recv_buf).view(self.size, -1).unbind(0)), _byte_tensor(send_buf)
        with self._blocking():
            work = self._posted(lambda: self.group.allgather([pieces], [send]),
                                "every rank's allgather")
            self._finish([(work, "every rank's allgather")], self.deadline(), self.timed_out)
        # kept until the next allgather or the close: gloo's thread lets go of a finished
        # allgather just after the wait returns, and where it lets go last it takes the GIL to
        # free the tensors, which at the interpreter's exit (an allgather the program's last
        # call) ends the process: "terminate called without an active exception"
        self._last_allgather = (work, pieces, send)
        n = nbytes(send_buf) * (self.size - 1)
        self.stats.bytes_sent += n
        self.stats.bytes_received += n
        self.stats.messages += self.size - 1

    def barrier(self):
        self.allgather_object(None, "barrier")

    # -- sub-groups -------------------------------------------------------------------------------
    def _split(self, color, key, members, name):
        """A gloo group of `members` in their order (only they make it; its key prefix is this
        group's, the split's name and the color: made once, `Transport.split`)."""
        return TorchDistTransport(None, self.timeout, _prefix=f"{self.prefix}/{name}/{color}",
                                  _rank=members.index(self.rank), _size=len(members))

    # -- failures and cleanup ---------------------------------------------------------------------
    ending = "ends its process (torchrun then stops the others; a peer waiting on it fails, naming it)"

    def _abort(self, reason: str):
        """End this process (the reason is printed): torchrun then stops the others."""
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def close(self):
        self._close_subgroups()
        self.group = None   # gloo closes its connections when the group is freed
        self._last_allgather = ()
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None


__all__ = ["TorchDistTransport", "torch_process_group"]
