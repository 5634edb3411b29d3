/*
flash_bwd_sm90.cu — dK, dV (and atomic dQ) of one backward ring step on Hopper (sm_90a): wgmma,
bulk tensor copies (TMA), mbarriers and warp specialisation.

ALGORITHM
The contract of flash_bwd.cu's flash_bwd_dkdv (read its opening comment first): K and V of one
rank stay, the bundle (Q, dO, lse, delta and the fp32 dQ accumulator) visits; a block of threads
owns 128 keys (64 at D = 256) of one (batch, kv head) and, for every query head of that kv head's
group and every query tile of BLOCK_M rows that sees one of its keys (query_tiles, params.cuh),
computes

    S^T  = K Q^T                         P^T = exp2(S^T * scale * log2e - lse * log2e)
    dP^T = V dO^T                        dS^T = P^T o (dP^T - delta)
    dV  += P^T dO                        dK  += dS^T Q        (x scale at the end)
    dQ  += scale * dS K                  (DQ: fp32 atomics into the travelling accumulator)

with the products on wgmma and the operands copied by TMA:
  * one block = 3 warpgroups of 128 threads: warpgroup 0 is the producer (setmaxnreg.dec): one
    elected thread of warp 0 copies K and V once, then Q and dO of each query tile into a ring of
    STAGES buffers (cp.async.bulk.tensor, 128-byte swizzle, completing on full[s]); warp 1 copies
    the tile's lse (as lse * log2e, +inf where a row saw no key or lies past q_len, so P = 0
    there) and delta into the stage and arrives on full[s] too (1 + 32 arrivals a phase);
  * warpgroups 1 and 2 are consumers, 64 keys each (one wgmma m64; at D = 256 the same 64 keys
    and half of the head dims each, Split below): keys are the rows of S^T and dP^T, so P^T and
    dS^T, re-packed as A fragments (accumulator_as_a), feed dV += P^T dO and dK += dS^T Q
    straight from registers (Q and dO read N-major from shared memory: transposed by the
    instruction), and the dK, dV accumulators never leave registers until the end;
  * DQ: each consumer writes its dS^T into a shared BLOCK_M x keys tile of dS (K-major, 128-byte
    swizzle: the A operand of dQ = dS K; at D = 256, where both hold the same dS^T, consumer 0
    writes it), fence.proxy.async, named barrier 2 over both consumers;
    then each computes one block of dQ (query rows x head dims: for D = 128 and 256 the two halves
    of the head dim, for D = 64 the two halves of the 128 query rows) over all the keys, K read
    N-major, and adds it into global dQ with fp32 atomicAdd. Named barrier 1 keeps the next
    tile's dS from overwriting one the other consumer still reads;
  * the consumers free a stage (arrive on empty[s], 256 arrivals) once its last product is done.
The CTA is the only writer of its dK/dV rows in a launch: dk += scale * acc, dv += acc, plain
read-add-write after the last tile, as flash_bwd_dkdv does.

PIPELINE (per consumer; the producer runs STAGES query tiles ahead)
    producer:  K, V -> [kv_full]      Q_i, dO_i, lse2_i, delta_i -> [full[s]]    waits [empty[s]]
    consumer:  wait kv_full; for each query tile i (stage s):
                   wait full[s]; S^T = K Q_i^T, dP^T = V dO_i^T; wait_group 0
                   mask, P^T, dS^T -> A fragments
                   issue dV += P^T dO_i
                   (DQ, while it runs) bar 1; dS^T -> shared dS; fence.proxy.async; bar 2
                   issue dK += dS^T Q_i; wait_group 0; arrive empty[s]
                   (DQ) dQ_blk = dS K; wait_group 0; atomicAdd dQ_blk
    No overlap yet between one tile's softmax and the next tile's products (FlashAttention-3 runs
    two query tiles in flight and a separate dQ writer warp): the first Hopper backward is the
    plain schedule, measured before it is made clever.

SHARED MEMORY (dynamic, 1024-aligned by aligned_smem)
    K, V (keys x D each), then STAGES x (Q, dO: BLOCK_M x D each), (DQ) dS BLOCK_M x keys, then
    STAGES x (lse2, delta: BLOCK_M fp32 each), then the mbarriers; every matrix stored as D/64
    (dS: keys/64) column blocks of rows x 64 elements with the 128-byte swizzle (what a TMA box of
    (64, rows) writes and a wgmma descriptor with that swizzle reads; kernels/emu/emu_wgmma.h).
    D     BLOCK_M  keys  STAGES  smem (bytes, burstcu/build/bwd_variants.py: sm90_dkdv_smem_bytes)
    64    128      128   2       1024 + 2x16384 + 2x2x16384 + 32768 + 2x1024 + 128  = 134272 (DQ)
    128   64       128   2       1024 + 2x32768 + 2x2x16384 + 16384 + 2x512 + 128   = 149632 (DQ)
    256   64       64    2       1024 + 2x32768 + 2x2x32768 + 8192 + 2x512 + 128    = 206976 (DQ)
    Registers: 24 for the producer, 240 for a consumer thread, which holds dK and dV (D/2 fp32
    each; D = 256: 64 each, half the dims), S^T and dP^T (BLOCK_M/2 each), their A fragments
    (BLOCK_M/4 u32 each) and a dQ block (32; D = 256: 64): at most 192 of them live at once for
    every head dim, as the dQ product waits for dV and dK (issued together with them, the A
    fragments and dQ block were ~40 too many: ptxas spilled 156-236 bytes). The deterministic
    mode's dQ kernel stays flash_bwd.cu's.

MASKS AND NON-FINITE INPUTS
Masks are flash_bwd_dkdv's: P = 0 at masked pairs and at keys past k_len (TMA's zeros there give S
= 0, masked by the element test); rows past q_len read zeros and lse2 = +inf, so P = dS = 0. Only
the tiles a bound or a ragged end cuts run the element test. A step with masked pairs whose
inputs may hold Inf/NaN runs flash_bwd.cu's CAREFUL twin instead (the nonfinite flag: this kernel
returns at once when it is set), the launch pair of KernelOps.

BUILD
    python -m burstcu.build check --arch sm_90a --family bwd_dkdv_sm90,bwd_dkdv_nodq_sm90
    CPU emulator: burstcu.init(backend="emulated", arch="sm_90a"); tests in
    tests/kernels/test_flash_bwd_sm90_emulated.py. No GPU has run this file yet.
*/

