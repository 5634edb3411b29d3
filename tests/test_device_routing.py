"""Which device a call runs on (`burstcu.arrays`). With group=None the inputs' DLPack device
routes the call: CPU arrays to the NumPy backend, CUDA arrays to the cupy group (or, on a machine
without a usable GPU, a clear error). With an op that computes on a GPU, inputs on another GPU
than the current one are refused through the cross-rank agreement, so a peer's wrong device stops
this rank too. CuPy is a stand-in (tests/fake_cupy.py)."""

from __future__ import annotations

import numpy as np
import pytest

import burstcu
from burstcu import arrays
from burstcu.group import Group
from burstcu.ops.numpy import NumpyOps
from burstcu.testing.reference import attention_ref
from burstcu.validate import InputError, calling_thread
from tests.fake_cupy import FakeCupy


class _DLTensor:
    """A framework array on the CPU that may claim to live on another device."""

    def __init__(self, data, device=None):
        self._data = np.asarray(data)
        self._device = device

    def __dlpack__(self, **kwargs):
        return self._data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._device or self._data.__dlpack_device__()


_DLTensor.__module__ = "standinfw"


def _qkv(seed=0, shape=(1, 16, 2, 8)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]


# ---- group=None: routed by the DLPack device ----------------------------------------------------
def test_cpu_dlpack_arrays_take_the_numpy_path():
    q, k, v = _qkv()
    assert arrays.group_for(None, _DLTensor(q)).backend == "numpy"
    assert arrays.group_for(None, _DLTensor(q, device=(1, 0))).backend == "numpy"
    out = burstcu.attention(_DLTensor(q), _DLTensor(k), _DLTensor(v), causal=True)
    assert np.abs(np.from_dlpack(out) - attention_ref(q, k, v, causal=True)[0]).max() < 1e-5


def test_cuda_dlpack_arrays_on_a_cpu_only_machine_get_a_clear_error():
    if burstcu.group.gpu_usable():
        pytest.skip("a GPU is usable here: CUDA arrays run on it")
    q, k, v = (_DLTensor(x, device=(2, 0)) for x in _qkv())
    with pytest.raises(ValueError, match=r"q is on CUDA device 0.*'cupy' backend cannot start"):
        burstcu.attention(q, k, v)


def test_cuda_arrays_given_to_a_host_group_get_a_clear_error():
    """A group that computes on the host (NumPy, the emulator) given CUDA arrays says so and
    what to do, instead of DLPack's BufferError."""
    q, k, v = _qkv()
    with burstcu.init(backend="numpy") as group:
        with pytest.raises(ValueError, match=r"^k is on CUDA device 1 but this group computes on "
                                             r"the host \(numpy\): make the group with "
                                             r"burstcu.init\(backend='cupy'\)"):
            burstcu.attention(q, _DLTensor(k, device=(2, 1)), v, group)
        with pytest.raises(ValueError, match=r"^q is on CUDA device 0 but this group computes on the host"):
            burstcu.decode(_DLTensor(q[:, :1], device=(2, 0)), k, v, group)
        cache = burstcu.KVCache(group, 1, 16, 2, 8, np.float32)
        for call in (cache.append, cache.from_prefill):
            with pytest.raises(ValueError, match=rf"KVCache.{call.__name__}: k is on CUDA device 0 but "
                                                 rf"this group computes on the host"):
                call(_DLTensor(k, device=(2, 0)), v)


