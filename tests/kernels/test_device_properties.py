"""Device properties read for the given device, never by making another device current (which
would create a CUDA context there): the compile path's arch (`burstcu.build.compile.device_arch`)
and the kernel table and shared-memory limit KernelOps picks for the current device. Runs on a
stand-in CuPy (tests/fake_cupy.py) that records every query and switch. The bootstrap's own
reads: tests/transport/test_bootstrap.py."""

from __future__ import annotations

from burstcu.build import compile
from burstcu.ops.cuda import kernel_ops
from tests.fake_cupy import FakeCupy


def test_compile_and_kernel_ops_read_properties_without_switching(monkeypatch):
    fake = FakeCupy(cc=(12, 0), current=2).install(monkeypatch)
    assert compile.device_arch(5) == "sm_120"
    assert compile.device_arch() == "sm_120"
    assert kernel_ops._device_table_arch() == "sm_86"
    assert kernel_ops._device_smem_limit() == 232448
    reads = [c for c in fake.calls if c[0] == "attr"]
    assert [c[2] for c in reads] == [5, 5, 2, 2, 2, 2, 2]
    assert fake.switches() == [] and not [c for c in fake.calls if c[0] == "Device"]
