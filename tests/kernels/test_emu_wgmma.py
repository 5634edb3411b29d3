"""Tests of the emulator's wgmma.mma_async math (kernels/emu/emu_wgmma.h: emu::wgmma_compute).

The C++ is called through a tiny extern "C" shim compiled here with g++ and loaded with ctypes.
Everything it is checked against is rebuilt in this file, separately, from the PTX ISA
("Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"):

* where element (mn, k) of a shared-memory operand lives: `canonical_offsets` evaluates the ISA's
  table of canonical layouts, written there in CuTe notation (shape:stride, in elements, composed
  with Swizzle<B,4,3> on the byte address), with a small CuTe-layout evaluator; `place` writes a
  logical matrix into a shared-memory byte image with it. The C++ decoder is written differently
  (closed-form addresses, see the top of emu_wgmma.h), and the ISA's own worked examples ("Exact
  layout" lines for MN-major bf16) are checked against this model and the C++ both;
* the tiles our attention kernel uses are also placed the way TMA writes them (the CUDA programming
  guide's 128-byte swizzle: 16-byte chunk x of row y lands at chunk x ^ (y % 8) for a 1024-byte
  aligned box), independently of both, and stepped through K with the kernel's descriptors;
* the register fragments (`a_pos`, `d_pos`) are the ISA's figures for .m64nNk16 as described there:
  warp w of the warpgroup owns rows 16w..16w+15, laid out like the mma.m16n8k16 fragments, whose
  tables the ISA gives as formulas (quoted below);
* results are compared with a float64 reference (products of f16/bf16 are exact in fp32; the fp32
  sums get rtol 1e-5 of the sum of |products|), and once bit for bit with fp32 sums in k order,
  the emulator's documented arithmetic.

Shared memory is filled with 0xFF (NaN in f16/bf16, as the emulator poisons it), so any read of a
byte the model did not write shows up as NaN. Nobody has checked the model against a GPU yet.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.emulated

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}
ELEM = {"f16": 0, "bf16": 1}
SWIZZLE_MODE = {0: 0, 128: 1, 64: 2, 32: 3}  # swizzle width in bytes -> descriptor bits 62-63

SHIM = r"""
#include "emu/emu_runtime.h"
#include "emu/emu_collectives.h"
#include "emu/emu_wgmma.h"
#include <cstdio>

extern "C" int wg_compute(int n, int elem, int a_in_regs, unsigned long long desc_a, unsigned long long desc_b,
                          int trans_a, int trans_b, int scale_d, const unsigned* a_regs, float* d, int d_stride,
                          int null_thread, const unsigned char* smem, size_t smem_size, char* err, size_t errlen) {
  emu::WgmmaOp op{n, elem ? emu::Elem::bf16 : emu::Elem::f16, a_in_regs != 0, desc_a, desc_b, trans_a, trans_b,
                  scale_d != 0};
  float* rows[128];
  for (int t = 0; t < 128; ++t) rows[t] = d ? d + size_t(t) * d_stride : nullptr;
  if (null_thread >= 0) rows[null_thread] = nullptr;
  const std::string msg = emu::wgmma_compute(op, reinterpret_cast<const emu::u32 (*)[4]>(a_regs),
                                             d ? rows : nullptr, smem, smem_size);
  snprintf(err, errlen, "%s", msg.c_str());
  return msg.empty() ? 0 : 1;
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("wgmma")
    src, so = out / "shim.cpp", out / "shim.so"
    src.write_text(SHIM)
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", str(KERNELS), "-DBURSTCU_EMU",
                    str(src), "-o", str(so)], check=True, capture_output=True, text=True)
    so_lib = ctypes.CDLL(str(so))
    f = so_lib.wg_compute
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong,
                  ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                  ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t]
    return so_lib


def call(lib, *, n, elem, smem, desc_b, d, a_regs=None, desc_a=0, trans_a=0, trans_b=0, scale_d=False,
         smem_size=None, null_thread=-1, pass_d=True, a_in_regs=None):
    """Runs wgmma_compute; returns the error message ('' on success). d (128 x n/2 float32) is updated.
    A comes from registers when a_regs is given (unless a_in_regs says otherwise)."""
    err = ctypes.create_string_buffer(512)
    regs = None if a_regs is None else np.ascontiguousarray(a_regs, np.uint32)
    in_regs = regs is not None if a_in_regs is None else a_in_regs
    assert d.dtype == np.float32 and d.flags.c_contiguous and d.shape[0] == 128
    rc = lib.wg_compute(n, ELEM[elem], int(in_regs), desc_a, desc_b, trans_a, trans_b, int(scale_d),
                        None if regs is None else regs.ctypes.data, d.ctypes.data if pass_d else None,
                        d.shape[1], null_thread, smem.ctypes.data, smem.size if smem_size is None else smem_size,
                        err, len(err))
    msg = err.value.decode()
    assert (rc == 0) == (msg == "")
    return msg