#include "hopper.cuh"

namespace bwd90 {

constexpr int kWgKeys = 64;      // keys of S^T a consumer warpgroup computes (one wgmma m64)
constexpr int kThreads = 384;    // producer warpgroup + two consumers
constexpr int kColBlock = 64;    // elements of a 128-byte swizzled column block
constexpr int kConsumers = 256;  // threads that arrive on the empty barriers
constexpr int kStatLanes = 32;   // producer warp 1: lse2 and delta, one arrival a lane
// registers a thread after setmaxnreg (128 x 24 + 256 x 240 = 384 x 168)
constexpr int kRegsProducer = 24, kRegsConsumer = 240;
constexpr int kDsFreeBar = 1;    // named barrier 1: both consumers are done with the last dS
constexpr int kDsReadyBar = 2;   // named barrier 2: both consumers wrote this tile's dS
constexpr float kLog2e = 1.4426950408889634f;

// How the two consumers share a block of threads' work. D <= 128: by keys, 64 each (kBlockN =
// 128), each with every head dim of its dK, dV rows. D = 256: by head dims, 128 each of the same
// 64 keys (kBlockN = 64): dK + dV of 64 keys x 256 dims would take 256 registers a thread, so
// each consumer computes the same S^T and dP^T (2 of the 5 products twice: 7/5 of the work, as
// flash_bwd_dkdv's WARPS_D = 2 does) and keeps half of dK and dV. The dQ block of a consumer is
// 64 query rows x kDqCols head dims; the BM x D tile of dQ is two of them.
template <int D, int BM>
struct Split {
  static constexpr bool kByDims = D == 256;
  static constexpr int kBlockN = kByDims ? 64 : 128;     // keys a block of threads owns
  static constexpr int kDims = kByDims ? D / 2 : D;      // head dims of dK, dV a consumer holds
  static constexpr int kDqCols = kByDims ? 128 : 64;     // head dims of a consumer's dQ block
  static constexpr int kDqRowBlocks = BM / 64;           // its query rows: block wg % this
  static_assert(kDqRowBlocks * (D / kDqCols) == 2, "two dQ blocks a tile, one a consumer");
};

// Byte offsets inside the (1024-aligned) dynamic shared memory.
template <int D, int BM, int STAGES, bool DQ>
struct Smem {
  static constexpr int kBlockN = Split<D, BM>::kBlockN;
  static constexpr int kKvBytes = kBlockN * D * 2;        // the K or the V tile
  static constexpr int kQBytes = BM * D * 2;              // a Q or a dO tile
  static constexpr int kK = 0;
  static constexpr int kV = kKvBytes;
  static constexpr int kQ = 2 * kKvBytes;                 // stage s: kQ + s * kQBytes
  static constexpr int kDo = kQ + STAGES * kQBytes;       // stage s: kDo + s * kQBytes
  static constexpr int kDs = kDo + STAGES * kQBytes;      // BM x kBlockN (DQ)
  static constexpr int kDsBytes = DQ ? BM * kBlockN * 2 : 0;
  static constexpr int kStats = kDs + kDsBytes;           // stage s: lse2[BM] then delta[BM]
  static constexpr int kStatBytes = 2 * BM * 4;
  static constexpr int kBars = kStats + STAGES * kStatBytes;
  static constexpr int kNumBars = 1 + 2 * STAGES;         // kv_full, full[STAGES], empty[STAGES]
  static constexpr int kBytes = 1024 + kBars + 128;       // = bwd_variants.sm90_dkdv_smem_bytes
  static_assert(kNumBars * 8 <= 128, "barriers fit their 128 bytes");
  static_assert(kKvBytes % 1024 == 0 && kQBytes % 1024 == 0, "tiles keep 1024-byte alignment");
};

template <int STAGES>
struct Barriers {
  u64 *kv_full, *full, *empty;
  __device__ __forceinline__ explicit Barriers(u64* bars)
      : kv_full(bars), full(bars + 1), empty(bars + 1 + STAGES) {}
};

template <int STAGES>
__device__ __forceinline__ void advance(int& stage, u32& phase) {
  if (++stage == STAGES) {
    stage = 0;
    phase ^= 1;
  }
}

/* The body of flash_bwd_dkdv_sm90: the block of threads owns keys [n0, n0 + kBlockN) of kv head
   hkv, batch b (blockIdx x, y, z) of the rectangle p.blk. */
template <typename T, int D, int BM, int STAGES, bool DQ>
__device__ __forceinline__ void dkdv_fold(const BwdStepSm90Params& p) {
  using S = Smem<D, BM, STAGES, DQ>;
  using W = Split<D, BM>;
  constexpr int kBlockN = W::kBlockN;
  static_assert(D == 64 || D == 128 || D == 256, "head dims 64, 128 and 256");
  static_assert(BM == 64 || BM == 128, "wgmma N of S^T = K Q^T");
  constexpr int kColBlocks = D / kColBlock;
  if (*p.nonfinite != 0) return;  // flash_bwd.cu's careful twin of this launch pair runs
  const int n0 = blockIdx.x * kBlockN, hkv = blockIdx.y, b = blockIdx.z;
  if (!query_tiles<BM, kBlockN>(p.blk, n0).live) return;  // no query sees these keys

  const int tid = threadIdx.x;
  if (tid == 0) {
    u64* bars = reinterpret_cast<u64*>(aligned_smem() + S::kBars);
    mbar_init(bars, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 1 + s, 1 + kStatLanes);
      mbar_init(bars + 1 + STAGES + s, kConsumers);
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  // Each role reads the parameters and carves shared memory itself: nothing stays live across
  // setmaxnreg (flash_fwd_sm90.cu).
  const int warpgroup = tid / 128;
  if (warpgroup == 0) {
    // ============================== producer ==============================
    setmaxnreg_dec<kRegsProducer>();
    const int warp = tid / 32;
    if (warp > 1) return;
    unsigned char* smem = aligned_smem();
    const Barriers<STAGES> bar(reinterpret_cast<u64*>(smem + S::kBars));
    const QueryTiles tiles = query_tiles<BM, kBlockN>(p.blk, n0);
    const int group = p.H / p.Hkv, n_it = group * tiles.m_tiles;
    int stage = 0;
    u32 phase = 0;
    if (warp == 0) {
      if (!elect_one()) return;
      tma_prefetch_map(&p.q_map);
      tma_prefetch_map(&p.do_map);
      mbar_arrive_expect_tx(bar.kv_full, 2 * S::kKvBytes);
      for (int c = 0; c < kColBlocks; ++c) {
        tma_load_4d(smem + S::kK + c * kBlockN * 128, &p.k_map, bar.kv_full, c * kColBlock, n0, hkv, b);
        tma_load_4d(smem + S::kV + c * kBlockN * 128, &p.v_map, bar.kv_full, c * kColBlock, n0, hkv, b);
      }
      for (int it = 0; it < n_it; ++it) {
        const int h = hkv * group + it / tiles.m_tiles, m0 = tiles.m_begin + (it % tiles.m_tiles) * BM;
        mbar_wait(bar.empty + stage, phase ^ 1);
        mbar_arrive_expect_tx(bar.full + stage, 2 * S::kQBytes);
        for (int c = 0; c < kColBlocks; ++c) {
          tma_load_4d(smem + S::kQ + stage * S::kQBytes + c * BM * 128, &p.q_map, bar.full + stage,
                      c * kColBlock, m0, h, b);
          tma_load_4d(smem + S::kDo + stage * S::kQBytes + c * BM * 128, &p.do_map, bar.full + stage,
                      c * kColBlock, m0, h, b);
        }
        advance<STAGES>(stage, phase);
      }
    } else {  // warp 1: each tile's lse2 and delta (flash_bwd.cu's load_row_stats)
      const int lane = tid % 32;
      for (int it = 0; it < n_it; ++it) {
        const int h = hkv * group + it / tiles.m_tiles, m0 = tiles.m_begin + (it % tiles.m_tiles) * BM;
        const long long row0 = b * p.stat_stride.b + h * p.stat_stride.h + p.blk.q_start + m0;
        const int rows = p.blk.q_len - m0;  // rows of the tile inside the rectangle
        mbar_wait(bar.empty + stage, phase ^ 1);
        float* lse2 = reinterpret_cast<float*>(smem + S::kStats + stage * S::kStatBytes) + lane;
#pragma unroll
        for (int r = 0; r < BM; r += 32) {
          const bool valid = lane + r < rows;
          const float l = valid ? p.lse[row0 + lane + r] : -INFINITY;
          lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;
          lse2[BM + r] = valid ? p.delta[row0 + lane + r] : 0.f;
        }
        mbar_arrive(bar.full + stage);
        advance<STAGES>(stage, phase);
      }
    }
    return;
  }

  // ============================== consumers ==============================
  setmaxnreg_inc<kRegsConsumer>();
  unsigned char* smem = aligned_smem();
  const Barriers<STAGES> bar(reinterpret_cast<u64*>(smem + S::kBars));
  const BlockRect& rect = p.blk;  // read in place: constant-bank operands
  const QueryTiles tiles = query_tiles<BM, kBlockN>(rect, n0);
  const int group = p.H / p.Hkv, n_it = group * tiles.m_tiles;
  const int wg = warpgroup - 1;           // 0 or 1: its keys (D <= 128) or head dims (D = 256)
  const int ct = tid - 128 * warpgroup;   // thread within the warpgroup
  const int warp = ct / 32, lane = ct % 32;
  const int g = lane / 4, tq = lane % 4;  // fragment coordinates: row group, thread in group
  const float scale_log2 = p.scale * kLog2e;
  const int n0_wg = n0 + (W::kByDims ? 0 : wg * kWgKeys);  // this warpgroup's first key
  const int dim0 = W::kByDims ? wg * W::kDims : 0;          // ... and first head dim of dK, dV
  const int key0 = n0_wg + warp * 16 + g; // this thread's keys: key0 and key0 + 8

  // wgmma descriptors (flash_fwd_sm90.cu and kernels/emu/emu_wgmma.h explain the layouts):
  //   K, V rows of this warpgroup as A (K-major), Q and dO as B of S^T, dP^T (K-major): a k16
  //   step is +32 bytes in a column block, the next column block rows x 128 bytes on;
  //   Q, dO as B of dK, dV (N-major over the head dim: LBO = BM x 128, the next 64 head dims;
  //   SBO = 1024, 8 query rows): a k16 step is 16 query rows = 2048 bytes;
  //   dS as A of dQ (K-major over keys, kBlockN / 64 column blocks of BM rows); K as B of dQ
  //   (N-major over the head dim, LBO = kBlockN x 128): a k16 step is 16 keys = 2048 bytes.
  const u32 kv_rows = (n0_wg - n0) * 128;  // this warpgroup's keys in the K, V tiles
  const u64 k_base = wgmma_desc(smem + S::kK + kv_rows, SWIZZLE_128B, 16, 1024);
  const u64 v_base = wgmma_desc(smem + S::kV + kv_rows, SWIZZLE_128B, 16, 1024);
  const u64 q_base = wgmma_desc(smem + S::kQ, SWIZZLE_128B, 16, 1024);
  const u64 do_base = wgmma_desc(smem + S::kDo, SWIZZLE_128B, 16, 1024);
  const u32 dims = (dim0 / kColBlock) * BM * 128;  // this warpgroup's head dims of Q, dO
  const u64 qt_base = wgmma_desc(smem + S::kQ + dims, SWIZZLE_128B, BM * 128, 1024);
  const u64 dot_base = wgmma_desc(smem + S::kDo + dims, SWIZZLE_128B, BM * 128, 1024);
  auto kmajor = [](int rows, int kk) { return (kk / 4) * rows * 128 + (kk % 4) * 32; };
  // this consumer's block of dQ: query rows 64 rb .., head dims dq_col0 .. + kDqCols
  const int rb = wg % W::kDqRowBlocks, dq_col0 = (wg / W::kDqRowBlocks) * W::kDqCols;
  const u64 ds_base = DQ ? wgmma_desc(smem + S::kDs + rb * 64 * 128, SWIZZLE_128B, 16, 1024) : 0;
  const u32 k_dims = (dq_col0 / kColBlock) * kBlockN * 128;  // the dQ block's head dims of K
  const u64 kt_base = DQ ? wgmma_desc(smem + S::kK + k_dims, SWIZZLE_128B, kBlockN * 128, 1024) : 0;

  float dk[W::kDims / 2], dv[W::kDims / 2];  // rows: this warpgroup's keys, columns: its head dims
#pragma unroll
  for (int i = 0; i < W::kDims / 2; ++i) dk[i] = dv[i] = 0.f;
  float st[BM / 2], dpt[BM / 2];  // S^T, dP^T: rows keys, columns the tile's queries
  u32 pa[BM / 16][4], dsa[BM / 16][4];  // P^T, dS^T as A fragments (k16 steps over queries)
  float dqb[DQ ? W::kDqCols / 2 : 1];   // the dQ block (64 x kDqCols)

  mbar_wait(bar.kv_full, 0);
  int stage = 0;
  u32 phase = 0;
  for (int it = 0; it < n_it; ++it) {
    const int h = hkv * group + it / tiles.m_tiles, m0 = tiles.m_begin + (it % tiles.m_tiles) * BM;
    const u32 q_off = stage * S::kQBytes;
    mbar_wait(bar.full + stage, phase);
    wgmma_fence_operand(st);
    wgmma_fence_operand(dpt);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, BM, 0, 0>(st, wgmma_desc_at(k_base, kmajor(kBlockN, kk)),
                            wgmma_desc_at(q_base, q_off + kmajor(BM, kk)), kk > 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, BM, 0, 0>(dpt, wgmma_desc_at(v_base, kmajor(kBlockN, kk)),
                            wgmma_desc_at(do_base, q_off + kmajor(BM, kk)), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(st);
    wgmma_fence_operand(dpt);

    // ---- P^T and dS^T in place; only a tile that a bound or a ragged end cuts runs the test
    const float* lse2 = reinterpret_cast<const float*>(smem + S::kStats + stage * S::kStatBytes);
    const float* dlt = lse2 + BM;
    const bool need_mask = n0_wg + kWgKeys > rect.k_len ||
                           rect.k_pos + n0_wg + kWgKeys - 1 > rect.q_pos + m0 + rect.hi ||
                           rect.k_pos + n0_wg < rect.q_pos + m0 + BM - 1 - rect.lo;
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = key0 + (i >= 2 ? 8 : 0), qi = 8 * j + 2 * tq + (i & 1);
          const int offset = rect.k_pos + key - rect.q_pos - m0 - qi;  // key - query position
          if (key >= rect.k_len || offset > rect.hi || offset < -rect.lo) st[4 * j + i] = -INFINITY;
        }
    }
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int qi = 8 * j + 2 * tq + (i & 1);
        const float pv = exp2f(fmaf(st[4 * j + i], scale_log2, -lse2[qi]));
        st[4 * j + i] = pv;
        dpt[4 * j + i] = pv * (dpt[4 * j + i] - dlt[qi]);
      }
    accumulator_as_a<T, BM>(st, pa);
    accumulator_as_a<T, BM>(dpt, dsa);

    // ---- dV += P^T dO (A from registers); meanwhile (DQ) dS^T into shared memory; dK += dS^T Q
    wgmma_fence_operand(dv);
    wgmma_fence_operand(dk);
    wgmma_fence_operand(pa);
    wgmma_fence_operand(dsa);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < BM / 16; ++kc)
      wgmma_rs<T, W::kDims, 1>(dv, pa[kc], wgmma_desc_at(dot_base, q_off + kc * 2048), true);
    wgmma_commit();
    if constexpr (DQ) {
      // dS^T (rounded as dsa holds it) into the shared dS tile, before dK += dS^T Q is issued:
      // the A registers of a wgmma in flight may not even be read (PTX ISA, wgmma.wait_group).
      // Query rows x keys, K-major: the thread's key kl = n0_wg - n0 + 16 warp + g (+8) sits in
      // column block (n0_wg - n0) / 64, 16-byte chunk 2 warp (+1) of its row; query qi = 8j +
      // 2tq (+1) is the row, whose chunks the 128-byte swizzle permutes by qi % 8 = 2tq (+1). So
      // an element's byte is one of four per-thread offsets (+8 key, +1 query) plus 1024 j: four
      // values held, not one address an element (ptxas hoisted those out of the tile loop and
      // spilled 124-256 bytes). D = 256: both consumers hold the same dS^T, consumer 0 writes it.
      named_bar_sync(kDsFreeBar, kConsumers);
      if (!W::kByDims || wg == 0) {
        int ds_at[2][2];  // [key +8][query +1]: byte offsets in shared memory
#pragma unroll
        for (int hk = 0; hk < 2; ++hk)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            ds_at[hk][e] = S::kDs + ((n0_wg - n0) / 64) * BM * 128 + 2 * g + (2 * tq + e) * 128 +
                           (((2 * warp + hk) ^ (2 * tq + e)) * 16);
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const u32 word = dsa[j / 2][2 * (j & 1) + i / 2];
            u16* at = reinterpret_cast<u16*>(smem + ds_at[i / 2][i & 1] + 1024 * j);
            *at = u16(word >> (16 * (i & 1)));
          }
      }
      fence_proxy_async();
      named_bar_sync(kDsReadyBar, kConsumers);
      wgmma_fence();
    }
#pragma unroll
    for (int kc = 0; kc < BM / 16; ++kc)
      wgmma_rs<T, W::kDims, 1>(dk, dsa[kc], wgmma_desc_at(qt_base, q_off + kc * 2048), true);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operand(dv);
    wgmma_fence_operand(dk);
    wgmma_fence_operand(pa);
    wgmma_fence_operand(dsa);
    mbar_arrive(bar.empty + stage);  // Q, dO and the stats of this stage are read

