"""NCCLTransport pieces that need no GPU: the dtype table, the NVTX helper, buffer checks and the
event order of its all-gather. Starting NCCL (device pick, unique id, every-rank failures):
tests/transport/test_bootstrap.py."""

from __future__ import annotations

import numpy as np
import pytest

from burstcu.testing.schedule import RecordingDevice, RecordingOps
from burstcu.transport import bootstrap, nccl
from burstcu.transport.streams import nvtx_range

try:
    import ml_dtypes
except ImportError:  # pragma: no cover
    ml_dtypes = None


# ---- dtype table (values from nccl.h; CuPy's constants must agree) ---------------------------
NCCL_H = {"int8": (0, 1), "uint8": (1, 1), "int32": (2, 1), "uint32": (3, 1), "int64": (4, 1),
          "uint64": (5, 1), "float16": (6, 1), "float32": (7, 1), "float64": (8, 1),
          "complex64": (7, 2), "complex128": (8, 2), "bool": (1, 1), "int16": (1, 2), "uint16": (1, 2)}


@pytest.mark.parametrize("name", sorted(NCCL_H))
def test_numpy_dtype_to_nccl(name):
    assert nccl.nccl_dtype(np.dtype(name)) == NCCL_H[name]


@pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
def test_ml_dtypes_to_nccl():
    assert nccl.nccl_dtype(ml_dtypes.bfloat16) == (9, 1)
    assert nccl.nccl_dtype(ml_dtypes.float8_e4m3fn) == (10, 1)
    assert nccl.nccl_dtype(ml_dtypes.float8_e5m2) == (11, 1)


@pytest.mark.skipif(bootstrap._nccl_problem() is not None, reason="cupy.cuda.nccl not installed")
def test_table_agrees_with_cupy_constants():
    import cupy.cuda.nccl
    assert nccl.nccl_dtype(np.uint8)[0] == cupy.cuda.nccl.NCCL_UINT8
    assert nccl.nccl_dtype(np.float16)[0] == cupy.cuda.nccl.NCCL_FLOAT16
    assert nccl.nccl_dtype(np.float64)[0] == cupy.cuda.nccl.NCCL_FLOAT64


@pytest.mark.parametrize("dtype", [object, "U4", [("a", "f4"), ("b", "i4")]])
def test_unsupported_dtypes_are_a_clear_error(dtype):
    with pytest.raises(TypeError, match="NCCL has no data type"):
        nccl.nccl_dtype(dtype)


def test_count_of_a_byte_view_and_of_complex():
    assert nccl.nccl_count(np.zeros(10, np.float32).view(np.uint8)) == (40, 1)
    assert nccl.nccl_count(np.zeros((3, 2), np.complex64)) == (12, 7)


# ---- helpers and error paths in one process -------------------------------------------------
def test_nvtx_range_is_a_no_op_without_a_gpu():
    with nvtx_range("burstcu test"):
        x = 1
    assert x == 1


def test_transport_checks_buffers():
    t = nccl.NCCLTransport(0, 2, RecordingDevice())
    with pytest.raises(ValueError, match="C-contiguous"):
        t.send_recv(np.zeros((4, 4))[:, ::2], None, 1, 1)
        t.commit()
    with pytest.raises(ValueError, match="needs 2 x"):
        t.allgather(np.zeros(4, np.uint8), np.zeros(4, np.uint8))
    with pytest.raises(RuntimeError, match="without an MPI communicator"):
        t.allgather_object(1)
    assert nccl.NCCLTransport(0, 1, RecordingDevice()).allgather_object("x") == ["x"]


def test_allgather_is_event_ordered():
    dev = RecordingDevice()
    ops = RecordingOps(dev)
    send, recv = ops.new("send", (4,), np.uint8), ops.new("recv", (2, 4), np.uint8)
    dev.actions.clear()
    t = nccl.NCCLTransport(1, 2, dev)
    t.allgather(send, recv)
    assert [(a.stream, a.kind) for a in dev.actions] == [
        ("compute", "record"), ("comm", "wait"), ("comm", "record"), ("comm", "allgather"),
        ("comm", "record"), ("compute", "wait")]
    assert t.stats.bytes_sent == 4 and t.stats.bytes_received == 4
    assert t.stats.messages == 1   # its piece to the one other rank


