"""NCCL transport (cupy.cuda.nccl): the ring exchange on a dedicated stream, ordered by events.

One ring step, as the engine drives it (see burstcu.transport.base)::

    compute stream:  ... kernels that last touched send/recv ... [record ready] ... step kernels ... [wait arrived] ...
                                                                 |                                    ^
    comm stream:                           [wait ready] [record started] groupStart send recv groupEnd [record arrived]

* `commit()` records `ready` on the compute stream (the caller's current stream) and makes the
  communication stream wait on it, so the send reads, and the receive overwrites, only after every
  kernel issued before the commit. Then it records `started` (the stream reached the exchange),
  posts the step's sends and receives inside one `groupStart`/`groupEnd`, records `arrived`
  after them, and hands both events to the watchdog (`EventWatchdog`), which times the exchange
  on a thread of its own.
* `wait()` makes the compute stream wait on the latest `arrived`: kernels issued after `wait()`
  see the received bytes, and nothing the caller issues later can overwrite a buffer NCCL still
  reads. The host never blocks.

Why grouping is enough for any ring size: NCCL fuses the point-to-point calls of one group into
one operation that makes progress on all of them together, so rank r's "send to r+1" and
"receive from r-1" never wait for each other. Without grouping, blocking send/recv would need the
even-ranks-send-first / odd-ranks-receive-first order to avoid a cycle of senders. Each commit is
one group on every rank, and the k-th group of rank r pairs with the k-th group of its
neighbours (burstcu.testing.schedule checks that alignment).

Events are reused across steps: `cudaStreamWaitEvent` captures the event's most recent record at
the time of the call, so re-recording `ready` at the next step cannot release an earlier wait.
Each exchange in flight has its own `started` and `arrived` (the watchdog queries them until it
has seen the exchange complete, then hands them out again).

All stream, event and NCCL actions go through a small *device* object (`CupyDevice` here). The
schedule checker (burstcu.testing.schedule) substitutes a recorder, so the schedule it proves race-free
is the one this class issues.

NCCL refuses two ranks on one GPU, so one process owns one GPU: `transport.bootstrap` picks it from the
node-local rank (or from the launcher's per-rank CUDA_VISIBLE_DEVICES; see launch/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .base import FIRST_USE_COMPILE, Transport, check_contiguous, deadline_after, nbytes
from . import wire
from .mpi import MPITransport
from .streams import CupyStreams

# ----------------------------------------------------------------------------------------------
# dtype table

# ncclDataType_t values from nccl.h, used when cupy.cuda.nccl lacks a name (e.g. float8 types,
# NCCL >= 2.24) or is not installed (tests of the table run without NCCL).
_NCCL_ENUM = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
              "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
              "float8_e4m3fn": 10, "float8_e5m2": 11}
_CUPY_NAME = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
              "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
              "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
              "bfloat16": "NCCL_BFLOAT16"}
# numpy dtypes NCCL has no type for, moved as (element type, elements per item). Fine for
# send/recv/allgather; a reduction over them would be wrong for bool (sum) and is not offered.
_AS_PAIRS = {"complex64": ("float32", 2), "complex128": ("float64", 2), "bool": ("uint8", 1),
             "int16": ("uint8", 2), "uint16": ("uint8", 2)}


def nccl_dtype(dtype: Any) -> tuple[int, int]:
    """(ncclDataType_t value, NCCL elements per numpy item) for a numpy (or ml_dtypes) dtype.

    The engine's message buffers are uint8 (ncclUint8, 1). Raises TypeError for dtypes NCCL
    cannot move (object, strings, structured).
    """
    dt = np.dtype(dtype)
    name = dt.name
    per_item = 1
    if name in _AS_PAIRS:
        name, per_item = _AS_PAIRS[name]
    if name not in _NCCL_ENUM:
        raise TypeError(f"NCCL has no data type for {dt.name!r}: send it as a uint8 view")
    return _nccl_constant(name), per_item


def _nccl_constant(name: str) -> int:
    try:
        from cupy.cuda import nccl
    except Exception:  # cupy or the NCCL wheel missing: the header's values are the ABI
        return _NCCL_ENUM[name]
    return int(getattr(nccl, _CUPY_NAME.get(name, ""), _NCCL_ENUM[name]))


def nccl_count(buf: Any) -> tuple[int, int]:
    """(NCCL element count, ncclDataType_t) of a contiguous array `buf`."""
    dtype, per_item = nccl_dtype(buf.dtype)
    return int(buf.size) * per_item, dtype


class CupyDevice(CupyStreams):
    """Streams, events and NCCL calls on one GPU, for one NCCL communicator."""

    def __init__(self, nccl_comm: Any):
        super().__init__()
        self.comm = nccl_comm

    def group_start(self) -> None:
        from cupy.cuda import nccl
        nccl.groupStart()

    def group_end(self) -> None:
        from cupy.cuda import nccl
        nccl.groupEnd()

    def send(self, buf: Any, peer: int, stream: Any) -> None:
        count, dtype = nccl_count(buf)
        self.comm.send(buf.data.ptr, count, dtype, peer, stream.ptr)

    def recv(self, buf: Any, peer: int, stream: Any) -> None:
        count, dtype = nccl_count(buf)
        self.comm.recv(buf.data.ptr, count, dtype, peer, stream.ptr)

    def all_gather(self, send_buf: Any, recv_buf: Any, stream: Any) -> None:
        count, dtype = nccl_count(send_buf)
        self.comm.allGather(send_buf.data.ptr, recv_buf.data.ptr, count, dtype, stream.ptr)

    def abort(self) -> None:
        """ncclCommAbort: kernels of this communicator stop waiting for peers."""
        if self.comm is not None:
            self.comm.abort()
            self.comm = None

    def close(self) -> None:
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


# ----------------------------------------------------------------------------------------------
# the transport

@dataclass
class _Exchange:
    """One exchange the watchdog waits for: its two events, what to call it, and the clocks
    it has started (monotonic seconds; None until then)."""

    started: Any
    arrived: Any
    what: str
    deadline: float | None = None   # timeout after `started` was seen complete
    oldest_since: float | None = None   # first seen the oldest, not started


class EventWatchdog:
    """A host thread that watches the exchanges the GPU has not finished, oldest first.

    The GPU ring never blocks the host: a peer that died leaves this rank's communication stream
    (and so its compute stream) stalled while the host queues more work. Each exchange is
    watched, from when the host posts it, through two events of the communication stream,
    `watch(started, arrived, what)` in stream order: `started`, recorded before its NCCL calls,
    completes when the stream reaches the exchange (the compute it waits for and every earlier
    exchange are done); `arrived`, recorded after them, when the exchange has completed.

    The oldest exchange not arrived is timed from the moment its `started` is seen complete, not
    from when the host queued it: this rank's GPU working through a backlog of long compute is
    not a dead peer. If it has not arrived `timeout` seconds after it started, `on_timeout(what)`
    runs once. That time still holds the peers' own lateness (their compute or host work, a
    first-use compile, before their matching exchange): the timeout must cover the slowest
    peer's step. An exchange the stream has not reached `unreached_after` seconds after it
    became the oldest (max(4 x timeout, 1 h); never with an infinite timeout: a kernel before
    it never ends) is reported by `on_unreached(what, seconds)` (on_timeout(what) without one).
    Where a query raises (a CUDA error), `on_error(what, exception)` runs instead
    (on_timeout(what) without an on_error). Each once, on the watchdog's thread (NCCLTransport:
    print, abort the NCCL communicator so its kernels stop waiting, abort the MPI job).

    The device's `query` polls, without blocking, every `poll` seconds, from a thread the
    device binds to its GPU first (`bind_thread`, where it has one); each poll retires every
    exchange that arrived (one stream: if the newest arrived, all did). Their events go back to
    the pools `event(role)` hands out, one a role, so a `started` event is never one a stream
    waits on (an event is re-recorded only once nothing queries its earlier record; a stream
    that waited on it keeps the record it captured).
    """

    IDLE_EXIT_S = 1.0  # the thread ends after this long with nothing pending (re-made on demand)

    def __init__(self, device: Any, timeout: float, on_timeout, poll: float = 0.01, on_error=None,
                 on_unreached=None):
        import collections
        import threading

        self.device, self.timeout, self.on_timeout, self.poll = device, timeout, on_timeout, poll
        self.on_error, self.on_unreached = on_error, on_unreached
        self.unreached_after = max(4 * timeout, 3600.0)
        self._lock = threading.Lock()
        self._pending: collections.deque[_Exchange] = collections.deque()   # oldest first
        self._free: dict = {"started": [], "arrived": []}   # of arrived exchanges, by role
        self._stop = threading.Event()
        self._thread: Any = None
        self.fired: str | None = None

    def event(self, role: str) -> Any:
        """An event for the next exchange's `role` ("started" or "arrived"): a recycled one of
        that role, else a new one of the device."""
        with self._lock:
            if self._free[role]:
                return self._free[role].pop()
        return self.device.new_event()

    def watch(self, started: Any, arrived: Any, what: str) -> None:
        """Watch the exchange between `started` and `arrived`, posted after every one before."""
        import threading

        with self._lock:
            self._pending.append(_Exchange(started, arrived, what))
            if self._stop.is_set() or self.fired is not None:
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="burstcu-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        import time

        bind = getattr(self.device, "bind_thread", None)
        try:
            if bind is not None:   # the rank's GPU, not device 0, for this thread's queries
                bind()
        except Exception as exc:  # noqa: BLE001 - no query can run: no exchange can be watched
            self._failed("binding the watchdog's thread to this rank's GPU", exc)
            return
        idle_since = time.monotonic()
        while not self._stop.wait(self.poll):
            with self._lock:
                oldest = self._pending[0] if self._pending else None
                if oldest is None and time.monotonic() - idle_since > self.IDLE_EXIT_S:
                    self._thread = None
                    return
            if oldest is None:
                continue
            try:
                if self._retire_arrived():
                    idle_since = time.monotonic()
                    continue
                late = self._late(oldest)
            except Exception as exc:  # noqa: BLE001 - a CUDA error: the exchange will not complete
                self._failed(oldest.what, exc)
                return
            if late is not None:
                self.fired = oldest.what
                if late == "unreached" and self.on_unreached is not None:
                    self.on_unreached(oldest.what, self.unreached_after)
                else:
                    self.on_timeout(oldest.what)
                return

    def _retire_arrived(self) -> bool:
        """Drop every pending exchange that arrived, its events back to the pools; whether any."""
        with self._lock:
            pending = list(self._pending)
        done = len(pending) if self.device.query(pending[-1].arrived) else 0
        while done < len(pending) and self.device.query(pending[done].arrived):
            done += 1
        with self._lock:
            for _ in range(done):
                exchange = self._pending.popleft()
                self._free["started"].append(exchange.started)
                self._free["arrived"].append(exchange.arrived)
        return done > 0

    def _late(self, oldest: _Exchange) -> str | None:
        """Whether the oldest pending exchange (not arrived) is "late" (past its deadline) or
        "unreached" (not started `unreached_after` seconds after it became the oldest), or None."""
        import time

        now = time.monotonic()
        if oldest.deadline is None:
            if self.device.query(oldest.started):
                oldest.deadline = deadline_after(self.timeout)
            elif oldest.oldest_since is None:
                oldest.oldest_since = now
            elif now - oldest.oldest_since > self.unreached_after:
                return "unreached"
            return None
        return "late" if now > oldest.deadline else None

    def _failed(self, what: str, error: BaseException) -> None:
        """`what` can no longer be watched (`error` raised): on_error, else on_timeout, once."""
        self.fired = what
        if self.on_error is not None:
            self.on_error(what, error)
        else:
            self.on_timeout(what)

    def stop(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(timeout=1.0)


class NCCLTransport(Transport):
    """Ring exchange over NCCL on a dedicated communication stream (see the module docstring).

    device: a CupyDevice (or a recorder with the same methods).
    host: the host side of the same ranks, for `allgather_object`, `barrier`, sub-groups and
        aborting (metadata only; no payload goes through it): an mpi4py communicator
        (duplicated here), or a transport that agrees by itself (`TorchDistTransport`; this
        transport then owns it). None for a recorder or a group of one.
    connect: connect(host transport of a sub-group) -> its NCCL communicator (`split`).
    """

    name = "nccl"

    def __init__(self, rank: int, size: int, device: Any, host: Any = None,
                 timeout: float | None = None, connect=None):
        super().__init__(rank, size, timeout)
        self.device = device
        self.connect = connect
        # metadata (agreement, barrier) and aborts go through the host, with the same deadlines
        self.meta: Transport | None = None
        if isinstance(host, Transport):
            self.meta = host
            host.timeout = self.timeout
        elif host is not None:
            self.meta = MPITransport(host, progress="inline", timeout=self.timeout)
        self.stream = device.new_stream()
        self._ready = device.new_event()     # compute -> comm: buffers may be read/overwritten
        self.watchdog = EventWatchdog(device, self.timeout, self._exchange_timed_out,
                                      on_error=self._exchange_failed,
                                      on_unreached=self._exchange_unreached)
        self._arrived: Any = None            # the posted exchanges have completed (or None)

    def _exchange_timed_out(self, what: str) -> None:
        peers = (f"ranks {self.top_rank(self.prev_rank)} and {self.top_rank(self.next_rank)} are its "
                 f"peers" if self.parent is None else
                 f"its {self.group_name} group is ranks {self.top_ranks()}")
        self.fail(f"rank {self.top_rank(self.rank)}: the NCCL exchange of {what} has not completed "
                  f"after {self.timeout:g} s ({peers}); timeout: burstcu.init(timeout=...) or "
                  f"$BURSTCU_TIMEOUT; {FIRST_USE_COMPILE}")

    def _exchange_unreached(self, what: str, seconds: float) -> None:
        self.fail(f"rank {self.top_rank(self.rank)}: the NCCL exchange of {what} has not been "
                  f"reached by this rank's GPU after {seconds:g} s: a kernel queued before it "
                  f"has not ended (a hang on this GPU, not a peer's)")

    def _exchange_failed(self, what: str, error: BaseException) -> None:
        self.fail(f"rank {self.top_rank(self.rank)}: the NCCL exchange of {what} failed on this "
                  f"rank's GPU ({type(error).__name__}: {error})")

    def _post(self, exchanges: Sequence[tuple[Any, Any, int, int]]) -> None:
        for send_buf, recv_buf, _, _ in exchanges:  # fail before anything is issued
            check_contiguous(send_buf, "send", "NCCL")
            check_contiguous(recv_buf, "receive", "NCCL")
        dev = self.device
        with dev.annotate("burstcu commit"):
            started = self._begin()
            dev.group_start()
            try:
                for send_buf, recv_buf, dst, src in exchanges:
                    if send_buf is not None:
                        dev.send(send_buf, dst, self.stream)
                    if recv_buf is not None:
                        dev.recv(recv_buf, src, self.stream)
            finally:
                dev.group_end()  # an open group would swallow every later NCCL call
            self._arrived = self._end(started)

    def _begin(self) -> Any:
        """Order the comm stream after the compute issued so far (`ready`), then record and
        return the event the watchdog times the exchange from (the stream reached it)."""
        dev, started = self.device, self.watchdog.event("started")
        dev.record(self._ready, dev.current_stream())
        dev.wait_event(self.stream, self._ready)
        dev.record(started, self.stream)
        return started

    def _end(self, started: Any) -> Any:
        """Record and return the event of the exchange begun at `started` completing, and hand
        both to the watchdog (in stream order: every exchange is watched from its post)."""
        arrived = self.watchdog.event("arrived")
        self.device.record(arrived, self.stream)
        self.watchdog.watch(started, arrived, self.doing())
        return arrived

    def _wait(self) -> None:
        if self._arrived is None:
            return
        with self.device.annotate("burstcu wait"):   # after every exchange posted (one stream)
            self.device.wait_event(self.device.current_stream(), self._arrived)
        self._arrived = None

    # -- collectives ---------------------------------------------------------------------------
    def allgather(self, send_buf: Any, recv_buf: Any) -> None:
        """ncclAllGather on the comm stream, ordered like a ring step (stream-ordered for the
        caller: kernels issued afterwards see recv_buf; the host does not block, so nothing is
        added to `stats.wait_seconds`, as in `wait`)."""
        check_contiguous(send_buf, "send", "NCCL")
        check_contiguous(recv_buf, "receive", "NCCL")
        if nbytes(recv_buf) != nbytes(send_buf) * self.size:
            raise ValueError(f"allgather: recv_buf has {nbytes(recv_buf)} bytes, needs "
                             f"{self.size} x {nbytes(send_buf)}")
        dev = self.device
        with dev.annotate("burstcu allgather"):
            started = self._begin()
            dev.all_gather(send_buf, recv_buf, self.stream)
            dev.wait_event(dev.current_stream(), self._end(started))
        self.stats.bytes_sent += nbytes(send_buf) * (self.size - 1)
        self.stats.bytes_received += nbytes(send_buf) * (self.size - 1)
        self.stats.messages += self.size - 1   # G-1 pieces out, as `CommStats` counts

    def allgather_object(self, obj: Any, what: str = "metadata") -> list:
        if self.meta is None:
            if self.size == 1:
                return [wire.decode(wire.encode(obj))]   # what a peer would get: plain values only
            raise RuntimeError("NCCLTransport without an MPI communicator (or another host) "
                               "cannot agree on metadata")
        self.meta.call, self.meta.where = self.call, self.where
        return self.meta.allgather_object(obj, what)

    def barrier(self) -> None:
        if self.meta is not None:
            self.allgather_object(None, "barrier")

    @property
    def abort_ends_every_rank(self) -> bool:
        return self.meta is not None and self.meta.abort_ends_every_rank

    def _abort(self, reason: str) -> None:
        abort = getattr(self.device, "abort", None)
        if abort is not None:  # unblock this rank's NCCL kernels first
            abort()
        if self.meta is not None:
            self.meta._abort(reason)

    def _split(self, color, key, members, name):
        """A sub-group with its own NCCL communicator, bootstrapped over the same split of the
        host (collective over this group); the sub-group owns its host's split."""
        if self.meta is None or self.connect is None:
            raise RuntimeError("an NCCLTransport without an MPI communicator (or a way to connect "
                               "one) cannot make sub-groups")
        sub_host = self.meta._split(color, key, members, name)
        try:
            return NCCLTransport(sub_host.rank, sub_host.size, CupyDevice(self.connect(sub_host)),
                                 sub_host, self.timeout, self.connect)
        except BaseException:
            sub_host.close()
            raise

    def say_left(self, why: str) -> None:
        if self.meta is not None:   # the agreement rounds run there
            self.meta.say_left(why)

    def close(self) -> None:
        self._close_subgroups()
        self.watchdog.stop()
        close = getattr(self.device, "close", None)
        if close is not None:
            close()
        if self.meta is not None:
            self.meta.left_why = self.left_why   # its close tells the peers (`say_left`)
            self.meta.close()
            self.meta = None


__all__ = ["NCCLTransport", "CupyDevice", "EventWatchdog", "nccl_dtype", "nccl_count"]
