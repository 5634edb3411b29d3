"""CUDA streams and events (CuPy) that the GPU transports order their work on, and NVTX ranges.

`CupyStreams` is the device object every GPU transport shares (NCCL's `CupyDevice` adds the NCCL
calls; the one-GPU loopback's copy device adds copies); `burstcu.testing.schedule`'s recorders
implement the same methods. `join_stream` orders the caller's stream after another through an
event without blocking the host. `nvtx_range` is safe on the CPU (a no-op without CuPy/NVTX).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

# ----------------------------------------------------------------------------------------------
# observability

@contextmanager
def nvtx_range(label: str) -> Iterator[None]:
    """An NVTX range around the host code inside (visible in Nsight Systems); a no-op when
    CuPy or NVTX is unavailable, so it is safe on the CPU."""
    nvtx = _nvtx()
    if nvtx is None:
        yield
        return
    nvtx.RangePush(label)
    try:
        yield
    finally:
        nvtx.RangePop()


_NVTX: list = []


def _nvtx():
    """cupy.cuda.nvtx when it can emit ranges, else None (looked up once)."""
    if not _NVTX:
        try:
            from cupy.cuda import nvtx
            _NVTX.append(nvtx if getattr(nvtx, "available", False) else None)
        except Exception:
            _NVTX.append(None)
    return _NVTX[0]


# ----------------------------------------------------------------------------------------------
# the device: every stream, event and NCCL action the transport issues

class CupyStreams:
    """CuPy streams and events on the GPU current when it is made: what every GPU transport's
    device shares.

    The transports call only these methods (and their own additions); burstcu.testing.schedule's
    recording devices implement the same ones to record the schedule. Stream and event objects
    are opaque to the transports.
    """

    def __init__(self):
        import cupy
        self._cupy = cupy
        self.device_id = int(cupy.cuda.runtime.getDevice())   # the GPU it was made on

    def bind_thread(self) -> None:
        """Make this device current on the calling thread (a thread starts on device 0: a query
        from it would open a context there, half a GB of another rank's GPU)."""
        self._cupy.cuda.Device(self.device_id).use()

    def current_stream(self) -> Any:
        """The caller's compute stream (CuPy's current stream at the time of the call)."""
        return self._cupy.cuda.get_current_stream()

    def new_stream(self) -> Any:
        # non_blocking: no implicit sync with the legacy default stream; events order everything
        return self._cupy.cuda.Stream(non_blocking=True)

    def new_event(self) -> Any:
        return self._cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        """Whether everything before the event's latest record has completed (no blocking)."""
        return bool(event.done)

    def annotate(self, label: str):
        return nvtx_range(label)


def join_stream(device: Any, stream: Any, event: Any) -> None:
    """Order the caller's current stream after everything issued so far on `stream`, through
    `event`, without blocking the host."""
    device.record(event, stream)
    device.wait_event(device.current_stream(), event)
