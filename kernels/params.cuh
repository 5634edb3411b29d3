// params.cuh — the parameter structs of the burstcu kernels: every __global__ function takes one
// of these by value (`const __grid_constant__ XxxParams<T> p`) and nothing else.
//
// Why structs: a step kernel needs ~35 values (pointers, strides, the rectangle, the scale); as
// loose arguments every launcher had to repeat their order, and the forward and backward drifted
// apart (int64 strides in one, int32 in the other). One struct per kernel gives each value a name
// and a comment, one place to change, and one layout to check.
//
// The host mirror is burstcu/ops/cuda/params.py: one `CStruct` per struct below, declaring the same
// fields in the same order, from which a NumPy structured dtype with C alignment is made; the
// launchers fill it once per launch and pass it as a numpy.void scalar (CuPy copies its bytes
// into the kernel's parameter space, the emulator into the struct). The layout test
// (tests/kernels/test_params_layout.py) compares every size, alignment and offset with what g++
// and NVRTC make of this file, so a field added here and not there (or in another order) fails
// on a CPU. Rules that keep the two in step:
//   * only fixed-size members: pointers (8 bytes), long long, int, float, and the structs here;
//   * no default member initialisers, no base classes, nothing virtual (standard layout, so
//     offsetof is defined and g++, nvcc and NVRTC all lay it out by natural alignment);
//   * 8-byte members first, then 4-byte ones, so that no padding is needed inside.
// Kernel parameters may take 4 KB (32 KB from CUDA 12.1 on Volta and newer): the largest struct
// here, BwdStepSm90Params, takes 832 bytes (BwdStepParams 288).
//
// Reading a parameter struct: a kernel copies the fields it uses into locals at its top, before
// any loop, and uses only those. A field read where it is used (inside the tile loops) is
// addressed through a register holding the parameter's address, and ptxas then computes what
// derives from it (tile offsets, mask bounds) per thread instead of on the uniform datapath:
// about 36 more registers for flash_bwd_dq at D = 128 (NVRTC 13.0, sm_80). Read at the top,
// each field is a constant-bank operand, as a scalar argument was.
//
// Conventions: every tensor has a contiguous last dim (D, or S for the row statistics), and its
// other strides are in elements, as 64-bit integers (a (B, S, H, D) tensor passes 2^31 elements at
// S = 1M, H = 16, D = 128). Sizes and positions are int: positions stay below 2^30 and the key
// bounds at most NO_BOUND = 2^29 (burstcu.ops.cuda.params), so their sums fit.
#pragma once

#include "common.cuh"

// Element strides of a (B, S, H, D) tensor along B, S and H (D is contiguous).
struct RowStrides {
  long long b, s, h;
};

// Element strides of a (B, H, S) fp32 row statistic (m, l, lse, delta, psum) along B and H
// (S is contiguous).
struct StatStrides {
  long long b, h;
};

// The rectangle one step launch covers (a burstcu.layout.Block) and its key bounds: query rows
// [q_start, q_start + q_len) against key rows [k_start, k_start + k_len); element (i, j), counted
// from q_start and k_start, is kept iff q_pos + i - lo <= k_pos + j <= q_pos + i + hi
// (causal: hi = 0; a sliding window (left, right): lo = left, hi = right; no bound: NO_BOUND).
struct BlockRect {
  int q_start, q_len;  // first query row (index into the tensors' S dim) and row count
  int k_start, k_len;  // first key row and key count
  int q_pos, k_pos;    // global positions of rows q_start and k_start
  int hi, lo;          // key bounds (above)
};

