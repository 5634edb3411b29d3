"""Host tensor maps (burstcu/ops/cuda/tensor_map.py): the driver's rules for cuTensorMapEncodeTiled,
checked on both backends before anything is encoded; the emulator's 128-byte mirror, field by
field; the (B, S, H, D) row maps of the Hopper kernels; and, on a GPU of compute capability 9.0 or
newer, the driver's own 128 bytes."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest

from burstcu.ops.cuda.params import data_ptr
from burstcu.ops.cuda.tensor_map import (EMU_MAGIC, SWIZZLES, tensor_map, tensor_map_4d_rows,
                                    validate_tiled)

BASE = 0x7F00_0000_1000  # 16-aligned
# a valid map: rows of 64 float16 (128 B) of a (4, 1000, 8, 64) tensor
GOOD = dict(ptr=BASE, dtype="float16", dims=(64, 1000, 8, 4), strides_bytes=(1024, 128, 1024000),
            box=(64, 128, 1, 1), swizzle="128B")


def emu_fields(raw: np.ndarray) -> dict:
    """The EmuTensorMap fields of 128 bytes, by the offsets of kernels/emu/emu_hopper.h."""
    b = raw.tobytes()
    assert len(b) == 128
    return {"magic": struct.unpack_from("<Q", b, 0)[0], "base": struct.unpack_from("<Q", b, 8)[0],
            "dims": struct.unpack_from("<5Q", b, 16), "strides": struct.unpack_from("<5Q", b, 56),
            "box": struct.unpack_from("<5I", b, 96), "rank": struct.unpack_from("<I", b, 116)[0],
            "elem_bytes": struct.unpack_from("<I", b, 120)[0], "swizzle": struct.unpack_from("<I", b, 124)[0]}


# ------------------------------------------------------------------------------------------------
# the driver's rules, on both backends

BAD = [  # (what changes, the words the error must contain)
    (dict(dtype="float64"), "dtype"),
    (dict(swizzle="16B"), "swizzle"),
    (dict(dims=(), strides_bytes=(), box=()), "tensorRank must be 1..5"),
    (dict(dims=(64, 2, 2, 2, 2, 2), strides_bytes=(128,) * 5, box=(64, 1, 1, 1, 1, 1)), "tensorRank must be 1..5"),
    (dict(strides_bytes=(1024, 128)), "rank - 1"),
    (dict(box=(64, 128, 1)), "boxDim has one entry a dim"),
    (dict(ptr=BASE + 8), "16-byte aligned"),
    (dict(ptr=-16), "16-byte aligned"),
    (dict(dims=(64, 0, 8, 4)), "globalDim must be non-zero"),
    (dict(dims=(64, 2 ** 32 + 1, 8, 4)), "at most 2^32"),
    (dict(strides_bytes=(1032, 128, 1024000)), "multiples of 16"),
    (dict(strides_bytes=(1024, -128, 1024000)), "multiples of 16"),
    (dict(strides_bytes=(1024, 128, 2 ** 40)), "less than 2^40"),
    (dict(box=(64, 0, 1, 1)), "boxDim must be non-zero"),
    (dict(box=(64, 257, 1, 1)), "at most 256"),
    (dict(box=(60, 128, 1, 1), swizzle="none"), "multiple of 16 bytes"),
    (dict(box=(64, 128, 1, 1), swizzle="64B"), "swizzle span, 64 bytes"),
    (dict(box=(32, 128, 1, 1), swizzle="32B"), "swizzle span, 32 bytes"),
    (dict(box=(128, 128, 1, 1), swizzle="128B"), "swizzle span, 128 bytes"),
    (dict(dims=(64.0, 1000, 8, 4)), "integers"),
]


@pytest.mark.parametrize("backend", ["emulated", "cupy"])
@pytest.mark.parametrize("change,words", BAD, ids=[w for _, w in BAD])
def test_every_rule_is_checked_before_encoding(backend, change, words):
    """The same ValueError on both backends, before the driver is touched (no GPU needed)."""
    with pytest.raises(ValueError, match=words.replace("^", r"\^")):
        tensor_map(backend, **{**GOOD, **change})


def test_the_limits_themselves_are_accepted():
    """Each bound at its largest allowed value passes the checks."""
    validate_tiled(0, "bfloat16", (2 ** 32, 1), (2 ** 40 - 16,), (8, 256), "none")   # 8 x 2 B = 16 B
    validate_tiled(16, "float16", (16,), (), (16,), "32B")                             # 32 B = the span
    validate_tiled(16, "float16", (32, 4), (64,), (32, 4), "64B")
    validate_tiled(16, "float16", (64, 4), (128,), (64, 4), "128B")
    validate_tiled(16, "float16", (64, 1, 1, 1, 1), (128, 128, 128, 128), (64, 1, 1, 1, 1), "none")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        tensor_map("numpy", **GOOD)


# ------------------------------------------------------------------------------------------------
# the emulator's mirror

def test_emulated_layout_field_by_field():
    raw = tensor_map("emulated", **GOOD)
    assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.shape == (128,)
    f = emu_fields(raw)
    assert f["magic"] == EMU_MAGIC == int.from_bytes(b"BCUTMAP1", "little")
    assert raw.tobytes()[:8] == b"BCUTMAP1"
    assert f["base"] == BASE
    assert f["dims"] == (64, 1000, 8, 4, 1)
    assert f["strides"] == (2, 1024, 128, 1024000, 0)
    assert f["box"] == (64, 128, 1, 1, 1)
    assert (f["rank"], f["elem_bytes"], f["swizzle"]) == (4, 2, 3)


@pytest.mark.parametrize("swizzle,value,inner", [("none", 0, 8), ("32B", 1, 16), ("64B", 2, 32),
                                                 ("128B", 3, 64)])
def test_emulated_swizzle_values_are_the_drivers(swizzle, value, inner):
    """0 none, 1 32B, 2 64B, 3 128B: CUtensorMapSwizzle's values (not the wgmma descriptor's)."""
    assert SWIZZLES[swizzle][0] == value
    raw = tensor_map("emulated", BASE, "bfloat16", (inner, 10), (4096,), (inner, 10), swizzle)
    assert emu_fields(raw)["swizzle"] == value


def test_emulated_rank_one_and_five():
    one = emu_fields(tensor_map("emulated", BASE, "float16", (64,), (), (64,), "128B"))
    assert one["dims"] == (64, 1, 1, 1, 1) and one["strides"] == (2, 0, 0, 0, 0)
    assert one["box"] == (64, 1, 1, 1, 1) and one["rank"] == 1
    five = emu_fields(tensor_map("emulated", BASE, "float16", (8, 2, 3, 4, 5), (16, 32, 96, 384),
                                 (8, 2, 1, 2, 1), "none"))
    assert five["dims"] == (8, 2, 3, 4, 5) and five["strides"] == (2, 16, 32, 96, 384)
    assert five["box"] == (8, 2, 1, 2, 1) and five["rank"] == 5


def test_encoded_maps_are_memoized_and_read_only(monkeypatch):
    """The same arguments give the same read-only bytes without encoding again; another address or
    geometry is another map; bad arguments are refused every time, cached or not."""
    from burstcu.ops.cuda import tensor_map as tm

    calls = []
    encode = tm._emulated
    monkeypatch.setattr(tm, "_emulated", lambda *a: calls.append(a) or encode(*a))
    tm._encoded.cache_clear()
    args = dict(GOOD, ptr=BASE + 4096)
    first = tensor_map("emulated", **args)
    again = tensor_map("emulated", **args)
    assert again is first and len(calls) == 1 and not first.flags.writeable
    with pytest.raises(ValueError):
        first[0] = 1
    other = tensor_map("emulated", **dict(args, ptr=BASE + 8192))
    assert len(calls) == 2 and emu_fields(other)["base"] == BASE + 8192 != emu_fields(first)["base"]
    taller = tensor_map("emulated", **dict(args, box=(64, 64, 1, 1)))
    assert len(calls) == 3 and emu_fields(taller)["box"][1] == 64
    for _ in range(2):
        with pytest.raises(ValueError, match="16"):
            tensor_map("emulated", **dict(args, ptr=BASE + 8))


# ------------------------------------------------------------------------------------------------
# row maps of (B, S, H, D) arrays

@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_rows_map_of_a_bshd_array(dtype):
    x = np.zeros((2, 300, 4, 128), dtype=dtype)
    f = emu_fields(tensor_map_4d_rows("emulated", x, 100, 150, 64))
    assert f["base"] == data_ptr(x) + 100 * 4 * 128 * 2
    assert f["dims"] == (128, 150, 4, 2, 1)
    assert f["strides"] == (2, 4 * 128 * 2, 128 * 2, 300 * 4 * 128 * 2, 0)
    assert f["box"] == (64, 64, 1, 1, 1)
    assert (f["rank"], f["elem_bytes"], f["swizzle"]) == (4, 2, 3)


def test_rows_map_of_float32_rows():
    """The Hopper backward's bulk dQ map: float32 (B, S, H, D) rows, boxes of 64 rows x 32 floats
    (128 bytes, the 128-byte swizzle's span); 48 floats a row would pass the span."""
    x = np.zeros((2, 300, 4, 128), np.float32)
    f = emu_fields(tensor_map_4d_rows("emulated", x, 100, 150, 64, box_cols=32))
    assert f["base"] == data_ptr(x) + 100 * 4 * 128 * 4
    assert f["strides"] == (4, 4 * 128 * 4, 128 * 4, 300 * 4 * 128 * 4, 0)
    assert f["box"] == (32, 64, 1, 1, 1) and (f["elem_bytes"], f["swizzle"]) == (4, 3)
    with pytest.raises(ValueError, match="swizzle span"):
        tensor_map_4d_rows("emulated", x, 100, 150, 64, box_cols=48)


def test_rows_map_of_a_strided_view():
    """A view (every other head of a larger array) keeps its own strides."""
    big = np.zeros((2, 64, 8, 64), np.float16)
    x = big[:, :, ::2, :]
    f = emu_fields(tensor_map_4d_rows("emulated", x, 0, 64, 128, swizzle="128B"))
    assert f["strides"][1:4] == (8 * 64 * 2, 2 * 64 * 2, 64 * 8 * 64 * 2)
    assert f["dims"][:4] == (64, 64, 4, 2) and f["box"][:2] == (64, 128)


def test_rows_map_of_size_one_dims_takes_contiguous_strides():
    """A dim of one index is never stepped: whatever stride NumPy reports there is replaced by
    a C-contiguous array's, rounded up to the 16 bytes the driver wants."""
    x = np.lib.stride_tricks.as_strided(np.zeros(64 * 16, np.float16), (1, 16, 1, 64), (2, 128, 2, 2))
    f = emu_fields(tensor_map_4d_rows("emulated", x, 0, 16, 16))
    assert f["strides"][:4] == (2, 128, 128, 16 * 128)
    y = np.lib.stride_tricks.as_strided(np.zeros(8 * 16, np.float16), (1, 16, 1, 8), (6, 16, 6, 2))
    f = emu_fields(tensor_map_4d_rows("emulated", y, 0, 16, 16, box_cols=8, swizzle="none"))
    assert f["strides"][:4] == (2, 16, 16, 256)   # H: D x 2 B = 16
    one_row = emu_fields(tensor_map_4d_rows("emulated", np.zeros((2, 1, 1, 8), np.float16), 0, 1, 16,
                                            box_cols=8, swizzle="none"))
    assert one_row["strides"][:4] == (2, 16, 16, 16)   # 16 B rows rounded; B's stride is its own


def test_rows_map_refusals():
    x = np.zeros((1, 32, 2, 64), np.float16)
    with pytest.raises(ValueError, match="rows"):
        tensor_map_4d_rows("emulated", x, 30, 4, 16)
    with pytest.raises(ValueError, match="rows"):
        tensor_map_4d_rows("emulated", x, 0, 0, 16)
    with pytest.raises(ValueError, match="dtype float64"):
        tensor_map_4d_rows("emulated", x.astype(np.float64), 0, 32, 16)
    with pytest.raises(ValueError, match="contiguous"):
        tensor_map_4d_rows("emulated", np.zeros((1, 32, 2, 128), np.float16)[..., ::2], 0, 32, 16)
    with pytest.raises(ValueError, match=r"\(B, S, H, D\)"):
        tensor_map_4d_rows("emulated", np.zeros((32, 64), np.float16), 0, 32, 16)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):   # a box row of 4 x 2 B
        tensor_map_4d_rows("emulated", x, 0, 32, 16, box_cols=4, swizzle="none")
    with pytest.raises(ValueError, match="multiples of 16"):   # D = 12: rows 24 B apart
        tensor_map_4d_rows("emulated", np.zeros((1, 32, 1, 12), np.float16), 0, 32, 16, box_cols=8,
                           swizzle="none")


# ------------------------------------------------------------------------------------------------
# the driver's encoding (a GPU of compute capability >= 9.0)

def _hopper_or_newer() -> bool:
    from burstcu.transport.bootstrap import gpu_usable

    if not gpu_usable():
        return False
    from burstcu.build.compile import compute_capability

    return compute_capability() >= 90


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper_or_newer(), reason="needs a CUDA GPU of compute capability 9.0 or newer")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_driver_encodes_128_bytes(dtype):
    import cupy

    x = cupy.zeros((2, 300, 4, 128), dtype=np.float16)   # bfloat16 maps read the same bytes
    raw = tensor_map("cupy", x.data.ptr, dtype, (128, 300, 4, 2), (1024, 256, 307200), (64, 64, 1, 1),
                     "128B")
    assert isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.shape == (128,)
    assert raw.any()                          # an encoding, not zeros
    assert raw.tobytes()[:8] != b"BCUTMAP1"   # the driver's, not the emulator's
    rows = tensor_map_4d_rows("cupy", x, 100, 150, 64)
    assert rows.shape == (128,) and rows.any()
