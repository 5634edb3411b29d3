"""The decode kernel family (kernels/flash_decode.cu): which instantiations exist.

* ``"decode"``: ``flash_decode_split<T, DPL, ROWS, NWARPS, STAGES>`` for T in {__half,
  __nv_bfloat16, float}, DPL in {1, 2, 4, 8} head-dim columns a lane (head dim <= 32 * DPL, the
  variant's `headdim`), ROWS query rows a block (32, or 16 at DPL = 8: at most 32 fp32
  accumulators a lane, ROWS / NWARPS rows a warp), NWARPS = 4, STAGES K/V tiles of BK = 32 keys
  in the cp.async ring: as many as fit KV_IN_FLIGHT bytes, 2 to 4. Dynamic shared memory
  (`smem_bytes`, the kernel's `decode::Layout`); a variant that does not fit the table's budget
  is left out (float32 at head dim 256 on sm_86: the launcher falls back to the array path).
* ``"decode_mma16"``, ``"decode_mma32"``, ``"decode_mma64"``: the tensor-core twin
  ``flash_decode_split_mma<T, DN, ROWS, BKM, NWARPS, STAGES>`` for T in {__half,
  __nv_bfloat16}, DN in {32, 64, 128, 256} (the variant's `headdim`), ROWS = 16, 32 or 64 query
  rows a block (the family's number: ROWS / 16 row tiles of 16, NWARPS / (ROWS / 16) warps of
  one key slice each a tile), NWARPS = 4, tiles of BKM = 64 keys (32 where 64-key tiles would
  pass sm_86's budget and a warp's slice of 32 is still a k16 multiple: DN = 256 at ROWS >= 32),
  STAGES from KV_IN_FLIGHT as above (`mma_smem_bytes`, the kernel's `decode::MmaLayout`). A
  variant over the table's budget is left out (DN = 256 at ROWS = 16 on sm_86: the launcher
  takes the next ROWS).
* ``"decode_combine"``: ``flash_decode_combine`` (fp32 in and out; `headdim` 0, dtype float32).
* ``"decode_merge"``: ``flash_decode_merge<TOut>``, the ranks' partials merged (fp32 in; its
  dtype the output's, `headdim` 0).
* ``"decode_finish"``: ``flash_decode_finish<TOut>``, one rank's decode ended in place of combine
  and merge (fp32 workspace in; its dtype the output's, `headdim` 0).
"""

from __future__ import annotations

from .variants import ARCHS, SMEM_PER_BLOCK, KernelVariant, LaunchConfig, base_table

SOURCE = "flash_decode.cu"
NWARPS = 4
BK = 32                 # decode::BK: keys a tile
COMBINE_THREADS = 128   # DECODE_COMBINE_THREADS in flash_decode.cu
KV_IN_FLIGHT = 65536    # bytes of K/V tiles a block's ring holds at most (STAGES from it)
_CXX = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
DPLS = (1, 2, 4, 8)


def rows_per_block(dpl: int) -> int:
    """Query rows a split block holds (ROWS): 32 fp32 accumulators a lane at most."""
    return 32 if dpl <= 4 else 16


def stage_bytes(dtype: str, dpl: int) -> int:
    """Bytes of one ring stage: a K and a V tile of BK rows padded by 16 bytes (decode::Layout)."""
    size = _ITEMSIZE[dtype]
    return 2 * BK * (32 * dpl * size + 16)


