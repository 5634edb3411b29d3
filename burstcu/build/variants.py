"""Which kernel instantiations exist: the single list both the compile gate and the launchers use.

Each family (forward in `fwd_variants`, backward in `bwd_variants`) declares its own
`KernelVariant`s; `burstcu.build.all_variants(arch)` is their union (this module imports
neither, so they import it without a circle). A variant is one C++ template
instantiation (a CuPy `name_expressions` entry), with the launch configuration it was tuned for.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

# Tile tables, not compile targets. "sm_80": A100 (163 KB opt-in smem a block); "sm_90": H100
# (227 KB); "sm_86": every GPU with at most 99 KB (101376 B) opt-in smem a block (cc 8.6, 8.7,
# 8.9 and the consumer Blackwells, cc 12.x). A table name only picks the tile sizes: at run time
# `compile.get_function` compiles the chosen instantiation for the device's own arch (a CUBIN for
# sm_86 would not load on an sm_120 device), see `burstcu.ops.cuda.kernel_ops._device_table_arch`.
# The compile gate compiles each table for the arch it is named after. "sm_90a": the sm_90 table
# plus the Hopper forward family (kernels/flash_fwd_sm90.cu: wgmma, TMA, setmaxnreg), whose
# variants name the compile target they need (`KernelVariant.target`): an sm_90a CUBIN runs on
# compute capability 9.0 only.
ARCHS = ("sm_80", "sm_86", "sm_90", "sm_90a")
# head dims the kernels instantiate; any other multiple of 8 up to 256 runs the next one, padded
NATIVE_HEADDIMS = (32, 64, 96, 128, 256)
# cp.async and bf16 mma.m16n8k16 need compute capability 8.0 (sm_80) or newer
MIN_COMPUTE_CAPABILITY = 80
DTYPES = ("float16", "bfloat16")
CXX_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


@dataclass(frozen=True)
class LaunchConfig:
    """How a variant is launched: threads per block, tile rows, dynamic shared memory, and (a
    pipelined kernel: the Hopper forward) the K/V tiles in flight."""

    threads: int
    block_m: int = 0
    block_n: int = 0
    smem_bytes: int = 0
    stages: int = 0


@dataclass(frozen=True)
class KernelVariant:
    """One instantiation. `name` is the C++ name expression, e.g. ``flash_fwd_step<__half, 64>``."""

    family: str
    source: str
    name: str
    dtype: str
    headdim: int
    launch: LaunchConfig
    target: str = ""  # the arch it must be compiled for ("sm_90a"), or "": the device's own


# opt-in dynamic shared memory a block may take, by tile table: what a table's variants must fit
# (on a GPU its own limit is read instead; the emulator holds each table to its own)
SMEM_PER_BLOCK = {"sm_80": 166912, "sm_86": 101376, "sm_90": 232448}


def base_table(arch: str) -> str:
    """The tile table of the families every arch shares: "sm_90a" takes sm_90's."""
    return "sm_90" if arch == "sm_90a" else arch


CAREFUL_SUFFIX = "_careful"


def careful_variant(variant: KernelVariant) -> KernelVariant:
    """The CAREFUL twin of a step variant: the same template with `true` appended, family
    `<family>_careful`. It runs in place of the plain one when a ring step with masked pairs may
    meet Inf/NaN inputs (kernels/common.cuh, gemm_rs_masked); being off the path of finite data,
    the compile gate reports its spills without failing on them."""
    return replace(variant, family=variant.family + CAREFUL_SUFFIX, name=variant.name[:-1] + ", true>")


def kernel_dir() -> Path:
    """Folder of the .cu sources: $BURSTCU_KERNEL_DIR, the checkout's kernels/, or package data."""
    env = os.environ.get("BURSTCU_KERNEL_DIR")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "kernels", here.parents[1] / "_kernels"):
        if (candidate / "common.cuh").exists():
            return candidate
    raise FileNotFoundError("cannot find the kernel sources (kernels/common.cuh); set BURSTCU_KERNEL_DIR")


KERNEL_SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")


def kernel_sources_digest(kdir: Path | None = None) -> str:
    """sha256 (hex) over the relative name and content of every kernel source and header under
    `kdir` (default `kernel_dir()`): ranks whose digests differ would run different kernels."""
    kdir = Path(kdir or kernel_dir()).resolve()
    h = hashlib.sha256()
    for path in sorted(p for p in kdir.rglob("*") if p.suffix in KERNEL_SOURCE_SUFFIXES and p.is_file()):
        h.update(str(path.relative_to(kdir)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
