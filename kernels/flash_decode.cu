/*
flash_decode.cu — decode: a few new query rows against one rank's KV cache rows ("flash
decoding": the keys are split, every split reduced on its own, the splits merged).

ALGORITHM
Shapes: q (B, T, H, D) the new tokens; the cache rows this rank holds, either contiguous, k, v
(B, S, Hkv, D), or paged, k, v (P, page_size, Hkv, D) with a page table (B, max_pages) int32 whose
entry i names the page holding rows [i * page_size, (i + 1) * page_size) of batch row b (vLLM's
and FlashInfer's convention). The first n_b rows are valid for batch row b (lengths, int32 (B,));
rows past n_b are never read. Query head h uses kv head h / (H / Hkv), so the R = (H / Hkv) * T
query rows of one kv head (its G query heads x T tokens) are the rows of one tile and share every
K/V byte read (at most ROWS of them a block; row_groups = ceil(R / ROWS), 1 in the usual cases).
    flash_decode_split   grid (splits, Hkv * row_groups, B), NWARPS warps a block
        split s covers keys [s * chunk, min((s + 1) * chunk, n_b)) of kv head hk, in tiles of
        BK = 32 keys; chunk is a multiple of BK;
        the block's query rows go to shared memory in fp32, scaled by scale * log2(e);
        K and V tiles stream through a ring of STAGES shared-memory buffers filled by cp.async
        (16 bytes a copy, L1 bypassed); the loads of tile i + STAGES - 1 are in flight while tile
        i is consumed; key rows past n_b and columns past D are zeros stored without a read;
        warp w owns query rows w, w + NWARPS, ... (RW = ROWS / NWARPS of them), so it needs no
        merge with the other warps. For each tile:
            scores: lane j holds key j of the tile (one 16-byte shared load a VEC elements) and
                computes s_r = q_r . k_j for its rows (q read as broadcast float4s); s_r = -inf
                for a key past the split's end
            m' = max(m_r, warp max of s_r);  p_rj = exp2(s_r - m');  the lane's l_r and every
                acc_r rescale by exp2(m_r - m');  p goes to shared memory (the warp's own rows)
            values: lane l owns columns [l * DPL, (l + 1) * DPL) and adds p_rj * v_j over the
                tile's 32 keys, four at a time (one float4 of p a row, one vector load of v)
        at the end l_r = warp sum of the lanes' l_r, and the split's (m, l, acc) go to the
        workspace: m, l (B, H, T, splits) and acc (B, H, T, splits, D), fp32, base 2.
    flash_decode_split_mma   the tensor-core twin (T in {__half, __nv_bfloat16}; the launcher
        takes it where D is a multiple of 16 up to 256, any R): the same grid with ROWS in
        {16, 32, 64} (R rounded up to 16, at most 64; more row groups past 64), the same
        workspace, so combine and merge are unchanged. NWARPS = 4 warps as MT = ROWS / 16 row
        tiles of 16 query rows x KS = NWARPS / MT key slices: warp w takes row tile w % MT and
        keys [s * KW, (s + 1) * KW) of every tile, s = w / MT, KW = BKM / KS (16, 32 or 64):
        each warp a FlashAttention-2 row block of its own over its slice of the split's keys.
        The block's query rows go to shared memory as T, unscaled, zero past D and past R; at
        DN <= 128 their A fragments (ldmatrix.x4) stay in registers for the whole split and
        their shared memory is the ring's last stage (first filled after the loop's first
        barrier), at DN = 256 they are re-read a tile (flash_fwd.cu's register budget);
        K and V tiles of BKM keys (64; 32 at DN = 256 and ROWS >= 32, sm_86's shared memory)
        stream through the same cp.async ring as above (decode::load_tile: 16-byte copies, key
        rows past the split's end zero-filled without a read, the page table when paged).
        For each tile, a warp whose slice holds a key of the split (else it only loads):
            S = Q K^T       mma.m16n8k16, A = Q fragments, B = K from ldmatrix.x4 (16 x KW)
            s = S * scale * log2(e); s = -inf past the split's end (a select: the zero-filled
                rows gave S = 0, never a product with what the memory there holds)
            m' = max(m, rowmax s) (a quad's warp_max); P = exp2(s - m'); l = l exp2(m - m')
                + rowsum P (the lane's part); acc *= exp2(m - m')   (flash_fwd.cu's, base 2)
            acc += P V      P's accumulator fragments re-packed as A fragments (gemm_rs), V
                from ldmatrix.x4.trans; a key past the end has P = 0 against a zero V row
        then the KS slices of a row tile merge (KS > 1) through the drained ring: slices 1..KS-1
        store their fragments lane-major (m, the lane's l, acc), slice 0 takes M = max_s m_s,
        l = sum_s exp2(m_s - M) l_s, acc likewise (an -inf M counts as 0), sums l over its quad
        and writes the rows < R of its tile; padding rows (past R) are never written.
    flash_decode_combine  grid (T * H, B), DECODE_COMBINE_THREADS threads over D
        M = max_s m_s; w_s = exp2(m_s - M); l = sum_s w_s l_s; acc = sum_s w_s acc_s
        written as the rank's partial in natural-log units: acc (B, T, H, D) (un-normalised,
        relative to m), m (B, H, T) = M * ln 2, l (B, H, T) — what burstcu.ops.decode.partial
        returns on the CPU, so the ranks' partials merge alike (burstcu.ops.decode.merge).
    flash_decode_merge    grid (T * H, B), DECODE_COMBINE_THREADS threads over D: the G ranks'
        partials (acc, m, l; rank r's at the addresses of rank 0's + r * rank_stride floats, as
        one all-gather lays them) merged in rank order into the call's result, one launch:
        M = max_r m_r; w_r = exp(m_r - M); L = sum_r w_r l_r; out = (sum_r w_r acc_r) / L in
        the output dtype, lse = M + ln L (burstcu.ops.decode.merge, the same steps and order);
        a row no rank saw (L = 0) gets out 0 and lse -inf.
    flash_decode_finish   grid (T * H, B), DECODE_COMBINE_THREADS threads over D: a decode whose
        cache rows all lie on this rank (one rank) in place of combine + merge, one launch less
        a token: the combine's sums (the same helpers, split_row and splits_sum, so the same
        order and roundings), then out = acc / l in the output dtype and lse = M ln 2 + ln l
        (M ln 2 rounded first, as the combine stores it: __fmul_rn keeps it out of an FMA). The
        merge of one rank weighs its partial by exp(0) = 1, so the finish gives the bits of
        combine + merge: on the emulator
        (tests/kernels/test_decode_emulated.py), and on a GPU by the SASS (NVRTC 13, sm_90: both
        kernels write out as acc times MUFU.RCP(l) and lse as FFMA(LG2(l), ln 2, M ln 2)).
A row that saw no valid key keeps m = -inf, l = 0, acc = 0; exponents use 0 in place of an -inf
maximum (the finite -inf guard of flash_fwd.cu), so no NaN comes from empty splits or rows. Only
l = 0 makes a row empty (out 0, lse -inf; so do valid keys whose scores are all -inf): a NaN in q
or a valid row of K (or an Inf one: a +inf score) makes l NaN, which is not "no key": out and
lse NaN, on every rank after the merge; a NaN in a valid row of V reaches only acc's columns it
multiplies. A
zero-filled key row gives s = 0, replaced by -inf (a select, not a product), and p = 0 against a
zero V row: nothing past n_b reaches the output, whatever the memory there holds.

WHY THESE TILES (napkin math, H100: 3.35 TB/s HBM, 132 SMs, ~25 GB/s = 12.7 B/clk an SM)
The kernel is memory-bound while the FMAs a key (2 * R * D) cost fewer issue slots than its
bytes (2 * D * 2 at fp16) take at the SM's share of HBM: a 32-key fp16 tile at D = 128 is 16 KB,
~1300 SM clocks of HBM time, against ~R * 300 warp instructions spread over the block's warps.
Little's law: ~3 MB must be in flight (1 us latency), ~25 KB an SM: STAGES - 1 tiles ahead of
the 2-3 resident blocks an SM covers that. The split count fills the SMs (burstcu.ops.cuda.decode,
FlashAttention's efficiency heuristic). Rows padded by 16 bytes in shared memory, so the eight
lanes of a 16-byte access phase read rows four banks apart (no conflict). By this count the
CUDA-core kernel would keep up with HBM at a few rows a tile (measured: it did not, below); the
FMAs a K/V byte grow with R (R / 2 at fp16: 2 R D
FMAs for 4 D bytes of K and V), so with GQA and several new tokens a call (T up to 8, G up to 8:
R = 16 to 64) it stops doing so: at R = 64, 12.7 B/clk an SM (H100's HBM) asks ~400 FMA/clk of an
SM's 128 fp32 FMA lanes. The twin puts both products on the tensor cores (mma.sync m16n8k16:
~1000 fp16 FMA/clk an SM at an A100's datasheet rate, more on an H100: ~2.5x the need at R = 64
with H100's HBM, ~3x with A100's); under 16 rows it runs one m16 tile with zero rows
(burstcu.ops.cuda.decode.MMA_MIN_ROWS). The rates above are datasheet leads. Measured on an H200
(bench/results/gpu_decode.md, 32/8 heads, d = 128, fp16, 1M cache rows): the CUDA-core kernel
on R = 4 read 0.38 of the copy bandwidth, the twin on R = 32 read 0.55: the CUDA-core kernel's
gap is not its FMAs.
Twin tiles: 64 keys a tile so that a key slice of each of the 4 warps is a whole k16 step at
ROWS = 16 (32 at DN = 256 with ROWS >= 32, for sm_86's shared memory); stages as above (2 to 4:
40 KB at DN = 32 up to 132 KB at DN = 256, ROWS = 16, where two stages are the least); the key
slices of a row tile, rather than idle warps, keep all four warps on the tensor cores at R = 16
and 32, at the price of one merge through shared memory a block. Rows padded by 16 bytes: the 8
row addresses of an ldmatrix fall in 8 different bank groups (flash_fwd.cu).

VARIANTS (burstcu/build/decode_variants.py)
    flash_decode_split<T, DPL, ROWS, NWARPS, STAGES>   T in {__half, __nv_bfloat16, float}; DPL
        in {1, 2, 4, 8} (D <= 32 * DPL); ROWS = 32 (DPL <= 4) or 16 (DPL = 8): RW * DPL <= 32
        fp32 accumulators a lane; NWARPS = 4; STAGES from the stage size (2..4, about 64 KB of
        K/V in flight a block); dynamic shared memory (decode_variants.smem_bytes); vec = 0 (D
        or a stride not a multiple of 16 bytes, an unaligned pointer) loads element by element
        into the same ring
    flash_decode_split_mma<T, DN, ROWS, BKM, NWARPS, STAGES>   T in {__half, __nv_bfloat16};
        DN in {32, 64, 128, 256} (D <= DN; columns past D zero-filled like the other kernels'
        padding); ROWS in {16, 32, 64} (families decode_mma16/32/64); NWARPS = 4; BKM and
        STAGES as above (decode_variants.mma_keys, mma_stages); dynamic shared memory
        decode_variants.mma_smem_bytes (decode::MmaLayout); vec = 0 as above. A variant over a
        table's shared memory is left out (DN = 256 at ROWS = 16 on sm_86: ROWS = 32 runs).
        From the compile gate (NVRTC 13, no spills; registers fp16 = bf16, sm_80 / sm_86 / sm_90):
            DN  ROWS  BKM  STAGES  smem B   registers       DN  ROWS  BKM  STAGES  smem B   registers
            32   16    64    4     40960   103/103/109     128   16    64    2     69632   183/183/187
            32   32    64    4     40960   109/109/112     128   32    64    2     69632   201/201/208
            32   64    64    4     40960   115/117/124     128   64    64    2     69632   223/225/223
            64   16    64    3     55296   150/150/160     256   16    64    2    143616   254/ - /247
            64   32    64    3     55296   154/154/159     256   32    32    2     84480   255/255/255
            64   64    64    3     55296   169/171/171     256   64    32    2    101376   246/244/244
        (ptxas takes what __launch_bounds__(128, 2) leaves, up to 255, for the loads it hoists;
        blocks an SM: the registers allow 2 to 4, the shared memory 1 to 5, by DN and GPU)
    flash_decode_combine   one kernel for every dtype (fp32 in, fp32 out)
    flash_decode_merge<TOut>   TOut in {__half, __nv_bfloat16, float} (fp32 partials in)
    flash_decode_finish<TOut>  TOut as the merge's (the fp32 workspace in)
*/
#pragma once

