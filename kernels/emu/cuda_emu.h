// cuda_emu.h — run CUDA C++ kernel source on the CPU with g++: the emulator's public header.
//
// How to use it
//   A kernel file that includes "common.cuh" gets this header automatically whenever neither nvcc nor
//   NVRTC is compiling (common.cuh then defines BURSTCU_EMU). A file that does not include common.cuh
//   can include this header first (burstcu/build/emulate.py's generated translation unit does).
//   Build:   g++ -std=c++17 -O2 -shared -fPIC -fstack-clash-protection -I kernels -DBURSTCU_EMU x.cpp
//            entry.cpp -lrt     (entry.cpp: #include "emu/emu_entry.h", the C entry points)
//   Register each instantiation after the kernel's definition, then launch through emu_launch
//   (emu_entry.h) — emulate.py does both:
//     BURSTCU_EMU_REGISTER("flash_fwd_step<__half, 64>", (flash_fwd_step<__half, 64>));
//
// What it provides: the CUDA keywords (__global__, __device__, __shared__, __launch_bounds__,
// __grid_constant__, ...), threadIdx/blockIdx/blockDim/gridDim/warpSize, dim3 and the vector
// types, __half/__nv_bfloat16 and their conversions, the math functions kernels use,
// __syncthreads/__syncwarp, shuffles, votes, atomics, __trap. The machinery is in emu_fiber.h
// (fibers), emu_runtime.h (scheduler, barriers, warp rendezvous, cp.async), emu_collectives.h
// (what shuffles/ldmatrix/mma compute), emu_launch.h (registry, fault handling, launch),
// emu_hopper.h (sm_90: mbarriers, bulk tensor copies, named barriers, the warpgroup side of wgmma),
// emu_wgmma.h (what wgmma computes) and emu_entry.h (the C entry points, and the sm_90 hooks).
//
// Constraints kernels must respect (all hold for code that is correct CUDA):
//   * `__shared__` is `static`, which is right only because blocks run one at a time: a kernel must
//     not rely on static shared memory starting zeroed or holding the previous block's values
//     (it does hold them here — the GPU gives garbage). `extern __shared__` does not compile: use
//     BURSTCU_DYNAMIC_SMEM(T, name) from common.cuh.
//   * __CUDA_ARCH__ is not defined: `#if __CUDA_ARCH__ >= 800` code takes its fallback path.
//   * A thread switches only at __syncthreads, warp and warpgroup collectives (wgmma, setmaxnreg),
//     named barriers, mbarrier waits (mbar_wait / a failing mbar_try_wait yields) and exit, so
//     atomics are trivially atomic, and a data race shows only as an ordering difference (see
//     randomised order). A thread that spins on a plain memory flag another thread sets never
//     lets it run: the watchdog (BURSTCU_EMU_TIMEOUT_S) reports it (spin on an mbarrier instead).
//   * Static shared arrays have no bounds check (dynamic shared memory ends at a guard page).
//   * Fiber stacks are 64 KB (BURSTCU_EMU_STACK_KB, read when the first fibers are made).
//   * Launches are serialised (one mutex per loaded module; emulate.py adds a process-wide lock).
//   * `assert` is the host's assert: a failing one aborts the process. Use __trap() for checks.
#pragma once
// A classic guard as well: emulate.py force-includes a precompiled copy of this header, and the
// guard (unlike #pragma once) is reliably remembered in a GCC precompiled header.
#ifndef BURSTCU_EMU_CUDA_EMU_H
#define BURSTCU_EMU_CUDA_EMU_H

#ifndef BURSTCU_EMU
#define BURSTCU_EMU 1
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#include "emu_launch.h"
#include "emu_hopper.h"  // sm_90: mbarriers, bulk tensor copies, named barriers, wgmma

// ---------------------------------------------------------------------------------------------
// Keywords

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__  // a by-value kernel parameter read in place; here an ordinary copy
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __constant__
#define __managed__
// __restrict__ is already a g++ keyword.

// ---------------------------------------------------------------------------------------------
// Indices and vector types

