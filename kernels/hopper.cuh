// hopper.cuh — the sm_90a primitives of the Hopper kernels (flash_fwd_sm90.cu, flash_bwd_sm90.cu),
// each with its CPU emulation beside it, as common.cuh does for the sm_80 ones.
//
// Three compilers read this file (see common.cuh): NVRTC/nvcc with __CUDA_ARCH__ (inline PTX;
// wgmma and setmaxnreg need the sm_90a target, --gpu-architecture=sm_90a), g++ with the emulator
// (BURSTCU_EMU: the calls into namespace emu, kernels/emu/emu_hopper.h and emu_wgmma.h), and
// nvcc's host pass (declarations only).
//
// Primitives (names are a contract with the sm90 kernels; every one is the PTX ISA's instruction
// of the same name, and the emulation implements the ISA's definition):
//   aligned_smem()                      the dynamic shared memory from its first 1024-byte
//                                       aligned byte (the 128-byte swizzle's period)
//   smem_addr(p)                        shared-window address of a pointer into shared memory;
//                                       in the emulator the offset from the dynamic smem base
//   mbar_init(bar, count)               mbarrier.init.shared::cta.b64
//   fence_mbarrier_init()               fence.mbarrier_init.release.cluster (after the inits, before
//                                       the barrier that publishes them)
//   mbar_arrive(bar)                    mbarrier.arrive.shared::cta.b64
//   mbar_arrive_expect_tx(bar, bytes)   mbarrier.arrive.expect_tx.shared::cta.b64
//   mbar_try_wait(bar, parity)          mbarrier.try_wait.parity.shared::cta.b64: true once the phase
//                                       of that parity has completed
//   mbar_wait(bar, parity)              try_wait until true (the emulator yields between tries)
//   tma_load_4d(dst, map, bar, c0..c3)  cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::
//                                       complete_tx::bytes: one box of `map` at coordinates
//                                       (c0 innermost) into dst, completing its bytes on bar
//   tma_reduce_add_4d(map, src, c0..c3) cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.
//                                       bulk_group: the box of `map` at the coordinates += the
//                                       shared image at src (tma_load_4d's layout), atomically an element
//   bulk_commit_group()                 cp.async.bulk.commit_group
//   bulk_wait_group_read<N>() / bulk_wait_group<N>()   cp.async.bulk.wait_group.read N / wait_group N
//   tma_prefetch_map(map)               prefetch.tensormap
//   fence_proxy_async()                 fence.proxy.async.shared::cta
//   elect_one()                         elect.sync over the full warp: true in exactly one lane
//   setmaxnreg_inc<N>/dec<N>()          setmaxnreg.{inc,dec}.sync.aligned.u32 N (no effect in the
//                                       emulator)
//   named_bar_sync(id, n)/arrive(id, n) bar.sync / bar.arrive with barrier id and thread count n
//   red_add_v2(dst, a, b)               red.global.add.v2.f32 (sm_90): a and b added to the two floats
//                                       at dst (8-byte aligned), each element atomically
//   wgmma_desc(p, swizzle, lbo, sbo)    the 64-bit shared-memory matrix descriptor of the PTX ISA
//                                       ("Matrix Descriptor Format"): start address >> 4 in bits
//                                       0-13, leading byte offset >> 4 in 16-29, stride byte offset
//                                       >> 4 in 32-45, base offset 0, swizzle mode in 62-63
//   wgmma_desc_at(desc, bytes)          the same descriptor `bytes` further on
//   wgmma_fence() / wgmma_commit() / wgmma_wait<N>()   wgmma.fence / commit_group / wait_group N
//   wgmma_ss<T, N, TA, TB>(d, da, db, acc)   wgmma.mma_async m64nNk16 .f32.T.T, A and B from shared
//                                       memory (descriptors), trans-a TA, trans-b TB; acc false:
//                                       D = A B (the scale-d predicate), else D += A B
//   wgmma_rs<T, N, TB>(d, a, db, acc)   the same with A from registers (a[4]: the m64k16 A fragment)
//   accumulator_as_a<T, N>(d, a)        an m64nN accumulator rounded to T as the A fragments of
//                                       N/16 k16 steps (P = S in attention: no shared memory)
//   Register fragments (PTX ISA, "Register Fragments and Shared Memory Matrix Layouts" of wgmma):
//   warp w of the warpgroup owns rows 16w..16w+15; accumulator d[4j + i] of lane (g = lane/4,
//   t = lane%4) is row g (+8 for i >= 2), column 8j + 2t + (i & 1); A fragment a[r] holds the two
//   elements of row g (+8 for r odd), columns 2t, 2t+1 (+8 for r >= 2), low half first.
//   The SWIZZLE_* constants are the descriptor's swizzle field values.
#pragma once

