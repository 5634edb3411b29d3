// emu_wgmma.h — what one Hopper `wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}.{f16,bf16}`
// computes, for the emulator: descriptor decoding, the canonical shared-memory layouts (K-major /
// MN-major; no, 32, 64 or 128-byte swizzle), the register fragments, and the arithmetic.
// This file is only the math: a pure function of the gathered inputs of the 128 threads of a
// warpgroup. The asynchronous side (issue / fence / commit / wait) is in emu_hopper.h, which calls
// wgmma_compute() when a wgmma-group is waited for.
//
// Source: the PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions"
// (9.7.15 in ISA 8.x/9.x): "Register Fragments and Shared Memory Matrix Layouts", "Shared Memory
// Matrix Layout" (swizzle-atom table, "Major-ness supported by Strides", "Canonical Layouts" and
// their worked bf16 examples) and "Matrix Descriptor Format". Cross-checked (read, nothing copied)
// against CUTLASS/CuTe (include/cute/atom/mma_traits_sm90_gmma.hpp: make_gmma_desc, the
// Layout_{K,MN}_SW*_Atom definitions, CLayout_64xN / ALayout_64x16) and ThunderKittens
// (include/types/shared/descriptor.cuh). No GPU has checked this file yet.
//
// =================================================================================================
// FOR THE KERNEL AUTHOR: descriptors for our attention tiles (16-bit elements, tile bases 1024-byte
// aligned in shared memory, swizzle mode field = 1 (128B), base offset 0)
//
//   Q (A operand of S = Q K^T) and K (B operand of S), K-major (imm-trans-a = imm-trans-b = 0),
//   stored as [D/64 column blocks][R rows][64 elements] with the 128-byte swizzle (what TMA writes
//   with a 64-element-wide box and CU_TENSOR_MAP_SWIZZLE_128B; R = 64 for a Q warpgroup slice,
//   BLOCK_N for K):
//       SBO = 1024 bytes (8 rows x 128 B: from rows 0-7 to rows 8-15), encoded 64
//       LBO = unused for swizzled K-major (the ISA says "assumed 1"): pass 16 bytes, encoded 1
//       k16 step kk = 0 .. D/16-1:  start = base + (kk / 4) * (R * 128) + (kk % 4) * 32 bytes
//       (4 steps of 32 B walk one 128-byte swizzle row; then jump to the next column block).
//
//   V (B operand of O = P V), N-major (imm-trans-b = 1), stored as [D/64 column blocks]
//   [BLOCK_N key rows][64 elements] with the 128-byte swizzle (each column block is BLOCK_N rows x
//   128 B; the key index is K of this product, the head dimension is N):
//       LBO = BLOCK_N * 128 bytes (from N = 0..63 to N = 64..127: the next column block), encoded
//             BLOCK_N * 8 (only read when N > 64; fits the 14-bit field for BLOCK_N <= 2047)
//       SBO = 1024 bytes (from key rows 0-7 to key rows 8-15 of one k16 step), encoded 64
//       k16 step kk = 0 .. BLOCK_N/16-1:  start = base + kk * 2048 bytes (16 key rows x 128 B)
//   This is what CuTe's make_gmma_desc<Major::MN> derives for that layout (for SW128 it takes LBO
//   from the stride between 64-element MN blocks and SBO from the stride between 8-row K groups)
//   and what ThunderKittens uses for an MN-major 128B tile (LBO = rows * 128, SBO = 1024, +2048 per
//   k16 chunk).
// =================================================================================================
//
// Matrix descriptor (64 bits; "matrix-descriptor-encode(x) = (x & 0x3FFFF) >> 4"):
//   bits  0-13  start address >> 4     bits 16-29  LBO >> 4     bits 32-45  SBO >> 4
//   bits 49-51  base offset            bits 62-63  swizzle: 0 none, 1 128B, 2 64B, 3 32B
//   Other bits are reserved. This emulator rejects a descriptor with a reserved bit set (on the
//   GPU they are presumably ignored, but a set bit here almost always means an offset added to a
//   descriptor carried out of a field, e.g. a start address past 256 KiB into bit 14).
//   Base offset: the ISA says it is 0 when the swizzle's repeating pattern starts at a 1024 (128B),
//   512 (64B) or 256 (32B) byte boundary, and otherwise (pattern start address >> 7) & 7; it does
//   not say exactly how the hardware combines it with the address bits (whether the row phase
//   becomes (addr >> 7) - base or + base). CuTe always writes 0, ThunderKittens never sets it, and
//   so do we: a non-zero base offset is rejected as unsupported rather than guessed at.
//
// Shared addresses: the emulator's shared address is the byte offset from the start of dynamic
// shared memory, and that start is 1024-byte aligned in the GPU's shared window, so swizzling the
// offset's bits gives the same permutation as swizzling the hardware address.
//
// ---- The canonical layouts -----------------------------------------------------------------------
// Terms (ISA): a "core matrix"/swizzle row unit is 16 bytes (T = 8 sixteen-bit elements). K-major
// means the 16 K values of one row of A (or one column of B) are contiguous; MN-major means M
// (or N) values are contiguous. B is addressed by (n, k): K-major B is stored like the rows of
// B^T, which is how K (of Q K^T) lies in memory.
// "Major-ness supported by strides" and the ISA's CuTe-notation table, in bytes, for 16-bit elements
// (mn = the M index of A or the N index of B, k = 0..15, W = swizzle width in bytes):
//
//   K-major, no swizzle ("interleave"): 8x16-byte core matrices, each 128 contiguous bytes.
//       addr = start + (mn / 8) * SBO + (mn % 8) * 16 + (k / 8) * LBO + (k % 8) * 2
//       (SBO: between 8-row groups along M/N; LBO: between the two 8-element K halves.)
//   K-major, W = 32/64/128: a swizzle atom is 8 rows of W bytes; the 16 K values (32 bytes) of a
//       row lie inside one W-byte row, so LBO is not used.
//       addr = start + (mn / 8) * SBO + (mn % 8) * W + k * 2
//   MN-major, no swizzle: core matrix = 8 K rows x 8 contiguous MN elements (128 bytes).
//       addr = start + (mn / 8) * SBO + (mn % 8) * 2 + (k / 8) * LBO + (k % 8) * 16
//       (here SBO steps along M/N and LBO along K: the roles are the "interleave" row of the table)
//   MN-major, W = 32/64/128: a swizzle atom is 8 K rows of W bytes = W/2 MN elements each.
//       addr = start + (mn / (W/2)) * LBO + (mn % (W/2)) * 2 + (k / 8) * SBO + (k % 8) * W
//       (LBO steps to the next W/2 MN elements, SBO to the next 8 K rows.)
//   Ambiguity: older ISA text (and many blogs) defines LBO as "the distance between adjacent core
//   matrices in the K dimension" and SBO as "... in the M or N dimension". That is right for K-major
//   and for MN-major without swizzle, but for swizzled MN-major the current ISA ("Leading dimension
//   byte offset ... MN-Major, swizzled layouts: offset from the first (swizzle-byte-size/16) rows to
//   the next (swizzle-byte-size/16) rows"; canonical ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) for
//   128B; worked example "MN-major, 64B swizzling, bf16": LBO = 256 elements between the two
//   32-element MN blocks, SBO = 512 elements between the two 8-row K groups) swaps them, and CuTe's
//   make_gmma_desc<Major::MN> does the same (LBO = MN-block stride, SBO = K-group stride for
//   swizzled layouts, the other way round for interleave). We follow the current ISA and CuTe.
//
// Swizzle (CuTe Swizzle<B,4,3> with B = 1, 2, 3 for 32/64/128B, per the ISA's canonical table):
// applied to the final byte ADDRESS, not to an offset from the start address:
//       phys = addr ^ (((addr >> 7) & (W/16 - 1)) << 4)
// i.e. the 16-byte chunk index (address bits 4..) is XORed with address bits 7.. (the 128-byte line
// index within the 1024 / 512 / 256-byte repeating pattern). Note for 64B and 32B: the XOR comes
// from the 128-byte line (bits 7-8, bit 7), not from the index of the 64- or 32-byte row, so two
// (four) consecutive 64-byte (32-byte) rows share one XOR value; a pattern is 8 rows of W bytes
// only for 128B. That is what Swizzle<2,4,3> / Swizzle<1,4,3> say. This matches the TMA swizzle modes
// (CUDA programming guide: the pattern's offset is (smem_ptr / 128) % 8, % 4, % 2) and CuTe's
// swizzle pointers, which swizzle the pointer value. It is why a K-major 128B tile can be stepped
// along K by adding 32 bytes to the start address: the row's chunk index becomes 2 + c, and the XOR
// with the row's line bits is still taken from the real address. Because of this, a start address
// that is not pattern-aligned is well defined here; what is not defined is a contiguous run that
// crosses a W-byte row: the 32-byte K run of a K-major row (start % W + 32 > W), or the
// min(MN, W/2) * 2-byte MN run of an MN-major row. Both are rejected (e.g. a k-step of +16 B).
//
// Legal combinations (ISA: "The transpose operation is only supported for the wgmma.mma_async
// variants with .f16/.bf16 types on matrices accessed from shared memory using matrix
// descriptors"): for f16/bf16 both K-major and MN-major, with any of the four swizzle modes, are
// legal for A in shared memory and for B. With A in registers there is no imm-trans-a (the "rs"
// form has only imm-trans-b), so trans_a != 0 with a_in_regs is an error. tf32 / fp8 / int8 / b1
// (K-major only), the .f16 accumulator, sparse wgmma and imm-scale-a/b = -1 are not modelled:
// WgmmaOp has no fields for them.
//
// ---- Register fragments (ISA Figures "WGMMA .m64nNk16 register fragment layout for matrix A" and
// "... for accumulator matrix D") -------------------------------------------------------------------
// Thread t of the warpgroup (t = 0..127), warp w = t / 32, lane l = t % 32, g = l / 4 (groupID),
// q = l % 4 (threadID_in_group). Each warp owns rows 16w .. 16w+15, laid out exactly as the 16-row
// fragments of mma.m16n8k16 (whose A and C/D tables the ISA gives as formulas):
//   A in registers (a0..a7, two per .f16x2 register, the lower-numbered element in the low 16 bits):
//       a_i: row 16w + g + 8 * ((i >> 1) & 1), col 2q + (i & 1) + 8 * (i >> 2)
//       so register r (= a_{2r}, a_{2r+1}) holds row 16w + g + 8 * (r & 1), cols 2q, 2q+1 (+8 for r >= 2)
//   D (N/2 f32 registers d0..): d_{4j+i}: row 16w + g + 8 * (i >> 1), col 8j + 2q + (i & 1)
// These agree with CuTe's ALayout_64x16 (((4,8,4),(2,2,2)):((128,1,16),(64,8,512)) over a 64x16
// column-major index) and CLayout_64xN (((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512))), which
// decode to the same formulas. The two figures are images (not viewable where this was written);
// their structure as the ISA text and third-party transcriptions describe it — each warp's 16 rows
// are the mma.m16n8k16 A (resp. C/D) fragment, warps stacked along M — gives the same pairs, e.g.
// T0: a0 (0,0), a1 (0,1), a2 (8,0), a4 (0,8); T32 a0 (16,0); T127 a7 (63,15); T0 d0..d3 (0,0) (0,1)
// (8,0) (8,1), d4 (0,8); T127 d_{N/2-1} (63, N-1). tests/kernels/test_emu_wgmma.py checks these.
//
// ---- Arithmetic -------------------------------------------------------------------------------------
// D[m][n] = sum_k A[m][k] * B[k][n] (+ D[m][n] when scale-d is true). The product of two f16 or two
// bf16 values is exact in fp32 (except that a bf16 x bf16 product can leave fp32's exponent range);
// the emulator adds the 16 products in k order in fp32, starting from +0, then adds D — the same
// contract as compute_mma in emu_collectives.h. The tensor core's summation order, internal
// precision and rounding are not documented, so results can differ from the GPU in the last bits.
#pragma once

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "emu_collectives.h"  // f16_to_f32 / bf16_to_f32; u32 / u64 / Elem / fmt via emu_runtime.h

