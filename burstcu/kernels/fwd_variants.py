"""The forward kernel family: which instantiations of kernels/flash_fwd.cu exist, per arch.

Two families live in flash_fwd.cu:

* ``"forward"``: ``flash_fwd_step<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS>``, one per (dtype, native
  head dim), with the tile sizes chosen for the arch (the table and the reasoning are in the
  comment that opens flash_fwd.cu; the register/smem figures come from the compile gate).
* ``"forward_finalize"``: ``flash_fwd_finalize<T>`` for T in {__half, __nv_bfloat16, float}
  (`headdim` 0: it serves every head dim).
"""

from __future__ import annotations

from .variants import ARCHS, CXX_TYPE, DTYPES, KernelVariant, LaunchConfig

SOURCE = "flash_fwd.cu"
NATIVE_HEADDIMS = (32, 64, 96, 128, 256)
FINALIZE_THREADS = 256  # flash_fwd_finalize's __launch_bounds__

# (arch, head dim) -> (NWARPS, BLOCK_N); BLOCK_M = 16 * NWARPS (each warp owns 16 query rows).
_TILES = {
    "sm_80": {32: (8, 64), 64: (8, 64), 96: (4, 32), 128: (4, 32), 256: (4, 32)},
    # 99 KB a block (sm_86/87/89/12x): the sm_80 tiles fit as they are; d = 256 needs exactly
    # (64 + 4*32) * 264 * 2 = 101376 B, the whole opt-in budget (no static smem).
    "sm_86": {32: (8, 64), 64: (8, 64), 96: (4, 32), 128: (4, 32), 256: (4, 32)},
    # sm_90's extra 64 KB of smem per SM lets d = 96 take 64-key tiles and still keep 3 blocks.
    "sm_90": {32: (8, 64), 64: (8, 64), 96: (4, 64), 128: (4, 32), 256: (4, 32)},
}


def step_smem_bytes(headdim: int, block_m: int, block_n: int) -> int:
    """Dynamic smem of a step launch: Q tile + 2 stages x (K, V), rows padded by 8 elements.

    Must equal `fwd::SmemBytes` in flash_fwd.cu.
    """
    return (block_m + 4 * block_n) * (headdim + 8) * 2


def step_variant(arch: str, dtype: str, headdim: int) -> KernelVariant:
    """The forward-step variant for (arch, dtype, native head dim)."""
    nwarps, block_n = _TILES[arch][headdim]
    block_m = 16 * nwarps
    name = f"flash_fwd_step<{CXX_TYPE[dtype]}, {headdim}, {block_m}, {block_n}, {nwarps}>"
    launch = LaunchConfig(threads=32 * nwarps, block_m=block_m, block_n=block_n,
                          smem_bytes=step_smem_bytes(headdim, block_m, block_n))
    return KernelVariant("forward", SOURCE, name, dtype, headdim, launch)


def finalize_variant(out_dtype: str) -> KernelVariant:
    """The finalize variant writing `out_dtype` ("float16", "bfloat16" or "float32")."""
    cxx = {"float32": "float", **CXX_TYPE}[out_dtype]
    return KernelVariant("forward_finalize", SOURCE, f"flash_fwd_finalize<{cxx}>", out_dtype, 0,
                         LaunchConfig(threads=FINALIZE_THREADS))


def forward_variants(arch: str) -> list[KernelVariant]:
    """Every forward-family variant on `arch`: steps for DTYPES x NATIVE_HEADDIMS, finalizes."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    steps = [step_variant(arch, dt, d) for dt in DTYPES for d in NATIVE_HEADDIMS]
    return steps + [finalize_variant(dt) for dt in (*DTYPES, "float32")]
