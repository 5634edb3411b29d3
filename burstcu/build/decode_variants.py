"""The decode kernel family (kernels/flash_decode.cu): which instantiations exist.

* ``"decode"``: ``flash_decode_split<T, DPL, ROWS, NWARPS>`` for T in {__half, __nv_bfloat16,
  float}, DPL in {1, 2, 4, 8} head-dim elements a lane (head dim <= 32 * DPL, the variant's
  `headdim`), ROWS query rows a block (16, or 8 at DPL = 8: at most 64 fp32 accumulators a lane),
  NWARPS = 4. The same tiles on every arch (no tensor cores, no dynamic shared memory).
* ``"decode_combine"``: ``flash_decode_combine`` (fp32 in and out; `headdim` 0, dtype float32).
"""

from __future__ import annotations

from .variants import ARCHS, KernelVariant, LaunchConfig

SOURCE = "flash_decode.cu"
NWARPS = 4
COMBINE_THREADS = 128   # DECODE_COMBINE_THREADS in flash_decode.cu
_CXX = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
DPLS = (1, 2, 4, 8)


def rows_per_block(dpl: int) -> int:
    """Query rows a split block holds (ROWS): 64 fp32 accumulators a lane at most."""
    return 16 if dpl <= 4 else 8


def split_variant(dtype: str, dpl: int) -> KernelVariant:
    rows = rows_per_block(dpl)
    name = f"flash_decode_split<{_CXX[dtype]}, {dpl}, {rows}, {NWARPS}>"
    return KernelVariant("decode", SOURCE, name, dtype, 32 * dpl,
                         LaunchConfig(threads=32 * NWARPS, block_m=rows))


def combine_variant() -> KernelVariant:
    return KernelVariant("decode_combine", SOURCE, "flash_decode_combine", "float32", 0,
                         LaunchConfig(threads=COMBINE_THREADS))


def decode_variants(arch: str) -> list[KernelVariant]:
    """Every decode-family variant (the same on every arch)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    return [split_variant(dt, dpl) for dt in _CXX for dpl in DPLS] + [combine_variant()]
