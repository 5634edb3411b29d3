/*
flash_fwd.cu — the forward step of BurstAttention's local attention (LAO), and its finalize.

ALGORITHM
FlashAttention-2 forward, cut at ring-step boundaries. A rank keeps, for its local queries, the
running online-softmax state of every row in fp32:
    acc (B, S, H, D)  sum_j exp2(s_ij - m_i) * v_j          (un-normalised output)
    m   (B, H, S)     running max of the scaled scores s_ij = (q_i . k_j) * scale * log2(e)
    l   (B, H, S)     running sum_j exp2(s_ij - m_i)
One launch of `flash_fwd_step` folds one K/V rectangle (a `burstcu.layout.Block`) into that
state, and one launch of `flash_fwd_steps` every rectangle of a ring step (grouped by query
range, so that no two blocks of threads hold the same rows; the groups' rectangles fold in
order, as one launch each would). In both, each block of threads reads the state of its BLOCK_M query rows, streams the K/V rows in
BLOCK_N-row tiles through shared memory, updates (acc, m, l) in registers with the usual FA2
rescaling, and writes the state back. The merge of ring steps is therefore fused into the kernel:
no partial output and no partial lse ever reach global memory, and the ring engine never runs a
separate merge. `flash_fwd_finalize` ends the pass: out = acc / l, lse = (m + log2 l) * ln 2
(natural log, as kernels/README.md specifies); a row that saw no key gets out 0 and lse -inf.

Inside a step (one thread block = NWARPS warps, each warp owns 16 query rows, BLOCK_M = 16*NWARPS):
    cp.async Q tile -> smem, K/V tile 0 -> smem stage 0
    for each K/V tile j that is not wholly in the causal future:
        cp.async K/V tile j+1 -> smem stage (j+1)%2          (double buffer: load overlaps math)
        S = Q K^T           mma.m16n8k16, A = Q from ldmatrix.x4, B = K from ldmatrix.x4
        mask                only if the tile straddles the diagonal or k_len (else no work)
        m' = max(m, rowmax S); P = exp2(S - m'); l = l*exp2(m-m') + rowsum P; acc *= exp2(m-m')
        acc += P V          P re-packed from the S accumulator fragments into A fragments (no
                            smem round trip), V from ldmatrix.x4.trans
    write acc, m, l back
A row whose keys are all masked so far keeps m = -inf; the exponent then uses 0 instead of m so
that exp2(-inf - (-inf)) never makes a NaN (the "finite -inf guard"). Masked scores are set to
-inf whatever K holds; a non-finite V at a masked key would still reach the row through 0 x Inf
in P V, so blocks with masked pairs launch the CAREFUL twin instead when V holds one
(flash_any_nonfinite sets the flag; kernels/README.md, "Masked positions are inert").

VARIANTS (burstcu/build/fwd_variants.py lists them; each is one template instantiation)
    flash_fwd_step<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS>   T in {__half, __nv_bfloat16}
        native HEADDIM in {32, 64, 96, 128, 256}; any other multiple of 8 up to 256 runs the next
        native one with q/k/v zero-padded (zeros add nothing to q.k nor to the padded output
        columns, which are dropped; the softmax scale stays 1/sqrt(real d)).
    flash_fwd_step<..., CAREFUL = true>   the same with gemm_rs_masked for P V
    flash_fwd_steps<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS[, true]>   the same tiles over a ring
        step's rectangle list (one launch a step when it has several rectangles)
    flash_fwd_pass<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS[, true]>   the same tiles for a pass of one
        fold over every query row (one rank, Ulysses): the state neither read nor written, out
        and lse written as flash_fwd_finalize would (KernelOps._fold; no fp32 state allocated)
    flash_fwd_finalize<T>   T in {__half, __nv_bfloat16, float}
    flash_any_nonfinite<T>  T in {__half, __nv_bfloat16, float}

TILE SIZES AND WHY
The BurstAttention paper (like FlashAttention-1) sizes the key tile from the on-chip memory M as
B_c = M / (4 d): on an A100 (163 KB usable smem = 83K fp16 elements) that is 326 rows at d = 64
and 163 at d = 128 — an upper bound, not a choice, because it spends the whole SM on one block.
The working constraints are, in order:
  1. registers: a thread holds D/2 fp32 of acc, BLOCK_N/2 fp32 of S, D/4 u32 of Q fragments (for
     D <= 128; at D = 256 Q is re-read from smem per tile, else acc+Q alone is 192 registers)
     and must stay <= 255 with no spills (the compile gate checks);
  2. shared memory: Q tile + 2 stages x (K + V) tiles, every row padded by 16 bytes so that the
     8 row addresses of an ldmatrix fall in 8 different bank groups (no conflicts, for every
     head dim including 96 where an XOR swizzle over 12 chunks does not close);
  3. about 8 or more resident warps per SM, so one warp's barrier or cp.async wait is covered
     by another's math (met everywhere but d = 256, where one 4-warp block fits on sm_80).
Result (smem = (BLOCK_M + 4 BLOCK_N) * (D + 8) * 2 bytes; registers from the gate, NVRTC 13.0):
    D    sm_80 (164 KB smem/SM)                     sm_90 (228 KB smem/SM), MEASURED on an H100
    32   8 warps, 128 x 64, 30 KB, 128 regs         same (not measured)
    64   8 warps, 128 x 64, 54 KB, 128 regs         4 warps,  64 x  64,  45 KB, 161 regs
    96   4 warps,  64 x 32, 39 KB, 160 regs         4 warps,  64 x  64,  65 KB, 168 regs (not measured)
    128  4 warps,  64 x 32, 51 KB, 168 regs         8 warps, 128 x 128, 170 KB, 249 regs
    256  4 warps,  64 x 32, 99 KB, 244 regs         8 warps, 128 x  64, 198 KB, 246 regs
The sm_90 column was chosen by timing every tile pair that passes the gate on an H100
(bench/gpu/tiles.py; bench/results/h100/tiles.json): against the sm_80-style tiles it was 1.22x
(d = 64), 1.32x (d = 128) and 1.16x (d = 256) faster at S = 4096 and 16384. Occupancy did not
decide it: at d = 128 and 256 the 8-warp blocks of 128 query rows (one block a SM) won, a K/V
tile in smem serving twice the query rows; at d = 64, 4 warps x 64 beat 8 warps x 128 at the
same registers. The sm_80 column is still the no-GPU choice (no A100 has measured it).
The "sm_86" table (GPUs with 99 KB = 101376 B opt-in smem a block and 100 KB a SM: cc 8.6, 8.7,
8.9 and 12.x, e.g. RTX 3090/4090/5090, A10, A40, L4, L40S) takes the sm_80 tiles unchanged: the
largest, d = 256, needs exactly 101376 B (one block a SM); d = 128 (51 KB) keeps one block a SM
there too (two would need 2 x 52 KB + 2 KB reserved > 100 KB). The table only picks tile sizes;
at run time the kernel is compiled for the device's own arch (sm_86, sm_89, sm_120, ...).
Registers, not smem, bind first: 8-16 warps per SM (d <= 128), which is the regime
FA2 itself runs in (few warps, much ILP per warp). Capping registers with a min-blocks launch
bound (3 or 4 blocks) made ptxas spill, which the gate forbids. sm_90 gets 64-key tiles at d = 96,
where its extra smem still leaves 3 blocks per SM. On compute capability 9.0 the forward steps of
head dims 64, 128 and 256 run flash_fwd_sm90.cu instead (wgmma, TMA, warp specialisation: the
"sm_90a" table); the sm_90 column above serves the other head dims there, and cc 10.x.
`python -m burstcu.build check --md F` writes the registers, smem and the occupancy they allow (computed
from ptxas, not measured).

NAPKIN MATH (A100: 312 TFLOP/s fp16 tensor, 1.55 TB/s HBM; a model: no A100 has run this code,
the H100 figures are bench/results/gpu_h100.md's)
Per K/V tile a block does 4 * BLOCK_M * BLOCK_N * D flops for 4 * BLOCK_N * D bytes of K and V,
i.e. BLOCK_M flop/byte from L2 (K/V tiles are shared by all query tiles of a head, so HBM sees
them about once per launch). Fusing the merge costs 8 D bytes of state traffic (read + write acc)
per query row per step against 4 k_len D flops: memory/compute = (8 / 1.55e12) / (4 k_len / 312e12)
= 400 / k_len, so ~10% at k_len = 4096 before any overlap between blocks, and a separate merge
kernel would move more (it reads a partial output and the state and writes the state). The target
is FA2-level throughput per step (measured on an H100: 0.49-0.79x torch's FA2 backend).

BUILD
    NVRTC (gate): python -m burstcu.build check --arch sm_80,sm_86,sm_90 --json gate.json
        options: -std=c++17 --gpu-architecture=sm_XX -default-device --use_fast_math
                 -I kernels/ -I <nvidia cu13 include> -Xptxas=-v
    at run time: burstcu.ops.cuda.kernel_ops.KernelOps("cupy") (same NVRTC path, CUBIN cached on disk)
    CPU emulator: burstcu.ops.cuda.kernel_ops.KernelOps("emulated") (g++ with kernels/emu/cuda_emu.h)
    cross-check: nvcc -cubin -arch=sm_90 -Xptxas -v -I kernels -DBURSTCU_NVCC_CHECK kernels/flash_fwd.cu
        (instantiates one variant per head dim so nvcc has something to compile)

ARGUMENT CONVENTIONS
Each kernel takes one struct by value (kernels/params.cuh: FwdStepParams, FwdFinalizeParams,
NonfiniteParams), which burstcu/ops/cuda/params.py fills. Strides are in elements, 64-bit (a (B, S, H,
D) tensor passes 2^31 elements at S = 1M, H = 16, D = 128). q, k, v, acc and out have a
contiguous last dim whose stride is 1; their strides must be even (float2 / 16-byte accesses),
which they are for any native D. m, l, lse have stride 1 along S. All other sizes are int32.
*/