// uint3 and dim3 are defined in emu_runtime.h. threadIdx etc. are read-only expressions, re-read
// after every switch (the switch is an opaque call, so the compiler cannot cache them across it).
#define threadIdx (static_cast<const uint3&>(::emu::g_cur->tid))
#define blockIdx (static_cast<const uint3&>(::emu::g_block_idx))
#define blockDim (static_cast<const dim3&>(::emu::g_block_dim))
#define gridDim (static_cast<const dim3&>(::emu::g_grid_dim))
static constexpr int warpSize = 32;

#define BURSTCU_EMU_VEC2(T, N) \
  struct __attribute__((aligned(2 * sizeof(T)))) N { T x, y; }; \
  inline N make_##N(T x, T y) { return N{x, y}; }
#define BURSTCU_EMU_VEC4(T, N) \
  struct __attribute__((aligned(4 * sizeof(T)))) N { T x, y, z, w; }; \
  inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
BURSTCU_EMU_VEC2(float, float2)
BURSTCU_EMU_VEC4(float, float4)
BURSTCU_EMU_VEC2(int, int2)
BURSTCU_EMU_VEC4(int, int4)
BURSTCU_EMU_VEC2(unsigned int, uint2)
BURSTCU_EMU_VEC4(unsigned int, uint4)
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
static_assert(sizeof(float4) == 16 && alignof(float4) == 16, "float4 must match CUDA's layout");

// ---------------------------------------------------------------------------------------------
// fp16 / bf16. __half wraps _Float16 (IEEE binary16, round to nearest even); __nv_bfloat16 is a
// 16-bit pattern with hand-written round-to-nearest-even, since g++ 12 has no bf16 arithmetic.
// Both convert implicitly to and from float, as CUDA's types do without __CUDA_NO_HALF_CONVERSIONS__.

struct __half {
  _Float16 v;
  __half() = default;
  __half(float f) : v(static_cast<_Float16>(f)) {}
  __half(double f) : v(static_cast<_Float16>(static_cast<float>(f))) {}
  __half(int i) : v(static_cast<_Float16>(static_cast<float>(i))) {}
  operator float() const;
};
struct __nv_bfloat16 {
  unsigned short x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : x(::emu::f32_to_bf16(f)) {}
  __nv_bfloat16(double f) : x(::emu::f32_to_bf16(static_cast<float>(f))) {}
  __nv_bfloat16(int i) : x(::emu::f32_to_bf16(static_cast<float>(i))) {}
  operator float() const { return ::emu::bf16_to_f32(x); }
};
struct __align__(4) __half2 { __half x, y; };
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __half half;
typedef __half2 half2;
typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
static_assert(sizeof(__half) == 2 && sizeof(__nv_bfloat16) == 2, "16-bit types must be 2 bytes");

inline unsigned short __half_as_ushort(__half h) {
  unsigned short b;
  memcpy(&b, &h, 2);
  return b;
}
inline __half::operator float() const { return ::emu::f16_to_f32(__half_as_ushort(*this)); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return ::emu::f16_to_f32(__half_as_ushort(h)); }
inline __half __ushort_as_half(unsigned short b) {
  __half h;
  memcpy(&h, &b, 2);
  return h;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return ::emu::bf16_to_f32(h.x); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) {
  __nv_bfloat16 h;
  h.x = b;
  return h;
}
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__half(lo), __half(hi)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__nv_bfloat16(lo), __nv_bfloat16(hi)};
}
inline float __low2float(__half2 h) { return float(h.x); }
inline float __high2float(__half2 h) { return float(h.y); }
inline float __low2float(__nv_bfloat162 h) { return float(h.x); }
inline float __high2float(__nv_bfloat162 h) { return float(h.y); }

// ---------------------------------------------------------------------------------------------
// Math and bit intrinsics (<cmath> supplies expf, exp2f, logf, log2f, fmaxf, fminf, sqrtf, fabsf, ...)

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fmul_rn(float a, float b) { return a * b; }   // a product never fused into an add
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <typename T> inline T __ldg(const T* p) { return *p; }