    if constexpr (DQ) {
      // ---- the dQ block = dS K over the tile's kBlockN keys, added with fp32 atomics (dK and dV
      // alone stay live beside it: 2 x kDims/2 + kDqCols/2 registers)
      wgmma_fence_operand(dqb);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_ss<T, W::kDqCols, 0, 1>(dqb, wgmma_desc_at(ds_base, kmajor(BM, kk)),
                              wgmma_desc_at(kt_base, kk * 2048), kk > 0);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(dqb);
      const float scale = p.scale;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = m0 + rb * 64 + warp * 16 + g + (i >= 2 ? 8 : 0);
        if (row >= rect.q_len) continue;
        float* dst = p.dq + b * p.dq_stride.b + (long long)(rect.q_start + row) * p.dq_stride.s +
                     h * p.dq_stride.h + dq_col0 + 2 * tq + (i & 1);
#pragma unroll
        for (int j = 0; j < W::kDqCols / 8; ++j) atomicAdd(dst + 8 * j, scale * dqb[4 * j + i]);
      }
    }
    advance<STAGES>(stage, phase);
  }

  // ---- dK, dV: this block of threads is their only writer in the launch
  const float scale = p.scale;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int key = key0 + (i >= 2 ? 8 : 0);
    if (key >= rect.k_len) continue;
    const long long row = b * p.dk_stride.b + (long long)(rect.k_start + key) * p.dk_stride.s +
                          hkv * p.dk_stride.h + dim0;
#pragma unroll
    for (int j = 0; j < W::kDims / 8; ++j) {
      const long long at = row + 8 * j + 2 * tq + (i & 1);
      p.dk[at] += scale * dk[4 * j + i];
      p.dv[at] += dv[4 * j + i];
    }
  }
}

}  // namespace bwd90

/* dK, dV (DQ: and dQ by fp32 atomics) of the rectangle p.blk: BwdStepSm90Params (kernels/params.cuh).
   grid (ceil(k_len / kBlockN), Hkv, B) (kBlockN 128, at D = 256 64), block 384 threads, dynamic
   smem bwd90::Smem<...>::kBytes.
   Returns at once when *p.nonfinite is set (flash_bwd.cu's careful twin runs instead). */
template <typename T, int D, int BM, int STAGES, bool DQ>
__global__ void __launch_bounds__(bwd90::kThreads, 1)
flash_bwd_dkdv_sm90(const __grid_constant__ BwdStepSm90Params p) {
  bwd90::dkdv_fold<T, D, BM, STAGES, DQ>(p);
}