#include "common.cuh"
#include "params.cuh"

// ------------------------------------------------------------------------------------------------
// small helpers (not primitives: index arithmetic and constants only)

namespace fwd {

// -inf: common.cuh defines INFINITY where NVRTC lacks math.h.
__device__ __forceinline__ float neg_inf() { return -INFINITY; }

// Shared-memory row stride in elements: D plus 8 elements (16 bytes) of padding, so that the
// 8 rows one ldmatrix reads start in 8 different 16-byte bank groups.
template <int HEADDIM>
struct SmemRow {
  static constexpr int kStride = HEADDIM + 8;
};

// Bytes of dynamic shared memory a step launch needs: Q tile + 2 stages of (K, V) tiles.
template <int HEADDIM, int BLOCK_M, int BLOCK_N>
struct SmemBytes {
  static constexpr int kValue = (BLOCK_M + 4 * BLOCK_N) * SmemRow<HEADDIM>::kStride * 2;
};

// Copy `rows` x HEADDIM elements (16-byte chunks) from global rows [row0, row0 + rows) into smem
// with cp.async; rows at or past `valid_rows` are zero-filled and read nothing.
//   dst: smem tile, rows x kStride elements;  src: element (row0, 0) of the global tensor;
//   row_stride: elements between consecutive global rows.
template <typename T, int HEADDIM, int ROWS, int NTHREADS>
__device__ __forceinline__ void load_tile(T* dst, const T* src, long long row_stride,
                                          int valid_rows, int tid) {
  constexpr int kChunks = HEADDIM / 8;  // 16-byte chunks per row
  constexpr int kStride = SmemRow<HEADDIM>::kStride;
#pragma unroll
  for (int i = tid; i < ROWS * kChunks; i += NTHREADS) {
    const int row = i / kChunks, chunk = i % kChunks;
    const bool valid = row < valid_rows;
    // An invalid row still needs a dereferenceable-looking address; row 0 always is (the
    // caller never loads a tile with valid_rows <= 0).
    const T* g = src + (valid ? row : 0) * row_stride + chunk * 8;
    cp_async_16(dst + row * kStride + chunk * 8, g, valid);
  }
}

}  // namespace fwd