#include "common.cuh"

// Everything the split kernel reads; element strides (64-bit) of q (B, T, H, D) and of the
// cache along its first three axes (the last is contiguous).
template <typename T>
struct DecodeSplitParams {
  const T* q;               // (B, T, H, D)
  const T* k;               // (B, S, Hkv, D), or paged (P, page_size, Hkv, D)
  const T* v;               // k's shape and strides
  const int* lengths;       // (B,): valid cache rows of each batch row
  const int* page_table;    // (B, max_pages): the page of each page_size rows; null: not paged
  float* ws_m;              // (B, H, T, splits) running max, base 2
  float* ws_l;              // (B, H, T, splits) running sum
  float* ws_acc;            // (B, H, T, splits, D) un-normalised output
  long long q_sb, q_st, q_sh;
  long long k_sb, k_ss, k_sh;   // paged: k_sb is the stride between pages
  long long pt_sb;          // page_table's row stride
  int T_, H, Hkv, D;        // new tokens, query heads, kv heads, head dim
  int chunk, splits;        // keys a split (a multiple of decode::BK), splits a row
  int page_size;            // rows a page (paged), else 0
  int vec;                  // 1: every K/V row chunk is 16-byte aligned (cp.async); 0: elements
  float scale_log2;         // softmax scale * log2(e)
};

