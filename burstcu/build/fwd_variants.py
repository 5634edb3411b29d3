"""The forward kernel family: which instantiations of kernels/flash_fwd.cu exist, per arch.

Two families live in flash_fwd.cu:

* ``"forward"``: ``flash_fwd_step<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS>``, one per (dtype, native
  head dim), with the tile sizes chosen for the arch (the table and the reasoning are in the
  comment that opens flash_fwd.cu; the register/smem figures come from the compile gate).
* ``"forward_careful"``: the same steps with CAREFUL = true (`variants.careful_variant`), run
  instead of ``"forward"`` for a block with masked pairs when V holds Inf/NaN.
* ``"forward_list"`` (and ``"forward_list_careful"``): ``flash_fwd_steps``, the same tiles over a
  ring step's whole rectangle list in one launch (`burstcu.ops.cuda.params.step_groups`).
* ``"forward_pass"`` (and ``"forward_pass_careful"``): ``flash_fwd_pass``, the same tiles for a
  pass of one fold over every query row: the state neither read nor written, out and lse written
  as the finalize would (`KernelOps._fold`).
* ``"forward_sm90"`` (tile table "sm_90a" only): ``flash_fwd_step_sm90<T, HEADDIM, BLOCK_N, STAGES>``
  of kernels/flash_fwd_sm90.cu for head dims 64, 128 and 256, compiled for sm_90a (wgmma, TMA,
  setmaxnreg): a producer warpgroup and two consumer warpgroups of 64 query rows each, on a
  persistent grid; ``"forward_sm90_careful"`` is its CAREFUL twin (the producer warpgroup zeroes
  each V tile's non-finite values and records where they were; the consumers turn the outputs
  they reach into NaN). The other head dims keep ``"forward"``.
* ``"forward_sm90_list"`` (and ``"forward_sm90_list_careful"``): ``flash_fwd_steps_sm90``, the
  Hopper step over a ring step's whole rectangle list in one launch (the same StepGroups as
  ``"forward_list"``, query tiles of 128 rows), on the same tiles as ``"forward_sm90"``.
* ``"forward_finalize"``: ``flash_fwd_finalize<T>`` for T in {__half, __nv_bfloat16, float}
  (`headdim` 0: it serves every head dim).
* ``"nonfinite_flag"``: ``flash_any_nonfinite<T>`` for T in {__half, __nv_bfloat16, float}: sets a
  device flag when a (B, S, H, D) tensor holds a value that could make a product at a masked pair
  non-finite (it picks which of a plain/careful pair runs, forward and backward alike).
"""

from __future__ import annotations

import functools

from .variants import (ARCHS, CAREFUL_SUFFIX, CXX_TYPE, DTYPES, NATIVE_HEADDIMS, SMEM_PER_BLOCK,
                       KernelVariant, LaunchConfig, base_table, careful_variant)

SOURCE = "flash_fwd.cu"
FINALIZE_THREADS = 256  # flash_fwd_finalize's __launch_bounds__
FINALIZE_VEC = 8        # elements a flash_fwd_finalize thread where rows allow (two float4 of acc)
FLAG_THREADS = 256  # flash_any_nonfinite's __launch_bounds__

# (arch, head dim) -> (NWARPS, BLOCK_N); BLOCK_M = 16 * NWARPS (each warp owns 16 query rows).
_TILES = {
    "sm_80": {32: (8, 64), 64: (8, 64), 96: (4, 32), 128: (4, 32), 256: (4, 32)},
    # 99 KB a block (sm_86/87/89/12x): the sm_80 tiles fit as they are; d = 256 needs exactly
    # (64 + 4*32) * 264 * 2 = 101376 B, the whole opt-in budget (no static smem).
    "sm_86": {32: (8, 64), 64: (8, 64), 96: (4, 32), 128: (4, 32), 256: (4, 32)},
    # sm_90: measured on an H100 (bench/gpu/tiles.py, bench/results/h100/tiles.json; fp16, median of
    # 10, S = 4096 and 16384): d = 64 4 warps x 64 keys (1.22x the 8 x 64 tiles chosen without a
    # GPU), d = 128 8 warps x 128 keys (1.32x; 249 registers, no spills; 170 KB smem, which only
    # sm_90's 227 KB allow), d = 256 8 warps x 64 keys (1.16x; 198 KB). d = 32 and 96 unmeasured.
    "sm_90": {32: (8, 64), 64: (4, 64), 96: (4, 64), 128: (8, 128), 256: (8, 64)},
}


def step_smem_bytes(headdim: int, block_m: int, block_n: int) -> int:
    """Dynamic smem of a step launch: Q tile + 2 stages x (K, V), rows padded by 8 elements.

    Must equal `fwd::SmemBytes` in flash_fwd.cu.
    """
    return (block_m + 4 * block_n) * (headdim + 8) * 2