def test_a_sub_group_is_connected_by_the_function_bootstrap_gave(monkeypatch):
    """`split` makes a sub-group's NCCL communicator with the transport's `connect` (bootstrap's
    closure over this rank's device) on the host's split (an MPI transport of the
    sub-communicator), and hands `connect` on, so a sub-group of the sub-group connects the
    same way; without one it refuses clearly."""
    MPI = pytest.importorskip("mpi4py.MPI")
    connected = []

    def connect(sub_host):
        assert sub_host.name == "mpi"
        connected.append(sub_host.size)
        return f"nccl communicator {len(connected)}"

    made = []
    monkeypatch.setattr(nccl, "CupyDevice", lambda comm: made.append(comm) or RecordingDevice())
    top = nccl.NCCLTransport(0, 1, RecordingDevice(), MPI.COMM_SELF, 5.0, connect)
    try:
        sub = top.split(0, 0, "heads")
        inner = sub.split(0, 0, "inner")
        assert connected == [1, 1] and made == ["nccl communicator 1", "nccl communicator 2"]
        assert sub.connect is connect and inner.connect is connect and sub.size == inner.size == 1
        assert top.split(0, 0, "heads") is sub and connected == [1, 1]   # made once per name
    finally:
        top.close()
    plain = nccl.NCCLTransport(0, 1, RecordingDevice(), MPI.COMM_SELF, 5.0)
    try:
        with pytest.raises(RuntimeError, match="cannot make sub-groups"):
            plain.split(0, 0, "heads")
    finally:
        plain.close()


def test_an_abort_ends_every_rank_when_the_host_side_is_mpi():
    """NCCL aborts through its host side: MPI_Abort ends every rank (so an uncaught exception
    may end the job, `burstcu.group.UncaughtEndsTheJob`); a host side that is not MPI's (here
    SelfTransport) or none at all does not say so."""
    MPI = pytest.importorskip("mpi4py.MPI")
    assert not nccl.NCCLTransport(0, 2, RecordingDevice()).abort_ends_every_rank

    from burstcu.transport.base import SelfTransport
    assert not nccl.NCCLTransport(0, 1, RecordingDevice(), SelfTransport()).abort_ends_every_rank
    over_mpi = nccl.NCCLTransport(0, 1, RecordingDevice(), MPI.COMM_SELF, 5.0)
    try:
        assert over_mpi.abort_ends_every_rank
    finally:
        over_mpi.close()


def test_the_watchdog_fires_once_even_when_more_exchanges_are_watched():
    """After the watchdog reported an exchange reached but never arrived (the job is ending), an
    exchange watched later is not reported again."""
    import time

    class Device:
        done: set = set()

        def new_event(self):
            return object()

        def query(self, event):
            return event in self.done

    device, fired = Device(), []
    dog = nccl.EventWatchdog(device, 0.1, fired.append, poll=0.01)
    started = dog.event("started")
    device.done.add(started)                      # reached, never arrives
    dog.watch(started, dog.event("arrived"), "first")
    deadline = time.monotonic() + 5
    while not fired and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.watch(dog.event("started"), dog.event("arrived"), "second")
    time.sleep(0.5)
    dog.stop()
    assert fired == ["first"]


def test_the_host_transport_tells_the_peers_why_the_group_closed():
    """A "cupy" group closed with an exception in flight: its NCCL transport's `left_why` was
    not handed to the host transport whose close sends the notice, so the peers heard a plain
    close (no grace for that rank's own failure to end the job, a wrong explanation)."""
    from burstcu.transport.base import Transport

    heard = []

    class Host(Transport):   # a host side that records the notice its close sends
        def say_left(self, why):
            heard.append(why)

        def close(self):
            self.say_left(self.left_why)

        def _post(self, exchanges): ...
        def _wait(self): ...
        def allgather_object(self, obj, what="metadata"): ...
        def allgather(self, send_buf, recv_buf): ...
        def barrier(self): ...

    transport = nccl.NCCLTransport(0, 2, RecordingDevice(), Host(0, 2, 10), 10)
    transport.left_why = "group.close(), with an exception in flight there: RuntimeError: x"
    transport.close()
    assert heard == [transport.left_why]
