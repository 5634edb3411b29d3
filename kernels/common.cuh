// common.cuh — device primitives shared by every burstcu kernel, each with its CPU emulation beside it.
//
// Three compilers read this file:
//   * NVRTC / nvcc device pass (__CUDA_ARCH__ defined): the inline-PTX branches below.
//   * g++ with the CPU emulator (BURSTCU_EMU, see emu/cuda_emu.h): the `#elif defined(BURSTCU_EMU)`
//     branches, which call the emulator's warp-level rendezvous (namespace emu).
//   * nvcc's host pass (__CUDACC__ without __CUDA_ARCH__): sees the declarations only; the bodies
//     are empty there because device code is never run on the host.
// When neither NVRTC nor nvcc is compiling, this header pulls in emu/cuda_emu.h itself, so a kernel
// file needs only `#include "common.cuh"` under every compiler.
//
// Primitives (names are a contract with flash_fwd.cu / flash_bwd.cu; keep them stable):
//   u16/u32/u64                   fixed-width integers (NVRTC has no <cstdint>)
//   to_float<T>, from_float<T>    float <-> T for T in {float, __half, __nv_bfloat16} (round to nearest even)
//   pack2<T>(lo, hi)              two T's in one u32, lo in bits 0-15 (the mma operand layout)
//   mma_m16n8k16<T>               mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32, PTX ISA fragments
//   ldmatrix_x{1,2,4}[_trans]     ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16
//   cp_async_16 / cp_async_commit / cp_async_wait<N>   cp.async.cg 16 B with zero-fill, groups
//   warp_max<W>, warp_sum<W>      xor-butterfly reductions over W consecutive lanes (all 32 lanes call)
//   smem_u32addr(p)               shared-window address of a generic pointer (device only)
//   BURSTCU_DYNAMIC_SMEM(T, name) declares `T* name` pointing at the block's dynamic shared memory
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#else
#ifndef BURSTCU_EMU
#define BURSTCU_EMU 1
#endif
#include "emu/cuda_emu.h"
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// NVRTC has no math.h, so INFINITY/NAN are ours there (as CUDA's math_constants.h spells them);
// under g++ <cmath> (via the emulator) already defines them.
#ifndef INFINITY
#define INFINITY (__int_as_float(0x7f800000))
#endif
#ifndef NAN
#define NAN (__int_as_float(0x7fffffff))
#endif

// ---------------------------------------------------------------------------------------------
// Dynamic shared memory. `extern __shared__` cannot be emulated by a macro on `__shared__` alone
// (g++ has no storage that is per-launch and sized at launch), so kernels declare it through this.
// One byte array serves every instantiation, so different T's never clash on the extern's type.
#if defined(BURSTCU_EMU)
#define BURSTCU_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::emu::dynamic_smem())
#else
#define BURSTCU_DYNAMIC_SMEM(T, name)                                   \
  extern __shared__ __align__(16) unsigned char burstcu_dynamic_smem_[]; \
  T* name = reinterpret_cast<T*>(burstcu_dynamic_smem_)
#endif

// ---------------------------------------------------------------------------------------------
// Type conversion. The same code serves both worlds: the emulator defines the CUDA intrinsics.
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> __device__ __forceinline__ u32 bits16(T x);
template <> __device__ __forceinline__ u32 bits16<__half>(__half x) { return __half_as_ushort(x); }
template <> __device__ __forceinline__ u32 bits16<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

// Two T's in one register, lo in bits 0-15: the element order of an mma .f16x2/.bf16x2 operand.
// On the GPU one cvt.rn.{f16x2,bf16x2}.f32 (its first source lands in the upper half); it rounds
// each element as cvt.rn.{f16,bf16}.f32 does, so the bits are those of the two conversions.
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
#if defined(__CUDA_ARCH__)
template <> __device__ __forceinline__ u32 pack2<__half>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#else
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi) {
  return bits16<T>(from_float<T>(lo)) | (bits16<T>(from_float<T>(hi)) << 16);
}
#endif