// Everything the combine kernel reads (workspace layout as above).
struct DecodeCombineParams {
  const float* ws_m;
  const float* ws_l;
  const float* ws_acc;
  float* acc;               // (B, T, H, D) contiguous
  float* m;                 // (B, H, T) contiguous, natural log units
  float* l;                 // (B, H, T) contiguous
  int T_, H, D, splits;
};

// Everything the finish kernel reads: the workspace as above, the call's result as the merge's.
struct DecodeFinishParams {
  const float* ws_m;
  const float* ws_l;
  const float* ws_acc;
  void* out;                // (B, T, H, D) contiguous, the kernel's TOut
  float* lse;               // (B, H, T) contiguous
  int T_, H, D, splits;
};

// Everything the merge kernel reads: the ranks' partials as the combine kernel writes them
// (acc (B, T, H, D), m (B, H, T) natural log, l (B, H, T), contiguous fp32), rank r's at rank 0's
// addresses + r * rank_stride floats.
struct DecodeMergeParams {
  const float* acc;
  const float* m;
  const float* l;
  void* out;                // (B, T, H, D) contiguous, the kernel's TOut
  float* lse;               // (B, H, T) contiguous
  long long rank_stride;    // floats from one rank's partial to the next (0 with one rank)
  int T_, H, D, ranks;
};

