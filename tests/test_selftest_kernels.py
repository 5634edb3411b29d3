"""The selftest's checks run on a kernel backend too (the GPU path, here on the CPU emulator):
the kernels' own dtype is chosen, and the check passes within its stated tolerance."""

import pytest

import burstcu
from burstcu import selftest


@pytest.mark.emulated
def test_selftest_checks_run_on_the_kernel_backend():
    group = burstcu.init(backend="emulated")
    assert selftest.native_dtype(group) == "float16"
    result = selftest.check_correctness(group, group.ops.xp, "float16", seqlen_local=32)
    assert result["ok"], result
    assert max(result["errors"].values()) > 0  # float16: not bitwise float64
    step = selftest.probe_overlap(group, seqlen=64, heads=2, repeat=1, dtype="float16")
    assert step["compute_s"] > 0 and step["message_bytes"] == 2 * 64 * 2 * 64 * 2