// ---------------------------------------------------------------------------------------------
// Shared-window address for PTX operands (.shared state space takes 32-bit addresses).
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ u32 smem_u32addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}
#endif

// ---------------------------------------------------------------------------------------------
// Tensor cores: D = A*B + C, A 16x16 row-major fragments a[4], B 16x8 column fragments b[2],
// C/D 16x8 fp32 c[4]/d[4], exactly as the PTX ISA "Matrix fragments for mma.m16n8k16" tables.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float d[4], const u32 a[4], const u32 b[2], const float c[4]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float d[4], const u32 a[4], const u32 b[2], const float c[4]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#elif defined(BURSTCU_EMU)
  ::emu::mma_m16n8k16(d, a, b, c, ::emu::Elem::f16);
#endif
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float d[4], const u32 a[4], const u32 b[2],
                                                            const float c[4]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%11,%12,%13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
        "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#elif defined(BURSTCU_EMU)
  ::emu::mma_m16n8k16(d, a, b, c, ::emu::Elem::bf16);
#endif
}

// ---------------------------------------------------------------------------------------------
// ldmatrix: lanes 8i..8i+7 give the row addresses (16-byte aligned, 8 b16 each) of matrix i;
// register r[i] of lane l receives row l/4, columns 2*(l%4) and 2*(l%4)+1 of matrix i
// (.trans: rows 2*(l%4), 2*(l%4)+1 of column l/4). For x1/x2 the upper lanes' addresses are unused.
__device__ __forceinline__ void ldmatrix_x1(u32 r[1], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(smem_u32addr(row)));
#elif defined(BURSTCU_EMU)
  ::emu::ldmatrix(r, row, 1, false);
#endif
}

__device__ __forceinline__ void ldmatrix_x2(u32 r[2], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32addr(row)));
#elif defined(BURSTCU_EMU)
  ::emu::ldmatrix(r, row, 2, false);
#endif
}

__device__ __forceinline__ void ldmatrix_x4(u32 r[4], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32addr(row)));
#elif defined(BURSTCU_EMU)
  ::emu::ldmatrix(r, row, 4, false);
#endif
}

__device__ __forceinline__ void ldmatrix_x1_trans(u32 r[1], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r[0]) : "r"(smem_u32addr(row)));
#elif defined(BURSTCU_EMU)
  ::emu::ldmatrix(r, row, 1, true);
#endif
}

__device__ __forceinline__ void ldmatrix_x2_trans(u32 r[2], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32addr(row)));
#elif defined(BURSTCU_EMU)
  ::emu::ldmatrix(r, row, 2, true);
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 r[4], const void* row) {
#if defined(__CUDA_ARCH__)
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32addr(row)));
#elif defined(BURSTCU_EMU)
  ::emu::ldmatrix(r, row, 4, true);
#endif
}

// ---------------------------------------------------------------------------------------------
// cp.async: 16 bytes global -> shared, bypassing L1 (.cg). With !valid the source size is 0, so
// nothing is read (gmem_src may point past the tensor) and the 16 destination bytes become zero.
// The emulator writes the destination only at cp_async_wait, so a read before the wait is stale,
// as it may be on the hardware.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32addr(smem_dst)),
               "l"(gmem_src), "r"(valid ? 16 : 0));
#elif defined(BURSTCU_EMU)
  ::emu::cp_async_16(smem_dst, gmem_src, valid);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::);
#elif defined(BURSTCU_EMU)
  ::emu::cp_async_commit();
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#elif defined(BURSTCU_EMU)
  ::emu::cp_async_wait(N);
#endif
}

