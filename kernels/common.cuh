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
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi) {
  return bits16<T>(from_float<T>(lo)) | (bits16<T>(from_float<T>(hi)) << 16);
}

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
