// emu_probes.cu — small kernels that exercise one emulator feature each, for tests/kernels/test_emulator.py.
// Written as ordinary CUDA against common.cuh: the same file compiles under NVRTC (see the test
// that checks it), so the probes themselves are not emulator-specific code.
#include "common.cuh"

// ---- mma: each lane passes registers the test built from the PTX ISA tables; d comes back raw.
// a: (32, 4) u32, b: (32, 2) u32, c/d: (32, 4) f32, indexed by lane.
template <typename T>
__global__ void probe_mma(const u32* a, const u32* b, const float* c, float* d) {
  const int lane = threadIdx.x;
  float dd[4];
  mma_m16n8k16<T>(dd, a + 4 * lane, b + 2 * lane, c + 4 * lane);
  for (int i = 0; i < 4; ++i) d[4 * lane + i] = dd[i];
}

// ---- ldmatrix: `src` (32 rows x 8 b16) is staged in shared memory; lane l gives the address of
// row rows[l]; out: (32, 4) u32 by lane. num in {1,2,4}, trans in {0,1}.
__global__ void probe_ldmatrix(const u16* src, const int* rows, int num, int trans, u32* out) {
  __shared__ __align__(16) u16 s[32 * 8];
  const int lane = threadIdx.x;
  for (int i = 0; i < 8; ++i) s[lane * 8 + i] = src[lane * 8 + i];
  __syncthreads();
  u32 r[4] = {0, 0, 0, 0};
  const u16* row = s + rows[lane] * 8;
  if (num == 1) trans ? ldmatrix_x1_trans(r, row) : ldmatrix_x1(r, row);
  if (num == 2) trans ? ldmatrix_x2_trans(r, row) : ldmatrix_x2(r, row);
  if (num == 4) trans ? ldmatrix_x4_trans(r, row) : ldmatrix_x4(r, row);
  for (int i = 0; i < 4; ++i) out[4 * lane + i] = r[i];
}

// ---- cp.async: two groups into dynamic shared memory; snapshots before/after each wait.
// src: (2, nthreads, 4) f32; out: (nthreads, 6) f32 = [g1 before wait, g2 before wait,
// g1 after wait<1>, g2 after wait<1>, g1 after wait<0>, g2 after wait<0>] (element 0 of each chunk).
__global__ void probe_cp_async(const float* src, float* out, int n_valid) {
  BURSTCU_DYNAMIC_SMEM(float, s);  // 2 * blockDim.x * 4 floats
  const int t = threadIdx.x, n = blockDim.x;
  float* s1 = s + 4 * t;
  float* s2 = s + 4 * (n + t);
  s1[0] = -1.0f;
  s2[0] = -2.0f;
  cp_async_16(s1, src + 4 * t, t < n_valid);
  cp_async_commit();
  cp_async_16(s2, src + 4 * (n + t), true);
  cp_async_commit();
  float* o = out + 6 * t;
  o[0] = s1[0];
  o[1] = s2[0];
  cp_async_wait<1>();
  o[2] = s1[0];
  o[3] = s2[0];
  cp_async_wait<0>();
  o[4] = s1[0];
  o[5] = s2[0];
}

// ---- shuffles, votes, reductions: out is (blockDim.x, 12) int, per thread.
__global__ void probe_warp(const float* x, int* out) {
  const int t = threadIdx.x, lane = t % 32;
  int* o = out + 12 * t;
  o[0] = __shfl_xor_sync(0xffffffffu, t, 5);
  o[1] = __shfl_sync(0xffffffffu, t, 7, 8);
  o[2] = __shfl_up_sync(0xffffffffu, t, 3, 16);
  o[3] = __shfl_down_sync(0xffffffffu, t, 2, 8);
  o[4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  o[5] = __any_sync(0xffffffffu, lane == 17);
  o[6] = __all_sync(0xffffffffu, lane < 31);
  o[7] = (int)warp_max<4>(x[t]);
  o[8] = (int)warp_sum<32>(x[t]);
  o[9] = (int)warp_sum<8>(x[t]);
  o[10] = (lane < 16) ? __shfl_xor_sync(0x0000ffffu, t, 1) : -1;  // a half-warp collective
  __syncwarp();
  o[11] = __float_as_int(__shfl_xor_sync(0xffffffffu, __int_as_float(t), 16));
}

// ---- atomics over a multi-block grid with 3D blocks.
__global__ void probe_atomics(float* fsum, int* isum, unsigned* usum, int* imax, unsigned long long* usum64) {
  const int lin = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int gid = blk * blockDim.x * blockDim.y * blockDim.z + lin;
  atomicAdd(fsum, 0.5f);
  atomicAdd(isum, gid);
  atomicAdd(usum, 1);
  atomicMax(imax, gid);
  atomicAdd(usum64, 3ull);
}

// ---- indices and shared memory: 3D block, multi-block grid, static + dynamic shared memory.
// Each block reverses its slice of `in` (through dynamic smem) and rotates it by one (through
// static smem); ids: (nblocks * nthreads, 8) int = threadIdx xyz, blockIdx xyz, blockDim.x*y*z, gridDim.x*y*z.
__global__ void probe_smem(const float* in, float* rev, float* rot, int* ids) {
  __shared__ float st[1024];
  BURSTCU_DYNAMIC_SMEM(float, dyn);
  const int nt = blockDim.x * blockDim.y * blockDim.z;
  const int lin = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int g = blk * nt + lin;
  dyn[lin] = in[g];
  st[lin] = in[g] * 2.0f;
  __syncthreads();
  rev[g] = dyn[nt - 1 - lin];
  rot[g] = st[(lin + 1) % nt];
  int* o = ids + 8 * g;
  o[0] = threadIdx.x; o[1] = threadIdx.y; o[2] = threadIdx.z;
  o[3] = blockIdx.x; o[4] = blockIdx.y; o[5] = blockIdx.z;
  o[6] = blockDim.x * blockDim.y * blockDim.z;
  o[7] = gridDim.x * gridDim.y * gridDim.z;
}

// ---- a race: read the neighbour's shared value with or without the barrier in between.
template <bool BARRIER>
__global__ void probe_race(int* out) {
  BURSTCU_DYNAMIC_SMEM(int, s);
  const int t = threadIdx.x;
  s[t] = t + 1;
  if (BARRIER) __syncthreads();
  out[t] = s[t > 0 ? t - 1 : 0];
}

// ---- conversions: from_float / pack2 of every input, as raw bits.
__global__ void probe_convert(const float* in, u16* h, u16* bf, u32* packed_h, u32* packed_bf, float* back, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    h[i] = __half_as_ushort(from_float<__half>(in[i]));
    bf[i] = __bfloat16_as_ushort(from_float<__nv_bfloat16>(in[i]));
    packed_h[i] = pack2<__half>(in[i], -in[i]);
    packed_bf[i] = pack2<__nv_bfloat16>(in[i], -in[i]);
    back[2 * i] = to_float(from_float<__half>(in[i]));
    back[2 * i + 1] = to_float(from_float<__nv_bfloat16>(in[i]));
  }
}

