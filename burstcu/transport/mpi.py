"""MPI transport (mpi4py), the CPU analogue of a dedicated communication stream.

MPICH progresses a large non-blocking transfer only while some thread is inside an MPI call, so
`Isend`/`Irecv` posted from the compute thread would mostly move while the host sits in a wait:
no overlap. With ``progress="thread"`` (the default) one worker thread posts each step's exchange
and drives it to completion, while the main thread computes in NumPy/BLAS (which release the
GIL). That thread plays the role the NCCL stream plays on a GPU. ``progress="inline"`` posts and
waits on the caller's thread, for comparison in benchmarks.

No wait spins and none is unbounded: requests are tested with sleeps in between that grow
with the time waited (`poll_until`: 5% of it, at most 10 ms), and every wait for a peer ends at
the transport's deadline with `CommTimeoutError` naming the peer. The metadata agreement
(`allgather_object`) gathers on rank 0 by point-to-point messages and answers every rank, so a
rank that never arrives is named by rank 0; its messages are plain values in a fixed encoding
(`burstcu.transport.wire`, never pickle); the calls being agreed on are named too, so ranks
inside different burstcu calls get the same error instead of matching each other's collectives.

``link=Link(gbps, latency_us)`` paces every message as a network of that speed would
(`burstcu.transport.link`): the progress thread sleeps until each exchange's paced completion
after MPI has moved it, so on one machine the exchange takes as long as on that link and still
runs behind the compute. With ``progress="inline"`` the data moves only inside `wait`, so the
link's clock for an exchange starts there too (not at its post): the wait takes the link's time
for it however long the compute in between, and nothing is hidden.

A wait that times out names only the peers whose requests are still incomplete ("rank 2's
message", "rank 1 to take this rank's message"), not those whose messages already went through;
when MPI has moved everything and the emulated link alone is late, it names the exchange's peers
and the link.

A rank that leaves a group (closes it, or its program ends with it open) tells its peers so
(`say_left`): a peer inside a call it never made (one more batch) fails at once, naming it,
instead of waiting out its timeout. The communicator is freed only once the peers' own notices
have come back (`_Parked`): MPI hands a freed communicator's context to the next one made, where
a late notice would be read as a message of that one's.

The transport duplicates the user's communicator, so its messages can never match the user's.
Before it exists, the start-up gathers (`gather_plain`) use collectives only, which match no
message of the user's (and cannot tell which rank is late).
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import Any

import numpy as np

from .base import (ABORT_GRACE_S, LEFT, CommTimeoutError, PeerFailedError, Transport, agreed,
                   answer_of, deadline_after, left_raising, nbytes, poll_until, sleep_until)
from . import wire
from .link import Link, port_of, release_port

PROGRESS = ("thread", "inline")   # where transfers progress: a worker thread, or the caller's
_TAG_RING = 7
_TAG_AGREE = 8
_ROOT_GRACE_S = 2.0  # other ranks wait this much longer, so rank 0 names a missing rank first
# a round that finds a peer left as its own exception passed (`left_raising`) waits this long
# before raising: left uncaught, that exception aborts the job first (its traceback, then
# `Transport.fail`'s line and ABORT_GRACE_S), and its message is the job's only one
LEFT_RAISING_GRACE_S = 2.0
_FAREWELLS: list[bytes] = []   # what `say_left` sent, alive for as long as MPI might read it


class _Parked:
    """Communicators closed by this rank whose peers may still send on them: the `say_left`
    notice is the last message a rank sends there, so a communicator is freed once this rank
    has taken the notice of every peer that sends it one (`MPITransport._notice_peers`), and
    whatever came before it. Freed earlier, its context could be handed to a new communicator
    (MPICH reuses them) where a late notice would be taken as that one's message (one of the
    next group's, or of the user's); until then it stays, and each transport made or closed
    frees those whose peers have all spoken."""

    def __init__(self):
        self.comms: list[tuple[Any, set]] = []   # (communicator, peers not heard from yet)
        self.lock = threading.Lock()

    def park(self, comm, peers: set) -> None:
        with self.lock:
            self.comms.append((comm, set(peers)))
        self.free_heard()

    def free_heard(self) -> None:
        from mpi4py import MPI

        if MPI.Is_finalized():   # (any MPI call would end the process)
            return
        with self.lock:
            waiting = []
            for comm, peers in self.comms:
                try:
                    peers -= {peer for peer in peers if _took_notice(comm, peer)}
                    if not peers:
                        comm.Free()
                except Exception:  # noqa: BLE001 - MPI finalized (interpreter exit): all gone
                    continue
                if peers:
                    waiting.append((comm, peers))
            self.comms = waiting


def _took_notice(comm, peer: int) -> bool:
    """Take every message `peer` has sent on `comm` so far; whether its `say_left` notice (the
    last it sends there) was among them."""
    from mpi4py import MPI

    while True:
        status = MPI.Status()
        message = comm.Improbe(source=peer, tag=MPI.ANY_TAG, status=status)
        if message is None:
            return False
        data = bytearray(status.Get_count(MPI.BYTE))
        message.Recv([data, MPI.BYTE])
        if status.Get_tag() == _TAG_AGREE and _is_notice(bytes(data)):
            return True


def _is_notice(data: bytes) -> bool:
    """Whether agreement bytes are a `say_left` notice: rank 0's answer {"left": ...}, or another
    rank's message labelled as the call `LEFT`."""
    try:
        message = wire.decode(data)
    except ValueError:
        return False
    if isinstance(message, dict):
        return "left" in message
    label, _, _ = wire.unlabelled(data)
    return label.startswith(LEFT)