// flash_fwd_step: fold one BlockRect into the running forward state (acc, m, l).
template <typename T>
struct FwdStepParams {
  const T* q;             // (B, Sq, H, D) queries, strides q_stride
  const T* k;             // (B, Sk, Hkv, D) keys, strides kv_stride
  const T* v;             // (B, Sk, Hkv, D) values, strides kv_stride (the same as k's)
  float* acc;             // (B, Sq, H, D) fp32 un-normalised output, strides acc_stride
  float* m;               // (B, H, Sq) fp32 running max of the scaled scores (base 2), ml_stride
  float* l;               // (B, H, Sq) fp32 running sum of exp2(s - m), ml_stride (m's)
  const int* nonfinite;   // device int: nonzero runs the CAREFUL twin (kernels/README.md)
  RowStrides q_stride;    // of q
  RowStrides kv_stride;   // of k and v
  RowStrides acc_stride;  // of acc
  StatStrides ml_stride;  // of m and l
  BlockRect blk;          // the rectangle and its key bounds
  int H, Hkv;             // query heads, kv heads (GQA: query head h reads kv head h / (H / Hkv))
  float scale_log2;       // softmax_scale * log2(e)
  // flash_fwd_steps only (flash_fwd_step leaves them 0 and reads blk): every rectangle of a ring
  // step in one launch, grouped by query range (the rectangles of a group share q_start and
  // q_len, each its own k_pos - q_pos; groups share no query row)
  const BlockRect* rects; // the rectangles, group by group, in the order they fold
  const int* groups;      // (2 n_groups + 2): group g's rectangles are rects[groups[g] ..
                          // groups[g + 1]), its query tiles blockIdx.x in [groups[n_groups + 1 + g],
                          // groups[n_groups + 2 + g])
  const int2* row_keys;   // null, or (a packed list, below) query row i sees only the key rows
                          // [row_keys[i].x, row_keys[i].y) besides its rectangle's bounds
  int n_groups;
  // flash_fwd_pass only (a pass of one fold: acc, m, l then null): the output and its lse
  T* out;                 // (B, Sq, H, D) output, strides out_stride
  float* lse;             // (B, H, Sq) fp32 natural log, strides lse_stride
  RowStrides out_stride;  // of out
  StatStrides lse_stride; // of lse
};

// A CUtensorMap (128 bytes, 64-byte aligned): how a bulk tensor copy (TMA) reads a global
// tensor. Opaque to the kernels: the driver's encoding on a GPU (cuTensorMapEncodeTiled), the
// emulator's mirror on the CPU (kernels/emu/emu_hopper.h); burstcu/ops/cuda/tensor_map.py builds both.
struct __align__(64) TensorMap {
  unsigned long long opaque[16];
};

// flash_fwd_step_sm90: FwdStepParams' fold with Q, K and V read through tensor maps. Each map
// covers only the rows of the rectangle, so rows past q_len / k_len read as zeros:
//   q_map  dims (D, q_len, H, B) from row q_start, box (64, BLOCK_M, 1, 1), 128-byte swizzle
//   k_map  dims (D, k_len, Hkv, B) from row k_start, box (64, BLOCK_N, 1, 1), 128-byte swizzle
//   v_map  the same for v
// The maps come first: their 64-byte alignment then needs no padding.
struct FwdStepSm90Params {
  TensorMap q_map, k_map, v_map;
  float* acc;             // (B, Sq, H, D) fp32 un-normalised output, strides acc_stride
  float* m;               // (B, H, Sq) fp32 running max (base 2), ml_stride
  float* l;               // (B, H, Sq) fp32 running sum, ml_stride (m's)
  const int* nonfinite;   // device int: nonzero runs the careful twin instead (kernels/README.md)
  RowStrides acc_stride;  // of acc
  StatStrides ml_stride;  // of m and l
  BlockRect blk;          // the rectangle and its key bounds
  int H, Hkv;             // query heads, kv heads (GQA)
  float scale_log2;       // softmax_scale * log2(e)
  int n_tiles;            // (query tiles of BLOCK_M rows) x H x B: the persistent grid's work
  int hb_group;           // (batch, head) pairs whose tiles go out together (H x B: one group)
  // flash_fwd_steps_sm90 only (flash_fwd_step_sm90 leaves them 0 and reads blk): a ring step's
  // rectangles as FwdStepParams' lists (query tiles of BLOCK_M rows); the maps then cover the
  // whole arrays (dims (D, Sq or Sk, heads, B)) and each rectangle's rows are reached through
  // the copies' row coordinates (q_start, k_start). n_groups first: no padding before the pointers.
  int n_groups;
  const BlockRect* rects; // the rectangles, group by group, in the order they fold
  const int* groups;      // (2 n_groups + 2): as FwdStepParams.groups
  const int2* row_keys;   // null, or a packed list's key rows of each query row (FwdStepParams')
  // flash_fwd_step_sm90 only (the list kernel's are 0), for a rectangle over every query row of the
  // state: fresh, the state holds nothing yet (not read: acc 0, m -inf, l 0); finalize, the step
  // ends the pass: out and lse are written (flash_fwd_finalize's), the state is not
  void* out;              // finalize: (B, Sq, H, D) in the kernel's T, strides out_stride
  float* lse;             // finalize: (B, H, Sq) fp32 natural log, strides lse_stride
  RowStrides out_stride;  // of out
  StatStrides lse_stride; // of lse
  int fresh, finalize;
};