// ---------------------------------------------------------------------------------------------
// Butterfly reductions over WIDTH consecutive lanes (WIDTH a power of two <= 32). Every lane of
// the warp must call them (full mask): afterwards each lane of a WIDTH-group holds the group's result.
template <int WIDTH> __device__ __forceinline__ float warp_max(float x) {
  static_assert(WIDTH >= 1 && WIDTH <= 32 && (WIDTH & (WIDTH - 1)) == 0, "WIDTH must be a power of two <= 32");
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

template <int WIDTH> __device__ __forceinline__ float warp_sum(float x) {
  static_assert(WIDTH >= 1 && WIDTH <= 32 && (WIDTH & (WIDTH - 1)) == 0, "WIDTH must be a power of two <= 32");
#pragma unroll
  for (int offset = WIDTH / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Non-finite values. A 16-bit float is Inf or NaN iff its exponent bits are all set.
template <typename T> struct ExponentBits;
// kMask: the exponent bits; kOne: the bits of 1.0
template <> struct ExponentBits<__half> { static constexpr u32 kMask = 0x7c00u, kOne = 0x3c00u; };
template <> struct ExponentBits<__nv_bfloat16> { static constexpr u32 kMask = 0x7f80u, kOne = 0x3f80u; };

/// Whether either 16-bit value packed in x (pack2's layout) is Inf or NaN.
template <typename T> __device__ __forceinline__ bool nonfinite_pair(u32 x) {
  constexpr u32 e = ExponentBits<T>::kMask;
  return (x & e) == e || ((x >> 16) & e) == e;
}

/// Whether any element of the ROWS x COLS tile at s (row stride ld elements, rows 16-byte
/// aligned, COLS a multiple of 8) is Inf or NaN: one warp vote, so all 32 lanes call it and all
/// get the answer. Reads the tile once (16 bytes a lane a turn).
template <typename T, int ROWS, int COLS>
__device__ __forceinline__ bool warp_any_nonfinite(const T* s, int ld) {
  static_assert(COLS % 8 == 0, "whole 16-byte chunks");
  constexpr int kChunks = COLS / 8;
  bool bad = false;
  for (int i = threadIdx.x & 31; i < ROWS * kChunks; i += 32) {
    const uint4 w = *reinterpret_cast<const uint4*>(s + (i / kChunks) * ld + (i % kChunks) * 8);
    bad = bad || nonfinite_pair<T>(w.x) || nonfinite_pair<T>(w.y) || nonfinite_pair<T>(w.z) ||
          nonfinite_pair<T>(w.w);
  }
  return __any_sync(0xffffffffu, bad);
}

// ---------------------------------------------------------------------------------------------
// Warp-level matmul with the left operand in registers (FlashAttention's P V, and the backward's
// P^T dO, dS^T Q, dS K). Fragments as mma.m16n8k16's C: x[j][0..1] at (row g, col 8j+2t+{0,1}),
// x[j][2..3] at (row g+8, same cols), g = lane/4, t = lane%4.

/// B operands of two n8 tiles (n0..n0+15, k0..k0+15) from row-major storage s[k][n] (stride ld):
/// b[0..1] for n0..n0+7, b[2..3] for n0+8..n0+15.
template <typename T>
__device__ __forceinline__ void ld_b_t(u32 b[4], const T* s, int ld, int k0, int n0) {
  const int lane = threadIdx.x & 31, i = lane >> 3, r = lane & 7;
  ldmatrix_x4_trans(b, s + (k0 + r + (i & 1) * 8) * ld + n0 + (i >> 1) * 8);
}

/// acc (16 x NW) += X (16 x KDIM fp32 fragments, rounded to T here) . sB[0:KDIM, n0:n0+NW]
/// (row-major, stride ld). The C fragments of two adjacent n8 tiles are the A fragment of one
/// k16 slice, so X never goes through shared memory.
template <typename T, int KDIM, int NW>
__device__ __forceinline__ void gemm_rs(float acc[NW / 8][4], const float x[KDIM / 8][4],
                                        const T* sB, int ld, int n0) {
#pragma unroll
  for (int kk = 0; kk < KDIM / 16; ++kk) {
    const u32 a[4] = {pack2<T>(x[2 * kk][0], x[2 * kk][1]), pack2<T>(x[2 * kk][2], x[2 * kk][3]),
                      pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]),
                      pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3])};
#pragma unroll
    for (int nd = 0; nd < NW / 16; ++nd) {
      u32 b[4];
      ld_b_t(b, sB, ld, kk * 16, n0 + nd * 16);
      mma_m16n8k16<T>(acc[2 * nd], a, b, acc[2 * nd]);
      mma_m16n8k16<T>(acc[2 * nd + 1], a, b + 2, acc[2 * nd + 1]);
    }
  }
}