# ---------------------------------------------------------------------------------------------
# Descriptor (ISA "Matrix Descriptor Format"): bits 0-13 matrix-descriptor-encode(start address),
# 16-29 encode(LBO), 32-45 encode(SBO), 49-51 base offset, 62-63 swizzle (0 none, 1 128B, 2 64B,
# 3 32B), where matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4.

def encode(x: int) -> int:
    return (x & 0x3FFFF) >> 4


def desc(start: int, lbo: int, sbo: int, swizzle: int, base_offset: int = 0) -> int:
    return (encode(start) | encode(lbo) << 16 | encode(sbo) << 32 | base_offset << 49
            | SWIZZLE_MODE[swizzle] << 62)


# ---------------------------------------------------------------------------------------------
# Shared-memory layouts. ISA "Canonical Layouts" (T = 128 / element bits = 8 for f16/bf16; m, k:
# repeats of the pattern along MN and K; LBO, SBO in elements here):
#   MN-major, none/interleave : Swizzle<0,4,3> o ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))
#   MN-major, 32B             : Swizzle<1,4,3> o ((T,2,m),(8,k)):((1,T,LBO),(2T,SBO))
#   MN-major, 64B             : Swizzle<2,4,3> o ((T,4,m),(8,k)):((1,T,LBO),(4T,SBO))
#   MN-major, 128B            : Swizzle<3,4,3> o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))
#   K-major,  none/interleave : Swizzle<0,4,3> o ((8,m),(T,2k)):((1T,SBO),(1,LBO))
#   K-major,  32B             : Swizzle<1,4,3> o ((8,m),(T,2k)):((2T,SBO),(1,T))
#   K-major,  64B             : Swizzle<2,4,3> o ((8,m),(T,2k)):((4T,SBO),(1,T))
#   K-major,  128B            : Swizzle<3,4,3> o ((8,m),(T,2k)):((8T,SBO),(1,T))
# The first mode is the MN index (M of A, N of B), the second the K index (0..15 here). The swizzle
# acts on the byte address (CuTe swizzles the pointer): Swizzle<B,M,S>(x) = x ^ ((x & (2^B-1) <<
# (M+S)) >> S).

T = 8
SW_BITS = {0: 0, 32: 1, 64: 2, 128: 3}


def cute_eval(shape, stride, idx):
    """Offset of index idx (int array) in a CuTe mode: nested (shape, stride), first sub-mode fastest."""
    if isinstance(shape, int):
        return idx * stride
    off = np.zeros_like(idx)
    for i, (s, d) in enumerate(zip(shape, stride)):
        size = int(np.prod(flatten(s)))
        last = i == len(shape) - 1
        off = off + cute_eval(s, d, idx if last else idx % size)
        idx = idx // size
    return off


def flatten(s):
    return [s] if isinstance(s, int) else [x for y in s for x in flatten(y)]


def cute_swizzle(addr, b: int, m: int = 4, s: int = 3):
    mask = ((1 << b) - 1) << (m + s)
    return addr ^ ((addr & mask) >> s)


