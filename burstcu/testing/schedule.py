"""Record the stream/event schedule of the ring engine over NCCL and prove it race-free, on a CPU.

What is recorded (`record`): one or more forward or backward calls of a strategy of
`burstcu.engine` (burst, ring, allgather, ulysses, and the linear ones, lasp1 and lasp2), or
(`record_decode`) of its decode, driving the real `NCCLTransport`, whose device (streams, events,
NCCL calls) is replaced by a `RecordingDevice`, and a `RecordingOps` whose arrays are
`FakeArray`s: views = (buffer id, byte range), no data. Every op, and the array arithmetic the
linear strategies write themselves (on the compute stream, as CuPy runs it), appends an `Action`
that reads and writes byte regions on a stream:

    compute stream   alloc, free, copy_, add_, zeros, forward_step (reads k, v; rw state),
                     backward_step (reads q, dout, lse, delta; rw dq, ctx), ...; wait(arrived)
    comm stream      wait(ready), send (reads its span), recv (writes its span), allgather,
                     record(arrived)
    both             record(event) on one stream, wait(event) on another

`alloc` writes every byte of a new buffer (the pool may hand out memory earlier compute work
used). Every view keeps its buffer's allocation alive; when the last one dies, a `free` that
writes every byte of the buffer is logged on the compute stream before the next action (CuPy's
pool may give the bytes to the next allocation there, and NCCL holds raw pointers, not views).
Two sentinel actions on the compute stream bracket the recorded calls: `begin` writes the
caller's inputs (the caller produced them on that stream) and `end` reads and writes every
buffer (after the call the caller, or the memory pool, may reuse any of it); frees after `end`
are not logged. Between two calls, `between` reads what the last one returned and writes the
inputs (the caller's work on that stream).

What is proved (`check`): happens-before = program order on each stream (the members of one
NCCL group are unordered with each other) + each event wait after the event's latest record
issued before it. For every pair of actions that touch overlapping bytes, at least one writing,
the one the host issued first must happen-before the other: then every stream interleaving the
GPU may choose gives the result of the host's program order, which is what the MPI transport and
the NumPy ops compute. A wait on an event never recorded is an error (CUDA treats it as a no-op,
so it silently orders nothing).

`check_world` adds the cross-rank rules. For each (source, destination) pair of ranks, the i-th
send from source to destination must meet an i-th receive from source at destination with the
same byte count (counts only: which bytes a message carries is followed by the replays
below). Every send and recv is in an NCCL group: the one between groupStart and groupEnd, or,
for a call outside any, a group of its own (NCCL runs it alone, in stream order, until its
peer's call runs). Each rank runs its groups in issue order,
a matched pair's two groups must run together, and so must the k-th all-gather of every rank;
a cycle of ranks each waiting in an earlier group for another's later one is reported as a
deadlock. So grouped exchanges, and ungrouped ones ordered even ranks send first / odd ranks
receive first, pass; blocking send-then-recv on every rank of a ring does not.

What the bytes carry (replaying every rank's schedule together, messages and all-gathers
delivering labels): `forward_blocks_read`, the K/V block each forward step reads;
`backward_sums`, the gradient terms (query rank, key rank, the (query row, key row) pairs its
blocks keep) each returned dq, dk, dv sums, repeats kept, with every input, context and
accumulator told apart (q from dout, dK from dV), so a term added twice, dropped, masked
wrongly, read from the wrong tensor or sent to the wrong owner shows; `decode_parts_merged`,
whose partial, of which call, each part of a decode merge is; `linear_sums`, which chunks'
states (LASP's M and dM) each returned row of linear attention sums, and through which rows;
`provenance`, where each byte a kernel reads and each byte returned came from (which rank's
input, or which element of which rank's kernel output), for a test to compare with what a
strategy should move where (Ulysses' head slices). Labels follow the exact bytes of every
view, strided ones included (`Region.runs`).

Ranks are simulated one after another in this process: the transport needs no peers to record.
`record_loopback` records the one-GPU loopback transport's ranks as threads into one schedule
(usp, whose sub-groups need it). A `Partition` layout records uneven shards, each rank with its
own length; `calls` > 1 records calls in a row on one op, so the buffers it keeps between calls
(burst's message pairs, decode's partials) are proved reused safely. Not recorded: host-side
agreement (`allgather_object`) and the kernels' own work (one `kernel` action each).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager
from functools import lru_cache
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import numpy as np

from .. import engine
from ..engine import decode as decode_engine
from ..layout import Partition
from ..ops.base import LocalOps, Message, accum_dtype, as_dtype
from ..transport.loopback import LoopbackHub, LoopbackTransport
from ..transport.nccl import NCCLTransport

COMPUTE = "compute"


# ----------------------------------------------------------------------------------------------
# fake arrays: where bytes live, not what they hold

@dataclass(frozen=True)
class Region:
    """Bytes [lo, hi) of buffer `buffer`; of a strided view, `runs` are the bytes it holds,
    exactly ((first byte, bytes), ... in the view's element order: `FakeArray.runs`), and
    [lo, hi) bounds them (what the race checker compares)."""

    buffer: int
    lo: int
    hi: int
    runs: tuple | None = field(default=None, compare=False)

    def overlaps(self, other: "Region") -> bool:
        return self.buffer == other.buffer and self.lo < other.hi and other.lo < self.hi


class _Allocation:
    """What every view of one recorded buffer holds: it dies with the buffer's last view, and
    the recorder then logs the buffer's free (`RecordingDevice.alloc`). `device`: the recorder
    the array's arithmetic is recorded on."""

    def __init__(self, device: "RecordingDevice"):
        self.device = device


class _Flags:
    def __init__(self, c_contiguous: bool = True):
        self.c_contiguous = c_contiguous


def elements(dst: "FakeArray", src) -> tuple:
    """A copy's or sum's `Action.detail`: ("elements", of dst, of src (a scalar: 1))."""
    return ("elements", dst.size, getattr(src, "size", 1))


class FakeArray:
    """A view of `shape`/`dtype` starting at byte `offset` of buffer `buffer`: C-contiguous, or
    (a slice along several axes, as the all-to-all strategies take heads and rows) strided, in
    which case its region is the whole byte range from its first to its last element, a
    conservative bound for the race checker, and `runs` the bytes it holds exactly.

    Supports what the engines and `Message` do to arrays: slicing with unit steps, `view` and
    `reshape` of contiguous views. Every view keeps the `allocation` of its buffer alive, as a
    CuPy view keeps its memory.
    """

    def __init__(self, buffer: int, offset: int, shape: tuple, dtype: Any, span: int | None = None,
                 allocation: _Allocation | None = None, strides: tuple | None = None):
        self.buffer, self.offset, self.allocation = buffer, offset, allocation
        self.shape, self.dtype = tuple(int(n) for n in shape), as_dtype(dtype)
        self.span = self.nbytes if span is None else span      # bytes from first to last element
        self.flags = _Flags(self.span == self.nbytes)
        # bytes between neighbours along each axis (C order unless a strided slice says)
        self.strides = strides if strides is not None else tuple(
            int(x) for x in np.cumprod((1,) + self.shape[:0:-1])[::-1] * self.dtype.itemsize)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def region(self) -> Region:
        return Region(self.buffer, self.offset, self.offset + self.span,
                      None if self.flags.c_contiguous else self.runs())

    def __getitem__(self, key) -> "FakeArray":
        assert self.flags.c_contiguous, "slicing a strided fake view is not supported"
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (len(self.shape) - len(key) + 1) + key[at + 1:]
        key = key + (slice(None),) * (len(self.shape) - len(key))
        assert not any(isinstance(k, (bool, np.bool_)) for k in key), key
        dropped = [isinstance(k, (int, np.integer)) for k in key]   # an integer drops its axis
        for k, n, drop in zip(key, self.shape, dropped):
            if drop and not -n <= k < n:
                raise IndexError(f"index {k} is out of bounds for an axis of size {n}")
        key = tuple(slice(int(k) % n, int(k) % n + 1) if drop else k
                    for k, n, drop in zip(key, self.shape, dropped))
        assert all(isinstance(k, slice) and k.step in (None, 1) for k in key), key
        bounds = [k.indices(n)[:2] for k, n in zip(key, self.shape)]
        shape = tuple(max(hi - lo, 0) for lo, hi in bounds)
        strides = self.strides
        first = sum(int(lo) * int(st) for (lo, _), st in zip(bounds, strides))
        last = sum((int(lo) + n - 1) * int(st) for (lo, _), n, st in zip(bounds, shape, strides))
        span = 0 if 0 in shape else last - first + self.dtype.itemsize
        kept = [(n, int(st)) for n, st, drop in zip(shape, strides, dropped) if not drop]
        return FakeArray(self.buffer, self.offset + first, tuple(n for n, _ in kept), self.dtype, span,
                         self.allocation, tuple(st for _, st in kept))

    def runs(self) -> tuple:
        """(first byte, bytes) of each contiguous run of bytes the view holds, in C order of its
        elements, adjacent runs merged."""
        if self.size == 0:
            return ()
        if self.flags.c_contiguous:
            return ((self.offset, self.nbytes),)
        inner, axes = self.dtype.itemsize, len(self.shape)
        while axes and (self.shape[axes - 1] == 1 or self.strides[axes - 1] == inner):
            inner *= self.shape[axes - 1]          # the innermost axes that are contiguous
            axes -= 1
        runs: list[tuple[int, int]] = []
        for index in itertools.product(*(range(n) for n in self.shape[:axes])):
            first = self.offset + sum(i * st for i, st in zip(index, self.strides))
            if runs and sum(runs[-1]) == first:
                runs[-1] = (runs[-1][0], runs[-1][1] + inner)
            else:
                runs.append((first, inner))
        return tuple(runs)

    # array arithmetic as the linear strategies write it (CuPy runs it on the current stream,
    # the compute stream): each is a kernel there, a new array where it makes one
    def _kernel(self, name: str, reads: Sequence, writes: Sequence, detail: Any = None) -> None:
        self.allocation.device.kernel(name, [a for a in reads if isinstance(a, FakeArray)], writes, detail)

    def _new(self, name: str, shape, dtype) -> "FakeArray":
        dtype = as_dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        return self.allocation.device.alloc(nbytes, name).view(dtype).reshape(shape)

    def __add__(self, other) -> "FakeArray":
        assert not isinstance(other, FakeArray) or other.shape == self.shape, (self, other)
        dtype = np.result_type(self.dtype, other.dtype if isinstance(other, FakeArray) else self.dtype)
        out = self._new("sum", self.shape, dtype)
        self._kernel("add", [self, other], [out], elements(out, other))
        return out

    def __iadd__(self, other) -> "FakeArray":
        """In place, as CuPy's `+=` runs: `add_`."""
        self.allocation.device.kernel("add_", [self] + ([other] if isinstance(other, FakeArray) else []),
                                      [self], detail=elements(self, other))
        return self

    def __setitem__(self, key, value) -> None:
        dst = self[key]
        self._kernel("setitem", [value], [dst], elements(dst, value) if isinstance(value, FakeArray)
                     else ("fill", value))

    def astype(self, dtype) -> "FakeArray":
        out = self._new("astype", self.shape, dtype)
        self._kernel("astype", [self], [out], elements(out, self))
        return out

    def view(self, dtype: Any) -> "FakeArray":
        dtype = as_dtype(dtype)
        assert self.flags.c_contiguous and self.nbytes % dtype.itemsize == 0
        return FakeArray(self.buffer, self.offset, (self.nbytes // dtype.itemsize,), dtype,
                         allocation=self.allocation)

    def reshape(self, shape) -> "FakeArray":
        assert self.flags.c_contiguous and int(np.prod(shape)) == self.size
        return FakeArray(self.buffer, self.offset, shape, self.dtype, allocation=self.allocation)

    def __repr__(self) -> str:
        return f"FakeArray(buffer={self.buffer}, bytes=[{self.region.lo}, {self.region.hi}))"


# ----------------------------------------------------------------------------------------------
# the recorded schedule

@dataclass(frozen=True)
class Action:
    """One thing issued to a stream, in host issue order (`index`).

    kind: alloc, free, kernel, send, recv, allgather, record, wait, begin, between, end.
    label: the annotation ranges open when it was issued + what it is (e.g. "fwd 2 compute /
        forward_step"). group: the NCCL group ordinal on this rank (send/recv/allgather only;
        a call outside groupStart/groupEnd, and each all-gather, is a group of its own).
    detail: what the replays need of a kernel beyond its bytes: for copies (copy_, setitem,
        astype) and sums (add_, add) `elements`, or the value of a fill ("fill", value); for
        forward_step and backward_step the step's blocks (`kept_rows` gives the pairs they
        keep); for the linear products the bytes of one row of each argument.
    sizes: the itemsize of each array a kernel writes.
    """

    index: int
    stream: str
    kind: str
    label: str
    reads: tuple = ()
    writes: tuple = ()
    event: str | None = None
    peer: int | None = None
    group: int | None = None
    nbytes: int = 0
    detail: Any = None
    sizes: tuple = ()

    def describe(self) -> str:
        return f"#{self.index} {self.kind} on the {self.stream} stream ({self.label})"


@dataclass
class Schedule:
    """The actions one rank issued in its recorded engine calls, the names of its buffers, and
    the bytes of the arrays the last call returned (in their order: out, lse; dq, dk, dv; then
    the row sums a backward was given to fill)."""

    rank: int
    size: int
    actions: list[Action]
    buffers: dict[int, str]
    outputs: tuple[Region, ...] = ()

    def renumbered(self, actions: Sequence[Action]) -> "Schedule":
        """A copy with `actions` (an edited list) in the given order, re-indexed 0..n-1."""
        return replace(self, actions=[replace(a, index=i) for i, a in enumerate(actions)],
                       buffers=dict(self.buffers))


class RecordingDevice:
    """The device interface of `burstcu.transport.nccl.CupyDevice`, recording instead of doing.

    Streams and events are names. `kernel` and `alloc` are how `RecordingOps` issues compute work.
    """

    def __init__(self):
        self.actions: list[Action] = []
        self.buffers: dict[int, str] = {}
        self._labels: list[str] = []
        self._last_label = "start"  # the last top-level range, to place unannotated work
        self._streams = 0
        self._events = 0
        self._groups = 0
        self._group_open: int | None = None
        self._freed: list[tuple[Region, str]] = []   # (bytes, label) of frees not yet logged
        self._ended = False

    # -- recording ---------------------------------------------------------------------------
    def _stream(self, name: str) -> str:
        """The recorded name of stream `name`."""
        return name

    def _label(self, what: str) -> str:
        if self._labels:
            return " / ".join(self._labels + [what])
        return f"{what}, after '{self._last_label}'"

    def _add(self, stream: str, kind: str, what: str, **kw) -> Action:
        # a buffer freed since the last action was freed before this one is issued
        while self._freed:
            region, label = self._freed.pop(0)
            self._append(COMPUTE, "free", label, writes=(region,))
        return self._append(stream, kind, self._label(what), **kw)

    def _append(self, stream: str, kind: str, label: str, **kw) -> Action:
        action = Action(len(self.actions), self._stream(stream), kind, label, **kw)
        self.actions.append(action)
        return action

    @contextmanager
    def annotate(self, label: str) -> Iterator[None]:
        self._labels.append(label)
        try:
            yield
        finally:
            self._labels.pop()
            if not self._labels:
                self._last_label = label

    def alloc(self, nbytes: int, name: str) -> FakeArray:
        """A new buffer from the pool: a write of all its bytes on the compute stream (the memory
        may have been used by earlier compute work). When its last view is gone, a `free` on the
        compute stream writes all its bytes, logged before the next action (CuPy's pool may
        give them to the next allocation on that stream, and NCCL holds raw pointers, not views,
        so a buffer the comm stream still reads or writes must stay referenced until the wait);
        frees after `end` are not logged (`end` covers them)."""
        arr = FakeArray(self._new_buffer(name), 0, (nbytes,), np.uint8, allocation=_Allocation(self))
        self._add(COMPUTE, "alloc", f"alloc {name}", writes=(arr.region,))
        weakref.finalize(arr.allocation, self._free, arr.region, name).atexit = False
        return arr

    def _new_buffer(self, name: str) -> int:
        """The id of a new buffer called `name`."""
        buffer = len(self.buffers)
        self.buffers[buffer] = name
        return buffer

    def _free(self, region: Region, name: str) -> None:
        """The last view of a buffer died (on any thread, maybe inside `_add`: only queue it,
        labelled where the host is now)."""
        if not self._ended:
            self._freed.append((region, self._label(f"free {name}")))

    def kernel(self, name: str, reads: Sequence[FakeArray] = (), writes: Sequence[FakeArray] = (),
               detail: Any = None) -> None:
        self._add(COMPUTE, "kernel", name, reads=tuple(a.region for a in reads),
                  writes=tuple(a.region for a in writes), detail=detail,
                  sizes=tuple(a.dtype.itemsize for a in writes))

    def sentinel(self, kind: str) -> None:
        """begin: the caller wrote its inputs; end: anything may be reused (see module doc)."""
        every = tuple(Region(b, 0, 1 << 62) for b in self.buffers)
        self._add(COMPUTE, kind, kind, reads=every if kind == "end" else (), writes=every)
        self._ended = kind == "end"

    def between(self, returned: Sequence[FakeArray], inputs: Sequence[FakeArray]) -> None:
        """Between two recorded calls, on the compute stream: the caller reads what the last
        call returned and writes the next call's inputs."""
        self._add(COMPUTE, "between", "between calls", reads=tuple(a.region for a in returned),
                  writes=tuple(a.region for a in inputs))

    # -- the CupyDevice interface ------------------------------------------------------------
    def current_stream(self) -> str:
        return COMPUTE

    def new_stream(self) -> str:
        self._streams += 1
        return f"comm{self._streams - 1}" if self._streams > 1 else "comm"

    def new_event(self) -> str:
        self._events += 1
        return f"event{self._events - 1}"

    def record(self, event: str, stream: str) -> None:
        self._add(stream, "record", f"record {event}", event=event)

    def wait_event(self, stream: str, event: str) -> None:
        self._add(stream, "wait", f"wait {event}", event=event)

    def query(self, event: str) -> bool:
        """Whether the event has completed: always, unless `stalled` (a test of the watchdog: a
        peer that never answers). Then a stream stops at its first NCCL call, or at a wait on
        an event that never completes: an event completes iff nothing before its latest record
        on its stream stops it (an event never recorded has completed, as in CUDA)."""
        return not getattr(self, "stalled", False) or self._completes(event, len(self.actions))

    def _completes(self, event: str, before: int) -> bool:
        """Under `stalled`: whether `event`'s latest record among actions[:before] completes."""
        record = next((a for a in reversed(self.actions[:before])
                       if a.kind == "record" and a.event == event), None)
        if record is None:
            return True
        return not any(a.kind in ("send", "recv", "allgather")
                       or a.kind == "wait" and not self._completes(a.event, a.index)
                       for a in self.actions[:record.index] if a.stream == record.stream)

    def group_start(self) -> None:
        assert self._group_open is None, "NCCL groups do not nest here"
        self._group_open = self._groups
        self._groups += 1

    def group_end(self) -> None:
        assert self._group_open is not None, "groupEnd without groupStart"
        self._group_open = None

    def _group(self) -> int:
        """The group of a send/recv issued now: the open one, or, outside groupStart/groupEnd,
        a group of its own (NCCL runs an ungrouped call by itself, in stream order)."""
        if self._group_open is not None:
            return self._group_open
        self._groups += 1
        return self._groups - 1

    def send(self, buf: FakeArray, peer: int, stream: str) -> None:
        self._add(stream, "send", f"send to rank {peer}", reads=(buf.region,), peer=peer,
                  group=self._group(), nbytes=buf.nbytes)

    def recv(self, buf: FakeArray, peer: int, stream: str) -> None:
        self._add(stream, "recv", f"recv from rank {peer}", writes=(buf.region,), peer=peer,
                  group=self._group(), nbytes=buf.nbytes)

    def all_gather(self, send_buf: FakeArray, recv_buf: FakeArray, stream: str) -> None:
        self._add(stream, "allgather", "allgather", reads=(send_buf.region,),
                  writes=(recv_buf.region,), group=self._groups, nbytes=send_buf.nbytes)
        self._groups += 1


class _FakeXP:
    """The array module `Message` allocates from."""

    def __init__(self, ops: "RecordingOps"):
        self._ops = ops

    def empty(self, n: int, dtype: Any = np.uint8) -> FakeArray:
        return self._ops.device.alloc(int(n) * as_dtype(dtype).itemsize, self._ops.take_name("buffer"))


def kept_rows(blocks) -> tuple:
    """The (local query row, local key row) pairs `blocks` (a step's `Block`s) keep, sorted,
    a pair kept by two blocks twice (`burstcu.layout.Block` states the tests)."""
    kept = []
    for blk in blocks:
        for i, j in itertools.product(range(blk.q_len), range(blk.k_len)):
            q, k = blk.q_pos + i, blk.k_pos + j
            if ((not blk.causal or q >= k) and (blk.left < 0 or k >= q - blk.left)
                    and (blk.right < 0 or k <= q + blk.right)):
                kept.append((blk.q_start + i, blk.k_start + j))
    return tuple(sorted(kept))


class RecordingOps(LocalOps):
    """A LocalOps that computes nothing and records which bytes each op reads and writes on the
    compute stream. State and context are FakeArrays of their own buffers."""

    name = "recording"
    array_types = (FakeArray,)

    def __init__(self, device: RecordingDevice):
        self.device = device
        self.xp = _FakeXP(self)
        self._next_name: str | None = None
        self._messages = 0

    def take_name(self, default: str) -> str:
        name, self._next_name = self._next_name or default, None
        return name

    def new(self, name: str, shape, dtype) -> FakeArray:
        dtype = as_dtype(dtype)
        return self.device.alloc(int(np.prod(shape)) * dtype.itemsize, name).view(dtype).reshape(shape)

    def annotate(self, label: str):
        return self.device.annotate(label)

    # -- memory ------------------------------------------------------------------------------
    def message(self, fields):
        self._next_name = f"msg{self._messages}({','.join(f[0] for f in fields)})"
        self._messages += 1
        return Message(self.xp, fields)

    def zeros(self, shape, dtype):
        arr = self.new("zeros", shape, dtype)
        self.device.kernel("zeros", writes=[arr])
        return arr

    def copy_(self, dst, src) -> None:
        if isinstance(src, FakeArray):
            self.device.kernel("copy_", reads=[src], writes=[dst], detail=elements(dst, src))
        else:
            self.device.kernel("copy_", writes=[dst], detail=("fill", src))

    def add_(self, dst, src) -> None:
        self.device.kernel("add_", reads=[dst, src], writes=[dst], detail=elements(dst, src))

    # -- forward -----------------------------------------------------------------------------
    def forward_init(self, q, softmax_scale):
        b, s, h, d = q.shape
        state = self.new("fwd state", (b, h, s, d + 2), accum_dtype(q.dtype))  # acc | max | sum
        self.device.kernel("forward_init", reads=[q], writes=[state])
        return state

    def forward_step(self, state, k, v, blocks, last=False) -> None:
        self.device.kernel("forward_step", reads=[state, k, v], writes=[state], detail=tuple(blocks))

    def forward_finalize(self, state, out_dtype):
        b, h, s, d2 = state.shape
        out = self.new("out", (b, s, h, d2 - 2), out_dtype)
        lse = self.new("lse", (b, h, s), state.dtype)
        self.device.kernel("forward_finalize", reads=[state], writes=[out, lse])
        return out, lse

    # -- backward ----------------------------------------------------------------------------
    def backward_delta(self, dout, out):
        b, s, h, _ = dout.shape
        delta = self.new("delta", (b, h, s), accum_dtype(dout.dtype))
        self.device.kernel("backward_delta", reads=[dout, out], writes=[delta])
        return delta

    def backward_init(self, k, v, softmax_scale):
        ctx = self.new("bwd ctx (k, v, dk, dv)", (4,) + k.shape, accum_dtype(k.dtype))
        self.device.kernel("backward_init", reads=[k, v], writes=[ctx])
        return ctx

    def backward_step(self, ctx, q, dout, lse, delta, dq, blocks, psum=None) -> None:
        sums = [] if psum is None else [psum]
        self.device.kernel("backward_step", reads=[ctx, q, dout, lse, delta, dq, *sums],
                           writes=[ctx, dq, *sums], detail=tuple(blocks))

    def backward_finalize(self, ctx, out_dtype):
        shape = ctx.shape[1:]
        dk, dv = self.new("dk", shape, out_dtype), self.new("dv", shape, out_dtype)
        self.device.kernel("backward_finalize", reads=[ctx], writes=[dk, dv])
        return dk, dv

    # -- decode ------------------------------------------------------------------------------
    def decode_partial(self, q, k_cache, v_cache, lengths, scale, out=None):
        b, t, h, d = q.shape
        acc = accum_dtype(q.dtype)
        if out is None:
            out = (self.new("decode acc", (b, t, h, d), acc), self.new("decode m", (b, h, t), acc),
                   self.new("decode l", (b, h, t), acc))
        self.device.kernel("decode_partial", reads=[q, k_cache, v_cache], writes=list(out))
        return out

    def decode_merge(self, parts, out_dtype):
        acc = parts[0][0]
        b, t, h, d = acc.shape
        out, lse = self.new("out", (b, t, h, d), out_dtype), self.new("lse", (b, h, t), acc.dtype)
        self.device.kernel("decode_merge", reads=[x for part in parts for x in part], writes=[out, lse])
        return out, lse

    def decode_whole(self, q, k_cache, v_cache, lengths, scale, out_dtype):
        b, t, h, d = q.shape
        out = self.new("out", (b, t, h, d), out_dtype)
        lse = self.new("lse", (b, h, t), accum_dtype(q.dtype))
        self.device.kernel("decode_whole", reads=[q, k_cache, v_cache], writes=[out, lse])
        return out, lse

    # -- linear attention: each product a kernel writing a new array --------------------------
    def _product(self, name: str, reads, *shapes, acc):
        outs = [self.new(name, shape, acc) for shape in shapes]
        reads = [x for x in reads if x is not None]
        rows = tuple(int(np.prod(x.shape[2:])) * x.dtype.itemsize for x in reads)   # of (B, C, H, D)
        self.device.kernel(name, reads=reads, writes=outs, detail=rows)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def _state_shape(k, d: int, hkv: int | None = None) -> tuple:
        return (k.shape[0], k.shape[2] if hkv is None else hkv, d, d)

    def linear_kv_state(self, k, v, acc):
        return self._product("linear_kv_state", [k, v], self._state_shape(k, k.shape[-1]), acc=acc)

    def linear_grad_state(self, q, dout, hkv, acc):
        return self._product("linear_grad_state", [q, dout], self._state_shape(q, q.shape[-1], hkv),
                             acc=acc)

    def linear_forward_run(self, q, k, v, prefix, acc):
        return self._product("linear_forward_run", [q, k, v, prefix], q.shape, acc=acc)

    def linear_backward_run(self, dout, q, k, v, prefix, suffix, acc):
        return self._product("linear_backward_run", [dout, q, k, v, prefix, suffix], q.shape,
                             k.shape, v.shape, acc=acc)

    def linear_forward_full(self, q, total, acc):
        return self._product("linear_forward_full", [q, total], q.shape, acc=acc)

    def linear_backward_full(self, dout, k, v, total, grad_total, acc):
        return self._product("linear_backward_full", [dout, k, v, total, grad_total], dout.shape,
                             k.shape, v.shape, acc=acc)


# ----------------------------------------------------------------------------------------------
# recording one engine call

SHAPE = (1, 4, 2, 1, 8)  # B, S (even: zigzag), H, Hkv, D — the schedule does not depend on values


def record(pass_: str, size: int, rank: int, *, causal: bool, layout: str | Partition,
           shape: tuple = SHAPE, dtype: Any = np.float16, strategy: str = "burst",
           options: dict | None = None, window_size: tuple = (-1, -1), cu_seqlens=None,
           row_sums: bool = False, block_mask=None, calls: int = 1) -> Schedule:
    """The schedule `rank` of `size` issues for `calls` consecutive `pass_` ("forward" or
    "backward") calls of `strategy` (a name of burstcu.engine, made with `options`, or of its
    linear strategies) on the same inputs: later calls reuse the buffers the op keeps. Strategies
    that make sub-groups ("usp") need `record_loopback`: a recording NCCL rank has no MPI to
    split over. layout: a name, or a `Partition` (uneven shards: this rank's S is its length, not
    shape's). window_size, cu_seqlens, block_mask: the mask, as the strategies take it; row_sums:
    the backward of attention_backward(check=True)."""
    device = RecordingDevice()
    ops = RecordingOps(device)
    outputs = _record_calls(ops, NCCLTransport(rank, size, device), pass_, causal=causal, layout=layout,
                            shape=shape, dtype=dtype, strategy=strategy, options=options,
                            window_size=window_size, cu_seqlens=cu_seqlens, row_sums=row_sums,
                            block_mask=block_mask, calls=calls)
    return Schedule(rank, size, device.actions, device.buffers, outputs)


def _record_calls(ops: "RecordingOps", transport, pass_: str, *, causal: bool, layout: str | Partition,
                  shape: tuple = SHAPE, dtype: Any = np.float16, strategy: str = "burst",
                  options: dict | None = None, window_size: tuple = (-1, -1), cu_seqlens=None,
                  row_sums: bool = False, block_mask=None, calls: int = 1) -> tuple[Region, ...]:
    """Record, on `ops`' device, the begin sentinel, `calls` calls on `transport` (`record`
    states the arguments) and the end sentinel; the bytes of what the last call returned, then
    of the row sums."""
    linear = strategy in engine.LINEAR_NAMES
    run = engine.get_linear(strategy) if linear else engine.get(strategy, **(options or {}))
    device = ops.device
    if isinstance(layout, Partition):
        shape = shape[:1] + (layout.lengths[transport.rank],) + shape[2:]
    args = _fake_inputs(ops, pass_, shape, dtype)
    kw: dict = dict(causal=causal, layout=layout)
    if linear:
        args = args[:4]                   # (q, k, v), or (dout, q, k, v): no out, lse
    else:
        kw.update(softmax_scale=1.0, window_size=window_size, cu_seqlens=cu_seqlens,
                  block_mask=block_mask)
        if row_sums and pass_ == "backward":
            b, s, h, _, _ = shape
            kw["row_sums"] = ops.new("row_sums", (b, h, s), accum_dtype(dtype))
            ops.copy_(kw["row_sums"], 0)        # zeroed, as attention_backward(check=True) passes it
    device.sentinel("begin")
    returned: Any = ()
    sums = [kw["row_sums"]] if "row_sums" in kw else []
    for call in range(calls):
        if call:   # the caller reads what the call returned (and the row sums), gives new inputs
            device.between(_arrays(returned) + tuple(sums), args + sums)
            for x in sums:
                ops.copy_(x, 0)
        returned = (run.forward if pass_ == "forward" else run.backward)(*args, ops, transport, **kw)
    device.sentinel("end")
    return _regions(returned) + _regions(tuple(sums))


DECODE_SHAPE = (1, 2, 4, 2, 8)   # B, T, H, Hkv, D


def record_decode(size: int, rank: int, *, shape: tuple = DECODE_SHAPE, cache_rows: int = 6,
                  dtype: Any = np.float16, calls: int = 1) -> Schedule:
    """The schedule `rank` of `size` issues for `calls` consecutive `burstcu.engine.decode`
    calls with q (B, T, H, D) of `shape` (B, T, H, Hkv, D) over a cache of `cache_rows` rows a
    rank (all valid); later calls reuse the op's kept partial and all-gather buffers."""
    device = RecordingDevice()
    ops = RecordingOps(device)
    transport = NCCLTransport(rank, size, device)
    b, t, h, hkv, d = shape
    q = ops.new("q", (b, t, h, d), dtype)
    k_cache = ops.new("k_cache", (b, cache_rows, hkv, d), dtype)
    v_cache = ops.new("v_cache", (b, cache_rows, hkv, d), dtype)
    device.sentinel("begin")
    returned: Any = ()
    for call in range(calls):
        if call:
            device.between(_arrays(returned), [q, k_cache, v_cache])
        returned = decode_engine.decode(q, k_cache, v_cache, [cache_rows] * b, 1.0, ops, transport)
    device.sentinel("end")
    return Schedule(rank, size, device.actions, device.buffers, _regions(returned))


def _arrays(returned) -> tuple:
    """The array, or each array of the tuple, an engine call returned."""
    return returned if isinstance(returned, tuple) else (returned,)


def _regions(returned) -> tuple[Region, ...]:
    """The bytes of each array an engine call returned."""
    return tuple(x.region for x in _arrays(returned))


def record_world(pass_: str, size: int, **kw) -> list[Schedule]:
    """Every rank's schedule (simulated one after another)."""
    return [record(pass_, size, r, **kw) for r in range(size)]


# ----------------------------------------------------------------------------------------------
# the loopback world: ranks sharing one device, recorded into one schedule

class _WorldLog:
    """The one action list and buffer table the ranks of a loopback world record into."""

    def __init__(self):
        self.lock = threading.Lock()
        self.actions: list[Action] = []
        self.buffers: dict[int, str] = {}


class RankRecordingDevice(RecordingDevice):
    """The recorder of one rank of a loopback world (`burstcu.transport.loopback`).

    Streams and events are named "r<rank>:<name>" and every rank appends to one shared list, so
    cross-rank orderings (a receiver's copy waiting on the sender's `ready` event, the sender
    waiting on the receiver's `copied`) are edges of one happens-before graph. `copy` records
    the device-to-device copy: it reads the peer's send bytes and writes this rank's receive
    bytes on this rank's communication stream.
    """

    def __init__(self, log: _WorldLog, rank: int):
        super().__init__()
        self.log, self.rank = log, rank
        self.actions, self.buffers = log.actions, log.buffers
        self._mine: list[int] = []

    def _stream(self, name: str) -> str:
        return f"r{self.rank}:{name}"

    def _add(self, stream: str, kind: str, what: str, **kw) -> Action:
        with self.log.lock:
            return super()._add(stream, kind, what, **kw)

    def _new_buffer(self, name: str) -> int:
        with self.log.lock:
            buffer = len(self.buffers)
            self.buffers[buffer] = f"rank {self.rank} {name}"
        self._mine.append(buffer)
        return buffer

    def sentinel(self, kind: str) -> None:
        every = tuple(Region(b, 0, 1 << 62) for b in self._mine)
        self._add(COMPUTE, kind, kind, reads=every if kind == "end" else (), writes=every)
        self._ended = kind == "end"

    def new_event(self) -> str:
        return f"r{self.rank}:{super().new_event()}"

    def copy(self, dst: FakeArray, src: FakeArray, stream: str) -> None:
        self._add(stream, "copy", f"copy {src.nbytes} bytes", reads=(src.region,),
                  writes=(dst.region,), nbytes=src.nbytes)


def record_loopback(pass_: str, size: int, *, causal: bool, layout: str | Partition,
                    transport_class: Any = None, **kw) -> Schedule:
    """The schedule of `pass_` calls of the real engine on every rank of a loopback world of
    `size` ranks, run as threads like the real thing, recorded into one Schedule (rank -1).
    transport_class: a LoopbackTransport subclass to record instead (the tests seed mistakes);
    the other keywords as `record` takes them."""
    log, hub = _WorldLog(), LoopbackHub(size, timeout=30.0)
    errors: list = []

    def rank_main(rank: int) -> None:
        try:
            device = RankRecordingDevice(log, rank)
            transport = (transport_class or LoopbackTransport)(rank, hub, device)
            _record_calls(RecordingOps(device), transport, pass_, causal=causal, layout=layout, **kw)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)
            hub.abort(f"rank {rank}: {exc}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Schedule(-1, size, log.actions, log.buffers)


def _fake_inputs(ops: "RecordingOps", pass_: str, shape: tuple, dtype: Any) -> list:
    """The positional arguments of ring.forward (q, k, v) or ring.backward (dout, q, k, v, out,
    lse) as FakeArrays."""
    if pass_ not in ("forward", "backward"):
        raise ValueError(f"pass_ must be 'forward' or 'backward', not {pass_!r}")
    b, s, h, hkv, d = shape
    q = ops.new("q", (b, s, h, d), dtype)
    k, v = ops.new("k", (b, s, hkv, d), dtype), ops.new("v", (b, s, hkv, d), dtype)
    if pass_ == "forward":
        return [q, k, v]
    return [ops.new("dout", (b, s, h, d), dtype), q, k, v, ops.new("out", (b, s, h, d), dtype),
            ops.new("lse", (b, h, s), accum_dtype(dtype))]


def prove_loopback(pass_: str, size: int, *, causal: bool, layout: str, **kw) -> Schedule:
    """Record a loopback world and raise ScheduleError explaining each race found."""
    schedule = record_loopback(pass_, size, causal=causal, layout=layout, **kw)
    problems = check(schedule)
    if problems:
        raise ScheduleError(report(problems))
    return schedule


# ----------------------------------------------------------------------------------------------
# happens-before

@dataclass
class Violation:
    """A pair of conflicting actions the schedule leaves unordered (or a structural error)."""

    rank: int
    message: str
    first: Action | None = None
    second: Action | None = None

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


def _predecessors(actions: Sequence[Action]) -> tuple[list[list[int]], list[Violation]]:
    """Direct happens-before edges into each action (all from earlier-issued actions)."""
    preds: list[list[int]] = [[] for _ in actions]
    frontier: dict[str, list[int]] = {}      # last action(s) of each stream
    open_group: dict[str, tuple[int, list[int]]] = {}  # stream -> (group, the frontier before it)
    last_record: dict[str, int] = {}
    problems: list[Violation] = []
    for a in actions:
        if a.group is not None and a.kind != "allgather":
            group, before = open_group.get(a.stream, (None, None))
            if group != a.group:  # the first member of a new group
                before = frontier.get(a.stream, [])
                open_group[a.stream] = (a.group, before)
                frontier[a.stream] = []
            preds[a.index] += before
            frontier[a.stream].append(a.index)
        else:
            open_group.pop(a.stream, None)
            preds[a.index] += frontier.get(a.stream, [])
            frontier[a.stream] = [a.index]
        if a.kind == "record":
            last_record[a.event] = a.index
        elif a.kind == "wait":
            if a.event in last_record:
                preds[a.index].append(last_record[a.event])
            else:
                problems.append(Violation(-1, f"{a.describe()} waits on {a.event}, which was never "
                                              "recorded before it: the wait orders nothing", a))
    return preds, problems


def happens_before(actions: Sequence[Action]) -> tuple[list[int], list[Violation]]:
    """For each action, a bitset (int) of the actions that happen before it."""
    preds, problems = _predecessors(actions)
    ancestors = [0] * len(actions)
    for a in actions:  # host order is a topological order: every edge points forward
        bits = 0
        for p in preds[a.index]:
            bits |= ancestors[p] | (1 << p)
        ancestors[a.index] = bits
    return ancestors, problems


def _accesses(actions: Sequence[Action]) -> dict[int, list[tuple[Action, Region, bool]]]:
    by_buffer: dict[int, list[tuple[Action, Region, bool]]] = {}
    for a in actions:
        for region in a.reads:
            by_buffer.setdefault(region.buffer, []).append((a, region, False))
        for region in a.writes:
            by_buffer.setdefault(region.buffer, []).append((a, region, True))
    return by_buffer


_HAZARD = {(True, False): "read-after-write", (False, True): "write-after-read",
           (True, True): "write-after-write"}


def _explain(schedule: Schedule, first: Action, r1: Region, w1: bool, second: Action, r2: Region,
             w2: bool) -> str:
    lo, hi = max(r1.lo, r2.lo), min(r1.hi, r2.hi)
    span = "every byte" if hi - lo > (1 << 61) else f"bytes [{lo}, {hi})"
    verb1, verb2 = ("writes" if w1 else "reads"), ("writes" if w2 else "reads")
    freed = ("; a free hands the bytes back to the memory pool, which may give them to the next "
             "allocation on its stream" if "free" in (first.kind, second.kind) else "")
    return (f"{_HAZARD[(w1, w2)]} race on buffer '{schedule.buffers[r1.buffer]}' {span}: "
            f"{first.describe()} {verb1} it, then {second.describe()} {verb2} it, but no chain of "
            f"stream order and event record -> wait makes the first finish before the second "
            f"starts{freed}")


def check(schedule: Schedule) -> list[Violation]:
    """Every race and missing record in one rank's schedule (empty when it is race-free)."""
    actions = schedule.actions
    ancestors, problems = happens_before(actions)
    out = [replace(p, rank=schedule.rank) for p in problems]
    for accesses in _accesses(actions).values():
        for i, (a, ra, wa) in enumerate(accesses):
            for b, rb, wb in accesses[i + 1:]:
                if a.index == b.index or not (wa or wb) or not ra.overlaps(rb):
                    continue
                first, second = (a, b) if a.index < b.index else (b, a)
                f = (ra, wa) if first is a else (rb, wb)
                s = (rb, wb) if first is a else (ra, wa)
                if not ancestors[second.index] >> first.index & 1:
                    out.append(Violation(schedule.rank, _explain(schedule, first, f[0], f[1],
                                                                 second, s[0], s[1]), first, second))
    return out


# ----------------------------------------------------------------------------------------------
# across ranks

def check_world(schedules: Sequence[Schedule]) -> list[Violation]:
    """Cross-rank pairing, as NCCL matches point-to-point messages: for each (source, destination)
    pair of ranks, the i-th send from source to destination meets the i-th receive from source
    at destination, and the two have the same byte count (a missing one is a hang, another
    count a truncated message or a hang on real hardware; only counts are compared, not which
    bytes). All-gathers, being collectives, must be the same number on every rank, the k-th of
    the same size everywhere. And the NCCL groups (an ungrouped call is a group of one) are
    proved free of deadlock: no cycle of ranks each waiting in an earlier group for another's
    later one (a pair or any longer ring of ranks, all-gathers included)."""
    gathers = [[a for a in s.actions if a.kind == "allgather"] for s in schedules]
    sends, recvs = _point_to_point(schedules)
    return (_unmatched_gathers(gathers) + _unmatched_messages(sends, recvs)
            + _deadlocks(schedules, sends, recvs, gathers))


def _point_to_point(schedules: Sequence[Schedule]) -> tuple[dict, dict]:
    """(sends, recvs): for each (source rank, destination rank), the sends the source issues to
    the destination and the receives the destination posts from the source, in issue order."""
    sends: dict[tuple[int, int], list[Action]] = {}
    recvs: dict[tuple[int, int], list[Action]] = {}
    for r, s in enumerate(schedules):
        for a in s.actions:
            if a.kind == "send":
                sends.setdefault((r, a.peer), []).append(a)
            elif a.kind == "recv":
                recvs.setdefault((a.peer, r), []).append(a)
    return sends, recvs


def _unmatched_gathers(gathers: list[list[Action]]) -> list[Violation]:
    """All-gathers that differ between ranks in number or, the k-th of each, in size."""
    out: list[Violation] = []
    if len({len(g) for g in gathers}) > 1:
        per_rank = ", ".join(f"rank {r}: {len(g)}" for r, g in enumerate(gathers))
        out.append(Violation(-1, f"ranks issue different numbers of allgathers ({per_rank}): some "
                                 "rank would wait forever for a peer"))
    for k in range(min((len(g) for g in gathers), default=0)):
        sizes = {g[k].nbytes for g in gathers}
        if len(sizes) > 1:
            out.append(Violation(-1, f"allgather #{k} does not match on every rank: sizes "
                                     f"{sorted(sizes)}", gathers[0][k]))
    return out


def _unmatched_messages(sends: dict, recvs: dict) -> list[Violation]:
    """Between each pair of ranks, the i-th send without an i-th receive, or the other way
    round, or the two of different sizes."""
    out: list[Violation] = []
    for src, dst in sorted(set(sends) | set(recvs)):
        ss, rr = sends.get((src, dst), []), recvs.get((src, dst), [])
        for i in range(max(len(ss), len(rr))):
            a = ss[i] if i < len(ss) else None
            b = rr[i] if i < len(rr) else None
            if a is None:
                out.append(Violation(dst, f"{b.describe()} ({b.nbytes} bytes) in NCCL group {b.group} "
                                          f"has no matching send from rank {src} (its message #{i} to "
                                          f"rank {dst}; rank {src} sends {len(ss)}): the exchange would "
                                          f"hang", b))
            elif b is None:
                out.append(Violation(src, f"{a.describe()} ({a.nbytes} bytes) in NCCL group {a.group} "
                                          f"has no matching recv at rank {dst} (message #{i}; rank {dst} "
                                          f"receives {len(rr)}): the exchange would hang", a))
            elif a.nbytes != b.nbytes:
                out.append(Violation(src, f"{a.describe()} sends {a.nbytes} bytes in NCCL group "
                                          f"{a.group}; rank {dst} receives {b.nbytes} in its group "
                                          f"{b.group}: the exchange would truncate or hang", a))
    return out


class _Meetings:
    """Union-find over (rank, NCCL group ordinal): the groups of different ranks that must run
    together (a matched send/recv pair, or the k-th all-gather of every rank) become one."""

    def __init__(self):
        self.parent: dict[tuple[int, int], tuple[int, int]] = {}

    def find(self, x: tuple[int, int]) -> tuple[int, int]:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def join(self, a: tuple[int, int], b: tuple[int, int]) -> None:
        self.parent[self.find(a)] = self.find(b)


def _deadlocks(schedules: Sequence[Schedule], sends: dict, recvs: dict,
               gathers: list[list[Action]]) -> list[Violation]:
    """Every rank's NCCL groups run in issue order, each one blocking until its peers' matching
    calls run (an ungrouped send or recv is a group of one: a blocking call); a matched
    send/recv pair, and the k-th all-gather of every rank, must run in the same "meeting" of
    groups. Merge the groups that meet; a cycle through the ranks' orders is then a set of ranks
    each waiting in an earlier group for another's later one."""
    meetings = _Meetings()
    for (src, dst), ss in sends.items():
        for a, b in zip(ss, recvs.get((src, dst), [])):
            meetings.join((src, a.group), (dst, b.group))
    for k in range(min((len(g) for g in gathers), default=0)):
        for r, g in enumerate(gathers[1:], start=1):
            meetings.join((r, g[k].group), (0, gathers[0][k].group))
    edges: dict[tuple[int, int], set] = {}
    for r, s in enumerate(schedules):
        order = sorted({a.group for a in s.actions if a.group is not None})
        for g1, g2 in zip(order, order[1:]):
            edges.setdefault(meetings.find((r, g1)), set()).add(meetings.find((r, g2)))
    path = _cycle(edges)
    if not path:
        return []
    ranks = sorted({r for r, g in list(meetings.parent) if meetings.find((r, g)) in path})
    return [Violation(-1, f"NCCL groups wait for each other in a cycle (ranks {ranks}): each holds "
                          f"a message another rank only posts in a later group — a deadlock")]


def _cycle(edges: dict) -> set:
    """The nodes on the depth-first path that closes the first cycle found in `edges` (node ->
    set of successors), or an empty set when there is none."""
    state: dict = {}   # 1: on the current path, 2: done

    def cycle_from(node) -> bool:
        state[node] = 1
        for nxt in edges.get(node, ()):
            if state.get(nxt) == 1 or (nxt not in state and cycle_from(nxt)):
                return True
        state[node] = 2
        return False

    for node in list(edges):
        if node not in state and cycle_from(node):
            return {n for n, mark in state.items() if mark == 1}
    return set()


# ----------------------------------------------------------------------------------------------
# following the bytes: which K/V block each forward step reads; what each backward sum holds

COPIES = ("copy_", "setitem", "astype")    # the kernels that copy (`_Bytes.copy`)
ZERO = ("acc", None, ())     # the label of zeroed bytes (an accumulator: no terms, nothing yet)


def _kernel_name(action: Action) -> str:
    """The op a compute-stream kernel action ran ("copy_", "forward_step", ...)."""
    return action.label.split(" / ")[-1].split(", after ")[0]


class _Bytes:
    """What each byte of one rank's buffers holds, as labels: (name, owner, offset) for byte
    `offset` of rank owner's input `name` (k and v; subclasses add others) wherever it was
    copied or sent, None otherwise."""

    INPUTS: tuple = ("k", "v")

    def __init__(self, schedule: Schedule):
        self.rank, self.held = schedule.rank, {}
        self.names = schedule.buffers

    def write(self, region: Region, labels: list | None = None) -> None:
        """Label the bytes `region` holds (None: nothing known), in order."""
        if region.hi - region.lo > (1 << 40):   # a sentinel: the caller may write anything
            return
        if region.runs is not None:             # a strided view: exactly its bytes
            assert labels is None or len(labels) == _held(region), (region, len(labels))
            at = 0
            for lo, n in region.runs:
                self.write(Region(region.buffer, lo, lo + n), None if labels is None else labels[at:at + n])
                at += n
            return
        assert labels is None or len(labels) == region.hi - region.lo, (region, len(labels))
        held = self.held.setdefault(region.buffer, [])
        if len(held) < region.hi:
            held.extend([None] * (region.hi - len(held)))
        held[region.lo:region.hi] = labels if labels is not None else [None] * (region.hi - region.lo)

    def read(self, region: Region) -> list:
        """The labels of the bytes `region` holds, in order."""
        if region.runs is not None:
            return [x for lo, n in region.runs for x in self.read(Region(region.buffer, lo, lo + n))]
        held = self.held.get(region.buffer, [])
        return (held[region.lo:region.hi] + [None] * region.hi)[:region.hi - region.lo]

    def fill(self, region: Region, label) -> None:
        self.write(region, [label] * _held(region))

    def label_of(self, region: Region):
        """The one label every byte of `region` holds, or None."""
        labels = set(self.read(region))
        return labels.pop() if len(labels) == 1 else None

    def shown(self, region: Region) -> list:
        """Up to four of the labels `region` holds, for a message."""
        return sorted(set(self.read(region)), key=str)[:4]

    def in_order(self, action: Action, region: Region, name: str, what: str) -> tuple[int, int, int]:
        """(rank, first byte, bytes) of the run of rank's input `name` that `region` holds, its
        bytes in order, or ScheduleError saying it is not `what`."""
        labels = self.read(region)
        first = labels[0] if labels else None
        if first is None or first[0] != name or labels != [(name, first[1], first[2] + o)
                                                            for o in range(len(labels))]:
            shown = sorted({x if x is None else x[:2] for x in labels}, key=str)[:4]
            raise ScheduleError(f"rank {self.rank}: {action.describe()} reads '{self.names[region.buffer]}' "
                                f"holding {shown}, not {what}")
        return first[1], first[2], len(labels)

    def whole(self, action: Action, region: Region, name: str) -> int:
        """The rank whose input `name` `region` holds, whole and in order (its byte o at o), or
        ScheduleError."""
        what = f"one rank's {name} whole and in order"
        rank, start, _ = self.in_order(action, region, name, what)
        if start:
            raise ScheduleError(f"rank {self.rank}: {action.describe()} reads rank {rank}'s {name} "
                                f"from byte {start}, not {what}")
        return rank

    def operands(self, action: Action, src: Region | None) -> tuple[list, list | None]:
        """The labels of a copy's or sum's destination and source (`elements`), byte for byte;
        for a cast (the same elements, other sizes), each element of both the one label its
        bytes hold (or None) repeated over dst's element size; a scalar, or another count of
        elements (a broadcast), gives (dst's, None). src: the source's bytes, None for a scalar."""
        dst, (_, n, n_src) = self.read(action.writes[0]), action.detail
        if src is None or n != n_src:
            return dst, None
        src = self.read(src)
        if len(src) != len(dst):
            width = len(dst) // n
            dst, src = _per_element(dst, n, width), _per_element(src, n, width)
        return dst, src

    def copy(self, action: Action) -> None:
        """A copy (copy_, setitem, astype): dst = src, byte for byte, through the bytes each
        view holds; a cast element by element (`operands`); a broadcast, or a fill, leaves
        nothing known."""
        self.write(action.writes[0], None if action.detail[0] == "fill" else
                   self.operands(action, action.reads[0])[1])

    def accumulate(self, action: Action, combine) -> bool:
        """Apply `action` if it is zeroing (ZERO), a fill, a copy, or add_ (each byte's labels
        joined by `combine`: the accumulating replays'); False, doing nothing, for any other."""
        name = _kernel_name(action) if action.kind == "kernel" else action.kind
        if name == "zeros" or (name in COPIES and action.detail == ("fill", 0)):
            self.fill(action.writes[0], ZERO)
        elif name in COPIES:                     # a fill of another value: nothing known
            self.copy(action)
        elif name == "add_":                     # b None: a constant or a broadcast
            a, b = self.operands(action, action.reads[1] if len(action.reads) == 2 else None)
            self.write(action.writes[0], None if b is None else [combine(x, y) for x, y in zip(a, b)])
        else:
            return False
        return True

    def apply(self, action: Action) -> None:
        """An action of the compute stream (or an alloc) on this rank, in issue order."""
        if action.kind == "alloc":
            region = action.writes[0]
            name = self.names[region.buffer]
            self.write(region, [(name, self.rank, o) for o in range(region.hi)] if name in self.INPUTS
                       else None)
        elif action.kind == "kernel" and _kernel_name(action) in COPIES:
            self.copy(action)
        elif action.kind != "between":   # between calls the caller writes inputs of one meaning
            for region in action.writes:
                self.write(region)


def _held(region: Region) -> int:
    """How many bytes `region` holds."""
    return region.hi - region.lo if region.runs is None else sum(n for _, n in region.runs)


def _per_element(labels: list, n: int, width: int) -> list:
    """The labels of n equal elements, each the one label its bytes hold (None if they differ),
    repeated `width` times."""
    size = len(labels) // n
    return [label for e in range(n) for label in
            [labels[e * size] if len(set(labels[e * size:(e + 1) * size])) == 1 else None] * width]


def _replay(schedules: Sequence[Schedule], held: Sequence[_Bytes], on_compute) -> None:
    """Replay every rank's schedule together (schedules[r] is rank r's), delivering messages'
    labels: the i-th send from one rank to another delivers its bytes' labels to the i-th
    receive there (an NCCL group's sends taken before its receives), and the k-th all-gather of
    every rank delivers every rank's labels, in rank order. Every other action (compute, alloc,
    free) goes to on_compute(rank, action), in issue order. ScheduleError when the replay
    cannot go on (a receive whose send never comes) or a message does not fit its receive."""
    assert [s.rank for s in schedules] == list(range(len(schedules))), [s.rank for s in schedules]
    at = [0] * len(schedules)
    sent: dict[tuple[int, int], list] = {}
    taken: dict[tuple[int, int], int] = {}
    sent_groups: set = set()
    gathers: list[dict[int, list]] = []       # the k-th all-gather: rank -> the labels it sends
    gathered = [0] * len(schedules)           # all-gathers each rank has completed
    while any(at[r] < len(s.actions) for r, s in enumerate(schedules)):
        moved = False
        for r, s in enumerate(schedules):
            while at[r] < len(s.actions):
                a = s.actions[at[r]]
                if a.group is not None and a.kind != "allgather" and (r, a.group) not in sent_groups:
                    sent_groups.add((r, a.group))
                    for b in s.actions[at[r]:]:
                        if b.group == a.group and b.kind == "send":
                            sent.setdefault((r, b.peer), []).append(held[r].read(b.reads[0]))
                if a.kind == "recv":
                    key = (a.peer, r)
                    i = taken.get(key, 0)
                    if i >= len(sent.get(key, [])):
                        break
                    taken[key] = i + 1
                    _deliver(held[r], a, sent[key][i])
                elif a.kind == "allgather":
                    k = gathered[r]
                    if k == len(gathers):
                        gathers.append({})
                    gathers[k].setdefault(r, held[r].read(a.reads[0]))
                    if len(gathers[k]) < len(schedules):
                        break
                    _deliver(held[r], a, [x for j in range(len(schedules)) for x in gathers[k][j]])
                    gathered[r] += 1
                elif a.kind not in ("send", "record", "wait"):
                    on_compute(r, a)
                at[r] += 1
                moved = True
        if not moved:
            stuck = [f"rank {r}: {s.actions[at[r]].describe()}" for r, s in enumerate(schedules)
                     if at[r] < len(s.actions)]
            raise ScheduleError("the replay is stuck, receives without sends: " + "; ".join(stuck))


def _deliver(held: _Bytes, action: Action, labels: list) -> None:
    """A receive (or all-gather) `action` writes the message bytes labelled `labels`."""
    region = action.writes[0]
    if len(labels) != _held(region):
        raise ScheduleError(f"rank {held.rank}: {action.describe()} writes {_held(region)} "
                            f"bytes of a {len(labels)}-byte message")
    held.write(region, labels)


def forward_blocks_read(schedules: Sequence[Schedule]) -> list[list[tuple[int, tuple]]]:
    """For each rank, for each of its forward_step kernels in issue order, the owner of the K/V
    block it reads and the (query row, key row) pairs its blocks keep (`kept_rows`), found by
    following the bytes: each rank's k and v inputs are labelled byte by byte, copies carry
    labels, and messages deliver them (`_replay`, the ranks replayed together). ScheduleError
    when a step reads anything but one block's K and V, whole and in order, or when the replay
    cannot go on (a receive whose send never comes)."""
    held = [_Bytes(s) for s in schedules]
    reads: list[list[tuple[int, tuple]]] = [[] for _ in schedules]

    def on_compute(r: int, a: Action) -> None:
        if a.kind == "kernel" and _kernel_name(a) == "forward_step":
            reads[r].append(_block_read(held[r], a))
        held[r].apply(a)

    _replay(schedules, held, on_compute)
    return reads


def _block_read(held: _Bytes, action: Action) -> tuple[int, tuple]:
    """(the owner of the K/V block a forward_step (reads: state, k, v) reads, the pairs kept)."""
    owners = {held.whole(action, region, name) for region, name in zip(action.reads[1:3], "kv")}
    if len(owners) != 1:
        raise ScheduleError(f"rank {held.rank}: {action.describe()} reads K of one rank and V of "
                            f"another ({sorted(owners)}), not one block's K and V")
    return owners.pop(), kept_rows(action.detail)




@lru_cache(maxsize=1 << 16)
def _sum(a, b):
    """The label of the elementwise sum of two bytes labelled a and b: for two accumulators of
    one kind (or one of them zeroed), the union of their terms, repeats kept; else None."""
    if a is None or b is None or a[0] != "acc" or b[0] != "acc":
        return None
    if a[1] is not None and b[1] is not None and a[1] != b[1]:
        return None
    return ("acc", a[1] or b[1], tuple(sorted(a[2] + b[2])))


class _Sums(_Bytes):
    """What each byte of one rank's buffers holds in a backward, as labels: (name, i, offset)
    for byte `offset` of rank i's input `name` (q, dout, out, lse, k, v) and of the delta made
    of its dout and out; ("ctx", j, terms) for a backward context of rank j's keys;
    ("acc", kind, terms) for an accumulator of `kind` (dq, dk, dv, row_sums; None: zeroed and
    added to by nothing yet): the sum of the gradient terms `terms`, a sorted tuple of (query
    rank, key rank, the (query row, key row) pairs kept, `kept_rows`), repeats kept. None:
    anything else. Labels travel by copies, messages and add_ (which sums accumulators of one
    kind); backward_step checks it reads one rank's q, dout, lse and delta, each whole and in
    order where it should, and adds its term to the context and to the dq (and row sums) it
    writes."""

    INPUTS = ("q", "dout", "out", "lse", "k", "v")

    def apply(self, action: Action) -> None:
        if self.accumulate(action, _sum):
            return
        name = _kernel_name(action) if action.kind == "kernel" else action.kind
        reads, writes = action.reads, action.writes
        if name == "alloc":
            super().apply(action)
        elif name == "add" and len(reads) == 2:   # out = a + b, all three of one dtype
            a, b = (self.read(region) for region in reads)
            same = action.detail[1] == action.detail[2] and len(a) == len(b) == _held(writes[0])
            self.write(writes[0], [_sum(x, y) for x, y in zip(a, b)] if same else None)
        elif name == "backward_delta":
            i = self.owner(action, zip(reads, ("dout", "out")))
            self.write(writes[0], [("delta", i, o) for o in range(_held(writes[0]))])
        elif name == "backward_init":
            self.fill(writes[0], ("ctx", self.owner(action, zip(reads, ("k", "v"))), ()))
        elif name == "backward_step":
            ctx, q, dout, lse, delta, dq, *sums = reads
            i = self.owner(action, zip((q, dout, lse, delta), ("q", "dout", "lse", "delta")))
            _, j, terms = self.one(action, ctx, "ctx")
            term = (i, j, kept_rows(action.detail))
            self.fill(ctx, ("ctx", j, tuple(sorted(terms + (term,)))))
            for region, kind in zip((dq, *sums), ("dq", "row_sums")):
                self.fill(region, _sum(self.one(action, region, "acc"), ("acc", kind, (term,))))
        elif name == "backward_finalize":
            terms = self.one(action, reads[0], "ctx")[2]
            for region, kind in zip(writes, ("dk", "dv")):
                self.fill(region, ("acc", kind, terms))
        elif name != "between":
            for region in writes:
                self.write(region)

    def one(self, action: Action, region: Region, kind: str):
        """The one label of kind `kind` every byte of `region` holds, or ScheduleError."""
        label = self.label_of(region)
        if label is None or label[0] != kind:
            raise ScheduleError(f"rank {self.rank}: {action.describe()} reads "
                                f"'{self.names[region.buffer]}' holding {self.shown(region)}, "
                                f"not one {kind!r}")
        return label

    def returned(self, region: Region, name: str, what: str) -> tuple:
        """The terms `region`, returned as `what`, sums: one accumulator of kind `name` (or
        zeroed), or ScheduleError."""
        label = self.label_of(region)
        if label is None or label[0] != "acc" or label[1] not in (name, None):
            raise ScheduleError(f"rank {self.rank}: {what} it returns holds {self.shown(region)}, "
                                f"not one sum of {name} terms")
        return label[2]

    def owner(self, action: Action, regions) -> int:
        """The one rank whose inputs the (region, name) pairs `regions` hold, each its own,
        whole and in order."""
        owners = {self.whole(action, region, name) for region, name in regions}
        if len(owners) != 1:
            raise ScheduleError(f"rank {self.rank}: {action.describe()} reads the inputs of ranks "
                                f"{sorted(owners)} together")
        return owners.pop()


def backward_sums(schedules: Sequence[Schedule]) -> list[tuple[tuple, ...]]:
    """For each rank, what each array its backward returned (dq, dk, dv, and the row sums it
    was given, if any) sums: a sorted tuple of gradient terms (query rank, key rank, the
    (query row, key row) pairs its blocks kept), one for each time the term was added in, found
    by following the bytes through copies, add_, messages and the backward kernels (`_Sums`,
    the ranks replayed together, `_replay`). ScheduleError when a kernel reads the inputs of two
    ranks together, or any but the input, context or accumulator it needs where it needs it,
    or a returned array holds anything but one sum of its own kind."""
    held = [_Sums(s) for s in schedules]
    _replay(schedules, held, lambda r, a: held[r].apply(a))
    for r, s in enumerate(schedules):
        assert len(s.outputs) in (3, 4), f"rank {r}: not a backward's outputs: {s.outputs}"
    return [tuple(held[r].returned(region, name, f"the {name}")
                  for name, region in zip(("dq", "dk", "dv", "row_sums"), s.outputs))
            for r, s in enumerate(schedules)]


class _LinearSums(_Sums):
    """What each byte holds in linear attention, labelled as `_Sums` does, the inputs being q,
    k, v and dout. A chunk's state M (linear_kv_state) or dM (linear_grad_state) is an
    accumulator of kind "M" or "dM" holding the term ("M", chunk) or ("dM", chunk), chunk =
    (rank, first local row, rows) of the rows it read; states sum as accumulators do. A run
    product (linear_*_run) writes ("acc", kind, (("intra", chunk),)) into each output (out;
    dq, dk, dv); a full product (linear_*_full) the terms of the states it reads (dq: M; out:
    M; dk and dv: dM) and ("rows", chunk) of its rows. Each product checks that its row
    arguments are the same rows of one rank's inputs, each in order."""

    INPUTS = ("q", "k", "v", "dout")

    def apply(self, action: Action) -> None:
        name = _kernel_name(action) if action.kind == "kernel" else action.kind
        reads, writes = action.reads, action.writes
        if name == "linear_kv_state":
            self.fill(writes[0], ("acc", "M", (("M", self.chunk(action, zip(reads, "kv"))),)))
        elif name == "linear_grad_state":
            self.fill(writes[0], ("acc", "dM", (("dM", self.chunk(action, zip(reads, ("q", "dout")))),)))
        elif name in ("linear_forward_run", "linear_backward_run"):
            names, kinds = ((("q", "k", "v"), ("out",)) if name == "linear_forward_run" else
                            (("dout", "q", "k", "v"), ("dq", "dk", "dv")))
            assert len(reads) == len(names), f"{action.describe()}: a run after a prefix or before a suffix"
            chunk = self.chunk(action, zip(reads, names))
            for region, kind in zip(writes, kinds):
                self.fill(region, ("acc", kind, (("intra", chunk),)))
        elif name == "linear_forward_full":
            chunk = self.chunk(action, [(reads[0], "q")])
            self.fill(writes[0], self.product(action, reads[1], "M", "out", chunk))
        elif name == "linear_backward_full":
            dout, k, v, total, grad_total = reads
            chunk = self.chunk(action, zip((dout, k, v), ("dout", "k", "v")))
            for region, (state, kind, what) in zip(writes, ((total, "M", "dq"), (grad_total, "dM", "dk"),
                                                            (grad_total, "dM", "dv"))):
                self.fill(region, self.product(action, state, kind, what, chunk))
        else:
            super().apply(action)

    def chunk(self, action: Action, regions) -> tuple[int, int, int]:
        """(rank, first local row, rows) that every (region, name) of `regions` holds of that
        rank's input `name`, in order (action.detail: the bytes of a row of each)."""
        chunks = set()
        for (region, name), row in zip(regions, action.detail):
            rank, start, nbytes = self.in_order(action, region, name, f"rows of one rank's {name} in order")
            if start % row or nbytes % row:
                raise ScheduleError(f"rank {self.rank}: {action.describe()} reads {nbytes} bytes "
                                    f"of '{self.names[region.buffer]}' from byte {start}: not whole "
                                    f"rows of {row}")
            chunks.add((rank, start // row, nbytes // row))
        if len(chunks) != 1:
            raise ScheduleError(f"rank {self.rank}: {action.describe()} reads rows {sorted(chunks)} together")
        return chunks.pop()

    def product(self, action: Action, state: Region, kind: str, what: str, chunk: tuple) -> tuple:
        """The label of a full product of `chunk`'s rows with `state` (an accumulator of `kind`),
        written into an output of kind `what`."""
        label = self.one(action, state, "acc")
        if label[1] not in (kind, None):
            raise ScheduleError(f"rank {self.rank}: {action.describe()} reads a sum of {label[1]} "
                                f"where a sum of {kind} belongs")
        return ("acc", what, tuple(sorted(label[2] + (("rows", chunk),))))


def linear_sums(schedules: Sequence[Schedule], seqlens: Sequence[int]) -> list[tuple[list, ...]]:
    """For each rank, for each array its linear-attention forward (out) or backward (dq, dk,
    dv) returned, for each of its seqlens[rank] local rows (B = 1: the rows are contiguous),
    the terms (`_LinearSums`) that row sums, sorted: which chunks' states reached it, and
    through which rows' products, found by following the bytes (`_replay`). ScheduleError when
    a product reads rows out of place, a state of the wrong kind, or a returned row holds
    anything but one sum of its array's kind."""
    held = [_LinearSums(s) for s in schedules]
    _replay(schedules, held, lambda r, a: held[r].apply(a))
    out = []
    for r, s in enumerate(schedules):
        names = {1: ("out",), 3: ("dq", "dk", "dv")}[len(s.outputs)]
        arrays = []
        for name, region in zip(names, s.outputs):
            row, rest = divmod(region.hi - region.lo, seqlens[r])
            assert rest == 0, f"rank {r}: {region} is not {seqlens[r]} rows"
            arrays.append([held[r].returned(Region(region.buffer, region.lo + i * row,
                                                   region.lo + (i + 1) * row), name, f"row {i} of the {name}")
                           for i in range(seqlens[r])])
        out.append(tuple(arrays))
    return out


class _Partials(_Bytes):
    """What each byte holds in decode: ("partial", field, r, n) for the field (acc, m or l) of
    the partial rank r's n-th decode_partial wrote, wherever it was copied or gathered; None
    otherwise. Each decode_merge's parts are noted, as the labels of the three arrays it read
    as each part's (acc, m, l), in the order read."""

    def __init__(self, schedule: Schedule):
        super().__init__(schedule)
        self.partials, self.merged = 0, []

    def apply(self, action: Action) -> None:
        name = _kernel_name(action) if action.kind == "kernel" else action.kind
        if name == "decode_partial":
            for region, part in zip(action.writes, ("acc", "m", "l")):
                self.fill(region, ("partial", part, self.rank, self.partials))
            self.partials += 1
        elif name == "decode_merge":
            reads = action.reads
            self.merged.append([tuple(map(self.label_of, reads[i:i + 3])) for i in range(0, len(reads), 3)])
        if name != "decode_partial":
            super().apply(action)


def decode_parts_merged(schedules: Sequence[Schedule]) -> list[list[list[tuple]]]:
    """For each rank, for each decode_merge it ran, the parts it merged in the order it read
    them: each part the labels of what it read as (acc, m, l), ("partial", field, r, n) for
    that field of what rank r's n-th decode_partial wrote, None for bytes of anything else or of
    several (`_replay`)."""
    held = [_Partials(s) for s in schedules]
    _replay(schedules, held, lambda r, a: held[r].apply(a))
    return [h.merged for h in held]


def _plus(a, b):
    """The label of the elementwise sum of bytes labelled a and b: ZERO adds nothing; two
    others make ("+", every term), terms sorted; None if either is unknown."""
    if a == ZERO or b == ZERO:
        return b if a == ZERO else a
    if a is None or b is None:
        return None
    terms = [t for x in (a, b) for t in (x[1:] if x[0] == "+" else (x,))]
    return ("+",) + tuple(sorted(terms, key=str))


class _Made(_Bytes):
    """Where each byte came from, for following a result home: (name, r, byte) for that byte
    of rank r's input `name`; ("made", what, r, e) for element e of the array `what` (MADE) a
    kernel of rank r wrote, on every byte of the element (so casts carry it); ZERO for zeroed
    bytes; ("+", terms...) for a sum; None for anything else. Copies carry labels through the
    bytes each view holds (strided too), add_ sums them, messages deliver them."""

    INPUTS = ("q", "k", "v", "dout", "out", "lse")
    MADE = {"forward_finalize": ("out", "lse"), "backward_delta": ("delta",),
            "backward_step": (None, "dq", "row_sums"), "backward_finalize": ("dk", "dv")}

    def apply(self, action: Action) -> None:
        if self.accumulate(action, _plus):
            return
        name = _kernel_name(action) if action.kind == "kernel" else action.kind
        if name in self.MADE:
            for region, size, what in zip(action.writes, action.sizes, self.MADE[name]):
                made = [("made", what, self.rank, e) for e in range(_held(region) // size)
                        for _ in range(size)] if what else None
                if made and name == "backward_step":       # it adds into dq and the row sums
                    made = [_plus(x, y) for x, y in zip(self.read(region), made)]
                self.write(region, made)
        else:
            super().apply(action)


PROVENANCE_KERNELS = ("forward_init", "forward_step", "backward_delta", "backward_init", "backward_step")


def provenance(schedules: Sequence[Schedule], kernels: Sequence[str] = PROVENANCE_KERNELS
               ) -> list[tuple[list[tuple[str, tuple[list, ...]]], tuple[list, ...]]]:
    """For each rank: (for each kernel named in `kernels`, in issue order, (its name, the
    labels of each region it read, byte by byte)), and the labels of each array the last call
    returned, byte by byte (`_Made` says what a label is), found by replaying every rank
    together (`_replay`). Unlike the other replays it checks nothing itself: a test compares
    the labels with the bytes a strategy should move where (Ulysses' all-to-alls, whose head
    slices are strided)."""
    held = [_Made(s) for s in schedules]
    reads: list[list] = [[] for _ in schedules]

    def on_compute(r: int, a: Action) -> None:
        if a.kind == "kernel" and _kernel_name(a) in kernels:
            reads[r].append((_kernel_name(a), tuple(held[r].read(region) for region in a.reads)))
        held[r].apply(a)

    _replay(schedules, held, on_compute)
    return [(reads[r], tuple(held[r].read(region) for region in s.outputs)) for r, s in enumerate(schedules)]


# ----------------------------------------------------------------------------------------------
# proving, and the seeded mistakes the tests use to show the checker catches them

class ScheduleError(AssertionError):
    """The schedule has races; the message lists them, one per line."""


def prove(pass_: str, size: int, *, causal: bool, layout: str | Partition, **kw) -> list[Schedule]:
    """Record every rank and raise ScheduleError explaining each race or mismatch found."""
    return proved(record_world(pass_, size, causal=causal, layout=layout, **kw))


def proved(schedules: list[Schedule]) -> list[Schedule]:
    """`schedules` (every rank's), or ScheduleError explaining each race or mismatch found."""
    problems = check_world(schedules)
    for s in schedules:
        problems += check(s)
    if problems:
        raise ScheduleError(report(problems))
    return schedules


def report(problems: Sequence[Violation], limit: int = 20) -> str:
    lines = [str(p) for p in problems[:limit]]
    if len(problems) > limit:
        lines.append(f"... and {len(problems) - limit} more")
    return "\n".join(lines)


def drop_action(schedule: Schedule, index: int) -> Schedule:
    """The schedule without action `index` (e.g. one event wait removed)."""
    return schedule.renumbered([a for a in schedule.actions if a.index != index])


def receive_into_current(schedule: Schedule, group: int) -> Schedule:
    """The buffers swapped one step early: group `group`'s receive lands in the buffer the same
    step sends from (and computes on) instead of the other one."""
    members = [a for a in schedule.actions if a.group == group]
    send = next(a for a in members if a.kind == "send")
    edited = [replace(a, writes=send.reads) if a.group == group and a.kind == "recv" else a
              for a in schedule.actions]
    return schedule.renumbered(edited)


__all__ = ["FakeArray", "Region", "Action", "Schedule", "RecordingDevice", "RecordingOps",
           "record", "record_world", "record_decode", "DECODE_SHAPE", "happens_before", "check",
           "check_world", "prove", "proved",
           "report", "Violation", "ScheduleError", "drop_action", "receive_into_current",
           "RankRecordingDevice", "record_loopback", "prove_loopback", "forward_blocks_read",
           "backward_sums", "decode_parts_merged", "kept_rows", "linear_sums", "provenance"]