/// s (16 x 8 NT fp32 C fragments) = Q K^T over KC k16 chunks of the head dim (flash_fwd.cu's
/// and flash_decode.cu's scores): the warp's 16 query rows as A fragments, qf[kc] from registers
/// (QR) or ldmatrix'ed a chunk at a time from q_row + 16 kc (the lane's row of the warp's Q tile
/// in shared memory: row lane % 16, columns 8 (lane / 16) on); the 8 NT keys' rows from kt
/// (row-major, stride ld) as the B fragments of two n8 tiles a ldmatrix.x4, the lane's row and
/// column of that load at k_row = (lane / 16) * 8 + lane % 8, k_col = ((lane / 8) % 2) * 8
/// (matrix i = keys 8 (i / 2), columns 8 (i % 2); formed once by the caller, outside its loops).
template <typename T, int NT, int KC, bool QR>
__device__ __forceinline__ void gemm_qk(float (&s)[NT][4], const u32 (&qf)[QR ? KC : 1][4],
                                        const T* q_row, const T* kt, int ld, int k_row, int k_col) {
#pragma unroll
  for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int kc = 0; kc < KC; ++kc) {
    u32 a_smem[4];
    const u32* a = QR ? qf[QR ? kc : 0] : a_smem;
    if (!QR) ldmatrix_x4(a_smem, q_row + kc * 16);
#pragma unroll
    for (int jp = 0; jp < NT / 2; ++jp) {
      u32 kb[4];
      ldmatrix_x4(kb, kt + (jp * 16 + k_row) * ld + kc * 16 + k_col);
      mma_m16n8k16<T>(s[2 * jp], a, kb, s[2 * jp]);
      mma_m16n8k16<T>(s[2 * jp + 1], a, kb + 2, s[2 * jp + 1]);
    }
  }
}

/// The online softmax of a tile's scores in base 2 (flash_fwd.cu's, flash_decode.cu's), for a
/// lane's two rows (r2 = 0: row g, 1: row g + 8) of s (16 x 8 NT, C fragments): m = max(m, the
/// row's max over the quad that shares it), alpha = exp2(m_old - m), s = P = exp2(s - m), l = l
/// alpha + the lane's part of the row sum (summed over the quad at the end). A row with no visible
/// key yet keeps m = -inf, and 0 stands in for it as the reference (exp2(-inf - 0) = 0, not
/// exp2(-inf + inf) = NaN): the finite -inf guard.
template <int NT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&m)[2], float (&l)[2],
                                               float (&alpha)[2]) {
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    float mx = m[r2];
#pragma unroll
    for (int j = 0; j < NT; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r2], s[j][2 * r2 + 1]));
    mx = warp_max<4>(mx);  // the 4 threads of a row group share the row
    const float ref = mx == -INFINITY ? 0.f : mx;
    alpha[r2] = exp2f(m[r2] - ref);
    m[r2] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j][2 * r2] = exp2f(s[j][2 * r2] - ref);
      s[j][2 * r2 + 1] = exp2f(s[j][2 * r2 + 1] - ref);
      sum += s[j][2 * r2] + s[j][2 * r2 + 1];
    }
    l[r2] = l[r2] * alpha[r2] + sum;
  }
}

/// For the products of a tile with masked pairs (gemm_rs_masked): 1.0 in each half of an A
/// operand register whose value is non-zero, 0 elsewhere.
template <typename T> __device__ __forceinline__ u32 nonzero_ones(u32 a) {
  constexpr u32 one = ExponentBits<T>::kOne;
  return ((a & 0x7fffu) ? one : 0u) | ((a & 0x7fff0000u) ? one << 16 : 0u);
}