# a step family's rectangle-list twin: family + LIST_SUFFIX (bwd_variants.LIST_SUFFIX's convention)
LIST_SUFFIX = "_list"
LIST_FAMILY = "forward" + LIST_SUFFIX
PASS_FAMILY = "forward_pass"   # flash_fwd_pass: a pass of one fold
# (table, head dims) with a flash_fwd_pass: where it keeps flash_fwd_step's blocks a SM (the gate's
# registers: at d = 64 on the sm_80 and sm_86 tiles it took 148 where the step takes 128, one
# block a SM instead of two, and bounded to two blocks it spilled; KernelOps runs the step and
# the finalize there)
PASS_HEADDIMS = {"sm_80": (32, 96, 128, 256), "sm_86": (32, 96, 128, 256), "sm_90": NATIVE_HEADDIMS}
_KERNELS = {"forward": "flash_fwd_step", LIST_FAMILY: "flash_fwd_steps", PASS_FAMILY: "flash_fwd_pass"}


def step_variant(arch: str, dtype: str, headdim: int, listed: bool = False,
                 family: str | None = None) -> KernelVariant:
    """The forward-step variant for (arch, dtype, native head dim): flash_fwd_step (one
    rectangle a launch), or with `listed` flash_fwd_steps (a ring step's rectangle list in one
    launch, family "forward_list"), or `family` PASS_FAMILY's flash_fwd_pass, on the same tiles."""
    nwarps, block_n = _TILES[base_table(arch)][headdim]
    return _tiled_variant(dtype, headdim, nwarps, block_n, family or (LIST_FAMILY if listed else "forward"))


def _tiled_variant(dtype: str, headdim: int, nwarps: int, block_n: int,
                   family: str = "forward") -> KernelVariant:
    block_m = 16 * nwarps
    name = f"{_KERNELS[family]}<{CXX_TYPE[dtype]}, {headdim}, {block_m}, {block_n}, {nwarps}>"
    launch = LaunchConfig(threads=32 * nwarps, block_m=block_m, block_n=block_n,
                          smem_bytes=step_smem_bytes(headdim, block_m, block_n))
    return KernelVariant(family, SOURCE, name, dtype, headdim, launch)


SM90_SOURCE = "flash_fwd_sm90.cu"
SM90_FAMILY = "forward_sm90"
SM90_LIST_FAMILY = SM90_FAMILY + LIST_SUFFIX   # flash_fwd_steps_sm90
SM90_BLOCK_M = 128  # two consumer warpgroups of 64 rows (one wgmma m64 each)
SM90_THREADS = 384  # a producer warpgroup and two consumer warpgroups
# head dim -> (BLOCK_N, STAGES): keys a K/V tile and K/V stages in flight. Q tile + STAGES x (K, V)
# tiles in the 227 KB; d = 256 takes 64-key tiles (the S accumulator is then 32 registers a
# thread, next to 128 of O). Searched on an H200 (bench/gpu/tiles.py --tile-table sm_90a,
# bench/results/h200/run4/tiles_sm90.json): at d = 128 a third stage (225 KB) runs the step 1.12x
# (fp16, S = 16K) to 1.19x (S = 4K) faster than two; at d = 64 and 256 these tiles were best.
_SM90_TILES = {64: (128, 3), 128: (128, 3), 256: (64, 2)}
SM90_SMEM_LIMIT = SMEM_PER_BLOCK["sm_90"]  # 227 KB
SM90_BLOCK_NS = (64, 128, 256)  # the kernel's static_assert: wgmma N of S = Q K^T
SM90_HEADDIMS = tuple(_SM90_TILES)


def sm90_smem_bytes(headdim: int, block_n: int, stages: int, careful: bool = False) -> int:
    """Dynamic smem of a forward_sm90 launch: 1024 B of alignment slack, Q (BLOCK_M x D), STAGES x
    (K, V) (BLOCK_N x D each), 2-byte elements, (careful: STAGES x D x BLOCK_N bits of
    non-finite marks), then 256 B of mbarriers. Must equal `fwd90::Smem::kBytes` in
    flash_fwd_sm90.cu."""
    marks = stages * headdim * block_n // 8 if careful else 0
    return 1024 + (SM90_BLOCK_M + 2 * stages * block_n) * headdim * 2 + marks + 256


def sm90_step_variant(dtype: str, headdim: int, careful: bool = False,
                      listed: bool = False) -> KernelVariant:
    """The Hopper forward step for (dtype, head dim in SM90_HEADDIMS), or its CAREFUL twin;
    `listed`: its rectangle-list twin flash_fwd_steps_sm90 (family forward_sm90_list)."""
    return sm90_variant_for_tiles(dtype, headdim, *_SM90_TILES[headdim], careful=careful,
                                  listed=listed)


