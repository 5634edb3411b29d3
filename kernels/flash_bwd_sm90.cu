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
  * one block = 3 warpgroups of 128 threads: warpgroup 0 is the producer (setmaxnreg.dec). One
    thread of warp 2 walks the query tiles (the rectangles in order, each one's query heads and
    tiles) and describes each in a free stage (TileMeta: rectangle, first row, head, whether it
    ends its rectangle), arriving on described[s] and full[s]; after the last tile one more stage
    says the walk is over. Warps 0 and 1 follow the descriptions, so none of the walk sits in
    their 24 registers: one elected thread of warp 0 copies K and V once, then Q and dO of each
    tile into the stage (cp.async.bulk.tensor, 128-byte swizzle, completing on full[s]); warp 1
    copies the tile's lse (as lse * log2e, +inf where a row saw no key or lies past q_len, so P
    = 0 there) and delta into the stage and arrives on full[s] too (1 + 32 + 1 arrivals a phase);
  * warpgroups 1 and 2 are consumers, 64 keys each (one wgmma m64; at D = 256 the same 64 keys
    and half of the head dims each, Split below): keys are the rows of S^T and dP^T, so P^T and
    dS^T, re-packed as A fragments (accumulator_as_a), feed dV += P^T dO and dK += dS^T Q
    straight from registers (Q and dO read N-major from shared memory: transposed by the
    instruction), and the dK, dV accumulators never leave registers until the rectangle ends
    (a rectangle's first products overwrite them: wgmma's scale-d predicate off);
  * DQ: each consumer writes its dS^T into a shared BLOCK_M x keys tile of dS (K-major, 128-byte
    swizzle: the A operand of dQ = dS K; at D = 256, where both hold the same dS^T, consumer 0
    writes it), fence.proxy.async, named barrier 2 over both consumers;
    then each computes one block of dQ (query rows x head dims: for D = 128 and 256 the two halves
    of the head dim, for D = 64 the two halves of the 128 query rows) over all the keys, K read
    N-major, and adds it into global dQ (p.dq_adds, set by the host): DQ = kDqAtomic with fp32
    atomics, two floats an instruction (red.global.add.v2.f32, dq_adds 2) where dq's rows sit on
    16 bytes at non-negative strides and D <= 128, else one (atomicAdd, 1); DQ = kDqBulk (D <=
    128) through a shared staging tile and bulk tensor reductions (cp.reduce.async.bulk.tensor
    .add, dq_adds 3: one thread a consumer issues them, the others go on), or one float an
    atomic add where dq's rows are not so. KernelOps.sm90_dq_adds chooses ("pairs", "singles", "bulk"). Named barrier 1 keeps the next
    tile's dS from overwriting one the other consumer still reads;
  * the consumers free a stage (arrive on empty[s], 256 arrivals) once its last product is done.
The CTA is the only writer of its dK/dV rows in a launch: dk += scale * acc, dv += acc, plain
read-add-write after a rectangle's last tile, as flash_bwd_dkdv does.

RECTANGLE LISTS (flash_bwd_dkdv_steps_sm90, LIST = true; flash_bwd_dkdv_sm90 is the same body with
LIST false, p.blk its one rectangle)
A ring step of many rectangles (packed documents) runs in one launch, on the lists flash_bwd.cu's
flash_bwd_dkdv_steps takes (rects grouped by key range, each group's in the step's order; a block
of threads finds its group and key tile with step_group_of, params.cuh). The tensor maps cover
the whole q, dO, k and v arrays, built once a launch; a rectangle's rows are reached through the
copies' row coordinates (q_start + m0, k_start + n0). The rectangles of a group share their keys,
so K and V are copied once; the walk runs on from one rectangle to the next through the same
stages, and at each rectangle's end the consumers add dK and dV into global memory, as a launch
of its own would: a list gives the bits of one launch a rectangle in its order (dQ's atomic adds
aside, whose order varies anyway). Rows past a rectangle's q_len or k_len are now the arrays'
next rows, not zeros: P = 0 there (lse2 = +inf, keys masked), but a non-finite Q, dO, K or V
there would reach a gradient as 0 x Inf on the tensor cores, so a list with a row count off the
tiles launches the careful pair, as a list with masked pairs does (burstcu/ops/cuda/backward.py).

