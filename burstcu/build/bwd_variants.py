"""Backward kernel variants (kernels/flash_bwd.cu): which instantiations exist, how to launch them.

Families (every one compiled for float16 and bfloat16):

* ``bwd_delta``      ``flash_bwd_delta<T>``: delta = rowsum(dO * O); any head dim (headdim 0 here).
* ``bwd_dkdv``       ``flash_bwd_dkdv<T, D, BM, BN, WARPS_D, true>``: dK, dV and dQ by fp32
  atomicAdd (the default, FlashAttention-2's scheme).
* ``bwd_dkdv_nodq``  the same kernel with ``DQ=false``: dK, dV only (dQ in a pass of its own:
  the deterministic mode, check=True, and the Hopper backward at head dim 256).
* ``bwd_dq``         ``flash_bwd_dq<T, D, BM, BN, WARPS_D>``: dQ without atomics (that pass); it
  also adds each row's sum of P when asked (attention_backward(check=True)).
* ``<family>_list`` for the three step families (``bwd_dkdv_list``, ``bwd_dkdv_nodq_list``,
  ``bwd_dq_list``): ``flash_bwd_dkdv_steps`` / ``flash_bwd_dq_steps``, the same tiles over a ring
  step's whole rectangle list in one launch (`burstcu.ops.cuda.params.step_group_lists`: grouped
  by key range for dK/dV, by query range for dQ), bit for bit what one launch a rectangle gives.
  A step of one rectangle keeps the per-rectangle kernel.
* ``<family>_careful`` for the six step families: CAREFUL = true (`variants.careful_variant`),
  run instead of the plain kernel for a block (a list: a step) with masked pairs when q, dO, K,
  V or delta could make a product there non-finite.
* ``bwd_dkdv_sm90`` / ``bwd_dkdv_nodq_sm90`` (tile table "sm_90a" only, compiled for sm_90a):
  ``flash_bwd_dkdv_sm90<T, D, BM, STAGES, DQ>`` of kernels/flash_bwd_sm90.cu (DQ 1: atomic dQ, 0:
  none), head dims 64, 128
  and 256: ``bwd_dkdv`` / ``bwd_dkdv_nodq`` on wgmma and TMA, 128 keys a block of threads (64 at
  d = 256; a producer warpgroup, two consumers). A block with masked pairs pairs it with the mma.sync
  ``bwd_dkdv_careful`` (or ``_nodq_careful``) twin, which runs when the inputs may hold Inf/NaN.
* ``bwd_dkdv_bulk_sm90`` (head dims 64 and 128): the same kernel with DQ 2, dQ added by bulk tensor
  reductions from a shared staging tile instead of atomics (``KernelOps.sm90_dq_adds = "bulk"``).
* ``bwd_dkdv_sm90_list`` / ``bwd_dkdv_nodq_sm90_list`` / ``bwd_dkdv_bulk_sm90_list``:
  ``flash_bwd_dkdv_steps_sm90``, the same
  kernel over a ring step's rectangle list in one launch (grouped by key range, tiles of its keys a
  block of threads), paired as a list with masked pairs is with ``bwd_dkdv_list_careful`` (or
  ``_nodq_list_careful``).

Native head dims are 32, 64, 96, 128 and 256; other multiples of 8 run the next native one with
zero padding (done by the caller). The tile table and the reasoning behind it are in the opening
comment of flash_bwd.cu: registers bind first (dK + dV take D/WARPS_D registers a thread, S and dP
take BM), then shared memory (163 KB a block on sm_80, 227 KB on sm_90, 99 KB on the "sm_86"
table: cc 8.6/8.7/8.9/12.x) bounds BN.
"""

from __future__ import annotations

from .variants import (ARCHS, CXX_TYPE, DTYPES, NATIVE_HEADDIMS, KernelVariant, LaunchConfig,
                       base_table, careful_variant)

