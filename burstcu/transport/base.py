"""The transport interface the ring engine is written against.

A transport moves opaque byte buffers between the ranks of one group. The ring engine drives it
in the ring-flash-attention pattern, one ring step at a time::

    transport.send_recv(send_buf, recv_buf, dst=next, src=prev)   # queue this step's exchange
    transport.commit()                                            # post it (non-blocking)
    ... compute on the other buffer ...
    transport.wait()                                              # the exchange has completed

`commit` and `wait` carry the ordering contract that makes double buffering safe:

* everything the caller did to `send_buf` and `recv_buf` before `commit` happens before the
  transport reads `send_buf` or writes `recv_buf` (NCCL: the communication stream waits on an
  event recorded on the compute stream; MPI: trivially true, the host posts after it computed);
* everything the transport does with them happens before anything the caller does after
  `wait` (NCCL: the compute stream waits on an event recorded on the communication stream, no
  host synchronisation; MPI: `Waitall`).

Between `commit` and `wait` the caller must neither write `send_buf` nor touch `recv_buf`.

Besides point-to-point, a transport offers `allgather_object` (small Python metadata, used to
agree on shapes before any data moves), `barrier`, and `allgather` of a byte buffer (used by the
all-gather baseline). Every byte of payload is counted in `stats`. An all-to-all is one commit of
`send_recv`s to every peer (`burstcu.engine.steps.post_pairwise`). `split(color, key, name)`
makes a sub-group (USP's Ulysses and ring groups): made once per name and kept, its traffic
counted in the parent's `stats`, its failures reported as the parent's call and step.

Failures. Every wait for a peer has a deadline (`timeout` seconds, from `burstcu.init(timeout=)`,
else $BURSTCU_TIMEOUT, else 600; `math.inf` waits forever) and waits without spinning; past it
the waiting rank raises `CommTimeoutError` naming the peer(s) it waited for and what it was
doing (`where`, which the engine keeps current: "attention forward: fwd 2 send/recv kv").
`fail(reason)` ends the whole
group after a failure on this rank: it prints the reason and aborts every rank (MPI_Abort), since
its peers may be blocked mid-ring waiting for it; a group of one just lets the exception rise.
"""

from __future__ import annotations

import math
import os
import sys
import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from . import wire


class CommTimeoutError(RuntimeError):
    """A rank waited longer than its deadline for a peer inside a burstcu call."""


class PeerFailedError(RuntimeError):
    """Another rank of the group failed; this rank stops waiting for it."""


DEFAULT_TIMEOUT = 600.0
# between printing why and aborting: the launcher forwards a rank's output through a pipe and
# may tear the job down before it has read what an aborting rank wrote last
ABORT_GRACE_S = 0.3
TIMEOUT_ENV = "BURSTCU_TIMEOUT"
# a cause of a timeout inside a call that is not a failure: a peer's first use of a kernel variant
# (under a causal contiguous layout only some ranks need some variants, so the others wait)
FIRST_USE_COMPILE = ("a peer may also be still compiling kernels on first use (the emulated and CUDA "
                     "backends compile each kernel variant at its first call; a lowered timeout can "
                     "end before that): warm the cache with python -m burstcu.build warm (CUDA; the "
                     "emulator's cache fills on a first run with the same $BURSTCU_CACHE_DIR), or "
                     "keep a timeout that covers the compile")


# the longest wait a deadline stands for: `timeout=math.inf` ("wait forever") waits this long
# (over 3 years), within what sleeps and thread waits take (threading.TIMEOUT_MAX: ~292 years)
MAX_WAIT_S = 1e8
FOREVER_WORDS = ("inf", "infinity", "none", "forever")