// flash_bwd_dkdv_sm90: BwdStepParams' dK/dV fold (with atomic dQ) with Q, dO, K and V read
// through tensor maps, each covering only the rectangle's rows (rows past q_len / k_len read as
// zeros; flash_bwd_dkdv_steps_sm90: the whole arrays, below):
//   q_map, do_map  dims (D, q_len, H, B) from row q_start, box (64, BLOCK_M, 1, 1), 128-byte swizzle
//   k_map, v_map   dims (D, k_len, Hkv, B) from row k_start, box (64, keys a block of threads: 128,
//                  64 at D = 256, 1, 1), 128-byte swizzle
struct BwdStepSm90Params {
  TensorMap q_map, do_map, k_map, v_map;
  TensorMap dq_map;       // dq (fp32) as q_map's rows, boxes of 64 rows x 32 floats (bulk dQ only)
  const float* lse;       // (B, H, Sq) fp32 natural-log sum of exp of the forward, stat_stride
  const float* delta;     // (B, H, Sq) fp32 rowsum(dO o O), stat_stride (lse's)
  float* dq;              // (B, Sq, H, D) fp32, strides dq_stride: += scale dS K (atomics)
  float* dk;              // (B, Sk, Hkv, D) fp32, strides dk_stride: += scale dS^T Q
  float* dv;              // (B, Sk, Hkv, D) fp32, strides dk_stride (dk's): += P^T dO
  const int* nonfinite;   // device int: nonzero runs the careful twin instead (flash_bwd.cu's)
  RowStrides dq_stride;   // of dq
  RowStrides dk_stride;   // of dk and dv
  StatStrides stat_stride;  // of lse and delta (rows contiguous)
  BlockRect blk;          // the rectangle and its key bounds
  int H, Hkv;             // query heads, kv heads (GQA)
  float scale;            // softmax scale
  // flash_bwd_dkdv_steps_sm90 only (flash_bwd_dkdv_sm90 leaves them 0 and reads blk): a ring
  // step's rectangles as BwdStepParams' dK/dV lists (grouped by key range, tiles of the kernel's
  // keys a block of threads); the maps then cover the whole arrays (dims (D, Sq or Sk, heads,
  // B)) and a rectangle's rows are reached through the copies' row coordinates. n_groups first:
  // no padding before the pointers.
  int n_groups;
  const BlockRect* rects; // the rectangles, group by group, in the order they fold
  const int* groups;      // (2 n_groups + 2): as BwdStepParams.groups
  const int2* key_rows;   // null, or a packed list's query rows of each key row (BwdStepParams')
  int dq_adds;            // how dQ is added (2 and 3: dq's rows on 16 bytes, non-negative strides):
                          // 1 one float an atomic add, 2 two (red.global.add.v2.f32, D <= 128),
                          // 3 bulk tensor reductions through dq_map (the kernel's DQ = kDqBulk)
};