SOURCE = "flash_bwd.cu"
SM90_SOURCE = "flash_bwd_sm90.cu"
SM90_DKDV_FAMILIES = {True: "bwd_dkdv_sm90", False: "bwd_dkdv_nodq_sm90"}  # by with_dq
SM90_DKDV_BULK = "bwd_dkdv_bulk_sm90"   # dQ by bulk tensor reductions (the kernel's DQ = 2)
SM90_BULK_HEADDIMS = (64, 128)          # its staging: a 64 x 64 fp32 block a consumer
SM90_DQ_BOX = (64, 32)                  # a reduction's box: 64 query rows x 32 fp32 head dims
SM90_DQ_ADDS = ("pairs", "singles", "bulk")   # KernelOps.sm90_dq_adds: how the Hopper kernel adds dQ
SM90_THREADS = 384   # a producer warpgroup and two consumer warpgroups
# (BM query rows a tile, BN keys a block of threads, STAGES of Q/dO) per head dim: S^T and dP^T
# take BM/2 registers a consumer thread each, dK and dV D/2 each (at D = 256 the two consumers
# split the head dims: 64 each, over 64 keys); a consumer's dQ block is 64 x 64 (64 x 128 at 256).
# Not measured on a GPU yet: the first table.
_SM90_DKDV_TILES = {64: (128, 128, 2), 128: (64, 128, 2), 256: (64, 64, 2)}
SM90_DKDV_HEADDIMS = tuple(_SM90_DKDV_TILES)
DELTA_THREADS = 128  # four warps, one (b, s, h) row each
DELTA_ROWS_PER_BLOCK = DELTA_THREADS // 32

# (BM query rows, BN key rows, WARPS_D) of the dK/dV kernel, per arch and head dim.
_DKDV_TILES = {
    "sm_80": {32: (64, 64, 1), 64: (64, 64, 1), 96: (32, 64, 1), 128: (32, 64, 1),
              256: (32, 64, 2)},
    # 99 KB a block: sm_80's tiles up to d = 128 (75 KB at most); d = 256 takes 16 query rows a
    # Q tile and 48 keys (6 warps): 87040 B with dS, 84736 B without (BM = 32 does not fit: the
    # two Q/dO stages alone are 67 KB; BN = 48 reads Q/dO a third less often than BN = 32).
    "sm_86": {32: (64, 64, 1), 64: (64, 64, 1), 96: (32, 64, 1), 128: (32, 64, 1),
              256: (16, 48, 2)},
    "sm_90": {32: (64, 128, 1), 64: (64, 128, 1), 96: (32, 128, 1), 128: (32, 128, 1),
              256: (32, 64, 2)},
}
# (BM, BN, WARPS_D) of the deterministic dQ kernel. sm_80 and sm_90 share one table (registers
# bind, not smem); the 99 KB table halves BN at d = 128 (104448 -> 69632 B) and at d = 256
# (135168 -> 101376 B, exactly the budget; BM stays 64 so K/V are streamed once per 64 queries).
_DQ_TILES_BIG = {32: (64, 64, 1), 64: (64, 64, 1), 96: (64, 32, 1), 128: (64, 64, 1),
                 256: (64, 32, 1)}
_DQ_TILES = {
    "sm_80": _DQ_TILES_BIG,
    "sm_86": {32: (64, 64, 1), 64: (64, 64, 1), 96: (64, 32, 1), 128: (64, 32, 1),
              256: (64, 16, 1)},
    # measured on an H100 (bench/gpu/tiles.py): d = 256 runs 1.24x faster with 128 query rows (8
    # warps, 251 registers); the other head dims' tiles and every dK/dV tile were already the
    # fastest candidate that passed the gate.
    "sm_90": {**_DQ_TILES_BIG, 256: (128, 32, 1)},
}

_PAD = 8  # elements of padding per shared-memory row (bank-conflict-free ldmatrix)
# a step family's rectangle-list twin: family + LIST_SUFFIX (bwd_dkdv_list, bwd_dq_list, ...)
LIST_SUFFIX = "_list"