def resolve_timeout(timeout: float | None) -> float:
    """`timeout`, else $BURSTCU_TIMEOUT, else 600 seconds; ValueError unless a positive number.
    `math.inf` (or $BURSTCU_TIMEOUT inf / none / forever) waits forever."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if raw.lower() in FOREVER_WORDS:
            return math.inf
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT
        except ValueError:
            raise ValueError(f"${TIMEOUT_ENV} must be a positive number of seconds (or inf: wait "
                             f"forever), not {raw!r}") from None
        if not timeout > 0:
            raise ValueError(f"${TIMEOUT_ENV} must be a positive number of seconds (or inf: wait "
                             f"forever), not {raw!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or not float(timeout) > 0:
        raise ValueError(f"timeout must be a positive number of seconds (math.inf: wait forever), "
                         f"not {timeout!r}")
    return float(timeout)


def deadline_after(timeout: float) -> float:
    """time.monotonic() `timeout` seconds from now, at most MAX_WAIT_S (so `math.inf` too)."""
    return time.monotonic() + min(timeout, MAX_WAIT_S)


# Polling: MPI progresses a transfer only inside an MPI call, so a wait must keep calling one;
# measured here (MPICH, 2 ranks), a 4-32 MiB exchange needs 1-3 polls and a poll costs 20-30 us
# of CPU. Sleeping between polls a fraction of the time waited so far keeps a late peer cheap
# (about 200 polls in the first second of a wait, then 100 a second: well under 1% of a core)
# and notices its arrival at most BACKOFF (5%) of the wait late. No poll spins.
MIN_SLEEP_S = 2e-5     # the first sleeps (the kernel rounds them up to ~60 us)
MAX_SLEEP_S = 0.01     # the longest sleep between polls
BACKOFF = 0.05         # otherwise sleep this fraction of the time waited so far


def poll_until(done, deadline: float, on_timeout) -> None:
    """Call `done()` until it returns True, sleeping between calls BACKOFF x the time waited so
    far (at least MIN_SLEEP_S, at most MAX_SLEEP_S, never past `deadline`): no core is burnt,
    however long the wait. Past `deadline` (time.monotonic()) raise `on_timeout()`."""
    start = time.monotonic()
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise on_timeout()
        nap = min(MAX_SLEEP_S, max(MIN_SLEEP_S, BACKOFF * (now - start)))
        time.sleep(max(0.0, min(nap, deadline - now)))


def sleep_until(moment: float) -> None:
    """Block (no polling) until time.monotonic() >= moment."""
    while True:
        left = moment - time.monotonic()
        if left <= 0:
            return
        time.sleep(left)


@dataclass
class CommStats:
    """Payload counters of one rank, counted where the bytes enter and leave the transport.

    bytes_sent / bytes_received: payload bytes of point-to-point and collective data.
    messages: messages this rank sent: each point-to-point send it posted (K and V sent together
        count as one), and G-1 for each all-gather among G ranks (its piece, once to every other
        rank: the all-gather counts as if it were sent directly, as bytes_sent counts it, G-1
        times the piece, whatever route the MPI or NCCL algorithm takes).
    wait_seconds: host seconds spent blocked on communication: in `wait`, and in `allgather`
        where the host blocks for it (MPI, gloo, loopback; loopback's `commit` too, which blocks
        until each peer has posted the message it takes): exposed, not hidden, communication as
        the host sees it. On NCCL the host blocks in neither (the compute stream waits on the
        communication stream; the host returns at once), so it stays near 0 there however long
        the device waits: time the streams (CUDA events) for that.
    steps: ring exchanges committed.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    wait_seconds: float = 0.0
    steps: int = 0
    history: list = field(default_factory=list, repr=False)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.messages = self.steps = 0
        self.wait_seconds = 0.0
        self.history.clear()

    def as_dict(self) -> dict:
        return {
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "messages": self.messages,
            "wait_seconds": self.wait_seconds,
            "steps": self.steps,
        }


def nbytes(buf: Any) -> int:
    """Payload size of a NumPy or CuPy array (or anything with `.nbytes`)."""
    return int(buf.nbytes)


def check_contiguous(buf: Any, what: str, transport: str) -> None:
    """ValueError unless `buf` is C-contiguous (transports move raw bytes, ignoring strides)."""
    flags = getattr(buf, "flags", None)
    if flags is not None and not flags.c_contiguous:
        raise ValueError(f"{transport} transport needs C-contiguous buffers; the {what} buffer is not")


# the call a rank that has left its group stands for in its peers' agreement rounds
# (`Transport.say_left`), followed by why it left
LEFT = "no call: it has left the group"
BY_CLOSE = "group.close(), or the end of its with-block"   # why a rank that closed its group left
RAISED = "with an exception in flight there: "   # why, when one was raised or handled at its close
UNMATCHED = ("the ranks still in the group made a call that the rank which left did not make (an "
             "evaluation on some ranks alone, or more batches on some ranks than on others)")
