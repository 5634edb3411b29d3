// hopper_isa_probes.cu — probes that ask the sm_90a hardware the PTX ISA questions the emulator
// (kernels/emu/emu_hopper.h, emu_wgmma.h) answers from its reading of the ISA, for
// tests/gpu/test_hopper_isa_gpu.py. Each probe's result is fixed bit for bit by the ISA (TMA copies
// bits; the wgmma inputs are small integers, so every product and every fp32 sum is exact in any
// order), so the host compares raw bytes / raw registers with a NumPy model and between the
// emulator and the GPU.
//
// Everything goes through kernels/hopper.cuh, with exactly the descriptors, strides and k16 steps
// of kernels/flash_fwd_sm90.cu. One block of 128 threads (one warpgroup) per launch. Shared
// memory: the dynamic smem, aligned to 1024 bytes in the shared window here (as the kernel's
// aligned_smem does), so launches ask for 1024 bytes more than they use.
// Raw registers: thread t writes its accumulators d[0 .. R) to out[t * R .. t * R + R).
#include "hopper.cuh"

__device__ __forceinline__ unsigned char* probe_smem() {
  BURSTCU_DYNAMIC_SMEM(unsigned char, raw);
  return raw + ((1024u - (smem_addr(raw) & 1023u)) & 1023u);
}

// Plain generic-proxy copies of host-prepared bytes (n a multiple of 4), by the whole block.
__device__ __forceinline__ void copy_in(unsigned char* dst, const unsigned char* src, int n) {
  for (int i = 4 * threadIdx.x; i < n; i += 4 * blockDim.x)
    *reinterpret_cast<u32*>(dst + i) = *reinterpret_cast<const u32*>(src + i);
}

// mbar_wait with a bound: a GPU probe must end even if the barrier never completes (copies that
// credit fewer bytes than expected). After about a second (2^31 clocks) it sets *status = 1 and
// the probe goes on (every thread takes the same path, so the warpgroup's wgmma stay aligned); its
// output is then whatever shared memory held. The emulator reports a barrier that can never
// complete as a deadlock instead, so there it is mbar_wait.
__device__ __forceinline__ void bounded_wait(u64* bar, u32 parity, int* status) {
#if defined(__CUDA_ARCH__)
  const long long start = clock64();
  while (!mbar_try_wait(bar, parity))
    if (clock64() - start > (1ll << 31)) {
      *status = 1;
      return;
    }
#else
  (void)status;
  mbar_wait(bar, parity);
#endif
}

template <int R> __device__ __forceinline__ void load_regs(float (&d)[R], const float* src) {
#pragma unroll
  for (int i = 0; i < R; ++i) d[i] = src[threadIdx.x * R + i];
}

template <int R> __device__ __forceinline__ void store_regs(float* dst, const float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) dst[threadIdx.x * R + i] = d[i];
}

// ---- TMA: where does one box of cp.async.bulk.tensor.4d land in shared memory?
// One thread loads the box of `map` at (c0, c1, c2, c3) into shared offset 1024 (a 1024-byte
// boundary; the mbarrier sits at offset 0) over bytes pre-filled with 0xA5; then the block copies
// the `out_bytes` shared bytes from offset 1024 (the box, its swizzle span and whatever follows,
// where nothing may have been written) to out. Asks: the box's element order (dim 0 innermost),
// zero fill outside the tensor, the swizzle of the 16-byte chunks as a function of the shared
// address bits, no write past the box's swizzle span, the full box's bytes credited to the mbarrier
// even where they were filled (a short count leaves status[0] = 1).
__global__ void probe_tma_box(const __grid_constant__ TensorMap map, int c0, int c1, int c2, int c3, int box_bytes,
                              int out_bytes, unsigned char* out, int* status) {
  unsigned char* smem = probe_smem();
  u64* bar = reinterpret_cast<u64*>(smem);
  unsigned char* box = smem + 1024;
  for (int i = threadIdx.x; i < out_bytes; i += blockDim.x) box[i] = 0xA5;
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    fence_mbarrier_init();
  }
  fence_proxy_async();  // the generic-proxy fill is ordered before the copy's async-proxy writes
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_arrive_expect_tx(bar, u32(box_bytes));
    tma_load_4d(box, &map, bar, c0, c1, c2, c3);
  }
  bounded_wait(bar, 0, status);
  for (int i = threadIdx.x; i < out_bytes; i += blockDim.x) out[i] = box[i];
}