def dkdv_smem_bytes(d: int, bm: int, bn: int, with_dq: bool, itemsize: int = 2) -> int:
    """K, V tiles (BN rows) + two stages of Q, dO (BM rows) + lse2, delta + dS (BN x BM) if dQ."""
    ld = d + _PAD
    elems = 2 * bn * ld + 4 * bm * ld + (bn * (bm + _PAD) if with_dq else 0)
    return elems * itemsize + 4 * bm * 4


def dq_smem_bytes(d: int, bm: int, bn: int, itemsize: int = 2) -> int:
    """Q, dO tiles (BM rows) + two stages of K, V (BN rows)."""
    return (2 * bm + 4 * bn) * (d + _PAD) * itemsize


def sm90_dkdv_smem_bytes(d: int, bm: int, bn: int, stages: int, with_dq: bool, bulk: bool = False) -> int:
    """Dynamic smem of flash_bwd_dkdv_sm90 (bwd90::Smem in flash_bwd_sm90.cu): 1024 B of alignment
    slack, K and V (BN x D), STAGES x (Q, dO: BM x D), dS (BM x BN) with dQ, the fp32 dQ staging
    (BM x D) with bulk dQ, STAGES x (lse2, delta: BM fp32 each, and the tile's 16-byte TileMeta),
    128 B of mbarriers."""
    return (1024 + 2 * bn * d * 2 + stages * 2 * bm * d * 2 + (bm * bn * 2 if with_dq else 0)
            + (bm * d * 4 if bulk else 0) + stages * (2 * bm * 4 + 16) + 128)


def sm90_dkdv_variant(dtype: str, d: int, with_dq: bool, listed: bool = False,
                      bulk: bool = False) -> KernelVariant:
    """The Hopper dK/dV step (family bwd_dkdv_sm90, bwd_dkdv_nodq_sm90 without dQ, or
    bwd_dkdv_bulk_sm90 with `bulk` dQ: head dims SM90_BULK_HEADDIMS) for (dtype, head dim in
    SM90_DKDV_HEADDIMS); `listed`: its rectangle-list twin flash_bwd_dkdv_steps_sm90 (family +
    LIST_SUFFIX) on the same tiles."""
    if d not in _SM90_DKDV_TILES or (bulk and d not in SM90_BULK_HEADDIMS):
        raise ValueError(f"the Hopper backward runs head dims {SM90_BULK_HEADDIMS if bulk else SM90_DKDV_HEADDIMS}"
                         f"{' with bulk dQ' if bulk else ''}, not {d}")
    bm, bn, stages = _SM90_DKDV_TILES[d]
    dq = 2 if bulk else int(with_dq)   # bwd90::kDqNone, kDqAtomic, kDqBulk
    kernel = "flash_bwd_dkdv_steps_sm90" if listed else "flash_bwd_dkdv_sm90"
    family = SM90_DKDV_BULK if bulk else SM90_DKDV_FAMILIES[with_dq]
    return KernelVariant(
        family=family + (LIST_SUFFIX if listed else ""), source=SM90_SOURCE,
        name=f"{kernel}<{CXX_TYPE[dtype]}, {d}, {bm}, {stages}, {dq}>",
        dtype=dtype, headdim=d,
        launch=LaunchConfig(threads=SM90_THREADS, block_m=bm, block_n=bn,
                            smem_bytes=sm90_dkdv_smem_bytes(d, bm, bn, stages, with_dq or bulk, bulk),
                            stages=stages),
        target="sm_90a")


def _dkdv(arch: str, dtype: str, d: int, with_dq: bool, listed: bool = False) -> KernelVariant:
    return dkdv_variant_for_tiles(dtype, d, *_DKDV_TILES[base_table(arch)][d], with_dq, listed)


def _dq(arch: str, dtype: str, d: int, listed: bool = False) -> KernelVariant:
    return dq_variant_for_tiles(dtype, d, *_DQ_TILES[base_table(arch)][d], listed)