namespace decode {

constexpr int BK = 32;   // keys a tile: one a lane in the scores

// The dynamic shared memory of one block, in this order (decode_variants.smem_bytes mirrors it):
//   kv  [STAGES][2][BK][LD] T   K then V of each stage, rows padded to LD = DN + 16 B
//   q   [ROWS][DN] float        the block's query rows, scaled; zero past D and past R
//   p   [NWARPS][RW][BK] float  each warp's probabilities of the tile
template <typename T, int DN, int ROWS, int NWARPS, int STAGES>
struct Layout {
  static constexpr int LD = DN + 16 / (int)sizeof(T);
  static constexpr int TILE = BK * LD;                  // elements of one K or V tile
  static constexpr int RW = ROWS / NWARPS;
  static constexpr int KV_BYTES = STAGES * 2 * TILE * (int)sizeof(T);
  static constexpr int BYTES = KV_BYTES + ROWS * DN * 4 + NWARPS * RW * BK * 4;
};

// Element offset of cache row j of one batch row: contiguous (pages == null) or through the
// batch row's page table.
struct CacheRows {
  const int* pages;
  long long base, sb, ss;
  int page_size;
  __device__ __forceinline__ long long operator()(int j) const {
    if (pages == nullptr) return base + j * ss;
    const int page = j / page_size;
    return base + pages[page] * sb + (j - page * page_size) * ss;
  }
};

// What a block of the split kernels (flash_decode_split, flash_decode_split_mma) works on, grid
// (splits, Hkv x row groups, B): kv head hk and its G = H / Hkv query heads, the block's first
// query row row0 and its rows (at most ROWS) of the R = G x T rows of that head, batch row b, the
// keys [start, stop) of split `split` (chunk keys a split, the row's valid keys at most) in
// `tiles` tiles of KEYS, and where the cache rows of (b, hk) lie.
template <typename T, int ROWS, int KEYS>
struct SplitBlock {
  int G, split, hk, b, row0, rows, start, stop, tiles;
  CacheRows cache;
  __device__ __forceinline__ SplitBlock(const DecodeSplitParams<T>& p, int chunk) {
    G = p.H / p.Hkv;
    const int R = G * p.T_, groups = (R + ROWS - 1) / ROWS;
    split = blockIdx.x;
    hk = blockIdx.y / groups;
    b = blockIdx.z;
    row0 = (blockIdx.y % groups) * ROWS;
    rows = min(ROWS, R - row0);
    start = split * chunk;
    stop = min(start + chunk, p.lengths[b]);
    tiles = stop > start ? (stop - start + KEYS - 1) / KEYS : 0;
    cache = CacheRows{p.page_table == nullptr ? nullptr : p.page_table + b * p.pt_sb,
                      (p.page_table == nullptr ? b * p.k_sb : 0) + (long long)hk * p.k_sh, p.k_sb,
                      p.k_ss, p.page_size};
  }
};

// The float of a 16-bit T given as its bits (the low 16 of b).
template <typename T> __device__ __forceinline__ float bits_to_float(u32 b);
template <> __device__ __forceinline__ float bits_to_float<__half>(u32 b) {
  return __half2float(__ushort_as_half((unsigned short)b));
}
template <> __device__ __forceinline__ float bits_to_float<__nv_bfloat16>(u32 b) {
  return __uint_as_float(b << 16);
}

// N consecutive elements of T at src (shared memory, N * sizeof(T) bytes aligned) as floats,
// through the widest loads that fit: 16-byte words, else 8, 4, 2.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* src, float* out) {
  constexpr int BYTES = N * (int)sizeof(T);
  if constexpr (sizeof(T) == 4 && N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      const float4 w = *reinterpret_cast<const float4*>(src + i);
      out[i] = w.x; out[i + 1] = w.y; out[i + 2] = w.z; out[i + 3] = w.w;
    }
  } else if constexpr (sizeof(T) == 2 && BYTES >= 4) {
    constexpr int WORDS = BYTES / 4, STEP = WORDS >= 4 ? 4 : WORDS;
#pragma unroll
    for (int w0 = 0; w0 < WORDS; w0 += STEP) {
      u32 words[STEP];
      if constexpr (STEP == 4) {
        const uint4 x = *reinterpret_cast<const uint4*>(src + 2 * w0);
        words[0] = x.x; words[1] = x.y; words[2] = x.z; words[3] = x.w;
      } else if constexpr (STEP == 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(src + 2 * w0);
        words[0] = x.x; words[1] = x.y;
      } else {
        words[0] = *reinterpret_cast<const u32*>(src + 2 * w0);
      }
#pragma unroll
      for (int e = 0; e < STEP; ++e) {
        out[2 * (w0 + e)] = bits_to_float<T>(words[e] & 0xffffu);
        out[2 * (w0 + e) + 1] = bits_to_float<T>(words[e] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int e = 0; e < N; ++e) out[e] = to_float(src[e]);
  }
}

// Stage one tile of KEYS cache rows, [j0, j0 + KEYS), into dst ([KEYS][LD]): rows past n (the
// split's valid keys from j0) and columns past D become zeros without a read. vec: 16-byte
// cp.async copies; else the elements through registers (visible after the next barrier).
template <typename T, int DN, int LD, int NT, int KEYS = BK>
__device__ __forceinline__ void load_tile(T* dst, const T* src, const CacheRows& rows, int j0,
                                          int n, int D, bool vec) {
  constexpr int VEC = 16 / (int)sizeof(T), CPR = DN / VEC, CHUNKS = KEYS * CPR;
#pragma unroll
  for (int it = 0; it < (CHUNKS + NT - 1) / NT; ++it) {
    const int c = threadIdx.x + it * NT;
    if (CHUNKS % NT != 0 && c >= CHUNKS) break;
    const int r = c / CPR, col = (c % CPR) * VEC;
    T* d = dst + r * LD + col;
    if (r >= n || col >= D) {
      *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    } else if (vec) {
      cp_async_16(d, src + rows(j0 + r) + col, true);
    } else {
      const T* s = src + rows(j0 + r) + col;
#pragma unroll
      for (int e = 0; e < VEC; ++e) d[e] = col + e < D ? s[e] : from_float<T>(0.f);
    }
  }
}

// The tensor-core twin's dynamic shared memory (decode_variants.mma_smem_bytes mirrors it):
//   kv  [STAGES][2][BKM][LD] T   K then V of each stage, rows padded to LD = DN + 8 (16 B)
//   q   [ROWS][LD] T             the block's query rows, unscaled; zero past D and past R. At
//                                DN <= 128 it lies in the last stage (its fragments go to
//                                registers before the ring first fills that stage), else after
// and, once the ring is drained, the key slices' merge scratch at the start of kv: slice s > 0
// of row tile r at floats ((s - 1) * MT + r) * SLOT, its fragments lane-major (no conflict).
template <typename T, int DN, int ROWS, int BKM, int NWARPS, int STAGES>
struct MmaLayout {
  static constexpr int LD = DN + 8;
  static constexpr int TILE = BKM * LD;                 // elements of one K or V tile
  static constexpr int MT = ROWS / 16;                  // row tiles, 16 query rows each
  static constexpr int KS = NWARPS / MT;                // key slices: the warps of a row tile
  static constexpr int KW = BKM / KS;                   // keys of a tile a warp takes
  static constexpr bool Q_IN_RING = DN <= 128;
  static constexpr int KV_BYTES = STAGES * 2 * TILE * 2;
  static constexpr int Q_BYTES = ROWS * LD * 2;
  static constexpr int BYTES = KV_BYTES + (Q_IN_RING ? 0 : Q_BYTES);
  static constexpr int SLOT = 32 * (DN / 2 + 4);        // a warp's o fragments, m[2], l[2]
  static constexpr int MERGE_BYTES = (KS - 1) * MT * SLOT * 4;
  static_assert(NWARPS % MT == 0 && KW % 16 == 0 && KS * KW == BKM, "whole k16 slices a warp");
  static_assert(!Q_IN_RING || Q_BYTES <= 2 * TILE * 2, "q fits one stage");
  static_assert(MERGE_BYTES <= KV_BYTES, "the merge scratch fits the ring");
};

}  // namespace decode

