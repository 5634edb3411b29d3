"""Host-side tensor maps (TMA descriptors) for the Hopper kernels (kernels/hopper.cuh, `TensorMap`).

`tensor_map(backend, ptr, dtype, dims, strides_bytes, box, swizzle)` describes a tiled view of a
global tensor and returns its 128 bytes as a NumPy array of 128 uint8 (what the kernel's params
struct holds, `burstcu.ops.cuda.params` field kind "tmap"), on both backends:

* ``"cupy"``: the driver's own encoding, `cuda.bindings.driver.cuTensorMapEncodeTiled` (needs a
  GPU of compute capability 9.0 or newer and its driver);
* ``"emulated"``: the CPU emulator's mirror `EmuTensorMap` (kernels/emu/emu_hopper.h), packed here
  field for field (`EMU_LAYOUT`; offsets in bytes, little-endian)::

      u64 magic        0    0x3150414d54554342 ("BCUTMAP1" little-endian)
      u64 base         8    address of element (0, ..., 0)
      u64 dims[5]      16   elements along dim i (dim 0 innermost); unused dims 1
      u64 strides[5]   56   bytes between consecutive indices of dim i; strides[0] = elem_bytes;
                            unused dims 0
      u32 box[5]       96   box size along dim i, in elements; unused dims 1
      u32 rank         116  1..5
      u32 elem_bytes   120  2 for float16 / bfloat16, 4 for float32
      u32 swizzle      124  0 none, 1 32B, 2 64B, 3 128B (the driver's CUtensorMapSwizzle values)

Both validate first with the rules the CUDA driver documents for cuTensorMapEncodeTiled
(`validate_tiled`), so a map the emulator accepts is one the driver accepts, and each violation
is a ValueError that names the rule. Fixed choices: element strides all 1, no interleave, L2
promotion 128 B (each box row is at most 128 bytes, one 128B-swizzle span: a larger promotion
would fetch bytes of the neighbouring head or head-dim half that this box does not read; CUTLASS's
TMA copies default to 128 B too), out-of-bound elements read as zeros (OOB fill NONE).

Encoded maps are memoized by their arguments (the last ENCODED_MAPS): the same arguments give the
same read-only array without a second driver call.

`tensor_map_4d_rows(backend, x, row_start, row_count, box_rows, box_cols=64, swizzle="128B")`: the
map the attention kernels use, of the rows [row_start, row_start + row_count) of a (B, S, H, D)
array: a box is `box_rows` rows x `box_cols` head-dim columns of one (batch, head), and the rows
past `row_count` read as zeros.
"""

from __future__ import annotations

import functools
import operator
import struct
from typing import Any, Sequence

import numpy as np

from ..base import dtype_name
from .params import data_ptr

BACKENDS = ("cupy", "emulated")
ELEM_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# swizzle name -> (CUtensorMapSwizzle value, bytes of the swizzle span; 0: none)
SWIZZLES = {"none": (0, 0), "32B": (1, 32), "64B": (2, 64), "128B": (3, 128)}
MAX_RANK = 5
MAX_DIM = 2 ** 32          # globalDim[i] <= 2^32
MAX_STRIDE = 2 ** 40       # globalStrides[i] < 2^40
STRIDE_ALIGN = 16          # globalStrides[i] % 16 == 0
ADDRESS_ALIGN = 16         # globalAddress % 16 == 0
MAX_BOX = 256              # 1 <= boxDim[i] <= 256
BOX_INNER_ALIGN = 16       # boxDim[0] * element bytes % 16 == 0 (interleave NONE)
MAP_BYTES = 128
ENCODED_MAPS = 256         # encoded maps kept (`_encoded`): 32 KB

EMU_MAGIC = 0x3150414D54554342  # b"BCUTMAP1" read as a little-endian u64
EMU_LAYOUT = struct.Struct("<QQ5Q5Q5IIII")  # EmuTensorMap, 128 bytes
assert EMU_LAYOUT.size == MAP_BYTES


def _ints(name: str, values: Sequence[Any]) -> list[int]:
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        raise ValueError(f"{name} must hold integers, not {list(values)!r}") from None