ENDED = "the calls after it cannot be made with that rank"


def _peer_left(message: str, whys: Sequence[str]) -> ValueError:
    """The error the ranks still in a call raise when a peer has left the group (`whys`: why
    each such peer left): marked `burstcu_peer_left`, since the rank that left does not raise
    it (one left uncaught ends the job: `group.UncaughtEndsTheJob`, `Call.raising_together`)."""
    plain = any(RAISED not in why for why in whys)
    exc = ValueError(f"{message}; {UNMATCHED if plain else ENDED}")
    exc.burstcu_peer_left = True
    return exc


def left_raising(answer: dict) -> bool:
    """Whether an agreement round's answer (`answer_of`) holds a peer that left its group with
    an exception in flight there (`RAISED`): one that may yet end the job."""
    whys = [answer["left"][1]] if "left" in answer else \
        [label for label in answer.get("calls", ()) if label.startswith(LEFT)]
    return any(RAISED in why for why in whys)


def calls_differ(labels: Sequence[str]) -> ValueError:
    """The error every rank raises when the agreement finds ranks inside different calls."""
    calls = ", ".join(f"rank {r}: {label}" for r, label in enumerate(labels))
    said = f"ranks are inside different burstcu calls ({calls}): every rank must make the same " \
           f"calls in the same order"
    left = [label for label in labels if label.startswith(LEFT)]
    return _peer_left(said, left) if left else ValueError(said)


def answer_of(messages: list[tuple]) -> dict:
    """The answer to an agreement round, from every rank's `wire.unlabelled` message in rank
    order: {"values": [...]}, {"calls": [labels]} when ranks are inside different calls, or
    {"unusable": (rank, why)} for the first rank whose message cannot be used."""
    problems = [(r, why) for r, (_, _, why) in enumerate(messages) if why is not None]
    labels = [label for label, _, _ in messages]
    if problems:
        return {"unusable": problems[0]}
    if len(set(labels)) > 1:
        return {"calls": labels}
    return {"values": [value for _, value, _ in messages]}


def agreed(answer: dict) -> list:
    """The values of an agreement round's answer (`answer_of`), or the error every rank raises."""
    if "calls" in answer:
        raise calls_differ(answer["calls"])
    if "left" in answer:   # rank 0's notice that it has left (`Transport.say_left`)
        rank, why = answer["left"]
        raise _peer_left(f"rank {rank} has left the group ({why}) while this rank is inside a "
                         f"burstcu call: every rank must make the same calls in the same order",
                         [why])
    if "unusable" in answer:
        rank, why = answer["unusable"]
        raise ValueError(f"rank {rank}'s agreement message cannot be used: {why}. Are all ranks "
                         f"running the same burstcu?")
    return answer["values"]