// min blocks 2: with the default bound ptxas capped the registers at 96 and spilled at DPL = 4;
// 2 blocks of 128 threads leave it up to 255 (shared memory then decides how many blocks an SM
// holds: burstcu.ops.cuda.decode.blocks_per_sm, 1 to 7 by dtype, head dim and GPU)
template <typename T, int DPL, int ROWS, int NWARPS, int STAGES>
__global__ void __launch_bounds__(NWARPS * 32, 2)
flash_decode_split(const __grid_constant__ DecodeSplitParams<T> p) {
  constexpr int DN = 32 * DPL, BK = decode::BK;
  using L = decode::Layout<T, DN, ROWS, NWARPS, STAGES>;
  constexpr int RW = L::RW, LD = L::LD;
  static_assert(STAGES >= 2 && ROWS % NWARPS == 0, "a ring of two stages at least");
  // fields used below, read once (see params.cuh on reading parameter structs)
  const int T_ = p.T_, H = p.H, D = p.D, chunk = p.chunk, splits = p.splits;
  const float scale_log2 = p.scale_log2;
  const bool vec = p.vec != 0;
  const decode::SplitBlock<T, ROWS, BK> blk(p, chunk);
  const int G = blk.G, split = blk.split, hk = blk.hk, b = blk.b, row0 = blk.row0, rows = blk.rows;
  const int start = blk.start, stop = blk.stop, tiles = blk.tiles;
  const decode::CacheRows& cache = blk.cache;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* __restrict__ kg = p.k;
  const T* __restrict__ vg = p.v;

  BURSTCU_DYNAMIC_SMEM(unsigned char, smem);
  T* kv = reinterpret_cast<T*>(smem);
  float* qs = reinterpret_cast<float*>(smem + L::KV_BYTES);
  float* ps = qs + ROWS * DN + warp * RW * BK;          // this warp's probabilities

  // query row r of the block is (query head hk * G + g, token t) with row0 + r = g * T + t;
  // zeros past D and past the block's rows, so the score loop runs over DN columns unmasked
  for (int i = threadIdx.x; i < ROWS * DN; i += NWARPS * 32) {
    const int r = i / DN, d = i % DN;
    float x = 0.f;
    if (r < rows && d < D) {
      const int g = (row0 + r) / T_, t = (row0 + r) % T_;
      x = to_float(p.q[b * p.q_sb + t * p.q_st + (long long)(hk * G + g) * p.q_sh + d]) * scale_log2;
    }
    qs[i] = x;
  }
  // the prologue: tiles 0 .. STAGES-2 in flight, one commit group each (empty past the end)
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < tiles) {
      const int j0 = start + i * BK;
      T* stage = kv + i * 2 * L::TILE;
      decode::load_tile<T, DN, LD, NWARPS * 32>(stage, kg, cache, j0, stop - j0, D, vec);
      decode::load_tile<T, DN, LD, NWARPS * 32>(stage + L::TILE, vg, cache, j0, stop - j0, D, vec);
    }
    cp_async_commit();
  }

  float m[RW], l[RW], acc[RW][DPL];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[i][e] = 0.f;
  }
  const int mine = rows > warp ? (rows - warp + NWARPS - 1) / NWARPS : 0;   // rows this warp owns
  for (int tile = 0; tile < tiles; ++tile) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();   // tile `tile` landed for every thread; every warp is done with tile - 1
    {
      const int next = tile + STAGES - 1;
      if (next < tiles) {
        const int j0 = start + next * BK;
        T* stage = kv + (next % STAGES) * 2 * L::TILE;
        decode::load_tile<T, DN, LD, NWARPS * 32>(stage, kg, cache, j0, stop - j0, D, vec);
        decode::load_tile<T, DN, LD, NWARPS * 32>(stage + L::TILE, vg, cache, j0, stop - j0, D, vec);
      }
      cp_async_commit();
    }
    if (mine == 0) continue;                      // a warp without rows only loads
    const T* ks = kv + (tile % STAGES) * 2 * L::TILE;
    const T* vs = ks + L::TILE;
    const int valid = min(BK, stop - (start + tile * BK));

    // scores: lane = key; q_r read as broadcast float4s
    float s[RW];
#pragma unroll
    for (int i = 0; i < RW; ++i) s[i] = 0.f;
    constexpr int VEC = 16 / (int)sizeof(T);
#pragma unroll
    for (int c = 0; c < DN; c += VEC) {
      float kf[VEC];
      decode::load_floats<T, VEC>(ks + lane * LD + c, kf);
#pragma unroll
      for (int i = 0; i < RW; ++i) {
        if (i >= mine) break;
        const float* qr = qs + (warp + NWARPS * i) * DN + c;
#pragma unroll
        for (int e = 0; e < VEC; e += 4) {
          const float4 q4 = *reinterpret_cast<const float4*>(qr + e);
          s[i] += q4.x * kf[e] + q4.y * kf[e + 1] + q4.z * kf[e + 2] + q4.w * kf[e + 3];
        }
      }
    }
    // online softmax, one row at a time; the lane keeps its own share of l
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      if (i >= mine) break;
      const float si = lane < valid ? s[i] : -INFINITY;
      const float m_new = fmaxf(m[i], warp_max<32>(si));
      const float base = m_new == -INFINITY ? 0.f : m_new;      // finite -inf guard
      const float keep = exp2f(m[i] - base), w = exp2f(si - base);
      l[i] = l[i] * keep + w;