// ------------------------------------------------------------------------------------------------
// forward step

namespace fwd {

// One rectangle as a block of query rows sees it: its key rows, their bounds, and which K/V
// tiles hold a key some row of the block may see (none: `live` false, nothing is loaded).
struct RectView {
  int k_start, k_len, k_pos, hi, lo;
  int n_keys, tile_begin, n_tiles;
  bool live;
};

// Keys that some row of the block (query rows q0 .. q_last, relative to q_start, at global
// positions from q_pos) may see: key j is visible to the last row iff k_pos + j <= q_pos + q_last
// + hi, and to the first iff k_pos + j >= q_pos + q0 - lo; tiles outside [tile_begin, n_tiles)
// are never loaded. k_pos is the rectangle's first key position in the group's coordinates
// (q_pos, the first rectangle's): only k_pos - q_pos counts, and the rectangles of one query
// range may carry positions shifted apart (a block mask's diagonals, burstcu/layout.py).
// (int arithmetic: positions stay below 2^30, the bounds at most NO_BOUND.)
template <int BLOCK_N>
__device__ __forceinline__ RectView rect_view(const BlockRect& r, int q_pos, int q0, int q_last) {
  RectView v;
  v.k_start = r.k_start; v.k_len = r.k_len; v.k_pos = r.k_pos - r.q_pos + q_pos; v.hi = r.hi; v.lo = r.lo;
  v.n_keys = max(0, min(r.k_len, q_pos + q_last + r.hi - v.k_pos + 1));
  const int first_key = q_pos + q0 - r.lo - v.k_pos;
  v.tile_begin = first_key > 0 ? first_key / BLOCK_N : 0;
  v.n_tiles = (v.n_keys + BLOCK_N - 1) / BLOCK_N;
  v.live = v.tile_begin < v.n_tiles;
  return v;
}

}  // namespace fwd

/* Fold attention of query rows [q_start, q_start + q_len) over key rows [k_start, k_start + k_len)
   into the running state (p.acc, p.m, p.l) of those query rows; shapes, strides and the key
   bounds hi, lo are FwdStepParams' (kernels/params.cuh). NO_BOUND keeps every sum of positions
   below 2^31 for positions below 2^30.
   LIST = false (flash_fwd_step): the one rectangle p.blk; grid (ceil(q_len / BLOCK_M), H, B).
   LIST = true (flash_fwd_steps): every rectangle of a ring step in one launch, grouped by query
     range (p.rects, p.groups, p.n_groups): block x finds its group by a binary search of the
     groups' first tiles, reads the state of its query rows once, folds the group's rectangles
     in order (each streams its own K/V tiles through the same smem stages) and writes the state
     once; grid (the groups' query tiles together, H, B). The result is what one flash_fwd_step
     launch a rectangle, in that order, computes, bit for bit: the state stays in fp32 registers
     between rectangles as it would in fp32 memory. A packed list (p.row_keys set, params.cuh)
     folds the same pairs in other tiles: the same result within rounding, not bit for bit.
   p.nonfinite: device int, nonzero when an operand of a tile with masked pairs may hold Inf/NaN
     (flash_any_nonfinite); the launcher issues the pair <..., false> and <..., true> on one
     stream and exactly one of them runs: the plain one when it is 0, the CAREFUL one otherwise
   block NWARPS * 32 threads, dynamic smem fwd::SmemBytes<HEADDIM, BLOCK_M, BLOCK_N>::kValue bytes. */
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAREFUL, bool LIST,
          bool PASS = false>