#pragma GCC visibility push(hidden)

namespace emu {

struct WgmmaOp {
  int n;           // N of m64nNk16: a multiple of 8, 8..256
  Elem elem;       // f16 or bf16 inputs, f32 accumulate
  bool a_in_regs;  // A from registers (the "rs" form) or from shared memory (descriptor)
  u64 desc_a;      // the A descriptor when !a_in_regs
  u64 desc_b;      // the B descriptor
  int trans_a;     // imm-trans-a (0: K-major, 1: M-major); only with A in shared memory
  int trans_b;     // imm-trans-b (0: K-major, 1: N-major)
  bool scale_d;    // false: D = A*B ; true: D = A*B + D
};

namespace wgmma_detail {

struct Desc {
  u64 start;    // byte address (offset into dynamic shared memory)
  u64 lbo, sbo; // bytes
  int swizzle;  // width of a swizzle row in bytes: 0 (none), 32, 64 or 128
};

inline const char* swizzle_name(int w) {
  return w == 128 ? "128B" : w == 64 ? "64B" : w == 32 ? "32B" : "no";
}

inline std::string decode(u64 v, const char* name, Desc* d) {
  const u64 reserved = (3ull << 14) | (3ull << 30) | (7ull << 46) | (0x3ffull << 52);
  if (v & reserved)
    return fmt("wgmma: %s descriptor 0x%016llx has reserved bits set (0x%016llx): bits 14-15, 30-31, 46-48 and "
               "52-61 must be 0 (an offset carried out of the start/LBO/SBO field?)",
               name, v, v & reserved);
  const int base_offset = int((v >> 49) & 7);
  if (base_offset)
    return fmt("wgmma: %s descriptor 0x%016llx has base offset %d: only 0 is supported by the emulator (the swizzle "
               "pattern must start at a 1024/512/256-byte boundary)",
               name, v, base_offset);
  static const int widths[4] = {0, 128, 64, 32};
  d->start = (v & 0x3fffull) << 4;
  d->lbo = ((v >> 16) & 0x3fffull) << 4;
  d->sbo = ((v >> 32) & 0x3fffull) << 4;
  d->swizzle = widths[v >> 62];
  return "";
}

// Swizzle<B,4,3> on a byte address: the 16-byte chunk index (bits 4..) XOR the line bits (7..).
inline u64 swizzle(u64 addr, int w) {
  if (w == 0) return addr;
  const u64 mask = u64(w / 16 - 1);  // 1, 3, 7 for 32, 64, 128 bytes
  return addr ^ (((addr >> 7) & mask) << 4);
}

// Address (before swizzling) of element (mn, k), k = 0..15, of a 16-bit operand (see the top).
inline u64 element_address(const Desc& d, bool mn_major, int mn, int k) {
  const u64 m = u64(mn), kk = u64(k);
  if (!mn_major) {
    if (d.swizzle == 0) return d.start + (m / 8) * d.sbo + (m % 8) * 16 + (kk / 8) * d.lbo + (kk % 8) * 2;
    return d.start + (m / 8) * d.sbo + (m % 8) * u64(d.swizzle) + kk * 2;
  }
  if (d.swizzle == 0) return d.start + (m / 8) * d.sbo + (m % 8) * 2 + (kk / 8) * d.lbo + (kk % 8) * 16;
  const u64 per_row = u64(d.swizzle / 2);  // MN elements in one swizzle row
  return d.start + (m / per_row) * d.lbo + (m % per_row) * 2 + (kk / 8) * d.sbo + (kk % 8) * u64(d.swizzle);
}

inline float to_f32(unsigned short bits, Elem e) { return e == Elem::f16 ? f16_to_f32(bits) : bf16_to_f32(bits); }

// Gathers operand `name` (rows x 16, rows = 64 for A, N for B) into out[k * ld + mn].
inline std::string gather(const char* name, u64 desc, bool mn_major, int rows, Elem e, const unsigned char* smem,
                          size_t smem_size, float* out, int ld) {
  Desc d;
  std::string err = decode(desc, name, &d);
  if (!err.empty()) return err;
  if (d.swizzle) {  // a contiguous run must stay inside one swizzle row
    const u64 run = mn_major ? u64(std::min(rows, d.swizzle / 2)) * 2 : 32;
    if (d.start % u64(d.swizzle) + run > u64(d.swizzle))
      return fmt("wgmma: %s descriptor 0x%016llx (%s-major, %s swizzle): start address 0x%llx is %llu bytes into a "
                 "%d-byte swizzle row, so its %llu-byte %s run would cross into the next row (not a canonical layout)",
                 name, desc, mn_major ? "MN" : "K", swizzle_name(d.swizzle), d.start,
                 d.start % u64(d.swizzle), d.swizzle, run, mn_major ? "MN" : "K");
  }
  if (!smem) return fmt("wgmma: %s is in shared memory but no shared memory was given", name);
  for (int mn = 0; mn < rows; ++mn)
    for (int k = 0; k < 16; ++k) {
      const u64 pre = element_address(d, mn_major, mn, k), addr = swizzle(pre, d.swizzle);
      if (addr + 2 > smem_size)
        return fmt("wgmma: %s descriptor 0x%016llx (%s-major, %s swizzle, start 0x%llx, LBO %llu, SBO %llu) reads "
                   "element (%s %d, k %d) at shared offset 0x%llx, past the %zu bytes of shared memory",
                   name, desc, mn_major ? "MN" : "K", swizzle_name(d.swizzle), d.start, d.lbo, d.sbo,
                   name[0] == 'A' ? "m" : "n", mn, k, addr, smem_size);
      unsigned short bits;
      memcpy(&bits, smem + addr, 2);
      out[k * ld + mn] = to_f32(bits, e);
    }
  return "";
}

}  // namespace wgmma_detail

// a_regs[t][0..3]: thread t's (t = 0..127) four A registers (rs form), or nullptr with A in shared
// memory. d[t]: thread t's n/2 accumulator floats, read when scale_d and written. smem / smem_size:
// the block's dynamic shared memory (descriptor addresses are offsets into it). Returns "" on
// success, otherwise a message; on error nothing is written to d. Never aborts.
inline std::string wgmma_compute(const WgmmaOp& op, const u32 (*a_regs)[4], float* const* d,
                                 const unsigned char* smem, size_t smem_size) {
  using namespace wgmma_detail;
  const int n = op.n;
  if (n < 8 || n > 256 || n % 8 != 0) return fmt("wgmma: n = %d is not a multiple of 8 in 8..256", n);
  if (op.elem != Elem::f16 && op.elem != Elem::bf16) return "wgmma: element type is neither f16 nor bf16";
  if (op.trans_a != 0 && op.trans_a != 1) return fmt("wgmma: imm-trans-a = %d (valid values are 0 and 1)", op.trans_a);
  if (op.trans_b != 0 && op.trans_b != 1) return fmt("wgmma: imm-trans-b = %d (valid values are 0 and 1)", op.trans_b);
  if (op.a_in_regs && op.trans_a)
    return "wgmma: imm-trans-a = 1 with A in registers (the transpose exists only for A read through a descriptor)";
  if (op.a_in_regs && !a_regs) return "wgmma: A is in registers but no A registers were given";
  if (!d) return "wgmma: no accumulator registers were given";
  for (int t = 0; t < 128; ++t)
    if (!d[t]) return fmt("wgmma: thread %d of the warpgroup has no accumulator registers", t);

  std::vector<float> A(16 * 64), B(16 * size_t(n));  // A[k * 64 + m], B[k * n + col]
  std::string err;
  if (op.a_in_regs) {
    for (int t = 0; t < 128; ++t) {
      const int w = t >> 5, g = (t & 31) >> 2, q = t & 3;
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) {
          const int row = 16 * w + g + 8 * (r & 1), col = 2 * q + h + 8 * (r >> 1);
          A[col * 64 + row] = to_f32(static_cast<unsigned short>(a_regs[t][r] >> (16 * h)), op.elem);
        }
    }
  } else {
    err = gather("A", op.desc_a, op.trans_a == 1, 64, op.elem, smem, smem_size, A.data(), 64);
    if (!err.empty()) return err;
  }
  err = gather("B", op.desc_b, op.trans_b == 1, n, op.elem, smem, smem_size, B.data(), n);
  if (!err.empty()) return err;

  // One output row at a time: acc[col] = sum over k in order, in fp32 (columns innermost so the
  // independent sums vectorise; each sum still adds its products in k order).
  std::vector<float> acc(static_cast<size_t>(n));
  for (int row = 0; row < 64; ++row) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int k = 0; k < 16; ++k) {
      const float a = A[k * 64 + row];
      const float* b = &B[size_t(k) * n];
      for (int col = 0; col < n; ++col) acc[col] += a * b[col];
    }
    const int w = row >> 4, g = row & 7, half = (row >> 3) & 1;
    for (int col = 0; col < n; ++col) {
      const int j = col >> 3, q = (col & 7) >> 1, i = 2 * half + (col & 1);
      float& out = d[32 * w + 4 * g + q][4 * j + i];
      out = op.scale_d ? acc[col] + out : acc[col];
    }
  }
  return "";
}

}  // namespace emu

#pragma GCC visibility pop
