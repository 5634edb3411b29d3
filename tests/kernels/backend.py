"""Which machine runs the kernel tests: the CPU emulator (default) or a GPU.

BURSTCU_KERNEL_TEST_BACKEND=cupy runs the same test bodies on a CUDA GPU through CuPy (NumPy
inputs are copied to the device and results back, `burstcu.testing.host_arrays`); without a
usable GPU those tests skip. bench/gpu/run.sh runs them so, and under compute-sanitizer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

BACKEND = os.environ.get("BURSTCU_KERNEL_TEST_BACKEND", "emulated")
# BURSTCU_KERNEL_TEST_ARCH=sm_90a runs every test that does not name a kernel table on that one
# (the Hopper forward kernels); unset: the device's own table on a GPU, sm_80's on the emulator
ARCH = os.environ.get("BURSTCU_KERNEL_TEST_ARCH") or None
# BURSTCU_CUPY_NO_POOL=1: every CuPy array is its own cudaMalloc, so compute-sanitizer's memcheck
# sees an access past an array's end (inside a pooled chunk it would go unnoticed)
if BACKEND == "cupy" and os.environ.get("BURSTCU_CUPY_NO_POOL") == "1":
    import cupy
    cupy.cuda.set_allocator(None)


def kernel_ops(deterministic: bool = False, randomize: bool = False, arch: str | None = None,
               pack_lists: bool = True):
    """KernelOps on the chosen backend with the tile table of `arch` (None: the device's own on
    a GPU, sm_80's on the emulator), seen through NumPy arrays. pack_lists False keeps every
    list step a tile a rectangle (what a test comparing it with a launch a rectangle bit for bit
    needs: a packed list rounds in another order)."""
    from burstcu.ops.cuda.kernel_ops import KernelOps
    from burstcu.testing.host_arrays import HostArrays

    if BACKEND == "cupy":
        from burstcu.transport.bootstrap import gpu_usable
        if not gpu_usable():
            pytest.skip("BURSTCU_KERNEL_TEST_BACKEND=cupy needs a CUDA GPU")
    ops = KernelOps(backend=BACKEND, arch=arch or ARCH, deterministic=deterministic,
                    randomize=randomize)
    # the tests check the kernels themselves: no first-use fallback to the mma.sync kernels
    # (kernel_ops._sm90_checked, tested on its own) may hide a wrong Hopper kernel on a GPU
    ops.first_use_check = False
    ops.pack_lists = pack_lists
    return HostArrays(ops)


def seeded_kernel_dir(folder: Path, source: str, anchor: str, replacement: str) -> Path:
    """A copy of the kernel sources in `folder`/kernels with the one `anchor` of `source` (a file
    name) replaced: a seeded mistake for the emulator to catch once BURSTCU_KERNEL_DIR names it."""
    from burstcu.build.variants import kernel_dir

    copy = Path(folder) / "kernels"
    shutil.copytree(kernel_dir(), copy)
    text = (copy / source).read_text()
    assert text.count(anchor) == 1, f"the seed's anchor moved in {source}: update the seed"
    (copy / source).write_text(text.replace(anchor, replacement))
    return copy