def canonical_layout(major: str, sw: int, rows: int, lbo_e: int, sbo_e: int):
    """The ISA's canonical (shape, stride) pair for an MN x 16 operand of 16-bit elements."""
    if major == "MN":
        w = max(sw // 16, 1)  # 16-byte units per swizzle row (1 for interleave)
        m = max(rows // (T * w), 1)
        if sw == 0:
            return ((T, 1, m), (8, 2)), ((1, T, sbo_e), (T, lbo_e))
        return ((T, w, m), (8, 2)), ((1, T, lbo_e), (w * T, sbo_e))
    m = rows // 8
    if sw == 0:
        return ((8, m), (T, 2)), ((T, sbo_e), (1, lbo_e))
    return ((8, m), (T, 2)), ((sw // 16 * T, sbo_e), (1, T))


def layout_addresses(shape, stride, rows: int, start: int, sw: int):
    """Byte address of every element (mn, k) of an MN x 16 operand: array [rows, 16]."""
    mn = np.arange(rows)[:, None].repeat(16, 1)
    k = np.arange(16)[None, :].repeat(rows, 0)
    off = cute_eval(shape[0], stride[0], mn) + cute_eval(shape[1], stride[1], k)
    return cute_swizzle(start + 2 * off, SW_BITS[sw])


def canonical_addresses(major, sw, rows, lbo, sbo, start):
    shape, stride = canonical_layout(major, sw, rows, lbo // 2, sbo // 2)
    return layout_addresses(shape, stride, rows, start, sw)


def place(smem: np.ndarray, mat: np.ndarray, addrs: np.ndarray) -> None:
    """Writes the 16-bit matrix mat [rows, 16] (MN x K) at byte addresses addrs [rows, 16]."""
    flat = addrs.ravel()
    assert len(np.unique(flat)) == flat.size, "test layout maps two elements to one address"
    bits = np.ascontiguousarray(mat).view(np.uint16).ravel()
    smem[flat] = (bits & 0xFF).astype(np.uint8)
    smem[flat + 1] = (bits >> 8).astype(np.uint8)


def poisoned(size: int) -> np.ndarray:
    return np.full(size, 0xFF, np.uint8)


# ---------------------------------------------------------------------------------------------
# Register fragments. ISA "Matrix Fragments for wgmma.mma_async.m64nNk16", Figures 148 (A) and 149
# (D): the warpgroup's 64 rows are 4 blocks of 16, block w held by warp w (threads 32w..32w+31), each
# block laid out like mma.m16n8k16, for which the ISA gives ("Matrix fragments for mma.m16n8k16 with
# floating point type", groupID = %laneid >> 2, threadID_in_group = %laneid % 4):
#   A: row = groupID for a_i where 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
#      col = threadID_in_group * 2 + (i & 0x1) for a_i where i < 4, ... + 8 for i >= 4
#   C/D: row = groupID for c_i where i < 2, groupID + 8 for i >= 2; col = threadID_in_group * 2 + (i & 0x1)
# and wgmma's D repeats the 16x8 C/D block N/8 times along N: d_{4j+i} is c_i of column block j.
# A's eight elements a0..a7 sit two to a .f16x2 register, a_{2r} in the low half of register r.

def a_pos(t: int, i: int) -> tuple[int, int]:
    warp, lane = divmod(t, 32)
    group, tig = lane >> 2, lane % 4
    row = group if (0 <= i < 2 or 4 <= i < 6) else group + 8
    col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
    return 16 * warp + row, col


def d_pos(t: int, i: int) -> tuple[int, int]:
    warp, lane = divmod(t, 32)
    group, tig = lane >> 2, lane % 4
    j, c = divmod(i, 4)
    return 16 * warp + (group if c < 2 else group + 8), 8 * j + tig * 2 + (c & 1)


@functools.lru_cache(maxsize=None)
def a_index():
    pos = np.array([[a_pos(t, i) for i in range(8)] for t in range(128)])
    return pos[..., 0], pos[..., 1]


@functools.lru_cache(maxsize=None)
def d_index(n: int):
    pos = np.array([[d_pos(t, i) for i in range(n // 2)] for t in range(128)])
    return pos[..., 0], pos[..., 1]


def pack_a(A: np.ndarray) -> np.ndarray:
    """64 x 16 f16/bf16 matrix -> the (128, 4) uint32 A registers of the rs form."""
    rows, cols = a_index()
    bits = np.ascontiguousarray(A).view(np.uint16).astype(np.uint32)[rows, cols]  # [128, 8]
    return bits[:, 0::2] | (bits[:, 1::2] << 16)


def pack_d(D: np.ndarray) -> np.ndarray:
    rows, cols = d_index(D.shape[1])
    return np.ascontiguousarray(D[rows, cols], np.float32)


def unpack_d(d: np.ndarray) -> np.ndarray:
    n = 2 * d.shape[1]
    rows, cols = d_index(n)
    D = np.full((64, n), np.nan, np.float32)
    D[rows, cols] = d
    return D


# ---------------------------------------------------------------------------------------------
# References

def rand16(rng, shape, elem, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(DTYPES[elem])


def assert_matches(got, A, Bt, D0=None, what=""):
    """got (64 x N) against A (64 x K) @ Bt.T (Bt: N x K) (+ D0) in float64, rtol 1e-5 of sum |terms|."""
    a, b = A.astype(np.float64), Bt.astype(np.float64)
    ref, bound = a @ b.T, np.abs(a) @ np.abs(b).T
    if D0 is not None:
        ref, bound = ref + D0, bound + np.abs(D0)
    assert np.all(np.isfinite(got)), f"{what}: non-finite results (read an unwritten byte?)"
    bad = np.abs(got - ref) > 1e-5 * bound + 1e-30
    assert not bad.any(), f"{what}: {bad.sum()} mismatches, first at {np.argwhere(bad)[0]}"


# ---------------------------------------------------------------------------------------------
# The fragment tables

def test_fragment_tables_match_isa(lib):
    # (thread, element) -> (row, col) pairs of Figures 148 / 149: per warp the mma.m16n8k16 layout,
    # warps stacked along M (the same pairs follow from CuTe's ALayout_64x16 / CLayout_64xN)
    assert a_pos(0, 0) == (0, 0) and a_pos(0, 1) == (0, 1)
    assert a_pos(0, 2) == (8, 0) and a_pos(0, 3) == (8, 1)
    assert a_pos(0, 4) == (0, 8) and a_pos(0, 6) == (8, 8)
    assert a_pos(1, 0) == (0, 2) and a_pos(4, 0) == (1, 0)
    assert a_pos(32, 0) == (16, 0) and a_pos(81, 5) == (36, 11)
    assert a_pos(127, 7) == (63, 15)
    assert [d_pos(0, i) for i in range(6)] == [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9)]
    assert d_pos(1, 0) == (0, 2) and d_pos(4, 0) == (1, 0) and d_pos(32, 0) == (16, 0)
    assert d_pos(127, 256 // 2 - 1) == (63, 255) and d_pos(127, 8 // 2 - 1) == (63, 7)
    # each table covers its matrix once
    assert len({a_pos(t, i) for t in range(128) for i in range(8)}) == 64 * 16
    assert len({d_pos(t, i) for t in range(128) for i in range(128)}) == 64 * 256
    # The C++ against them. A = 0..1023 (exact in f16); B = the 16 x 16 identity, in shared memory
    # K-major without swizzle (so D = A):
    A = np.arange(64 * 16, dtype=np.float64).reshape(64, 16).astype(np.float16)
    eye = np.eye(16).astype(np.float16)
    smem = poisoned(4096)
    place(smem, eye, canonical_addresses("K", 0, 16, 128, 256, 2048))
    d_desc = desc(2048, 128, 256, 0)
    # (1) A in shared memory: checks the D fragment alone
    place(smem, A, canonical_addresses("K", 0, 64, 1024, 128, 0))
    d = np.zeros((128, 8), np.float32)
    assert call(lib, n=16, elem="f16", smem=smem, desc_a=desc(0, 1024, 128, 0), desc_b=d_desc, d=d) == ""
    for t in range(128):
        for i in range(8):
            assert d[t, i] == A[d_pos(t, i)], (t, i)
    # (2) A in registers: with D known good, checks the A fragment
    regs = np.zeros((128, 4), np.uint32)
    bits = A.view(np.uint16)
    for t in range(128):
        for i in range(8):
            regs[t, i // 2] |= np.uint32(bits[a_pos(t, i)]) << (16 * (i % 2))
    d2 = np.zeros((128, 8), np.float32)
    assert call(lib, n=16, elem="f16", smem=smem, a_regs=regs, desc_b=d_desc, d=d2) == ""
    np.testing.assert_array_equal(d2, d)


# ---------------------------------------------------------------------------------------------
# Every (major, swizzle) for A in shared memory (plus the rs form) against every one for B

A_LAYOUTS = [("regs", 0)] + [(m, s) for m in ("K", "MN") for s in (0, 32, 64, 128)]
B_LAYOUTS = [(m, s) for m in ("K", "MN") for s in (0, 32, 64, 128)]


def choose_layout(major, sw, rows, variant, rng):
    """(lbo, sbo, offset of the start address from a 1024-aligned base) for an MN x 16 operand,
    non-overlapping, with the atoms in either order and some padding, per the canonical layouts."""
    if sw == 0:  # 128-byte core matrices
        groups = rows // 8
        if variant == 0:  # the two K halves far apart, 8-row/8-column groups adjacent
            return groups * 128 + 256, 128, 0
        return 128, 256 + 128, 0  # K halves adjacent, groups 384 bytes apart (padded)
    atom = 8 * sw  # one swizzle atom: 8 rows of sw bytes
    if major == "K":
        # LBO is unused ("assumed 1"): pass garbage in one variant. The start may sit any multiple of
        # 32 bytes into the swizzle row (the K-loop pattern): the XOR then uses the real address.
        lbo = 16 if variant == 0 else 0x3FF0
        return lbo, atom * (1 + variant), int(rng.integers(0, sw // 32)) * 32
    per_row = sw // 2
    blocks = max(-(-rows // per_row), 1)
    if variant == 0:  # MN blocks adjacent, then the second 8-row K group
        return atom, blocks * atom + atom, 0
    return 2 * atom, atom, 0  # K groups adjacent, MN blocks 2 atoms apart


@pytest.mark.parametrize("ib", range(len(B_LAYOUTS)), ids=[f"B-{m}-{s}" for m, s in B_LAYOUTS])
@pytest.mark.parametrize("ia", range(len(A_LAYOUTS)), ids=[f"A-{m}-{s}" for m, s in A_LAYOUTS])
def test_layouts(lib, ia, ib):
    a_major, a_sw = A_LAYOUTS[ia]
    b_major, b_sw = B_LAYOUTS[ib]
    n = (8, 64, 128, 256)[(ia + 2 * ib) % 4]
    elem = ("f16", "bf16")[(ia + ib) % 2]
    scale_d = bool((ia // 2 + ib) % 2)
    variant = (ia + ib // 2) % 2
    rng = np.random.default_rng(100 * ia + ib)
    A, Bt = rand16(rng, (64, 16), elem), rand16(rng, (n, 16), elem)
    D0 = rng.standard_normal((64, n)).astype(np.float32)

    smem = poisoned(1 << 17)
    kw = {}
    a_base = 1024
    if a_major == "regs":
        kw["a_regs"] = pack_a(A)
        b_base = 1024
    else:
        lbo, sbo, ofs = choose_layout(a_major, a_sw, 64, variant, rng)
        addrs = canonical_addresses(a_major, a_sw, 64, lbo, sbo, a_base + ofs)
        place(smem, A, addrs)
        kw.update(desc_a=desc(a_base + ofs, lbo, sbo, a_sw), trans_a=int(a_major == "MN"))
        b_base = (int(addrs.max()) // 1024 + 2) * 1024
    lbo, sbo, ofs = choose_layout(b_major, b_sw, n, 1 - variant, rng)
    addrs = canonical_addresses(b_major, b_sw, n, lbo, sbo, b_base + ofs)
    place(smem, Bt, addrs)
    size = int(addrs.max()) + 2
    d = pack_d(D0) if scale_d else np.full((128, n // 2), np.nan, np.float32)  # scale-d 0: D not read
    msg = call(lib, n=n, elem=elem, smem=smem[:size].copy(), desc_b=desc(b_base + ofs, lbo, sbo, b_sw),
               trans_b=int(b_major == "MN"), scale_d=scale_d, d=d, **kw)
    assert msg == ""
    assert_matches(unpack_d(d), A, Bt, D0 if scale_d else None, f"A {a_major}/{a_sw} B {b_major}/{b_sw} n={n}")


def test_k_order_fp32_bitwise(lib):
    """The documented arithmetic: 16 exact products added in k order in fp32 from +0, then D."""
    rng = np.random.default_rng(7)
    for elem, n in (("f16", 24), ("bf16", 200)):
        A, Bt = rand16(rng, (64, 16), elem, 8.0), rand16(rng, (n, 16), elem, 8.0)
        D0 = (rng.standard_normal((64, n)) * 100).astype(np.float32)
        smem = poisoned(1 << 15)
        place(smem, Bt, canonical_addresses("K", 128, n, 16, 1024, 0))
        d = pack_d(D0)
        assert call(lib, n=n, elem=elem, smem=smem, a_regs=pack_a(A), desc_b=desc(0, 16, 1024, 128), d=d,
                    scale_d=True) == ""
        s = np.zeros((64, n), np.float32)
        a32, b32 = A.astype(np.float32), Bt.astype(np.float32)
        for k in range(16):
            s = s + a32[:, k:k + 1] * b32[None, :, k]
        np.testing.assert_array_equal(unpack_d(d), s + D0)


# ---------------------------------------------------------------------------------------------
# The ISA's worked examples with 16-bit elements ("MN-Major, no-swizzling / 32B / 64B swizzling
# and bf16 type", Figures 168-170): the exact layout and the LBO / SBO encodings, as printed there.

ISA_EXAMPLES = [
    # (swizzle, exact layout (shape, stride) in elements, LBO encoding, SBO encoding)
    (0, (((8, 1, 2), (8, 2)), ((1, 8, 64), (8, 128))), 16, 8),
    (32, (((8, 2, 2), (8, 2)), ((1, 8, 128), (16, 256))), 16, 32),
    (64, (((8, 4, 2), (8, 2)), ((1, 8, 256), (32, 512))), 32, 64),
]


@pytest.mark.parametrize("sw,exact,lbo_enc,sbo_enc", ISA_EXAMPLES)
def test_isa_mn_major_examples(lib, sw, exact, lbo_enc, sbo_enc):
    shape, stride = exact
    n = int(np.prod(flatten(shape[0])))  # MN extent: 16, 32, 64
    start = 4096
    addrs = layout_addresses(shape, stride, n, start, sw)
    # the model's canonical table gives the same addresses for these parameters
    np.testing.assert_array_equal(addrs, canonical_addresses("MN", sw, n, lbo_enc * 16, sbo_enc * 16, start))
    rng = np.random.default_rng(sw)
    A, Bt = rand16(rng, (64, 16), "bf16"), rand16(rng, (n, 16), "bf16")
    smem = poisoned(8192)
    place(smem, Bt, addrs)
    b_desc = encode(start) | lbo_enc << 16 | sbo_enc << 32 | SWIZZLE_MODE[sw] << 62
    d = np.zeros((128, n // 2), np.float32)
    assert call(lib, n=n, elem="bf16", smem=smem, a_regs=pack_a(A), desc_b=b_desc, trans_b=1, d=d) == ""
    assert_matches(unpack_d(d), A, Bt, None, f"ISA example {sw}")


# ---------------------------------------------------------------------------------------------
# Our attention kernel's tiles, placed as TMA writes them and stepped as the kernel steps them.

def tma_sw128(smem: np.ndarray, mat: np.ndarray, base: int) -> int:
    """Writes mat [rows, cols] (cols a multiple of 64) as [cols/64 blocks][rows][64] with the 128B
    swizzle (CUDA programming guide: chunk x of row y at chunk x ^ (y % 8), base 1024-aligned).
    Returns the end address."""
    assert base % 1024 == 0
    rows, cols = mat.shape
    r = np.arange(rows)[:, None, None]
    blk = np.arange(cols // 64)[None, :, None]
    c = np.arange(64)[None, None, :]
    addr = base + blk * (rows * 128) + r * 128 + (((c // 8) ^ (r % 8)) * 16) + (c % 8) * 2
    bits = np.ascontiguousarray(mat).view(np.uint16).reshape(rows, cols // 64, 64)
    smem[addr] = (bits & 0xFF).astype(np.uint8)
    smem[addr + 1] = (bits >> 8).astype(np.uint8)
    return base + rows * cols * 2


@pytest.mark.parametrize("D,BN,elem", [(64, 128, "bf16"), (128, 128, "f16"), (128, 176, "bf16"), (256, 64, "f16")])
def test_kernel_qk(lib, D, BN, elem):
    """S = Q K^T: Q (64 x D) and K (BN x D) K-major, 128B swizzle, [D/64][rows][64]; SBO 1024, LBO 16,
    k16 step kk: start + (kk / 4) * rows * 128 + (kk % 4) * 32."""
    rng = np.random.default_rng(D + BN)
    Q, K = rand16(rng, (64, D), elem), rand16(rng, (BN, D), elem)
    smem = poisoned(1 << 17)
    q_base = 0
    k_base = tma_sw128(smem, Q, q_base)
    end = tma_sw128(smem, K, k_base)
    smem = smem[:end].copy()
    d = np.full((128, BN // 2), np.nan, np.float32)
    for kk in range(D // 16):
        da = desc(q_base + (kk // 4) * 64 * 128 + (kk % 4) * 32, 16, 1024, 128)
        db = desc(k_base + (kk // 4) * BN * 128 + (kk % 4) * 32, 16, 1024, 128)
        assert call(lib, n=BN, elem=elem, smem=smem, desc_a=da, desc_b=db, d=d, scale_d=kk > 0) == ""
    assert_matches(unpack_d(d), Q, K, None, "Q K^T")


@pytest.mark.parametrize("D,BN,p_in_regs", [(64, 128, True), (128, 128, True), (128, 64, False), (256, 128, True)])
def test_kernel_pv(lib, D, BN, p_in_regs):
    """O = P V: V (BN x D) N-major (trans-b 1), 128B swizzle, [D/64][BN][64]; LBO = BN * 128 (next 64
    columns), SBO = 1024 (next 8 key rows), k16 step kk: start + kk * 2048. P from registers (rs form)
    or from shared memory laid out like Q."""
    elem = "bf16"
    rng = np.random.default_rng(D * 3 + BN)
    P, V = rand16(rng, (64, BN), elem), rand16(rng, (BN, D), elem)
    smem = poisoned(1 << 17)
    v_base = 0
    p_base = tma_sw128(smem, V, v_base)
    end = tma_sw128(smem, P, p_base) if not p_in_regs else p_base
    smem = smem[:end].copy()

    def run(lbo):
        d = np.full((128, D // 2), np.nan, np.float32)
        for kk in range(BN // 16):
            kw = {}
            if p_in_regs:
                kw["a_regs"] = pack_a(P[:, 16 * kk:16 * kk + 16])
            else:
                kw["desc_a"] = desc(p_base + (kk // 4) * 64 * 128 + (kk % 4) * 32, 16, 1024, 128)
            db = desc(v_base + kk * 2048, lbo, 1024, 128)
            assert call(lib, n=D, elem=elem, smem=smem, desc_b=db, trans_b=1, d=d, scale_d=kk > 0, **kw) == ""
        return unpack_d(d)

    assert_matches(run(BN * 128), P, V.T, None, "P V")
    if D > 64:  # the LBO matters: a wrong one reads the wrong column block
        wrong = run(1024)
        ref = P.astype(np.float64) @ V.astype(np.float64)
        assert not np.allclose(wrong, ref, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------
# Errors: a message, never an abort, and d left alone

def test_errors(lib):
    rng = np.random.default_rng(3)
    smem = poisoned(16384)
    place(smem, rand16(rng, (64, 16), "f16"), canonical_addresses("K", 128, 64, 16, 1024, 0))  # 8 KiB
    regs = pack_a(rand16(rng, (64, 16), "f16"))
    good_b = desc(0, 16, 1024, 128)
    d0 = rng.standard_normal((128, 32)).astype(np.float32)

    def err(**kw):
        d = d0.copy()
        args = dict(n=64, elem="f16", smem=smem, desc_b=good_b, d=d, a_regs=regs, scale_d=True)
        args.update(kw)
        msg = call(lib, **args)
        np.testing.assert_array_equal(d, d0)  # untouched on error
        return msg

    d = d0.copy()
    assert call(lib, n=64, elem="f16", smem=smem, desc_b=good_b, d=d, a_regs=regs) == ""

    # reads past the end of shared memory
    assert "past the 16384 bytes" in err(desc_b=desc(12288, 16, 1024, 128))
    assert "past the 8000 bytes" in err(smem_size=8000)
    assert "past the" in err(a_regs=None, desc_a=desc(10240, 16, 1024, 128))
    assert "past the" in err(desc_b=desc(12288, 128, 1024, 0), trans_b=1)  # MN-major, no swizzle
    # imm-trans-a exists only with A in shared memory
    assert "imm-trans-a" in err(trans_a=1)
    assert "imm-trans-b" in err(trans_b=2)
    # shape
    for n in (0, 4, 12, 264):
        assert "multiple of 8" in err(n=n)
    # descriptor fields
    assert "base offset 3" in err(desc_b=good_b | 3 << 49)
    assert "reserved" in err(desc_b=good_b | 1 << 14)
    assert "reserved" in err(desc_b=good_b | 1 << 46)
    # a K-major 32-byte run straddling a 128-byte swizzle row (a +16 B step)
    assert "cross" in err(desc_b=desc(112, 16, 1024, 128))
    assert "cross" in err(desc_b=desc(16, 16, 256, 32))
    # an MN-major 64-element run that does not start at a swizzle row
    assert "cross" in err(desc_b=desc(64, 1024, 1024, 128), trans_b=1)
    # missing inputs
    assert "no A registers" in err(a_regs=None, a_in_regs=True)
    assert "thread 5" in err(null_thread=5)
    assert "no accumulator" in err(pass_d=False)