#include "common.cuh"
#include "params.cuh"  // TensorMap

enum : int { SWIZZLE_NONE = 0, SWIZZLE_128B = 1, SWIZZLE_64B = 2, SWIZZLE_32B = 3 };

// ---------------------------------------------------------------------------------------------
// shared-window addresses
__device__ __forceinline__ u32 smem_addr(const void* p) {
#if defined(__CUDA_ARCH__)
  return static_cast<u32>(__cvta_generic_to_shared(p));
#elif defined(BURSTCU_EMU)
  return ::emu::smem_offset(p);
#else
  return 0;
#endif
}

// ---------------------------------------------------------------------------------------------
// mbarriers
__device__ __forceinline__ void mbar_init(u64* bar, u32 count) {
#if defined(__CUDA_ARCH__)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::mbar_init(bar, count);
#endif
}

__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__)
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(u64* bar) {
#if defined(__CUDA_ARCH__)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::mbar_arrive(bar, 0);
#endif
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u64* bar, u32 bytes) {
#if defined(__CUDA_ARCH__)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::mbar_arrive(bar, bytes);
#endif
}

__device__ __forceinline__ bool mbar_try_wait(u64* bar, u32 parity) {
#if defined(__CUDA_ARCH__)
  u32 done;
  asm volatile(
      "{ .reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p; }\n"
      : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
  return done != 0;
#elif defined(BURSTCU_EMU)
  return ::emu::mbar_try_wait(bar, parity);
#else
  return true;
#endif
}

__device__ __forceinline__ void mbar_wait(u64* bar, u32 parity) {
#if defined(__CUDA_ARCH__)
  while (!mbar_try_wait(bar, parity)) {
  }
#elif defined(BURSTCU_EMU)
  ::emu::mbar_wait(bar, parity);
#endif
}

// ---------------------------------------------------------------------------------------------
// bulk tensor copies (TMA)
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2,
                                            int c3) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_addr(dst)), "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1),
      "r"(c2), "r"(c3)
      : "memory");
#elif defined(BURSTCU_EMU)
  const int coords[4] = {c0, c1, c2, c3};
  ::emu::tma_load(dst, map, bar, coords, 4);
#endif
}

// cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group: the box of `map` at
// (c0..c3) in global memory += the box's image in shared memory at src (laid out as tma_load_4d
// writes it, swizzle included), element by element and each element atomically; elements outside
// the tensor are not written. Asynchronous: src may be rewritten only after bulk_wait_group_read,
// and it must be made visible to the async proxy first (fence_proxy_async, then a barrier).
__device__ __forceinline__ void tma_reduce_add_4d(const TensorMap* map, const void* src, int c0, int c1, int c2,
                                                  int c3) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(reinterpret_cast<u64>(map)), "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#elif defined(BURSTCU_EMU)
  const int coords[4] = {c0, c1, c2, c3};
  ::emu::tma_reduce_add(map, src, coords, 4);
#endif
}

// cp.async.bulk.commit_group: this thread's bulk operations issued since the last commit form a
// bulk async-group.
__device__ __forceinline__ void bulk_commit_group() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#elif defined(BURSTCU_EMU)
  ::emu::bulk_commit_group();
#endif
}

// cp.async.bulk.wait_group.read N: until at most N of this thread's most recent bulk async-groups
// still read their shared source (the older ones' sources may be rewritten).
template <int N> __device__ __forceinline__ void bulk_wait_group_read() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::bulk_wait_group(N, true);
#endif
}

// cp.async.bulk.wait_group N: until at most N of this thread's most recent bulk async-groups are
// pending at all (the older ones' writes are done).
template <int N> __device__ __forceinline__ void bulk_wait_group() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::bulk_wait_group(N, false);
#endif
}

// prefetch.tensormap: bring a tensor map (here: in the kernel's parameter space) into the
// cache of tensor maps before the first copy that uses it. No effect in the emulator.
__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
#else
  (void)map;
#endif
}