// ---- a struct passed by value (the kernels' calling convention): every field arrives intact.
struct ProbeArgs {
  const int* x;    // (blockDim.x,) input
  long long* out;  // (blockDim.x, 3) output
  long long big;   // needs all 64 bits
  int n;
  float f;
};

__global__ void probe_struct(const __grid_constant__ ProbeArgs a) {
  const int t = threadIdx.x;
  a.out[3 * t] = a.x[t] * a.n;
  a.out[3 * t + 1] = a.big + t;
  a.out[3 * t + 2] = static_cast<long long>(a.f * 4.f);
}

// ---- errors the emulator must report (mode selects which).
__device__ __noinline__ int deep(volatile char* p, int depth) {
  volatile char big[8192];
  big[0] = p ? p[0] : 0;
  return depth > 0 ? deep(big, depth - 1) + big[0] : big[0];
}

__global__ void probe_errors(int mode, int* out) {
  const int t = threadIdx.x, lane = t % 32;
  switch (mode) {
    case 0:  // divergent barrier: two call sites
      if (t < 16) __syncthreads();
      else __syncthreads();
      break;
    case 1:  // a thread exits while others will wait at a barrier
      if (t == 3) return;
      __syncthreads();
      break;
    case 2:  // a lane exits before a full-warp shuffle
      if (lane == 31) return;
      out[t] = __shfl_xor_sync(0xffffffffu, t, 1);
      break;
    case 3:  // half the warp shuffles, the other half waits at the barrier
      if (lane < 16) out[t] = __shfl_xor_sync(0xffffffffu, t, 1);
      __syncthreads();
      break;
    case 4:  // stack overflow: 64 frames of 8 KB
      out[t] = deep(nullptr, 64);
      break;
    case 5:  // wild pointer
      out[t] = *reinterpret_cast<volatile int*>(16);
      break;
    case 6: {  // past the end of dynamic shared memory (launch with 256 bytes)
      BURSTCU_DYNAMIC_SMEM(int, s);
      out[t] = reinterpret_cast<volatile int*>(s)[t * 1024];
      break;
    }
    case 7:
      if (t == 5) __trap();
      break;
    case 8:  // ldmatrix needs 16-byte aligned rows
    {
      __shared__ __align__(16) u16 s[32 * 8 + 8];
      u32 r[1];
      ldmatrix_x1(r, s + 1);
      out[t] = r[0];
      break;
    }
    case 10: {  // spin on a flag that a later thread sets: runs forever in a cooperative emulator
      volatile int* flag = out + 63;
      if (t == 0) while (*flag == 0) {}
      if (t == 63) *flag = 1;
      break;
    }
    case 11:  // allocate and synchronise for ever: the watchdog must not stop it inside malloc
      for (;;) {
        volatile char* p = static_cast<volatile char*>(malloc(4096 + t));
        p[t] = char(t);
        out[t] = int(reinterpret_cast<unsigned long long>(p) >> 4) + p[t];
        free(const_cast<char*>(p));
        __syncthreads();
      }
    case 9:  // a real deadlock: half the warp waits at a shuffle, the other half at a vote
      if (lane < 16) out[t] = __shfl_xor_sync(0xffffffffu, t, 1);
      else out[t] = __ballot_sync(0xffffffffu, 1);
      break;
  }
}

// ---- speed: context switches (one __syncwarp = 32 switches per warp) and the cost of mma/ldmatrix.
__global__ void bench_syncwarp(int iters, int* out) {
  int acc = 0;
  for (int i = 0; i < iters; ++i) {
    __syncwarp();
    acc += i;
  }
  out[threadIdx.x] = acc;
}

__global__ void bench_mma(int iters, float* out) {
  u32 a[4] = {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u}, b[2] = {0x3c003c00u, 0x3c003c00u};
  float c[4] = {0, 0, 0, 0};
  for (int i = 0; i < iters; ++i) mma_m16n8k16<__half>(c, a, b, c);
  out[threadIdx.x] = c[0];
}

__global__ void bench_ldmatrix(int iters, u32* out) {
  __shared__ __align__(16) u16 s[32 * 8];
  s[threadIdx.x * 8] = (u16)threadIdx.x;
  __syncthreads();
  u32 r[4], acc = 0;
  for (int i = 0; i < iters; ++i) {
    ldmatrix_x4(r, s + (threadIdx.x % 32) * 8);
    acc += r[0];
  }
  out[threadIdx.x] = acc;
}