def delta_variant(dtype: str) -> KernelVariant:
    """The delta kernel of `dtype` (head dim is a runtime argument, so headdim is 0)."""
    return KernelVariant(
        family="bwd_delta", source=SOURCE, name=f"flash_bwd_delta<{CXX_TYPE[dtype]}>",
        dtype=dtype, headdim=0,
        launch=LaunchConfig(threads=DELTA_THREADS, block_m=DELTA_ROWS_PER_BLOCK))


def backward_variants(arch: str) -> list[KernelVariant]:
    """Every backward instantiation for the tile table `arch` (one of ARCHS); "sm_90a" adds the
    Hopper dK/dV steps."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    out: list[KernelVariant] = []
    for dtype in DTYPES:
        out.append(delta_variant(dtype))
        for d in NATIVE_HEADDIMS:
            steps = [step for listed in (False, True)
                     for step in (_dkdv(arch, dtype, d, True, listed),
                                  _dkdv(arch, dtype, d, False, listed), _dq(arch, dtype, d, listed))]
            out += steps + [careful_variant(v) for v in steps]
        if arch == "sm_90a":
            out += [sm90_dkdv_variant(dtype, d, with_dq, listed) for d in SM90_DKDV_HEADDIMS
                    for with_dq in (True, False) for listed in (False, True)]
            out += [sm90_dkdv_variant(dtype, d, True, listed, bulk=True) for d in SM90_BULK_HEADDIMS
                    for listed in (False, True)]
    return out


def _check_tiles(d: int, bm: int, bn: int, warps_d: int) -> None:
    """The kernels' static_asserts: D % 32, (D / WARPS_D) % 16, BM % 16, BN % 16 all zero."""
    if (warps_d < 1 or d % 32 or d % warps_d or (d // warps_d) % 16 or bm % 16 or bn % 16
            or bm <= 0 or bn <= 0):
        raise ValueError(f"illegal backward tiles: D={d}, BM={bm}, BN={bn}, WARPS_D={warps_d}")


def dkdv_variant_for_tiles(dtype: str, d: int, bm: int, bn: int, warps_d: int,
                           with_dq: bool = True, listed: bool = False) -> KernelVariant:
    """A dK/dV variant with explicit tiles, outside any table (for tile searches such as
    bench/gpu/tiles.py); with a table's tiles this equals that table's variant. `listed`: the
    rectangle-list kernel flash_bwd_dkdv_steps (family ``<family>_list``) on the same tiles."""
    _check_tiles(d, bm, bn, warps_d)
    flag = "true" if with_dq else "false"
    family = "bwd_dkdv" if with_dq else "bwd_dkdv_nodq"
    kernel = "flash_bwd_dkdv_steps" if listed else "flash_bwd_dkdv"
    return KernelVariant(
        family=family + (LIST_SUFFIX if listed else ""), source=SOURCE,
        name=f"{kernel}<{CXX_TYPE[dtype]}, {d}, {bm}, {bn}, {warps_d}, {flag}>",
        dtype=dtype, headdim=d,
        launch=LaunchConfig(threads=(bn // 16) * warps_d * 32, block_m=bm, block_n=bn,
                            smem_bytes=dkdv_smem_bytes(d, bm, bn, with_dq)))


def dq_variant_for_tiles(dtype: str, d: int, bm: int, bn: int, warps_d: int,
                         listed: bool = False) -> KernelVariant:
    """A deterministic-dQ variant with explicit tiles, outside any table (see
    `dkdv_variant_for_tiles`); `listed`: flash_bwd_dq_steps (family ``bwd_dq_list``)."""
    _check_tiles(d, bm, bn, warps_d)
    kernel = "flash_bwd_dq_steps" if listed else "flash_bwd_dq"
    return KernelVariant(
        family="bwd_dq" + (LIST_SUFFIX if listed else ""), source=SOURCE,
        name=f"{kernel}<{CXX_TYPE[dtype]}, {d}, {bm}, {bn}, {warps_d}>",
        dtype=dtype, headdim=d,
        launch=LaunchConfig(threads=(bm // 16) * warps_d * 32, block_m=bm, block_n=bn,
                            smem_bytes=dq_smem_bytes(d, bm, bn)))
