"""The CUDA local op: `KernelOps` runs the kernels of kernels/ (compiled by `burstcu.build`) on a
GPU through CuPy, or on the CPU under the emulator (backend "emulated").

kernel_ops.py  KernelOps: forward (sm80 `mma.sync` and sm90 `wgmma` families), the dispatch,
               the first-use check
backward.py    the backward step and delta kernels' launches
decode.py      the split-K decode kernels' launches
params.py      host mirrors of kernels/params.cuh (the parameter structs passed by value)
tensor_map.py  TMA tensor maps for the sm90 family (driver-encoded, or the emulator's blob)
"""

from .kernel_ops import BACKENDS, KernelOps, table_arch_for

__all__ = ["KernelOps", "BACKENDS", "table_arch_for"]