PIPELINE (per consumer; the producer runs STAGES query tiles ahead)
    producer:  warp 2: waits [empty[s]]; TileMeta_i -> [described[s]], [full[s]]
               warp 0: K, V -> [kv_full]; wait [described[s]]; Q_i, dO_i -> [full[s]]
               warp 1: wait [described[s]]; lse2_i, delta_i -> [full[s]]
    consumer:  wait kv_full; for each query tile i (stage s):
                   wait full[s]; issue S^T = K Q_i^T; issue dP^T = V dO_i^T
                   wait_group 1 (S^T); mask, P^T -> A fragments, while dP^T runs
                   issue dV += P^T dO_i; wait_group 1 (dP^T); dS^T -> A fragments, while dV runs
                   (DQ) bar 1; dS^T -> shared dS; fence.proxy.async; bar 2
                   issue dK += dS^T Q_i
                   (DQ) wait_group 1 (dV); issue dQ_blk = dS K, while dK runs
                   wait_group 1 (dK; dQ after dK or no DQ: 0); arrive empty[s]
                   (DQ) (dQ after dK: issue dQ_blk = dS K) wait_group 0; atomic adds of dQ_blk
                        (pairs or singles), or (bulk) wait_group.read; bar; dQ_blk -> staging;
                        fence; bar; reductions
                   (the rectangle's last tile) dK, dV += the accumulators
    So a warpgroup's tensor cores wait for the part of P^T's mask and exp2 that outlasts dP^T's
    products, for dS^T beyond dV's, and for the dQ adds. Where the registers do not allow it
    (the kernel's kDvEarly and kDqUnderDk), S^T and dP^T are awaited together and P^T, dS^T
    formed together before dV is issued (D = 64, whose 128 query rows double S^T, dP^T and their
    fragments: 48 bytes spilled; D = 256 in the list kernel with dQ), or dQ is issued after dK
    has retired (D = 256, whose dQ block is 64 registers: ptxas serialized every wgmma). Not yet:
    one tile's dQ adds under the next tile's products, and the two consumers out of step (they
    meet at bars 1 and 2 every tile; FlashAttention-3's backward keeps the same meeting).

SHARED MEMORY (dynamic, 1024-aligned by aligned_smem)
    K, V (keys x D each), then STAGES x (Q, dO: BLOCK_M x D each), (DQ) dS BLOCK_M x keys, (bulk
    dQ) the fp32 staging BLOCK_M x D (two 64 x 64 blocks, each two swizzled boxes of 64 x 32), then
    STAGES x (lse2, delta: BLOCK_M fp32 each; the TileMeta, 16 bytes), then the mbarriers (kv_full,
    full, empty, described: 1 + 3 x STAGES); every matrix stored as D/64
    (dS: keys/64) column blocks of rows x 64 elements with the 128-byte swizzle (what a TMA box of
    (64, rows) writes and a wgmma descriptor with that swizzle reads; kernels/emu/emu_wgmma.h).
    D     BLOCK_M  keys  STAGES  smem (bytes, burstcu/build/bwd_variants.py: sm90_dkdv_smem_bytes)
    64    128      128   2       1024 + 2x16384 + 2x2x16384 + 32768 + 2x1040 + 128  = 134304 (DQ)
    128   64       128   2       1024 + 2x32768 + 2x2x16384 + 16384 + 2x528 + 128   = 149664 (DQ)
    256   64       64    2       1024 + 2x32768 + 2x2x32768 + 8192 + 2x528 + 128    = 207008 (DQ)
    bulk dQ (D 64 and 128): + 32768 for the staging, 167072 and 182432
    Registers: 24 for the producer, 240 for a consumer thread, which holds dK and dV (D/2 fp32
    each; D = 256: 64 each, half the dims), S^T and dP^T (BLOCK_M/2 each), their A fragments
    (BLOCK_M/4 u32 each) and a dQ block (32; D = 256: 64). Live at once at D = 128: 208 (S^T,
    dP^T in flight, P^T's fragments and dK, dV: kDvEarly), 176 under dK (dS^T's fragments, the dQ
    block, dK, dV: kDqUnderDk); the dQ block waits for dV (issued together with dV and dK, the A
    fragments and dQ block were ~40 too many: ptxas spilled 156-236 bytes). At D = 256 the same
    two phases need 208 and 208 (a dQ block of 64): ptxas fit the first, not the second (it
    serialized every wgmma, C7512, which the gate fails). dQ in a pass of its
    own (the deterministic mode; head dim 256, where it was faster) is flash_bwd.cu's kernel.
    What the list kernel needed to stay at 0 bytes of local memory (the gate): one walker (warp
    2) instead of three, no value computed before setmaxnreg kept after it (each role finds its
    key block again), a tile's mask bounds formed from one corner offset, a rectangle's dK, dV
    started by the products rather than zeroed, and (LIST false) the one rectangle's dK, dV
    written after the loop, at the end of the walk.

MASKS AND NON-FINITE INPUTS
Masks are flash_bwd_dkdv's: P = 0 at masked pairs and at keys past k_len (the element test; LIST
false: TMA's zeros there give S = 0); rows past q_len get lse2 = +inf (LIST false: they also read
zeros), so P = dS = 0. Only the tiles a bound or a ragged end cuts run the element test. A packed
list (LIST, p.key_rows set: params.cuh; one rectangle a group, no key bound) runs it in every
tile, each key kept only for the query rows of its run: dK, dV within rounding of the rectangles'
launches, not their bits. A step with masked pairs (LIST: or rows that end inside a tile, whose
neighbours the whole-array maps read, or a packed list) whose inputs may hold Inf/NaN runs
flash_bwd.cu's CAREFUL twin instead (the nonfinite flag: this kernel returns at once when it is
set), the launch pair of burstcu/ops/cuda/backward.py.

BUILD
    python -m burstcu.build check --arch sm_90a --family bwd_dkdv_sm90,bwd_dkdv_nodq_sm90,\
        bwd_dkdv_bulk_sm90,bwd_dkdv_sm90_list,bwd_dkdv_nodq_sm90_list,bwd_dkdv_bulk_sm90_list
    CPU emulator: burstcu.init(backend="emulated", arch="sm_90a"); tests in
    tests/kernels/test_flash_bwd_sm90_emulated.py and test_flash_bwd_sm90_lists_emulated.py. First
    run on an H200 in bench/results/h200/run7: 153 of 154 kernel tests passed (the failure a test's
    wrong expectation), memcheck and racecheck clean; fwd+bwd at d = 128, S = 16K 1.03x torch
    flash, 0.6x cuDNN.
*/

#include "hopper.cuh"

namespace bwd90 {

constexpr int kWgKeys = 64;      // keys of S^T a consumer warpgroup computes (one wgmma m64)
constexpr int kThreads = 384;    // producer warpgroup + two consumers
constexpr int kColBlock = 64;    // elements of a 128-byte swizzled column block
constexpr int kConsumers = 256;  // threads that arrive on the empty barriers
constexpr int kStatLanes = 32;   // producer warp 1: lse2 and delta, one arrival a lane
constexpr int kFullArrivals = 1 + kStatLanes + 1;  // a stage's: warp 0 (with the bytes), warp 1, warp 2
// registers a thread after setmaxnreg (128 x 24 + 256 x 240 = 384 x 168)
constexpr int kRegsProducer = 24, kRegsConsumer = 240;
constexpr int kDsFreeBar = 1;    // named barrier 1: both consumers are done with the last dS
constexpr int kDsReadyBar = 2;   // named barrier 2: both consumers wrote this tile's dS
constexpr int kDqBar = 3;        // named barriers 3, 4: consumer 0's, 1's threads around its dQ staging
// dQ of the kernel's DQ parameter: none (dK, dV only), fp32 atomic adds, or bulk tensor reductions
enum : int { kDqNone = 0, kDqAtomic = 1, kDqBulk = 2 };
constexpr int kDqBoxCols = 32;   // fp32 head dims of a dQ reduction box: 128 bytes, the swizzle span
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
template <int D, int BM, int STAGES, int DQ>
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
  static constexpr int kDq = kDs + kDsBytes;              // (kDqBulk) fp32 dQ staging, BM x D
  static constexpr int kDqBytes = DQ == kDqBulk ? BM * D * 4 : 0;
  static constexpr int kStats = kDq + kDqBytes;           // stage s: lse2[BM], delta[BM], TileMeta
  static constexpr int kMeta = 2 * BM * 4;                // the TileMeta within a stage's stats
  static constexpr int kStatBytes = kMeta + 16;
  static constexpr int kBars = kStats + STAGES * kStatBytes;
  static constexpr int kNumBars = 1 + 3 * STAGES;         // kv_full, full, empty, described [STAGES]
  static constexpr int kBytes = 1024 + kBars + 128;       // = bwd_variants.sm90_dkdv_smem_bytes
  static_assert(kNumBars * 8 <= 128, "barriers fit their 128 bytes");
  static_assert(kKvBytes % 1024 == 0 && kQBytes % 1024 == 0, "tiles keep 1024-byte alignment");
};

// A query tile as the producer's warp 2 describes it in its stage, for the other producer warps
// and the consumers: its rectangle r (rect_at), first row m0 (counted from the rectangle's
// q_start) and query head h, and whether it ends its rectangle (the consumers then add dK and dV
// into global memory; the next tile's products start them again). After the last tile one more
// stage says kEndsWork and holds no tile.
struct TileMeta {
  int r, m0, h, ends;  // ends: 0, kEndsRect or kEndsWork
};
constexpr int kEndsRect = 1, kEndsWork = 2;

template <int STAGES>
struct Barriers {
  u64 *kv_full, *full, *empty, *described;
  __device__ __forceinline__ explicit Barriers(u64* bars)
      : kv_full(bars), full(bars + 1), empty(bars + 1 + STAGES), described(bars + 1 + 2 * STAGES) {}
};

template <int STAGES>
__device__ __forceinline__ void advance(int& stage, u32& phase) {
  if (++stage == STAGES) {
    stage = 0;
    phase ^= 1;
  }
}

// The block of threads' keys [n0, n0 + BN) and its rectangles rects[r_first .. r_end): LIST false,
// p.blk alone (r 0) and blockIdx.x the key tile; LIST, blockIdx.x is a key tile of a group of the
// step's list (step_group_of), whose rectangles share k_start and k_len.
template <bool LIST, int BN>
__device__ __forceinline__ void key_block(const BwdStepSm90Params& p, int& n0, int& r_first, int& r_end) {
  if constexpr (LIST) {
    const int g = step_group_of(p.groups, p.n_groups, blockIdx.x);
    n0 = (blockIdx.x - p.groups[p.n_groups + 1 + g]) * BN;
    r_first = p.groups[g];
    r_end = p.groups[g + 1];
  } else {
    n0 = blockIdx.x * BN;
    r_first = 0;
    r_end = 1;
  }
}

// Rectangle r of key_block's range, read in place: p.blk (LIST false: constant-bank operands),
// else p.rects[r] (global memory, read where used: a copy in registers spills the consumers).
template <bool LIST>
__device__ __forceinline__ const BlockRect& rect_at(const BwdStepSm90Params& p, int r) {
  if constexpr (LIST) return p.rects[r];
  else return p.blk;
}

// Row coordinates of a rectangle's first query and first key in the tensor maps: 0 where the maps
// cover the rectangle's rows alone (LIST false), its q_start / k_start where they cover the arrays.
template <bool LIST>
__device__ __forceinline__ int map_q_row(const BlockRect& r) { return LIST ? r.q_start : 0; }
template <bool LIST>
__device__ __forceinline__ int map_k_row(const BlockRect& r) { return LIST ? r.k_start : 0; }

/* The body of flash_bwd_dkdv_sm90 (LIST false) and flash_bwd_dkdv_steps_sm90 (LIST true): the block
   of threads owns keys [n0, n0 + kBlockN) of kv head hkv, batch b (blockIdx y, z) of each of its
   rectangles (key_block) and runs them in order, each as its own launch would: its query heads
   and tiles through the one pipeline (the stages and phases run on across rectangles), then dK
   and dV added into global memory (the next rectangle's first products overwrite the
   accumulators). */
template <typename T, int D, int BM, int STAGES, int DQ, bool LIST>
__device__ __forceinline__ void dkdv_fold(const BwdStepSm90Params& p) {
  using S = Smem<D, BM, STAGES, DQ>;
  using W = Split<D, BM>;
  constexpr int kBlockN = W::kBlockN;
  // dQ added two floats at a time where dq_adds allows: up to D = 128 (at 256 the list kernel's 64
  // dQ values a thread leave no room for it: 32 bytes spilled; dQ takes its own pass there)
  constexpr bool kDqPairs = D <= 128;
  // S^T and dP^T awaited one at a time, dV's products issued before dP^T is awaited (the
  // consumer loop), where the registers allow: at D = 64 (128 query rows) they spilled 48 bytes,
  // at D = 256 in the list kernel with dQ 4 bytes (and 4 with the waits alone split)
  constexpr bool kDvEarly = D != 64 && !(D == 256 && LIST && DQ);
  // (DQ) the dQ block's products issued under dK's rather than after them, where the registers
  // allow: at D = 256 (a dQ block of 64 registers) ptxas serialized every wgmma (C7512)
  constexpr bool kDqUnderDk = DQ && D != 256;
  static_assert(D == 64 || D == 128 || D == 256, "head dims 64, 128 and 256");
  static_assert(BM == 64 || BM == 128, "wgmma N of S^T = K Q^T");
  static_assert(DQ != kDqBulk || W::kDqCols == 64, "bulk dQ: a consumer's block is 64 x 64 (D <= 128)");
  constexpr int kColBlocks = D / kColBlock;
  if (*p.nonfinite != 0) return;  // flash_bwd.cu's careful twin of this launch pair runs
  {
    int n0, r_first, r_end;
    key_block<LIST, kBlockN>(p, n0, r_first, r_end);
    bool live = false;
    for (int r = r_first; r < r_end && !live; ++r)
      live = query_tiles<BM, kBlockN>(rect_at<LIST>(p, r), n0).live;
    if (!live) return;  // no query sees these keys
  }

  const int tid = threadIdx.x;
  if (tid == 0) {
    u64* bars = reinterpret_cast<u64*>(aligned_smem() + S::kBars);
    mbar_init(bars, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bars + 1 + s, kFullArrivals);
      mbar_init(bars + 1 + STAGES + s, kConsumers);
      mbar_init(bars + 1 + 2 * STAGES + s, 1);
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
    const int hkv = blockIdx.y, b = blockIdx.z;
    int n0, r_first, r_end;
    key_block<LIST, kBlockN>(p, n0, r_first, r_end);
    const int warp = tid / 32;
    if (warp > 2) return;
    unsigned char* smem = aligned_smem();
    const Barriers<STAGES> bar(reinterpret_cast<u64*>(smem + S::kBars));
    int stage = 0;
    u32 phase = 0;
    if (warp == 2) {  // the walk over the tiles: each one's TileMeta into its stage
      if (!elect_one()) return;
      const int group = p.H / p.Hkv, h_end = (hkv + 1) * group;
      for (int r = r_first; r < r_end; ++r) {
        const QueryTiles tiles = query_tiles<BM, kBlockN>(rect_at<LIST>(p, r), n0);
        if (!tiles.live) continue;
        const int m_end = tiles.m_begin + tiles.m_tiles * BM;
        for (int h = hkv * group; h < h_end; ++h)
          for (int m0 = tiles.m_begin; m0 < m_end; m0 += BM) {
            mbar_wait(bar.empty + stage, phase ^ 1);
            TileMeta* meta = reinterpret_cast<TileMeta*>(smem + S::kStats + stage * S::kStatBytes + S::kMeta);
            meta->r = r;
            meta->m0 = m0;
            meta->h = h;
            meta->ends = h + 1 < h_end || m0 + BM < m_end ? 0 : kEndsRect;
            mbar_arrive(bar.described + stage);
            mbar_arrive(bar.full + stage);
            advance<STAGES>(stage, phase);
          }
      }
      mbar_wait(bar.empty + stage, phase ^ 1);  // the end of the walk
      reinterpret_cast<TileMeta*>(smem + S::kStats + stage * S::kStatBytes + S::kMeta)->ends = kEndsWork;
      mbar_arrive(bar.described + stage);
      mbar_arrive(bar.full + stage);
      return;
    }
    // warps 0 and 1 follow the descriptions: nothing of the walk in their 24 registers
    const bool copies = warp == 0;
    if (copies && !elect_one()) return;
    if (copies) {  // K and V once
      tma_prefetch_map(&p.q_map);
      tma_prefetch_map(&p.do_map);
      const int k_row = map_k_row<LIST>(rect_at<LIST>(p, r_first)) + n0;  // the group's keys
      mbar_arrive_expect_tx(bar.kv_full, 2 * S::kKvBytes);
      for (int c = 0; c < kColBlocks; ++c) {
        tma_load_4d(smem + S::kK + c * kBlockN * 128, &p.k_map, bar.kv_full, c * kColBlock, k_row, hkv, b);
        tma_load_4d(smem + S::kV + c * kBlockN * 128, &p.v_map, bar.kv_full, c * kColBlock, k_row, hkv, b);
      }
    }
    for (;; advance<STAGES>(stage, phase)) {
      mbar_wait(bar.described + stage, phase);
      unsigned char* stats = smem + S::kStats + stage * S::kStatBytes;
      const TileMeta& tile = *reinterpret_cast<const TileMeta*>(stats + S::kMeta);
      if (tile.ends == kEndsWork) {  // no tile: the stage completes for the consumers to read it
        mbar_arrive(bar.full + stage);
        return;
      }
      const int h = tile.h, m0 = tile.m0;
      const BlockRect& rect = rect_at<LIST>(p, tile.r);
      if (copies) {  // warp 0: the tile's Q and dO
        const int q_row = map_q_row<LIST>(rect) + m0;
        mbar_arrive_expect_tx(bar.full + stage, 2 * S::kQBytes);
        for (int c = 0; c < kColBlocks; ++c) {
          tma_load_4d(smem + S::kQ + stage * S::kQBytes + c * BM * 128, &p.q_map, bar.full + stage,
                      c * kColBlock, q_row, h, b);
          tma_load_4d(smem + S::kDo + stage * S::kQBytes + c * BM * 128, &p.do_map, bar.full + stage,
                      c * kColBlock, q_row, h, b);
        }
      } else {  // warp 1: its lse2 and delta (flash_bwd.cu's load_row_stats)
        const int lane = tid % 32;
        const long long row0 = b * p.stat_stride.b + h * p.stat_stride.h + rect.q_start + m0;
        const int rows = rect.q_len - m0;  // rows of the tile inside the rectangle
        float* lse2 = reinterpret_cast<float*>(stats) + lane;
#pragma unroll
        for (int i = 0; i < BM; i += 32) {
          const bool valid = lane + i < rows;
          const float l = valid ? p.lse[row0 + lane + i] : -INFINITY;
          lse2[i] = l == -INFINITY ? INFINITY : l * kLog2e;
          lse2[BM + i] = valid ? p.delta[row0 + lane + i] : 0.f;
        }
        mbar_arrive(bar.full + stage);
      }
    }
    return;
  }

  // ============================== consumers ==============================
  setmaxnreg_inc<kRegsConsumer>();
  const int hkv = blockIdx.y, b = blockIdx.z;
  int n0, r_first, r_end;
  key_block<LIST, kBlockN>(p, n0, r_first, r_end);
  unsigned char* smem = aligned_smem();
  const Barriers<STAGES> bar(reinterpret_cast<u64*>(smem + S::kBars));
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

  // rows: this warpgroup's keys, columns: its head dims; a rectangle's first products overwrite
  // them (the scale-d predicate off) rather than the accumulators being zeroed at its end: a zeroing
  // on one branch of the loop made ptxas copy them all there, and spill
  float dk[W::kDims / 2], dv[W::kDims / 2];

  // ---- a rectangle's dK, dV: this block of threads is their only writer in the launch. LIST
  // false: after the loop (a write inside it kept its addresses in registers through the loop)
  auto add_dkdv = [&]() {
    int r = r_first;
    asm volatile("" : "+r"(r));  // its address is formed here, not held through the loop
    const BlockRect& keys = rect_at<LIST>(p, r);  // every rectangle's k_start and k_len
    const float scale = p.scale;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = key0 + (i >= 2 ? 8 : 0);
      if (key >= keys.k_len) continue;
      const long long row = b * p.dk_stride.b + (long long)(keys.k_start + key) * p.dk_stride.s +
                            hkv * p.dk_stride.h + dim0;
#pragma unroll
      for (int j = 0; j < W::kDims / 8; ++j) {
        const long long at = row + 8 * j + 2 * tq + (i & 1);
        p.dk[at] += scale * dk[4 * j + i];
        p.dv[at] += dv[4 * j + i];
      }
    }
  };

  mbar_wait(bar.kv_full, 0);
  if constexpr (DQ == kDqBulk)
    if (ct == 0 && p.dq_adds == 3) tma_prefetch_map(&p.dq_map);
  int stage = 0;
  u32 phase = 0;
  // the query tiles as the producer's warp 2 describes them (TileMeta), in its order
  for (bool fresh = true;; advance<STAGES>(stage, phase)) {  // fresh: the tile starts a rectangle
    const u32 q_off = stage * S::kQBytes;
    mbar_wait(bar.full + stage, phase);
    const unsigned char* stats = smem + S::kStats + stage * S::kStatBytes;
    const TileMeta& tile = *reinterpret_cast<const TileMeta*>(stats + S::kMeta);
    if (tile.ends == kEndsWork) {  // the walk's end
      if constexpr (!LIST) add_dkdv();
      if constexpr (DQ == kDqBulk)
        if (ct == 0) bulk_wait_group<0>();  // the last reductions done before the block ends
      return;
    }
    float st[BM / 2], dpt[BM / 2];  // S^T, dP^T: rows keys, columns the tile's queries
    u32 pa[BM / 16][4], dsa[BM / 16][4];  // P^T, dS^T as A fragments (k16 steps over queries)
    float dqb[DQ ? W::kDqCols / 2 : 1];   // the dQ block (64 x kDqCols)
    wgmma_fence_operand(st);
    wgmma_fence_operand(dpt);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, BM, 0, 0>(st, wgmma_desc_at(k_base, kmajor(kBlockN, kk)),
                            wgmma_desc_at(q_base, q_off + kmajor(BM, kk)), kk > 0);
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wgmma_ss<T, BM, 0, 0>(dpt, wgmma_desc_at(v_base, kmajor(kBlockN, kk)),
                            wgmma_desc_at(do_base, q_off + kmajor(BM, kk)), kk > 0);
    wgmma_commit();
    if constexpr (kDvEarly) {
      wgmma_wait<1>();  // S^T ready; dP^T still in flight while P^T is computed
    } else {
      wgmma_wait<0>();
      wgmma_fence_operand(dpt);
    }
    wgmma_fence_operand(st);

    // ---- P^T, then dS^T, in place; only a tile that a bound or a ragged end cuts runs the test
    const float* lse2 = reinterpret_cast<const float*>(stats);
    const float* dlt = lse2 + BM;
    const BlockRect& rect = rect_at<LIST>(p, tile.r);
    const int m0 = tile.m0;
    // key - query position at the warpgroup's first key and the tile's first row: every offset
    // of the tile is this + (key - n0_wg) - qi
    const int corner = rect.k_pos - rect.q_pos + n0_wg - m0;
    const int2* key_rows = LIST ? p.key_rows : nullptr;  // a packed list's (params.cuh): every tile
    const bool need_mask = n0_wg + kWgKeys > rect.k_len || corner + kWgKeys - 1 > rect.hi ||
                           corner - (BM - 1) < -rect.lo || key_rows != nullptr;
    if (need_mask) {
      // LIST: key key0 (+8) is seen by the tile's query rows [q_first, q_end) (all of them, or,
      // packed, its run's; a key past k_len by none), loaded here: no registers held across tiles
      int q_first[2] = {0, 0}, q_end[2] = {BM, BM};
      if (key_rows != nullptr) {
#pragma unroll
        for (int hk = 0; hk < 2; ++hk) {
          const int key = key0 + 8 * hk;
          const int2 run = key < rect.k_len ? key_rows[rect.k_start + key] : make_int2(0, 0);
          const int q0 = rect.q_start + m0;
          q_first[hk] = run.x - q0;
          q_end[hk] = run.y - q0;
        }
      }
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int key = key0 + (i >= 2 ? 8 : 0), qi = 8 * j + 2 * tq + (i & 1);
          const int offset = corner + key - n0_wg - qi;  // key - query position
          if (key >= rect.k_len || offset > rect.hi || offset < -rect.lo ||
              (LIST && (qi < q_first[i / 2] || qi >= q_end[i / 2])))
            st[4 * j + i] = -INFINITY;
        }
    }
    // ---- dV += P^T dO (A from registers). kDvEarly: issued before dP^T is awaited. ptxas moves
    // ALU work across a wgmma.wait_group freely (it sank two thirds of P^T's exp2 below the wait
    // for dP^T), not across a product that reads it; dV's products then run on under dS^T and
    // its trip through shared memory. Else after both, as P^T and dS^T are formed together.
    auto issue_dv = [&]() {
      wgmma_fence_operand(dv);
      wgmma_fence_operand(pa);
      wgmma_fence();
#pragma unroll
      for (int kc = 0; kc < BM / 16; ++kc)
        wgmma_rs<T, W::kDims, 1>(dv, pa[kc], wgmma_desc_at(dot_base, q_off + kc * 2048), kc > 0 || !fresh);
      wgmma_commit();
    };
    if constexpr (kDvEarly) {
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int qi = 8 * j + 2 * tq + (i & 1);
          st[4 * j + i] = exp2f(fmaf(st[4 * j + i], scale_log2, -lse2[qi]));
        }
      accumulator_as_a<T, BM>(st, pa);
      issue_dv();
      wgmma_wait<1>();  // dP^T ready, dV in flight
      wgmma_fence_operand(dpt);
#pragma unroll
      for (int j = 0; j < BM / 8; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int qi = 8 * j + 2 * tq + (i & 1);
          dpt[4 * j + i] = st[4 * j + i] * (dpt[4 * j + i] - dlt[qi]);
        }
      accumulator_as_a<T, BM>(dpt, dsa);
    } else {
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
      wgmma_fence_operand(dk);
      wgmma_fence_operand(dsa);
      issue_dv();
    }

    // ---- (DQ) dS^T into shared memory; dK += dS^T Q
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
    }
    wgmma_fence_operand(dk);
    wgmma_fence_operand(dsa);
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < BM / 16; ++kc)
      wgmma_rs<T, W::kDims, 1>(dk, dsa[kc], wgmma_desc_at(qt_base, q_off + kc * 2048), kc > 0 || !fresh);
    wgmma_commit();
    // (DQ) the dQ block = dS K over the tile's kBlockN keys (dS from shared memory)
    auto issue_dq = [&]() {
      if constexpr (DQ) {
        wgmma_fence_operand(dqb);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk)
          wgmma_ss<T, W::kDqCols, 0, 1>(dqb, wgmma_desc_at(ds_base, kmajor(BM, kk)),
                                        wgmma_desc_at(kt_base, kk * 2048), kk > 0);
        wgmma_commit();
      }
    };
    if constexpr (kDqUnderDk) {  // issued while dK's products run: the tensor pipe stays fed
      wgmma_wait<1>();  // dV retired: its A fragments are free for the dQ block
      wgmma_fence_operand(dv);
      wgmma_fence_operand(pa);
      issue_dq();
      wgmma_wait<1>();  // dK retired: Q and dO are read
    } else {
      wgmma_wait<0>();
    }
    wgmma_fence_operand(dv);
    wgmma_fence_operand(dk);
    wgmma_fence_operand(pa);
    wgmma_fence_operand(dsa);
    // what the dQ block and the rectangle's end need of the stage, before it is handed back
    const int h = tile.h, q_start = rect.q_start, q_len = rect.q_len;
    const int q_row = map_q_row<LIST>(rect) + m0;  // the tile's first row in the maps (bulk dQ)
    const bool ends = tile.ends == kEndsRect;
    mbar_arrive(bar.empty + stage);  // Q, dO and the stats of this stage are read

    if constexpr (DQ) {
      // ---- the dQ block, added with fp32 atomics or bulk reductions (dK and dV alone stay live
      // beside it: 2 x kDims/2 + kDqCols/2 registers; kDqUnderDk: dS^T's A fragments too, until
      // dK retires)
      if constexpr (!kDqUnderDk) issue_dq();
      wgmma_wait<0>();
      wgmma_fence_operand(dqb);
      const float scale = p.scale;
      const long long dq_at = b * p.dq_stride.b + (long long)q_start * p.dq_stride.s + h * p.dq_stride.h;
      // (the branches of another DQ are constant false: the compiler drops them)
      if (DQ == kDqBulk && p.dq_adds == 3) {
        // bulk tensor reductions: the block (64 rows x 64 head dims) into this consumer's staging
        // as two boxes of 64 rows x 32 floats, each laid out as a bulk copy with the 128-byte
        // swizzle would land it (row r at r x 128 bytes, its 16-byte chunks XORed by r % 8 = g),
        // then one thread adds both boxes into dq (dq_map: rows past the tensor are not written;
        // rows past q_len inside it get zeros, P being 0 there). The reductions read the staging
        // asynchronously: the next block waits for that (wait_group.read) before writing it.
        unsigned char* staging = smem + S::kDq + wg * (64 * 64 * 4);
        if (ct == 0) bulk_wait_group_read<0>();
        named_bar_sync(kDqBar + wg, 128);
        const int row_at = (warp * 16 + g) * 128 + 8 * (tq & 1), x = (tq >> 1) ^ g;
#pragma unroll
        for (int j = 0; j < W::kDqCols / 8; ++j)
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            const int at = (j / 4) * (64 * 128) + hr * 1024 + row_at + ((2 * (j % 4)) ^ x) * 16;
            *reinterpret_cast<float2*>(staging + at) =
                make_float2(scale * dqb[4 * j + 2 * hr], scale * dqb[4 * j + 2 * hr + 1]);
          }
        fence_proxy_async();
        named_bar_sync(kDqBar + wg, 128);
        if (ct == 0 && m0 + rb * 64 < q_len) {  // a block wholly past q_len adds nothing
#pragma unroll
          for (int bx = 0; bx < 2; ++bx)
            tma_reduce_add_4d(&p.dq_map, staging + bx * (64 * 128), dq_col0 + bx * kDqBoxCols,
                              q_row + rb * 64, h, b);
          bulk_commit_group();
        }
      } else if (DQ == kDqAtomic && kDqPairs && p.dq_adds == 2) {
        // two floats an add (red.global.add.v2.f32): a thread holds head dims 8j + 2tq and + 1 of
        // rows g and g + 8, 8-byte aligned (the host sets dq_adds = 2 only for rows on 16 bytes).
        // Four an add would need a swap between lanes tq and tq ^ 1 and four consecutive
        // registers: the list kernel then spilled 40-48 bytes at D = 64 and 256.
        int lane_row = rb * 64 + warp * 16 + g, lane_col = dq_col0 + 2 * tq;
        asm volatile("" : "+r"(lane_row), "+r"(lane_col));  // formed here, not held through the loop
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int row = m0 + lane_row + 8 * hr;
          if (row >= q_len) continue;
          float* dst = p.dq + dq_at + (long long)row * p.dq_stride.s + lane_col;
#pragma unroll
          for (int j = 0; j < W::kDqCols / 8; ++j)
            red_add_v2(dst + 8 * j, scale * dqb[4 * j + 2 * hr], scale * dqb[4 * j + 2 * hr + 1]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = m0 + rb * 64 + warp * 16 + g + (i >= 2 ? 8 : 0);
          if (row >= q_len) continue;
          float* dst = p.dq + dq_at + (long long)row * p.dq_stride.s + dq_col0 + 2 * tq + (i & 1);
#pragma unroll
          for (int j = 0; j < W::kDqCols / 8; ++j) atomicAdd(dst + 8 * j, scale * dqb[4 * j + i]);
        }
      }
    }
    fresh = ends;
    if constexpr (LIST)
      if (ends) add_dkdv();
  }
}

}  // namespace bwd90