PARKED = _Parked()


def _byte_view(buf: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 array (works for ml_dtypes too)."""
    if not buf.flags.c_contiguous:
        raise ValueError("MPI transport needs C-contiguous buffers")
    return buf.reshape(-1).view(np.uint8)


def _peers(pending: list) -> str:
    """The peers of [(request, peer)] as a message names them: "rank 2's message and rank 1 to
    take this rank's message" (each once)."""
    return " and ".join(dict.fromkeys(peer for _, peer in pending))


def _sleep_until(moment: float, deadline: float, on_timeout) -> None:
    """Sleep until `moment` (an exchange's completion on the emulated link); past `deadline`
    raise `on_timeout()` instead of sleeping on."""
    if moment > deadline:
        sleep_until(deadline)
        raise on_timeout()
    sleep_until(moment)


def _send(comm, payload: bytes, dest: int):
    """Post one agreement message (wire bytes) to `dest`; the request."""
    from mpi4py import MPI

    return comm.Isend([payload, MPI.BYTE], dest=dest, tag=_TAG_AGREE)


def _take(comm, source: int) -> bytes | None:
    """The agreement message `source` sent, if one has arrived (else None): its bytes, received
    whatever their length; what they hold is `wire.decode`'s business, never unpickled."""
    from mpi4py import MPI

    status = MPI.Status()
    message = comm.Improbe(source=source, tag=_TAG_AGREE, status=status)
    if message is None:
        return None
    data = bytearray(status.Get_count(MPI.BYTE))
    message.Recv([data, MPI.BYTE])
    return bytes(data)


# communicators (by handle) whose start-up gather timed out -> (what it was, its requests and
# buffers, kept: MPI may still complete it and write into them). MPI cannot withdraw a posted
# collective, so the next one over the communicator would pair with it on the ranks that came
# late: a retried init read another round's bytes as a length. `gather_plain` refuses instead.
_STALLED: dict[int, tuple[str, list]] = {}


def gather_plain(comm, obj, timeout: float, what: str) -> list:
    """Every rank's `obj` (plain values, `wire`) over a raw mpi4py communicator, before any
    transport exists (`burstcu.init`, the NCCL bootstrap, the self-test): non-blocking
    all-gathers of the lengths, then of the labelled messages, each bounded by `timeout`
    seconds (past it, CommTimeoutError naming `what`; every later gather over `comm` then
    raises RuntimeError at once, `_STALLED`). Every rank decodes every message, so a message
    that cannot be used, or ranks in different rounds, raise ValueError on every rank."""
    from mpi4py import MPI

    key = comm.py2f()
    if key in _STALLED:
        stale = _STALLED[key][0]
        raise RuntimeError(f"rank {comm.Get_rank()} cannot start {what}: an earlier "
                           f"{'one' if stale == what else stale} timed out on this communicator, "
                           f"and MPI cannot withdraw a collective once posted: a new one would "
                           f"pair with it on the ranks that came late. "
                           f"End the job (every rank), and give the next run a longer timeout "
                           f"(burstcu.init(timeout=...) or $BURSTCU_TIMEOUT)")
    deadline = deadline_after(timeout)
    held = []   # the requests and buffers of the collectives posted, which MPI may yet use

    def timed_out() -> CommTimeoutError:
        _STALLED[key] = (what, held)
        return CommTimeoutError(f"rank {comm.Get_rank()} waited {timeout:g} s for every rank of the "
                                f"communicator to reach {what} (a rank may have failed, exited or "
                                f"be stuck before it)")

    data = np.frombuffer(wire.labelled(what, obj), np.uint8)
    sizes, mine = np.zeros(comm.Get_size(), np.int64), np.array([data.size], np.int64)
    request = comm.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T])
    held += [request, mine, sizes, data]
    poll_until(request.Test, deadline, timed_out)
    if sizes.max() > wire.MAX_BYTES:
        raise ValueError(f"rank {int(sizes.argmax())} sent {int(sizes.max())} bytes, over the "
                         f"{wire.MAX_BYTES}-byte bound of agreement messages")
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    gathered = np.empty(int(sizes.sum()), np.uint8)
    request = comm.Iallgatherv([data, MPI.BYTE], [gathered, (sizes, offsets), MPI.BYTE])
    held += [request, gathered, offsets]
    poll_until(request.Test, deadline, timed_out)
    return agreed(answer_of([wire.unlabelled(gathered[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]))


def _world_ranks(comm) -> tuple[int, ...] | None:
    """The ranks in MPI's world of `comm`'s ranks (a communicator split from it), or None
    where they cannot be told (an inter-communicator, a rank outside the world)."""
    from mpi4py import MPI

    mine = world = None
    try:
        mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        ranks = tuple(int(r) for r in MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world))
    except Exception:  # noqa: BLE001 - only the messages would have used them
        return None
    finally:
        for g in (mine, world):
            if g is not None:
                g.Free()
    return None if MPI.UNDEFINED in ranks else ranks


class MPITransport(Transport):
    name = "mpi"
    abort_ends_every_rank = True

    def __init__(self, comm: Any, progress: str = "thread", timeout: float | None = None,
                 link: Link | None = None):
        if progress not in PROGRESS:
            raise ValueError(f"progress must be one of {PROGRESS}, not {progress!r}")
        if link is not None and not isinstance(link, Link):
            raise TypeError(f"link must be a burstcu.Link or None, not {type(link).__name__}")
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        self.job_ranks = _world_ranks(comm)
        # peers whose `say_left` notice a round has taken -> that notice (rank 0's: its answer;
        # the others': their message, unlabelled), which stands for them in every later round
        self.heard_left: dict[int, Any] = {}
        self.where = "creating the group (every rank must call burstcu.init)"
        PARKED.free_heard()
        self.comm, request = comm.Idup()  # a private communicator; bounded like every wait
        poll_until(request.Test, self.deadline(), lambda: self._init_timed_out(comm))
        self.where = "between calls"
        self.progress = progress
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="burstcu-comm") if progress == "thread" else None
        self._pending: list[Future] = []   # progress="thread": one future an exchange
        # per pending future: [(request or None, peer)] still incomplete (the progress thread
        # replaces it as requests complete), every peer of its exchange (for timeout messages),
        # and when the link has paced it (`_post`)
        self._posted: list[tuple[list, str, float]] = []
        self._requests: list[tuple[Any, str]] = []    # progress="inline": (request, peer)
        self._unpaced: list[tuple[list, list]] = []   # progress="inline": sizes sent, received
        self.link = link
        self._port = port_of(link) if link is not None else None

    def _init_timed_out(self, comm):
        """Print and abort through the user's communicator (ours is not made yet): the ranks that
        did arrive are blocked in the same duplication."""
        exc = self.timed_out("every rank of the communicator to call burstcu.init (a rank may "
                             "have failed or exited before it)")
        sys.stderr.write(f"burstcu: {exc}\nburstcu: rank {self.rank} ends all {self.size} ranks\n")
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        comm.Abort(1)
        return exc

    # -- the ring exchange -----------------------------------------------------------------------
    def _waited_for(self, exchanges) -> list[str]:
        """The peer each request of `exchanges` waits for, in `_start`'s order."""
        peers = []
        for send_buf, recv_buf, dst, src in exchanges:
            if recv_buf is not None:
                peers.append(f"rank {self.top_rank(src)}'s message")
            if send_buf is not None:
                peers.append(f"rank {self.top_rank(dst)} to take this rank's message")
        return peers

    def _start(self, exchanges) -> list[tuple[Any, str]]:
        """Post the exchanges' receives and sends: [(request, the peer it waits for)]."""
        from mpi4py import MPI

        reqs = []
        for send_buf, recv_buf, dst, src in exchanges:
            if recv_buf is not None:
                reqs.append(self.comm.Irecv([_byte_view(recv_buf), MPI.BYTE], source=src, tag=_TAG_RING))
            if send_buf is not None:
                reqs.append(self.comm.Isend([_byte_view(send_buf), MPI.BYTE], dest=dst, tag=_TAG_RING))
        return list(zip(reqs, self._waited_for(exchanges)))

    def _paced(self, sent, received) -> float:
        """When messages of these sizes posted now complete on the emulated link (0: no link)."""
        return 0.0 if self._port is None else self._port.schedule(sent, received)

    @contextmanager
    def _naming_peers(self, waited_for: str):
        """MPI's own error inside a wait (a peer that died mid-transfer: "See the MPI_ERROR
        field in MPI_Status", or MPI's error stack on one line), raised as PeerFailedError naming
        the peer(s) waited for."""
        from mpi4py import MPI

        try:
            yield
        except MPI.Exception as exc:
            raise PeerFailedError(
                f"rank {self.top_rank(self.rank)}: MPI failed while waiting for {waited_for} "
                f"during {self.doing()}: {' '.join(exc.Get_error_string().split())} (that rank "
                f"may have died or exited)") from None

    def _complete(self, left: list, deadline: float, on_timeout) -> None:
        """Test the requests of `left` [(request, peer)] until all have completed, dropping each
        from `left` (in place: a timeout elsewhere reads it) as it does. Past `deadline` raise
        `on_timeout(peers)` naming only the peers still incomplete; MPI's own error names the
        peer of the request that raised it."""
        def done() -> bool:
            still = []
            for request, peer in left:
                with self._naming_peers(peer):
                    if not request.Test():
                        still.append((request, peer))
            left[:] = still
            return not still

        poll_until(done, deadline, lambda: on_timeout(_peers(left)))

    def _post(self, exchanges):
        sent = [nbytes(s) for s, _, _, _ in exchanges if s is not None]
        received = [nbytes(r) for _, r, _, _ in exchanges if r is not None]
        if self._pool is None:   # inline: the data moves in `wait`, and the link's clock starts there
            self._requests += self._start(exchanges)
            self._unpaced.append((sent, received))
            return
        ready = self._paced(sent, received)
        # the thread gives up 2 s past the deadline of a wait begun now (nothing it runs outlives
        # a closed group, or the interpreter, by more); a wait begun later, after a long compute,
        # takes over what is left then (`_wait`)
        give_up = self.deadline() + _ROOT_GRACE_S
        left = [(None, peer) for peer in self._waited_for(exchanges)]   # none posted yet
        everyone = _peers(left)

        def run() -> bool:
            """True once the exchange has moved and the link's pace has passed; False where
            the thread gave up first (its requests still in `left`)."""
            left[:] = self._start(exchanges)
            try:
                self._complete(left, give_up, lambda _: TimeoutError())
                _sleep_until(ready, give_up, TimeoutError)   # the link's pace: asleep, not polling
            except TimeoutError:
                return False
            return True

        self._posted.append((left, everyone, ready))
        self._pending.append(self._pool.submit(run))

    def _wait(self):
        deadline = self.deadline()
        if self._requests:   # inline: the link's clock starts now, when the data starts to move
            ready = max(self._paced(sent, received) for sent, received in self._unpaced)
            left, self._requests, self._unpaced = self._requests, [], []
            self._finish_here(left, _peers(left), ready, deadline)
        pending, self._pending = self._pending, []
        posted, self._posted = self._posted, []
        finished = []
        for fut in pending:
            try:
                finished.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except (concurrent.futures.TimeoutError, TimeoutError):  # distinct types before 3.11
                raise self.timed_out(self._still_awaited(pending, posted)) from None
        # exchanges whose thread gave up before this wait began (the compute between commit
        # and wait outlasted the timeout): this wait goes on with them until its own deadline
        given_up = [entry for done, entry in zip(finished, posted) if not done]
        if given_up:
            self._finish_here([x for left, _, _ in given_up for x in left],
                              " and ".join(dict.fromkeys(peers for _, peers, _ in given_up)),
                              max(ready for _, _, ready in given_up), deadline)

    def _finish_here(self, left: list, everyone: str, ready: float, deadline: float) -> None:
        """Complete `left`'s requests on the calling thread, then sleep until the link has paced
        them (`ready`); past `deadline` raise CommTimeoutError naming the peers still silent, or
        once MPI has moved everything, `everyone` and the link."""
        self._complete(left, deadline, self.timed_out)
        _sleep_until(ready, deadline, lambda: self.timed_out(f"{everyone} ({self.link})"))

    def _still_awaited(self, pending: list, posted: list) -> str:
        """The peers of the exchanges not finished (`pending` futures, `posted` their requests)
        whose requests are still incomplete; when MPI has moved all of them, their peers and the
        emulated link that still paces them."""
        unfinished = [p[:2] for f, p in zip(pending, posted)
                      if not f.done() or f.exception() is not None or not f.result()]
        # tuple(left): one atomic read of a list the progress thread replaces; an exchange not
        # yet started (requests None: queued behind an earlier one) waits for no peer of its own
        incomplete = _peers([x for left, _ in unfinished for x in tuple(left) if x[0] is not None])
        everyone = " and ".join(dict.fromkeys(peers for _, peers in unfinished))
        return incomplete or f"{everyone} ({self.link})"

    # -- agreement and collectives -----------------------------------------------------------------
    def allgather_object(self, obj, what: str = "metadata"):
        """Every rank's `obj` (plain values: `burstcu.transport.wire`) in rank order, gathered on
        rank 0 and sent back (see the module docstring). `what` names the call; ranks inside
        different calls raise ValueError on every rank, and so does a message that cannot be
        encoded or read (whichever rank's it is)."""
        mine = wire.labelled(what, obj)
        answer = self._collect(mine) if self.rank == 0 else self._ask(mine)
        if left_raising(answer):   # left uncaught, that rank's exception ends the job within
            time.sleep(LEFT_RAISING_GRACE_S)   # about a second: its message then stands alone
        return agreed(answer)

    def _collect(self, mine: bytes) -> dict:
        """Rank 0: receive every rank's labelled message, answer each with the values, the calls
        when they differ, or the first rank whose message cannot be used."""
        got: dict[int, tuple] = {0: wire.unlabelled(mine), **self.heard_left}

        def arrived() -> bool:
            for r in range(1, self.size):
                if r not in got:
                    with self._naming_peers(f"rank {self.top_rank(r)}'s agreement message"):
                        message = _take(self.comm, r)
                    if message is not None:
                        got[r] = wire.unlabelled(message)
            return len(got) == self.size

        poll_until(arrived, self.deadline(), lambda: self.timed_out(
            f"rank(s) {sorted(set(range(self.size)) - set(got))} to reach the agreement round "
            f"(they may have failed, exited, or be inside another call)"))
        payload = wire.encode(answer_of([got[r] for r in range(self.size)]),
                              limit=self.size * wire.MAX_BYTES)
        left = {r: got[r] for r in range(1, self.size) if got[r][0].startswith(LEFT)}
        self.heard_left.update(left)   # taken: `close` waits for them no more, rounds stand them in
        sends = [_send(self.comm, payload, r) for r in range(1, self.size) if r not in left]
        with self._naming_peers("the other ranks to take the agreement's answer"):
            poll_until(lambda: all(req.Test() for req in sends), self.deadline(),
                       lambda: self.timed_out("the other ranks to take the agreement's answer"))
        return wire.decode(payload, limit=self.size * wire.MAX_BYTES)

    def _ask(self, mine: bytes) -> dict:
        """Other ranks: send this rank's labelled message to rank 0 and wait for its answer."""
        if 0 in self.heard_left:   # rank 0 has left: its notice answers every round
            return self.heard_left[0]
        send = _send(self.comm, mine, 0)
        box: list = []

        def answered() -> bool:
            with self._naming_peers(f"rank {self.top_rank(0)}'s answer to the agreement round"):
                message = _take(self.comm, 0)
            if message is not None:
                box.append(message)
            return bool(box)

        poll_until(answered, self.deadline() + _ROOT_GRACE_S, lambda: self.timed_out(
            "rank 0's answer to the agreement round (rank 0, or a rank it waits for, may have "
            "failed or exited)"))
        with self._naming_peers(f"rank {self.top_rank(0)} to take this rank's agreement message"):
            poll_until(send.Test, self.deadline(), lambda: self.timed_out("rank 0 to take this "
                                                                          "rank's agreement message"))
        answer = wire.decode(box[0], limit=self.size * wire.MAX_BYTES)
        if isinstance(answer, dict) and "left" in answer:
            self.heard_left[0] = answer
        return answer

    def allgather(self, send_buf, recv_buf):
        """Counted (and paced on an emulated link) as G-1 messages of send_buf's size each
        way: this rank's piece to every other rank, theirs to it (`CommStats`). The host blocks
        until it completes (on the calling thread, whatever `progress`): `stats.wait_seconds`."""
        from mpi4py import MPI

        pieces = [nbytes(send_buf)] * (self.size - 1)
        with self._blocking():
            ready = self._paced(pieces, pieces)
            req = self.comm.Iallgather([_byte_view(send_buf), MPI.BYTE], [_byte_view(recv_buf), MPI.BYTE])
            deadline = self.deadline()
            with self._naming_peers("every rank's allgather"):
                poll_until(req.Test, deadline, lambda: self.timed_out("every rank's allgather"))
            _sleep_until(ready, deadline, lambda: self.timed_out(f"the allgather ({self.link})"))
        self.stats.bytes_sent += sum(pieces)
        self.stats.bytes_received += sum(pieces)
        self.stats.messages += len(pieces)

    def barrier(self):
        self.allgather_object(None, "barrier")

    # -- sub-groups ---------------------------------------------------------------------------------
    def _split(self, color, key, members, name):
        sub_comm = self.comm.Split(color, key)  # every rank is here: split() agreed first
        try:
            # the same link: the same port (`port_of`), so the sub-group's messages queue with ours
            return MPITransport(sub_comm, progress=self.progress, timeout=self.timeout, link=self.link)
        finally:
            sub_comm.Free()  # the sub-group keeps its own duplicate

    # -- failures and cleanup ----------------------------------------------------------------------
    def _abort(self, reason: str):
        from mpi4py import MPI

        # closed meanwhile (its communicator freed): the world's abort ends the same job
        (self.comm if self.comm is not None else MPI.COMM_WORLD).Abort(1)

    def say_left(self, why: str) -> None:
        """(See `Transport.say_left`.) Rank 0 sends each peer the answer {"left": (0, why)} to
        the agreement round it is in or will be in; the others send rank 0 a message labelled
        as the call `LEFT`, which rank 0's round answers as ranks inside different calls. The
        sends are a few bytes (completed as posted: MPI's eager protocol), tested for a moment,
        then freed; a peer that has left too never receives them."""
        from mpi4py import MPI

        if self.comm is None or self.size == 1 or MPI.Is_finalized():   # (a call now would end
            return                                                       # the process)
        payload = wire.encode({"left": (0, why)}) if self.rank == 0 else \
            wire.labelled(f"{LEFT} ({why})", None)
        try:
            sends = [_send(self.comm, payload, r) for r in self._notice_peers()]
        except MPI.Exception:   # MPI's own error (a peer gone): nothing more to tell
            return
        with suppress(MPI.Exception, TimeoutError):
            poll_until(lambda: all(req.Test() for req in sends), deadline_after(0.2), TimeoutError)
        unsent = [req for req in sends if req != MPI.REQUEST_NULL]
        if unsent:
            _FAREWELLS.append(payload)   # MPI may still read it
        for req in unsent:
            with suppress(MPI.Exception):
                req.Free()

    def close(self):
        self._close_subgroups()
        if self.comm is not None:
            self.say_left(self.left_why)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._port is not None:
            release_port(self._port)
            self._port = None
        if self.comm is None:
            return
        # freed once the peers that tell this rank they have left (`say_left`) have done so
        PARKED.park(self.comm, self._notice_peers() - set(self.heard_left))
        self.comm = None

    def _notice_peers(self) -> set[int]:
        """The peers this rank tells it has left, and that tell it (`say_left`): every other
        rank for rank 0, rank 0 for the others (the agreement rounds' two ways)."""
        return set(range(1, self.size)) if self.rank == 0 else {0}