#pragma unroll
      for (int e = 0; e < DPL; ++e) acc[i][e] *= keep;
      m[i] = m_new;
      ps[i * BK + lane] = w;
    }
    __syncwarp();
    // values: four keys at a time; keys past `valid` have p = 0 and zero-filled V rows
#pragma unroll 2
    for (int j = 0; j < BK; j += 4) {
      float vf[4][DPL];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj) decode::load_floats<T, DPL>(vs + (j + jj) * LD + lane * DPL, vf[jj]);
#pragma unroll
      for (int i = 0; i < RW; ++i) {
        if (i >= mine) break;
        const float4 p4 = *reinterpret_cast<const float4*>(ps + i * BK + j);
#pragma unroll
        for (int e = 0; e < DPL; ++e)
          acc[i][e] += p4.x * vf[0][e] + p4.y * vf[1][e] + p4.z * vf[2][e] + p4.w * vf[3][e];
      }
    }
    __syncwarp();      // ps is rewritten by the next tile
  }
  cp_async_wait<0>();  // nothing outstanding when the block ends

  // the warp's rows: l summed over the lanes, then (m, l, acc) of the split to the workspace
  const long long row_stride = (long long)splits;   // ws_m/ws_l: (B, H, T, splits)
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    if (i >= mine) break;
    const float total = warp_sum<32>(l[i]);
    const int r = row0 + warp + NWARPS * i;
    const int g = r / T_, t = r % T_, h = hk * G + g;
    const long long row = (((long long)b * H + h) * T_ + t) * row_stride + split;
    if (lane == 0) {
      p.ws_m[row] = m[i];
      p.ws_l[row] = total;
    }
#pragma unroll
    for (int e = 0; e < DPL; ++e) {
      const int d = lane * DPL + e;
      if (d < D) p.ws_acc[row * D + d] = acc[i][e];
    }
  }
}

// The tensor-core twin (ALGORITHM, flash_decode_split_mma): the same (m, l, acc) of every
// split, S = Q K^T and acc += P V as mma.m16n8k16 (fragments as flash_fwd.cu's).
// min blocks 2, as the CUDA-core kernel's (no register cap below 255 at 128 threads)
template <typename T, int DN, int ROWS, int BKM, int NWARPS, int STAGES>
__global__ void __launch_bounds__(NWARPS * 32, 2)
flash_decode_split_mma(const __grid_constant__ DecodeSplitParams<T> p) {
  using L = decode::MmaLayout<T, DN, ROWS, BKM, NWARPS, STAGES>;
  constexpr int LD = L::LD, MT = L::MT, KS = L::KS, KW = L::KW, NT = NWARPS * 32;
  constexpr int kDTiles = DN / 8;        // n-tiles of P V (8 columns each)
  constexpr int kNTiles = KW / 8;        // n-tiles of Q K^T (8 keys each)
  constexpr int kKChunks = DN / 16;      // k-chunks of Q K^T
  constexpr bool kQInRegs = L::Q_IN_RING;
  static_assert(sizeof(T) == 2 && STAGES >= 2 && DN % 32 == 0, "16-bit T, a ring of two stages");
  // fields used below, read once (see params.cuh on reading parameter structs)
  const int T_ = p.T_, H = p.H, D = p.D, chunk = p.chunk, splits = p.splits;
  const float scale_log2 = p.scale_log2;
  const bool vec = p.vec != 0;
  const decode::SplitBlock<T, ROWS, BKM> blk(p, chunk);
  const int G = blk.G, split = blk.split, hk = blk.hk, b = blk.b, row0 = blk.row0, rows = blk.rows;
  const int start = blk.start, stop = blk.stop, tiles = blk.tiles;
  const decode::CacheRows& cache = blk.cache;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // mma fragment coordinates: row in the tile, thread in the quad
  const int rt = warp % MT, ks = warp / MT;          // the warp's row tile and key slice
  const bool has_rows = rt * 16 < rows;              // warp-uniform: padding tiles only load
  const T* __restrict__ kg = p.k;
  const T* __restrict__ vg = p.v;

  BURSTCU_DYNAMIC_SMEM(unsigned char, smem);
  T* kv = reinterpret_cast<T*>(smem);
  T* sQ = kv + (kQInRegs ? STAGES - 1 : STAGES) * 2 * L::TILE;

  // query row r of the block is (query head hk * G + g, token t) with row0 + r = g * T + t;
  // a warp a row, two elements a lane at a time; zeros past D and past the block's rows
  for (int r = warp; r < ROWS; r += NWARPS) {
    const T* src = nullptr;
    if (r < rows) {
      const int gq = (row0 + r) / T_, tq = (row0 + r) % T_;
      src = p.q + b * p.q_sb + tq * p.q_st + (long long)(hk * G + gq) * p.q_sh;
    }
    for (int d = 2 * lane; d < DN; d += 64) {
      u32 x = 0u;
      if (src != nullptr && d < D) x = bits16<T>(src[d]) | (d + 1 < D ? bits16<T>(src[d + 1]) << 16 : 0u);
      *reinterpret_cast<u32*>(sQ + r * LD + d) = x;
    }
  }
  // the prologue: tiles 0 .. STAGES-2 in flight, one commit group each (empty past the end);
  // the last stage (where q may lie) is first filled after the loop's first barrier
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < tiles) {
      const int j0 = start + i * BKM;
      T* stage = kv + i * 2 * L::TILE;
      decode::load_tile<T, DN, LD, NT, BKM>(stage, kg, cache, j0, stop - j0, D, vec);
      decode::load_tile<T, DN, LD, NT, BKM>(stage + L::TILE, vg, cache, j0, stop - j0, D, vec);
    }
    cp_async_commit();
  }
  __syncthreads();   // q stored

  // ldmatrix.x4 row addresses of an A fragment: lanes 0-15 rows 0-15 at column 0, lanes 16-31
  // the same rows at column 8; K's B fragments two n-tiles at once (gemm_qk, common.cuh)
  const T* q_frag_row = sQ + (rt * 16 + lane % 16) * LD + (lane / 16) * 8;
  const int k_frag_row = (lane / 16) * 8 + lane % 8, k_frag_col = ((lane / 8) % 2) * 8;
  u32 qf[kQInRegs ? kKChunks : 1][4];
  if (kQInRegs && has_rows) {
#pragma unroll
    for (int kc = 0; kc < (kQInRegs ? kKChunks : 0); ++kc) ldmatrix_x4(qf[kc], q_frag_row + kc * 16);
  }

  float o[kDTiles][4];   // acc fragments: o[j][0..1] row g, columns 8j+2t..+1; o[j][2..3] row g+8
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};   // l_i: this lane's part of the row sum
#pragma unroll
  for (int j = 0; j < kDTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  for (int tile = 0; tile < tiles; ++tile) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();   // tile `tile` landed for every thread; every warp is done with tile - 1
    {
      const int next = tile + STAGES - 1;
      if (next < tiles) {
        const int j0 = start + next * BKM;
        T* stage = kv + (next % STAGES) * 2 * L::TILE;
        decode::load_tile<T, DN, LD, NT, BKM>(stage, kg, cache, j0, stop - j0, D, vec);
        decode::load_tile<T, DN, LD, NT, BKM>(stage + L::TILE, vg, cache, j0, stop - j0, D, vec);
      }
      cp_async_commit();
    }
    // the split's keys left from the warp's first key of this tile (warp-uniform): none, or no
    // row in the warp's tile, and it only loads
    const int valid = stop - start - (tile * BKM + ks * KW);
    if (!has_rows || valid <= 0) continue;
    const T* kt = kv + (tile % STAGES) * 2 * L::TILE + ks * KW * LD;
    const T* vt = kt + L::TILE;

    // ---- S = Q K^T: the warp's 16 rows x KW keys
    float s[kNTiles][4];
    gemm_qk<T, kNTiles, kKChunks, kQInRegs>(s, qf, q_frag_row, kt, LD, k_frag_row, k_frag_col);
    // ---- base-2 units; a key past the split's end gets -inf by a select (its zero-filled row
    // gave s = 0: never a product with what the memory there holds)
    const bool need_mask = valid < KW;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = s[j][e] * scale_log2;
        s[j][e] = need_mask && 8 * j + 2 * t + (e & 1) >= valid ? -INFINITY : x;
      }
    }
    // ---- online softmax (common.cuh, flash_fwd.cu's, with its finite -inf guard)
    float alpha[2];
    online_softmax(s, m_i, l_i, alpha);