__device__ __forceinline__ void fence_proxy_async() {
#if defined(__CUDA_ARCH__)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#elif defined(BURSTCU_EMU)
  ::emu::fence_proxy_async();
#endif
}

// ---------------------------------------------------------------------------------------------
// warp and warpgroup control
__device__ __forceinline__ bool elect_one() {
#if defined(__CUDA_ARCH__)
  u32 pred;
  asm volatile(
      "{ .reg .pred p;\n"
      "elect.sync _|p, 0xffffffff;\n"
      "selp.u32 %0, 1, 0, p; }\n"
      : "=r"(pred));
  return pred != 0;
#elif defined(BURSTCU_EMU)
  return ::emu::elect_one();
#else
  return false;
#endif
}

template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH__)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#elif defined(BURSTCU_EMU)
  ::emu::setmaxnreg(N);
#endif
}

template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH__)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#elif defined(BURSTCU_EMU)
  ::emu::setmaxnreg(N);
#endif
}

// Named barriers: `n` threads (a multiple of 32) meet at barrier `id` (1..15; 0 is __syncthreads').
__device__ __forceinline__ void named_bar_sync(int id, int n) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::named_barrier(id, n, true);
#endif
}

__device__ __forceinline__ void named_bar_arrive(int id, int n) {
#if defined(__CUDA_ARCH__)
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::named_barrier(id, n, false);
#endif
}

// ---------------------------------------------------------------------------------------------
// global reductions
__device__ __forceinline__ void red_add_v2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__)
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::red_add_v2(dst, a, b);
#else
  (void)dst, (void)a, (void)b;
#endif
}

// ---------------------------------------------------------------------------------------------
// The block's dynamic shared memory, aligned to 1024 bytes in the shared window (the 128-byte
// swizzle of TMA and wgmma is a function of the address bits): Smem's offsets count from here.
__device__ __forceinline__ unsigned char* aligned_smem() {
  BURSTCU_DYNAMIC_SMEM(unsigned char, raw);
  return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}

// ---------------------------------------------------------------------------------------------
// wgmma
__device__ __forceinline__ u64 wgmma_desc(const void* smem, int swizzle, u32 lbo_bytes, u32 sbo_bytes) {
  return (u64((smem_addr(smem) >> 4) & 0x3fffu)) | (u64((lbo_bytes >> 4) & 0x3fffu) << 16) |
         (u64((sbo_bytes >> 4) & 0x3fffu) << 32) | (u64(swizzle & 3) << 62);
}

// The descriptor of the matrix `bytes` further on in shared memory: the start address field
// (bits 0-13, address >> 4) plus bytes >> 4 (bytes a multiple of 16; shared addresses stay
// below 256 KB, so the field does not carry into the next one).
__device__ __forceinline__ u64 wgmma_desc_at(u64 desc, u32 bytes) { return desc + (bytes >> 4); }

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH__)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#elif defined(BURSTCU_EMU)
  ::emu::wgmma_fence();
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH__)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#elif defined(BURSTCU_EMU)
  ::emu::wgmma_commit();
#endif
}

template <int N> __device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH__)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#elif defined(BURSTCU_EMU)
  ::emu::wgmma_wait(N);
#endif
}

// The accumulators stay live across an asynchronous wgmma: ptxas must not move them, so every
// register of d goes through an empty asm that "reads and writes" it (CUTLASS calls this
// warpgroup_fence_operand).
template <int R> __device__ __forceinline__ void wgmma_fence_operand(float (&d)[R]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
#endif
}
// ... and the A fragments of the register form, a[K][4] (K k16 steps)
template <int K> __device__ __forceinline__ void wgmma_fence_operand(u32 (&a)[K][4]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[k][i])::"memory");
#endif
}

#if defined(__CUDA_ARCH__)
// The asm of each shape (N/2 accumulator operands %0..%(N/2-1), then the inputs).
#define BURSTCU_WGMMA_SS_64(DT) \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." DT "." DT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(TRANS_A), "n"(TRANS_B))

#define BURSTCU_WGMMA_RS_64(DT) \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." DT "." DT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(TRANS_B))

#define BURSTCU_WGMMA_SS_128(DT) \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." DT "." DT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(TRANS_A), "n"(TRANS_B))

#define BURSTCU_WGMMA_RS_128(DT) \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." DT "." DT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(TRANS_B))

#define BURSTCU_WGMMA_SS_256(DT) \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %130, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." DT "." DT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, %131, %132;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
               : "l"(desc_a), "l"(desc_b), "r"(int(accumulate)), "n"(TRANS_A), "n"(TRANS_B))