/// ... and of a B operand register: returns 1.0 in each half that is Inf or NaN, and sets those
/// halves of b to 0.
template <typename T> __device__ __forceinline__ u32 take_nonfinite(u32& b) {
  constexpr u32 e = ExponentBits<T>::kMask, one = ExponentBits<T>::kOne;
  const bool lo = (b & e) == e, hi = ((b >> 16) & e) == e;
  b &= (lo ? 0xffff0000u : 0xffffffffu) & (hi ? 0x0000ffffu : 0xffffffffu);
  return (lo ? one : 0u) | (hi ? one << 16 : 0u);
}

/// Two n8 tiles of a product for a tile with masked pairs: acc0/acc1 += a . b with b's Inf/NaN
/// values taken out (set to 0), taint0/taint1 += [a != 0] . [b was Inf/NaN] (exact counts).
/// b[0..1] serve the first tile, b[2..3] the second, as ld_b_t loads them; b is modified.
template <typename T>
__device__ __forceinline__ void mma_pair_masked(float acc0[4], float acc1[4], float taint0[4],
                                                float taint1[4], const u32 a[4], u32 b[4]) {
  const u32 a_nonzero[4] = {nonzero_ones<T>(a[0]), nonzero_ones<T>(a[1]), nonzero_ones<T>(a[2]),
                            nonzero_ones<T>(a[3])};
  const u32 b_bad[4] = {take_nonfinite<T>(b[0]), take_nonfinite<T>(b[1]), take_nonfinite<T>(b[2]),
                        take_nonfinite<T>(b[3])};
  mma_m16n8k16<T>(acc0, a, b, acc0);
  mma_m16n8k16<T>(acc1, a, b + 2, acc1);
  mma_m16n8k16<T>(taint0, a_nonzero, b_bad, taint0);
  mma_m16n8k16<T>(taint1, a_nonzero, b_bad + 2, taint1);
}

/// gemm_rs for a tile with masked pairs, whose weights there are exactly 0: a weight that is 0
/// after rounding to T adds nothing, even against an Inf or NaN in sB (the tensor cores would
/// add 0 x Inf = NaN, so a NaN in V at a key a row cannot see would reach that row). `masked`
/// must be the same on every lane. Unmasked, or when the sB slab is all finite (one warp vote
/// over it), this is gemm_rs. Otherwise sB's non-finite values are replaced by 0 for the product,
/// which is then bit for bit gemm_rs's wherever no non-finite value meets a non-zero weight, and
/// a second product of indicators, taint = [x != 0] . [sB not finite] (exact small counts), turns
/// the outputs where one does into NaN. (IEEE arithmetic would give +-Inf for some of those.)
template <typename T, int KDIM, int NW>
__device__ __forceinline__ void gemm_rs_masked(float acc[NW / 8][4], const float x[KDIM / 8][4],
                                               const T* sB, int ld, int n0, bool masked) {
  if (!masked || !warp_any_nonfinite<T, KDIM, NW>(sB + n0, ld)) {
    gemm_rs<T, KDIM, NW>(acc, x, sB, ld, n0);
    return;
  }
#pragma unroll
  for (int nd = 0; nd < NW / 16; ++nd) {  // 16 output columns at a time: taint takes 8 registers
    float taint[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < KDIM / 16; ++kk) {
      const u32 a[4] = {pack2<T>(x[2 * kk][0], x[2 * kk][1]), pack2<T>(x[2 * kk][2], x[2 * kk][3]),
                        pack2<T>(x[2 * kk + 1][0], x[2 * kk + 1][1]),
                        pack2<T>(x[2 * kk + 1][2], x[2 * kk + 1][3])};
      u32 b[4];
      ld_b_t(b, sB, ld, kk * 16, n0 + nd * 16);
      mma_pair_masked<T>(acc[2 * nd], acc[2 * nd + 1], taint[0], taint[1], a, b);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (taint[h][i] != 0.f) acc[2 * nd + h][i] = NAN;
  }
}