def sm90_variant_for_tiles(dtype: str, headdim: int, block_n: int, stages: int,
                           careful: bool = False, listed: bool = False) -> KernelVariant:
    """A Hopper forward step with explicit tiles, in the table or not (bench/gpu/tiles.py):
    BLOCK_N keys a K/V tile (64, 128 or 256), STAGES K/V tiles in flight (>= 2); head dim 64, 128
    or 256. Whether it fits shared memory and the registers is the compile gate's to say. The
    CAREFUL twin keeps the tiles but drops stages (to 2 at least) where its non-finite marks would
    not fit beside them: the stages change when copies land, not what the kernel computes."""
    if headdim not in SM90_HEADDIMS or block_n not in SM90_BLOCK_NS or stages < 2:
        raise ValueError(f"no Hopper forward tiles for d={headdim}, BLOCK_N={block_n}, "
                         f"STAGES={stages} (d in {SM90_HEADDIMS}, BLOCK_N in {SM90_BLOCK_NS}, "
                         f"STAGES >= 2)")
    while careful and stages > 2 and sm90_smem_bytes(headdim, block_n, stages, True) > SM90_SMEM_LIMIT:
        stages -= 1
    kernel = "flash_fwd_steps_sm90" if listed else "flash_fwd_step_sm90"
    name = (f"{kernel}<{CXX_TYPE[dtype]}, {headdim}, {block_n}, {stages}"
            + (", true>" if careful else ">"))
    launch = LaunchConfig(threads=SM90_THREADS, block_m=SM90_BLOCK_M, block_n=block_n,
                          smem_bytes=sm90_smem_bytes(headdim, block_n, stages, careful),
                          stages=stages)
    family = (SM90_LIST_FAMILY if listed else SM90_FAMILY) + (CAREFUL_SUFFIX if careful else "")
    return KernelVariant(family, SM90_SOURCE, name, dtype, headdim, launch, target="sm_90a")


@functools.lru_cache(maxsize=None)
def careful_twin(variant: KernelVariant) -> KernelVariant:
    """The CAREFUL twin that a step variant of any family launches beside (KernelOps.launch_step):
    a forward_sm90 variant's keeps its tiles with the stages its marks leave room for
    (sm90_variant_for_tiles); every other family's is `variants.careful_variant`'s."""
    if variant.family in (SM90_FAMILY, SM90_LIST_FAMILY):
        return sm90_variant_for_tiles(variant.dtype, variant.headdim, variant.launch.block_n,
                                      variant.launch.stages, careful=True,
                                      listed=variant.family == SM90_LIST_FAMILY)
    return careful_variant(variant)


def finalize_variant(out_dtype: str) -> KernelVariant:
    """The finalize variant writing `out_dtype` ("float16", "bfloat16" or "float32")."""
    cxx = {"float32": "float", **CXX_TYPE}[out_dtype]
    return KernelVariant("forward_finalize", SOURCE, f"flash_fwd_finalize<{cxx}>", out_dtype, 0,
                         LaunchConfig(threads=FINALIZE_THREADS))


def nonfinite_flag_variant(dtype: str) -> KernelVariant:
    """The kernel that flags values in a `dtype` ("float16", "bfloat16" or "float32") tensor that
    could make a product at a masked pair non-finite."""
    cxx = {"float32": "float", **CXX_TYPE}[dtype]
    return KernelVariant("nonfinite_flag", SOURCE, f"flash_any_nonfinite<{cxx}>", dtype, 0,
                         LaunchConfig(threads=FLAG_THREADS))


def forward_variants(arch: str) -> list[KernelVariant]:
    """Every forward-family variant on `arch`: steps (plain and careful) for DTYPES x
    NATIVE_HEADDIMS, on "sm_90a" the Hopper steps (one rectangle a launch and lists) too,
    finalizes, non-finite flags."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    steps = [step_variant(arch, dt, d, family=family) for family in ("forward", LIST_FAMILY, PASS_FAMILY)
             for dt in DTYPES for d in NATIVE_HEADDIMS
             if family != PASS_FAMILY or d in PASS_HEADDIMS[base_table(arch)]]
    hopper = ([sm90_step_variant(dt, d, careful, listed) for listed in (False, True)
               for careful in (False, True) for dt in DTYPES for d in SM90_HEADDIMS]
              if arch == "sm_90a" else [])
    return (steps + [careful_variant(v) for v in steps] + hopper
            + [finalize_variant(dt) for dt in (*DTYPES, "float32")]
            + [nonfinite_flag_variant(dt) for dt in (*DTYPES, "float32")])


def step_variant_for_tiles(dtype: str, headdim: int, nwarps: int, block_n: int) -> KernelVariant:
    """A forward-step variant with explicit tiles, outside any table (for tile searches such as
    bench/gpu/tiles.py): NWARPS warps, BLOCK_M = 16 * NWARPS query rows, BLOCK_N keys a tile.

    The kernel's static_asserts need HEADDIM and BLOCK_N to be multiples of 16; with the tiles of
    a table this returns exactly that table's `step_variant`.
    """
    if headdim % 16 or block_n % 16 or nwarps < 1:
        raise ValueError(f"illegal forward tiles: d={headdim}, NWARPS={nwarps}, BLOCK_N={block_n}")
    return _tiled_variant(dtype, headdim, nwarps, block_n)