def validate_tiled(ptr: int, dtype: str, dims: Sequence[int], strides_bytes: Sequence[int],
                   box: Sequence[int], swizzle: str) -> tuple[int, list[int], list[int], list[int]]:
    """Check a tiled map against cuTensorMapEncodeTiled's documented requirements (element
    strides 1, interleave NONE); return (elem_bytes, dims, strides_bytes, box) as int lists.

    Raises ValueError naming the rule broken: dtype float16/bfloat16; rank 1..5; rank - 1 global
    strides and rank box sizes; the global address 16-byte aligned; every dim 1..2^32; every
    stride a multiple of 16 below 2^40; every box size 1..256; box[0] x element bytes a multiple
    of 16, and no more than the swizzle span (32, 64 or 128 bytes) when swizzled.
    """
    if dtype not in ELEM_BYTES:
        raise ValueError(f"dtype {dtype!r}: tensor maps here are for {', '.join(ELEM_BYTES)}")
    if swizzle not in SWIZZLES:
        raise ValueError(f"swizzle {swizzle!r}: choose from {', '.join(SWIZZLES)}")
    elem = ELEM_BYTES[dtype]
    dims, strides, box = _ints("dims", dims), _ints("strides_bytes", strides_bytes), _ints("box", box)
    ptr = operator.index(ptr)
    rank = len(dims)
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"rank {rank}: tensorRank must be 1..{MAX_RANK} (dims {dims})")
    if len(strides) != rank - 1:
        raise ValueError(f"{len(strides)} strides for rank {rank}: globalStrides has rank - 1 = "
                         f"{rank - 1} entries, the byte strides of dims 1..{rank - 1} (dim 0 is contiguous)")
    if len(box) != rank:
        raise ValueError(f"{len(box)} box sizes for rank {rank}: boxDim has one entry a dim")
    if ptr < 0 or ptr % ADDRESS_ALIGN:
        raise ValueError(f"global address {ptr:#x}: globalAddress must be {ADDRESS_ALIGN}-byte aligned")
    for i, n in enumerate(dims):
        if not 1 <= n <= MAX_DIM:
            raise ValueError(f"dims[{i}] = {n}: globalDim must be non-zero and at most 2^32")
    for i, s in enumerate(strides, start=1):
        if s < 0 or s % STRIDE_ALIGN:
            raise ValueError(f"stride of dim {i} = {s} B: globalStrides must be multiples of "
                             f"{STRIDE_ALIGN} bytes")
        if s >= MAX_STRIDE:
            raise ValueError(f"stride of dim {i} = {s} B: globalStrides must be less than 2^40")
    for i, b in enumerate(box):
        if not 1 <= b <= MAX_BOX:
            raise ValueError(f"box[{i}] = {b}: boxDim must be non-zero and at most {MAX_BOX}")
    inner = box[0] * elem
    if inner % BOX_INNER_ALIGN:
        raise ValueError(f"box[0] = {box[0]} elements = {inner} B: boxDim[0] x element size must be "
                         f"a multiple of {BOX_INNER_ALIGN} bytes")
    span = SWIZZLES[swizzle][1]
    if span and inner > span:
        raise ValueError(f"box[0] = {box[0]} elements = {inner} B: with swizzle {swizzle} the box's "
                         f"inner dimension must be at most the swizzle span, {span} bytes")
    return elem, dims, strides, box


def tensor_map(backend: str, ptr: int, dtype: str, dims: Sequence[int], strides_bytes: Sequence[int],
               box: Sequence[int], swizzle: str) -> np.ndarray:
    """The 128 bytes of a tiled tensor map, as a NumPy array of 128 uint8.

    `ptr`: address of element (0, ..., 0); `dims`: elements along each dim, innermost first;
    `strides_bytes`: byte strides of dims 1..rank-1 (dim 0 is contiguous); `box`: the box copied
    by one load, in elements, innermost first; `swizzle`: "none", "32B", "64B" or "128B".
    Raises ValueError (`validate_tiled`) before anything else; on "cupy", RuntimeError with the
    driver's error when it refuses the map anyway.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: choose from {', '.join(BACKENDS)}")
    elem, dims, strides, box = validate_tiled(ptr, dtype, dims, strides_bytes, box, swizzle)
    return _encoded(backend, int(ptr), dtype, elem, tuple(dims), tuple(strides), tuple(box), swizzle)


@functools.lru_cache(maxsize=ENCODED_MAPS)
def _encoded(backend: str, ptr: int, dtype: str, elem: int, dims: tuple, strides: tuple,
             box: tuple, swizzle: str) -> np.ndarray:
    """The encoded map of validated arguments, read-only. Memoized: a map is a function of its
    arguments alone (an address and a geometry, no tensor contents); a Hopper launch encodes three,
    and a ring's steps and a model's layers meet the same buffers again and again."""
    encode = {"cupy": _driver, "emulated": _emulated}[backend]
    raw = encode(ptr, dtype, elem, list(dims), list(strides), list(box), swizzle)
    raw.setflags(write=False)
    return raw


def _emulated(ptr: int, dtype: str, elem: int, dims: list[int], strides: list[int], box: list[int],
              swizzle: str) -> np.ndarray:
    """The emulator's map (emu_hopper.h reads EMU_LAYOUT)."""
    swizzle_value = SWIZZLES[swizzle][0]
    rank = len(dims)
    pad = MAX_RANK - rank
    raw = EMU_LAYOUT.pack(EMU_MAGIC, ptr, *dims, *([1] * pad), elem, *strides, *([0] * pad),
                          *box, *([1] * pad), rank, elem, swizzle_value)
    return np.frombuffer(raw, dtype=np.uint8).copy()