// flash_fwd_finalize: out = acc / l, lse = (m + log2 l) * ln 2 over the whole (B, S, H) state.
template <typename T>
struct FwdFinalizeParams {
  const float* acc;         // (B, S, H, D) fp32, strides acc_stride
  const float* m;           // (B, H, S) fp32, strides ml_stride
  const float* l;           // (B, H, S) fp32, strides ml_stride (m's)
  T* out;                   // (B, S, H, D) output, strides out_stride
  float* lse;               // (B, H, S) fp32 natural-log sum of exp, strides lse_stride
  RowStrides acc_stride;    // of acc
  RowStrides out_stride;    // of out
  StatStrides ml_stride;    // of m and l
  StatStrides lse_stride;   // of lse
  int S, D;                 // rows a (batch, head) and head dim (acc's last dim)
  int vec;                  // elements a thread: 8 (D % 8 == 0, rows on 16 bytes) or 1
};

// flash_any_nonfinite: set *flag when x holds a value that could poison a masked pair.
template <typename T>
struct NonfiniteParams {
  const T* x;            // (B, S, H, D) tensor to scan (a (B, H, S) statistic as (B, S, H, 1))
  int* flag;             // device int, only ever set to 1 here
  RowStrides x_stride;   // of x
  int S, D;              // rows a (batch, head) and elements a row (S * D / vec < 2^31)
  int vec;               // elements a thread reads: 16 / sizeof(T) (aligned rows) or 1
};

// flash_bwd_delta: delta = rowsum(dO * O) in fp32.
template <typename T>
struct BwdDeltaParams {
  const T* out;               // (B, S, H, D) forward output, strides row_stride
  const T* dout;              // (B, S, H, D) its gradient, strides row_stride (out's)
  float* delta;               // (B, H, S) fp32, strides delta_stride
  RowStrides row_stride;      // of out and dout
  StatStrides delta_stride;   // of delta
  int B, S, H, D;             // sizes of out
};

// flash_bwd_dkdv and flash_bwd_dq: one backward ring step over one BlockRect (or, the _steps
// kernels, over a step's list of them). The two kernels of a deterministic step take the same
// struct (psum is read by the dQ kernels only), a list step one struct each (its own grouping).
template <typename T>
struct BwdStepParams {
  const T* q;               // (B, Sq, H, D) visiting queries, strides q_stride
  const T* dout;            // (B, Sq, H, D) output gradient, strides q_stride (q's)
  const T* k;               // (B, Sk, Hkv, D) resident keys, strides k_stride
  const T* v;               // (B, Sk, Hkv, D) resident values, strides k_stride (k's)
  const float* lse;         // (B, H, Sq) fp32 forward lse (natural log), strides stat_stride
  const float* delta;       // (B, H, Sq) fp32 rowsum(dO * O), strides stat_stride
  float* dq;                // (B, Sq, H, D) fp32 travelling dQ accumulator, strides dq_stride
  float* dk;                // (B, Sk, Hkv, D) fp32 resident dK accumulator, strides dk_stride
  float* dv;                // (B, Sk, Hkv, D) fp32 resident dV accumulator, strides dk_stride
  float* psum;              // (B, H, Sq) fp32 with stat_stride, or null: flash_bwd_dq adds each
                            // row's sum of the recomputed P to it (attention_backward(check=True))
  const int* nonfinite;     // device int: nonzero runs the CAREFUL twin of the pair
  RowStrides q_stride;      // of q and dout
  RowStrides k_stride;      // of k and v
  RowStrides dq_stride;     // of dq
  RowStrides dk_stride;     // of dk and dv
  StatStrides stat_stride;  // of lse, delta and psum
  BlockRect blk;            // the rectangle and its key bounds
  int H, Hkv;               // query heads, kv heads (GQA as in the forward)
  float scale;              // softmax scale (natural units; the kernels fold in log2(e))
  // flash_bwd_dkdv_steps / flash_bwd_dq_steps only (the one-rectangle kernels leave them 0 and
  // read blk): every rectangle of a ring step in one launch, laid out as FwdStepParams' lists,
  // grouped by key range (k_start, k_len) for dK/dV and by query range (q_start, q_len) for dQ;
  // within a step two ranges are equal or disjoint, so no two blocks of threads share an output row
  const BlockRect* rects;   // the rectangles, group by group, each group in the step's order
  const int* groups;        // (2 n_groups + 2): as FwdStepParams.groups, tiles of BN keys
                            // (dK/dV) or of BM queries (dQ)
  const int2* row_keys;     // null, or a packed list's key rows of each query row (the dQ
                            // kernels read it; FwdStepParams')
  const int2* key_rows;     // null, or a packed list's query rows of each key row: key row j is
                            // seen only by query rows [key_rows[j].x, key_rows[j].y) (dK/dV)
  int n_groups;
};