def test_cuda_dlpack_arrays_route_to_the_cupy_group(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(arrays, "local_group", lambda backend: (backend, sentinel))
    assert arrays.group_for(None, _DLTensor(np.zeros(1), device=(2, 1))) == ("cupy", sentinel)
    assert arrays.group_for(None, _DLTensor(np.zeros(1))) == ("numpy", sentinel)


# ---- an op on a GPU: inputs on the current GPU, agreed across ranks -----------------------------
class _OpOnTheCurrentGpu(NumpyOps):
    """The NumPy op, saying that its work runs on CuPy's current GPU (as the CUDA kernels' op
    does): the device check reads the device from the op."""

    device = "cuda"

    def current_device(self) -> int:
        import cupy   # the stand-in installed by the test
        return int(cupy.cuda.runtime.getDevice())


class _TwoRankTransport:
    """Rank 0 of two; the other rank's agreement message is `peer`."""

    size, rank = 2, 0

    def __init__(self, peer):
        self.peer, self.sent = peer, []

    def allgather_object(self, obj, what="metadata"):
        self.sent.append(obj)
        return [obj, self.peer]


def _cupy_group(monkeypatch, peer, current=0):
    FakeCupy(current=current).install(monkeypatch)
    return Group(0, 2, "cupy", _TwoRankTransport(peer), _OpOnTheCurrentGpu())


def test_inputs_on_another_gpu_fail_through_the_agreement(monkeypatch):
    group = _cupy_group(monkeypatch, peer=(None, None, (None, calling_thread(), "its site")))
    q, k, v = (_DLTensor(x, device=(2, 1)) for x in _qkv())
    with pytest.raises(ValueError, match=r"q is on CUDA device 1 but the current CuPy device is 0"
                                         r".*cupy\.cuda\.Device\(1\)\.use\(\)"):
        burstcu.attention(q, k, v, group)
    (err, meta, (length, thread, _)), = group.transport.sent  # raised only after the agreement round
    assert err[0] == "ValueError" and meta is None and length is None and thread == "MainThread"
    assert InputError.from_plain(err).kind is ValueError


def test_a_peer_on_another_gpu_stops_this_rank_too(monkeypatch):
    message = "k is on CUDA device 1 but the current CuPy device is 0: call cupy.cuda.Device(1).use()"
    group = _cupy_group(monkeypatch, peer=(InputError(ValueError, message).plain(), None,
                                           (None, calling_thread(), "its site")))
    with pytest.raises(ValueError, match=r"rank 1: k is on CUDA device 1"):
        burstcu.attention(*_qkv(), group)  # this rank's inputs (host arrays here) are fine
    assert len(group.transport.sent) == 1


def test_inputs_on_the_current_gpu_pass_the_device_check(monkeypatch):
    group = _cupy_group(monkeypatch, peer=(None, None, None), current=1)
    inputs = tuple(_DLTensor(x, device=(2, 1)) for x in _qkv())
    assert arrays.device_problem(group.ops, ("q", "k", "v"), inputs) is None


# ---- one op a GPU: its kernels, buffers and flags are that GPU's --------------------------------
def _fresh_local_groups(monkeypatch):
    from burstcu import group as group_module
    monkeypatch.setattr(group_module, "_LOCAL", {})
    return group_module.local_group


def test_each_gpu_of_a_process_gets_its_own_group_of_one(monkeypatch):
    """group=None on two GPUs of one process: an op a device, bound to it (a kernel object loaded
    and given its shared memory on one device cannot launch on another); the op refuses a call
    made while another device is current, through the agreement, before anything runs."""
    fake = FakeCupy(cc=(8, 0), current=0).install(monkeypatch)
    local_group = _fresh_local_groups(monkeypatch)
    on_0 = local_group("cupy")
    fake.select(1)
    on_1 = local_group("cupy")
    assert on_1 is not on_0 and (on_0.ops.device_id, on_1.ops.device_id) == (0, 1)
    assert local_group("cupy") is on_1 and local_group("numpy") is local_group("numpy")
    fake.select(0)
    assert local_group("cupy") is on_0
    inputs = tuple(_DLTensor(x, device=(2, 1)) for x in _qkv())
    assert arrays.device_problem(on_1.ops, ("q", "k", "v"), inputs).message.startswith(
        "this group computes on CUDA device 1 (it was made there")
    fake.select(1)
    assert arrays.device_problem(on_1.ops, ("q", "k", "v"), inputs) is None
    assert "but the current CuPy device is 1: call cupy.cuda.Device(0).use()" in \
        arrays.device_problem(on_0.ops, ("q", "k", "v"), inputs).message


def test_a_gpu_op_keeps_its_buffers_per_stream_and_thread(monkeypatch):
    """A GPU group of one runs several threads' calls as they come, all on the legacy stream by
    default: what the op keeps between calls (message buffers, decode plans) is keyed by thread
    too, so two threads' launches never share a workspace."""
    import threading

    FakeCupy(cc=(8, 0)).install(monkeypatch)
    ops = _fresh_local_groups(monkeypatch)("cupy").ops
    keys = [ops.stream_key()]
    thread = threading.Thread(target=lambda: keys.append(ops.stream_key()))
    thread.start()
    thread.join()
    assert keys[0] == ops.stream_key() and keys[0] != keys[1]
    assert keys[0][0] == keys[1][0] == 0     # one stream, two threads