def _driver(ptr: int, dtype: str, elem: int, dims: list[int], strides: list[int], box: list[int],
            swizzle: str) -> np.ndarray:
    import ctypes

    from cuda.bindings import driver

    data_type = {"float16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                 "bfloat16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                 "float32": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[dtype]
    swizzle_enum = {"none": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
                    "32B": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
                    "64B": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
                    "128B": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle]
    (err,) = driver.cuInit(0)  # a no-op once CuPy has initialized the driver
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit failed: {err!r}")
    err, tmap = driver.cuTensorMapEncodeTiled(
        data_type, len(dims), ptr,
        [driver.cuuint64_t(n) for n in dims], [driver.cuuint64_t(s) for s in strides],
        [driver.cuuint32_t(b) for b in box], [driver.cuuint32_t(1) for _ in dims],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle_enum,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the map ({err!r}): dtype {dtype}, dims "
                           f"{dims}, strides {strides} B, box {box}, swizzle {swizzle}, address {ptr:#x}")
    raw = ctypes.string_at(tmap.getPtr(), MAP_BYTES)
    return np.frombuffer(raw, dtype=np.uint8).copy()


def tensor_map_4d_rows(backend: str, x, row_start: int, row_count: int, box_rows: int,
                       box_cols: int = 64, swizzle: str = "128B") -> np.ndarray:
    """The tensor map of rows [row_start, row_start + row_count) of a (B, S, H, D) array `x`.

    `x`: NumPy or CuPy, float16, bfloat16 or float32, last dim contiguous. The map has dims (D, row_count,
    H, B), byte strides x's (S, H, B) strides, base the address of x[0, row_start, 0, 0], and box
    (box_cols, box_rows, 1, 1): one load brings box_rows rows x box_cols columns of one (batch,
    head) at coordinates (column, row - row_start, head, batch); rows at or past row_count read as
    zeros. Raises ValueError for any other shape or layout, a row range outside x, or a map the
    driver's rules refuse. Memoized with its checks by x's address, dtype, shape and strides (a
    launch asks for three maps, mostly of buffers it met before).
    """
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"x must be a (B, S, H, D) array, not shape {getattr(x, 'shape', None)}")
    return _rows_map(backend, data_ptr(x), dtype_name(x), tuple(x.shape), tuple(x.strides),
                     operator.index(row_start), operator.index(row_count), box_rows, box_cols, swizzle)


@functools.lru_cache(maxsize=ENCODED_MAPS)
def _rows_map(backend: str, ptr: int, dtype: str, shape: tuple, strides_bytes: tuple, row_start: int,
              row_count: int, box_rows: int, box_cols: int, swizzle: str) -> np.ndarray:
    """tensor_map_4d_rows of the (B, S, H, D) array at `ptr` with these dtype, shape and byte
    strides."""
    B, S, H, D = (int(n) for n in shape)
    if dtype not in ELEM_BYTES:
        raise ValueError(f"x has dtype {dtype}: tensor maps here are for {', '.join(ELEM_BYTES)}")
    itemsize = ELEM_BYTES[dtype]
    if strides_bytes[3] != itemsize and D > 1:
        raise ValueError(f"x's last dim must be contiguous (stride {strides_bytes[3]} B, element "
                         f"{itemsize} B)")
    if row_start < 0 or row_count < 1 or row_start + row_count > S:
        raise ValueError(f"rows [{row_start}, {row_start + row_count}) are not a non-empty range of "
                         f"x's {S} rows")
    # a dim of one index is never stepped along: its stride is free (NumPy and CuPy may report
    # any value there), so such a dim gets the stride a C-contiguous x would have, rounded up to
    # the 16 bytes the driver requires
    contiguous = (S * H * D * itemsize, H * D * itemsize, D * itemsize)
    strides = [-(-c // STRIDE_ALIGN) * STRIDE_ALIGN if n == 1 else int(s)
               for n, s, c in zip((B, row_count, H), strides_bytes[:3], contiguous)]
    if min(strides) < 0:
        raise ValueError(f"x has a negative stride ({strides_bytes}): tensor maps need positive strides")
    base = ptr + row_start * int(strides_bytes[1])
    return tensor_map(backend, base, dtype, (D, row_count, H, B), (strides[1], strides[2], strides[0]),
                      (box_cols, box_rows, 1, 1), swizzle)


__all__ = ["BACKENDS", "EMU_LAYOUT", "EMU_MAGIC", "SWIZZLES", "tensor_map",
           "tensor_map_4d_rows", "validate_tiled"]