__device__ __forceinline__ void flash_fwd_fold(const FwdStepParams<T>& p) {
  if ((*p.nonfinite != 0) != CAREFUL) return;  // the other variant of this launch pair runs
  static_assert(BLOCK_M == 16 * NWARPS, "each warp owns 16 query rows");
  static_assert(HEADDIM % 16 == 0 && BLOCK_N % 16 == 0, "mma k-chunks are 16 wide");
  constexpr int kThreads = NWARPS * 32;
  constexpr int kStride = fwd::SmemRow<HEADDIM>::kStride;
  constexpr int kDTiles = HEADDIM / 8;   // n-tiles of the P V product (8 output dims each)
  constexpr int kNTiles = BLOCK_N / 8;   // n-tiles of the Q K^T product (8 keys each)
  constexpr int kKChunks = HEADDIM / 16; // k-chunks of Q K^T
  // Q fragments live in registers when they fit next to acc (D/4 + D/2 registers); at D = 256
  // they would take 64 more than the budget allows, so they are re-read from smem per tile.
  constexpr bool kQInRegs = HEADDIM <= 128;

  // the fields, read once here (kernels/params.cuh, "Reading a parameter struct")
  const T* __restrict__ q = p.q;
  const T* __restrict__ k = p.k;
  const T* __restrict__ v = p.v;
  float* __restrict__ acc = p.acc;
  float* __restrict__ m = p.m;
  float* __restrict__ l = p.l;
  const long long q_sb = p.q_stride.b, q_sr = p.q_stride.s, q_sh = p.q_stride.h;
  const long long kv_sb = p.kv_stride.b, kv_sr = p.kv_stride.s, kv_sh = p.kv_stride.h;
  const long long acc_sb = p.acc_stride.b, acc_sr = p.acc_stride.s, acc_sh = p.acc_stride.h;
  const long long ml_sb = p.ml_stride.b, ml_sh = p.ml_stride.h;
  const int H = p.H, Hkv = p.Hkv;
  const float scale_log2 = p.scale_log2;
  // a packed list (params.cuh): each query row's run of keys masks too, in every tile
  const int2* __restrict__ row_keys = LIST ? p.row_keys : nullptr;

  // this block's rectangles: p.blk alone, or its group's (LIST)
  const BlockRect* rects = nullptr;
  int r_first = 0, r_end = 1, q_tile = blockIdx.x;
  int q_start = p.blk.q_start, q_len = p.blk.q_len, q_pos = p.blk.q_pos;
  if constexpr (LIST) {
    const int* groups = p.groups;
    const int n_groups = p.n_groups;
    const int group = step_group_of(groups, n_groups, blockIdx.x);
    rects = p.rects;
    r_first = groups[group];
    r_end = groups[group + 1];
    q_tile = blockIdx.x - groups[n_groups + 1 + group];
    q_start = rects[r_first].q_start;
    q_len = rects[r_first].q_len;
    q_pos = rects[r_first].q_pos;
  }

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row group, thread in group
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (H / Hkv);
  const int q0 = q_tile * BLOCK_M;       // first query row of this block, relative to q_start
  const int w0 = q0 + warp * 16;         // first query row of this warp
  const int q_last = min(q0 + BLOCK_M, q_len) - 1;

  // the first rectangle with a key some row of this block sees (none: state unchanged)
  int r = r_first;
  fwd::RectView cur = fwd::rect_view<BLOCK_N>(LIST ? rects[r] : p.blk, q_pos, q0, q_last);
  if constexpr (LIST)
    while (!cur.live && ++r < r_end) cur = fwd::rect_view<BLOCK_N>(rects[r], q_pos, q0, q_last);
  // PASS (flash_fwd_pass): every row is written, whether the block's rows see a key or not
  if (q_last < q0 || (!PASS && !cur.live)) return;

  BURSTCU_DYNAMIC_SMEM(T, smem);
  // layout: Q | K0 V0 | K1 V1; stage s of K starts at sK0 + s * kStage (plain arithmetic, not a
  // pointer array, which would be indexed at run time and land on the stack)
  constexpr int kStage = 2 * BLOCK_N * kStride;
  T* sQ = smem;
  T* sK0 = sQ + BLOCK_M * kStride;
  T* sV0 = sK0 + BLOCK_N * kStride;

  const T* gQ = q + b * q_sb + (long long)(q_start + q0) * q_sr + h * q_sh;
  const T* gK = k + b * kv_sb + (long long)cur.k_start * kv_sr + hk * kv_sh;
  const T* gV = v + b * kv_sb + (long long)cur.k_start * kv_sr + hk * kv_sh;

  // ---- prologue: Q tile and the first rectangle's K/V tile tile_begin in flight
  if (!PASS || cur.live) {
    fwd::load_tile<T, HEADDIM, BLOCK_M, kThreads>(sQ, gQ, q_sr, q_len - q0, tid);
    cp_async_commit();
    const int nb = cur.tile_begin * BLOCK_N;
    fwd::load_tile<T, HEADDIM, BLOCK_N, kThreads>(sK0, gK + nb * kv_sr, kv_sr, cur.n_keys - nb, tid);
    fwd::load_tile<T, HEADDIM, BLOCK_N, kThreads>(sV0, gV + nb * kv_sr, kv_sr, cur.n_keys - nb, tid);
    cp_async_commit();
  }

  // ---- running state of this thread's two rows (w0 + g, w0 + g + 8), read while loads fly
  // (PASS: not read, acc 0, m -inf, l 0)
  const int row[2] = {w0 + g, w0 + g + 8};
  const bool row_ok[2] = {row[0] < q_len, row[1] < q_len};
  float o[kDTiles][4];  // acc fragment: o[j][0..1] row 0, dims 8j+2t..+1; o[j][2..3] row 1
  float m_i[2], l_i[2]; // l_i is this thread's partial row sum: only t == 0 starts from l
  float* ml_base_m = m + b * ml_sb + h * ml_sh + q_start;
  float* ml_base_l = l + b * ml_sb + h * ml_sh + q_start;
  float* acc_base = acc + b * acc_sb + (long long)q_start * acc_sr + h * acc_sh;
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const bool read = !PASS && row_ok[r2];
    m_i[r2] = read ? ml_base_m[row[r2]] : fwd::neg_inf();
    l_i[r2] = (read && t == 0) ? ml_base_l[row[r2]] : 0.f;
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      float2 a = make_float2(0.f, 0.f);
      if (read) a = *reinterpret_cast<const float2*>(acc_base + row[r2] * acc_sr + 8 * j + 2 * t);
      o[j][2 * r2] = a.x;
      o[j][2 * r2 + 1] = a.y;
    }
  }

  u32 qf[kQInRegs ? kKChunks : 1][4];  // Q A-fragments, one x4 per 16-wide k-chunk
  // ldmatrix.x4 row addresses for an A fragment: lanes 0-15 rows 0-15 at col 0, lanes 16-31 the
  // same rows at col 8 (matrices: rows 0-7|8-15 x cols 0-7|8-15 = a0, a1, a2, a3).
  const T* q_frag_row = sQ + (warp * 16 + lane % 16) * kStride + (lane / 16) * 8;
  if constexpr (LIST && kQInRegs) {  // the group's Q fragments once, before its rectangles
    cp_async_wait<1>();              // Q has landed (the first K/V tile may still fly)
    __syncthreads();
#pragma unroll
    for (int kc = 0; kc < kKChunks; ++kc) ldmatrix_x4(qf[kc], q_frag_row + kc * 16);
  }
  // K B-fragments for two n-tiles at once (gemm_qk)
  const int k_frag_row = (lane / 16) * 8 + lane % 8, k_frag_col = ((lane / 8) % 2) * 8;

  while (!PASS || cur.live) {  // one pass a live rectangle (once for flash_fwd_step)
    const int k_start = cur.k_start, k_len = cur.k_len, k_pos = cur.k_pos, hi = cur.hi, lo = cur.lo;
    const int n_keys = cur.n_keys, tile_begin = cur.tile_begin, n_tiles = cur.n_tiles;
    for (int tile = tile_begin; tile < n_tiles; ++tile) {
      const int stage = (tile - tile_begin) % 2, n0 = tile * BLOCK_N;
      if (tile + 1 < n_tiles) {  // prefetch the next tile into the other stage
        const int nn = n0 + BLOCK_N;
        fwd::load_tile<T, HEADDIM, BLOCK_N, kThreads>(sK0 + (stage ^ 1) * kStage, gK + nn * kv_sr, kv_sr, n_keys - nn, tid);
        fwd::load_tile<T, HEADDIM, BLOCK_N, kThreads>(sV0 + (stage ^ 1) * kStage, gV + nn * kv_sr, kv_sr, n_keys - nn, tid);
        cp_async_commit();
        cp_async_wait<1>();  // everything but the prefetch: Q and this tile
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      if (!LIST && kQInRegs && tile == tile_begin) {
#pragma unroll
        for (int kc = 0; kc < (kQInRegs ? kKChunks : 0); ++kc) ldmatrix_x4(qf[kc], q_frag_row + kc * 16);
      }

      // A warp whose rows all precede every key of the tile, or that has no valid row, adds
      // nothing (P would be 0 and the rescale 1): it skips the math but not the barriers.
      const bool warp_live = w0 < q_len && q_pos + w0 + 15 + hi >= k_pos + n0 &&
                             q_pos + w0 - lo <= k_pos + n0 + BLOCK_N - 1;
      if (warp_live) {
        // ---- S = Q K^T for this warp's 16 rows x BLOCK_N keys
        float s[kNTiles][4];
        const T* kt = sK0 + stage * kStage;
        gemm_qk<T, kNTiles, kKChunks, kQInRegs>(s, qf, q_frag_row, kt, kStride, k_frag_row, k_frag_col);

        // ---- scale into base-2 units; mask only tiles that straddle k_len or the diagonal (a
        // packed list: every tile)
        const bool need_mask = n0 + BLOCK_N > n_keys || k_pos + n0 + BLOCK_N - 1 > q_pos + w0 + hi ||
                               k_pos + n0 < q_pos + w0 + 15 - lo || row_keys != nullptr;
        // LIST: row r2 keeps the keys first[r2] .. last[r2] of the rectangle: its bounds and
        // k_len, and (packed) its run of keys (a row past q_len: none). The one-rectangle kernel
        // keeps the test of the bounds an element: as per-row values it took more registers
        // (138 against 128 at d = 64 on sm_80, one block a SM instead of two).
        int first[2] = {0, 0}, last[2] = {0, 0};
        if (LIST && need_mask) {
#pragma unroll
          for (int r2 = 0; r2 < 2; ++r2) {
            first[r2] = q_pos + row[r2] - lo - k_pos;
            last[r2] = min(k_len - 1, q_pos + row[r2] + hi - k_pos);
            if (row_keys != nullptr) {
              const int2 run = row_ok[r2] ? row_keys[q_start + row[r2]] : make_int2(0, 0);
              first[r2] = max(first[r2], run.x - k_start);
              last[r2] = min(last[r2], run.y - 1 - k_start);
            }
          }
        }
#pragma unroll
        for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[j][e] * scale_log2;
            if (need_mask) {
              const int key = n0 + 8 * j + 2 * t + (e & 1);
              const int qr = row[e / 2];
              const bool keep = LIST ? key >= first[e / 2] && key <= last[e / 2]
                                     : key < k_len && k_pos + key <= q_pos + qr + hi &&
                                           k_pos + key >= q_pos + qr - lo;
              x = keep ? x : fwd::neg_inf();
            }
            s[j][e] = x;
          }
        }

        // ---- online softmax: new max, rescale factor, P = exp2(S - m)
        float alpha[2];
        online_softmax(s, m_i, l_i, alpha);   // l_i partial: reduced over the row group at the end
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          o[j][0] *= alpha[0]; o[j][1] *= alpha[0];
          o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
        }

        // ---- acc += P V: the S accumulator fragments are P's A fragments (gemm_rs). In a tile
        // with masked pairs P is exactly 0 there, and a non-finite V at such a key must not reach
        // the row (0 x Inf = NaN on the tensor cores): the CAREFUL variant takes care of it.
        if constexpr (CAREFUL)
          gemm_rs_masked<T, BLOCK_N, HEADDIM>(o, s, sV0 + stage * kStage, kStride, 0, need_mask);
        else
          gemm_rs<T, BLOCK_N, HEADDIM>(o, s, sV0 + stage * kStage, kStride, 0);
      }
      __syncthreads();  // the next iteration's prefetch overwrites this stage
    }
    if constexpr (!LIST) break;
    // ---- the group's next live rectangle: its first K/V tile into stage 0 (both stages free).
    // The row sums are reduced over the row group here, as writing and re-reading the state
    // between two launches would (thread t == 0 holds the sum): the same bits as a launch each.
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const float lsum = warp_sum<4>(l_i[r2]);
      l_i[r2] = t == 0 ? lsum : 0.f;
    }
    do {
      ++r;
    } while (r < r_end && !(cur = fwd::rect_view<BLOCK_N>(rects[r], q_pos, q0, q_last)).live);
    if (r >= r_end) break;
    gK = k + b * kv_sb + (long long)cur.k_start * kv_sr + hk * kv_sh;
    gV = v + b * kv_sb + (long long)cur.k_start * kv_sr + hk * kv_sh;
    const int nb = cur.tile_begin * BLOCK_N;
    fwd::load_tile<T, HEADDIM, BLOCK_N, kThreads>(sK0, gK + nb * kv_sr, kv_sr, cur.n_keys - nb, tid);
    fwd::load_tile<T, HEADDIM, BLOCK_N, kThreads>(sV0, gV + nb * kv_sr, kv_sr, cur.n_keys - nb, tid);
    cp_async_commit();
  }

  // ---- write the state back (rows past q_len were never read and are not written); PASS: out
  // and lse instead, flash_fwd_finalize's out = acc / l, lse = (m + log2 l) ln 2 (l == 0: 0, -inf)
