"""Loopback transport: G ranks as threads of one process, sharing one device.

NCCL refuses two ranks on one GPU, so a single GPU cannot run a multi-rank ring through it. This
transport moves the ring's messages between ranks that share a device, with the same ordering
contract as `NCCLTransport` (see burstcu.transport.base), so the real engine, its double buffers
and its stream/event ordering run on real hardware with G = 2, 3, 4, ... ranks:

    sender s, commit:   record ready_s on s's compute stream; publish (send_buf, ready_s)
    receiver r, commit: record ready_r on r's compute stream; r's comm stream waits ready_r
                        (r's earlier kernels are done with recv_buf); for each receive: take the
                        sender's (send_buf, ready_s) from the hub (the host blocks until the
                        sender has committed the matching message), comm stream waits ready_s,
                        device-to-device copy send_buf -> recv_buf on r's comm stream, record
                        copied on it and publish it
    receiver r, wait:   record arrived on r's comm stream; r's compute stream waits arrived
    sender s, wait:     take every `copied` of its sends (published by the receivers) and make
                        s's compute stream wait on each: s may overwrite send_buf afterwards

Each rank thread runs on its own compute stream and its own communication stream, so one rank's
copies overlap its own and the other ranks' kernels as NCCL's would. Events are created per
message: an event re-recorded by a sender one step ahead would otherwise release (or block) a
peer's earlier wait. The host never synchronizes a stream.

The same transport runs on the CPU with `HostDevice` (no streams: the receiver copies with NumPy
at commit, the sender's wait returns once every receiver has copied), which is how CI runs it, and
under `burstcu.testing.schedule` with a recording device, which proves the GPU ordering race-free.

Messages are matched per (sender, receiver) pair in commit order, like NCCL point-to-point calls.
Every host-side wait for a peer has a deadline; when it passes, or when another rank fails
(`LoopbackHub.abort`), the waiting rank raises `CommTimeoutError` / `PeerFailedError` naming the
peer, so one failing rank never leaves the others hanging.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any, Sequence

import numpy as np

from . import wire
from .base import (FIRST_USE_COMPILE, LEFT, CommTimeoutError, PeerFailedError, Transport, agreed,
                   answer_of, check_contiguous, nbytes)
from .streams import CupyStreams, join_stream


class LoopbackHub:
    """The mailboxes and the barrier shared by the `size` ranks of one loopback world.

    timeout: seconds a rank waits for a peer before raising CommTimeoutError.
    """

    def __init__(self, size: int, timeout: float = 120.0):
        if size < 1:
            raise ValueError(f"a loopback world needs at least one rank, not {size}")
        self.size = size
        self.timeout = float(timeout)
        self._cond = threading.Condition()
        self._boxes: dict[tuple, Any] = {}
        self._failure: str | None = None
        # a rank's k-th transport on the hub (`join`) meets the others' k-th: its generation,
        # each with its own agreement rounds
        self._objects: dict[tuple, list] = {}   # (generation, round) -> [slots, readers]
        self._rounds: dict[tuple, int] = {}     # (rank, generation) -> its next round
        self._generations = [0] * size          # transports made so far, rank by rank
        self._subhubs: dict[tuple, LoopbackHub] = {}
        # (rank, generation) -> what stands for that rank in the generation's rounds once it left
        self._left: dict[tuple, Any] = {}

    def subhub(self, name: str, members: tuple[int, ...]) -> "LoopbackHub":
        """The hub of the sub-group `members` made under `name`: the first member thread to ask
        makes it, the others get the same one. An abort of this hub reaches it."""
        with self._cond:
            hub = self._subhubs.get((name, members))
            if hub is None:
                hub = self._subhubs[(name, members)] = LoopbackHub(len(members), self.timeout)
                if self._failure is not None:
                    hub.abort(self._failure)
            return hub

    def abort(self, reason: str) -> None:
        """Wake every waiting rank with PeerFailedError(reason) (first reason wins), in this
        hub and in every sub-group hub made from it."""
        with self._cond:
            if self._failure is None:
                self._failure = reason
            self._cond.notify_all()
            subhubs = list(self._subhubs.values())
        for hub in subhubs:
            hub.abort(reason)

    def join(self, rank: int) -> int:
        """A transport of `rank` is made on this hub: its generation (1 for the first)."""
        with self._cond:
            self._generations[rank] += 1
            return self._generations[rank]

    def leave(self, rank: int, generation: int, stand_in: Any) -> None:
        """`rank`'s transport of `generation` has left: `stand_in` is its object in every one of
        that generation's agreement rounds from now on."""
        with self._cond:
            self._left[(rank, generation)] = stand_in
            self._cond.notify_all()

    def put(self, key: tuple, value: Any) -> None:
        with self._cond:
            assert key not in self._boxes, f"message {key} posted twice"
            self._boxes[key] = value
            self._cond.notify_all()

    def take(self, key: tuple, what: str) -> Any:
        """The value put under `key`, removed; blocks until it is there (or timeout / abort)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while key not in self._boxes:
                if self._failure is not None:
                    raise PeerFailedError(f"stopped waiting for {what}: {self._failure}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"waited {self.timeout:g} s for {what}; {FIRST_USE_COMPILE}")
                self._cond.wait(min(left, 1.0))
            return self._boxes.pop(key)

    def allgather_object(self, rank: int, obj: Any, generation: int = 0) -> list:
        """Every rank's `obj` in rank order. Round k of every rank's transports of `generation`
        meets round k of the others'; a rank that has left (`leave`) is its stand-in there; a
        round's slots are dropped once every rank has read them (or stands in)."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            round_ = self._rounds.get((rank, generation), 0)
            self._rounds[(rank, generation)] = round_ + 1
            key = (generation, round_)
            slots = self._objects.setdefault(key, [[None] * self.size, 0])[0]
            slots[rank] = (obj,)
            self._cond.notify_all()
            while any(slot is None for slot in slots):
                for peer in [p for p, slot in enumerate(slots) if slot is None]:
                    if (peer, generation) in self._left:
                        slots[peer] = (self._left[(peer, generation)],)
                        self._objects[key][1] += 1   # it reads nothing more
                missing = [peer for peer, slot in enumerate(slots) if slot is None]
                if not missing:
                    break
                if self._failure is not None:
                    raise PeerFailedError(f"rank {rank} stopped waiting for rank(s) {missing} "
                                          f"(agreement round {round_}): {self._failure}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"rank {rank} waited {self.timeout:.0f} s for rank(s) "
                                           f"{missing} (agreement round {round_})")
                self._cond.wait(min(left, 1.0))
            self._objects[key][1] += 1
            if self._objects[key][1] == self.size:
                del self._objects[key]
            return [slot[0] for slot in slots]


