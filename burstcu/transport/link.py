"""An emulated network link for the MPI transport: `Link(gbps=..., latency_us=...)`.

On one machine MPI moves a ring step's message through shared memory in about a millisecond,
far faster than the step's compute, so nothing shows whether the exchange really runs behind
the compute. `burstcu.init(..., link=Link(gbps=1, latency_us=50))` paces every message as a
network of that speed would: the exchange then takes as long as it would on such a link, and
overlapping it with compute becomes measurable (`bench/cpu/overlap.py --link-gbps`).

The model, per rank: one port, full duplex, which every group of the rank made with that link
shares. Messages leave through the outgoing direction one after another, each occupying it for
`latency + n * 8 / (gbps * 1e9)` seconds (n bytes); messages arrive through the incoming
direction the same way. A message of n bytes therefore completes no earlier than latency +
n*8/(gbps*1e9) after it was posted, later while earlier messages still occupy its direction; an
exchange (one commit) completes when its last message does. This is the cost model's
(`burstcu.plan`, `bench/model/predict.py`) `t_comm = messages * latency + bytes / bandwidth`
for each direction. The clock of each message starts when its data can start to move on this
rank: when this rank posts it with the progress thread (progress="thread"), at the `wait` that
moves it with progress="inline" (there the data moves only inside the wait, so however long the
compute between post and wait, the wait takes the link's time: nothing is hidden). The sender's
and the receiver's sides are paced alike; a peer that posts later delays the data as well, but
the pacing does not add that peer's lateness to the link time.

Pacing is done by the transport's progress thread, which sleeps until a message's completion
time after MPI has really moved it, so the exchange overlaps with compute exactly as it would
on a NIC; the caller's `wait` returns only then (inline: the wait itself sleeps until then).
The all-gather is paced as G-1 messages of one piece each way (what it counts in `stats`), on
the calling thread: it blocks anyway.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Link:
    """An emulated link: `gbps` gigabits per second each way (1 Gb/s = 1e9 bits/s), and
    `latency_us` microseconds per message. See the module docstring for the model."""

    gbps: float
    latency_us: float = 0.0

    def __post_init__(self):
        for name, low in (("gbps", None), ("latency_us", 0.0)):
            value = getattr(self, name)
            ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
                  and math.isfinite(value) and (value > 0 if low is None else value >= low))
            if not ok:
                need = "a positive number" if low is None else "a number >= 0"
                raise ValueError(f"Link({name}=...) must be {need}, not {value!r}")
            object.__setattr__(self, name, float(value))   # a NumPy number too: plain, as it travels

    def seconds(self, nbytes: int) -> float:
        """Time one message of `nbytes` occupies a direction of the port."""
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)

    def describe(self) -> str:
        """The label every link-dependent figure carries: "emulated link 1 Gb/s, 50 us"."""
        return f"emulated link {self.gbps:g} Gb/s, {self.latency_us:g} us"

    def __str__(self) -> str:
        return self.describe()

    def as_dict(self) -> dict:
        return {"link_gbps": self.gbps, "link_latency_us": self.latency_us}


class Port:
    """One rank's port on a `Link`: when each direction is free again (time.monotonic()).
    Shared by every group of this process on the same link, sub-groups too (one rank, one
    port: `port_of`); posts may come from any thread."""

    def __init__(self, link: Link):
        self.link = link
        self._free = {"out": 0.0, "in": 0.0}
        self._lock = threading.Lock()
        self.holders = 0   # the open groups on it (`port_of`, `release_port`)

    def schedule(self, sent: Sequence[int], received: Sequence[int], posted: float | None = None) -> float:
        """Queue messages of these sizes (bytes) posted at `posted` (default now): the moment
        the last of them completes."""
        posted = time.monotonic() if posted is None else posted
        done = posted
        with self._lock:
            for direction, sizes in (("out", sent), ("in", received)):
                if not sizes:
                    continue
                free = max(posted, self._free[direction])
                for n in sizes:
                    free += self.link.seconds(n)
                self._free[direction] = free
                done = max(done, free)
        return done


_PORTS: dict[Link, Port] = {}
_PORTS_LOCK = threading.Lock()


def port_of(link: Link) -> Port:
    """This process's port on `link` (an equal Link is the same link) for one more group: the
    open groups a rank makes with it queue their messages through one port, as a rank's one
    NIC would. Give it back with `release_port` when the group closes."""
    with _PORTS_LOCK:
        port = _PORTS.setdefault(link, Port(link))
        port.holders += 1
        return port


def release_port(port: Port) -> None:
    """A group on `port` has closed; once none is left the port goes, with what its messages
    had booked (a later group starts on a free link, not behind a closed group's messages
    that never moved)."""
    with _PORTS_LOCK:
        port.holders -= 1
        if port.holders <= 0 and _PORTS.get(port.link) is port:
            del _PORTS[port.link]


__all__ = ["Link", "Port", "port_of", "release_port"]