#pragma unroll
  for (int r2 = 0; r2 < 2; ++r2) {
    const float lsum = warp_sum<4>(l_i[r2]);
    if (!row_ok[r2]) continue;
    if constexpr (PASS) {
      const long long at = q_start + row[r2];
      T* out_row = p.out + b * p.out_stride.b + at * p.out_stride.s + h * p.out_stride.h;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        const float x = lsum == 0.f ? 0.f : o[j][2 * r2] / lsum;
        const float y = lsum == 0.f ? 0.f : o[j][2 * r2 + 1] / lsum;
        *reinterpret_cast<u32*>(out_row + 8 * j + 2 * t) = pack2<T>(x, y);
      }
      if (t == 0)
        p.lse[b * p.lse_stride.b + h * p.lse_stride.h + at] =
            lsum == 0.f ? fwd::neg_inf() : (m_i[r2] + log2f(lsum)) * 0.6931471805599453f;
      continue;
    }
    if (t == 0) {
      ml_base_m[row[r2]] = m_i[r2];
      ml_base_l[row[r2]] = lsum;
    }
#pragma unroll
    for (int j = 0; j < kDTiles; ++j)
      *reinterpret_cast<float2*>(acc_base + row[r2] * acc_sr + 8 * j + 2 * t) = make_float2(o[j][2 * r2], o[j][2 * r2 + 1]);
  }
}