#pragma unroll
    for (int j = 0; j < kDTiles; ++j) {
      o[j][0] *= alpha[0]; o[j][1] *= alpha[0];
      o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
    }
    // ---- acc += P V: S's accumulator fragments re-packed as A fragments, V by ldmatrix .trans;
    // a key past the end has p = 0 against a zero-filled V row
    gemm_rs<T, KW, DN>(o, s, vt, LD, 0);
  }
  cp_async_wait<0>();  // nothing outstanding when the ring is reused or the block ends

  // ---- the key slices of a row tile merged into slice 0's registers, through the drained ring
  if constexpr (KS > 1) {
    __syncthreads();   // every warp is done with the ring
    float* scratch = reinterpret_cast<float*>(smem);
    if (ks > 0 && has_rows) {
      float* mine = scratch + ((ks - 1) * MT + rt) * L::SLOT + lane;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mine[(4 * j + e) * 32] = o[j][e];
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        mine[(4 * kDTiles + r2) * 32] = m_i[r2];
        mine[(4 * kDTiles + 2 + r2) * 32] = l_i[r2];
      }
    }
    __syncthreads();
    if (ks == 0 && has_rows) {
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        float top = m_i[r2];
#pragma unroll
        for (int sl = 1; sl < KS; ++sl)
          top = fmaxf(top, scratch[((sl - 1) * MT + rt) * L::SLOT + (4 * kDTiles + r2) * 32 + lane]);
        const float ref = top == -INFINITY ? 0.f : top;
        const float w0 = exp2f(m_i[r2] - ref);
        l_i[r2] *= w0;
#pragma unroll
        for (int j = 0; j < kDTiles; ++j) {
          o[j][2 * r2] *= w0;
          o[j][2 * r2 + 1] *= w0;
        }
#pragma unroll
        for (int sl = 1; sl < KS; ++sl) {
          const float* other = scratch + ((sl - 1) * MT + rt) * L::SLOT + lane;
          const float w = exp2f(other[(4 * kDTiles + r2) * 32] - ref);
          l_i[r2] += w * other[(4 * kDTiles + 2 + r2) * 32];
#pragma unroll
          for (int j = 0; j < kDTiles; ++j) {
            o[j][2 * r2] += w * other[(4 * j + 2 * r2) * 32];
            o[j][2 * r2 + 1] += w * other[(4 * j + 2 * r2 + 1) * 32];
          }
        }
        m_i[r2] = top;
      }
    }
  }

  // ---- the rows of the warp's tile (slice 0): l summed over the quad, then the split's (m, l,
  // acc) to the workspace; padding rows (past R) are never written
  if (ks == 0 && has_rows) {
    const long long row_stride = (long long)splits;   // ws_m/ws_l: (B, H, T, splits)
    // float2 stores where every row's pairs lie on 8 bytes (D even, ws_acc on 8 bytes)
    const bool pairs = (D & 1) == 0 && (reinterpret_cast<unsigned long long>(p.ws_acc) & 7u) == 0;
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const float total = warp_sum<4>(l_i[r2]);
      const int rr = rt * 16 + g + 8 * r2;
      if (rr >= rows) continue;
      const int gq = (row0 + rr) / T_, tq = (row0 + rr) % T_, h = hk * G + gq;
      const long long row = (((long long)b * H + h) * T_ + tq) * row_stride + split;
      if (t == 0) {
        p.ws_m[row] = m_i[r2];
        p.ws_l[row] = total;
      }
      float* out = p.ws_acc + row * D;
#pragma unroll
      for (int j = 0; j < kDTiles; ++j) {
        const int d = 8 * j + 2 * t;
        if (pairs && d + 1 < D) {
          *reinterpret_cast<float2*>(out + d) = make_float2(o[j][2 * r2], o[j][2 * r2 + 1]);
        } else {
          if (d < D) out[d] = o[j][2 * r2];
          if (d + 1 < D) out[d + 1] = o[j][2 * r2 + 1];
        }
      }
    }
  }
}

