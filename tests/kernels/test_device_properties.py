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


def test_the_emulator_holds_each_table_to_its_gpus_shared_memory():
    """The emulator let any variant take up to sm_90's 227 KB a block, so a tile that no GPU of
    the "sm_86" table (99 KB) or "sm_80" (163 KB) can run passed there: KernelOps now holds the
    emulated table to its GPUs' limit, which headdim_problem and the launch both read."""
    from dataclasses import replace

    import pytest

    limits = {"sm_80": 166912, "sm_86": 101376, "sm_90": 232448, "sm_90a": 232448}
    for arch, limit in limits.items():
        ops = kernel_ops.KernelOps("emulated", arch=arch)
        assert ops.smem_limit == limit == compile.ARCH_LIMITS[arch]["smem_per_block"]
        assert ops.headdim_problem(128) is None and ops.headdim_problem(128, backward=True) is None
    ops = kernel_ops.KernelOps("emulated", arch="sm_86")
    name, variant = next((n, v) for n, v in ops._variants.items() if v.family == "forward")
    ops._variants[name] = replace(variant, launch=replace(variant.launch, smem_bytes=101377))
    with pytest.raises(ValueError, match=r"takes 101377 bytes of shared memory a block; the sm_86 "
                                         r"table's GPUs allow 101376"):
        ops.function(name)