def stages_for(dtype: str, dpl: int) -> int:
    """STAGES: as many tiles as KV_IN_FLIGHT bytes hold, 2 to 4."""
    return max(2, min(4, KV_IN_FLIGHT // stage_bytes(dtype, dpl)))


def smem_bytes(dtype: str, dpl: int) -> int:
    """Dynamic shared memory of a split block (decode::Layout::BYTES): the ring, the fp32 query
    rows (ROWS x 32*DPL) and each warp's probabilities (ROWS x BK fp32 in all)."""
    rows = rows_per_block(dpl)
    return stages_for(dtype, dpl) * stage_bytes(dtype, dpl) + rows * 32 * dpl * 4 + rows * BK * 4


def split_variant(dtype: str, dpl: int) -> KernelVariant:
    rows, stages = rows_per_block(dpl), stages_for(dtype, dpl)
    name = f"flash_decode_split<{_CXX[dtype]}, {dpl}, {rows}, {NWARPS}, {stages}>"
    return KernelVariant("decode", SOURCE, name, dtype, 32 * dpl,
                         LaunchConfig(threads=32 * NWARPS, block_m=rows, block_n=BK,
                                      smem_bytes=smem_bytes(dtype, dpl), stages=stages))


MMA_DTYPES = ("float16", "bfloat16")
MMA_HEADDIMS = (32, 64, 128, 256)      # DN: the native head dims of the tensor-core twin
MMA_ROWS = (16, 32, 64)                # ROWS: query rows a block (families decode_mma<ROWS>)
MMA_FAMILY = "decode_mma"              # + ROWS


def mma_family(rows: int) -> str:
    return f"{MMA_FAMILY}{rows}"


def _mma_bytes(dn: int, rows: int, keys: int) -> int:
    """decode::MmaLayout::BYTES of a 16-bit T: the ring (+ the query rows past DN = 128)."""
    stage = 2 * keys * (dn + 8) * 2
    stages = max(2, min(4, KV_IN_FLIGHT // stage))
    return stages * stage + (rows * (dn + 8) * 2 if dn > 128 else 0)


def mma_keys(dn: int, rows: int) -> int:
    """BKM: keys a tile of the tensor-core twin, 64, or 32 where the 64-key tiles would not fit
    sm_86's budget and each of the NWARPS / (ROWS / 16) key slices still takes whole k16 steps."""
    slices = NWARPS // (rows // 16)
    if _mma_bytes(dn, rows, 64) > SMEM_PER_BLOCK["sm_86"] and (32 // slices) % 16 == 0:
        return 32
    return 64


def mma_stages(dn: int, rows: int) -> int:
    """STAGES of the tensor-core twin: as many tiles as KV_IN_FLIGHT bytes hold, 2 to 4."""
    return max(2, min(4, KV_IN_FLIGHT // (2 * mma_keys(dn, rows) * (dn + 8) * 2)))


def mma_smem_bytes(dn: int, rows: int) -> int:
    """Dynamic shared memory of a tensor-core twin's block (decode::MmaLayout::BYTES)."""
    return _mma_bytes(dn, rows, mma_keys(dn, rows))


def mma_variant(dtype: str, dn: int, rows: int) -> KernelVariant:
    keys, stages = mma_keys(dn, rows), mma_stages(dn, rows)
    name = f"flash_decode_split_mma<{_CXX[dtype]}, {dn}, {rows}, {keys}, {NWARPS}, {stages}>"
    return KernelVariant(mma_family(rows), SOURCE, name, dtype, dn,
                         LaunchConfig(threads=32 * NWARPS, block_m=rows, block_n=keys,
                                      smem_bytes=mma_smem_bytes(dn, rows), stages=stages))


def combine_variant() -> KernelVariant:
    return KernelVariant("decode_combine", SOURCE, "flash_decode_combine", "float32", 0,
                         LaunchConfig(threads=COMBINE_THREADS))


def merge_variant(out_dtype: str) -> KernelVariant:
    name = f"flash_decode_merge<{_CXX[out_dtype]}>"
    return KernelVariant("decode_merge", SOURCE, name, out_dtype, 0, LaunchConfig(threads=COMBINE_THREADS))


def finish_variant(out_dtype: str) -> KernelVariant:
    name = f"flash_decode_finish<{_CXX[out_dtype]}>"
    return KernelVariant("decode_finish", SOURCE, name, out_dtype, 0, LaunchConfig(threads=COMBINE_THREADS))


def decode_variants(arch: str) -> list[KernelVariant]:
    """Every decode-family variant of the tile table `arch` that fits its shared memory."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    budget = SMEM_PER_BLOCK[base_table(arch)]
    mma = [mma_variant(dt, dn, rows) for dt in MMA_DTYPES for rows in MMA_ROWS for dn in MMA_HEADDIMS
           if mma_smem_bytes(dn, rows) <= budget]
    return ([split_variant(dt, dpl) for dt in _CXX for dpl in DPLS if smem_bytes(dt, dpl) <= budget]
            + mma + [combine_variant()] + [merge_variant(dt) for dt in _CXX]
            + [finish_variant(dt) for dt in _CXX])