// One rectangle a launch (p.blk): grid (ceil(q_len / BLOCK_M), H, B).
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAREFUL = false>
__global__ void __launch_bounds__(NWARPS * 32)
flash_fwd_step(const __grid_constant__ FwdStepParams<T> p) {
  flash_fwd_fold<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAREFUL, false>(p);
}

// A pass of one fold (p.blk over every query row of the pass): the state neither read nor written,
// out and lse written as flash_fwd_finalize would (p.out, p.lse); grid as flash_fwd_step's. The
// sm_80 and sm_86 tables have none at d = 64 (burstcu/build/fwd_variants.py, PASS_HEADDIMS).
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAREFUL = false>
__global__ void __launch_bounds__(NWARPS * 32)
flash_fwd_pass(const __grid_constant__ FwdStepParams<T> p) {
  flash_fwd_fold<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAREFUL, false, true>(p);
}

// A ring step's rectangles in one launch (p.rects, p.groups): grid (the groups' query tiles, H, B).
// The rectangle loop keeps a few more values live than one rectangle does; where ptxas would
// rather spill than give up a third 4-warp block a SM (d = 128 on sm_80, d = 96 on sm_90: 168
// registers), the bound of two blocks (8 warps) a SM lets it keep them in registers.
template <typename T, int HEADDIM, int BLOCK_M, int BLOCK_N, int NWARPS, bool CAREFUL = false>
__global__ void __launch_bounds__(NWARPS * 32, (8 + NWARPS - 1) / NWARPS)
flash_fwd_steps(const __grid_constant__ FwdStepParams<T> p) {
  flash_fwd_fold<T, HEADDIM, BLOCK_M, BLOCK_N, NWARPS, CAREFUL, true>(p);
}