# ----------------------------------------------------------------------------------------------
# devices: what moves the bytes

class HostDevice:
    """The CPU: no streams or events (every action completes when issued); copies with NumPy."""

    def current_stream(self) -> None:
        return None

    def new_stream(self) -> None:
        return None

    def new_event(self) -> None:
        return None

    def record(self, event: Any, stream: Any) -> None:
        pass

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        dst.reshape(-1).view(np.uint8)[...] = src.reshape(-1).view(np.uint8)

    def annotate(self, label: str):
        return nullcontext()


class CupyCopyDevice(CupyStreams):
    """One GPU shared by the ranks: CuPy streams and events, device-to-device async copies."""

    def copy(self, dst: Any, src: Any, stream: Any) -> None:
        runtime = self._cupy.cuda.runtime
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes(src),
                            runtime.memcpyDeviceToDevice, stream.ptr)


# ----------------------------------------------------------------------------------------------
# the transport

class LoopbackTransport(Transport):
    """Rank `rank` of a loopback world (see the module docstring).

    hub: the world's LoopbackHub. device: HostDevice, CupyCopyDevice, or a recorder with the same
    methods (burstcu.testing.schedule). Must be created and used on the rank's own thread, with that
    thread's compute stream current (CuPy's current stream is per thread).
    """

    name = "loopback"

    def __init__(self, rank: int, hub: LoopbackHub, device: Any):
        super().__init__(rank, hub.size, hub.timeout)
        self.hub = hub
        self.generation = hub.join(rank)
        self.device = device
        self.stream = device.new_stream()
        self._arrived = device.new_event()
        self._sent = [0] * hub.size       # messages posted to each peer so far
        self._received = [0] * hub.size   # messages taken from each peer so far
        self._unconfirmed: list[tuple] = []  # keys of sends whose `copied` is still to wait on
        self._in_flight = False
        self._collectives = 0

    def _post(self, exchanges: Sequence[tuple[Any, Any, int, int]]) -> None:
        for send_buf, recv_buf, _, _ in exchanges:  # fail before anything is posted
            for buf, what in ((send_buf, "send"), (recv_buf, "receive")):
                if buf is not None:
                    check_contiguous(buf, what, "loopback")
        dev = self.device
        with dev.annotate("burstcu commit"):
            ready = dev.new_event()
            dev.record(ready, dev.current_stream())
            for send_buf, _, dst, _ in exchanges:
                if send_buf is not None:
                    key = ("msg", self.rank, dst, self._sent[dst])
                    self._sent[dst] += 1
                    self.hub.put(key, (send_buf, ready))
                    self._unconfirmed.append(key)
            dev.wait_event(self.stream, ready)
            with self._blocking():   # the host waits for each peer to post the message it takes
                for _, recv_buf, _, src in exchanges:
                    if recv_buf is not None:
                        key = ("msg", src, self.rank, self._received[src])
                        self._received[src] += 1
                        self._receive(key, recv_buf, src)
        self._in_flight = True

    def _receive(self, key: tuple, recv_buf: Any, src: int) -> None:
        dev = self.device
        send_buf, peer_ready = self.hub.take(
            key, f"rank {src}'s message #{key[3]} to rank {self.rank} (step {self.stats.steps})")
        if nbytes(send_buf) != nbytes(recv_buf):
            problem = (f"rank {src} sent {nbytes(send_buf)} bytes, rank {self.rank} expected "
                       f"{nbytes(recv_buf)}")
            self.hub.abort(problem)
            raise ValueError(problem)
        dev.wait_event(self.stream, peer_ready)
        dev.copy(recv_buf, send_buf, self.stream)
        copied = dev.new_event()
        dev.record(copied, self.stream)
        self.hub.put(("copied",) + key[1:], copied)

    def _wait(self) -> None:
        if not self._in_flight:
            return
        dev = self.device
        with dev.annotate("burstcu wait"):
            join_stream(dev, self.stream, self._arrived)
            keys, self._unconfirmed = self._unconfirmed, []
            for key in keys:
                copied = self.hub.take(("copied",) + key[1:],
                                       f"rank {key[2]} to receive message #{key[3]} of rank {self.rank}")
                dev.wait_event(dev.current_stream(), copied)
        self._in_flight = False

    # -- collectives ---------------------------------------------------------------------------
    def allgather(self, send_buf: Any, recv_buf: Any) -> None:
        """Every rank's send_buf into recv_buf (rank-major), stream-ordered like a ring step. The
        host blocks until every rank has posted its piece and taken this one's (the hub's
        hand-overs): `stats.wait_seconds`."""
        check_contiguous(send_buf, "send", "loopback")
        check_contiguous(recv_buf, "receive", "loopback")
        if nbytes(recv_buf) != nbytes(send_buf) * self.size:
            raise ValueError(f"allgather: recv_buf has {nbytes(recv_buf)} bytes, needs "
                             f"{self.size} x {nbytes(send_buf)}")
        dev, n = self.device, self._collectives
        self._collectives += 1
        flat = recv_buf.reshape(-1).view(np.uint8)
        width = nbytes(send_buf)
        with dev.annotate("burstcu allgather"), self._blocking():
            ready = dev.new_event()
            dev.record(ready, dev.current_stream())
            for peer in range(self.size):
                self.hub.put(("gather", n, self.rank, peer), (send_buf, ready))
            dev.wait_event(self.stream, ready)
            for peer in range(self.size):
                part, peer_ready = self.hub.take(("gather", n, peer, self.rank),
                                                 f"rank {peer}'s allgather #{n} contribution")
                dev.wait_event(self.stream, peer_ready)
                dev.copy(flat[peer * width:(peer + 1) * width], part, self.stream)
            done = dev.new_event()
            dev.record(done, self.stream)
            for peer in range(self.size):
                self.hub.put(("gathered", n, self.rank, peer), done)
            for peer in range(self.size):  # my send_buf is free once every rank has copied it
                dev.wait_event(dev.current_stream(),
                               self.hub.take(("gathered", n, peer, self.rank),
                                             f"rank {peer} to finish allgather #{n}"))
        self.stats.bytes_sent += width * (self.size - 1)
        self.stats.bytes_received += width * (self.size - 1)
        self.stats.messages += self.size - 1   # G-1 pieces out, as `CommStats` counts

    def allgather_object(self, obj: Any, what: str = "metadata") -> list:
        # in the wire encoding, as over MPI: plain values only, whatever the transport
        messages = self.hub.allgather_object(self.rank, wire.labelled(what, obj), self.generation)
        return agreed(answer_of([wire.unlabelled(m) for m in messages]))

    def barrier(self) -> None:
        self.allgather_object(None, "barrier")

    def say_left(self, why: str) -> None:
        """(See `Transport.say_left`.) A message labelled as the call `LEFT` stands for this
        rank in its peers' agreement rounds from now on."""
        self.hub.leave(self.rank, self.generation, wire.labelled(f"{LEFT} ({why})", None))

    def close(self) -> None:
        super().close()
        self.say_left(self.left_why)

    def _abort(self, reason: str) -> None:
        self.hub.abort(reason)
        if self.parent is not None:  # the whole world stops, not only this sub-group
            self.parent._abort(reason)

    def _split(self, color, key, members, name):
        return type(self)(members.index(self.rank), self.hub.subhub(name, members), self.device)


__all__ = ["LoopbackHub", "LoopbackTransport", "HostDevice", "CupyCopyDevice", "PeerFailedError"]