// CUDA's integer min/max overloads (mixed signed/unsigned promote to unsigned, as in CUDA).
#define BURSTCU_EMU_MINMAX(T)                           \
  inline T min(T a, T b) { return a < b ? a : b; }     \
  inline T max(T a, T b) { return a > b ? a : b; }
BURSTCU_EMU_MINMAX(int)
BURSTCU_EMU_MINMAX(unsigned int)
BURSTCU_EMU_MINMAX(long)
BURSTCU_EMU_MINMAX(unsigned long)
BURSTCU_EMU_MINMAX(long long)
BURSTCU_EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
inline unsigned int min(int a, unsigned int b) { return min(unsigned(a), b); }
inline unsigned int min(unsigned int a, int b) { return min(a, unsigned(b)); }
inline unsigned int max(int a, unsigned int b) { return max(unsigned(a), b); }
inline unsigned int max(unsigned int a, int b) { return max(a, unsigned(b)); }

// ---------------------------------------------------------------------------------------------
// Synchronisation and control

#define __syncthreads() ::emu::syncthreads(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::emu::collective(::emu::K_SYNCWARP, mask); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __trap() { ::emu::trap(); }
inline unsigned __activemask() {
  const ::emu::Warp& w = ::emu::g_run->warps[::emu::g_cur->warp];
  return w.exist & ~w.exited;
}

// ---------------------------------------------------------------------------------------------
// Shuffles and votes (any type of 8 bytes or fewer travels as raw bits)

namespace emu {
template <typename T> inline T shuffle_as(int kind, unsigned mask, T var, long arg, int width) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  u64 bits = 0;
  memcpy(&bits, &var, sizeof(T));
  bits = shuffle(kind, mask, bits, arg, width);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}
}  // namespace emu

template <typename T> inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return ::emu::shuffle_as(::emu::K_SHFL_IDX, mask, var, src_lane, width);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::emu::shuffle_as(::emu::K_SHFL_UP, mask, var, long(delta), width);
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return ::emu::shuffle_as(::emu::K_SHFL_DOWN, mask, var, long(delta), width);
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return ::emu::shuffle_as(::emu::K_SHFL_XOR, mask, var, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return unsigned(::emu::vote(::emu::K_BALLOT, mask, pred)); }
inline int __any_sync(unsigned mask, int pred) { return int(::emu::vote(::emu::K_ANY, mask, pred)); }
inline int __all_sync(unsigned mask, int pred) { return int(::emu::vote(::emu::K_ALL, mask, pred)); }

// ---------------------------------------------------------------------------------------------
// Atomics: fibers switch only at synchronisation points, so a plain read-modify-write is atomic.
// The value parameters are not deduced, so atomicAdd(unsigned_ptr, 1) converts 1 as CUDA's overloads do.
namespace emu {
template <typename T> struct same { using type = T; };
}

template <typename T> inline T atomicAdd(T* p, typename ::emu::same<T>::type v) {
  ++::emu::g_global_adds[0];
  T old = *p;
  *p = old + v;
  return old;
}
template <typename T> inline T atomicSub(T* p, typename ::emu::same<T>::type v) {
  T old = *p;
  *p = old - v;
  return old;
}
template <typename T> inline T atomicMax(T* p, typename ::emu::same<T>::type v) {
  T old = *p;
  *p = old > v ? old : v;
  return old;
}
template <typename T> inline T atomicMin(T* p, typename ::emu::same<T>::type v) {
  T old = *p;
  *p = old < v ? old : v;
  return old;
}
template <typename T> inline T atomicExch(T* p, typename ::emu::same<T>::type v) {
  T old = *p;
  *p = v;
  return old;
}
template <typename T> inline T atomicCAS(T* p, typename ::emu::same<T>::type compare, typename ::emu::same<T>::type v) {
  T old = *p;
  if (old == compare) *p = v;
  return old;
}

#endif  // BURSTCU_EMU_CUDA_EMU_H