// ---- wgmma S = Q K^T (flash_fwd_sm90.cu's issue_qk): both operands K-major in shared memory with
// the 128-byte swizzle, Q stored [D/64 column blocks][128 rows][64] (the kernel's Q tile; this
// warpgroup reads the 64-row slice `qslice`, at + qslice * 64 * 128 bytes), K stored
// [D/64][N rows][64]; descriptors SBO = 1024, LBO = 16, k16 step kk at + (kk / 4) * rows * 128 +
// (kk % 4) * 32 bytes. The first wgmma has scale-d = acc0 (the accumulators start from `init`),
// the others true. The tiles are plain copies of q_img / k_img: no TMA involved.
template <typename T, int N, int D>
__global__ void __launch_bounds__(128, 1)
probe_qk(const unsigned char* q_img, const unsigned char* k_img, int qslice, int acc0, const float* init,
         float* out) {
  unsigned char* smem = probe_smem();
  unsigned char* sQ = smem;
  unsigned char* sK = smem + 128 * D * 2;
  copy_in(sQ, q_img, 128 * D * 2);
  copy_in(sK, k_img, N * D * 2);
  float s[N / 2];
  load_regs(s, init);
  fence_proxy_async();  // generic-proxy stores, read next by the tensor cores (async proxy)
  __syncthreads();
  const unsigned char* q = sQ + qslice * 64 * 128;
  wgmma_fence_operand(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, N, 0, 0>(s, wgmma_desc(q + (kk / 4) * 128 * 128 + (kk % 4) * 32, SWIZZLE_128B, 16, 1024),
                         wgmma_desc(sK + (kk / 4) * N * 128 + (kk % 4) * 32, SWIZZLE_128B, 16, 1024),
                         kk > 0 || acc0 != 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(s);
  store_regs(out, s);
}

// ---- wgmma O += P V (flash_fwd_sm90.cu's issue_pv): P from registers (the rs form: p_regs holds
// each thread's A fragments, [128 threads][BLOCK_N / 16 k16 steps][4] u32, placed by the host with
// its fragment table), V read N-major (imm-trans-b = 1) with the 128-byte swizzle, stored
// [D/64][BLOCK_N key rows][64]; descriptor LBO = BLOCK_N * 128, SBO = 1024, k16 step kc at
// + kc * 2048 bytes; N = D. The first wgmma has scale-d = acc0 (from `init`), the others true.
template <typename T, int D, int BLOCK_N>
__global__ void __launch_bounds__(128, 1)
probe_pv(const unsigned char* v_img, const u32* p_regs, int acc0, const float* init, float* out) {
  constexpr int kSteps = BLOCK_N / 16;
  unsigned char* sV = probe_smem();
  copy_in(sV, v_img, BLOCK_N * D * 2);
  u32 pa[kSteps][4];
#pragma unroll
  for (int kc = 0; kc < kSteps; ++kc)
#pragma unroll
    for (int r = 0; r < 4; ++r) pa[kc][r] = p_regs[(threadIdx.x * kSteps + kc) * 4 + r];
  float o[D / 2];
  load_regs(o, init);
  fence_proxy_async();
  __syncthreads();
  wgmma_fence_operand(o);
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < kSteps; ++kc)
    wgmma_rs<T, D, 1>(o, pa[kc], wgmma_desc(sV + kc * 16 * 128, SWIZZLE_128B, BLOCK_N * 128, 1024),
                      kc > 0 || acc0 != 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(o);
  store_regs(out, o);
}

// ---- the kernel's data path in miniature: Q, K and V arrive by TMA (maps as tensor_map_4d_rows
// builds them: box (64, 128 rows) for Q, (64, BLOCK_N rows) for K and V, 128-byte swizzle; each
// tile D/64 boxes of column blocks, as the producer of flash_fwd_sm90.cu issues them), then
// S = Q K^T (ss, Q slice qslice, scale-d false first) -> s_out raw; P = S packed into A fragments
// exactly as the kernel's pack_p; O = o_init + P V (rs, V N-major) -> o_out raw. Asks: the
// layout TMA writes is the one the wgmma descriptors read, and the S accumulator re-packed is a
// valid A fragment. status[0] = 1 when a barrier wait gave up.
template <typename T, int D, int BLOCK_N>
__global__ void __launch_bounds__(128, 1)
probe_attn_tma(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
               const __grid_constant__ TensorMap v_map, int q_row, int k_row, int h, int hk, int b, int qslice,
               const float* o_init, float* s_out, float* o_out, int* status) {
  constexpr int kQBytes = 128 * D * 2, kTileBytes = BLOCK_N * D * 2, kSteps = BLOCK_N / 16;
  unsigned char* smem = probe_smem();
  u64* bars = reinterpret_cast<u64*>(smem);  // q_full, k_full, v_full
  unsigned char* sQ = smem + 1024;
  unsigned char* sK = sQ + kQBytes;
  unsigned char* sV = sK + kTileBytes;
  if (threadIdx.x == 0) {
    for (int i = 0; i < 3; ++i) mbar_init(bars + i, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  if (threadIdx.x < 32 && elect_one()) {
    mbar_arrive_expect_tx(bars + 0, kQBytes);
    for (int c = 0; c < D / 64; ++c) tma_load_4d(sQ + c * 128 * 128, &q_map, bars + 0, c * 64, q_row, h, b);
    mbar_arrive_expect_tx(bars + 1, kTileBytes);
    for (int c = 0; c < D / 64; ++c) tma_load_4d(sK + c * BLOCK_N * 128, &k_map, bars + 1, c * 64, k_row, hk, b);
    mbar_arrive_expect_tx(bars + 2, kTileBytes);
    for (int c = 0; c < D / 64; ++c) tma_load_4d(sV + c * BLOCK_N * 128, &v_map, bars + 2, c * 64, k_row, hk, b);
  }
  bounded_wait(bars + 0, 0, status);
  bounded_wait(bars + 1, 0, status);
  float s[BLOCK_N / 2];
#pragma unroll
  for (int i = 0; i < BLOCK_N / 2; ++i) s[i] = 0.f;
  const unsigned char* q = sQ + qslice * 64 * 128;
  wgmma_fence_operand(s);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, BLOCK_N, 0, 0>(s, wgmma_desc(q + (kk / 4) * 128 * 128 + (kk % 4) * 32, SWIZZLE_128B, 16, 1024),
                               wgmma_desc(sK + (kk / 4) * BLOCK_N * 128 + (kk % 4) * 32, SWIZZLE_128B, 16, 1024),
                               kk > 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(s);
  store_regs(s_out, s);
  u32 pa[kSteps][4];  // pack_p of flash_fwd_sm90.cu
  accumulator_as_a<T, BLOCK_N>(s, pa);
  float o[D / 2];
  load_regs(o, o_init);
  bounded_wait(bars + 2, 0, status);
  wgmma_fence_operand(o);
  wgmma_fence();
#pragma unroll
  for (int kc = 0; kc < kSteps; ++kc)
    wgmma_rs<T, D, 1>(o, pa[kc], wgmma_desc(sV + kc * 16 * 128, SWIZZLE_128B, BLOCK_N * 128, 1024), true);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(o);
  store_regs(o_out, o);
}

// The fragment-table probes (A = identity-like, B = index-encoding, so that every output register
// names the (row, col) it holds) are probe_qk<__half, 256, 64> and probe_pv<__half, 64, 64> with
// special data: see test_hopper_isa_gpu.py.