// A PACKED list (burstcu/ops/cuda/packing.py) is a step of many small rectangles (the documents
// of a packed sequence) re-cut into tiles: each group is one tile of rows (query rows for
// FwdStepParams and the dQ kernels, key rows for dK/dV) with one rectangle over every row and
// key the tile's rows see and no key bound (hi = lo = NO_BOUND); which pairs are kept comes from
// per-row intervals instead. Every query row i of a step sees one run of key rows,
// [row_keys[i].x, row_keys[i].y) (empty: x == y), and both ends never decrease with i; so every
// key row j is seen by one run of query rows, [key_rows[j].x, key_rows[j].y). A tile of a packed
// list holds pieces of several documents, where the rectangles would run one mostly empty tile
// each. Rows and keys are absolute (indices into the S dim of q and of k); a kernel tests the
// interval of the rows it holds in every tile (its mask path), a pair kept iff both tests pass.

// The group of a rectangle-list launch (FwdStepParams / BwdStepParams: rects, groups, n_groups)
// whose tiles hold `tile` (blockIdx.x): the last group whose first tile is <= tile, found by a
// binary search of the groups' first tiles (groups[n_groups + 1 ..], a prefix sum).
__device__ __forceinline__ int step_group_of(const int* groups, int n_groups, int tile) {
  const int* tile_first = groups + n_groups + 1;
  int lo = 0, hi = n_groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_first[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One rectangle as a dK/dV block of keys [n0, n0 + BN) sees it (flash_bwd.cu, flash_bwd_sm90.cu):
// the Q tiles [m_begin, m_begin + m_tiles * BM) holding a query that sees one of its keys (none:
// `live` false).
// Query i sees key j iff q_pos + i - lo <= k_pos + j <= q_pos + i + hi (int arithmetic:
// positions stay below 2^30 and the bounds at most NO_BOUND = 2^29).
struct QueryTiles {
  BlockRect r;
  int m_begin, m_tiles;
  bool live;
};

template <int BM, int BN>
__device__ __forceinline__ QueryTiles query_tiles(const BlockRect& r, int n0) {
  QueryTiles v;
  v.r = r;
  const int n_last = min(n0 + BN, r.k_len) - 1;
  const int first_q = r.k_pos + n0 - r.hi - r.q_pos;
  v.m_begin = first_q > 0 ? first_q / BM * BM : 0;
  const int m_end = min(r.q_len, r.k_pos + n_last + r.lo - r.q_pos + 1);
  v.live = n0 < r.k_len && v.m_begin < m_end;
  v.m_tiles = (m_end - v.m_begin + BM - 1) / BM;
  return v;
}