/* dK, dV (DQ: and dQ by fp32 atomics) of the rectangle p.blk: BwdStepSm90Params (kernels/params.cuh).
   grid (ceil(k_len / kBlockN), Hkv, B) (kBlockN 128, at D = 256 64), block 384 threads, dynamic
   smem bwd90::Smem<...>::kBytes.
   Returns at once when *p.nonfinite is set (flash_bwd.cu's careful twin runs instead). */
template <typename T, int D, int BM, int STAGES, int DQ>
__global__ void __launch_bounds__(bwd90::kThreads, 1)
flash_bwd_dkdv_sm90(const __grid_constant__ BwdStepSm90Params p) {
  bwd90::dkdv_fold<T, D, BM, STAGES, DQ, false>(p);
}

/* flash_bwd_dkdv_sm90 over a ring step's rectangle list in one launch: p.rects, p.groups, p.n_groups
   grouped by key range (burstcu.ops.cuda.params.step_group_lists, tiles of kBlockN keys), tensor
   maps of the whole q, dO, k and v arrays (box rows as flash_bwd_dkdv_sm90's); grid (the groups'
   key tiles, Hkv, B); the rest as flash_bwd_dkdv_sm90. p.key_rows set (a packed list): each key is
   seen by its run of query rows only. */
template <typename T, int D, int BM, int STAGES, int DQ>
__global__ void __launch_bounds__(bwd90::kThreads, 1)
flash_bwd_dkdv_steps_sm90(const __grid_constant__ BwdStepSm90Params p) {
  bwd90::dkdv_fold<T, D, BM, STAGES, DQ, true>(p);
}