class Transport(ABC):
    """Point-to-point exchange + metadata agreement among `size` ranks; this process is `rank`."""

    name: str = "abstract"
    link = None  # the emulated link its messages are paced to (`burstcu.transport.link`), if any
    # whether its group's local op compiles kernels at their first call (a peer's compile can
    # outlast a wait; `burstcu.Group` sets it from `LocalOps.compiles_on_first_use`)
    compiles_kernels = True
    # whether `_abort` ends the other ranks' processes too (MPI_Abort); where it ends only this
    # process (torchrun stops the others) or wakes threads, False
    abort_ends_every_rank = False

    def __init__(self, rank: int, size: int, timeout: float | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a group of size {size}")
        self.rank = rank
        self.size = size
        # the places in the program the group's calls came from, where they differed between
        # ranks (`burstcu.validate.warn_if_sites_differ`)
        self.sites_seen: dict = {}
        self.stats = CommStats()
        self.timeout = resolve_timeout(timeout)
        self.call: str | None = None     # the burstcu call in progress ("attention forward")
        self.where = "between calls"     # its latest step, from the engine's annotations
        self._queued: list[tuple[Any, Any, int, int]] = []
        # a sub-group (`split`): the transport it was split from, its ranks' ranks there, its name
        self.parent: Transport | None = None
        self.members: tuple[int, ...] = tuple(range(size))
        self.group_name = ""
        self._subgroups: dict[str, Transport] = {}
        # the job's ranks (MPI's world, torch's default group) of this group's ranks, when the
        # group is made of some of them or in another order; None: the same numbers
        self.job_ranks: tuple[int, ...] | None = None

    # -- failures --------------------------------------------------------------------------------
    def deadline(self) -> float:
        return deadline_after(self.timeout)

    def doing(self) -> str:
        """What this rank is doing, for messages: "attention forward at 'fwd 2 compute'"."""
        if self.parent is not None:
            return f"{self.parent.doing()} (in its {self.group_name} group of ranks {self.top_ranks()})"
        return f"{self.call or 'no burstcu call'} at '{self.where}'"

    def top_rank(self, rank: int) -> int:
        """`rank` of this group as a rank of the group it was split from (recursively)."""
        return rank if self.parent is None else self.parent.top_rank(self.members[rank])

    def top_ranks(self) -> list[int]:
        return [self.top_rank(r) for r in range(self.size)]

    def timed_out(self, waited_for: str) -> CommTimeoutError:
        """The error of a wait for `waited_for` past the deadline; inside a call (where kernels
        compile on first use) it names that cause too (`FIRST_USE_COMPILE`)."""
        top = self
        while top.parent is not None:
            top = top.parent
        inside = top.call not in (None, "burstcu.init")
        hint = f"; {FIRST_USE_COMPILE}" if inside and top.compiles_kernels else ""
        return CommTimeoutError(f"rank {self.top_rank(self.rank)} waited {self.timeout:g} s for "
                                f"{waited_for} during {self.doing()} (timeout: "
                                f"burstcu.init(timeout=...) or ${TIMEOUT_ENV}){hint}")

    def fail(self, reason: str) -> None:
        """After a failure on this rank inside a burstcu call: make every rank stop (see the
        module docstring). Returns where the transport leaves the exception to rise (a group of
        one; a loopback world, whose other ranks are woken with the reason). A sub-group's
        failure (its watchdog) ends the whole group it was split from."""
        if self.parent is not None:
            self.parent.fail(reason)
            return
        if self.size > 1:
            try:   # a second Ctrl-C during the grace must not skip the abort (peers would wait)
                sys.stderr.write(f"burstcu: {reason}{self.job_ranks_said()}\nburstcu: rank "
                                 f"{self.rank} {self.ending}\n")
                sys.stderr.flush()
                time.sleep(ABORT_GRACE_S)
            finally:
                self._abort(reason)

    @property
    def ending(self) -> str:
        """What `fail` does, as its last line says it after "rank r"."""
        return f"ends all {self.size} ranks of the group (its peers may be waiting for it)"

    def job_ranks_said(self) -> str:
        """" (ranks 0-2 of this group are ranks [1, 2, 3] of the job)" where a message's rank
        numbers are not the job's, else ""."""
        if self.job_ranks is None or self.job_ranks == tuple(range(self.size)):
            return ""
        return f" (ranks 0-{self.size - 1} of this group are ranks {list(self.job_ranks)} of the job)"

    def _abort(self, reason: str) -> None:
        """End every rank (MPI_Abort, the communicator's abort, ...); default: nothing."""

    # -- sub-groups ------------------------------------------------------------------------------
    def split(self, color: int, key: int, name: str) -> "Transport":
        """The sub-group of the ranks that pass the same `color`, ordered by `key`. Collective:
        every rank calls it, in the same order; the first call under `name` makes the group
        (after one bounded agreement, so a missing rank times out instead of hanging), later
        ones return it. It shares this transport's timeout and `stats`, reports failures as
        this transport's call and step, and is closed with it."""
        sub = self._subgroups.get(name)
        if sub is None:
            chosen = self.allgather_object((int(color), int(key)), f"split {name}")
            members = tuple(r for _, r in sorted((k, r) for r, (c, k) in enumerate(chosen)
                                                 if c == color))
            sub = self._split(int(color), int(key), members, name)
            sub.parent, sub.members, sub.group_name, sub.stats = self, members, name, self.stats
            self._subgroups[name] = sub
        return sub

    def _split(self, color: int, key: int, members: tuple[int, ...], name: str) -> "Transport":
        raise NotImplementedError(f"the {self.name} transport cannot make sub-groups")

    def _close_subgroups(self) -> None:
        for sub in self._subgroups.values():
            sub.close()
        self._subgroups.clear()

    # -- ring pattern --------------------------------------------------------------------------
    @property
    def next_rank(self) -> int:
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.size

    def send_recv(self, send_buf: Any | None, recv_buf: Any | None, dst: int, src: int) -> None:
        """Queue one exchange: send `send_buf` to `dst`, receive `recv_buf` from `src`.

        Either side may be None (nothing to send, or nothing to receive). Both buffers must be
        contiguous. Sizes must match what the peer posts; the engine guarantees it.
        """
        assert send_buf is not None or recv_buf is not None, "an exchange needs a buffer"
        assert 0 <= dst < self.size and 0 <= src < self.size
        if send_buf is not None:
            assert dst != self.rank, "a rank does not send to itself"
        self._queued.append((send_buf, recv_buf, dst, src))

    def commit(self) -> None:
        """Post every queued exchange, without blocking the host."""
        assert self._queued, "commit() with nothing queued"
        queued, self._queued = self._queued, []
        for send_buf, recv_buf, _, _ in queued:
            if send_buf is not None:
                self.stats.bytes_sent += nbytes(send_buf)
                self.stats.messages += 1
            if recv_buf is not None:
                self.stats.bytes_received += nbytes(recv_buf)
        self.stats.steps += 1
        self._post(queued)

    def wait(self) -> None:
        """Return when everything committed so far has completed (see the module docstring)."""
        with self._blocking():
            self._wait()

    @contextmanager
    def _blocking(self):
        """Count the host time inside as blocked on communication (`CommStats.wait_seconds`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.wait_seconds += time.perf_counter() - t0

    @abstractmethod
    def _post(self, exchanges: Sequence[tuple[Any, Any, int, int]]) -> None: ...

    @abstractmethod
    def _wait(self) -> None: ...

    # -- collectives -----------------------------------------------------------------------------
    @abstractmethod
    def allgather_object(self, obj: Any, what: str = "metadata") -> list:
        """Every rank's `obj`, in rank order (small metadata of plain values, in the fixed
        encoding of `burstcu.transport.wire`; not counted).
        `what` names the call: ranks inside different calls raise ValueError on every rank."""

    @abstractmethod
    def allgather(self, send_buf: Any, recv_buf: Any) -> None:
        """Gather equal-sized contiguous buffers: `recv_buf` is `size` copies of send_buf's shape,
        rank-major. Blocking for the caller's subsequent work (stream-ordered on a GPU); where it
        blocks the host, that time counts in `stats.wait_seconds`."""

    @abstractmethod
    def barrier(self) -> None: ...

    def close(self) -> None:
        """Release resources (threads, communicators), sub-groups included."""
        self._close_subgroups()

    # why `close` tells the peers this rank has left (`say_left`): `BY_CLOSE`, followed by
    # `RAISED` and the exception where one is in flight at its close
    left_why = BY_CLOSE

    def say_left(self, why: str) -> None:
        """Tell the peers, without waiting for any, that this rank has left the group (`why`: it
        closed it, its program ended), so that a peer inside a call this rank never made fails
        at once (`LEFT`, `UNMATCHED`) instead of at its timeout. Default: nothing (the peers
        wait until their timeout)."""


class SelfTransport(Transport):
    """The transport of a group of one: no peers, so nothing is ever sent."""

    name = "self"

    def __init__(self, timeout: float | None = None):
        super().__init__(0, 1, timeout)

    def _post(self, exchanges):
        raise AssertionError("a group of one never exchanges data")

    def _wait(self):
        pass

    def allgather_object(self, obj, what: str = "metadata"):
        return [wire.decode(wire.encode(obj))]   # what a peer would get: plain values only

    def allgather(self, send_buf, recv_buf):
        recv_buf.reshape(send_buf.shape)[...] = send_buf

    def barrier(self):
        pass

    def _split(self, color, key, members, name):
        return SelfTransport(self.timeout)