#define BURSTCU_WGMMA_RS_256(DT) \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %133, 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n256k16.f32." DT "." DT " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, %134;\n}\n" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(int(accumulate)), "n"(TRANS_B))
#endif  // __CUDA_ARCH__

template <typename T> struct IsHalf { static constexpr bool value = false; };
template <> struct IsHalf<__half> { static constexpr bool value = true; };

template <typename T> struct WgmmaType;
template <> struct WgmmaType<__half> {
#if defined(BURSTCU_EMU)
  static constexpr ::emu::Elem kElem = ::emu::Elem::f16;
#endif
};
template <> struct WgmmaType<__nv_bfloat16> {
#if defined(BURSTCU_EMU)
  static constexpr ::emu::Elem kElem = ::emu::Elem::bf16;
#endif
};

// D (64 x N fp32, d[N/2] per thread) = A B (+ D when accumulate): A (64 x 16) and B (16 x N) in
// shared memory through descriptors; TRANS_A / TRANS_B: 0 = K-major, 1 = MN-major (transposed).
template <typename T, int N, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], u64 desc_a, u64 desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 256, "instantiated N: 64, 128, 256");
#if defined(__CUDA_ARCH__)
  constexpr bool kHalf = IsHalf<T>::value;
  if constexpr (N == 64) {
    if constexpr (kHalf) { BURSTCU_WGMMA_SS_64("f16"); } else { BURSTCU_WGMMA_SS_64("bf16"); }
  } else if constexpr (N == 128) {
    if constexpr (kHalf) { BURSTCU_WGMMA_SS_128("f16"); } else { BURSTCU_WGMMA_SS_128("bf16"); }
  } else {
    if constexpr (kHalf) { BURSTCU_WGMMA_SS_256("f16"); } else { BURSTCU_WGMMA_SS_256("bf16"); }
  }
#elif defined(BURSTCU_EMU)
  ::emu::wgmma_issue(d, N, WgmmaType<T>::kElem, nullptr, desc_a, desc_b, TRANS_A, TRANS_B, accumulate);
#endif
}

// D (64 x N fp32) = A B (+ D): A from registers (a[4], the fragment above), B in shared memory.
template <typename T, int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const u32 (&a)[4], u64 desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 256, "instantiated N: 64, 128, 256");
#if defined(__CUDA_ARCH__)
  constexpr bool kHalf = IsHalf<T>::value;
  if constexpr (N == 64) {
    if constexpr (kHalf) { BURSTCU_WGMMA_RS_64("f16"); } else { BURSTCU_WGMMA_RS_64("bf16"); }
  } else if constexpr (N == 128) {
    if constexpr (kHalf) { BURSTCU_WGMMA_RS_128("f16"); } else { BURSTCU_WGMMA_RS_128("bf16"); }
  } else {
    if constexpr (kHalf) { BURSTCU_WGMMA_RS_256("f16"); } else { BURSTCU_WGMMA_RS_256("bf16"); }
  }
#elif defined(BURSTCU_EMU)
  ::emu::wgmma_issue(d, N, WgmmaType<T>::kElem, a, 0, desc_b, 0, TRANS_B, accumulate);
#endif
}

// The m64nN fp32 accumulator d as the A fragments of N/16 k16 steps, rounded to T: k16 step kc
// covers columns 16kc..16kc+15, i.e. the accumulator's n8 blocks 2kc (a[kc][0] row g, a[kc][1]
// row g+8, columns 2t, 2t+1) and 2kc+1 (a[kc][2], a[kc][3]: columns 8+2t, 8+2t+1) — the two
// register tables above coincide, so no element moves between threads.
template <typename T, int N>
__device__ __forceinline__ void accumulator_as_a(const float (&d)[N / 2], u32 (&a)[N / 16][4]) {
#pragma unroll
  for (int kc = 0; kc < N / 16; ++kc) {
    a[kc][0] = pack2<T>(d[8 * kc + 0], d[8 * kc + 1]);
    a[kc][1] = pack2<T>(d[8 * kc + 2], d[8 * kc + 3]);
    a[kc][2] = pack2<T>(d[8 * kc + 4], d[8 * kc + 5]);
    a[kc][3] = pack2<T>(d[8 * kc + 6], d[8 * kc + 7]);
  }
}