// ------------------------------------------------------------------------------------------------
// the non-finite flag

/* flag[0] = 1 if an element of x could make a product at a masked pair non-finite (flag is only
   ever set here, never cleared): Inf or NaN, and for bfloat16 also |x| >= 2^56, whose products
   with a D <= 256 vector may overflow float32 (dP = dO . v in the backward); float16 cannot.
   x (B, S, H, D) T, last dim contiguous (a (B, H, S) float row statistic such as delta goes in
   as (B, S, H, 1) through a transposed view); NonfiniteParams (kernels/params.cuh).
   vec: elements a thread reads, 16 / sizeof(T) when the launcher found every row's chunks
   16-byte aligned (one uint4 load), else 1.
   grid (ceil(S * D / vec / 256), H, B), block 256: one chunk a thread, its row found with one
   division (S * D / vec < 2^31); memory bound, launched only for ring steps with masked pairs. */
/// may_poison of the element whose bit pattern is the low sizeof(T) bytes of `bits`
template <typename T> __device__ __forceinline__ bool may_poison_bits(unsigned bits);
template <> __device__ __forceinline__ bool may_poison_bits<__half>(unsigned bits) {
  return (bits & 0x7c00u) == 0x7c00u;
}
template <> __device__ __forceinline__ bool may_poison_bits<__nv_bfloat16>(unsigned bits) {
  return (bits & 0x7f80u) >= ((127u + 56u) << 7);
}
template <> __device__ __forceinline__ bool may_poison_bits<float>(unsigned bits) {
  return (bits & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ unsigned element_bits(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned element_bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ unsigned element_bits(float x) { return __float_as_uint(x); }

template <typename T>
__global__ void __launch_bounds__(256)
flash_any_nonfinite(const __grid_constant__ NonfiniteParams<T> p) {
  // the fields, read once here (kernels/params.cuh, "Reading a parameter struct")
  const T* __restrict__ x = p.x;
  const long long sb = p.x_stride.b, ss = p.x_stride.s, sh = p.x_stride.h;
  const int S = p.S, D = p.D, vec = p.vec;

  const int chunks = D / vec;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= S * chunks) return;
  const int s = i / chunks;
  const T* src = x + blockIdx.z * sb + s * ss + blockIdx.y * sh + (i - s * chunks) * vec;
  bool bad = false;
  if (vec > 1) {  // the 16 bytes as four words of 4 / sizeof(T) elements each, read by shifting
    const uint4 w = *reinterpret_cast<const uint4*>(src);
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4 / (int)sizeof(T); ++e) bad = bad || may_poison_bits<T>(words[j] >> (16 * e));
  } else {
    bad = may_poison_bits<T>(element_bits(*src));
  }
  if (bad) *p.flag = 1;  // every writer writes the same value
}

// ------------------------------------------------------------------------------------------------
// finalize

/* out = acc / l and lse = (m + log2 l) * ln 2 for every (b, s, h); rows with l == 0 get out 0 and
   lse -inf, rows with l NaN (a NaN they saw) NaN.
   acc, out (B, S, H, D), m, l, lse (B, H, S): FwdFinalizeParams (kernels/params.cuh).
   grid (ceil(S * D / vec / 256), H, B), block 256: `vec` consecutive elements of one row a thread
   (memory bound: 4 + sizeof(T) bytes an element). vec = 8 where D % 8 == 0 and every row of acc
   and out starts on 16 bytes: two float4 loads of acc and 16 bytes of out a thread (one uint4 of
   16-bit T, two float4 of float); else 1. The row comes from one 32-bit division where S * D /
   vec < 2^31, a 64-bit one beyond. One thread an element ran 183 us over 2^25 elements on an
   H200 (1.1 TB/s, bench/results/h200/run4: small_parts), 8 a thread 47 us (run5). */
template <typename T>
__device__ __forceinline__ void store8(T* dst, const float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    *reinterpret_cast<uint4*>(dst) =
        make_uint4(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]), pack2<T>(v[4], v[5]), pack2<T>(v[6], v[7]));
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
flash_fwd_finalize(const __grid_constant__ FwdFinalizeParams<T> p) {
  // the fields, read once here (kernels/params.cuh, "Reading a parameter struct")
  const float* __restrict__ acc = p.acc;
  const float* __restrict__ m = p.m;
  const float* __restrict__ l = p.l;
  T* __restrict__ out = p.out;
  float* __restrict__ lse = p.lse;
  const long long acc_sb = p.acc_stride.b, acc_sr = p.acc_stride.s, acc_sh = p.acc_stride.h;
  const long long out_sb = p.out_stride.b, out_sr = p.out_stride.s, out_sh = p.out_stride.h;
  const long long ml_sb = p.ml_stride.b, ml_sh = p.ml_stride.h;
  const long long lse_sb = p.lse_stride.b, lse_sh = p.lse_stride.h;
  const int S = p.S, D = p.D, vec = p.vec;

  const int h = blockIdx.y, b = blockIdx.z;
  const int chunks = D / vec;
  const long long n = (long long)S * chunks;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  int s, d;
  if (n <= 0x7fffffffLL) {  // the usual case, one 32-bit division (the branch is uniform)
    s = (int)i / chunks;
    d = ((int)i - s * chunks) * vec;
  } else {
    s = (int)(i / chunks);
    d = (int)(i - (long long)s * chunks) * vec;
  }
  const float lv = l[b * ml_sb + h * ml_sh + s];
  const float* src = acc + b * acc_sb + s * acc_sr + h * acc_sh + d;
  T* dst = out + b * out_sb + s * out_sr + h * out_sh + d;
  // l == 0: the row saw no key. (Not `l > 0`: a NaN that the row did see makes l NaN, and it
  // must come out as NaN, not as an empty row.)
  if (vec == 8) {
    const float4 a0 = reinterpret_cast<const float4*>(src)[0], a1 = reinterpret_cast<const float4*>(src)[1];
    float v[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = lv == 0.f ? 0.f : v[j] / lv;
    store8<T>(dst, v);
  } else {
    *dst = from_float<T>(lv == 0.f ? 0.f : *src / lv);
  }
  if (d == 0) {
    const float mv = m[b * ml_sb + h * ml_sh + s];
    const float ln2 = 0.6931471805599453f;
    lse[b * lse_sb + h * lse_sh + s] = lv == 0.f ? fwd::neg_inf() : (mv + log2f(lv)) * ln2;
  }
}

#if defined(BURSTCU_NVCC_CHECK)
// nvcc cross-check only: explicit instantiations (NVRTC and the emulator use name expressions).
template __global__ void flash_fwd_step<__half, 64, 128, 64, 8>(const FwdStepParams<__half>);
template __global__ void flash_fwd_step<__nv_bfloat16, 128, 64, 32, 4>(const FwdStepParams<__nv_bfloat16>);
template __global__ void flash_fwd_steps<__half, 64, 128, 64, 8>(const FwdStepParams<__half>);
template __global__ void flash_fwd_finalize<__half>(const FwdFinalizeParams<__half>);
#endif