#define DECODE_COMBINE_THREADS 128

// One row's splits (m, l: splits floats; acc: splits x D) reduced, shared by the combine and the
// finish so that both sum in one order with one rounding each: the largest m (base 2), then
// sums weighted by exp2(m_s - base), base = that maximum or 0 where it is -inf (no NaN).
struct SplitRow {
  long long row;      // the block's (b, h, t) in (B, H, T)
  long long at;       // its first element in (B, T, H, D)
  const float* m;     // its splits' m (l and acc at the same row of ws_l, ws_acc)
  float top, base;    // the largest m, and the weights' base
};
__device__ __forceinline__ SplitRow split_row(const float* ws_m, int T_, int H, int D, int splits) {
  const int h = blockIdx.x / T_, t = blockIdx.x % T_, b = blockIdx.y;
  SplitRow r;
  r.row = ((long long)b * H + h) * T_ + t;
  r.at = (((long long)b * T_ + t) * H + h) * D;
  r.m = ws_m + r.row * splits;
  r.top = -INFINITY;
  for (int s = 0; s < splits; ++s) r.top = fmaxf(r.top, r.m[s]);
  r.base = r.top == -INFINITY ? 0.f : r.top;
  return r;
}
__device__ __forceinline__ float splits_sum(const SplitRow& r, const float* x, long long stride,
                                            int splits) {
  float sum = 0.f;
  for (int s = 0; s < splits; ++s) sum += exp2f(r.m[s] - r.base) * x[s * stride];
  return sum;
}

__global__ void __launch_bounds__(DECODE_COMBINE_THREADS)
flash_decode_combine(const __grid_constant__ DecodeCombineParams p) {
  const int D = p.D, splits = p.splits;
  const SplitRow r = split_row(p.ws_m, p.T_, p.H, D, splits);
  const float* acc = p.ws_acc + r.row * splits * D;
  for (int d = threadIdx.x; d < D; d += DECODE_COMBINE_THREADS)
    p.acc[r.at + d] = splits_sum(r, acc + d, D, splits);
  if (threadIdx.x == 0) {
    p.m[r.row] = r.top == -INFINITY ? -INFINITY : __fmul_rn(r.top, 0.6931471805599453f);    // ln 2
    p.l[r.row] = splits_sum(r, p.ws_l + r.row * splits, 1, splits);
  }
}

template <typename TOut>
__global__ void __launch_bounds__(DECODE_COMBINE_THREADS)
flash_decode_finish(const __grid_constant__ DecodeFinishParams p) {
  const int D = p.D, splits = p.splits;
  const SplitRow r = split_row(p.ws_m, p.T_, p.H, D, splits);
  const float total = splits_sum(r, p.ws_l + r.row * splits, 1, splits);   // every thread's divisor
  const bool seen = total != 0.f;   // 0: no valid key; a NaN a key brought stays NaN
  const float* acc = p.ws_acc + r.row * splits * D;
  for (int d = threadIdx.x; d < D; d += DECODE_COMBINE_THREADS) {
    const float sum = splits_sum(r, acc + d, D, splits);
    static_cast<TOut*>(p.out)[r.at + d] = from_float<TOut>(seen ? sum / total : 0.f);
  }
  if (threadIdx.x == 0)
    p.lse[r.row] = seen ? __fmul_rn(r.top, 0.6931471805599453f) + logf(total) : -INFINITY;
}

template <typename TOut>
__global__ void __launch_bounds__(DECODE_COMBINE_THREADS)
flash_decode_merge(const __grid_constant__ DecodeMergeParams p) {
  const int T_ = p.T_, H = p.H, D = p.D, ranks = p.ranks;
  const long long stride = p.rank_stride;
  const int h = blockIdx.x / T_, t = blockIdx.x % T_, b = blockIdx.y;
  const long long row = ((long long)b * H + h) * T_ + t;          // in (B, H, T)
  const long long at = (((long long)b * T_ + t) * H + h) * D;     // in (B, T, H, D)
  float top = -INFINITY;
  for (int r = 0; r < ranks; ++r) top = fmaxf(top, p.m[r * stride + row]);
  const float shift = top == -INFINITY ? 0.f : top;               // exp(-inf - 0) = 0, no NaN
  float total = 0.f;
  for (int r = 0; r < ranks; ++r) total += expf(p.m[r * stride + row] - shift) * p.l[r * stride + row];
  const bool seen = total != 0.f;   // 0: no valid key anywhere; a NaN a key brought stays NaN
  TOut* out = (TOut*)p.out + at;
  for (int d = threadIdx.x; d < D; d += DECODE_COMBINE_THREADS) {
    float sum = 0.f;
    for (int r = 0; r < ranks; ++r)
      sum += expf(p.m[r * stride + row] - shift) * p.acc[r * stride + at + d];
    out[d] = from_float<TOut>(seen ? sum / total : 0.f);
  }
  if (threadIdx.x == 0) p.lse[row] = seen ? shift + logf(total) : -INFINITY;
}
